"""Chained hashes of full token blocks: the one definition the engines, the router's prefix
affinity and the shared KV-cache service agree on.

Block i's hash covers block i's tokens and, through the previous hash, every token before
it, so equal hashes mean equal prefixes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

HASH_BYTES = 16


def block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    h = hashlib.blake2b(parent, digest_size=HASH_BYTES)
    h.update(b"".join(t.to_bytes(4, "little") for t in tokens))
    return h.digest()


def block_hashes(tokens: Sequence[int], block_size: int, namespace: bytes = b"") -> list[bytes]:
    """Hashes of every full block of `tokens`; `namespace` keeps models apart."""
    hashes: list[bytes] = []
    parent = namespace
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_hash(parent, tokens[start:start + block_size])
        hashes.append(parent)
    return hashes
