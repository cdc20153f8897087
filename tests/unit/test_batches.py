"""Files and batches on the edge (services/edge/batch/files_api.py, batches_api.py, batch_runner.py) over a router
double, the objects in the edge's memory: upload, validation, a batch run in the batch class, its output and
error files as OpenAI writes them, cancel, a line retried after a 503, and a batch taken over by another
edge from the results its first edge wrote."""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from services.edge.batch import runner as batch_runner
from services.edge.batch.files_api import FileStore
from services.edge.batch.runner import BatchRunner
from services.edge.errors import ApiError
from services.edge.gateway.tenants import STANDARD, AuthenticatedCaller, TenantTier
from services.edge.object_store import StoredObjects
from tests.fakes.edge_router import FakeRouter, asgi, edge_app

BOUNDARY = "----infermeshtest"


def sync(test: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> None:
        asyncio.run(test(*args, **kwargs))
    return run


def form(content: bytes, purpose: str = "batch", filename: str = "in.jsonl") -> tuple[bytes, dict[str, str]]:
    body = (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\n{purpose}\r\n"
            f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{filename}\"\r\n"
            f"Content-Type: application/octet-stream\r\n\r\n").encode() + content + f"\r\n--{BOUNDARY}--\r\n".encode()
    return body, {"content-type": f"multipart/form-data; boundary={BOUNDARY}", "content-length": str(len(body))}


def lines(n: int, url: str = "/v1/chat/completions", **extra: Any) -> bytes:
    return "".join(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": url, **extra,
                               "body": {"model": "m", "messages": [{"role": "user", "content": f"hi {i}"}],
                                        "max_tokens": 4}}) + "\n" for i in range(n)).encode()


async def upload(app: Any, content: bytes, who: dict[str, str] | None = None) -> str:
    body, headers = form(content)
    status, _, raw = await asgi(app, "POST", "/v1/files", body, {**headers, **(who or {})})
    assert status == 200, raw
    return json.loads(raw)["id"]


async def create(app: Any, fid: str, who: dict[str, str] | None = None, **extra: Any) -> dict[str, Any]:
    body = {"input_file_id": fid, "endpoint": "/v1/chat/completions", "completion_window": "24h", **extra}
    status, _, raw = await asgi(app, "POST", "/v1/batches", json.dumps(body).encode(), who)
    assert status == 200, raw
    return json.loads(raw)


async def submit(app: Any, content: bytes, who: dict[str, str] | None = None) -> str:
    """A batch of `content`'s lines, uploaded and created as `who`: its id."""
    return str((await create(app, await upload(app, content, who), who))["id"])


async def settled(app: Any, bid: str, seconds: float = 10) -> dict[str, Any]:
    deadline = time.monotonic() + seconds
    while True:
        _, _, raw = await asgi(app, "GET", f"/v1/batches/{bid}")
        record = json.loads(raw)
        if record["status"] in ("completed", "failed", "cancelled", "expired"):
            return record
        assert time.monotonic() < deadline, record
        await asyncio.sleep(0.02)


async def content(app: Any, fid: str) -> list[dict[str, Any]]:
    status, _, raw = await asgi(app, "GET", f"/v1/files/{fid}/content")
    assert status == 200
    return [json.loads(line) for line in raw.decode().splitlines()]


@sync
async def test_a_batch_runs_its_lines_in_the_batch_class_and_writes_the_output_file() -> None:
    router = FakeRouter()
    app = edge_app(router, response_cache_ttl_s=0)
    fid = await upload(app, lines(5))
    _, _, raw = await asgi(app, "GET", f"/v1/files/{fid}")
    assert json.loads(raw)["purpose"] == "batch" and json.loads(raw)["bytes"] == len(lines(5))
    record = await settled(app, (await create(app, fid, metadata={"job": "nightly"}))["id"])
    assert record["status"] == "completed" and record["request_counts"] == {"total": 5, "completed": 5, "failed": 0}
    assert record["metadata"] == {"job": "nightly"} and record["error_file_id"] is None and "_run" not in record
    out = await content(app, record["output_file_id"])
    assert [o["custom_id"] for o in out] == [f"req-{i}" for i in range(5)]
    assert all(o["response"]["status_code"] == 200 and o["error"] is None and o["id"].startswith("batch_req_")
               and o["response"]["body"]["choices"][0]["message"]["content"] == "Hi!"
               and o["response"]["request_id"] == o["response"]["body"]["id"] for o in out)
    assert len(router.calls) == 5 and {c.priority for c in router.calls} == {"batch"}
    _, _, raw = await asgi(app, "GET", "/v1/batches?limit=1")
    assert [b["id"] for b in json.loads(raw)["data"]] == [record["id"]]
    _, _, raw = await asgi(app, "GET", "/v1/files")
    assert {f["purpose"] for f in json.loads(raw)["data"]} == {"batch", "batch_output"}
    status, _, raw = await asgi(app, "POST", f"/v1/batches/{record['id']}/cancel")
    assert status == 409 and "completed" in json.loads(raw)["error"]["message"]


