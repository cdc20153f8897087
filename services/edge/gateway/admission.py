"""Who may call the edge, and how much: API keys and JWTs (tenants and tiers), signed requests, admin
keys, request and token rates per tier, requests in flight.

Each check raises ApiError with the status a client sees: 401 (no or a wrong key or token, a bad
signature), 403 (admin API off), 429 (a rate of the caller's tier, with Retry-After; a request larger
than its tier's whole token budget, `request_too_large` with `x-should-retry: false`, since no wait
lets it through; or too many failed keys from one client address) and 503 (too many in flight across
all callers).
The buckets themselves are pure (mesh/ratelimit.py); this reads the clock.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import OrderedDict

from mesh import signing
from mesh.apikeys import ApiKeys
from mesh.clients.router_client import GenerateSpec
from mesh.ratelimit import (
    DEFAULT_COMPLETION_TOKENS,
    InFlight,
    Limiter,
    Rate,
    estimate_tokens,
    retry_after_s,
    settlement,
)
from services.edge.batch.admission import BatchLineCaller, BatchPlaces
from services.edge.config import EdgeConfig
from services.edge.errors import DO_NOT_RETRY, ApiError
from services.edge.gateway.jwt_auth import JwtRefused, JwtVerifier, looks_like_jwt
from services.edge.gateway.tenants import STANDARD, AuthenticatedCaller, Directory, TenantTier
from services.edge.metrics import REFUSED
from services.edge.transports.asgi import Scope


@dataclasses.dataclass
class Charge:
    """One request's token reservation (all its prompts and choices), settled when it ends."""

    caller: AuthenticatedCaller
    reserved: int
    started: bool = False           # a delta arrived: the router may have generated tokens
    used: int | None = None         # prompt + completion tokens, once the final message told
    places: int = 0                 # in-flight places held: one a router call (prompts x n)
    conversation: tuple[str, str] | None = None    # (tenant, session) whose stored tokens its usage updates


MAX_CONVERSATIONS = 100_000          # conversations whose tokens an edge remembers (least recently used go)


