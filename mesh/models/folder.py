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


def is_present(folder: str | Path) -> bool:
    """True when `folder` holds a completed conversion (its marker file exists)."""
    return (Path(folder) / MARKER).is_file()


def read_marker(folder: str | Path) -> dict[str, Any] | None:
    try:
        marker = json.loads((Path(folder) / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def write_marker(folder: Path, spec: ModelSpec, sha256: str, extra: dict[str, Any]) -> None:
    """Mark `folder` complete: where it came from, the source's digest, and the conversion's facts."""
    marker = {
        "name": spec.name,
        "source": spec.source,
        "sha256": sha256,
        "converted_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "format": "huggingface",
        **extra,
    }
    write_atomic(folder / MARKER, json.dumps(marker, indent=2) + "\n")
