"""Moved to the package mesh.models (catalog, folder, store, pull, gguf)."""
# temporary: removed when the engine/edge imports move

from __future__ import annotations

from mesh.models import *  # noqa: F403
from mesh.models import __all__  # noqa: F401