@sync
async def test_a_request_a_line_cannot_make_is_its_error_line() -> None:
    app = edge_app(FakeRouter(), response_cache_ttl_s=0)
    bad = json.dumps({"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions",
                      "body": {"model": "m", "messages": []}}).encode() + b"\n"
    record = await settled(app, (await create(app, await upload(app, lines(2) + bad)))["id"])
    assert record["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    errors = await content(app, record["error_file_id"])
    assert errors[0]["custom_id"] == "bad" and errors[0]["response"]["status_code"] == 400
    assert errors[0]["response"]["body"]["error"]["param"] == "messages"


@sync
async def test_an_input_that_breaks_the_rules_makes_a_failed_batch_naming_its_lines() -> None:
    app = edge_app(FakeRouter())
    text = lines(2) + lines(1) + lines(1, url="/v1/completions").replace(b"req-0", b"other")
    record = await create(app, await upload(app, text))
    assert record["status"] == "failed" and record["failed_at"]
    assert [(e["code"], e["line"]) for e in record["errors"]["data"]] == [("duplicate_custom_id", 3),
                                                                          ("invalid_url", 4)]


@pytest.mark.parametrize(("body", "param"), [
    ({"endpoint": "/v1/chat/completions", "completion_window": "24h"}, "input_file_id"),
    ({"input_file_id": "file-x", "endpoint": "/v1/moderations", "completion_window": "24h"}, "endpoint"),
    ({"input_file_id": "file-x", "endpoint": "/v1/completions", "completion_window": "1h"}, "completion_window"),
    ({"input_file_id": "file-x", "endpoint": "/v1/completions", "completion_window": "24h", "x": 1}, "x"),
    ({"input_file_id": "file-x", "endpoint": "/v1/completions", "completion_window": "24h",
      "metadata": {"k": 1}}, "metadata"),
])
@sync
async def test_a_wrong_create_request_is_a_400_naming_the_field(body: dict[str, Any], param: str) -> None:
    status, _, raw = await asgi(edge_app(FakeRouter()), "POST", "/v1/batches", json.dumps(body).encode())
    assert status == 400 and json.loads(raw)["error"]["param"] == param


@sync
async def test_uploads_are_checked() -> None:
    app = edge_app(FakeRouter())
    status, _, raw = await asgi(app, "POST", "/v1/files", *form(b'{"a": 1}\nnot json\n'))
    assert status == 400 and "line 2" in json.loads(raw)["error"]["message"]
    status, _, raw = await asgi(app, "POST", "/v1/files", *form(b'{"a": 1}\n', purpose="fine-tune"))
    assert status == 400 and json.loads(raw)["error"]["param"] == "purpose"
    status, _, raw = await asgi(app, "POST", "/v1/files", b"{}", {"content-type": "application/json"})
    assert status == 400 and "multipart" in json.loads(raw)["error"]["message"]
    status, _, _ = await asgi(app, "GET", "/v1/files/file-nope/content")
    assert status == 404
    fid = await upload(app, lines(1))
    status, _, raw = await asgi(app, "DELETE", f"/v1/files/{fid}")
    assert status == 200 and json.loads(raw)["deleted"]
    assert (await asgi(app, "GET", f"/v1/files/{fid}"))[0] == 404


@sync
async def test_a_cancelled_batch_stops_and_reports_the_lines_it_did_not_run() -> None:
    router = FakeRouter()
    router.release = asyncio.Event()                  # every line waits in the "engine"
    app = edge_app(router, response_cache_ttl_s=0, batch_concurrency=2)
    record = await create(app, await upload(app, lines(6)))
    while len(router.calls) < 2:
        await asyncio.sleep(0.01)
    status, _, raw = await asgi(app, "POST", f"/v1/batches/{record['id']}/cancel")
    assert status == 200 and json.loads(raw)["status"] == "cancelling"
    record = await settled(app, record["id"])
    assert record["status"] == "cancelled" and record["cancelled_at"] and record["output_file_id"] is None
    assert len(router.calls) == 2                     # the two under way were stopped, no more began
    errors = await content(app, record["error_file_id"])
    assert [e["custom_id"] for e in errors] == [f"req-{i}" for i in range(6)]
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}


