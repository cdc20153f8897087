"""transformers' float32 model of a model folder, the independent reference that the engine's `--dtype float32`
equals token for token, loaded in about a second instead of ~10.

`mesh.models.gguf.load_float32` de-quantizes model.gguf through transformers' GGUF reader at every call. Here
that is done once per GGUF and transformers release: `convert_gguf` (the same reader, saved as float32
safetensors) into `~/.cache/infermesh/test-references/<key>/` (not under $INFERMESH_HOME, which tests point at
temporary folders), where key hashes the file's sha256 and transformers' version; later loads (other tests,
other pytest processes, other clones) read that folder. A file lock lets parallel workers (pytest-xdist) share
one conversion."""

from __future__ import annotations

import fcntl
import hashlib
import shutil
from pathlib import Path
from typing import Any

from mesh import models


def float32_folder(folder: str | Path) -> Path:
    """A float32 Hugging Face folder with the weights transformers reads from `folder`/model.gguf (the folder
    itself where it holds safetensors)."""
    import transformers

    from mesh.models.download import sha256_file
    from mesh.models.gguf import convert_gguf

    folder = Path(folder)
    gguf = folder / "model.gguf"
    if not gguf.is_file():
        return folder
    marker = models.read_marker(folder) if (folder / models.MARKER).is_file() else {}
    sha = marker.get("sha256") or sha256_file(gguf)
    key = hashlib.sha256(f"{sha} {transformers.__version__}".encode()).hexdigest()[:16]
    root = Path.home() / ".cache" / "infermesh" / "test-references"
    target = root / key
    if (target / "config.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "config.json").is_file():
            partial = root / f"{key}.partial"
            shutil.rmtree(partial, ignore_errors=True)
            convert_gguf(gguf, partial)
            partial.rename(target)          # config.json appears with the whole folder
    return target


def load_model(folder: str | Path) -> Any:
    """transformers' float32 model (eval mode) of `folder`, as `load_float32` gives it."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(float32_folder(folder)), dtype=torch.float32).eval()



# (id(model), prompt) -> (tokens, logits of the first, max_new_tokens they were generated with)
_GREEDY: dict[tuple[int, tuple[int, ...]], tuple[list[int], Any, int]] = {}


def greedy(model: Any, ids: list[int], n: int) -> tuple[list[int], Any]:
    """transformers' greedy tokens after `ids` (n, or fewer where it ends the sequence) and the logits of the
    first, with `generate`.  Kept per (model, prompt) for the most tokens asked so far: greedy decoding is
    prefix-consistent, so n tokens are the first n of any longer run."""
    import torch

    key = (id(model), tuple(ids))
    kept = _GREEDY.get(key)
    if kept is None or kept[2] < n:
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
        kept = (out.sequences[0, len(ids):].tolist(), out.logits[0][0].float(), n)
        _GREEDY[key] = kept
    return kept[0][:n], kept[1]
