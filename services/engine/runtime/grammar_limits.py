"""What compiled grammars may cost an engine: memory (a byte budget), compiles (per tenant and at once),
and the constraints refused for good.  Pure: the methods that depend on time take `now`; the glue is
grammar.py (Grammars), and the compiles themselves run in grammar_worker.py.

Issue 31, finding 4: a compiled grammar can hold ~20 MB (xgrammar's token-mask cache; 60 properties with
their own patterns measured 19 MB) and take seconds of CPU, and before these limits any caller could make
an engine compile one per request and keep 256 of them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from mesh.errors import InvalidArgument, ResourceExhausted
from mesh.ratelimit import Limiter, Rate, retry_after_s

# Why a constraint was refused (infermesh_engine_constrained_requests_total's `grammar` label).
REFUSALS = ("invalid", "rate_limited", "busy", "timeout", "remembered")


@dataclass(frozen=True)
class GrammarLimits:
    """The defaults are an engine's at its default KV budget (EngineConfig.grammar_cache_bytes)."""
    cache_bytes: int = 128 << 20          # compiled grammars kept, by xgrammar's memory_size_bytes
    compile_rate: Rate | None = Rate(20, 60)  # new compiles per tenant (cache_salt); None: no limit
    compiles: int = 1                     # compiles running at once, all tenants together
    # Compiles waiting for a slot, each for one compile_timeout_s at most; beyond: refused.  Room for an
    # application's first burst of schemas; each holds a server thread (cache hits need none).
    queue: int = 16
    compile_timeout_s: float = 10.0       # a compile still running then is stopped and its constraint refused
    remembered: int = 4096                # refused constraints kept (as 32-byte digests), the oldest forgotten

    def __post_init__(self) -> None:
        if (self.cache_bytes < 0 or self.compiles < 1 or self.queue < 0 or self.compile_timeout_s <= 0
                or self.remembered < 1):
            raise ValueError("grammar limits: cache_bytes >= 0, compiles >= 1, queue >= 0, compile_timeout_s > 0, "
                             "remembered >= 1")


class CompileRefused(ResourceExhausted):
    """Too many compiles (the tenant's rate, or the engine's at once): retry later; cache hits still pass."""

    def __init__(self, message: str, retry_after_s: int, reason: str):
        # A tenant's own compile rate is its answer (the router relays it, no failover); `busy` is the engine's.
        super().__init__(message, retry_after_s, caller_limit=reason == "rate_limited")
        self.reason = reason


class ConstraintRefused(InvalidArgument):
    """This constraint cannot be used here: it does not compile, or compiling it takes too long."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


class GrammarCache:
    """Compiled grammars by key, within `budget` bytes; the least recently used go first.

    A grammar larger than the whole budget is not kept (its request uses it, the next compiles it again):
    keeping it would empty the cache for one entry that alone breaks the bound."""

    def __init__(self, budget: int):
        self.budget = budget
        self.bytes = 0
        self.evictions = 0
        self._entries: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()    # key -> (grammar, size)

    def get(self, key: Hashable) -> Any | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def put(self, key: Hashable, value: Any, size: int) -> bool:
        """Keep `value` (`size` bytes), evicting the least recently used to make room; False: not kept."""
        if size > self.budget:
            return False
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= old[1]
        while self._entries and self.bytes + size > self.budget:
            _, (_, dropped) = self._entries.popitem(last=False)
            self.bytes -= dropped
            self.evictions += 1
        self._entries[key] = (value, size)
        self.bytes += size
        return True

    def keys(self) -> list[Hashable]:
        """Oldest (next to go) first."""
        return list(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


class CompileGate:
    """Admits compiles: each tenant within its rate, at most `limits.compiles` running at once across
    tenants, and at most `limits.queue` more waiting for a slot.

    A burst of new schemas (an application's first requests, a few milliseconds each) waits its turn;
    past the queue, or after waiting one compile's time limit (the glue's part: it holds the clock),
    a compile is refused with RESOURCE_EXHAUSTED and a retry-after, and its rate is given back.  Only
    compiles pass here; cache hits, and requests that wait for the same constraint's compile already
    under way, do not."""

    def __init__(self, limits: GrammarLimits):
        self.limits = limits
        self.running = 0
        self.waiting = 0
        self._rates = Limiter(limits.compile_rate, max_callers=10_000) if limits.compile_rate else None
        self._refused: OrderedDict[bytes, str] = OrderedDict()   # constraint digest -> why

    def enter(self, tenant: bytes, now: float) -> bool:
        """Admit one compile for `tenant` (its cache_salt; b"": the common namespace): True, run it now;
        False, it waits for a slot (then `start` it, or `give_up`).  CompileRefused past the limits."""
        if self.running >= self.limits.compiles and self.waiting >= self.limits.queue:
            raise self._busy()                  # before the rate: a busy refusal spends none
        if self._rates is not None:
            wait = self._rates.take(tenant, 1, now)
            if wait > 0:
                raise CompileRefused(f"too many new constraints: this tenant may have {self.limits.compile_rate} "
                                     f"grammars compiled on this engine (--grammar-compile-rate); retry in "
                                     f"{retry_after_s(wait)} s, or reuse constraints sent before (cached ones do "
                                     f"not count)", retry_after_s(wait), "rate_limited")
        if self.running < self.limits.compiles:
            self.running += 1
            return True
        self.waiting += 1
        return False

    def start(self) -> bool:
        """A waiting compile takes a free slot: True, or False (none free yet)."""
        if self.running >= self.limits.compiles:
            return False
        self.waiting -= 1
        self.running += 1
        return True

    def give_up(self, tenant: bytes, now: float) -> CompileRefused:
        """A waiting compile found no slot in time: out of the queue, its rate given back."""
        self.waiting -= 1
        if self._rates is not None:
            self._rates.give(tenant, 1, now)
        return self._busy()

    def _busy(self) -> CompileRefused:
        # Compiles take milliseconds to seconds: 1 s is a fair first wait (slow ones hold their slots up to
        # the timeout, and a retry that comes too soon is refused again, as cheaply).
        return CompileRefused(f"{self.running} grammar compile(s) running and {self.waiting} waiting on this "
                              f"engine (--grammar-compiles {self.limits.compiles}); retry in 1 s (constraints "
                              f"compiled before are served meanwhile)", 1, "busy")

    def leave(self) -> None:
        self.running = max(0, self.running - 1)

    def refusal(self, key: bytes) -> str | None:
        """Why the constraint with digest `key` was refused for good, or None."""
        return self._refused.get(key)

    def remember(self, key: bytes, why: str) -> None:
        self._refused[key] = why
        self._refused.move_to_end(key)
        while len(self._refused) > self.limits.remembered:
            self._refused.popitem(last=False)
