"""The Batch API (OpenAI's /v1/batches): POST /v1/batches, GET /v1/batches (the tenant's, newest first),
GET /v1/batches/{id}, POST /v1/batches/{id}/cancel.  The lines run in services/edge/batch/runner.py.

A batch names an uploaded file of purpose "batch" (services/edge/batch/files_api.py) whose lines are
`{"custom_id", "method": "POST", "url", "body"}`, every url the batch's endpoint (/v1/chat/completions,
/v1/completions, /v1/embeddings or /v1/responses), custom_ids unique, no `stream`.  A file that breaks these
makes a batch whose status is "failed" with `errors` naming each line (as OpenAI's validation does), not a
400; a field of the create request itself that is wrong is a 400 that names it.  The file's lines are checked
in a thread (seconds of CPU for a large one).  Records keep `_run` (the tenant, tier and lease the runner
needs, and the name of the token budget its lines draw on: services/edge/batch/admission.py) out of what
clients see.  Another tenant's ids are not found.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from services.edge.batch.admission import budget_name
from services.edge.batch.files_api import FileStore
from services.edge.batch.jsonl import MAX_LINES, LineProblem, load_line, nonblank
from services.edge.batch.runner import KIND, BatchRunner
from services.edge.errors import ApiError, shown
from services.edge.transports.asgi import Receive, Scope, Send, send_json

PREFIX = "/v1/batches"
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
WINDOW_S = {"24h": 86400}
MAX_ERRORS = 100
FIELDS = ("input_file_id", "endpoint", "completion_window", "metadata")


def new_batch_id() -> str:
    return f"batch_{uuid.uuid4().hex[:24]}"


def public(record: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in record.items() if k != "_run"}


def not_found(bid: str) -> ApiError:
    return ApiError(404, f"No batch found with id '{shown(bid)}'.", "batch_id", kind="not_found_error", code=None)


class Batches:
    """The routes (app.py sends every /v1/batches path here; the caller is admitted by then)."""

    def __init__(self, files: FileStore, runner: BatchRunner, read_json: Any):
        self.files, self.runner, self.read_json = files, runner, read_json

    async def route(self, scope: Scope, headers: dict[str, str], receive: Receive, send: Send) -> int:
        method, tail = scope["method"], scope["path"][len(PREFIX):].strip("/")
        caller = scope["infermesh.caller"]
        bid, _, rest = tail.partition("/")
        if method == "POST" and not tail:
            record = await self.create(caller, await self.read_json(scope, receive, headers))
        elif method == "GET" and not tail:
            return await self.listed(caller.tenant, scope, send)
        elif method == "GET" and bid and not rest:
            record = await self._record(caller.tenant, bid)
        elif method == "POST" and bid and rest == "cancel":
            record = await self.cancel(caller.tenant, bid)
        elif not rest or rest == "cancel":
            raise ApiError(405, f"method {shown(method)} is not allowed on {shown(scope['path'])}",
                           code="method_not_allowed")
        else:
            raise ApiError(404, f"no route {shown(method)} {shown(scope['path'])}; use POST|GET {PREFIX}, GET "
                           f"{PREFIX}/ID or POST {PREFIX}/ID/cancel", kind="not_found_error", code=None)
        await send_json(send, 200, public(record))
        return 200

    async def _record(self, tenant: str, bid: str) -> dict[str, Any]:
        record = await self.runner.record(tenant, bid) if bid.startswith("batch_") and "." not in bid else None
        if record is None:
            raise not_found(bid)
        return record

    async def create(self, caller: Any, body: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(body) - set(FIELDS) - {"output_expires_after"})
        if unknown:
            raise ApiError(400, f"unrecognized field(s): {shown(', '.join(unknown))}; use {', '.join(FIELDS)}",
                           unknown[0], code="unknown_parameter")
        fid, endpoint, window = body.get("input_file_id"), body.get("endpoint"), body.get("completion_window")
        if not isinstance(fid, str) or not fid:
            raise ApiError(400, "input_file_id is required: the id of a file uploaded with purpose 'batch'",
                           "input_file_id", code="missing_required_parameter")
        if endpoint not in ENDPOINTS:
            raise ApiError(400, f"endpoint {shown(endpoint)!r} is not supported; use one of {', '.join(ENDPOINTS)}",
                           "endpoint")
        if window not in WINDOW_S:
            raise ApiError(400, f"completion_window {shown(window)!r} is not supported; use '24h'",
                           "completion_window")
        metadata = check_metadata(body.get("metadata"))
        meta = await self.files.meta(caller.tenant, fid)
        if meta is None:
            raise ApiError(404, f"No such File object: {shown(fid)}", "input_file_id", kind="not_found_error",
                           code=None)
        if meta["purpose"] != "batch":
            raise ApiError(400, f"file {shown(fid)} has purpose {meta['purpose']!r}; a batch reads a file uploaded "
                           "with purpose 'batch'", "input_file_id")
        content = await self.files.read(caller.tenant, meta)
        if content is None:
            raise ApiError(404, f"No such File object: {shown(fid)}", "input_file_id", kind="not_found_error",
                           code=None)
        total, errors = await asyncio.to_thread(check_lines, content, endpoint)
        now = int(time.time())
        record: dict[str, Any] = {
            "id": new_batch_id(), "object": "batch", "endpoint": endpoint, "errors": None, "input_file_id": fid,
            "completion_window": window, "status": "validating", "output_file_id": None, "error_file_id": None,
            "created_at": now, "in_progress_at": None, "expires_at": now + WINDOW_S[window], "finalizing_at": None,
            "completed_at": None, "failed_at": None, "expired_at": None, "cancelling_at": None,
            "cancelled_at": None, "request_counts": {"total": total, "completed": 0, "failed": 0},
            "metadata": metadata,
            "_run": {"tenant": caller.tenant, "tier": caller.tier.name, "label": caller.label,
                     "budget": budget_name(caller)}}
        if errors:
            record.update(status="failed", failed_at=now, errors={"object": "list", "data": errors})
        else:
            self.runner.lease(record)
        await self.runner.put(caller.tenant, record)
        if not errors:
            self.runner.launch(caller.tenant, record)
        return record

    async def cancel(self, tenant: str, bid: str) -> dict[str, Any]:
        record = await self._record(tenant, bid)
        if record["status"] in ("validating", "in_progress"):
            record.update(status="cancelling", cancelling_at=int(time.time()))
            await self.runner.put(tenant, record)
            self.runner.cancel(bid)
        elif record["status"] not in ("cancelling", "cancelled"):
            raise ApiError(409, f"Cannot cancel a batch with status '{record['status']}'.", "batch_id",
                           code="batch_not_cancellable")
        return record

    async def listed(self, tenant: str, scope: Scope, send: Send) -> int:
        query = dict(p.partition("=")[::2] for p in scope.get("query_string", b"").decode("latin-1").split("&") if p)
        limit = query.get("limit", "20")
        if not limit.isdigit() or not 1 <= int(limit) <= 100:
            raise ApiError(400, f"limit {shown(limit)!r} must be a whole number from 1 to 100", "limit")
        records = []
        for _, bid in await self.runner.stored.keys(tenant, KIND):
            if "." not in bid and (record := await self.runner.record(tenant, bid)) is not None:
                records.append(public(record))
        records.sort(key=lambda r: (-r["created_at"], r["id"]))
        after = query.get("after", "")
        if after:
            ids = [r["id"] for r in records]
            records = records[ids.index(after) + 1:] if after in ids else []
        page = records[:int(limit)]
        await send_json(send, 200, {"object": "list", "data": page, "has_more": len(records) > len(page),
                                    "first_id": page[0]["id"] if page else None,
                                    "last_id": page[-1]["id"] if page else None})
        return 200


def check_metadata(metadata: Any) -> dict[str, str] | None:
    """At most 16 pairs, keys up to 64 characters and values up to 512, all strings (OpenAI's limits)."""
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or len(metadata) > 16 or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512 for k, v in metadata.items()):
        raise ApiError(400, "metadata is at most 16 string pairs, keys up to 64 characters and values up to 512",
                       "metadata")
    return metadata


