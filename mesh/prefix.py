"""Chained hashes of full token blocks: the one definition the engines, the router's prefix
affinity and the shared KV-cache service agree on.

Block i's hash covers block i's tokens and, through the previous hash, every token before
it, so equal hashes mean equal prefixes.  The chain starts from a root: the model's namespace,
salted per tenant (`root`), so callers with different salts never share a block nor learn, from a
cache hit's speed or `cached_tokens`, what another sent.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

HASH_BYTES = 16


def block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    h = hashlib.blake2b(parent, digest_size=HASH_BYTES)
    h.update(b"".join(t.to_bytes(4, "little") for t in tokens))
    return h.digest()


def root(namespace: bytes, salt: bytes = b"") -> bytes:
    """The chain's first parent: `namespace` itself unsalted (the model's shared namespace)."""
    if not salt:
        return namespace
    h = hashlib.blake2b(b"infermesh-cache-salt", digest_size=HASH_BYTES)
    h.update(len(namespace).to_bytes(4, "little") + namespace + salt)
    return h.digest()


def tenant_salt(tenant: str) -> bytes:
    """The cache salt of a tenant's requests (the router's --prefix-sharing tenant)."""
    return tenant.encode()


def block_hashes(tokens: Sequence[int], block_size: int, namespace: bytes = b"", salt: bytes = b"") -> list[bytes]:
    """Hashes of every full block of `tokens`; `namespace` keeps models apart, `salt` tenants."""
    hashes: list[bytes] = []
    parent = root(namespace, salt)
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_hash(parent, tokens[start:start + block_size])
        hashes.append(parent)
    return hashes
