"""Issue 16: any holder of a mesh certificate could call any RPC, and the router trusted `tenant`.

Now each servicer admits only the certificate kinds (subject CN) that call it (mesh/peers.py):
an engine leaf cannot read sessions nor set routing, and a `tenant` is honoured only from the edge.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from mesh import peers
from mesh.credentials import MeshTLS
from mesh.errors import NotFound
from mesh.grpcutil import Service, channel
from mesh.pki import ensure_mesh_ca
from meshpb.v1 import cache_pb2, cache_pb2_grpc, router_pb2, router_pb2_grpc
from services.cache.server import CacheServicer, add_to
from services.cache.sessions import SessionStore
from services.cache.store import BlockStore
from services.router.callers import Callers
from services.router.request import Reply
from services.router.server import RouterServicer
from tests.security.test_mtls import serving


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_mesh_ca(tmp_path_factory.mktemp("pki") / "mesh")


def cache_call(pki: Path, caller: str) -> grpc.StatusCode:
    """GetSession on a TLS cache (holding the `cache` leaf) as a `caller` leaf; its status code."""
    async def run() -> grpc.StatusCode:
        servicer = CacheServicer(SessionStore(ttl_s=60), BlockStore.create(hot_bytes=1 << 20))
        async with serving(MeshTLS.load(pki / "cache"), "meshpb.v1.Cache", lambda s: add_to(s, servicer)) as address:
            async with channel(address, MeshTLS.load(pki / caller)) as ch:
                try:
                    await cache_pb2_grpc.CacheStub(ch).GetSession(cache_pb2.SessionRequest(session_id="t/s"),
                                                                  timeout=5)
                except grpc.aio.AioRpcError as err:
                    return err.code()
                return grpc.StatusCode.OK

    return asyncio.run(run())


def test_engine_certificate_cannot_read_sessions(pki: Path) -> None:
    assert cache_call(pki, "engine") == grpc.StatusCode.PERMISSION_DENIED


def test_router_certificate_reads_sessions(pki: Path) -> None:
    assert cache_call(pki, "router") == grpc.StatusCode.OK


class _Recorder:
    """Stands in for the router's Dispatcher: remembers the tenant it was handed."""

    def __init__(self) -> None:
        self.tenants: list[str] = []

    async def generate(self, request: Any, request_id: str, context: Any, admit: Any = None) -> AsyncIterator[Reply]:
        self.tenants.append(request.tenant)
        yield Reply(text="ok")

    def resolve(self, model: str) -> str:          # as the Admin: past the check, the model is unknown
        raise NotFound(f"model {model!r}")

    def load_entropy(self, now: float) -> float:   # as the Admin: an empty replica table
        return 0.0

    def replicas(self, now: float) -> list[Any]:
        return []


def bare_router(recorder: _Recorder, callers: Callers | None = None) -> RouterServicer:
    """The router's handlers only (no watch, no upstreams), `recorder` standing in for the rest."""
    servicer = RouterServicer.__new__(RouterServicer)
    servicer.dispatcher = recorder                        # type: ignore[assignment]
    servicer.admin = recorder                             # type: ignore[assignment]
    servicer.callers = callers or Callers()
    servicer.watch = SimpleNamespace(ready=lambda: True, tokenizer_healthy=True)   # type: ignore[assignment]
    servicer.config = SimpleNamespace(expected_engines=1)                          # type: ignore[assignment]
    return servicer


def router_calls(pki: Path, callers: list[str]) -> tuple[list[str], dict[str, grpc.StatusCode]]:
    """Generate (tenant "acme") and SetModelRouting from each caller on a TLS router servicer."""
    recorder = _Recorder()
    servicer = bare_router(recorder)
    codes: dict[str, grpc.StatusCode] = {}

    async def run() -> None:
        def register(service: Service) -> None:
            router_pb2_grpc.add_RouterServicer_to_server(servicer, service.server)

        async with serving(MeshTLS.load(pki / "router"), "meshpb.v1.Router", register) as address:
            for caller in callers:
                async with channel(address, MeshTLS.load(pki / caller)) as ch:
                    stub = router_pb2_grpc.RouterStub(ch)
                    async for _ in stub.Generate(router_pb2.RouterGenerateRequest(tenant="acme"), timeout=5):
                        pass
                    try:
                        await stub.SetModelRouting(router_pb2.SetModelRoutingRequest(model="m"), timeout=5)
                        codes[caller] = grpc.StatusCode.OK
                    except grpc.aio.AioRpcError as err:
                        codes[caller] = err.code()

    asyncio.run(run())
    return recorder.tenants, codes


def test_only_the_edge_names_a_tenant_and_sets_routing(pki: Path) -> None:
    tenants, codes = router_calls(pki, ["edge", "client", "engine"])
    assert tenants == ["acme", "peer:client", "peer:engine"]
    assert codes["engine"] == grpc.StatusCode.PERMISSION_DENIED
    # edge and client pass the check, then the stand-in admin knows no model
    assert codes["edge"] == codes["client"] == grpc.StatusCode.NOT_FOUND


def test_tenant_rule_and_plaintext() -> None:
    assert peers.tenant_for("edge", "k-123") == "k-123"
    assert peers.tenant_for("client", "k-123") == "peer:client"
    assert peers.tenant_for("", "k-123") == "peer:nameless"
    assert peers.tenant_for(None, "k-123") == "k-123"            # --insecure-mesh: no peer, as before
    assert peers.permits(None, peers.SESSIONS)
    assert not peers.permits("engine", peers.SESSIONS)
    assert not peers.permits("", peers.ENGINE)
