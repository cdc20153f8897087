"""mesh.files: atomic replacement (modes, chunks, nothing left on failure) and the exclusive lock."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from mesh.files import exclusive_lock, write_atomic


def test_write_replaces_whole_files_with_the_mode_asked(tmp_path: Path):
    target = tmp_path / "sub" / "a.json"
    write_atomic(target, "one")
    assert target.read_text() == "one" and oct(target.stat().st_mode & 0o777) == "0o644"
    write_atomic(target, b"two", mode=0o600)
    assert target.read_bytes() == b"two" and oct(target.stat().st_mode & 0o777) == "0o600"
    write_atomic(target, [b"head-", memoryview(b"payload")])         # chunks are written in order
    assert target.read_bytes() == b"head-payload"
    assert sorted(p.name for p in target.parent.iterdir()) == ["a.json"]   # no temp file left


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temp(tmp_path: Path):
    target = tmp_path / "a.txt"
    write_atomic(target, "old")

    def chunks():
        yield b"new, but "
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        write_atomic(target, chunks())
    assert target.read_text() == "old"
    assert os.listdir(tmp_path) == ["a.txt"]


def test_the_lock_is_exclusive(tmp_path: Path):
    lock = tmp_path / "deep" / ".x.lock"
    order: list[str] = []

    def other() -> None:
        with exclusive_lock(lock):
            order.append("other")

    with exclusive_lock(lock):
        thread = threading.Thread(target=other)
        thread.start()
        order.append("first")           # the other thread cannot have the lock before this
    thread.join(5)
    assert order == ["first", "other"]

