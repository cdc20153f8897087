"""Rate limits: token buckets per caller, and a bound on requests in flight (the edge's, and the
router's for native gRPC callers).

Pure: every method that depends on time takes `now` (seconds on a monotonic clock) and does no
I/O, so the tests drive a fake clock.  The glue that reads the clock is services/edge/gateway/admission.py
(and services/router/callers.py).

- Requests (`INFERMESH_RATE_LIMIT`, e.g. `5/s`): one token per request; the bucket holds one
  period's worth, so `5/s` allows a burst of 5, then 5 a second.
- Tokens (`INFERMESH_TOKEN_LIMIT`, tokens per minute): a request reserves its whole cost before
  any engine works on it: every prompt's tokens plus max_tokens for each generation it asks for
  (prompts x n), so concurrent requests see each other's reservations.  One that asks for more than
  the bucket holds (one period's worth) could never pass and is refused outright; one that does not
  fit now waits for refill.  When it ends it settles against the real usage: the unused part is
  refunded, an overrun becomes debt that refill pays back first.
"""

from __future__ import annotations

import math
import re
from collections import Counter, OrderedDict
from collections.abc import Hashable, Mapping
from dataclasses import dataclass

_UNITS = {"s": 1.0, "sec": 1.0, "second": 1.0, "m": 60.0, "min": 60.0, "minute": 60.0,
          "h": 3600.0, "hour": 3600.0}
_RATE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(?:/\s*([a-z]+))?\s*")


@dataclass(frozen=True)
class Rate:
    amount: float       # this many ...
    period_s: float     # ... per this many seconds; the bucket holds `amount` (one period's burst)

    def __post_init__(self) -> None:
        if not (self.amount > 0 and self.period_s > 0 and math.isfinite(self.amount)):
            raise ValueError(f"a rate needs a positive amount and period, got {self.amount}/{self.period_s}s")

    @property
    def per_s(self) -> float:
        return self.amount / self.period_s

    def __str__(self) -> str:
        unit = {1.0: "s", 60.0: "m", 3600.0: "h"}.get(self.period_s, f"{self.period_s:g}s")
        return f"{self.amount:g}/{unit}"


def parse_rate(text: str, default_unit: str = "s") -> Rate | None:
    """`5/s`, `300/m`, `300/min`, `10000/h`; a bare number uses `default_unit`; "" or "0" is no limit."""
    if not text.strip():
        return None
    match = _RATE.fullmatch(text.lower())
    if not match:
        raise ValueError(f"rate {text!r} is not N/s, N/m or N/h")
    amount, unit = float(match.group(1)), match.group(2) or default_unit
    if unit not in _UNITS:
        raise ValueError(f"rate {text!r}: unit {unit!r} is not s, m or h")
    return Rate(amount, _UNITS[unit]) if amount > 0 else None


def retry_after_s(wait_s: float) -> int:
    """The Retry-After header's whole seconds: rounded up, at least 1."""
    return max(1, math.ceil(wait_s - 1e-9))


class TokenBucket:
    """Holds up to `capacity` tokens and refills at `per_s` a second.

    The level may go below zero: a charge settled after the fact (more tokens generated than
    were reserved) is debt, and nothing more is admitted until refill has paid it back."""

    def __init__(self, per_s: float, capacity: float, now: float):
        self.per_s, self.capacity = per_s, capacity
        self.level = capacity
        self.updated = now

    def _refill(self, now: float) -> None:
        if now > self.updated:
            self.level = min(self.capacity, self.level + (now - self.updated) * self.per_s)
            self.updated = now

    def wait_s(self, amount: float, now: float) -> float:
        """Seconds until `amount` (at most the capacity: a full bucket lets any amount through, into
        debt) is there.  Token reservations go through Limiter.reserve, which refuses more than the
        capacity instead."""
        self._refill(now)
        missing = min(amount, self.capacity) - self.level
        return max(0.0, missing / self.per_s)

    def take(self, amount: float, now: float) -> float:
        """Take `amount` and return 0.0, or take nothing and return the seconds to wait."""
        wait = self.wait_s(amount, now)
        if wait == 0.0:
            self.level -= amount
        return wait

    def give(self, amount: float, now: float) -> None:
        """Return tokens (a refund), or charge more with a negative amount (debt allowed)."""
        self._refill(now)
        self.level = min(self.capacity, self.level + amount)

    def full(self, now: float) -> bool:
        self._refill(now)
        return self.level >= self.capacity


