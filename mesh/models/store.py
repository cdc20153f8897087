"""Where infermesh keeps its models, and how a name becomes a folder.

Layout under `home()` (`$INFERMESH_HOME`, else `~/.cache/infermesh`):

    models/<name>/            a pulled catalog model: a plain Hugging Face folder
    models/<name>/infermesh-model.json
                              the marker (mesh/models/folder.py): a folder without it is incomplete
    registry.json             local folders registered under a name

A name is a catalog model (or its alias), a registered name, or a Hugging Face folder's path.
"""

from __future__ import annotations

import datetime
import json
import os
import re
from pathlib import Path
from typing import Any

from mesh.files import exclusive_lock, write_atomic
from mesh.models.catalog import ALIASES, CATALOG, ModelError, canonical
from mesh.models.folder import is_present, validate_folder

REGISTRY = "registry.json"
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def home() -> Path:
    """`$INFERMESH_HOME`, else `~/.cache/infermesh`: models, registry, TLS certificates, tuned plans (the
    built kernels are kept apart: meshkernels/cpu_ops.py)."""
    env = os.environ.get("INFERMESH_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "infermesh"


def models_dir() -> Path:
    return home() / "models"


# ------------------------------------------------------------------------------------------ registry

def _registry_path() -> Path:
    return home() / REGISTRY


def load_registry() -> dict[str, dict[str, Any]]:
    """Registered name -> {"path", "registered_at"}; empty when nothing was ever registered."""
    try:
        data = json.loads(_registry_path().read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot read {_registry_path()}: {exc}") from exc
    models = data.get("models", {}) if isinstance(data, dict) else {}
    return {k: v for k, v in models.items() if isinstance(v, dict) and "path" in v}


TASKS = ("auto", "generate", "embed")


def register(name: str, folder: str | Path, task: str = "auto") -> Path:
    """Register a local Hugging Face Llama-family folder under `name`; return the resolved folder.  `task`
    "embed": an embedding model, which serves embeddings only (task_of); "auto": decided by the folder."""
    if task not in TASKS:
        raise ModelError(f"task {task!r} is not one of {', '.join(TASKS)}")
    name = name.strip()
    if not _NAME_RE.fullmatch(name):
        raise ModelError(f"invalid model name {name!r}: use letters, digits, '.', '_' and '-'")
    if name in CATALOG or name in ALIASES:
        raise ModelError(f"{name!r} is a catalog model name; register the folder under another name")
    resolved = validate_folder(folder)
    with exclusive_lock(home() / f".{REGISTRY}.lock"):
        registry = load_registry()
        registry[name] = {
            "path": str(resolved),
            "registered_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            **({"task": task} if task != "auto" else {}),
        }
        write_atomic(_registry_path(), json.dumps({"version": 1, "models": registry}, indent=2) + "\n")
    return resolved


def task_of(folder: str | Path) -> str:
    """"embed" for an embedding model (registered with task embed, or, registered without one, a
    sentence-transformers folder: its `modules.json`), else "generate"."""
    resolved = Path(folder).resolve()
    for entry in load_registry().values():
        if Path(entry["path"]).resolve() == resolved and entry.get("task") in ("generate", "embed"):
            return str(entry["task"])
    return "embed" if (resolved / "modules.json").is_file() else "generate"


# ------------------------------------------------------------------------------------------- lookups

def _known_hint() -> str:
    return "known models: " + ", ".join(sorted(set(CATALOG) | set(ALIASES) | set(load_registry())))


def path(name: str) -> Path:
    """The folder of a pulled catalog model, a registered model, or an existing Hugging Face folder."""
    key = canonical(name)
    spec = CATALOG.get(key)
    if spec is not None:
        target = models_dir() / spec.name
        if is_present(target):
            return target
        raise ModelError(
            f"model {key!r} has not been pulled yet; run `infermesh model pull {key}` ({_known_hint()})"
        )
    entry = load_registry().get(key)
    if entry is not None:
        folder = Path(entry["path"])
        if not (folder / "config.json").is_file():
            raise ModelError(f"model {key!r} is registered at {folder}, but that folder has no config.json "
                             f"any more; register it again with `infermesh model register {key} FOLDER`")
        return folder
    candidate = Path(name).expanduser()
    if candidate.is_dir() and (candidate / "config.json").is_file():
        return candidate.resolve()
    raise ModelError(f"unknown model {name!r}; run `infermesh model pull NAME` for a catalog model, "
                     f"or `infermesh model register NAME FOLDER` for a local one ({_known_hint()})")


def served_model(spec: str) -> tuple[str, str]:
    """`NAME` or `NAME=FOLDER` (as given to `--model`) -> (served name, folder)."""
    if "=" in spec:
        name, folder = (part.strip() for part in spec.split("=", 1))
        if not name:
            raise ModelError(f"--model {spec!r}: the name before '=' is empty")
        return canonical(name), str(validate_folder(folder))
    resolved = path(spec)
    key = canonical(spec)
    if key in CATALOG or key in load_registry():
        return key, str(resolved)
    return resolved.name, str(resolved)  # a bare folder path: serve it under its folder name


def list_models() -> list[dict[str, Any]]:
    """Every catalog and registered model: name, source, present, path (and a description)."""
    entries: list[dict[str, Any]] = []
    for spec in CATALOG.values():
        target = models_dir() / spec.name
        entries.append({"name": spec.name, "source": spec.source, "present": is_present(target),
                        "path": str(target), "description": spec.description})
    for name, entry in sorted(load_registry().items()):
        folder = Path(entry["path"])
        entries.append({"name": name, "source": "local", "present": (folder / "config.json").is_file(),
                        "path": str(folder), "description": "registered local folder"})
    return entries
