"""Time to first token over a lossy wide-area hop: HTTP/3 (1-RTT and 0-RTT) against HTTP/1.1.

    sudo .venv/bin/python bench/edge_loss.py [--loss 5] [--rtt-ms 50] [--requests 100]

The client and the edge sit in two network namespaces joined by /work/shared/tools/wanem.py,
which delays and randomly drops every IP packet in user space (no netem here), TCP and UDP
alike, handshakes included. The edge is our real front door: uvicorn (h11) for HTTP/1.1 and
services/edge/transports/http3.py for HTTP/3, serving a fake model that streams tokens at once (`--llm`
serves the real mesh instead), so the numbers are the network's. Every request is a new
client: a new TCP connection for HTTP/1.1 (cleartext, as the edge serves it; add `h1-tls`
to --modes for HTTPS/1.1), a new QUIC connection for HTTP/3, either a full handshake (`h3`)
or resumed from the previous connection's ticket with the request in 0-RTT early data
(`h3-0rtt`). The modes take turns request by request, over the same requests, so a slow
patch of the shared machine hits them all. TTFT runs from opening the connection to the
first content token. Nothing is asserted; the table and ratios are printed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, MutableMapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

WANEM = os.environ.get("WANEM", "/work/shared/tools/wanem.py")
CLIENT_ADDR, SERVER_ADDR = "10.203.0.1", "10.203.0.2"
HTTP_PORT, HTTPS_PORT, HTTP3_PORT = 8000, 8001, 8443
MODES = ("h1", "h3", "h3-0rtt")
LABELS = {"h1": "HTTP/1.1, new TCP connection", "h1-tls": "HTTPS/1.1 (TLS 1.3), new TCP connection",
          "h3": "HTTP/3, new QUIC connection (1-RTT)", "h3-0rtt": "HTTP/3, resumed, request in 0-RTT"}
SHORT = {"h1": "HTTP/1.1", "h1-tls": "HTTPS/1.1", "h3": "HTTP/3 1-RTT", "h3-0rtt": "HTTP/3 0-RTT"}
LLM_KEY = "edge-loss-bench"


# ----------------------------------------------------------------------------- the edge side

class FakeModel:
    """An OpenAI-style streaming chat endpoint whose 'model' answers at once: TTFT is the network's."""

    def __init__(self, tokens: int, gap_s: float) -> None:
        self.tokens, self.gap_s = tokens, gap_s

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        if scope["path"] == "/health":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": b"ok"})
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]})
        for i in range(self.tokens):
            chunk = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": f" tok{i}"}}]}
            await send({"type": "http.response.body", "body": f"data: {json.dumps(chunk)}\n\n".encode(),
                        "more_body": True})
            await asyncio.sleep(self.gap_s)
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


async def serve(a: argparse.Namespace) -> None:
    import uvicorn

    from services.edge.transports.http3 import serve_http3
    from services.edge.transports.tls import ensure_self_signed_cert

    cert, key = ensure_self_signed_cert(a.cert_dir)
    app = FakeModel(a.tokens, a.token_gap_ms / 1000)
    common: dict[str, Any] = dict(http="h11", lifespan="off", log_level="warning", access_log=False)
    servers = [uvicorn.Server(uvicorn.Config(app, host=a.host, port=HTTP_PORT, **common)),
               uvicorn.Server(uvicorn.Config(app, host=a.host, port=HTTPS_PORT, ssl_certfile=cert, ssl_keyfile=key,
                                             **common))]
    for s in servers:
        s.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    tasks = [asyncio.create_task(s.serve()) for s in servers]
    h3 = await serve_http3(app, a.host, HTTP3_PORT, cert, key)
    while not all(s.started for s in servers):
        await asyncio.sleep(0.02)
    print("READY", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    h3.close()
    for s in servers:
        s.should_exit = True
    await asyncio.gather(*tasks, return_exceptions=True)


# ----------------------------------------------------------------------------- the client side

def first_content(buffer: bytes) -> tuple[bool, bytes]:
    """Scan complete SSE events; (True, _) once one carries non-empty content, else (False, unparsed tail)."""
    while b"\n\n" in buffer:
        event, buffer = buffer.split(b"\n\n", 1)
        for line in event.split(b"\n"):
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                choices = json.loads(line[6:]).get("choices") or [{}]
                if choices[0].get("delta", {}).get("content"):
                    return True, buffer
    return False, buffer


async def _h1_body(reader: asyncio.StreamReader, conn: Any) -> AsyncIterator[bytes]:
    import h11

    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await reader.read(65536))
        elif isinstance(event, h11.Response):
            if event.status_code != 200:
                raise RuntimeError(f"HTTP {event.status_code}")
        elif isinstance(event, h11.Data):
            yield bytes(event.data)
        elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
            raise RuntimeError("response ended before the first token")


