"""End to end over HTTP/3 (QUIC) with an aioquic client."""

from __future__ import annotations

import asyncio
import json

import pytest

from mesh.clients.http3 import H3Client
from mesh.clients.tickets import TicketStore
from tests.e2e.conftest import Mesh

pytestmark = pytest.mark.e2e


def test_streamed_chat_over_http3_equals_transformers(mesh: Mesh, reference) -> None:  # type: ignore[no-untyped-def]
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    expected = reference(32, messages=messages)
    body = json.dumps({"model": "smollm2-135m", "messages": messages, "temperature": 0, "max_tokens": 32,
                       "stream": True}).encode()

    async def scenario() -> tuple[str, list[dict[str, object]], int, str]:
        async with H3Client("127.0.0.1", mesh.http3_port, verify=False) as client:
            events: list[dict[str, object]] = []
            async with client.stream("POST", "/v1/chat/completions", {"content-type": "application/json"},
                                     body) as response:
                status = response.status
                raw = (await response.read()).decode()
            for block in raw.split("\n\n"):
                if block.startswith("data: ") and block != "data: [DONE]":
                    events.append(json.loads(block[6:]))
            plain = await client.request("POST", "/v1/chat/completions", {"content-type": "application/json"},
                                         body.replace(b'"stream": true', b'"stream": false'))
            content = json.loads(plain.body)["choices"][0]["message"]["content"]
            return raw, events, status, content

    raw, events, status, content = asyncio.run(scenario())
    assert status == 200 and raw.rstrip().endswith("data: [DONE]")
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])  # type: ignore[index]
    assert text == expected and content == expected
    assert events[-1]["infermesh"]["replica"] in ("engine-0", "engine-1")  # type: ignore[index]


def test_second_connection_streams_chat_from_0rtt_early_data(mesh: Mesh, reference) -> None:  # type: ignore[no-untyped-def]
    messages = [{"role": "user", "content": "Name a primary colour."}]
    expected = reference(16, messages=messages)
    body = json.dumps({"model": "smollm2-135m", "messages": messages, "temperature": 0, "max_tokens": 16,
                       "stream": True}).encode()
    tickets = TicketStore()

    async def chat() -> tuple[str, bool, H3Client]:
        async with H3Client("127.0.0.1", mesh.http3_port, verify=False, tickets=tickets) as client:
            async with client.stream("POST", "/v1/chat/completions", {"content-type": "application/json"},
                                     body) as response:
                assert response.status == 200
                raw = (await response.read()).decode()
        events = [json.loads(b[6:]) for b in raw.split("\n\n") if b.startswith("data: ") and b != "data: [DONE]"]
        text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
        return text, response.zero_rtt, client

    first, first_0rtt, c1 = asyncio.run(chat())
    assert first == expected and not first_0rtt and not c1.resumed
    # The edge's ticket from the first connection lets the second send its request in 0-RTT.
    second, second_0rtt, c2 = asyncio.run(chat())
    assert second == expected
    assert second_0rtt and c2.resumed and c2.early_data_accepted, c2.handshake_summary()
