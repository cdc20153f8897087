"""Batch lines as a class of their own at the edge: their places in flight, and the token budget they draw on.

- Places (`BatchPlaces`): a batch line (services/edge/batch/lines.py) takes one of the edge's batch places
  before it enters its route, and never one of the interactive in-flight places (Admission.in_flight,
  --max-concurrent): interactive requests are never refused for want of room a batch holds.  Batch lines
  together hold at most `--batch-share` of --max-concurrent (default 1/4: 64 of 256), one tenant's at most
  `--batch-tenant-share` of those (default 1/2), and a line takes a place only while interactive requests
  leave one free (interactive in flight + batch lines in flight < --max-concurrent), so batches give way to
  interactive load.  A line with no place WAITS for one (it is not refused); when a place frees, the waiting
  tenant holding the fewest places gets it (tenants take turns; a tenant's own lines in arrival order).
- Budget (`BatchLineCaller.budget`): a line's tokens are reserved from the same token bucket as the
  interactive requests of the caller that created the batch (its API key's, its JWT's tenant and subject's,
  its address's), so a tenant out of tokens cannot run the same request as a batch line at once.  The bucket
  is saved with the batch as a name that is not a secret (`budget_name`: a key's is its tenant id,
  tenant_of in mesh/apikeys.py) and found again by the edge that runs the batch (`budget_bucket`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
from collections import deque
from collections.abc import Hashable, Iterable
from typing import Any

from mesh.apikeys import tenant_of
from mesh.ratelimit import InFlight
from services.edge.gateway.tenants import AuthenticatedCaller

POLL_S = 0.05           # how often waiting lines look again for room interactive requests left (they do not tell)


@dataclasses.dataclass(frozen=True)
class BatchLineCaller(AuthenticatedCaller):
    """The caller a batch line runs as: `bucket` keys its request rate (a bucket per tenant for batch work),
    `budget` the token bucket it reserves from (the batch creator's interactive one)."""

    budget: Hashable = None


def budget_name(caller: AuthenticatedCaller) -> list[str]:
    """The caller's token bucket as a JSON-able name kept in a batch's record (never the key or its digest)."""
    bucket = caller.bucket
    if isinstance(bucket, bytes):
        return ["key", tenant_of(bucket)]
    if isinstance(bucket, tuple) and len(bucket) == 3 and bucket[0] == "jwt":
        return ["jwt", str(bucket[1]), str(bucket[2])]
    if isinstance(bucket, str):
        return ["addr", bucket]
    return ["tenant", caller.tenant]


def budget_bucket(name: Any, tenant: str, key_digests: Iterable[bytes]) -> Hashable:
    """The token bucket `budget_name` named; a key no longer configured, or a batch saved before budgets were
    kept, draws on a bucket of the tenant's batches."""
    if isinstance(name, list) and len(name) == 2 and name[0] == "key":
        for d in key_digests:
            if tenant_of(d) == name[1]:
                return d
    elif isinstance(name, list) and len(name) == 3 and name[0] == "jwt":
        return ("jwt", name[1], name[2])
    elif isinstance(name, list) and len(name) == 2 and name[0] == "addr":
        return str(name[1])
    return ("batch-budget", tenant)


class BatchPlaces:
    """The edge's places for batch lines (see the module's docstring)."""

    def __init__(self, interactive: InFlight, edge_limit: int, tenant_limit: int):
        self.interactive = interactive
        self.edge_limit, self.tenant_limit = max(1, edge_limit), max(1, min(tenant_limit, edge_limit))
        self.held: dict[str, int] = {}
        self.total = 0
        self.waiting: dict[str, deque[asyncio.Future[None]]] = {}
        self._poller: asyncio.Task[None] | None = None

    @classmethod
    def shared(cls, interactive: InFlight, share: float, tenant_share: float) -> BatchPlaces:
        """`share` of the interactive limit for batch lines, `tenant_share` of those for one tenant's."""
        edge = max(1, math.floor(interactive.limit * share))
        return cls(interactive, edge, max(1, math.floor(edge * tenant_share)))

    def queued(self) -> int:
        return sum(len(q) for q in self.waiting.values())

    def _room(self, tenant: str) -> bool:
        return (self.total < self.edge_limit and self.held.get(tenant, 0) < self.tenant_limit
                and self.interactive.count + self.total < self.interactive.limit)

    def _take(self, tenant: str) -> None:
        self.held[tenant] = self.held.get(tenant, 0) + 1
        self.total += 1

    async def acquire(self, tenant: str) -> None:
        """A place for one of `tenant`'s lines, once there is one (cancelled while waiting: none is held)."""
        if not self.waiting and self._room(tenant):
            self._take(tenant)
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiting.setdefault(tenant, deque()).append(future)
        self.hand_out()
        if not future.done():
            self._poll()
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release(tenant)                 # handed a place just as it was cancelled
            else:
                with contextlib.suppress(ValueError):
                    self.waiting.get(tenant, deque()).remove(future)
                self._tidy(tenant)
            raise

    def release(self, tenant: str) -> None:
        left = self.held.get(tenant, 0) - 1
        if left > 0:
            self.held[tenant] = left
        else:
            self.held.pop(tenant, None)
        self.total = max(0, self.total - 1)
        self.hand_out()

    def hand_out(self) -> None:
        """Give free places to waiting lines: the tenant that holds the fewest first."""
        while True:
            ready = [t for t, q in self.waiting.items() if q and self._room(t)]
            if not ready:
                return
            tenant = min(ready, key=lambda t: self.held.get(t, 0))
            future = self.waiting[tenant].popleft()
            self._tidy(tenant)
            if not future.done():
                self._take(tenant)
                future.set_result(None)

    def _tidy(self, tenant: str) -> None:
        if tenant in self.waiting and not self.waiting[tenant]:
            del self.waiting[tenant]

    def _poll(self) -> None:
        """While lines wait, look for room every POLL_S: interactive requests leaving free it unannounced."""
        if self._poller is None or self._poller.done():
            self._poller = asyncio.get_running_loop().create_task(self._keep_polling())

    async def _keep_polling(self) -> None:
        while self.waiting:
            await asyncio.sleep(POLL_S)
            self.hand_out()
