"""What the edges keep for the API (stored Responses API responses, files, batches): a tenant's values by kind and id,
each with a time to live on the wall clock, bounded in bytes.

With a folder (the embedded session store's --sessions-dir) every change is a JSON line appended to
`objects.jsonl` before the RPC answers, replayed at start (expired values left out) and rewritten compacted
when it holds more than twice what is live, as the session journal is (services/cache/journal.py).  Without
one the values live in memory only.  Lines: {"k": [tenant, kind, id], "e": expires unix seconds, "v": base64}
or {"k": [...], "d": 1}.  A line that does not parse (a torn last line) is skipped with a warning.
"""

from __future__ import annotations

import base64
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

from mesh.errors import InvalidArgument, ResourceExhausted
from mesh.files import write_atomic

log = logging.getLogger(__name__)

FILE = "objects.jsonl"
KINDS = ("response", "file", "batch")
MAX_LISTED = 10_000
MAX_VALUE_BYTES = 4 << 20
MAX_TTL_S = 30 * 86400.0
MAX_ID_CHARS = 128
_SLACK_LINES = 1000

Key = tuple[str, str, str]


class ObjectStore:
    def __init__(self, folder: str | Path | None = None, max_bytes: int = 256 << 20, tenant_share: float = 0.25,
                 clock: Callable[[], float] = time.time):
        """`tenant_share`: the part of `max_bytes` one tenant may hold, so no tenant fills the store for all."""
        self.clock = clock
        self.max_bytes = max_bytes
        self.max_tenant_bytes = int(max_bytes * tenant_share)
        self.bytes = 0
        self.tenant_bytes: dict[str, int] = {}
        self._items: dict[Key, tuple[bytes, float]] = {}
        self.path = Path(folder) / FILE if folder else None
        self._file: IO[str] | None = None
        self._lines = 0
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._load()

    def __len__(self) -> int:
        return len(self._items)

    @staticmethod
    def check(key: Key) -> None:
        tenant, kind, oid = key
        if kind not in KINDS:
            raise InvalidArgument(f"kind {kind[:32]!r} is not one of {', '.join(KINDS)}")
        if not 0 < len(oid) <= MAX_ID_CHARS or len(tenant) > 256:
            raise InvalidArgument(f"an object's id is 1 to {MAX_ID_CHARS} characters, its tenant at most 256")

    def get(self, key: Key) -> bytes | None:
        self.check(key)
        item = self._items.get(key)
        if item is None or item[1] <= self.clock():
            if item is not None:
                self._drop(key, journal=False)      # expired: a replay leaves it out anyway
            return None
        return item[0]

    def put(self, key: Key, value: bytes, ttl_s: float) -> None:
        self.check(key)
        if len(value) > MAX_VALUE_BYTES:
            raise InvalidArgument(f"the value is {len(value)} bytes; at most {MAX_VALUE_BYTES}")
        if not 0 < ttl_s <= MAX_TTL_S:
            raise InvalidArgument(f"ttl_s {ttl_s:g} must be above 0 and at most {MAX_TTL_S:g}")
        self._expire()
        old = self._items.get(key)
        before = len(old[0]) if old else 0
        held = self.tenant_bytes.get(key[0], 0)
        if held - before + len(value) > self.max_tenant_bytes:
            raise ResourceExhausted(f"this tenant's stored objects hold {held} of the {self.max_tenant_bytes} bytes "
                                    "it may keep; delete some (DELETE /v1/responses/ID) or store less")
        if self.bytes - before + len(value) > self.max_bytes:
            raise ResourceExhausted(f"the object store holds {self.bytes} of its {self.max_bytes} bytes; "
                                    "delete stored objects or retry later")
        expires = self.clock() + ttl_s
        self._account(key, len(value) - before)
        self._items[key] = (value, expires)
        self._write({"k": list(key), "e": round(expires, 3), "v": base64.b64encode(value).decode("ascii")})

    def keys(self, tenant: str | None, kind: str) -> list[Key]:
        """The live keys of `kind`: `tenant`'s, or every tenant's (None); at most MAX_LISTED, by id."""
        self.check((tenant or "", kind, "-"))
        now = self.clock()
        found = sorted((k for k, (_, expires) in self._items.items()
                        if k[1] == kind and (tenant is None or k[0] == tenant) and expires > now),
                       key=lambda k: (k[2], k[0]))
        return found[:MAX_LISTED]

    def delete(self, key: Key) -> bool:
        self.check(key)
        found = self.get(key) is not None
        if found:
            self._drop(key, journal=True)
        return found

    def _account(self, key: Key, change: int) -> None:
        self.bytes += change
        held = self.tenant_bytes.get(key[0], 0) + change
        if held:
            self.tenant_bytes[key[0]] = held
        else:
            self.tenant_bytes.pop(key[0], None)

    def _drop(self, key: Key, journal: bool) -> None:
        value, _ = self._items.pop(key)
        self._account(key, -len(value))
        if journal:
            self._write({"k": list(key), "d": 1})

    def _expire(self) -> None:
        now = self.clock()
        for key in [k for k, (_, expires) in self._items.items() if expires <= now]:
            self._drop(key, journal=False)

    # -- the journal ------------------------------------------------------------------------------
    def _load(self) -> None:
        assert self.path is not None
        if self.path.exists():
            with self.path.open(encoding="utf-8") as f:
                for number, raw in enumerate(f, 1):
                    try:
                        record = json.loads(raw)
                        key: Key = tuple(record["k"])          # type: ignore[assignment]
                        if record.get("d"):
                            if key in self._items:
                                self._drop(key, journal=False)
                            continue
                        value = base64.b64decode(record["v"])
                        old = self._items.get(key)
                        self._account(key, len(value) - (len(old[0]) if old else 0))
                        self._items[key] = (value, float(record["e"]))
                    except (ValueError, TypeError, KeyError) as exc:
                        log.warning("%s line %d skipped (%s)", self.path, number, exc)
        self._expire()
        self._rewrite()

    def _rewrite(self) -> None:
        assert self.path is not None
        if self._file is not None:
            self._file.close()
        lines = [json.dumps({"k": list(k), "e": round(e, 3), "v": base64.b64encode(v).decode("ascii")}) + "\n"
                 for k, (v, e) in self._items.items()]
        write_atomic(self.path, "".join(lines), mode=0o600)
        self._file = self.path.open("a", encoding="utf-8")
        self._lines = len(lines)

    def _write(self, record: dict[str, object]) -> None:
        if self._file is None:
            return
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._file.flush()
        self._lines += 1
        if self._lines > 2 * len(self._items) + _SLACK_LINES:
            self._rewrite()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
