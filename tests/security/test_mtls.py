"""Issue 16: the services behind the edge accepted anyone who could connect.

Now a service started with the mesh's credentials (mutual TLS, mesh/credentials.py) refuses a
plaintext caller, a TLS caller without a certificate and one whose certificate another CA signed,
and serves the mesh's own client (health and reflection included); `infermesh up` gives every
service its credentials unless told `--insecure-mesh`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from infermesh.launcher import MeshConfig, plan
from mesh import credentials
from mesh.credentials import MeshTLS
from mesh.grpcutil import Service, channel, check_health
from mesh.healthcheck import probe_grpc
from mesh.pki import KINDS, ensure_mesh_ca


@pytest.fixture(scope="module")
def cas(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("pki")
    return ensure_mesh_ca(root / "mesh"), ensure_mesh_ca(root / "other")


@contextlib.asynccontextmanager
async def serving(tls: MeshTLS | None = None, name: str = "meshpb.v1.Cache",
                  register: Callable[[Service], None] | None = None) -> AsyncIterator[str]:
    """A service on a free loopback port (with `register`'s servicers added), for the block's length."""
    service = Service(name, "127.0.0.1", 0, tls=tls)
    if register is not None:
        register(service)
    await service.start()
    await service.ready()
    try:
        yield f"127.0.0.1:{service.port}"
    finally:
        await service.stop(0)


def against_mesh_server(cas: tuple[Path, Path], scenario: Callable[[str], Awaitable[None]]) -> None:
    """Run `scenario(address)` against a service holding the mesh CA's `cache` leaf."""
    async def run() -> None:
        async with serving(MeshTLS.load(cas[0] / "cache")) as address:
            await scenario(address)

    asyncio.run(run())


async def _check(ch: grpc.aio.Channel) -> int:
    reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=3)
    return int(reply.status)


def test_plaintext_caller_is_refused(cas: tuple[Path, Path]) -> None:
    against_mesh_server(cas, plaintext_caller)


async def plaintext_caller(server: str) -> None:
    async with grpc.aio.insecure_channel(server) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _check(ch)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_caller_without_a_certificate_is_refused(cas: tuple[Path, Path]) -> None:
    async def scenario(server: str) -> None:
        await caller_without_certificate(server, cas)

    against_mesh_server(cas, scenario)


async def caller_without_certificate(server: str, cas: tuple[Path, Path]) -> None:
    # It trusts the mesh CA (so the server is fine to it) but has no certificate of its own.
    creds = grpc.ssl_channel_credentials((cas[0] / "ca.crt").read_bytes())
    async with grpc.aio.secure_channel(server, creds, options=credentials.TLS_CHANNEL_OPTIONS) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _check(ch)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_certificate_from_another_ca_is_refused(cas: tuple[Path, Path]) -> None:
    async def scenario(server: str) -> None:
        await other_ca(server, cas)

    against_mesh_server(cas, scenario)


async def other_ca(server: str, cas: tuple[Path, Path]) -> None:
    mesh, other = MeshTLS.load(cas[0] / "client"), MeshTLS.load(cas[1] / "client")
    impostor = MeshTLS(root=mesh.root, cert=other.cert, key=other.key)
    assert not await check_health(server, tls=impostor, timeout=3)
    async with channel(server, impostor) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _check(ch)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    # Nor does the mesh's client trust a server whose certificate another CA signed.
    async with serving(MeshTLS.load(cas[1] / "cache")) as stranger:
        assert not await check_health(stranger, tls=mesh, timeout=3)


def test_mesh_client_gets_health_and_reflection(cas: tuple[Path, Path]) -> None:
    async def scenario(server: str) -> None:
        await mesh_client(server, cas)

    against_mesh_server(cas, scenario)


async def mesh_client(server: str, cas: tuple[Path, Path]) -> None:
    tls = MeshTLS.load(cas[0] / "client")
    assert await check_health(server, tls=tls, timeout=3)
    async with channel(server, tls) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        replies = [r async for r in stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
            list_services="")]))]
    names = {s.name for s in replies[0].list_services_response.service}
    assert {"meshpb.v1.Cache", "grpc.health.v1.Health"} <= names
    # The container probe (mesh/healthcheck.py, blocking: off the loop) with and without the certificate.
    assert await asyncio.to_thread(probe_grpc, server, tls_dir=str(cas[0] / "client")) == ""
    assert await asyncio.to_thread(probe_grpc, server) != ""


def test_process_wide_credentials_reach_every_channel_and_server(
        cas: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    # What run_service does with --tls-dir (or a tool with $INFERMESH_MESH_TLS_DIR): no call site
    # passes credentials itself.
    monkeypatch.setattr(credentials, "_configured", False)
    monkeypatch.setattr(credentials, "_current", None)
    monkeypatch.setenv(credentials.ENV_VAR, str(cas[0] / "router"))

    async def scenario() -> None:
        async with serving() as address:
            assert await check_health(address, timeout=3)
            async with grpc.aio.insecure_channel(address) as ch:
                with pytest.raises(grpc.aio.AioRpcError):
                    await _check(ch)

    asyncio.run(scenario())


def test_infermesh_up_gives_every_service_mesh_credentials(tmp_path: Path) -> None:
    config = MeshConfig(engines=2, fallback_engines=1, mesh_ca=str(tmp_path))
    for child in (c for stage in plan(config) for c in stage):
        kind = child.argv[child.argv.index("-m") + 1].removeprefix("services.")
        assert child.argv[child.argv.index("--tls-dir") + 1] == str(tmp_path / kind), child.name
        assert kind in KINDS
    insecure = MeshConfig(mesh_tls=False)
    assert all("--tls-dir" not in c.argv for stage in plan(insecure) for c in stage)


def test_mesh_ca_keys_are_private_and_leaves_carry_the_hosts(tmp_path: Path) -> None:
    from cryptography import x509

    root = ensure_mesh_ca(tmp_path, ["10.20.0.2", "router:50051"])
    assert (root / "ca.key").stat().st_mode & 0o777 == 0o600
    assert all((root / kind / "tls.key").stat().st_mode & 0o777 == 0o600 for kind in KINDS)
    cert = x509.load_pem_x509_certificate((root / "engine" / "tls.crt").read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    names = {str(n) for n in sans.get_values_for_type(x509.DNSName)}
    names |= {str(n) for n in sans.get_values_for_type(x509.IPAddress)}
    assert {credentials.MESH_NAME, "localhost", "127.0.0.1", "10.20.0.2", "router"} <= names
    before = (root / "ca.crt").read_bytes()
    ensure_mesh_ca(tmp_path, ["10.20.0.3"])          # a new host: same CA, leaves reissued with it
    assert (root / "ca.crt").read_bytes() == before
    assert b"10.20.0.3" not in before
