"""Request heads: the strict rules both front doors apply before a request reaches the app.

Pure: bytes or header lists in, a refusal (status, message) or None out.  HTTP/1.1
(services/edge/transports/http11.py) checks the raw head before h11 parses it, so the size bound holds however
the head arrives (h11's own 16 KiB limit applies only to a head still incomplete) and the forms h11
tolerates but RFC 9112 lets a server refuse never reach it: both Content-Length and
Transfer-Encoding (a request smuggling vector, 6.1), obs-fold (5.2), bare LF line endings (2.2)
and versions other than HTTP/1.0 and 1.1.  HTTP/3 (services/edge/transports/http3.py) bounds the decoded
header list the same way.
"""

from __future__ import annotations

import re
from typing import NamedTuple
from urllib.parse import unquote

from services.edge.transports.asgi import Scope

MAX_HEAD_BYTES = 16 * 1024      # request line + headers, as h11's incomplete-event limit
MAX_HEADERS = 128               # header fields per request; real clients send about 10

_VERSION = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+ \S+ HTTP/1\.[01]")
_END = b"\r\n\r\n"


class Refusal(NamedTuple):
    status: int         # 400 or 431
    message: str


TOO_LARGE = Refusal(431, f"request head is larger than {MAX_HEAD_BYTES} bytes or has more than "
                         f"{MAX_HEADERS} header fields")


def http1_head(buffer: bytes) -> Refusal | None:
    """The refusal for the request head at the start of `buffer` (what h11 has not parsed yet), or
    None when it is fine or still incomplete and within bounds."""
    end = buffer.find(_END, 0, MAX_HEAD_BYTES + len(_END))
    if end < 0:
        if b"\n" in buffer[:MAX_HEAD_BYTES].replace(b"\r\n", b""):
            return Refusal(400, "request head lines must end with CRLF, not a bare LF")
        return TOO_LARGE if len(buffer) > MAX_HEAD_BYTES else None
    lines = buffer[:end].split(b"\r\n")
    if any(b"\n" in line for line in lines):
        return Refusal(400, "request head lines must end with CRLF, not a bare LF")
    if len(lines) - 1 > MAX_HEADERS:
        return TOO_LARGE
    if not _VERSION.fullmatch(lines[0]):
        return Refusal(400, "request line must be METHOD TARGET HTTP/1.1 (or HTTP/1.0)")
    names = []
    for line in lines[1:]:
        if line[:1] in (b" ", b"\t"):
            return Refusal(400, "obsolete line folding (a header line starting with a space or tab) is refused")
        names.append(line.partition(b":")[0].strip().lower())
    if b"content-length" in names and b"transfer-encoding" in names:
        return Refusal(400, "a request may not carry both Content-Length and Transfer-Encoding")
    return None


def h3_headers(raw: list[tuple[bytes, bytes]]) -> Refusal | None:
    """The refusal for an HTTP/3 header list over the same bounds (pseudo-headers count too)."""
    if len(raw) > MAX_HEADERS + 4 or sum(len(n) + len(v) + 4 for n, v in raw) > MAX_HEAD_BYTES:
        return TOO_LARGE
    return None


def h3_scope(raw: list[tuple[bytes, bytes]], client: tuple[str, int] | None, server: tuple[str, int] | None
             ) -> Scope | None:
    """An HTTP/3 header list -> the ASGI scope, or None when its pseudo-headers are malformed."""
    pseudo: dict[bytes, bytes] = {}
    headers: list[tuple[bytes, bytes]] = []
    for name, value in raw:
        if name.startswith(b":"):
            pseudo[name] = value
        elif name.lower() != b"early-data":  # ours to set (RFC 8470 5.1); a client's is a forgery
            headers.append((name.lower(), value))
    method, target = pseudo.get(b":method"), pseudo.get(b":path")
    if not method or not target:
        return None
    raw_path, _, query = target.partition(b"?")
    try:
        path = unquote(raw_path.decode("ascii"))
        method_str = method.decode("ascii")
    except UnicodeDecodeError:
        return None
    # ASGI apps (and OpenAI SDK clients) expect Host; HTTP/3 carries it as :authority.
    authority = pseudo.get(b":authority")
    if authority and not any(n == b"host" for n, _ in headers):
        headers.insert(0, (b"host", authority))
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "3",
        "method": method_str,
        "scheme": "https",
        "path": path,
        "raw_path": raw_path,
        "query_string": query,
        "root_path": "",
        "headers": headers,
        "client": client,
        "server": server,
        "extensions": {},
    }
