"""The web page at `/`: a playground (chat with a model, streamed, with what the mesh did under each answer)
and a console (the replicas live, from GET /admin/console).  Plain static files shipped with the package
(services/edge/static/: index.html, app.js, style.css), read once at start; no build step, no
third-party code.

The page runs under a strict Content-Security-Policy (scripts, styles and connections to this origin
only, no inline code, not framable).  It is served without a key; everything it fetches asks for one
when keys are configured (the API key for /v1/models and completions, an admin key for the console).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import grpc

from mesh.clients.router_pool import Routers
from services.edge.errors import from_grpc
from services.edge.transports.asgi import Receive, Scope, Send, send_json

STATIC = Path(__file__).resolve().parent / "static"
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
SECURITY_HEADERS = [(b"content-security-policy", CSP.encode()), (b"x-content-type-options", b"nosniff"),
                    (b"referrer-policy", b"no-referrer"), (b"x-frame-options", b"DENY"),
                    (b"cross-origin-opener-policy", b"same-origin")]
# URL path -> (file under static/, content type)
FILES = {"/": ("index.html", "text/html; charset=utf-8"),
         "/static/app.js": ("app.js", "text/javascript; charset=utf-8"),
         "/static/style.css": ("style.css", "text/css; charset=utf-8")}


class Page:
    def __init__(self, router: Routers):
        self.router = router
        self.files: dict[str, tuple[bytes, bytes, bytes]] = {}      # path -> (body, content type, etag)
        for path, (name, kind) in FILES.items():
            body = (STATIC / name).read_bytes()
            etag = b'"' + hashlib.sha256(body).hexdigest()[:16].encode() + b'"'
            self.files[path] = (body, kind.encode(), etag)

    async def static(self, scope: Scope, headers: dict[str, str], receive: Receive, send: Send) -> int:
        body, kind, etag = self.files[scope["path"]]
        common = [(b"content-type", kind), (b"etag", etag), (b"cache-control", b"no-cache"), *SECURITY_HEADERS]
        if headers.get("if-none-match", "") == etag.decode():
            await send({"type": "http.response.start", "status": 304, "headers": common})
            await send({"type": "http.response.body", "body": b""})
            return 304
        await send({"type": "http.response.start", "status": 200,
                    "headers": [*common, (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
        return 200

    async def console(self, scope: Scope, headers: dict[str, str], receive: Receive, send: Send) -> int:
        """GET /admin/console (admin key): the router's view, as the console page reads it every second."""
        try:
            state: dict[str, Any] = await self.router.state()
        except grpc.aio.AioRpcError as err:
            raise from_grpc(err) from None
        await send_json(send, 200, state)
        return 200
