"""Who calls the router natively, and how much: API keys in gRPC metadata, admin keys, request rates.

The edge authenticated its callers already (HTTP `Authorization`) and names the tenant; a request
from the edge's certificate is taken as it is.  Any other caller (an operator's client certificate)
meets the edge's rules here, from the same settings (INFERMESH_API_KEYS, INFERMESH_ADMIN_KEYS,
INFERMESH_RATE_LIMIT): `authorization: Bearer KEY` metadata when keys are configured, the key's
tenant for sessions and prefix caches, its request rate, and failed keys limited per peer address.
The edge's token limit (INFERMESH_TOKEN_LIMIT) is the edge's alone.

A plaintext router (--insecure-mesh, debugging) cannot tell the edge from anyone else: it trusts
every caller, as it trusts every caller's certificate kind (mesh/peers.py).
"""

from __future__ import annotations

import time
from collections.abc import Hashable

import grpc

from mesh import peers
from mesh.apikeys import ApiKeys, tenant_of
from mesh.errors import ResourceExhausted, Unauthenticated
from mesh.ratelimit import Limiter, Rate, retry_after_s


class Callers:
    def __init__(self, keys: tuple[bytes, ...] = (), admin_keys: tuple[bytes, ...] = (),
                 rate_limit: Rate | None = None, auth_failure_limit: Rate | None = None):
        self.keys = ApiKeys(keys)
        self.admin_keys = ApiKeys(admin_keys)
        self.rate = Limiter(rate_limit) if rate_limit else None
        self.auth_failures = Limiter(auth_failure_limit) if auth_failure_limit else None

    def tenant(self, context: grpc.aio.ServicerContext, named: str) -> str:
        """The tenant a Generate runs as: the edge's `named` one; a native caller's API key's; with no
        keys configured, its certificate kind's namespace (mesh.peers.tenant_for).  Raises
        Unauthenticated (no or a wrong key) or ResourceExhausted (over its rate, with retry-after)."""
        caller = peers.kind(context)
        if caller is None or caller == peers.TENANT_KIND or not self.keys.enabled:
            return peers.tenant_for(caller, named)
        key = self._key(context, self.keys, "Generate", "API key")
        self._take(self.rate, key, "requests for this API key")
        return tenant_of(key)

    def check_user(self, context: grpc.aio.ServicerContext, rpc: str) -> None:
        """A read-only user RPC (ListModels, ListReplicas, GetModelRouting): an API key when keys are set."""
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
