"""Sessions belong to their caller: the edge names the caller (tenant), the router keys every
conversation by tenant and session id, so another key naming the same session neither reads
nor appends to it."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from mesh.apikeys import digest
from mesh.errors import InvalidArgument
from services.router.sessions import session_key
from tests.fakes.router_mesh import chat, collect, run, running
from tests.security.edge_driver import Client, SlowRouter, edge

A, B = "key:aaaaaaaaaaaaaaaa", "key:bbbbbbbbbbbbbbbb"


def test_another_tenant_naming_the_session_gets_none_of_its_history() -> None:
    """The finding: key B sending `x-session-id: acme-support` after key A got A's history back."""
    async def scenario() -> None:
        async with running() as mesh:
            await collect(mesh, chat(("user", "The secret code is 4417."), max_tokens=2, session="acme-support",
                                     tenant=A))
            a_history = list(mesh.cache.sessions[f"{A}/acme-support"])
            await collect(mesh, chat(("user", "What is the code?"), max_tokens=2, session="acme-support", tenant=B))
            await collect(mesh, chat(("user", "And now?"), max_tokens=2, session="acme-support"))   # no tenant
            # What the model saw for B and for the tenant-less caller: their own message, nothing of A's.
            assert mesh.tokenizer.templated[1] == [("user", "What is the code?")]
            assert mesh.tokenizer.templated[2] == [("user", "And now?")]
            # A's history is A's alone: neither B nor the native caller appended to it.
            assert mesh.cache.sessions[f"{A}/acme-support"] == a_history
            assert [m for m, _ in a_history] == ["user", "assistant"]
            assert mesh.cache.sessions[f"{B}/acme-support"][0] == ("user", "What is the code?")
            assert mesh.cache.sessions["grpc:/acme-support"][0] == ("user", "And now?")
            # A itself still continues its own conversation.
            await collect(mesh, chat(("user", "Repeat it."), max_tokens=2, session="acme-support", tenant=A))
            assert mesh.tokenizer.templated[3][0] == ("user", "The secret code is 4417.")

    run(scenario)


def test_a_tenant_cannot_spell_another_tenants_key() -> None:
    assert session_key(A, "s") != session_key(B, "s") != session_key("", "s")
    assert session_key(A, "") == ""                     # no session: nothing stored, no affinity
    with pytest.raises(InvalidArgument):
        session_key("key:a/b", "s")                     # "key:a" + "b/s" would collide

    async def scenario() -> None:
        async with running() as mesh:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(mesh, chat(("user", "hi"), session="s", tenant="key:a/b"))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    run(scenario)


def test_the_edge_names_the_tenant_after_the_key_and_never_sends_the_key() -> None:
    async def main() -> None:
        router = SlowRouter(tokens=1, every_s=0)
        app = edge(router, api_key_digests=(digest("key-one"), digest("key-two")))
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                           "user": "acme-support"}).encode()
        for key in ("key-one", "key-two", "key-one"):
            client = Client(app, "/v1/chat/completions", body, {"authorization": f"Bearer {key}"})
            await asyncio.wait_for(client.run(), 5)
            assert client.status == 200
        one, two, again = (spec.tenant for spec in router.calls)
        assert one == again != two
        assert one == "key:" + digest("key-one").hex()[:16]
        assert all("key-one" not in t and "key-two" not in t for t in (one, two))
        # With no keys configured (loopback), the caller is its address.
        open_app = edge(router)
        client = Client(open_app, "/v1/chat/completions", body)
        await asyncio.wait_for(client.run(), 5)
        assert router.calls[-1].tenant == "addr:127.0.0.1"

    asyncio.run(main())
