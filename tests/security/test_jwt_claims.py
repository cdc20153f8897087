"""Finding 7 of issue 31 (LOW): a JWT `tenant` claim with a trailing newline was a new tenant.

The claim was checked with a `$`-anchored pattern, which lets one trailing newline through: `acme\\n`
became a tenant of its own and a metric label.  Now names are matched whole (and so are the keys
file's tenant and tier names, tier names in the tiers file and model names).
"""

from __future__ import annotations

import asyncio
import json
import time

import jwt
import pytest

from services.edge.gateway.jwt_auth import JwtRefused, JwtVerifier
from services.edge.gateway.tenants import TenantTier, parse_keys, parse_tiers
from tests.fakes.scripted_router import ScriptedRouter, app, request, tokens

SECRET = "a-secret-of-at-least-32-bytes-for-hs256!"


def _token(tenant: str) -> str:
    return jwt.encode({"tenant": tenant, "exp": time.time() + 60}, SECRET, algorithm="HS256")


@pytest.mark.parametrize("tenant", ["acme\n", "acme\r\n", " acme", "acme "])
def test_a_tenant_claim_with_white_space_around_it_is_refused(tenant: str) -> None:
    with pytest.raises(JwtRefused, match="tenant"):
        JwtVerifier(SECRET).verify(_token(tenant))
    assert JwtVerifier(SECRET).verify(_token("acme")).tenant == "acme"


def test_the_edge_answers_401_to_such_a_token() -> None:
    async def main() -> None:
        router = ScriptedRouter(tokens(["ok"]))
        edge = app(router, jwt_secret=SECRET)
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        status, _, raw = await request(edge, "POST", "/v1/chat/completions", body,
                                       {"authorization": f"Bearer {_token('acme' + chr(10))}"})
        assert status == 401 and json.loads(raw)["error"]["code"] == "invalid_token" and not router.calls
        status, _, _ = await request(edge, "POST", "/v1/chat/completions", body,
                                     {"authorization": f"Bearer {_token('acme')}"})
        assert status == 200
    asyncio.run(main())


def test_names_in_the_keys_and_tiers_files_are_matched_whole() -> None:
    with pytest.raises(ValueError):
        parse_tiers(json.dumps({"gold\n": {}}), TenantTier("standard"))
    assert parse_keys("k1 tenant=acme")[next(iter(parse_keys("k1 tenant=acme")))].tenant == "acme"
