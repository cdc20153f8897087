"""Who calls the router natively, and how much: API keys in gRPC metadata, admin keys, request and
token rates.

The edge authenticated its callers already (HTTP `Authorization`) and names the tenant; a request
from the edge's certificate is taken as it is, and its tokens are not charged again (the edge charged
them).  Any other caller (an operator's client certificate) meets the edge's rules here, from the
same settings (INFERMESH_API_KEYS, INFERMESH_ADMIN_KEYS, INFERMESH_RATE_LIMIT, INFERMESH_TOKEN_LIMIT):
`authorization: Bearer KEY` metadata when keys are configured, the key's tenant for sessions and
prefix caches, its request rate, its token budget, and failed keys limited per peer address.

Tokens per key: once the prompt is tokenized (exact, not an estimate), a Generate reserves its prompt
tokens + max_tokens (or a default when unbounded) before any engine call opens; RESOURCE_EXHAUSTED
with retry-after when the budget cannot hold it now, without one when it never can (more than one
period's limit).  It settles to the final usage: the unused part back, an overrun as debt.

A plaintext router (--insecure-mesh, debugging) cannot tell the edge from anyone else: it trusts
every caller, as it trusts every caller's certificate kind (mesh/peers.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import AsyncGenerator, Callable, Hashable
from typing import NamedTuple, TypeVar

import grpc

from mesh import peers
from mesh.apikeys import ApiKeys, tenant_of
from mesh.errors import ResourceExhausted, Unauthenticated
from mesh.ratelimit import DEFAULT_COMPLETION_TOKENS, Limiter, Rate, reservation, retry_after_s, settlement
from mesh.request_limits import MAX_WEIGHT, name_problem
from mesh.sampling import problem
from services.router.request import Reply, RouterRequest

T = TypeVar("T")


class Caller(NamedTuple):
    """Who a Generate runs as."""

    tenant: str
    key: bytes | None = None     # a native caller's API key digest (its limits' bucket); None: the edge, or no keys


@dataclasses.dataclass
class TokenCharge:
    """One native Generate's tokens: reserved once its prompt is tokenized, settled when it ends."""

    key: bytes
    max_tokens: int              # the request's; 0: unbounded, the default is reserved
    reserved: int = 0            # taken from the key's budget; 0 until then (or when refused)
    started: bool = False        # a reply went out: an engine may have generated tokens
    used: int | None = None      # prompt + completion tokens, once the final reply told


