"""Finding 6 of issue 31 (LOW): what a signing key could do unsigned, and what its signature left out.

A key that must sign got `/health?verbose=1` (the mesh's whole internal state) unsigned and outside
its request rate; and the signature covered method, path, body and time but no header, so a header
that changes the answer (an added `x-session-id`, a pinned replica or version) still verified.  Now
verbose health is an API route like any other for such a key (signed, counted), and the signature
covers `x-session-id` and every `x-infermesh-*` header.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from mesh import signing
from services.edge.app import EdgeApp
from tests.fakes.scripted_router import ScriptedRouter, app, request, tokens

KEY, SECRET = "sk-signer", "s3cr3t-signing"
AUTH = {"authorization": f"Bearer {KEY}"}
CHAT = "/v1/chat/completions"
BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()


@pytest.fixture
def edge(tmp_path: Path) -> tuple[EdgeApp, ScriptedRouter]:
    (tmp_path / "keys").write_text(f"{KEY} tenant=acme tier=free signing_secret={SECRET}\n")
    (tmp_path / "tiers.json").write_text(json.dumps({"free": {"requests": "3/m"}}))
    router = ScriptedRouter(tokens(["ok"]))
    return app(router, keys_file=str(tmp_path / "keys"), tiers_file=str(tmp_path / "tiers.json")), router


def test_verbose_health_needs_the_signature_and_counts_against_the_rate(edge: tuple[EdgeApp, ScriptedRouter]) -> None:
    app_, _ = edge

    async def main() -> None:
        status, _, raw = await request(app_, "GET", "/health?verbose=1", headers=AUTH)
        assert status == 401 and json.loads(raw)["error"]["code"] == "invalid_signature"
        statuses = []
        for _ in range(4):
            signed = signing.sign_headers(SECRET, "GET", "/health?verbose=1", headers=AUTH)
            statuses.append((await request(app_, "GET", "/health?verbose=1", headers=signed))[0])
        assert statuses == [200, 200, 200, 429]               # the free tier's 3 requests a minute
        assert (await request(app_, "GET", "/health"))[0] == 200       # the plain probe stays open
    asyncio.run(main())


@pytest.mark.parametrize("header", ["x-session-id", "x-infermesh-replica", "x-infermesh-model-version",
                                    "x-infermesh-cache"])
def test_a_header_added_to_a_signed_request_breaks_its_signature(edge: tuple[EdgeApp, ScriptedRouter],
                                                                  header: str) -> None:
    app_, router = edge

    async def main() -> None:
        signed = signing.sign_headers(SECRET, "POST", CHAT, BODY, headers=AUTH)
        status, _, raw = await request(app_, "POST", CHAT, BODY, {**signed, header: "other"})
        assert status == 401 and "does not match" in json.loads(raw)["error"]["message"]
        assert not router.calls
        # signed with the header, it passes
        signed = signing.sign_headers(SECRET, "POST", CHAT, BODY, headers={**AUTH, header: "1"})
        assert (await request(app_, "POST", CHAT, BODY, signed))[0] in (200, 404)
    asyncio.run(main())


def test_the_signed_header_lines_are_sorted_and_lower_case() -> None:
    now = time.time()
    a = signing.sign_headers(SECRET, "POST", CHAT, BODY, now=now, nonce="nonce-0001",
                             headers={"X-Session-Id": "s1", "x-infermesh-replica": "engine-0", "accept": "*/*"})
    b = signing.sign_headers(SECRET, "POST", CHAT, BODY, now=now, nonce="nonce-0001",
                             headers={"x-infermesh-replica": "engine-0", "x-session-id": "s1"})
    assert a[signing.SIGNATURE] == b[signing.SIGNATURE]         # other headers are not signed
    lines = signing.signed_headers({"X-Session-Id": "s1", "x-infermesh-nonce": "n", "Accept": "x"})
    assert lines == ["x-session-id:s1"]
