"""The cache service's stored objects (services/cache/objects.py): by tenant, kind and id, with a time to
live and a byte budget, and brought back from their journal after a restart."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mesh.errors import InvalidArgument, ResourceExhausted
from services.cache.objects import FILE, MAX_VALUE_BYTES, ObjectStore


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def test_a_tenants_objects_are_its_own_and_expire() -> None:
    clock = Clock()
    store = ObjectStore(clock=clock)
    store.put(("t:a", "response", "resp_1"), b"one", 60)
    assert store.get(("t:a", "response", "resp_1")) == b"one"
    assert store.get(("t:b", "response", "resp_1")) is None            # another tenant's id
    clock.now += 61
    assert store.get(("t:a", "response", "resp_1")) is None and store.bytes == 0
    store.put(("t:a", "response", "resp_2"), b"two", 60)
    assert store.delete(("t:a", "response", "resp_2")) and not store.delete(("t:a", "response", "resp_2"))


def test_one_tenant_keeps_at_most_its_share() -> None:
    store = ObjectStore(max_bytes=100, tenant_share=0.25)
    store.put(("t:a", "response", "1"), b"x" * 20, 60)
    with pytest.raises(ResourceExhausted, match="this tenant's stored objects hold 20 of the 25 bytes"):
        store.put(("t:a", "response", "2"), b"x" * 6, 60)
    store.put(("t:b", "response", "1"), b"x" * 25, 60)                  # another tenant's share is its own
    store.delete(("t:a", "response", "1"))
    store.put(("t:a", "response", "2"), b"x" * 25, 60)
    assert store.tenant_bytes == {"t:a": 25, "t:b": 25} and store.bytes == 50


def test_keys_of_a_kind_by_tenant_or_all() -> None:
    clock = Clock()
    store = ObjectStore(clock=clock)
    store.put(("t:b", "batch", "batch_2"), b"x", 60)
    store.put(("t:a", "batch", "batch_1"), b"x", 60)
    store.put(("t:a", "file", "file-1"), b"x", 60)
    store.put(("t:a", "batch", "batch_3"), b"x", 10)
    assert store.keys("t:a", "batch") == [("t:a", "batch", "batch_1"), ("t:a", "batch", "batch_3")]
    clock.now += 11
    assert store.keys(None, "batch") == [("t:a", "batch", "batch_1"), ("t:b", "batch", "batch_2")]
    with pytest.raises(InvalidArgument, match="not one of"):
        store.keys("t:a", "nope")


def test_limits_are_refused_precisely() -> None:
    store = ObjectStore(max_bytes=10, tenant_share=1.0)
    with pytest.raises(InvalidArgument, match="kind 'files' is not one of response, file, batch"):
        store.put(("t", "files", "x"), b"v", 60)
    with pytest.raises(InvalidArgument, match="ttl_s 0 must be above 0"):
        store.put(("t", "response", "x"), b"v", 0)
    with pytest.raises(InvalidArgument, match="at most"):
        store.put(("t", "response", "x"), b"v" * (MAX_VALUE_BYTES + 1), 60)
    with pytest.raises(InvalidArgument, match="id is 1 to 128"):
        store.get(("t", "response", ""))
    store.put(("t", "response", "a"), b"12345678", 60)
    with pytest.raises(ResourceExhausted, match="the object store holds 8 of its 10 bytes"):
        store.put(("u", "response", "b"), b"123", 60)
    store.put(("t", "response", "a"), b"1234567890", 60)                # a replacement counts its own size once


def test_the_journal_brings_back_what_was_live(tmp_path: Path) -> None:
    clock = Clock()
    store = ObjectStore(tmp_path, clock=clock)
    store.put(("t", "response", "kept"), b"\x00binary\xff", 3600)
    store.put(("t", "response", "short"), b"x", 10)
    store.put(("t", "response", "gone"), b"y", 3600)
    store.delete(("t", "response", "gone"))
    store.close()                                    # as after kill -9: every line was flushed
    with (tmp_path / FILE).open("a") as f:
        f.write('{"k": ["t", "resp')                 # a torn last line
    clock.now += 60
    again = ObjectStore(tmp_path, clock=clock)
    assert again.get(("t", "response", "kept")) == b"\x00binary\xff"
    assert again.get(("t", "response", "short")) is None and again.get(("t", "response", "gone")) is None
    assert len(again) == 1 and again.bytes == len(b"\x00binary\xff") == again.tenant_bytes["t"]
    lines = (tmp_path / FILE).read_text().splitlines()          # rewritten with the live object alone
    assert len(lines) == 1 and json.loads(lines[0])["k"] == ["t", "response", "kept"]
