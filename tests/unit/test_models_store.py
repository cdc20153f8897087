"""mesh.models.store: home, the registry, and how a name becomes a folder; no download, no conversion."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mesh.models import MARKER, ModelError, store
from tests.unit.model_folders import hf_folder, store_home  # noqa: F401  (store_home: a fixture)

pytestmark = pytest.mark.usefixtures("store_home")


def test_home_follows_env(store_home: Path, monkeypatch: pytest.MonkeyPatch):  # noqa: F811
    assert store.home() == store_home
    assert store.models_dir() == store_home / "models"
    monkeypatch.delenv("INFERMESH_HOME")
    assert store.home() == Path.home() / ".cache" / "infermesh"


def test_default_is_an_alias(store_home: Path):  # noqa: F811
    with pytest.raises(ModelError, match=r"infermesh model pull smollm2-135m"):
        store.path("default")
    target = store_home / "models" / "smollm2-135m"
    hf_folder(target)
    (target / MARKER).write_text("{}")
    assert store.path("default") == target
    assert store.path("smollm2-135m") == target
    assert store.served_model("default") == ("smollm2-135m", str(target))


def test_unknown_name_says_how_to_pull_and_lists_names():
    with pytest.raises(ModelError) as info:
        store.path("no-such-model")
    message = str(info.value)
    assert "no-such-model" in message
    assert "infermesh model pull NAME" in message
    assert "smollm2-135m" in message and "default" in message


def test_an_existing_hf_folder_is_accepted_as_a_path(tmp_path: Path):
    folder = hf_folder(tmp_path / "some-model")
    assert store.path(str(folder)) == folder.resolve()
    assert store.served_model(str(folder)) == ("some-model", str(folder.resolve()))


def test_a_catalog_model_not_pulled_is_listed_absent(store_home: Path):  # noqa: F811
    hf_folder(store_home / "models" / "smollm2-135m")            # complete-looking files, but no marker
    (entry,) = store.list_models()
    assert (entry["name"], entry["present"]) == ("smollm2-135m", False)
    assert entry["path"] == str(store_home / "models" / "smollm2-135m")


# ---------------------------------------------------------------------------------------- register

def test_register_validates_the_folder_and_the_name(tmp_path: Path):
    with pytest.raises(ModelError, match="not a directory"):
        store.register("mine", tmp_path / "missing")
    with pytest.raises(ModelError,
                       match=r"model_type 'gpt2'; supported: gemma2, gemma3_text, llama, mistral, phi3, qwen2, qwen3"):
        store.register("mine", hf_folder(tmp_path / "gpt2", model_type="gpt2"))
    with pytest.raises(ModelError, match="no tokenizer files"):
        store.register("mine", hf_folder(tmp_path / "notok", tokenizer=()))
    with pytest.raises(ModelError, match="invalid model name"):
        store.register("a/b", hf_folder(tmp_path / "ok"))
    with pytest.raises(ModelError, match="catalog model name"):
        store.register("default", hf_folder(tmp_path / "ok"))
    assert not (store.home() / "registry.json").exists()


@pytest.mark.parametrize("model_type,tokenizer", [
    ("llama", ("tokenizer.json",)),
    ("mistral", ("tokenizer.model",)),
    ("qwen2", ("vocab.json", "merges.txt")),
])
def test_register_then_path_and_list(tmp_path: Path, store_home: Path, model_type, tokenizer):  # noqa: F811
    folder = hf_folder(tmp_path / f"my-{model_type}", model_type=model_type, tokenizer=tokenizer)
    assert store.register("mine", folder) == folder.resolve()
    registry = json.loads((store_home / "registry.json").read_text())
    assert registry["models"]["mine"]["path"] == str(folder.resolve())
    assert store.path("mine") == folder.resolve()
    assert store.served_model("mine") == ("mine", str(folder.resolve()))
    entries = {e["name"]: e for e in store.list_models()}
    assert set(entries) == {"smollm2-135m", "mine"}
    assert entries["mine"]["source"] == "local" and entries["mine"]["present"] is True
    assert entries["smollm2-135m"]["present"] is False
    assert "mine" in str(pytest.raises(ModelError, store.path, "nope").value)


def test_register_keeps_other_names_and_overwrites_same_name(tmp_path: Path, store_home: Path):  # noqa: F811
    a, b = hf_folder(tmp_path / "a"), hf_folder(tmp_path / "b")
    store.register("one", a)
    store.register("two", b)
    store.register("one", b)
    assert store.path("one") == store.path("two") == b.resolve()
    assert sorted(p.name for p in store_home.iterdir() if not p.name.startswith(".")) == ["registry.json"]


def test_registered_folder_that_disappeared(tmp_path: Path):
    folder = hf_folder(tmp_path / "gone")
    store.register("gone", folder)
    (folder / "config.json").unlink()
    with pytest.raises(ModelError, match="register it again"):
        store.path("gone")
    assert next(e for e in store.list_models() if e["name"] == "gone")["present"] is False


def test_a_broken_registry_is_an_error(store_home: Path):  # noqa: F811
    store_home.mkdir(parents=True)
    (store_home / "registry.json").write_text("{not json")
    with pytest.raises(ModelError, match="cannot read"):
        store.load_registry()


def test_served_model_with_explicit_folder(tmp_path: Path):
    folder = hf_folder(tmp_path / "x")
    assert store.served_model(f"custom={folder}") == ("custom", str(folder.resolve()))
    with pytest.raises(ModelError, match="no config.json"):
        store.served_model(f"custom={tmp_path}")
    with pytest.raises(ModelError, match="the name before '=' is empty"):
        store.served_model(f"={folder}")


def test_an_embedding_model_is_one_by_its_folder_or_its_registration(tmp_path: Path):
    plain = hf_folder(tmp_path / "plain")
    sentence = hf_folder(tmp_path / "sentence")
    (sentence / "modules.json").write_text("[]")                  # a sentence-transformers folder
    assert (store.task_of(plain), store.task_of(sentence)) == ("generate", "embed")
    store.register("plain-embed", plain, task="embed")
    store.register("sentence-generate", sentence, task="generate")
    assert (store.task_of(plain), store.task_of(sentence)) == ("embed", "generate")
    assert store.load_registry()["plain-embed"]["task"] == "embed"
    with pytest.raises(ModelError, match="task 'chat' is not one of auto, generate, embed"):
        store.register("x", plain, task="chat")