class Callers:
    def __init__(self, keys: tuple[bytes, ...] = (), admin_keys: tuple[bytes, ...] = (),
                 rate_limit: Rate | None = None, auth_failure_limit: Rate | None = None,
                 token_limit: Rate | None = None):
        self.keys = ApiKeys(keys)
        self.admin_keys = ApiKeys(admin_keys)
        self.rate = Limiter(rate_limit) if rate_limit else None
        self.auth_failures = Limiter(auth_failure_limit) if auth_failure_limit else None
        self.tokens = Limiter(token_limit) if token_limit else None

    def caller(self, context: grpc.aio.ServicerContext, named: str) -> Caller:
        """Who a Generate runs as: the edge's `named` tenant; a native caller's API key's; with no keys
        configured, its certificate kind's namespace (mesh.peers.tenant_for).  Raises Unauthenticated
        (no or a wrong key) or ResourceExhausted (over its request rate, with retry-after)."""
        kind = peers.kind(context)
        if kind is None or kind == peers.TENANT_KIND or not self.keys.enabled:
            return Caller(peers.tenant_for(kind, named))
        key = self._key(context, self.keys, "Generate", "API key")
        self._take(self.rate, key, "requests for this API key")
        return Caller(tenant_of(key), key)

    def weight(self, context: grpc.aio.ServicerContext, caller: Caller, asked: float) -> float:
        """The tier weight a Generate carries to the engines (fair scheduling): the edge's, which knows the
        tiers; 0 (the engines read 1) for any other caller, whose claim no tier backs."""
        kind = peers.kind(context)
        return asked if caller.key is None and (kind is None or kind == peers.TENANT_KIND) else 0.0

    def charge(self, caller: Caller, max_tokens: int) -> TokenCharge | None:
        """The token charge a Generate of `caller` opens; None when the router charges none (the edge's
        calls, which the edge charged; no keys; no token limit)."""
        if self.tokens is None or caller.key is None:
            return None
        return TokenCharge(caller.key, max_tokens)

    def reserve(self, charge: TokenCharge, prompt_tokens: int, now: float) -> None:
        """Take `prompt_tokens` + max_tokens from the key's budget before any engine works on them.
        Raises ResourceExhausted: with retry-after when the budget holds too little now; without, when
        the request is larger than the whole budget and no wait would let it through."""
        assert self.tokens is not None
        amount = reservation(prompt_tokens, charge.max_tokens)
        wait = self.tokens.reserve(charge.key, amount, now)
        if wait == math.inf:
            asked = f"max_tokens {charge.max_tokens}" if charge.max_tokens else \
                f"max_tokens unset ({DEFAULT_COMPLETION_TOKENS} reserved)"
            raise ResourceExhausted(
                f"request too large for this API key's token limit {self.tokens.rate}: it needs {amount} tokens "
                f"({prompt_tokens} prompt + {asked}); lower max_tokens or shorten the prompt, it cannot pass "
                "as it is")
        if wait > 0:
            raise ResourceExhausted(f"too many tokens for this API key: limit {self.tokens.rate}, this request "
                                    f"needs {amount} ({prompt_tokens} prompt + max_tokens); try again in "
                                    f"{wait:.3g}s", retry_after_s=retry_after_s(wait))
        charge.reserved = amount

    def admission(self, charge: TokenCharge | None) -> Callable[[int], None] | None:
        """The dispatcher's `admit`: reserve `charge` once the prompt's token count is known (None: none)."""
        if charge is None:
            return None
        return lambda prompt_tokens: self.reserve(charge, prompt_tokens, time.monotonic())

    def metered(self, charge: TokenCharge | None, replies: AsyncGenerator[T, None],
                used: Callable[[T], int | None]) -> AsyncGenerator[T, None]:
        """`replies`, with `charge` (if any) settled when the stream ends, however it ends; `used(reply)`:
        the request's prompt + completion tokens on its final reply, else None."""
        return replies if charge is None else self._metered(charge, replies, used)

    async def _metered(self, charge: TokenCharge, replies: AsyncGenerator[T, None],
                       used: Callable[[T], int | None]) -> AsyncGenerator[T, None]:
        try:
            async with contextlib.aclosing(replies):
                async for reply in replies:
                    charge.started = True
                    charge.used = used(reply) if charge.used is None else charge.used
                    yield reply
        finally:
            self.settle(charge, time.monotonic())

    def settle(self, charge: TokenCharge, now: float) -> None:
        """Settle a charge to its usage: the unused part back, an overrun as debt; all back when it ended
        before a reply; nothing when cut off mid-stream (usage unknown)."""
        back = settlement(charge.reserved, charge.used, charge.started)
        if self.tokens is not None and back:
            self.tokens.give(charge.key, back, now)

    def check_user(self, context: grpc.aio.ServicerContext, rpc: str) -> None:
        """A read-only user RPC (ListModels, ListReplicas, GetModelRouting, Tokenize, Detokenize): an API key
        when keys are set."""
        caller = peers.kind(context)
        if caller is None or caller == peers.TENANT_KIND or not self.keys.enabled:
            return
        self._key(context, self.keys, rpc, "API key")

    def check_admin(self, context: grpc.aio.ServicerContext, rpc: str) -> None:
        """An admin RPC: the edge (it checked the admin key) or an operator's certificate; the operator
        also needs an admin key when admin keys are configured."""
        peers.require(context, rpc, peers.ROUTER_ADMIN)
        caller = peers.kind(context)
        if caller is None or caller == peers.TENANT_KIND or not self.admin_keys.enabled:
            return
        self._key(context, self.admin_keys, rpc, "admin key")

    def _key(self, context: grpc.aio.ServicerContext, keys: ApiKeys, rpc: str, what: str) -> bytes:
        address = context.peer() or "unknown"
        address = address.rsplit(":", 1)[0]          # ipv4:127.0.0.1:5555 -> per host, not per port
        self._take(self.auth_failures, address, "failed keys from this address", charge=False)
        metadata = dict((k, v) for k, v in (context.invocation_metadata() or ()) if isinstance(v, str))
        found = keys.match(metadata.get("authorization", ""))
        if found is None:
            if self.auth_failures is not None:
                self.auth_failures.take(address, 1, time.monotonic())
            raise Unauthenticated(f"{rpc}: invalid or missing {what}; send gRPC metadata "
                                  f"'authorization: Bearer KEY'")
        return found

    @staticmethod
    def _take(limiter: Limiter | None, who: Hashable, what: str, charge: bool = True) -> None:
        """Charge one to `who`'s bucket (or, charge=False, only check it is not empty); raise when over."""
        if limiter is None:
            return
        now = time.monotonic()
        wait = limiter.take(who, 1, now) if charge else limiter.bucket(who, now).wait_s(1, now)
        if wait > 0:
            raise ResourceExhausted(f"too many {what}: limit {limiter.rate}; try again in {wait:.3g}s",
                                    retry_after_s=retry_after_s(wait))


def refusal(request: RouterRequest) -> str | None:
    """Why a native Generate request breaks the limits the edge enforces (mesh/sampling.py, mesh/request_limits.py),
    or None."""
    broken = problem(request.sampling)
    return ((broken[1] if broken else None)
            or name_problem("session_id", request.session_id) or name_problem("model", request.model)
            or name_problem("history_from", request.history_from)
            or name_problem("pinned_replica", request.pinned_replica)
            or name_problem("request_id", request.request_id)
            or (f"cache_class {request.cache_class[:32]!r} is not premium, standard or batch"
                if request.cache_class not in ("", "premium", "standard", "batch") else None)
            or (f"weight {request.weight:g} must be between 0 (the default, 1) and {MAX_WEIGHT:g}"
                if not 0.0 <= request.weight <= MAX_WEIGHT else None))


def tokens_used(reply: Reply) -> int | None:
    """The request's prompt + completion tokens, on its final reply."""
    if not reply.finish_reason:
        return None
    return 0 if reply.usage is None else reply.usage.prompt_tokens + reply.usage.completion_tokens
