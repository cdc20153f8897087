"""HMAC-signed requests: what a client signs, how it signs, and how the edge checks it.  Pure: `now` in.

A key with a signing secret (the keys file's `signing_secret=`) must sign every request:

    x-infermesh-timestamp: Unix seconds          (within WINDOW_S of the edge's clock)
    x-infermesh-nonce:     8 to 128 characters [A-Za-z0-9_-], never used twice within the window
    x-infermesh-signature: hex HMAC-SHA256(secret, METHOD "\\n" PATH[?QUERY] "\\n" TIMESTAMP "\\n" NONCE
                                             "\\n" hex SHA-256(body) ["\\n" NAME ":" VALUE]...)

The NAME:VALUE lines are the headers that change an answer, those present on the request, sorted by
name, names lower case, values as sent: `x-session-id` and every `x-infermesh-*` header but the three
above (`x-infermesh-replica`, `x-infermesh-model-version`, `x-infermesh-cache`, ...).  A header added
to a signed request (a session it did not name, a pinned replica) makes the signature fail.

`sign_headers` makes them (tests, clients in Python).  The nonce cache is one edge's: a request replayed
to another edge replica within the window is not caught there (docs/operations.md, "Gateway policies").
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Mapping

WINDOW_S = 300.0
TIMESTAMP, NONCE, SIGNATURE = "x-infermesh-timestamp", "x-infermesh-nonce", "x-infermesh-signature"
_NONCE = re.compile(r"[A-Za-z0-9_-]{8,128}")


class BadSignature(Exception):
    """Why a request's signature was refused, in words a client can act on."""


def signed_headers(headers: Mapping[str, str]) -> list[str]:
    """The `name:value` lines a signature covers, from a request's headers (names lower case)."""
    return sorted(f"{k}:{v}" for k, v in ((k.lower(), v) for k, v in headers.items())
                  if (k == "x-session-id" or k.startswith("x-infermesh-")) and k not in (TIMESTAMP, NONCE, SIGNATURE))


def canonical(method: str, path: str, timestamp: str, nonce: str, body: bytes,
              headers: Mapping[str, str] | None = None) -> bytes:
    return "\n".join((method.upper(), path, timestamp, nonce, hashlib.sha256(body).hexdigest(),
                      *signed_headers(headers or {}))).encode()


def signature(secret: bytes, method: str, path: str, timestamp: str, nonce: str, body: bytes,
              headers: Mapping[str, str] | None = None) -> str:
    return hmac.new(secret, canonical(method, path, timestamp, nonce, body, headers), hashlib.sha256).hexdigest()


def sign_headers(secret: bytes | str, method: str, path: str, body: bytes = b"", now: float | None = None,
                 nonce: str | None = None, headers: Mapping[str, str] | None = None) -> dict[str, str]:
    """The three headers for one request that will also carry `headers` (those a signature covers are
    signed: `x-session-id`, `x-infermesh-*`); the result holds `headers` too, ready to send."""
    key = secret.encode() if isinstance(secret, str) else secret
    stamp = str(int(time.time() if now is None else now))
    nonce = nonce or secrets.token_urlsafe(18)
    return {**(headers or {}), TIMESTAMP: stamp, NONCE: nonce,
            SIGNATURE: signature(key, method, path, stamp, nonce, body, headers)}


class NonceCache:
    """Nonces seen within the window, per signer; bounded (the oldest go first past `max_entries`, and an
    entry older than the window is useless anyway: its timestamp would be refused)."""

    def __init__(self, window_s: float = WINDOW_S, max_entries: int = 1_000_000):
        self.window_s = window_s
        self.max_entries = max_entries
        self._seen: OrderedDict[tuple[object, str], float] = OrderedDict()

    def add(self, signer: object, nonce: str, now: float) -> bool:
        """False when the nonce was used by this signer within the window."""
        while self._seen:
            (oldest, at) = next(iter(self._seen.items()))
            if at > now - 2 * self.window_s and len(self._seen) < self.max_entries:
                break
            del self._seen[oldest]
        key = (signer, nonce)
        if key in self._seen:
            return False
        self._seen[key] = now
        return True


def verify(secret: bytes, signer: object, method: str, path: str, headers: dict[str, str], body: bytes,
           now: float, nonces: NonceCache) -> None:
    """Raise BadSignature unless the request is signed by `secret`, fresh, and not seen before."""
    stamp, nonce, given = headers.get(TIMESTAMP, ""), headers.get(NONCE, ""), headers.get(SIGNATURE, "")
    if not (stamp and nonce and given):
        missing = [h for h, v in ((TIMESTAMP, stamp), (NONCE, nonce), (SIGNATURE, given)) if not v]
        raise BadSignature(f"this API key must sign its requests: missing {', '.join(missing)} "
                           "(HMAC-SHA256; see docs/operations.md, 'Signed requests')")
    if not (stamp.isascii() and stamp.isdigit()):
        raise BadSignature(f"{TIMESTAMP} must be Unix seconds, got {stamp[:32]!r}")
    skew = now - int(stamp)
    if abs(skew) > nonces.window_s:
        raise BadSignature(f"the request's timestamp is {abs(skew):.0f} s {'old' if skew > 0 else 'ahead'}: "
                           f"signed requests must be within {nonces.window_s:g} s of the server's clock")
    if not _NONCE.fullmatch(nonce):
        raise BadSignature(f"{NONCE} must be 8 to 128 characters of letters, digits, '-' or '_'")
    expected = signature(secret, method, path, stamp, nonce, body, headers)
    if not hmac.compare_digest(expected, given.strip().lower()):
        raise BadSignature(f"{SIGNATURE} does not match: sign METHOD, PATH, TIMESTAMP, NONCE, the body's "
                           "SHA-256 and the request's x-session-id and x-infermesh-* headers (NAME:VALUE, sorted), "
                           "newline-separated, with HMAC-SHA256 and this key's signing secret")
    if not nonces.add(signer, nonce, now):
        raise BadSignature(f"this {NONCE} was already used: a replayed request is refused")
