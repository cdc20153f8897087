"""A consistent-hash ring: session keys to replica ids, so a change of pool moves few sessions.

Each replica owns `vnodes` points on a 64-bit ring; a key belongs to the first point at or
after its own hash.  Adding a replica takes about 1/(n+1) of the keys, all from the others;
removing one moves only the keys it owned.  blake2b keeps the layout the same in every
process and every run (Python's hash() is salted per process).
"""

from __future__ import annotations

import hashlib
from bisect import bisect_left
from collections.abc import Iterable, Iterator


def _point(data: str) -> int:
    return int.from_bytes(hashlib.blake2b(data.encode(), digest_size=8).digest(), "big")


class HashRing:
    def __init__(self, replica_ids: Iterable[str], vnodes: int = 128):
        if vnodes < 1:
            raise ValueError("vnodes must be at least 1")
        self.replica_ids = frozenset(replica_ids)
        points = sorted((_point(f"{rid}#{v}"), rid) for rid in self.replica_ids for v in range(vnodes))
        self._hashes = [h for h, _ in points]
        self._owners = [rid for _, rid in points]

    def owner(self, key: str) -> str:
        return next(self.walk(key))

    def walk(self, key: str) -> Iterator[str]:
        """Distinct replica ids clockwise from `key`'s point: the owner first, then the fallbacks."""
        if not self._owners:
            return
        start = bisect_left(self._hashes, _point(key)) % len(self._hashes)
        seen: set[str] = set()
        for i in range(len(self._owners)):
            rid = self._owners[(start + i) % len(self._owners)]
            if rid not in seen:
                seen.add(rid)
                yield rid
                if len(seen) == len(self.replica_ids):
                    return