class Admission:
    def __init__(self, config: EdgeConfig):
        self.directory = Directory(config.api_key_digests, config.keys_file, config.tiers_file,
                                   TenantTier(STANDARD, config.rate_limit, config.token_limit))
        self.jwt = JwtVerifier(config.jwt_secret, config.jwt_jwks_file, config.jwt_audience, config.jwt_issuer) \
            if config.jwt_secret or config.jwt_jwks_file else None
        self.admin_keys = ApiKeys(config.admin_key_digests)
        # Per tier: its limiter, rebuilt when a reload changes the tier's rate.
        self._limiters: dict[tuple[str, str], Limiter] = {}
        self.nonces = signing.NonceCache()
        self.in_flight = InFlight(config.max_concurrent)
        # Each stored conversation's tokens as its last turn here used them (prompt, history included, + answer):
        # the next turn reserves them too, counted by the tokenizer, not estimated from bytes.
        self.conversations: OrderedDict[tuple[str, str], int] = OrderedDict()
        # Batch lines' own places (services/edge/batch/admission.py), never the interactive ones above.
        self.batch_places = BatchPlaces.shared(self.in_flight, config.batch_share, config.batch_tenant_share)
        # Failed keys per client address: past the limit the address gets 429 whatever key it sends
        # (a right key must not be told apart while guessing is refused); good keys never draw on it.
        self.auth_failures = Limiter(config.auth_failure_limit) if config.auth_failure_limit else None

    @property
    def enabled(self) -> bool:
        return self.directory.enabled or self.jwt is not None

    def authenticate(self, scope: Scope, headers: dict[str, str]) -> AuthenticatedCaller:
        """The caller: its API key's or JWT's tenant and tier; with neither configured (loopback only) its
        address, in the standard tier."""
        address = _address(scope)
        self.directory.refresh()
        if not self.enabled:
            return AuthenticatedCaller(address, f"addr:{address}", self.directory.tiers[STANDARD], "anonymous")
        self._limit_failures(address)
        scheme, _, token = headers.get("authorization", "").partition(" ")
        token = token.strip()
        caller = None
        if scheme.lower() == "bearer" and token:
            if self.jwt is not None and looks_like_jwt(token):
                caller = self._from_jwt(token, address)
            else:
                caller = self.directory.by_key(token)
        if caller is None:
            self._failed(address)
            raise ApiError(401, "invalid or missing API key (send 'Authorization: Bearer KEY')",
                           kind="authentication_error", code="invalid_api_key")
        return caller

    def _from_jwt(self, token: str, address: str) -> AuthenticatedCaller:
        assert self.jwt is not None
        try:
            claims = self.jwt.verify(token)
        except JwtRefused as exc:
            self._failed(address)
            raise ApiError(401, str(exc), kind="authentication_error", code="invalid_token") from None
        tier = self.directory.tier(claims.tier)
        if tier is None:
            self._failed(address)
            raise ApiError(401, f"the JWT's tier {claims.tier!r} is not one this edge defines "
                           f"({', '.join(sorted(self.directory.tiers))})", kind="authentication_error",
                           code="invalid_token")
        return AuthenticatedCaller(("jwt", claims.tenant, claims.subject), f"t:{claims.tenant}", tier, claims.tenant)

    def check_signature(self, caller: AuthenticatedCaller, scope: Scope, headers: dict[str, str], body: bytes) -> None:
        """401 unless a caller whose key has a signing secret signed this request (mesh/signing.py)."""
        if caller.signing_secret is None:
            return
        query = scope.get("query_string", b"").decode("latin-1")
        path = scope["path"] + (f"?{query}" if query else "")
        try:
            signing.verify(caller.signing_secret, caller.bucket, scope["method"], path, headers, body, time.time(),
                           self.nonces)
        except signing.BadSignature as exc:
            REFUSED.labels("signature").inc()
            raise ApiError(401, str(exc), kind="authentication_error", code="invalid_signature") from None

    def _limiter(self, tier: TenantTier, kind: str) -> Limiter | None:
        rate: Rate | None = tier.requests if kind == "requests" else tier.tokens
        if rate is None:
            return None
        limiter = self._limiters.get((tier.name, kind))
        if limiter is None or limiter.rate != rate:
            limiter = self._limiters[(tier.name, kind)] = Limiter(rate)
        return limiter

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

    def limit_requests(self, caller: AuthenticatedCaller) -> None:
        limit = self._limiter(caller.tier, "requests")
        if limit is None:
            return
        wait = limit.take(caller.bucket, 1, time.monotonic())
        if wait > 0:
            REFUSED.labels("requests").inc()
            raise ApiError(429, f"Rate limit reached for requests: limit {limit.rate} ({caller.tier.name} tier). "
                           f"Please try again in {wait:.3g}s.", kind="requests", code="rate_limit_exceeded",
                           retry_after_s=retry_after_s(wait))

    def enter(self, caller: AuthenticatedCaller, spec: GenerateSpec, places: int = 0) -> Charge:
        """Admit a completion: its places among those in flight (a place a router call it has open at once:
        prompts x n unless `places` says; 429, 503), then its tokens (429).  Every Charge returned must be
        given back to `leave`."""
        if isinstance(caller, BatchLineCaller):
            return self.enter_batch_line(caller, spec)
        places = places or (len(spec.prompts) or 1) * spec.n     # fan-out counts as it calls
        self._take_places(caller, places)
        try:
            charge = self._reserve_tokens(caller, spec)
        except ApiError:
            self.in_flight.leave(self._place_holder(caller), places)
            raise
        charge.places = places
        return charge

    def _take_places(self, caller: AuthenticatedCaller, places: int) -> None:
        """`places` in flight for the caller's tenant: 429 over its fair share (it leaves the others room), 503
        when the edge is full; a request of more calls than half the edge's places never fits (429, no retry)."""
        gate = self.in_flight
        if places > max(1, gate.limit // 2):
            REFUSED.labels("in_flight").inc()
            raise ApiError(429, f"this request makes {places} router calls (prompts x n); this edge runs at most "
                           f"{max(1, gate.limit // 2)} of one request at once: lower n or the number of prompts",
                           kind="in_flight", code="request_too_large", retry_after_s=DO_NOT_RETRY)
        refused = gate.take(self._place_holder(caller), places, fair=self.enabled)
        if refused == "share":
            REFUSED.labels("in_flight").inc()
            raise ApiError(429, f"this caller has {gate.held[caller.tenant]} router calls in flight, its share of "
                           f"this edge's {gate.limit} while it is nearly full; retry shortly", kind="in_flight",
                           code="rate_limit_exceeded", retry_after_s=1)
        if refused == "full":
            REFUSED.labels("in_flight").inc()
            raise ApiError(503, f"the edge is at its limit of {gate.limit} requests in flight; "
                           "retry shortly", kind="service_unavailable", code="overloaded", retry_after_s=1)

    def _place_holder(self, caller: AuthenticatedCaller) -> str:
        """Whose in-flight places a caller's are: its tenant where callers are told apart by keys or tokens (the
        places are shared fairly between them); else "" (unauthenticated loopback callers are one tenant: they
        take the whole edge)."""
        return caller.tenant if self.enabled else ""

    def leave(self, charge: Charge) -> None:
        if not isinstance(charge.caller, BatchLineCaller):
            self.in_flight.leave(self._place_holder(charge.caller), charge.places)
        self._settle_tokens(charge)

    def enter_batch_line(self, caller: BatchLineCaller, spec: GenerateSpec) -> Charge:
        """Admit a batch line: its place is one of the batch places (services/edge/batch/lines.py took it before
        the line's route ran), not one of the interactive ones; its tokens are reserved from its budget, the
        token bucket of the batch creator's interactive requests (429 as theirs: the batch runner waits the
        Retry-After and tries again; request_too_large when it can never fit)."""
        return self._reserve_tokens(dataclasses.replace(caller, bucket=caller.budget), spec)

    def _reserve_tokens(self, caller: AuthenticatedCaller, spec: GenerateSpec) -> Charge:
        """Reserve the whole request before any of it reaches the router: every prompt's estimate plus
        max_tokens for each of its prompts x n choices.  Taken here, before the first await, so requests
        arriving together see each other's reservations."""
        generations = (len(spec.prompts) or 1) * spec.n
        text_bytes = _prompt_bytes(spec)
        history = self.conversations.get((caller.tenant, spec.history_from or spec.session_id), 0)
        charge = Charge(caller, history + estimate_tokens(text_bytes, spec.sampling.max_tokens,
                                                          generations=generations),
                        conversation=(caller.tenant, spec.session_id) if spec.session_id else None)
        limit = self._limiter(caller.tier, "tokens")
        if limit is None:
            return charge
        wait = limit.reserve(caller.bucket, charge.reserved, time.monotonic())
        if wait == math.inf:
            REFUSED.labels("tokens").inc()
            raise ApiError(429, _too_large(limit.rate, caller.tier.name, charge.reserved, spec, text_bytes, history),
                           kind="tokens", code="request_too_large", retry_after_s=DO_NOT_RETRY)
        if wait > 0:
            REFUSED.labels("tokens").inc()
            raise ApiError(429, f"Rate limit reached for tokens: limit {limit.rate} ({caller.tier.name} tier), "
                           f"requested about {charge.reserved} (prompt estimate + prompts x n x max_tokens). "
                           f"Please try again in {wait:.3g}s.", kind="tokens", code="rate_limit_exceeded",
                           retry_after_s=retry_after_s(wait))
        return charge

    def _settle_tokens(self, charge: Charge) -> None:
        """Refund what was reserved but not used; an overrun becomes the caller's debt.  A request that
        ended before any token (refused by the router) costs nothing; one cut off mid-stream keeps its
        reservation, since its usage is unknown.  A conversation's usage is what its next turn reserves."""
        if charge.conversation is not None and charge.used is not None:
            self.conversations[charge.conversation] = charge.used
            self.conversations.move_to_end(charge.conversation)
            while len(self.conversations) > MAX_CONVERSATIONS:
                self.conversations.popitem(last=False)
        limit = self._limiter(charge.caller.tier, "tokens")
        back = settlement(charge.reserved, charge.used, charge.started)
        if limit is not None and back:
            limit.give(charge.caller.bucket, back, time.monotonic())


def _prompt_bytes(spec: GenerateSpec) -> int:
    """The bytes of every text that reaches the model: each prompt (completions); or the messages with
    their names and tool calls, and the tools list (chat's template writes them into the prompt); and a
    structured-output constraint's text."""
    if spec.messages:
        texts = [t for m in spec.messages for t in (m.content, m.name, m.tool_calls, m.tool_call_id)]
        texts.append(spec.tools)
    else:
        texts = list(spec.prompts or (spec.prompt or "",))
    c = spec.sampling.constraint
    if c is not None and c.kind != "tool_calls":        # a tool_calls constraint's text is the tools list
        texts += [c.text, c.prefix, c.suffix]
    return sum(len(t.encode()) for t in texts)


def _too_large(rate: Rate, tier: str, reserved: int, spec: GenerateSpec, text_bytes: int, history: int) -> str:
    """OpenAI's words for a request over the whole budget, with what it asked for and what to lower."""
    period = {1.0: "second", 60.0: "min", 3600.0: "hour"}.get(rate.period_s, f"{rate.period_s:g} s")
    prompts, max_tokens = len(spec.prompts) or 1, spec.sampling.max_tokens
    each = f"max_tokens {max_tokens}" if max_tokens else f"max_tokens unset ({DEFAULT_COMPLETION_TOKENS} reserved)"
    completion = prompts * spec.n * (max_tokens or DEFAULT_COMPLETION_TOKENS)
    stored = f" + the stored conversation's {history}" if history else ""
    return (f"Request too large for tokens per {period}: limit {rate.amount:g} ({tier} tier), requested about "
            f"{reserved} = prompt estimate {math.ceil(text_bytes / 4)}{stored} + {prompts} prompt(s) x n {spec.n} x "
            f"{each} ({completion}). Lower max_tokens, n or the number of prompts (or shorten the prompt) to fit in "
            f"{rate.amount:g} tokens; the request cannot pass as it is, so do not retry it unchanged.")


def _address(scope: Scope) -> str:
    client = scope.get("client")
    return str(client[0]) if client else "unknown"
