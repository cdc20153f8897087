"""A Hugging Face model folder as infermesh reads it, without loading it: is it usable, is its
conversion complete (the marker), which ids end a sequence.  Standard library only."""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

from mesh.files import write_atomic
from mesh.models.catalog import SUPPORTED_MODEL_TYPES, ModelError, ModelSpec

# Written last, atomically, into a converted folder: a folder without it is incomplete.
MARKER = "infermesh-model.json"
# Any one of these sets is a usable tokenizer (fast tokenizer, sentencepiece, or byte-level BPE files).
TOKENIZER_FILE_SETS: tuple[tuple[str, ...], ...] = (
    ("tokenizer.json",),
    ("tokenizer.model",),
    ("vocab.json", "merges.txt"),
)


def validate_folder(folder: str | Path) -> Path:
    """Check that `folder` is a Hugging Face Llama-family folder with a tokenizer; return it resolved."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise ModelError(f"{folder} is not a directory")
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ModelError(f"{folder} has no config.json; it is not a Hugging Face model folder")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise ModelError(f"{config_file} is not valid JSON: {exc}") from exc
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelError(
            f"{config_file} has model_type {model_type!r}; supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))}"
        )
    if not any(all((folder / f).is_file() for f in files) for files in TOKENIZER_FILE_SETS):
        wanted = " or ".join(" + ".join(files) for files in TOKENIZER_FILE_SETS)
        raise ModelError(f"{folder} has no tokenizer files (expected {wanted})")
    return folder.resolve()


def eos_token_ids(folder: str | Path) -> frozenset[int]:
    """Every end-of-sequence id a Hugging Face folder declares (config and generation config)."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        file = Path(folder) / name
        if file.exists():
            eos = json.loads(file.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return frozenset(ids)


SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k")


def sampling_defaults(folder: str | Path) -> dict[str, float]:
    """The sampling values the model's generation_config.json sets (temperature, top_p, top_k), for requests
    that leave them unset; `do_sample: false` there means greedy (temperature 0), as transformers reads it."""
    file = Path(folder) / "generation_config.json"
    try:
        config = json.loads(file.read_text()) if file.exists() else {}
    except (OSError, ValueError):
        return {}
    defaults = {name: float(config[name]) for name in SAMPLING_DEFAULTS
                if isinstance(config.get(name), (int, float)) and not isinstance(config.get(name), bool)}
    if config.get("do_sample") is False:
        defaults["temperature"] = 0.0
    return defaults


POOLING_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean"}


def pooling_mode(folder: str | Path) -> str:
    """How the model pools an embedding: its sentence-transformers pooling config (`1_Pooling/config.json`:
    the CLS token, the last token or the mean of the tokens) where it has one, else the mean."""
    file = Path(folder) / "1_Pooling" / "config.json"
    try:
        config = json.loads(file.read_text()) if file.exists() else {}
    except (OSError, ValueError):
        return "mean"
    return next((mode for key, mode in POOLING_MODES.items() if isinstance(config, dict) and config.get(key) is True),
                "mean")


def is_present(folder: str | Path) -> bool:
    """True when `folder` holds a completed conversion (its marker file exists)."""
    return (Path(folder) / MARKER).is_file()


def read_marker(folder: str | Path) -> dict[str, Any] | None:
    try:
        marker = json.loads((Path(folder) / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def write_marker(folder: Path, spec: ModelSpec | tuple[str, str], sha256: str, extra: dict[str, Any]) -> None:
    """Mark `folder` complete: where it came from (a catalog spec, or (name, source) for a local file), the
    source's digest, and the conversion's facts."""
    name, source = (spec.name, spec.source) if isinstance(spec, ModelSpec) else spec
    marker = {
        "name": name,
        "source": source,
        "sha256": sha256,
        "converted_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "format": "huggingface",
        **extra,
    }
    write_atomic(folder / MARKER, json.dumps(marker, indent=2) + "\n")


def _gguf_parameters(file: Path) -> tuple[int, set[str]]:
    """(weights, tensor types) of a GGUF file, from its header (imported here only, as `model inspect` is
    its one caller)."""
    from gguf import GGMLQuantizationType

    from mesh.models.gguf_header import read_header

    tensors = read_header(file).tensors
    return sum(t.n_elements for t in tensors), {GGMLQuantizationType(t.qtype).name for t in tensors}


def describe_folder(folder: str | Path) -> dict[str, Any]:
    """What a folder holds, read from its files without loading a weight: architecture, parameters (from
    the safetensors headers), context, dtype, quantization, chat template, end-of-sequence ids, RoPE and
    sliding window, and where it came from (the conversion marker)."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    params, dtypes = 0, set()
    for file in sorted(folder.glob("*.safetensors")):
        with file.open("rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            count = 1
            for dim in entry["shape"]:
                count *= dim
            params += count
            dtypes.add(entry["dtype"])
    tokenizer_config = folder / "tokenizer_config.json"
    template = (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file() or (
        tokenizer_config.is_file() and bool(json.loads(tokenizer_config.read_text()).get("chat_template")))
    marker = read_marker(folder) or {}
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope and all(isinstance(v, dict) for v in rope.values()):
        rope_text = ", ".join(f"{kind}: {v.get('rope_type', 'default')}" for kind, v in sorted(rope.items()))
    else:
        rope_text = str(rope.get("rope_type", rope.get("type", "default")) if rope else "default")
    quantization = config.get("quantization_config", {}).get("quant_method") if isinstance(
        config.get("quantization_config"), dict) else None
    source = str(marker.get("source", ""))
    gguf_file = folder / "model.gguf"
    if gguf_file.is_file():
        params, dtypes = _gguf_parameters(gguf_file)
        quantization = (f"GGUF tensors {marker.get('gguf_tensor_types') or ', '.join(sorted(dtypes))} (kept as the "
                        "file's blocks in model.gguf)")
    elif not quantization and marker.get("gguf_tensor_types"):
        quantization = (f"GGUF tensors {marker['gguf_tensor_types']} (stored dequantized; the engine re-packs "
                        "4- and 8-bit blocks where that is lossless)")
    elif not quantization and source.lower().endswith(".gguf"):
        quantization = (f"converted from {source.rsplit('/', 1)[-1]} (stored dequantized; the engine re-packs "
                        "4- and 8-bit blocks where that is lossless)")
    return {
        "folder": str(folder.resolve()),
        "architecture": config.get("model_type"),
        "supported": config.get("model_type") in SUPPORTED_MODEL_TYPES,
        "parameters": params,
        "layers": config.get("num_hidden_layers"),
        "hidden_size": config.get("hidden_size"),
        "heads": f"{config.get('num_attention_heads')} query / "
                 f"{config.get('num_key_value_heads', config.get('num_attention_heads'))} kv",
        "context": config.get("max_position_embeddings"),
        "dtype": ", ".join(sorted(dtypes)) or config.get("torch_dtype") or config.get("dtype"),
        "quantization": quantization or "none",
        "rope": rope_text,
        "sliding_window": config.get("sliding_window"),
        "chat_template": template,
        "eos_token_ids": sorted(eos_token_ids(folder)),
        "source": source or "local folder",
    }
