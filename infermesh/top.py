"""`infermesh top`: a live terminal view of the router's replicas, refreshed every second.

One row per engine replica, from the router's ListReplicas (its replica table, the engines' last
load reports, and its failover state): health, breaker, load (requests this router has open on it,
running and waiting on the engine), KV cache use, throughput, P99 latency, region and model version.
Plain ANSI: the screen is cleared and redrawn; `--once` prints one snapshot and exits.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from typing import NamedTuple, TextIO

import grpc

from mesh.grpcutil import channel
from meshpb.v1 import router_pb2, router_pb2_grpc

CLEAR = "\x1b[H\x1b[2J"
RESET = "\x1b[0m"
COLORS = {"ok": "\x1b[32m", "warn": "\x1b[33m", "bad": "\x1b[31m", "dim": "\x1b[2m", "bold": "\x1b[1m"}


class Row(NamedTuple):
    replica: str
    model: str
    version: str
    region: str
    state: str            # up | down | isolated
    breaker: str          # closed | half_open | open
    in_flight: int
    running: int
    waiting: int
    kv_used: float        # 0..1; -1: no load report yet
    tokens_per_s: float
    p99_ms: float


class TopSnapshot(NamedTuple):
    router: str
    rows: list[Row]
    load_entropy: float


def from_pb(router: str, reply: router_pb2.ListReplicasResponse) -> TopSnapshot:
    rows = []
    for r in reply.replicas:
        load = r.load
        kv = 1.0 - load.kv_blocks_free / load.kv_blocks_total if load.kv_blocks_total else -1.0
        state = "isolated" if r.isolation else "up" if r.healthy else "down"
        rows.append(Row(r.replica_id, r.model, r.model_version, r.region, state, r.breaker or "closed", r.in_flight,
                        load.running, load.waiting, kv, load.tokens_per_second, load.p99_latency_ms))
    return TopSnapshot(router, rows, reply.load_entropy)


async def fetch(router: str, timeout: float = 2.0) -> TopSnapshot:
    # With API keys configured the router asks a native caller for one: $INFERMESH_API_KEY.
    key = os.environ.get("INFERMESH_API_KEY", "")
    metadata = (("authorization", f"Bearer {key}"),) if key else ()
    async with channel(router) as ch:
        reply = await router_pb2_grpc.RouterStub(ch).ListReplicas(router_pb2.ListReplicasRequest(), timeout=timeout,
                                                                  metadata=metadata)
    return from_pb(router, reply)


_COLUMNS = (("REPLICA", 14), ("MODEL", 18), ("VER", 5), ("REGION", 8), ("STATE", 9), ("BREAKER", 10),
            ("INFLIGHT", 9), ("RUN", 5), ("WAIT", 5), ("KV%", 6), ("TOK/S", 8), ("P99ms", 8))


def _tone(column: str, value: str) -> str:
    if column == "STATE":
        return "ok" if value == "up" else "bad"
    if column == "BREAKER":
        return {"closed": "ok", "half_open": "warn"}.get(value, "bad")
    return ""


def render(snap: TopSnapshot, color: bool = False, now: float | None = None) -> str:
    """The screen for one snapshot (no clear code: the caller adds it)."""
    def paint(text: str, tone: str) -> str:
        return f"{COLORS[tone]}{text}{RESET}" if color and tone else text

    stamp = time.strftime("%H:%M:%S", time.localtime(now))
    up = sum(r.state == "up" for r in snap.rows)
    lines = [paint(f"infermesh top - router {snap.router} - {stamp} - {up}/{len(snap.rows)} replicas up - "
                   f"load entropy {snap.load_entropy:.2f}", "bold"),
             ""]
    lines.append(" ".join(name.ljust(width) for name, width in _COLUMNS).rstrip())
    for r in sorted(snap.rows, key=lambda row: row.replica):
        cells = (r.replica, r.model, r.version, r.region, r.state, r.breaker, str(r.in_flight), str(r.running),
                 str(r.waiting), f"{100 * r.kv_used:.0f}" if r.kv_used >= 0 else "-", f"{r.tokens_per_s:.1f}",
                 f"{r.p99_ms:.0f}")
        parts = []
        for (name, width), cell in zip(_COLUMNS, cells, strict=True):
            text = cell[: width - 1] if len(cell) >= width else cell
            parts.append(paint(text, _tone(name, cell)) + " " * (width - len(text)))
        lines.append(" ".join(parts).rstrip())
    if not snap.rows:
        lines.append(paint("(no replicas known to the router yet)", "dim"))
    return "\n".join(lines) + "\n"


async def run(router: str, once: bool = False, interval_s: float = 1.0, out: TextIO = sys.stdout) -> int:
    """Redraw every interval until interrupted (or once).  Returns the exit code."""
    color = out.isatty()
    while True:
        try:
            snap = await fetch(router)
            screen = render(snap, color)
        except grpc.aio.AioRpcError as err:
            if once:
                print(f"infermesh top: router {router}: {err.code().name}: {err.details()}", file=sys.stderr)
                return 1
            screen = f"infermesh top - router {router} unreachable ({err.code().name}); retrying\n"
        if once:
            out.write(screen)
            out.flush()
            return 0
        out.write(CLEAR + screen)
        out.flush()
        await asyncio.sleep(interval_s)


def main(router: str, once: bool = False, interval_s: float = 1.0) -> int:
    try:
        return asyncio.run(run(router, once, interval_s))
    except KeyboardInterrupt:
        return 0
