"""Abandoned requests are cancelled: at the edge (whole answers as well as streams) and from the router
to the engine, and the edge's in-flight place lives exactly as long as the request."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

from mesh.clients.http3 import H3Client
from meshpb.v1 import engine_pb2
from services.edge.config import EdgeConfig
from services.edge.transports.http11 import http_server
from services.edge.transports.tls import ensure_self_signed_cert
from tests.fakes.router_mesh import FakeEngine, chat, run, running, until
from tests.security.edge_driver import Client, SlowRouter, edge
from tests.service.test_http3_server import run_with_server

CHAT = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1500})


async def _abandon(stream: bool) -> tuple[SlowRouter, Client, int]:
    router = SlowRouter()
    app = edge(router, max_concurrent=4)
    body = json.loads(CHAT)
    client = Client(app, "/v1/chat/completions", json.dumps({**body, "stream": stream}).encode())
    request = asyncio.create_task(client.run())
    await asyncio.wait_for(router.started.wait(), 5)
    await asyncio.sleep(0.05)                          # a few tokens are generated
    assert app.admission.in_flight.count == 1
    client.leave()
    # The app lets go (the router's answer never ends by itself): a bound generous enough for a loaded machine.
    await asyncio.wait_for(request, 10.0)
    return router, client, app.admission.in_flight.count


def test_a_whole_answer_whose_client_left_is_cancelled_and_frees_its_place() -> None:
    async def main() -> None:
        router, client, in_flight = await _abandon(stream=False)
        assert router.cancelled == 1                   # the router call (the gRPC stream) was cancelled
        assert in_flight == 0
        assert client.status is None                   # nobody to answer

    asyncio.run(main())


def test_a_stream_whose_client_left_is_cancelled_and_frees_its_place() -> None:
    async def main() -> None:
        router, client, in_flight = await _abandon(stream=True)
        assert router.cancelled == 1 and in_flight == 0
        assert client.status == 200                    # headers went out before the client left

    asyncio.run(main())


def test_four_abandoned_requests_do_not_lock_out_other_callers() -> None:
    """The finding: four fire-and-forget max_tokens 1500 requests held `--max-concurrent 4`."""
    async def main() -> None:
        router = SlowRouter()
        app = edge(router, max_concurrent=4)
        clients = [Client(app, "/v1/chat/completions", CHAT.encode()) for _ in range(4)]
        tasks = [asyncio.create_task(c.run()) for c in clients]
        await until(lambda: len(router.calls) == 4, "four requests in flight", 5)
        for c in clients:
            c.leave()
        await asyncio.wait_for(asyncio.gather(*tasks), 10.0)
        assert router.cancelled == 4 and app.admission.in_flight.count == 0
        late = Client(app, "/v1/chat/completions", CHAT.encode())      # another caller: admitted, not 503
        task = asyncio.create_task(late.run())
        await until(lambda: len(router.calls) == 5, "the fifth request admitted", 5)
        late.leave()
        await asyncio.wait_for(task, 10.0)
        assert late.status is None and app.admission.in_flight.count == 0

    asyncio.run(main())


def test_a_whole_answer_still_arrives_when_the_client_stays() -> None:
    async def main() -> None:
        router = SlowRouter(tokens=3, every_s=0.001)
        app = edge(router)
        client = Client(app, "/v1/chat/completions", CHAT.encode())
        await asyncio.wait_for(client.run(), 5)
        assert client.status == 200 and router.cancelled == 0 and app.admission.in_flight.count == 0
        answer = json.loads(b"".join(m.get("body", b"") for m in client.sent[1:]))
        assert answer["choices"][0]["message"]["content"] == "t t t "

    asyncio.run(main())


class HangingEngine(FakeEngine):
    """Sends one token, then waits forever; notes whether its caller cancelled the call."""

    cancelled: asyncio.Event | None = None

    async def Generate(self, request: engine_pb2.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[engine_pb2.GenerateResponse]:
        self.script.calls.append((self.replica_id, request))
        try:
            yield engine_pb2.GenerateResponse(ids=[100])
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            assert HangingEngine.cancelled is not None
            HangingEngine.cancelled.set()
            raise


def test_cancelling_the_routers_generate_cancels_the_engines() -> None:
    async def scenario() -> None:
        HangingEngine.cancelled = asyncio.Event()
        async with running(engines=1, engine=HangingEngine) as mesh:
            call = mesh.router.Generate(chat(("user", "hi"), max_tokens=1500), timeout=20)
            first = await call.read()
            assert list(first.ids) == [100]
            replica = mesh.servicer.table.all()[0]
            assert replica.in_flight == 1
            call.cancel()
            await asyncio.wait_for(HangingEngine.cancelled.wait(), 10.0)       # it would hang forever otherwise
            await until(lambda: replica.in_flight == 0, "the router's attempt to end", 10.0)

    run(scenario)


def test_over_http1_a_closed_socket_cancels_a_whole_answer() -> None:
    """The same through uvicorn (services/edge/transports/http11.py): the socket's close is the disconnect."""
    async def main() -> None:
        router = SlowRouter()
        app = edge(router, max_concurrent=4)
        server = http_server(app, EdgeConfig(host="127.0.0.1", http_port=0))
        serving = asyncio.create_task(server.serve())
        try:
            await until(lambda: server.started, "the HTTP/1.1 server", 5)
            port = server.servers[0].sockets[0].getsockname()[1]
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(CHAT), CHAT.encode()))
            await writer.drain()
            await asyncio.wait_for(router.started.wait(), 5)
            writer.close()                             # fire and forget
            await until(lambda: router.cancelled == 1 and app.admission.in_flight.count == 0,
                        "the request to be cancelled", 10.0)
        finally:
            server.should_exit = server.force_exit = True     # force: do not wait for a request left running
            await asyncio.wait_for(serving, 5)

    asyncio.run(main())


def test_over_http3_a_closed_connection_cancels_a_whole_answer(tmp_path: Path) -> None:
    """The same through services/edge/transports/http3.py: the QUIC connection's end is the disconnect."""
    router = SlowRouter()
    app = edge(router, max_concurrent=4)

    async def check(port: int, _: object) -> None:
        async with H3Client("127.0.0.1", port, verify=False) as client:
            request = asyncio.create_task(client.request("POST", "/v1/chat/completions",
                                                         {"content-type": "application/json"}, CHAT.encode()))
            await asyncio.wait_for(router.started.wait(), 5)
            assert app.admission.in_flight.count == 1
            request.cancel()                               # fire and forget: then the connection closes
            await asyncio.gather(request, return_exceptions=True)
        await until(lambda: router.cancelled == 1 and app.admission.in_flight.count == 0,
                    "the request to be cancelled", 10.0)

    run_with_server(ensure_self_signed_cert(str(tmp_path)), check, app)
