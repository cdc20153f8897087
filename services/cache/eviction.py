"""Eviction policies for one cache tier.  Pure: callers pass `now`, a logical clock.

A policy only orders keys; the tier owns the bytes and asks `pop()` for the next victim until
the new block fits.  `now` must never decrease; equal `now`s are ordered by call order, so
every eviction order is deterministic.

- `lru`:    least recently used first.
- `lru2`:   LRU-K with K=2 (O'Neil et al., 1993).  A key's age is its 2nd most recent access;
            keys accessed only once have no 2nd access (an infinite backward distance) and go
            first, oldest last access first; then the key whose 2nd most recent access is oldest
            (ties: older last access).  A burst of blocks put once and never read again cannot
            flush blocks that engines keep reusing (a shared system prompt).
- `tenant`: GreedyDual (Cao and Irani, 1997) with each block's weight from its tenant's SLA class
            (premium=4, standard=2, batch=1 by default; unknown or empty: the `standard` weight).
            A block's credit is H = L + weight, set when it is inserted and on every access; the
            block with the lowest H goes first (ties: least recently used), and L, the tier's
            inflation value, becomes the victim's H.  So an untouched premium block (4) outlives
            the next three batch blocks (1) put after it, but not forever: strict priority would
            let one premium tenant's never-reused blocks starve every batch tenant's hot prefix.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Hashable, Iterator, Mapping

DEFAULT_WEIGHTS: Mapping[str, float] = {"premium": 4.0, "standard": 2.0, "batch": 1.0}


class EvictionPolicy(ABC):
    """The eviction order of one tier's keys.

    Contract: `insert` a key once (it counts as its first access), `touch` it on every later
    access, `remove` it when the tier drops it for another reason; `pop` removes and returns
    the next victim (None when empty), `peek` returns it without removing.
    """

    @abstractmethod
    def insert(self, key: Hashable, now: float, tenant: str = "") -> None: ...

    @abstractmethod
    def touch(self, key: Hashable, now: float) -> None: ...

    @abstractmethod
    def remove(self, key: Hashable) -> None: ...

    @abstractmethod
    def peek(self) -> Hashable | None: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...

    def pop(self) -> Hashable | None:
        key = self.peek()
        if key is not None:
            self.remove(key)
        return key

    def drain(self) -> Iterator[Hashable]:
        """Every key in eviction order, emptying the policy (tests, shutdown)."""
        while (key := self.pop()) is not None:
            yield key


class LRU(EvictionPolicy):
    def __init__(self) -> None:
        self._keys: OrderedDict[Hashable, None] = OrderedDict()

    def insert(self, key: Hashable, now: float, tenant: str = "") -> None:
        self._keys[key] = None
        self._keys.move_to_end(key)

    def touch(self, key: Hashable, now: float) -> None:
        self._keys.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        self._keys.pop(key, None)

    def peek(self) -> Hashable | None:
        return next(iter(self._keys), None)

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys


class _HeapPolicy(EvictionPolicy):
    """A min-heap of (rank..., seq, key) with lazy deletion: a key's live entry is the one whose
    seq matches `_seq[key]`; stale entries are skipped on peek and compacted when they pile up."""

    def __init__(self) -> None:
        self._heap: list[tuple] = []
        self._seq: dict[Hashable, int] = {}
        self._counter = itertools.count()

    def _push(self, key: Hashable, rank: tuple) -> None:
        seq = next(self._counter)
        self._seq[key] = seq
        heapq.heappush(self._heap, (*rank, seq, key))
        if len(self._heap) > 2 * len(self._seq) + 64:
            self._heap = [e for e in self._heap if self._seq.get(e[-1]) == e[-2]]
            heapq.heapify(self._heap)

    def remove(self, key: Hashable) -> None:
        self._seq.pop(key, None)

    def peek(self) -> Hashable | None:
        while self._heap:
            entry = self._heap[0]
            if self._seq.get(entry[-1]) == entry[-2]:
                return entry[-1]
            heapq.heappop(self._heap)
        return None

    def __len__(self) -> int:
        return len(self._seq)

    def __contains__(self, key: object) -> bool:
        return key in self._seq


class LRU2(_HeapPolicy):
    def __init__(self) -> None:
        super().__init__()
        self._last: dict[Hashable, float] = {}

    def insert(self, key: Hashable, now: float, tenant: str = "") -> None:
        self._last[key] = now
        self._push(key, (0, now, now))            # one access: no 2nd most recent, goes first

    def touch(self, key: Hashable, now: float) -> None:
        previous = self._last[key]
        self._last[key] = now
        self._push(key, (1, previous, now))       # rank by the 2nd most recent access

    def remove(self, key: Hashable) -> None:
        super().remove(key)
        self._last.pop(key, None)


class TenantPriority(_HeapPolicy):
    def __init__(self, weights: Mapping[str, float] = DEFAULT_WEIGHTS, default_weight: float | None = None):
        super().__init__()
        if any(w <= 0 for w in weights.values()):
            raise ValueError("tenant weights must be positive")
        self.weights = dict(weights)
        self.default_weight = default_weight if default_weight is not None else self.weights.get("standard", 1.0)
        self.inflation = 0.0                      # L: the last victim's credit
        self._weight: dict[Hashable, float] = {}

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, self.default_weight)

    def insert(self, key: Hashable, now: float, tenant: str = "") -> None:
        self._weight[key] = self.weight(tenant)
        self._push(key, (self.inflation + self._weight[key], now))

    def touch(self, key: Hashable, now: float) -> None:
        self._push(key, (self.inflation + self._weight[key], now))

    def remove(self, key: Hashable) -> None:
        super().remove(key)
        self._weight.pop(key, None)

    def pop(self) -> Hashable | None:
        key = self.peek()
        if key is not None:
            self.inflation = self._heap[0][0]     # only evictions inflate L, never a plain remove
            self.remove(key)
        return key


POLICIES = {"lru": LRU, "lru2": LRU2, "tenant": TenantPriority}


def make_policy(name: str, weights: Mapping[str, float] = DEFAULT_WEIGHTS) -> EvictionPolicy:
    if name == "tenant":
        return TenantPriority(weights)
    if name not in POLICIES:
        raise ValueError(f"unknown eviction policy {name!r} (use one of {', '.join(POLICIES)})")
    return POLICIES[name]()
