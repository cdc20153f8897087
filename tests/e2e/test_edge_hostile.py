"""End to end: an edge with API keys and rate limits, under hostile input, keeps serving good clients.

Every bad request is answered by the edge with a precise 4xx in OpenAI's error shape, and between
any two bad requests a good one (the `openai` package: chat and completions, streaming or not,
with logprobs) must succeed.  The router's own counter proves that only good requests reached it.
"""

from __future__ import annotations

import asyncio
import http.client
import itertools
import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import openai
import pytest

from meshpb.v1 import common_pb2, router_pb2, router_pb2_grpc, tokenizer_pb2
from tests.e2e.conftest import OFFSET, Mesh, running_mesh

pytestmark = pytest.mark.e2e

PORTS = OFFSET + 500
GOOD, HOSTILE = "sk-good-0123", "sk-hostile-4567"
ENV = {"INFERMESH_API_KEYS": f"{GOOD},{HOSTILE}", "INFERMESH_RATE_LIMIT": "3/s", "INFERMESH_TOKEN_LIMIT": "200000/m",
       "INFERMESH_EDGE_HEADER_TIMEOUT": "2", "INFERMESH_EDGE_BODY_TIMEOUT": "2", "INFERMESH_EDGE_MAX_MESSAGES": "100"}
MODEL = "smollm2-135m"
MIB = 1 << 20


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    log = tmp_path_factory.mktemp("keyed") / "infermesh-up.log"
    with running_mesh(["--engines", "1"], PORTS, log, env=ENV) as m:
        yield m


class Pace:
    """Keeps one key's requests under its 3/s limit, so only the deliberate burst meets a 429."""

    def __init__(self, gap_s: float = 0.4):
        self.gap_s, self.last = gap_s, 0.0

    def __call__(self) -> None:
        time.sleep(max(0.0, self.last + self.gap_s - time.monotonic()))
        self.last = time.monotonic()


class Good:
    """The well-behaved client: each call makes one request of the next kind and checks its answer."""

    def __init__(self, mesh: Mesh):
        self.client = openai.OpenAI(base_url=f"{mesh.http}/v1", api_key=GOOD, max_retries=0, timeout=120)
        self.pace = Pace()
        self.kinds = itertools.cycle([self.chat, self.chat_stream, self.completion, self.completion_stream,
                                      self.chat_logprobs, self.completion_logprobs])
        self.served = 0

    def __call__(self) -> None:
        self.pace()
        next(self.kinds)()
        self.served += 1

    def chat(self) -> None:
        reply = self.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                    max_tokens=4, temperature=0)
        assert reply.choices[0].message.content and reply.usage and reply.usage.completion_tokens > 0

    def chat_stream(self) -> None:
        chunks = list(self.client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")

    def completion(self) -> None:
        reply = self.client.completions.create(model=MODEL, prompt="The sky is", max_tokens=4, temperature=0)
        assert reply.choices[0].text

    def completion_stream(self) -> None:
        text = "".join(c.choices[0].text for c in self.client.completions.create(
            model=MODEL, prompt="The sky is", max_tokens=4, stream=True) if c.choices)
        assert text

    def chat_logprobs(self) -> None:
        reply = self.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                    max_tokens=4, temperature=0, logprobs=True, top_logprobs=3)
        content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
        assert content and len(content) == reply.usage.completion_tokens  # type: ignore[union-attr]
        for entry in content:
            assert entry.logprob <= 0 and len(entry.top_logprobs) == 3 and entry.bytes is not None
            # Greedy: the chosen token is the most likely one.
            assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)
        assert "".join(e.token for e in content) == reply.choices[0].message.content

    def completion_logprobs(self) -> None:
        prompt = "The sky is"
        chunks = [c for c in self.client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, logprobs=2,
                                                            temperature=0, stream=True) if c.choices]
        tokens, offsets = [], []
        for c in chunks:
            if c.choices[0].logprobs:
                lp = c.choices[0].logprobs
                assert all(len(top) in (2, 3) for top in lp.top_logprobs or [])
                tokens += lp.tokens or []
                offsets += lp.text_offset or []
        assert tokens and offsets[0] == len(prompt)
        assert offsets == [len(prompt) + len("".join(tokens[:i])) for i in range(len(tokens))]


@pytest.fixture(scope="module")
def good(keyed: Mesh) -> Good:
    return Good(keyed)


@pytest.fixture(scope="module")
def hostile_pace() -> Pace:
    return Pace()


def post(mesh: Mesh, path: str, body: bytes, key: str | None = HOSTILE, **headers: str
         ) -> tuple[int, dict[str, str], dict[str, Any]]:
    conn = http.client.HTTPConnection("127.0.0.1", int(mesh.http.rsplit(":", 1)[1]), timeout=60)
    try:
        hdrs = {"content-type": "application/json", **headers}
        if key is not None:
            hdrs["authorization"] = f"Bearer {key}"
        conn.request("POST", path, body=body, headers=hdrs)
        reply = conn.getresponse()
        return reply.status, {k.lower(): v for k, v in reply.getheaders()}, json.loads(reply.read())
    finally:
        conn.close()


