"""The edges' shared response cache: opaque values under opaque keys, each with its own TTL, bounded in
bytes (least recently used first).  Pure: callers pass `now`."""

from __future__ import annotations

from collections import OrderedDict

from mesh.errors import InvalidArgument

MAX_VALUE_BYTES = 1 << 20
MAX_TTL_S = 3600.0


class ResponseStore:
    def __init__(self, max_bytes: int = 256 << 20):
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: OrderedDict[bytes, tuple[bytes, float]] = OrderedDict()
        self.hits = self.misses = self.stored = 0

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: bytes, now: float) -> bytes | None:
        item = self._items.get(key)
        if item is None or item[1] <= now:
            if item is not None:
                self._drop(key)
            self.misses += 1
            return None
        self._items.move_to_end(key)
        self.hits += 1
        return item[0]

    def put(self, key: bytes, value: bytes, ttl_s: float, now: float) -> bool:
        if not 16 <= len(key) <= 64:
            raise InvalidArgument("a response key is 16 to 64 bytes")
        if len(value) > MAX_VALUE_BYTES:
            raise InvalidArgument(f"a cached response is at most {MAX_VALUE_BYTES} bytes, got {len(value)}")
        if not 0 < ttl_s <= MAX_TTL_S:
            raise InvalidArgument(f"ttl_s must be in (0, {MAX_TTL_S:g}], got {ttl_s:g}")
        if key in self._items:
            self._drop(key)
        if len(value) > self.max_bytes:
            return False
        self._items[key] = (value, now + ttl_s)
        self.bytes += len(value)
        self.stored += 1
        while self.bytes > self.max_bytes:
            self._drop(next(iter(self._items)))
        return True

    def _drop(self, key: bytes) -> None:
        value, _ = self._items.pop(key)
        self.bytes -= len(value)
