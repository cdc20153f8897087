"""0-RTT over real QUIC on loopback: tickets, early data, and what a replayed first flight can do."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import ssl
import stat
import time
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

import pytest
from aioquic.h3.connection import H3_ALPN, H3Connection
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.tls import SessionTicket

from mesh.clients.http3 import H3Client
from mesh.clients.tickets import TicketStore
from services.edge.transports.tls import ensure_self_signed_cert
from services.edge.transports.zero_rtt import SessionTicketStore, replay_tolerable
from tests.service.test_http3_server import read_body, run_with_server

CHAT = "/v1/chat/completions"
BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()


@pytest.fixture(scope="module")
def cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    return ensure_self_signed_cert(str(tmp_path_factory.mktemp("tls")))


class Recorder:
    """Echoes each request as JSON and records what the app saw (one entry per invocation)."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

    async def __call__(self, scope: MutableMapping[str, Any], receive: Callable, send: Callable) -> None:
        body = await read_body(receive)
        seen = {"path": scope["path"], "headers": {k.decode(): v.decode() for k, v in scope["headers"]},
                "body": body.decode()}
        self.seen.append(seen)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": json.dumps(seen).encode()})


def run(cert: tuple[str, str], check: Callable[[int, Recorder], Awaitable[None]]) -> None:
    run_with_server(cert, check, Recorder(), ticket_store=SessionTicketStore())


async def _first_ticket(port: int, tickets: TicketStore | None = None) -> SessionTicket:
    async with H3Client("127.0.0.1", port, verify=False, tickets=tickets) as c:
        assert (await c.request("GET", "/health")).status == 200
        assert not c.resumed and c.early_data_accepted is None
    assert c.session_ticket is not None and c.session_ticket.max_early_data_size is not None
    return c.session_ticket


def test_second_connection_sends_request_as_accepted_early_data(cert: tuple[str, str], tmp_path: Path) -> None:
    path = tmp_path / "tickets.json"

    async def check(port: int, app: Recorder) -> None:
        await _first_ticket(port, TicketStore(path))
        # A new store on the same file: a later `infermesh chat --http3` process.
        async with H3Client("127.0.0.1", port, verify=False, tickets=TicketStore(path)) as c:
            async with c.stream("POST", CHAT, {"content-type": "application/json"}, BODY) as s:
                got = json.loads(await s.read())
            assert s.status == 200 and s.zero_rtt
            assert c.resumed and c.early_data_sent and c.early_data_accepted
            assert c.handshake_summary().startswith("0-RTT: resumed")
            # A second request on the connection goes after the handshake, in 1-RTT.
            async with c.stream("GET", "/health") as s2:
                assert not s2.zero_rtt and "early-data" not in json.loads(await s2.read())["headers"]
        # Server side: the app ran the request before the handshake completed, from early data.
        assert got["headers"]["early-data"] == "1" and got["body"] == BODY.decode()
        assert app.seen[-2] == got
        # The connection brought the next ticket back, for the next run.
        assert TicketStore(path).take(c.ticket_key) is not None

    run(cert, check)


def test_ticket_is_single_use_so_a_reused_ticket_gets_no_early_data(cert: tuple[str, str]) -> None:
    async def check(port: int, app: Recorder) -> None:
        ticket = await _first_ticket(port)
        async with H3Client("127.0.0.1", port, verify=False, session_ticket=ticket) as c:
            assert (await c.request("POST", CHAT, body=BODY)).status == 200
            assert c.early_data_accepted
        # The same ticket again, as an attacker replaying the ClientHello would present it:
        # the server has forgotten it, so no resumption and no early data; the request is
        # resent after a full handshake, which proves it comes from the real client.
        async with H3Client("127.0.0.1", port, verify=False, session_ticket=ticket) as c:
            async with c.stream("POST", CHAT, body=BODY) as s:
                got = json.loads(await s.read())
            assert s.status == 200 and not s.zero_rtt
            assert c.early_data_sent and c.early_data_accepted is False and not c.resumed
            assert "refused" in c.handshake_summary()
        assert "early-data" not in got["headers"] and got["body"] == BODY.decode()

    run(cert, check)