CALLER = AuthenticatedCaller(("batch", "t"), "t", TenantTier(STANDARD, priority="batch"), "t")


def record_of(fid: str, total: int, owner: str, lease_until: float) -> dict[str, Any]:
    now = int(time.time())
    return {"id": "batch_taken", "object": "batch", "endpoint": "/v1/chat/completions", "errors": None,
            "input_file_id": fid, "completion_window": "24h", "status": "in_progress", "output_file_id": None,
            "error_file_id": None, "created_at": now, "in_progress_at": now, "expires_at": now + 86400,
            "finalizing_at": None, "completed_at": None, "failed_at": None, "expired_at": None,
            "cancelling_at": None, "cancelled_at": None, "request_counts": {"total": total, "completed": 0,
                                                                           "failed": 0},
            "metadata": None, "_run": {"tenant": "t", "tier": STANDARD, "label": "t", "owner": owner,
                                       "lease_until": lease_until}}


@sync
async def test_another_edge_takes_over_a_batch_whose_lease_ran_out_and_retries_a_503(monkeypatch: Any) -> None:
    monkeypatch.setattr(batch_runner, "PERSIST_S", 0.01)
    stored = StoredObjects()
    files = FileStore(stored)
    fid = (await files.save("t", "in.jsonl", "batch", lines(3)))["id"]
    asked: list[str] = []

    async def call(caller: AuthenticatedCaller, url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any], int]:
        text = body["messages"][0]["content"]
        asked.append(text)
        if asked.count(text) == 1 and text == "hi 2":
            return 503, {"error": {"message": "busy"}}, 0
        return 200, {"id": f"chatcmpl-{text}"}, 0

    first = BatchRunner(stored, files, call, lambda run: CALLER, "edge-a", 2)
    live = record_of(fid, 3, "edge-a/0", time.time() + 60)
    await first.put("t", live)
    done = {"0": {"ok": True, "line": {"id": "batch_req_0", "custom_id": "req-0", "error": None,
                                        "response": {"status_code": 200, "request_id": "x", "body": {}}}}}
    await stored.put("t", "batch", "batch_taken.r0", json.dumps(done).encode())   # line 0 answered before
    second = BatchRunner(stored, files, call, lambda run: CALLER, "edge-b", 2)
    assert await second.scan() == 0                    # edge-a's lease holds
    await first.put("t", record_of(fid, 3, "edge-a/0", time.time() - 1))
    assert await second.scan() == 1
    await asyncio.gather(*second.running.values())
    record = await second.record("t", "batch_taken")
    assert record is not None and record["status"] == "completed"
    assert sorted(asked) == ["hi 1", "hi 2", "hi 2"]   # line 0 not again; line 2 once more after its 503
    out = await files.content("t", record["output_file_id"])
    assert out is not None and [json.loads(x)["custom_id"] for x in out.decode().splitlines()] == ["req-0", "req-1",
                                                                                                   "req-2"]
    assert await stored.get("t", "batch", "batch_taken.r0") is None          # the parts go once the files are out


@sync
async def test_a_batch_whose_store_is_down_when_it_ends_finishes_once_the_store_is_back(monkeypatch: Any) -> None:
    """The cache service restarting just as the last line is answered: the finish is tried again (the results are
    in memory) instead of the batch waiting for its lease to run out and another scan."""
    monkeypatch.setattr(batch_runner, "FINISH_INTERVAL_S", 0.01)

    class Restarting(StoredObjects):
        down = 0                                     # puts refused from now on, as while the service restarts

        async def put(self, tenant: str, kind: str, oid: str, value: bytes, ttl_s: float = 0) -> None:
            if self.down and kind == "file":
                self.down -= 1
                raise ApiError(503, "the object store is unreachable (UNAVAILABLE); retry shortly")
            await super().put(tenant, kind, oid, value, ttl_s or 3600)

    stored = Restarting()
    files = FileStore(stored)
    fid = (await files.save("t", "in.jsonl", "batch", lines(3)))["id"]

    async def call(caller: AuthenticatedCaller, url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any], int]:
        stored.down = 3                              # the output file's writes fail three times
        return 200, {"id": "chatcmpl-x"}, 0

    runner = BatchRunner(stored, files, call, lambda run: CALLER, "edge-a", 2)
    record = record_of(fid, 3, runner.owner, time.time() + 60)
    await runner.put("t", record)
    runner.launch("t", record)
    await asyncio.wait_for(asyncio.gather(*runner.running.values()), 10)
    done = await runner.record("t", "batch_taken")
    assert done is not None and done["status"] == "completed" and stored.down == 0
    assert done["output_file_id"] and await files.content("t", done["output_file_id"]) is not None
