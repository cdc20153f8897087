"""Giving freed heap memory back to the system.

glibc keeps what a process frees in its arenas for the next allocation; after a one-off peak (a
grammar's compile, a model version's weights released after a hot swap) the process would hold that
peak for good.  `trim_heap` asks glibc to return every free page (malloc_trim(0)); on another C
library it does nothing.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim   # type: ignore[no-any-return]
    except (OSError, AttributeError):      # not glibc: the heap stays as the allocator leaves it
        return None


def trim_heap() -> None:
    """Return the heap's free pages to the system (glibc); a no-op elsewhere."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
