"""Issue 49, finding 6: a signing key's DELETE and bodiless POST went unsigned.

`DELETE /v1/responses/{id}`, `DELETE /v1/files/{id}` and `POST /v1/batches/{id}/cancel` with no
signature headers answered 200 and acted: only GETs and the routes that read a JSON body checked the
signature.  Now the app checks it for every method before any route runs (EdgeApp._signed), over the
body as it came (empty for a bodiless request).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from mesh import signing
from services.edge.app import EdgeApp
from tests.fakes.scripted_router import ScriptedRouter, app, request, tokens

KEY, SECRET = "sk-signer", "s3cr3t-signing"
AUTH = {"authorization": f"Bearer {KEY}"}
ACTS = [("DELETE", "/v1/responses/resp_0123"), ("DELETE", "/v1/files/file-0123"),
        ("POST", "/v1/batches/batch_0123/cancel"), ("POST", "/v1/files"), ("POST", "/v1/batches"),
        ("POST", "/v1/responses"), ("POST", "/v1/embeddings"), ("POST", "/tokenize")]


class Forgetful(ScriptedRouter):
    """Counts the conversations the edge asks it to forget."""

    def __init__(self) -> None:
        super().__init__(tokens(["ok"]))
        self.forgotten: list[str] = []

    async def forget_conversation(self, session_id: str, tenant: str = "", timeout: float = 10.0) -> bool:
        self.forgotten.append(session_id)
        return True


@pytest.fixture
def edge(tmp_path: Path) -> tuple[EdgeApp, Forgetful]:
    (tmp_path / "keys").write_text(f"{KEY} tenant=acme signing_secret={SECRET}\n")
    router = Forgetful()
    return app(router, keys_file=str(tmp_path / "keys")), router


@pytest.mark.parametrize(("method", "path"), ACTS)
def test_every_method_needs_the_signature(edge: tuple[EdgeApp, Forgetful], method: str, path: str) -> None:
    app_, router = edge

    async def main() -> None:
        status, _, raw = await request(app_, method, path, headers=AUTH)
        assert status == 401 and json.loads(raw)["error"]["code"] == "invalid_signature"
        assert router.forgotten == [] and router.calls == []
    asyncio.run(main())


def test_a_signed_delete_passes_and_a_replayed_one_does_not(edge: tuple[EdgeApp, Forgetful]) -> None:
    app_, router = edge

    async def main() -> None:
        path = "/v1/responses/resp_0123"
        signed = signing.sign_headers(SECRET, "DELETE", path, headers=AUTH)
        status, _, _ = await request(app_, "DELETE", path, headers=signed)
        assert status != 401 and router.forgotten == ["resp_0123"]
        status, _, raw = await request(app_, "DELETE", path, headers=signed)       # the same nonce again
        assert status == 401 and router.forgotten == ["resp_0123"]
    asyncio.run(main())


def test_a_signed_body_is_checked_once_and_reaches_the_route(edge: tuple[EdgeApp, Forgetful]) -> None:
    app_, router = edge

    async def main() -> None:
        body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 2}).encode()
        signed = signing.sign_headers(SECRET, "POST", "/v1/completions", body, headers=AUTH)
        status, _, raw = await request(app_, "POST", "/v1/completions", body, signed)
        assert status == 200 and json.loads(raw)["choices"][0]["text"] == "ok"
        assert router.calls[0].prompt == "hi"
        # a body other than the signed one is refused before the route reads it
        signed = signing.sign_headers(SECRET, "POST", "/v1/completions", body, headers=AUTH)
        other = body.replace(b"hi", b"ho")
        status, _, _ = await request(app_, "POST", "/v1/completions", other, signed)
        assert status == 401 and len(router.calls) == 1
    asyncio.run(main())