def raw(mesh: Mesh, data: bytes, trickle: bytes = b"", every_s: float = 0.5, limit_s: float = 15.0
        ) -> tuple[int, dict[str, Any], float]:
    """Send `data` on a fresh connection, then `trickle` a byte at a time; return the status, the
    JSON body and the seconds until the server answered."""
    port = int(mesh.http.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=limit_s) as s:
        started = time.monotonic()
        s.sendall(data)
        s.settimeout(every_s)
        received = b""
        for byte in [trickle[i:i + 1] for i in range(len(trickle))] or [b""]:
            try:
                chunk = s.recv(65536)
                received += chunk
                break
            except TimeoutError:
                try:
                    s.sendall(byte)
                except OSError:         # the server has just closed: its answer is waiting
                    pass
        answered = time.monotonic() - started
        s.settimeout(limit_s)
        try:
            while chunk := s.recv(65536):
                received += chunk
        except ConnectionResetError:
            # The server answered and closed while trickled bytes were still arriving: TCP resets the
            # connection after the answer (which the parse below checks is whole).
            pass
    head, _, body = received.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body), answered


def assert_error(status: int, body: dict[str, Any], expected: int, code: str | None = None) -> None:
    assert status == expected, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if code is not None:
        assert error["code"] == code, error


def routed(mesh: Mesh) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{9180 + PORTS}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("infermesh_router_requests_total{"))


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def cases(mesh: Mesh) -> list[tuple[str, Callable[[], None]]]:
    port_path = "/v1/chat/completions"

    def call(body: bytes, expected: int, code: str | None = None, key: str | None = HOSTILE,
             **headers: str) -> Callable[[], None]:
        def run() -> None:
            status, _, reply = post(mesh, port_path, body, key, **headers)
            assert_error(status, reply, expected, code)
        return run

    def declared_8mib() -> None:
        # Refused on Content-Length alone: the body is never read.
        head = (f"POST {port_path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {HOSTILE}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {8 * MIB}\r\n\r\n").encode()
        status, body, answered = raw(mesh, head)
        assert_error(status, body, 413, "body_too_large")
        assert answered < 2

    def chunked_8mib() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", int(mesh.http.rsplit(":", 1)[1]), timeout=60)
        chunk = b"x" * (64 << 10)
        conn.request("POST", port_path, body=iter([chunk] * 128), encode_chunked=True,
                     headers={"authorization": f"Bearer {HOSTILE}", "content-type": "application/json"})
        reply = conn.getresponse()
        assert_error(reply.status, json.loads(reply.read()), 413, "body_too_large")
        conn.close()

    def slow_head() -> None:
        status, body, answered = raw(mesh, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n",
                                     trickle=b"X-Slow: " + b"a" * 30)
        assert_error(status, body, 408, "request_timeout")
        assert 1.5 < answered < 5

    def slow_body() -> None:
        head = (f"POST {port_path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {HOSTILE}\r\n"
                "Content-Length: 100\r\n\r\n{\"model\": ").encode()
        status, body, answered = raw(mesh, head, trickle=b'"' + b"a" * 30)
        assert_error(status, body, 408, "request_timeout")
        assert 1.5 < answered < 5

    def bad_http() -> None:
        status, body, _ = raw(mesh, b"POST /v1/chat/completions HTTP/1.1\r\nHost x\r\n\r\n")
        assert_error(status, body, 400, "invalid_http_request")

    hostile = openai.OpenAI(base_url=f"{mesh.http}/v1", api_key=HOSTILE, max_retries=0, timeout=60)

    def unknown_model() -> None:
        with pytest.raises(openai.NotFoundError, match="not served") as err:
            hostile.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
        assert err.value.status_code == 404 and err.value.code == "not_found"

    messages = [{"role": "user", "content": "x"}] * 101
    return [
        ("missing key", call(json.dumps(CHAT).encode(), 401, "invalid_api_key", key=None)),
        ("wrong key", call(json.dumps(CHAT).encode(), 401, "invalid_api_key", key="sk-wrong")),
        ("malformed JSON", call(b'{"model": ', 400, "invalid_json")),
        ("invalid UTF-8", call(b'{"model": "\xc3\x28"}', 400, "invalid_encoding")),
        ("lone surrogate", call(b'{"model": "\\udc00", "messages": []}', 400, "invalid_encoding")),
        ("not an object", call(b"[1, 2]", 400, "invalid_type")),
        ("bad role", call(json.dumps({**CHAT, "messages": [{"role": "robot", "content": "x"}]}).encode(), 400)),
        ("wrong type", call(json.dumps({**CHAT, "max_tokens": "2"}).encode(), 400, "invalid_type")),
        ("unknown field", call(json.dumps({**CHAT, "functions": []}).encode(), 400, "unknown_parameter")),
        ("negative max_tokens", call(json.dumps({**CHAT, "max_tokens": -1}).encode(), 400)),
        ("top_logprobs over 20", call(json.dumps({**CHAT, "logprobs": True, "top_logprobs": 21}).encode(), 400)),
        ("too many messages", call(json.dumps({**CHAT, "messages": messages}).encode(), 400)),
        ("long model name", call(json.dumps({**CHAT, "model": "m" * 300}).encode(), 400)),
        ("long stop string", call(json.dumps({**CHAT, "stop": "s" * 300}).encode(), 400)),
        ("deep nesting", call(b'{"metadata": ' + b"[" * 200_000 + b"]" * 200_000 + b"}", 400, "invalid_json")),
        ("huge integer", call(b'{"seed": ' + b"9" * 10_000 + b"}", 400, "invalid_json")),
        ("NaN", call(b'{"temperature": NaN}', 400, "invalid_json")),
        ("unknown model", unknown_model),
        ("8 MiB body, declared", declared_8mib),
        ("8 MiB body, sent", call(b"x" * (8 * MIB), 413, "body_too_large")),
        ("8 MiB body, chunked", chunked_8mib),
        ("slow head", slow_head),
        ("slow body", slow_body),
        ("malformed HTTP", bad_http),
    ]


