"""mesh.models.folder: what makes a Hugging Face folder usable, the completion marker, eos ids."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mesh.models import MARKER, ModelError, folder
from tests.unit.model_folders import fake_spec, hf_folder


def test_validate_names_what_is_missing(tmp_path: Path):
    with pytest.raises(ModelError, match="not a directory"):
        folder.validate_folder(tmp_path / "missing")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelError, match="no config.json"):
        folder.validate_folder(empty)
    (empty / "config.json").write_text("{not json")
    with pytest.raises(ModelError, match="not valid JSON"):
        folder.validate_folder(empty)
    with pytest.raises(ModelError,
                       match=r"model_type 'gpt2'; supported: gemma2, gemma3_text, llama, mistral, phi3, qwen2, qwen3"):
        folder.validate_folder(hf_folder(tmp_path / "gpt2", model_type="gpt2"))
    with pytest.raises(ModelError, match="no tokenizer files"):
        folder.validate_folder(hf_folder(tmp_path / "notok", tokenizer=()))
    with pytest.raises(ModelError, match="no tokenizer files"):  # half of a vocab.json + merges.txt pair
        folder.validate_folder(hf_folder(tmp_path / "half", tokenizer=("vocab.json",)))


@pytest.mark.parametrize("model_type,tokenizer", [
    ("llama", ("tokenizer.json",)),
    ("mistral", ("tokenizer.model",)),
    ("qwen2", ("vocab.json", "merges.txt")),
])
def test_validate_accepts_every_supported_type_and_tokenizer(tmp_path: Path, model_type, tokenizer):
    found = hf_folder(tmp_path / "m", model_type=model_type, tokenizer=tokenizer)
    assert folder.validate_folder(found) == found.resolve()


def test_marker_is_written_atomically(tmp_path: Path):
    spec = fake_spec(b"x")
    assert not folder.is_present(tmp_path)
    folder.write_marker(tmp_path, spec, spec.sha256, {"loader": "fake"})
    assert sorted(p.name for p in tmp_path.iterdir()) == [MARKER]  # no temp file left
    assert folder.is_present(tmp_path)
    marker = folder.read_marker(tmp_path)
    assert marker is not None
    assert (marker["sha256"], marker["source"], marker["loader"]) == (spec.sha256, spec.source, "fake")
    assert folder.read_marker(tmp_path / "missing") is None


def test_eos_ids_from_config_and_generation_config(tmp_path: Path):
    assert folder.eos_token_ids(tmp_path) == frozenset()
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert folder.eos_token_ids(tmp_path) == frozenset({2})
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert folder.eos_token_ids(tmp_path) == frozenset({2, 7})
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": None}))
    assert folder.eos_token_ids(tmp_path) == frozenset({2, 7})


def test_sampling_defaults_come_from_the_generation_config(tmp_path: Path) -> None:
    from mesh.models import sampling_defaults

    assert sampling_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.9, "top_k": 20,
                                                                 "do_sample": True, "eos_token_id": 2}))
    assert sampling_defaults(tmp_path) == {"temperature": 0.6, "top_p": 0.9, "top_k": 20.0}
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False, "top_p": True}))
    assert sampling_defaults(tmp_path) == {"temperature": 0.0}          # greedy, as transformers reads it
    (tmp_path / "generation_config.json").write_text("{not json")
    assert sampling_defaults(tmp_path) == {}


def test_the_engine_applies_them_only_to_fields_left_unset() -> None:
    from mesh.errors import InvalidArgument
    from meshpb.v1 import common_pb2
    from services.engine.rpcs.server import sampling_from_pb

    defaults = {"temperature": 0.6, "top_k": 20.0}
    unset = common_pb2.SamplingParams(temperature=1.0, top_p=1.0, model_defaults=["temperature", "top_p", "top_k"])
    got = sampling_from_pb(unset, defaults)
    assert (got.temperature, got.top_p, got.top_k) == (0.6, 1.0, 20)       # top_p: the model sets none
    given = common_pb2.SamplingParams(temperature=0.0, top_k=5, model_defaults=["top_p"])
    got = sampling_from_pb(given, defaults)
    assert (got.temperature, got.top_k) == (0.0, 5)
    with pytest.raises(InvalidArgument, match="model_defaults names seed"):
        sampling_from_pb(common_pb2.SamplingParams(model_defaults=["seed"]), defaults)
