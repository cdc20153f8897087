"""Where each prompt prefix was last sent: block hash -> replica id, bounded, least recently used out.

The router cannot see the engines' caches; it remembers where it routed each prefix, which
is where that prefix's KV blocks were computed and, until evicted there, still are.  Block
hashes are chained (mesh/prefix.py), so one hash stands for the whole prefix up to it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence


class PrefixMap:
    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self._where: OrderedDict[bytes, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._where)

    def record(self, hashes: Sequence[bytes], replica_id: str) -> None:
        """The prompt with these block hashes was sent to `replica_id`; its blocks now live there.

        A later record of the same hash moves it: the newest copy is the likeliest still cached."""
        for h in hashes:
            self._where[h] = replica_id
            self._where.move_to_end(h)
        while len(self._where) > self.capacity:
            self._where.popitem(last=False)

    def matches(self, hashes: Sequence[bytes]) -> Iterator[tuple[str, int]]:
        """(replica id, matched blocks) for each known prefix of `hashes`, longest first."""
        for i in range(len(hashes) - 1, -1, -1):
            rid = self._where.get(hashes[i])
            if rid is not None:
                yield rid, i + 1

    def forget(self, replica_id: str) -> int:
        """Drop a departed replica's entries; returns how many.  O(size): for rare events only."""
        stale = [h for h, rid in self._where.items() if rid == replica_id]
        for h in stale:
            del self._where[h]
        return len(stale)