def test_hostile_input_gets_precise_errors_while_good_clients_are_served(keyed: Mesh, good: Good,
                                                                         hostile_pace: Pace) -> None:
    before = routed(keyed)
    good()
    for name, case in cases(keyed):
        hostile_pace()
        try:
            case()
        except AssertionError as exc:
            raise AssertionError(f"{name}: {exc}") from exc
        good()
    assert routed(keyed) - before == good.served      # nothing hostile reached the router


def test_burst_over_the_rate_gets_429_with_retry_after(keyed: Mesh, good: Good) -> None:
    url = f"{keyed.http}/v1/models"
    statuses, refusal = [], None
    time.sleep(1.0)     # a full bucket: 3 requests pass at once, then one every 1/3 s
    for i in range(8):
        request = urllib.request.Request(url, headers={"authorization": f"Bearer {HOSTILE}"})
        try:
            with urllib.request.urlopen(request, timeout=10) as reply:
                statuses.append(reply.status)
        except urllib.error.HTTPError as err:
            statuses.append(err.code)
            refusal = (err.headers.get("retry-after"), json.loads(err.read()))
        if i == 4:
            good()
    assert statuses[:2] == [200, 200] and 429 in statuses, statuses
    assert refusal is not None
    retry_after, body = refusal
    assert retry_after is not None and int(retry_after) >= 1
    assert body["error"]["type"] == "requests" and body["error"]["code"] == "rate_limit_exceeded"
    # The good key has its own bucket: it was served in the middle of the burst, and still is.
    good()
    time.sleep(int(retry_after))
    request = urllib.request.Request(url, headers={"authorization": f"Bearer {HOSTILE}"})
    with urllib.request.urlopen(request, timeout=10) as reply:
        assert reply.status == 200


def test_openapi_and_health_need_no_key(keyed: Mesh) -> None:
    with urllib.request.urlopen(f"{keyed.http}/openapi.json", timeout=10) as reply:
        doc = json.loads(reply.read())
    assert doc["openapi"] == "3.1.0" and doc["paths"]["/v1/models"]["get"]["security"] == [{"bearerAuth": []}]
    with urllib.request.urlopen(f"{keyed.http}/health", timeout=10) as reply:
        assert reply.status == 200
    with urllib.request.urlopen(f"{keyed.http}/metrics", timeout=10) as reply:
        assert 'infermesh_edge_refused_total{limit="requests"}' in reply.read().decode()


def test_native_grpc_callers_need_a_key_and_get_its_sessions(keyed: Mesh, good: Good) -> None:
    """The router reads the edge's keys: a client certificate alone no longer runs Generate, and a
    key's session over gRPC is the one the same key wrote over HTTP (and no other key's)."""
    pace = Pace()
    pace()
    good.client.chat.completions.create(model=MODEL, max_tokens=2, user="native-e2e",
                                        messages=[{"role": "user", "content": "The secret code is 4417."}])

    async def prompt_tokens(key: str) -> int | str:
        request = router_pb2.RouterGenerateRequest(
            model=MODEL, session_id="native-e2e", sampling=common_pb2.SamplingParams(max_tokens=1),
            chat=router_pb2.ChatInput(messages=[tokenizer_pb2.ChatMessage(role="user", content="And?")]))
        metadata = (("authorization", f"Bearer {key}"),) if key else ()
        pace()
        async with keyed.channel(keyed.router) as ch:
            try:
                replies = [r async for r in router_pb2_grpc.RouterStub(ch).Generate(request, timeout=60,
                                                                                       metadata=metadata)]
            except grpc.aio.AioRpcError as err:
                return err.code().name
        return replies[-1].usage.prompt_tokens

    assert asyncio.run(prompt_tokens("")) == "UNAUTHENTICATED"
    own, other = asyncio.run(prompt_tokens(GOOD)), asyncio.run(prompt_tokens(HOSTILE))
    assert isinstance(own, int) and isinstance(other, int)
    assert own > other + 5          # GOOD's history (the secret) came along; HOSTILE's session is empty