async def ttft_h1(host: str, port: int, body: bytes, headers: dict[str, str], tls: ssl.SSLContext | None) -> float:
    import h11

    t0 = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, port, ssl=tls)
    try:
        conn = h11.Connection(h11.CLIENT)
        hdrs = [("host", f"{host}:{port}"), ("content-type", "application/json"), ("content-length", str(len(body))),
                ("connection", "close"), *headers.items()]
        writer.write(conn.send(h11.Request(method="POST", target="/v1/chat/completions", headers=hdrs))
                     + conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))
        buffer = b""
        async for data in _h1_body(reader, conn):
            found, buffer = first_content(buffer + data)
            if found:
                return time.perf_counter() - t0
        raise RuntimeError("no token")
    finally:
        writer.transport.abort()  # a client that got its token and left; no lingering FIN exchange


class H3Runner:
    """HTTP/3 requests, each on a new connection; closing (and, for 0-RTT, awaiting the next ticket)
    runs in the background so it doesn't delay the next request of another mode."""

    def __init__(self, host: str, port: int, zero_rtt: bool) -> None:
        from mesh.clients.tickets import TicketStore

        self.host, self.port = host, port
        self.tickets = TicketStore() if zero_rtt else None
        self.closing: list[asyncio.Task[None]] = []
        self.zero_rtt_accepted = 0

    async def ttft(self, body: bytes, headers: dict[str, str]) -> float:
        from mesh.clients.http3 import H3Client

        if self.tickets is not None and self.closing:
            await asyncio.gather(*self.closing, return_exceptions=True)  # the previous ticket is in the store
        t0 = time.perf_counter()
        client = H3Client(self.host, self.port, verify=False, tickets=self.tickets, timeout=60)
        await client.__aenter__()
        try:
            async with client.stream("POST", "/v1/chat/completions",
                                     {"content-type": "application/json", **headers}, body) as s:
                if s.status != 200:
                    raise RuntimeError(f"HTTP {s.status}")
                buffer = b""
                async for data in s.chunks():
                    found, buffer = first_content(buffer + data)
                    if found:
                        elapsed = time.perf_counter() - t0
                        self.zero_rtt_accepted += s.zero_rtt
                        return elapsed
                raise RuntimeError("no token")
        finally:
            self.closing.append(asyncio.create_task(client.__aexit__(None, None, None)))


