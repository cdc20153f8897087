"""Finding 4 of issue 49: a large batch file stopped the whole edge.  POST /v1/files with 32 MiB of `{}` lines,
then a batch on it: another tenant's GET /v1/models took 21-23 s, every line parsed on the event loop (the
multipart form by the email package, then each line at upload, at creation and when the batch ran).  A line
nested 5,000 deep was a 500 (RecursionError).

Now the form is split with byte searches and the lines are checked in a thread (services/edge/batch/jsonl.py),
at most 50,000 requests a file (OpenAI's limit: checking stops at the first past it) and each line nested at
most MAX_DEPTH deep (a 400 naming the line at upload; at creation the batch fails naming it).  What is checked
is where the work runs: every split and parse of a file's lines (the form, each line) in a thread, never on the
event loop's; the stall (the longest any GET /v1/models took meanwhile) is printed, not asserted (machines are
shared and noisy).
"""

from __future__ import annotations

import asyncio
import functools
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from mesh.apikeys import digest
from services.edge.app import EdgeApp
from services.edge.batch import batches_api, files_api
from services.edge.batch import runner as batch_runner
from services.edge.batch.files_api import MAX_UPLOAD_BYTES
from services.edge.batch.jsonl import MAX_DEPTH
from services.edge.config import EdgeConfig
from tests.fakes.edge_router import FakeRouter, asgi
from tests.unit.test_batches import form

A = {"authorization": "Bearer k-a"}
B = {"authorization": "Bearer k-b"}


class Router(FakeRouter):
    async def models(self) -> list[Any]:
        return []


@pytest.fixture
def threads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, bool]]:
    """(function, ran on the event loop's thread) of every split and parse of a file's lines (nonblank, load_line,
    parse_form, as the files, batches and runner modules call them)."""
    seen: list[tuple[str, bool]] = []
    loop_thread = threading.current_thread()

    def spied(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            seen.append((name, threading.current_thread() is loop_thread))
            return fn(*args, **kwargs)
        return call
    for module in (files_api, batches_api, batch_runner):
        for name in ("nonblank", "load_line", "parse_form"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, spied(name, getattr(module, name)))
    return seen


def _off_the_loop(seen: list[tuple[str, bool]], names: set[str]) -> None:
    assert {name for name, _ in seen} >= names and not [name for name, on_loop in seen if on_loop]


def _app(router: Router | None = None) -> EdgeApp:
    return EdgeApp(EdgeConfig(api_key_digests=(digest("k-a"), digest("k-b")), response_cache_ttl_s=0),
                   router or Router())  # type: ignore[arg-type]


async def _worst_wait(app: EdgeApp, work: Any) -> tuple[Any, float]:
    """`work`'s result, and the longest another tenant's GET /v1/models waited while it ran: one is due every
    10 ms, and each counts from when it was due (a stalled loop delays it before it starts) to its answer."""
    done = asyncio.Event()
    worst = 0.0

    async def probe() -> None:
        nonlocal worst
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.01)
            status, _, _ = await asgi(app, "GET", "/v1/models", b"", B)
            assert status == 200
            now = time.perf_counter()
            worst, last = max(worst, now - last - 0.01), now

    prober = asyncio.create_task(probe())
    await asyncio.sleep(0.05)
    try:
        result = await work
    finally:
        done.set()
        await prober
    return result, worst


def _valid_lines(size: int) -> bytes:
    """Chat requests (~670 bytes each, content in 13 short text parts) filling `size` bytes: every line one a
    batch takes."""
    def one(i: int) -> bytes:
        parts = [{"type": "text", "text": f"part {k} of {i}"} for k in range(13)]
        return json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                           "body": {"model": "m", "max_tokens": 4,
                                    "messages": [{"role": "user", "content": parts}]}}).encode() + b"\n"
    lines, total, i = [], 0, 0
    while total + len(one(i)) <= size:
        lines.append(one(i))
        total += len(lines[-1])
        i += 1
    return b"".join(lines)


