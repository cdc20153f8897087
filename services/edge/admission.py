"""Who may call the edge, and how much: API keys, admin keys, request and token rates, requests in flight.

Each check raises ApiError with the status a client sees: 401 (no or a wrong key), 403 (admin API
off), 429 (a rate per caller, with Retry-After; or too many failed keys from one client address)
and 503 (too many in flight across all callers).
The buckets themselves are pure (mesh/ratelimit.py); this reads the clock.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Hashable

from mesh.apikeys import ApiKeys
from mesh.clients.router import GenerateSpec
from mesh.ratelimit import InFlight, Limiter, estimate_tokens, retry_after_s
from services.edge.asgi import Scope
from services.edge.config import EdgeConfig
from services.edge.errors import ApiError
from services.edge.metrics import REFUSED


@dataclasses.dataclass
class Charge:
    """One request's token reservation, settled when it ends."""

    caller: Hashable
    reserved: int
    started: bool = False           # a delta arrived: the router may have generated tokens
    used: int | None = None         # prompt + completion tokens, once the final message told


class Admission:
    def __init__(self, config: EdgeConfig):
        self.keys = ApiKeys(config.api_key_digests)
        self.admin_keys = ApiKeys(config.admin_key_digests)
        self.request_limit = Limiter(config.rate_limit) if config.rate_limit else None
        self.token_limit = Limiter(config.token_limit) if config.token_limit else None
        self.in_flight = InFlight(config.max_concurrent)
        # Failed keys per client address: past the limit the address gets 429 whatever key it sends
        # (a right key must not be told apart while guessing is refused); good keys never draw on it.
        self.auth_failures = Limiter(config.auth_failure_limit) if config.auth_failure_limit else None

    def authenticate(self, scope: Scope, headers: dict[str, str]) -> Hashable:
        """The caller that rate limits count against: its API key's digest, or with no keys configured
        (loopback only) its address."""
        address = _address(scope)
        if not self.keys.enabled:
            return address
        self._limit_failures(address)
        caller = self.keys.match(headers.get("authorization", ""))
        if caller is None:
            self._failed(address)
            raise ApiError(401, "invalid or missing API key (send 'Authorization: Bearer KEY')",
                           kind="authentication_error", code="invalid_api_key")
        return caller

    def check_admin(self, scope: Scope, headers: dict[str, str]) -> None:
        if not self.admin_keys.enabled:
            raise ApiError(403, "the admin API is off: configure admin keys (INFERMESH_ADMIN_KEYS or "
                           "INFERMESH_ADMIN_KEYS_FILE); API keys do not open it",
                           kind="permission_error", code="admin_disabled")
        address = _address(scope)
        self._limit_failures(address)
        if not self.admin_keys.check(headers.get("authorization", "")):
            self._failed(address)
            raise ApiError(401, "invalid or missing admin key (send 'Authorization: Bearer ADMIN_KEY')",
                           kind="authentication_error", code="invalid_admin_key")

    def _limit_failures(self, address: str) -> None:
        if self.auth_failures is None:
            return
        now = time.monotonic()
        wait = self.auth_failures.bucket(address, now).wait_s(1, now)
        if wait > 0:
            REFUSED.labels("auth_failures").inc()
            raise ApiError(429, f"too many failed API keys from this address: limit {self.auth_failures.rate}. "
                           f"Please try again in {wait:.3g}s.", kind="auth_failures",
                           code="rate_limit_exceeded", retry_after_s=retry_after_s(wait))

    def _failed(self, address: str) -> None:
        if self.auth_failures is not None:
            self.auth_failures.take(address, 1, time.monotonic())

    def limit_requests(self, caller: Hashable) -> None:
        if self.request_limit is None:
            return
        wait = self.request_limit.take(caller, 1, time.monotonic())
        if wait > 0:
            REFUSED.labels("requests").inc()
            raise ApiError(429, f"Rate limit reached for requests: limit {self.request_limit.rate}. "
                           f"Please try again in {wait:.3g}s.", kind="requests", code="rate_limit_exceeded",
                           retry_after_s=retry_after_s(wait))

    def enter(self, caller: Hashable, spec: GenerateSpec) -> Charge:
        """Admit a completion: a place among those in flight (503), then its tokens (429).  Every
        Charge returned must be given back to `leave`."""
        if not self.in_flight.enter():
            REFUSED.labels("in_flight").inc()
            raise ApiError(503, f"the edge is at its limit of {self.in_flight.limit} requests in flight; "
                           "retry shortly", kind="service_unavailable", code="overloaded", retry_after_s=1)
        try:
            return self._reserve_tokens(caller, spec)
        except ApiError:
            self.in_flight.leave()
            raise

    def leave(self, charge: Charge) -> None:
        self.in_flight.leave()
        self._settle_tokens(charge)

    def _reserve_tokens(self, caller: Hashable, spec: GenerateSpec) -> Charge:
        text_bytes = (len(spec.prompt.encode()) if spec.prompt is not None else
                      sum(len(m.content.encode()) for m in spec.messages))
        charge = Charge(caller, estimate_tokens(text_bytes, spec.sampling.max_tokens))
        if self.token_limit is not None:
            limit = self.token_limit
            wait = limit.take(caller, charge.reserved, time.monotonic())
            if wait > 0:
                REFUSED.labels("tokens").inc()
                raise ApiError(429, f"Rate limit reached for tokens: limit {limit.rate}, requested about "
                               f"{charge.reserved} (prompt estimate + max_tokens). Please try again in "
                               f"{wait:.3g}s.", kind="tokens", code="rate_limit_exceeded",
                               retry_after_s=retry_after_s(wait))
        return charge

    def _settle_tokens(self, charge: Charge) -> None:
        """Refund what was reserved but not used; an overrun becomes the caller's debt.  A request that
        ended before any token (refused by the router) costs nothing; one cut off mid-stream keeps its
        reservation, since its usage is unknown."""
        if self.token_limit is None:
            return
        if charge.used is not None:
            self.token_limit.give(charge.caller, charge.reserved - charge.used, time.monotonic())
        elif not charge.started:
            self.token_limit.give(charge.caller, charge.reserved, time.monotonic())


def _address(scope: Scope) -> str:
    client = scope.get("client")
    return str(client[0]) if client else "unknown"