def check_lines(content: bytes, endpoint: str) -> tuple[int, list[dict[str, Any]]]:
    """The input's requests, and what is wrong with them (OpenAI's batch error objects, at most MAX_ERRORS)."""
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()

    def wrong(code: str, message: str, param: str | None, line: int) -> None:
        if len(errors) < MAX_ERRORS:
            errors.append({"code": code, "message": message, "param": param, "line": line})

    total = 0
    for number, raw in nonblank(content.decode("utf-8", "replace")):
        total += 1
        if total > MAX_LINES:      # refused whole: the rest is only counted
            continue
        try:
            item = load_line(raw)
        except LineProblem as exc:
            wrong("invalid_json_line", f"this line is not a JSON object a batch can take: {exc}", None, number)
            continue
        if not isinstance(item, dict):
            wrong("invalid_json_line", "this line is not a JSON object", None, number)
            continue
        custom_id, body = item.get("custom_id"), item.get("body")
        if not isinstance(custom_id, str) or not custom_id or len(custom_id) > 512:
            wrong("missing_custom_id", "custom_id must be a string of 1 to 512 characters", "custom_id", number)
        elif custom_id in seen:
            wrong("duplicate_custom_id", f"custom_id {shown(custom_id)!r} is used by an earlier line", "custom_id",
                  number)
        else:
            seen.add(custom_id)
        if item.get("method") != "POST":
            wrong("invalid_method", "method must be 'POST'", "method", number)
        if item.get("url") != endpoint:
            wrong("invalid_url", f"url must be the batch's endpoint, {endpoint}", "url", number)
        if not isinstance(body, dict):
            wrong("invalid_body", "body must be a JSON object: the request for the endpoint", "body", number)
        elif body.get("stream"):
            wrong("invalid_body", "a batch request cannot stream; leave out 'stream'", "body.stream", number)
    if total == 0:
        wrong("empty_file", "the input file has no requests", None, 0)
    elif total > MAX_LINES:
        errors[:] = [{"code": "too_many_requests", "param": None, "line": 0,
                      "message": f"the input file has {total} requests; a batch takes at most {MAX_LINES}"}]
    return total, errors