def chat_body(i: int, prompt_bytes: int, llm: bool) -> bytes:
    text = f"Request {i}: " + " ".join(f"word{(i * 31 + k) % 997}" for k in range(prompt_bytes // 8))
    body: dict[str, Any] = {"model": "default", "stream": True, "temperature": 0,
                            "messages": [{"role": "user", "content": text[:prompt_bytes]}]}
    if llm:
        body["max_tokens"] = 4
    return json.dumps(body).encode()


async def client(a: argparse.Namespace) -> None:
    tls = ssl.create_default_context()
    tls.check_hostname, tls.verify_mode = False, ssl.CERT_NONE
    headers = {"authorization": f"Bearer {LLM_KEY}"} if a.llm else {}
    runners = {"h3": H3Runner(a.host, a.http3_port, False), "h3-0rtt": H3Runner(a.host, a.http3_port, True)}

    async def one(mode: str, body: bytes) -> float:
        if mode in ("h1", "h1-tls"):
            port = a.http_port if mode == "h1" else HTTPS_PORT
            return await ttft_h1(a.host, port, body, headers, tls if mode == "h1-tls" else None)
        return await runners[mode].ttft(body, headers)

    # Warm-up, not measured: the 0-RTT runner's first ticket, imports, the edge's first request.
    for mode in a.modes:
        await asyncio.wait_for(one(mode, chat_body(-1, a.prompt_bytes, a.llm)), 60)
    runners["h3-0rtt"].zero_rtt_accepted = 0
    samples: dict[str, list[float]] = {m: [] for m in a.modes}
    failures: dict[str, int] = {m: 0 for m in a.modes}
    for i in range(a.requests):
        body = chat_body(i, a.prompt_bytes, a.llm)
        for mode in a.modes[i % len(a.modes):] + a.modes[:i % len(a.modes)]:  # rotate who goes first
            try:
                samples[mode].append(await asyncio.wait_for(one(mode, body), a.request_timeout))
            except (OSError, RuntimeError, TimeoutError) as exc:
                failures[mode] += 1
                print(f"{mode} request {i}: {type(exc).__name__}: {exc}", file=sys.stderr)
        if (i + 1) % 20 == 0:
            print(f"{i + 1}/{a.requests} requests per mode", file=sys.stderr, flush=True)
    for runner in runners.values():
        await asyncio.gather(*runner.closing, return_exceptions=True)
    print(json.dumps({"samples": samples, "failures": failures,
                      "zero_rtt_accepted": runners["h3-0rtt"].zero_rtt_accepted}))


# ----------------------------------------------------------------------------- the orchestration

def percentile(values: list[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    k = (len(ordered) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def report(result: dict[str, Any], a: argparse.Namespace) -> str:
    samples: dict[str, list[float]] = result["samples"]
    link = "loopback, no emulation" if a.loopback else f"{a.rtt_ms:g} ms RTT, {a.loss:g}% loss each way"
    lines = [f"TTFT over {link}; {a.requests} requests per mode, {a.prompt_bytes}-byte prompts, "
             f"{'the real mesh' if a.llm else 'fake model'}", "",
             "| mode | n | p50 ms | p90 ms | p99 ms | mean ms | failed |", "|---|---|---|---|---|---|---|"]
    p: dict[str, dict[int, float]] = {}
    for mode in a.modes:
        v = samples[mode]
        p[mode] = {q: percentile(v, q) * 1000 for q in (50, 90, 99)}
        mean = sum(v) / len(v) * 1000 if v else math.nan
        lines.append(f"| {LABELS[mode]} | {len(v)} | {p[mode][50]:.0f} | {p[mode][90]:.0f} | {p[mode][99]:.0f} "
                     f"| {mean:.0f} | {result['failures'][mode]} |")
    lines.append("")
    if "h3-0rtt" in a.modes:
        lines.append(f"0-RTT early data accepted on {result['zero_rtt_accepted']}/{len(samples['h3-0rtt'])} "
                     "resumed requests")
    for base in ("h1", "h1-tls"):
        for other in ("h3", "h3-0rtt"):
            if base in a.modes and other in a.modes:
                lines.append(f"{SHORT[base]} / {SHORT[other]}: p50 {p[base][50] / p[other][50]:.2f}x, "
                             f"p90 {p[base][90] / p[other][90]:.2f}x, p99 {p[base][99] / p[other][99]:.2f}x")
    if "h3" in a.modes and "h3-0rtt" in a.modes:
        lines.append(f"HTTP/3 1-RTT / 0-RTT: p50 {p['h3'][50] / p['h3-0rtt'][50]:.2f}x, "
                     f"p90 {p['h3'][90] / p['h3-0rtt'][90]:.2f}x, p99 {p['h3'][99] / p['h3-0rtt'][99]:.2f}x")
    return "\n".join(lines)


def _wait_line(proc: subprocess.Popen[str], word: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            raise SystemExit(f"edge_loss: {proc.args!r} exited before {word}")
        if line.startswith(word):
            return
    raise SystemExit(f"edge_loss: no {word} from {proc.args!r} within {timeout:.0f}s")


def _stop(proc: subprocess.Popen[str] | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _server_command(a: argparse.Namespace, host: str, cert_dir: str) -> list[str]:
    if a.llm:
        return [str(ROOT / ".venv" / "bin" / "infermesh"), "up", "--host", host]
    return [sys.executable, __file__, "serve", "--host", host, "--cert-dir", cert_dir,
            "--tokens", str(a.tokens), "--token-gap-ms", str(a.token_gap_ms)]


def _wait_llm_ready(prefix: list[str], host: str, timeout: float) -> None:
    probe = ["curl", "-sf", "-o", "/dev/null", f"http://{host}:{HTTP_PORT}/health"]
    deadline = time.monotonic() + timeout
    while subprocess.run(prefix + probe).returncode != 0:
        if time.monotonic() > deadline:
            raise SystemExit("edge_loss: the mesh did not become healthy")
        time.sleep(2)


def orchestrate(a: argparse.Namespace) -> int:
    if a.llm and "h1-tls" in a.modes:
        raise SystemExit("edge_loss: h1-tls needs the fake model (the mesh's HTTP/1.1 is cleartext)")
    if not a.loopback and os.geteuid() != 0:
        raise SystemExit("edge_loss: network namespaces need root (or pass --loopback for a smoke run)")
    tag = f"el{os.getpid() % 100000}"
    wanem = server = None
    env = {**os.environ, "INFERMESH_API_KEYS": LLM_KEY} if a.llm else None
    client_prefix = server_prefix = []
    host = "127.0.0.1" if a.loopback else SERVER_ADDR
    try:
        with tempfile.TemporaryDirectory() as tmp:
            if not a.loopback:
                wanem = subprocess.Popen([sys.executable, WANEM, "up", "--rtt-ms", str(a.rtt_ms), "--loss", str(a.loss),
                                          "--jitter-ms", str(a.jitter_ms), "--a", f"{tag}c", "--b", f"{tag}s"],
                                         stdout=subprocess.PIPE, text=True)
                _wait_line(wanem, "READY", 30)
                client_prefix = ["ip", "netns", "exec", f"{tag}c"]
                server_prefix = ["ip", "netns", "exec", f"{tag}s"]
            server = subprocess.Popen(server_prefix + _server_command(a, host, tmp), stdout=subprocess.PIPE,
                                      text=True, env=env)
            if a.llm:
                _wait_llm_ready(server_prefix, host, 600)
            else:
                _wait_line(server, "READY", 60)
            cmd = [sys.executable, __file__, "client", "--host", host, "--requests", str(a.requests),
                   "--prompt-bytes", str(a.prompt_bytes), "--request-timeout", str(a.request_timeout),
                   "--modes", ",".join(a.modes)] + (["--llm"] if a.llm else [])
            print(f"edge_loss: {a.requests} requests x {len(a.modes)} modes over "
                  f"{'loopback' if a.loopback else f'{a.rtt_ms:g} ms RTT, {a.loss:g}% loss'}", file=sys.stderr)
            done = subprocess.run(client_prefix + cmd, stdout=subprocess.PIPE, text=True)
            if done.returncode != 0:
                raise SystemExit(f"edge_loss: the client failed ({done.returncode})")
            result = json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        _stop(server)
        _stop(wanem)  # wanem deletes both namespaces on SIGTERM
    text = report(result, a)
    print(text)
    if a.save:
        Path(a.save).write_text(json.dumps({"args": vars(a), **result}) + "\n")
    return 0


def _modes(value: str) -> list[str]:
    modes = [m.strip() for m in value.split(",") if m.strip()]
    unknown = set(modes) - set(LABELS)
    if unknown or not modes:
        raise argparse.ArgumentTypeError(f"modes are among {', '.join(LABELS)}")
    return modes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="role")
    s = sub.add_parser("serve", help="(internal) the fake-model edge, in the server namespace")
    s.add_argument("--host", required=True)
    s.add_argument("--cert-dir", required=True)
    s.add_argument("--tokens", type=int, default=16)
    s.add_argument("--token-gap-ms", type=float, default=5.0)
    c = sub.add_parser("client", help="(internal) the measuring client, in the client namespace")
    c.add_argument("--host", required=True)
    c.add_argument("--http-port", type=int, default=HTTP_PORT)
    c.add_argument("--http3-port", type=int, default=HTTP3_PORT)
    for q in (p, c):
        q.add_argument("--requests", type=int, default=100, help="requests per mode (default 100)")
        q.add_argument("--prompt-bytes", type=int, default=800, help="user message size (default 800)")
        q.add_argument("--request-timeout", type=float, default=30.0)
        q.add_argument("--modes", type=_modes, default=list(MODES),
                       help=f"comma-separated, among {', '.join(LABELS)} (default {','.join(MODES)})")
        q.add_argument("--llm", action="store_true", help="serve the real mesh (`infermesh up`), not a fake model")
    p.add_argument("--loss", type=float, default=5.0, help="percent of packets dropped, each way (default 5)")
    p.add_argument("--rtt-ms", type=float, default=50.0, help="round-trip delay (default 50)")
    p.add_argument("--jitter-ms", type=float, default=0.0)
    p.add_argument("--tokens", type=int, default=16, help="fake model: tokens per answer")
    p.add_argument("--token-gap-ms", type=float, default=5.0, help="fake model: time between tokens")
    p.add_argument("--loopback", action="store_true", help="no namespaces, no emulation: a smoke run without root")
    p.add_argument("--save", help="also write the samples as JSON here")
    a = p.parse_args(argv)
    if a.role == "serve":
        asyncio.run(serve(a))
        return 0
    if a.role == "client":
        asyncio.run(client(a))
        return 0
    return orchestrate(a)


if __name__ == "__main__":
    sys.exit(main())