def test_replayed_first_flight_runs_only_replay_tolerable_requests(cert: tuple[str, str]) -> None:
    """A first flight sent without ever finishing the handshake, as a replay would be.

    The plain completion runs from early data; the session turn is held for a handshake
    that never comes, so the app never sees it.
    """

    async def check(port: int, app: Recorder) -> None:
        ticket = await _first_ticket(port)
        config = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN, server_name="localhost",
                                   verify_mode=ssl.CERT_NONE, session_ticket=ticket)
        quic = QuicConnection(configuration=config)
        quic.connect(("127.0.0.1", port), now=time.monotonic())
        h3 = H3Connection(quic)
        for path, extra in (("/v1/completions", []), (CHAT, [(b"x-session-id", b"s1")])):
            stream_id = quic.get_next_available_stream_id()
            h3.send_headers(stream_id, [(b":method", b"POST"), (b":scheme", b"https"),
                                        (b":authority", b"localhost"), (b":path", path.encode()), *extra])
            h3.send_data(stream_id, BODY, end_stream=True)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            for data, _ in quic.datagrams_to_send(now=time.monotonic()):
                sock.sendto(data, ("127.0.0.1", port))
            while not any(seen["path"] == "/v1/completions" for seen in app.seen):
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.5)  # ample time for the held request, were it to run
        early = [seen for seen in app.seen if seen["path"] != "/health"]
        assert [seen["path"] for seen in early] == ["/v1/completions"]
        assert early[0]["headers"]["early-data"] == "1"

    run(cert, check)


def test_session_request_in_early_data_waits_for_the_handshake_then_runs(cert: tuple[str, str]) -> None:
    async def check(port: int, app: Recorder) -> None:
        ticket = await _first_ticket(port)
        async with H3Client("127.0.0.1", port, verify=False, session_ticket=ticket) as c:
            async with c.stream("POST", CHAT, {"x-session-id": "s1"}, BODY) as s:
                got = json.loads(await s.read())
            assert s.status == 200 and c.early_data_accepted
        assert "early-data" not in got["headers"] and got["headers"]["x-session-id"] == "s1"

    run(cert, check)


def test_client_cannot_forge_the_early_data_header(cert: tuple[str, str]) -> None:
    async def check(port: int, app: Recorder) -> None:
        async with H3Client("127.0.0.1", port, verify=False) as c:
            r = await c.request("GET", "/health", {"early-data": "1"})
        assert "early-data" not in json.loads(r.body)["headers"]

    run(cert, check)


def _scope(method: str, path: str, headers: list[tuple[bytes, bytes]] | None = None) -> dict[str, Any]:
    return {"method": method, "path": path, "headers": headers or []}


def test_replay_tolerable_policy() -> None:
    assert replay_tolerable(_scope("GET", "/v1/models"), b"")
    assert replay_tolerable(_scope("POST", CHAT), BODY)
    assert replay_tolerable(_scope("POST", "/v1/completions"), b"not json")  # a 400 either way
    assert not replay_tolerable(_scope("POST", CHAT, [(b"x-session-id", b"s")]), BODY)
    assert not replay_tolerable(_scope("POST", CHAT), json.dumps({"user": "alice", "messages": []}).encode())
    assert not replay_tolerable(_scope("POST", "/admin/models/reload"), b"")
    assert not replay_tolerable(_scope("DELETE", "/v1/models/x"), b"")


def test_ticket_store_file_is_private_single_use_and_survives_corruption(tmp_path: Path) -> None:
    import datetime

    from aioquic.tls import CipherSuite

    now = datetime.datetime.now(datetime.UTC)
    ticket = SessionTicket(age_add=7, cipher_suite=CipherSuite.AES_128_GCM_SHA256,
                           not_valid_after=now + datetime.timedelta(hours=1), not_valid_before=now,
                           resumption_secret=b"\x01" * 32, server_name="localhost", ticket=b"\x02" * 64,
                           max_early_data_size=0xFFFFFFFF, other_extensions=[(57, b"\x03\x04")])
    path = tmp_path / "home" / "h3-tickets.json"
    TicketStore(path).put("localhost@h:1", ticket)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600  # it holds resumption secrets
    assert TicketStore(path).take("localhost@h:1") == ticket
    assert TicketStore(path).take("localhost@h:1") is None  # taken means gone, from the file too
    expired = SessionTicket(**{**ticket.__dict__, "not_valid_after": now - datetime.timedelta(seconds=1)})
    TicketStore(path).put("localhost@h:2", expired)
    assert TicketStore(path).take("localhost@h:2") is None
    path.write_text("{not json")
    assert TicketStore(path).take("localhost@h:1") is None


def test_server_ticket_store_is_bounded_and_single_use() -> None:
    store = SessionTicketStore(max_tickets=2)
    made = [SessionTicket(age_add=0, cipher_suite=0, not_valid_after=None, not_valid_before=None,  # type: ignore[arg-type]
                          resumption_secret=b"", server_name="", ticket=bytes([i])) for i in range(3)]
    for t in made:
        store.add(t)
    assert store.pop(b"\x00") is None  # the oldest went first
    assert store.pop(b"\x01") is made[1] and store.pop(b"\x01") is None
