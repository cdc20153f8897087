"""Issue 16: the router's native gRPC interface skipped the edge's API keys, admin keys and rate
limits: with INFERMESH_API_KEYS set, a client certificate's Generate ran unauthenticated on a7f9686,
and SetModelRouting needed no admin key.

Now (services/router/callers.py) a caller other than the edge sends `authorization: Bearer KEY`
metadata when keys are configured, runs as that key's tenant (the one the edge gives the same
key), meets its request rate, and an admin RPC asks for an admin key.  The edge is trusted as
before: it checked the key itself.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from mesh.apikeys import digest, tenant_of
from mesh.credentials import MeshTLS
from mesh.grpcutil import Service, channel
from mesh.pki import ensure_mesh_ca
from mesh.ratelimit import Rate
from meshpb.v1 import router_pb2, router_pb2_grpc
from services.router.callers import Callers
from tests.security.test_mtls import serving
from tests.security.test_peers import _Recorder, bare_router

KEY, OTHER, ADMIN = "sk-alpha", "sk-beta", "sk-admin"
Outcome = tuple[str, str]          # (status code name, detail)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_mesh_ca(tmp_path_factory.mktemp("pki") / "mesh")


def calls(pki: Path, caller: str, steps: list[tuple[str, str]], rate: Rate | None = None,
          failures: Rate | None = None) -> tuple[list[Outcome], list[str]]:
    """Run (rpc, key) steps as a `caller` leaf against a TLS router with keys configured; the
    outcome of each and the tenants the Generates ran as."""
    recorder = _Recorder()
    callers = Callers((digest(KEY), digest(OTHER)), (digest(ADMIN),), rate, failures)
    servicer = bare_router(recorder, callers)
    outcomes: list[Outcome] = []

    async def run() -> None:
        def register(service: Service) -> None:
            router_pb2_grpc.add_RouterServicer_to_server(servicer, service.server)

        async with serving(MeshTLS.load(pki / "router"), "meshpb.v1.Router", register) as address:
            async with channel(address, MeshTLS.load(pki / caller)) as ch:
                stub = router_pb2_grpc.RouterStub(ch)
                for rpc, key in steps:
                    metadata = (("authorization", f"Bearer {key}"),) if key else ()
                    try:
                        if rpc == "Generate":
                            request = router_pb2.RouterGenerateRequest(tenant="acme")
                            async for _ in stub.Generate(request, timeout=5, metadata=metadata):
                                pass
                        elif rpc == "SetModelRouting":
                            await stub.SetModelRouting(router_pb2.SetModelRoutingRequest(model="m"), timeout=5,
                                                       metadata=metadata)
                        else:
                            await stub.ListReplicas(router_pb2.ListReplicasRequest(), timeout=5, metadata=metadata)
                        outcomes.append(("OK", ""))
                    except grpc.aio.AioRpcError as err:
                        outcomes.append((err.code().name, err.details() or ""))

    asyncio.run(run())
    return outcomes, recorder.tenants


def test_native_generate_needs_a_key(pki: Path) -> None:
    outcomes, tenants = calls(pki, "client", [("Generate", ""), ("Generate", "sk-wrong"), ("Generate", KEY),
                                              ("Generate", OTHER)])
    assert [code for code, _ in outcomes] == ["UNAUTHENTICATED", "UNAUTHENTICATED", "OK", "OK"]
    assert "authorization: Bearer KEY" in outcomes[0][1]
    # each key is its own tenant, the one the edge would give it: never the "acme" it named
    assert tenants == [tenant_of(digest(KEY)), tenant_of(digest(OTHER))]


def test_the_edge_is_trusted_with_its_tenant(pki: Path) -> None:
    outcomes, tenants = calls(pki, "edge", [("Generate", ""), ("ListReplicas", "")])
    assert [code for code, _ in outcomes] == ["OK", "OK"]
    assert tenants == ["acme"]


def test_list_replicas_needs_a_key(pki: Path) -> None:
    outcomes, _ = calls(pki, "client", [("ListReplicas", ""), ("ListReplicas", KEY)])
    assert [code for code, _ in outcomes] == ["UNAUTHENTICATED", "OK"]


def test_admin_rpc_needs_the_admin_key(pki: Path) -> None:
    outcomes, _ = calls(pki, "client", [("SetModelRouting", ""), ("SetModelRouting", KEY),
                                        ("SetModelRouting", ADMIN)])
    # past the key check the stand-in admin knows no model: NOT_FOUND
    assert [code for code, _ in outcomes] == ["UNAUTHENTICATED", "UNAUTHENTICATED", "NOT_FOUND"]
    assert "admin key" in outcomes[1][1]


def test_a_keys_request_rate_is_limited(pki: Path) -> None:
    outcomes, _ = calls(pki, "client", [("Generate", KEY)] * 3 + [("Generate", OTHER)], rate=Rate(2, 60))
    assert [code for code, _ in outcomes] == ["OK", "OK", "RESOURCE_EXHAUSTED", "OK"]
    assert "limit 2/m" in outcomes[2][1]


def test_failed_keys_are_limited_per_address(pki: Path) -> None:
    outcomes, _ = calls(pki, "client", [("Generate", "sk-guess")] * 3 + [("Generate", KEY)], failures=Rate(3, 60))
    assert [code for code, _ in outcomes] == ["UNAUTHENTICATED"] * 3 + ["RESOURCE_EXHAUSTED"]