def test_a_32_mib_file_of_empty_objects_is_refused_without_stopping_the_edge(threads: list[tuple[str, bool]]) -> None:
    """The probe's file: 11 million `{}` lines.  Refused at upload (400 naming line 50,001: more requests than
    a batch takes), the form and its lines read in a thread while GET /v1/models from another tenant goes on."""
    async def main() -> None:
        app = _app()
        content = b"{}\n" * ((MAX_UPLOAD_BYTES - 1024) // 3)
        body, headers = form(content)
        (status, _, raw), worst = await _worst_wait(app, asgi(app, "POST", "/v1/files", body, {**headers, **A}))
        print(f"\n32 MiB of {{}} lines: upload {status}, another tenant's longest GET /v1/models {worst:.3f} s")
        assert status == 400 and "line 50001" in json.loads(raw)["error"]["message"]
        _off_the_loop(threads, {"parse_form", "nonblank", "load_line"})

    asyncio.run(main())


def test_a_32_mib_batch_is_uploaded_and_created_without_stopping_the_edge(threads: list[tuple[str, bool]]) -> None:
    """32 MiB of valid chat lines (45,000): uploaded, checked, made a batch and read by its runner, every line in
    a thread (the longest GET /v1/models of another tenant meanwhile: 0.6-0.9 s before, when the form and every
    line were parsed on the event loop; ~0.1 s on an idle 2-core machine now, the thread and the loop sharing the
    GIL)."""
    async def main() -> None:
        router = Router()
        router.release = asyncio.Event()              # the lines wait in the "engine" until cancelled
        app = _app(router)
        content = _valid_lines(MAX_UPLOAD_BYTES - 1024)
        body, headers = form(content)

        async def upload_and_create() -> dict[str, Any]:
            status, _, raw = await asgi(app, "POST", "/v1/files", body, {**headers, **A})
            assert status == 200, raw
            request = {"input_file_id": json.loads(raw)["id"], "endpoint": "/v1/chat/completions",
                       "completion_window": "24h"}
            status, _, raw = await asgi(app, "POST", "/v1/batches", json.dumps(request).encode(), A)
            assert status == 200, raw
            record = json.loads(raw)
            while not router.calls:                                       # the runner has read the file
                await asyncio.sleep(0.01)
            await asgi(app, "POST", f"/v1/batches/{record['id']}/cancel", b"", A)
            return dict(record)

        started = time.perf_counter()
        record, worst = await _worst_wait(app, upload_and_create())
        took = time.perf_counter() - started
        print(f"\n32 MiB batch ({record['request_counts']['total']} lines): upload + create + read {took:.1f} s, "
              f"another tenant's longest GET /v1/models {worst:.3f} s")
        assert record["status"] == "validating" and record["request_counts"]["total"] > 40_000
        _off_the_loop(threads, {"parse_form", "nonblank", "load_line"})
        assert [name for name, _ in threads].count("nonblank") >= 3        # at upload, at creation, by the runner
        await asyncio.wait_for(asyncio.gather(*app.batch_runner.running.values()), 60)

    asyncio.run(main())


def _nested(depth: int) -> bytes:
    return json.dumps({"custom_id": "deep", "method": "POST", "url": "/v1/chat/completions"}).encode()[:-1] + \
        b', "body": {"model": "m", "messages": [], "x": ' + b"[" * depth + b"]" * depth + b"}}\n"


@pytest.mark.parametrize("depth", [5_000, 100_000, MAX_DEPTH + 1])
def test_a_line_nested_too_deep_is_a_400_naming_it_at_upload(depth: int) -> None:
    async def main() -> None:
        app = _app()
        ok = json.dumps({"custom_id": "ok", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}).encode() + b"\n"
        body, headers = form(ok + b"\n" + _nested(depth))
        status, _, raw = await asgi(app, "POST", "/v1/files", body, {**headers, **A})
        error = json.loads(raw)["error"]
        assert status == 400 and "line 3" in error["message"] and "nested" in error["message"], error
        assert error["param"] == "file"

    asyncio.run(main())


def test_a_stored_file_with_a_line_nested_too_deep_makes_a_failed_batch_naming_it() -> None:
    """A file that reached the store without the upload's check (an earlier edge's): the batch's creation
    fails it naming the line, as for any line that breaks the rules; never a 500."""
    async def main() -> None:
        app = _app()
        tenant = app.admission.directory.by_key("k-a")
        assert tenant is not None
        meta = await app.batch_runner.files.save(tenant.tenant, "deep.jsonl", "batch", _nested(5_000))
        request = {"input_file_id": meta["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        status, _, raw = await asgi(app, "POST", "/v1/batches", json.dumps(request).encode(), A)
        assert status == 200, raw
        record = json.loads(raw)
        assert record["status"] == "failed"
        assert [(e["code"], e["line"]) for e in record["errors"]["data"]] == [("invalid_json_line", 1)]
        assert "nested" in record["errors"]["data"][0]["message"]

    asyncio.run(main())
