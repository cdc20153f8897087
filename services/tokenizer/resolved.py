"""What transformers makes of a model folder's tokenizer files, kept so that the tokenizer service starts
without importing transformers (and torch, which transformers imports): ~0.5 s of CPU a start instead of ~4.5 s.

transformers' `AutoTokenizer` decides three things from a folder's files: the `tokenizers` backend (read from
tokenizer.json, rebuilt by a model's tokenizer class, or converted from tokenizer.model / vocab.json +
merges.txt; special tokens named in tokenizer_config.json added), the chat template(s), and the named special
tokens a template sees (`bos_token`, `eos_token`, ...).  `resolve(folder)` returns those three.  The first time
a set of files is seen it asks transformers and keeps the answer in the cache, keyed by the files' contents and
transformers' version, so a folder holding the same files (a copy, a test's folder) starts from the cache too.

The cache: `$INFERMESH_TOKENIZER_CACHE`, else `~/.cache/infermesh/tokenizers` (a cache of the machine, like the
built kernels: not under `$INFERMESH_HOME`).  A missing, partial or unreadable entry is resolved again."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from mesh.files import write_atomic

log = logging.getLogger(__name__)

FORMAT = 1
# A folder's files that AutoTokenizer may read (config.json: the model type and tokenizer class it goes by).
SOURCE_SUFFIXES = (".json", ".jinja", ".model", ".txt", ".tiktoken")
SOURCE_FOLDERS = ("additional_chat_templates",)
# Written by infermesh beside the model (when it was pulled, from where): no part of the tokenizer.
NOT_SOURCES = frozenset({"infermesh-model.json", "model.safetensors.index.json"})


@dataclass(frozen=True)
class Resolved:
    backend_json: str                         # the `tokenizers.Tokenizer`, serialized
    chat_template: str | dict[str, str] | None
    special_tokens: dict[str, str]            # transformers' `special_tokens_map`: bos_token, eos_token, ...


def cache_root() -> Path:
    env = os.environ.get("INFERMESH_TOKENIZER_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "infermesh" / "tokenizers"


def resolve(folder: str | Path) -> Resolved:
    folder = Path(folder)
    entry = cache_root() / cache_key(folder)
    try:
        return read(entry)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    resolved = from_transformers(folder)
    try:
        write(entry, resolved)
    except OSError as exc:
        log.warning("could not keep %s's resolved tokenizer in %s (%s); the next start resolves it again",
                    folder, entry.parent, exc)
    return resolved


def cache_key(folder: Path) -> str:
    digest = hashlib.sha256(f"{FORMAT}\0{_transformers_version()}\0".encode())
    for file in sources(folder):
        data = file.read_bytes()
        digest.update(f"{file.relative_to(folder)}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()[:32]


def sources(folder: Path) -> list[Path]:
    files = [f for f in folder.iterdir() if f.is_file() and f.suffix in SOURCE_SUFFIXES and f.name not in NOT_SOURCES]
    for sub in SOURCE_FOLDERS:
        if (folder / sub).is_dir():
            files += [f for f in (folder / sub).iterdir() if f.is_file()]
    return sorted(files)


def from_transformers(folder: Path) -> Resolved:
    from transformers import AutoTokenizer

    hf: Any = AutoTokenizer.from_pretrained(str(folder))
    template = hf.chat_template
    return Resolved(backend_json=hf.backend_tokenizer.to_str(),
                    chat_template=dict(template) if isinstance(template, dict) else template,
                    special_tokens={k: str(v) for k, v in hf.special_tokens_map.items()})


def read(entry: Path) -> Resolved:
    """The entry's two files: `meta.json` (written last, so its presence says the entry is whole) and
    `tokenizer.json`."""
    meta = json.loads((entry / "meta.json").read_text())
    if meta["format"] != FORMAT:
        raise ValueError(f"format {meta['format']}")
    template = meta["chat_template"]
    if not (template is None or isinstance(template, str) or (
            isinstance(template, dict) and all(isinstance(v, str) for v in template.values()))):
        raise TypeError("chat_template")
    special = {str(k): str(v) for k, v in meta["special_tokens"].items()}
    return Resolved((entry / "tokenizer.json").read_text(), template, special)


def write(entry: Path, resolved: Resolved) -> None:
    write_atomic(entry / "tokenizer.json", resolved.backend_json)
    write_atomic(entry / "meta.json", json.dumps({
        "format": FORMAT, "transformers": _transformers_version(), "chat_template": resolved.chat_template,
        "special_tokens": resolved.special_tokens}, ensure_ascii=False, indent=1))


def _transformers_version() -> str:
    try:
        return metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return "none"