class Limiter:
    """One token bucket per caller (an API key's digest, or a client address), made on first use.

    At most `max_callers` buckets are kept; past that the least recently used go first, so a
    flood of client addresses cannot grow memory (a dropped caller comes back with a full bucket)."""

    def __init__(self, rate: Rate, max_callers: int = 100_000):
        self.rate = rate
        self.max_callers = max_callers
        self._buckets: OrderedDict[Hashable, TokenBucket] = OrderedDict()

    def bucket(self, caller: Hashable, now: float) -> TokenBucket:
        b = self._buckets.get(caller)
        if b is None:
            b = self._buckets[caller] = TokenBucket(self.rate.per_s, self.rate.amount, now)
            while len(self._buckets) > self.max_callers:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(caller)
        return b

    def take(self, caller: Hashable, amount: float, now: float) -> float:
        """0.0 when admitted (and charged), else the seconds until `amount` would be."""
        return self.bucket(caller, now).take(amount, now)

    def reserve(self, caller: Hashable, amount: float, now: float) -> float:
        """Take a request's whole reservation up front: 0.0 when taken; else the seconds until `caller`'s
        bucket holds it, or math.inf when it never can (more than the capacity: one period's worth).
        Nothing is taken unless it all fits, so a refused request leaves the budget as it was."""
        if amount > self.rate.amount:
            return math.inf
        return self.take(caller, amount, now)

    def give(self, caller: Hashable, amount: float, now: float) -> None:
        self.bucket(caller, now).give(amount, now)

    def __len__(self) -> int:
        return len(self._buckets)


def over_fair_share(held: Mapping[str, int], tenant: str, limit: int, asking: int = 1) -> bool:
    """Whether `tenant` (holding held[tenant] of `limit` places) must not take `asking` more: once three quarters
    of the places would be taken, a tenant is admitted only while it holds less than an equal share with one more
    tenant (limit // (tenants + 1)), so one tenant's flood leaves the others at least a quarter of the places."""
    total = sum(held.values())
    mine = held.get(tenant, 0)
    tenants = sum(1 for v in held.values() if v) + (not mine)
    return total + asking > limit - limit // 4 and mine + asking > limit // (tenants + 1)


class InFlight:
    """At most `limit` places in flight across all callers (a place is one router call: a request with prompts x n
    choices takes that many), shared fairly between tenants (over_fair_share); the excess is refused at once, not
    queued (a queue in front of a saturated mesh only turns overload into timeouts)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.count = 0
        self.held: Counter[str] = Counter()

    def take(self, tenant: str = "", places: int = 1, fair: bool = False) -> str | None:
        """Take `places` for `tenant`, or say why not: "full", or with `fair` "share" (over_fair_share)."""
        if self.count + places > self.limit:
            return "full"
        if fair and over_fair_share(self.held, tenant, self.limit, places):
            return "share"
        self.count += places
        self.held[tenant] += places
        return None

    def enter(self, tenant: str = "", places: int = 1, fair: bool = False) -> bool:
        return self.take(tenant, places, fair) is None

    def leave(self, tenant: str = "", places: int = 1) -> None:
        self.count = max(0, self.count - places)
        self.held[tenant] -= places
        if self.held[tenant] <= 0:
            del self.held[tenant]


DEFAULT_COMPLETION_TOKENS = 256    # reserved for a generation whose max_tokens is unbounded (0)


def reservation(prompt_tokens: int, max_tokens: int, generations: int = 1,
                default_completion: int = DEFAULT_COMPLETION_TOKENS) -> int:
    """What a request reserves before any engine works on it: its prompts' tokens (every prompt's),
    plus max_tokens (a default when unbounded) for each of its `generations` (prompts x n)."""
    return prompt_tokens + generations * (max_tokens or default_completion)


def estimate_tokens(text_bytes: int, max_tokens: int, default_completion: int = DEFAULT_COMPLETION_TOKENS,
                    generations: int = 1) -> int:
    """A request's reservation before the tokenizer has seen it: about 4 bytes per prompt token
    (English text under BPE vocabularies) for `text_bytes` of prompt text, then as `reservation`."""
    return reservation(math.ceil(text_bytes / 4), max_tokens, generations, default_completion)


def settlement(reserved: int, used: int | None, started: bool) -> int:
    """The tokens a reservation gives back when its request ends: the unused part when the usage is
    known (negative for an overrun: the caller's debt); all of it when it ended before any token (refused
    downstream); nothing when it was cut off mid-stream, since its usage is unknown."""
    if used is not None:
        return reserved - used
    return 0 if started else reserved
