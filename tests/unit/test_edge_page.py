"""The web page and the console's JSON through the edge's ASGI app (a fake router behind it)."""

import asyncio
import json

from mesh.apikeys import digest
from services.edge.app import EdgeApp
from services.edge.config import EdgeConfig
from tests.fakes.edge_router import FakeRouter, asgi


def _app(**config: object) -> EdgeApp:
    return EdgeApp(EdgeConfig(api_key_digests=(digest("k"),), **config), FakeRouter())  # type: ignore[arg-type]


def test_static_files_are_served_without_a_key_under_a_strict_policy() -> None:
    async def main() -> None:
        app = _app(http3_port=8443)
        status, headers, body = await asgi(app, "GET", "/")
        assert status == 200 and headers["content-type"].startswith("text/html")
        assert "script-src 'self'" in headers["content-security-policy"] and "'unsafe-inline'" not in \
            headers["content-security-policy"]
        assert headers["alt-svc"] == 'h3=":8443"; ma=86400' and headers["x-frame-options"] == "DENY"
        assert b'id="playground"' in body and b'id="console"' in body
        status, headers, _ = await asgi(app, "GET", "/static/app.js", b"", {"if-none-match": headers["etag"]})
        assert status == 200                              # another file: another etag
        status, headers, _ = await asgi(app, "GET", "/static/style.css")
        etag = headers["etag"]
        assert (await asgi(app, "GET", "/static/style.css", b"", {"if-none-match": etag}))[0] == 304
        assert (await asgi(app, "POST", "/"))[0] == 405
        assert (await asgi(app, "GET", "/static/other.js"))[0] == 404
        assert (await asgi(app, "GET", "/v1/models"))[0] == 401       # what the page fetches needs a key

    asyncio.run(main())


def test_the_console_json_needs_an_admin_key() -> None:
    async def main() -> None:
        assert (await asgi(_app(), "GET", "/admin/console", b"", {"authorization": "Bearer k"}))[0] == 403
        app = _app(admin_key_digests=(digest("admin"),))
        assert (await asgi(app, "GET", "/admin/console", b"", {"authorization": "Bearer k"}))[0] == 401
        status, _, body = await asgi(app, "GET", "/admin/console", b"", {"authorization": "Bearer admin"})
        state = json.loads(body)
        assert status == 200 and state["engines"][0]["replica"] == "engine-0" and state["ready"] is True

    asyncio.run(main())
