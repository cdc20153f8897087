"""Files other processes read while we write them: atomic replacement and an exclusive lock.

Standard library only: mesh.models (imported by the CLI, which must start fast) uses it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# Every temp file write_atomic makes ends so: a startup scan may delete what a crash left.
TMP_SUFFIX = ".tmp"


def write_atomic(target: str | os.PathLike[str], data: str | bytes | Iterable[bytes], mode: int = 0o644) -> None:
    """Replace `target` with `data` so that a reader, or a crash, sees the old file or the whole new
    one, never a part: the data goes to a temp file in the same folder (a rename is atomic only within
    one file system), is fsynced, gets `mode`, and is renamed over `target`.

    `data` may be several byte chunks (a header and a large payload) so they need not be joined.  The
    temp file, `.<name>.<random>.tmp`, is created 0600, so a secret (`mode=0o600`) is never readable by
    others, not even briefly; on any error it is removed.  The parent folder is created if missing."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    chunks = (data,) if isinstance(data, bytes) else data
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=TMP_SUFFIX)
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def exclusive_lock(lock_file: str | os.PathLike[str]) -> Iterator[None]:
    """Hold an exclusive lock on `lock_file` (created if missing) for the block: two processes never
    do the locked work (pull one model, rewrite one registry) at once.  No locking where not POSIX."""
    lock_file = Path(lock_file)
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(lock_file, "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


class WatchedFile:
    """A settings file read again when its modification time or size changes (`refresh`); a version that
    does not parse is logged and the last good value kept."""

    def __init__(self, path: str, parse: Callable[[str], Any]):
        self.path, self.parse = path, parse
        self.stamp: tuple[int, int] | None = None
        self.value = self._read()

    def _stat(self) -> tuple[int, int]:
        st = os.stat(self.path)
        return (st.st_mtime_ns, st.st_size)

    def _read(self) -> Any:
        self.stamp = self._stat()
        return self.parse(Path(self.path).read_text())

    def refresh(self) -> bool:
        """True when the file changed and was read again."""
        try:
            if self._stat() == self.stamp:
                return False
            self.value = self._read()
            log.info("%s reloaded", self.path)
            return True
        except (OSError, ValueError) as exc:
            log.error("%s not reloaded, the last good version stays: %s", self.path, exc)
            return False
