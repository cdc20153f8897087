"""API keys: stored as SHA-256 digests, compared in constant time; read by the edge and, for native
gRPC callers, the router (the same INFERMESH_API_KEYS / INFERMESH_ADMIN_KEYS)."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
from collections.abc import Iterable
from pathlib import Path


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def load_keys(env: dict[str, str] | None = None, variable: str = "INFERMESH_API_KEYS") -> tuple[bytes, ...]:
    """Digests of the keys in INFERMESH_API_KEYS (comma-separated) and INFERMESH_API_KEYS_FILE
    (one key per line, # comments; the edge's tenant, tier and signing fields after the key are not
    read here: services/edge/gateway/tenants.py).  The plain keys are not kept.  variable="INFERMESH_ADMIN_KEYS"
    reads the admin API's keys the same way."""
    env = dict(os.environ) if env is None else env
    keys = [k.strip() for k in env.get(variable, "").split(",")]
    path = env.get(f"{variable}_FILE")
    if path:
        for line in Path(path).read_text().splitlines():
            words = line.split("#", 1)[0].split()
            keys.extend(words[:1])
    return tuple(sorted({digest(k) for k in keys if k}))


def find_digest(key: str, digests: Iterable[bytes]) -> bytes | None:
    """The digest among `digests` that `key` hashes to, or None; every digest is compared, in constant
    time (how long it takes tells nothing about which key, if any, was close)."""
    probe = digest(key)
    found = None
    for d in digests:
        if hmac.compare_digest(probe, d):
            found = d
    return found


def tenant_of(key_digest: bytes) -> str:
    """The tenant an API key's caller runs as (sessions and prefix caches are namespaced by it):
    stable and not a secret, its SHA-256 digest cut to 16 hex digits (64 bits: keys do not collide,
    and neither the key nor its whole digest leaves the service that checked it)."""
    return "key:" + key_digest.hex()[:16]


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ApiKeys:
    def __init__(self, digests: tuple[bytes, ...]):
        self.digests = digests

    @property
    def enabled(self) -> bool:
        return bool(self.digests)

    def match(self, authorization: str) -> bytes | None:
        """The digest of the configured key in `Bearer <key>`, or None; every digest is compared, in
        constant time.  The digest names the caller for rate limits without keeping the key."""
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return None
        return find_digest(key.strip(), self.digests)

    def check(self, authorization: str) -> bool:
        """True for `Bearer <a configured key>`, and for anything when no keys are configured."""
        return not self.enabled or self.match(authorization) is not None
