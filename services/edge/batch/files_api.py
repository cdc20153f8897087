"""The Files API (OpenAI's /v1/files), for batches: POST /v1/files (multipart: `file` and `purpose`
"batch"), GET /v1/files (the tenant's), GET /v1/files/{id}, GET /v1/files/{id}/content, DELETE /v1/files/{id}.

A file lives in the cache service's object store under the caller's tenant (services/edge/object_store.py: on its
disk, so it outlives a restart of any service), as its metadata (kind "file", id `file-...`) and its bytes in
parts of at most PART_BYTES (ids `file-....0`, `.1`, ...; the store keeps values up to 4 MiB), the metadata
written last: a file is listed only once whole.  An upload is at most MAX_UPLOAD_BYTES; a batch input's lines
must each be a JSON object nested at most batch_jsonl.MAX_DEPTH deep, at most MAX_LINES of them (which line is
not is a 400 that names it), checked in a thread (services/edge/batch/jsonl.py).  Batches write their results as files
of purpose "batch_output" (services/edge/batch/runner.py).  Another tenant's ids are not found.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from services.edge.batch.jsonl import MAX_LINES, LineProblem, load_line, nonblank, parse_form
from services.edge.errors import ApiError, shown
from services.edge.object_store import StoredObjects
from services.edge.transports.asgi import Receive, Scope, Send, read_body, send_json

PREFIX = "/v1/files"
KIND = "file"
PART_BYTES = 3 << 20
MAX_UPLOAD_BYTES = 32 << 20
FORM_SLACK_BYTES = 64 << 10        # the multipart envelope around the file
UPLOAD_BODY_BYTES = MAX_UPLOAD_BYTES + FORM_SLACK_BYTES    # an upload's whole body (app.py reads it so to sign it)
PURPOSES = ("batch",)              # what a client uploads; the edge writes "batch_output" files itself
TTL_S = 30 * 86400.0


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex[:24]}"


def not_found(fid: str) -> ApiError:
    return ApiError(404, f"No such File object: {shown(fid)}", "file_id", kind="not_found_error", code=None)


class FileStore:
    """Files of one tenant each, whole or not at all."""

    def __init__(self, stored: StoredObjects):
        self.stored = stored

    async def save(self, tenant: str, filename: str, purpose: str, content: bytes) -> dict[str, Any]:
        fid = new_file_id()
        parts = [content[i:i + PART_BYTES] for i in range(0, len(content), PART_BYTES)] or [b""]
        for i, part in enumerate(parts):
            await self.stored.put(tenant, KIND, f"{fid}.{i}", part, TTL_S)
        meta = {"id": fid, "object": "file", "bytes": len(content), "created_at": int(time.time()),
                "expires_at": int(time.time() + TTL_S), "filename": filename, "purpose": purpose,
                "status": "processed", "status_details": None, "parts": len(parts)}
        await self.stored.put(tenant, KIND, fid, json.dumps(meta).encode(), TTL_S)
        return shown_meta(meta)

    async def meta(self, tenant: str, fid: str) -> dict[str, Any] | None:
        if not _is_file_id(fid):
            return None
        value = await self.stored.get(tenant, KIND, fid)
        return json.loads(value) if value is not None else None

    async def content(self, tenant: str, fid: str) -> bytes | None:
        meta = await self.meta(tenant, fid)
        return None if meta is None else await self.read(tenant, meta)

    async def read(self, tenant: str, meta: dict[str, Any]) -> bytes | None:
        """The bytes of the file `meta` describes (None: expired under it; its parts have the same TTL)."""
        parts = []
        for i in range(meta["parts"]):
            part = await self.stored.get(tenant, KIND, f"{meta['id']}.{i}")
            if part is None:
                return None
            parts.append(part)
        return b"".join(parts)

    async def delete(self, tenant: str, meta: dict[str, Any]) -> None:
        """Delete the file `meta` describes: its description first (a half-deleted file is not listed)."""
        await self.stored.delete(tenant, KIND, meta["id"])
        for i in range(meta["parts"]):
            await self.stored.delete(tenant, KIND, f"{meta['id']}.{i}")

    async def listed(self, tenant: str) -> list[dict[str, Any]]:
        found = []
        for _, fid in await self.stored.keys(tenant, KIND):
            if "." not in fid and (meta := await self.meta(tenant, fid)) is not None:
                found.append(shown_meta(meta))
        return sorted(found, key=lambda m: (-m["created_at"], m["id"]))


def shown_meta(meta: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in meta.items() if k != "parts"}


def _is_file_id(fid: str) -> bool:
    return fid.startswith("file-") and 5 < len(fid) <= 64 and "." not in fid and "/" not in fid


class Files:
    """The routes (app.py sends every /v1/files path here; the caller is admitted by then)."""

    def __init__(self, files: FileStore, admission: Any, body_timeout_s: float):
        self.files, self.admission, self.body_timeout_s = files, admission, body_timeout_s

    async def route(self, scope: Scope, headers: dict[str, str], receive: Receive, send: Send) -> int:
        method, tail = scope["method"], scope["path"][len(PREFIX):].strip("/")
        tenant = scope["infermesh.caller"].tenant
        fid, _, rest = tail.partition("/")
        if method == "POST" and not tail:
            return await self.upload(scope, headers, receive, send)
        if method == "GET" and not tail:
            data = await self.files.listed(tenant)
            await send_json(send, 200, {"object": "list", "data": data, "has_more": False,
                                        "first_id": data[0]["id"] if data else None,
                                        "last_id": data[-1]["id"] if data else None})
            return 200
        if method == "GET" and fid and rest == "content":
            content = await self.files.content(tenant, fid)
            if content is None:
                raise not_found(fid)
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/octet-stream"),
                                    (b"content-length", str(len(content)).encode())]})
            await send({"type": "http.response.body", "body": content})
            return 200
        if method in ("GET", "DELETE") and fid and not rest:
            meta = await self.files.meta(tenant, fid)
            if meta is None:
                raise not_found(fid)
            if method == "DELETE":
                await self.files.delete(tenant, meta)
            body = shown_meta(meta) if method == "GET" else {"id": fid, "object": "file", "deleted": True}
            await send_json(send, 200, body)
            return 200
        raise ApiError(405 if not rest or rest == "content" else 404,
                       f"no route {shown(method)} {shown(scope['path'])}; use POST|GET {PREFIX}, GET|DELETE "
                       f"{PREFIX}/ID or GET {PREFIX}/ID/content", kind="invalid_request_error", code=None)

    async def upload(self, scope: Scope, headers: dict[str, str], receive: Receive, send: Send) -> int:
        raw = await read_body(receive, headers, UPLOAD_BODY_BYTES, self.body_timeout_s)
        # (its signature, for a key that must sign, was checked by the app over this body: EdgeApp._signed)
        # Seconds of CPU for a large file: in a thread, so that the edge's other requests go on meanwhile.
        purpose, filename, content = await asyncio.to_thread(read_upload, headers.get("content-type", ""), raw)
        meta = await self.files.save(scope["infermesh.caller"].tenant, str(filename)[:256], purpose, content)
        await send_json(send, 200, meta)
        return 200


def read_upload(content_type: str, raw: bytes) -> tuple[str, str | None, bytes]:
    """(purpose, filename, content) of an upload, its lines checked (off the event loop: a thread's work)."""
    form = parse_form(content_type, raw)
    purpose = form.get("purpose", (None, b""))[1].decode("utf-8", "replace").strip()
    if purpose not in PURPOSES:
        raise ApiError(400, f"purpose {shown(purpose)!r} is not supported; use 'batch'", "purpose")
    if "file" not in form or form["file"][0] is None:
        raise ApiError(400, "give the file as a multipart field 'file' with a filename", "file",
                       code="missing_required_parameter")
    filename, content = form["file"]
    if len(content) > MAX_UPLOAD_BYTES:
        raise ApiError(413, f"the file is {len(content)} bytes; at most {MAX_UPLOAD_BYTES}", "file",
                       code="file_too_large")
    check_jsonl(content)
    return purpose, filename, content


def check_jsonl(content: bytes) -> None:
    """400 naming the first line of a batch input that is not a JSON object (or is nested past MAX_DEPTH), or
    the first request past MAX_LINES; blank lines are allowed."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"the file is not UTF-8 (byte {exc.start})", "file") from None
    if not text or text.isspace():
        raise ApiError(400, "the file is empty; a batch input has one JSON request per line", "file")
    for count, (number, line) in enumerate(nonblank(text), 1):
        if count > MAX_LINES:
            raise ApiError(400, f"line {number} of the file is request {count}; a batch input has at most "
                           f"{MAX_LINES} requests", "file")
        try:
            value = load_line(line)
        except LineProblem as exc:
            raise ApiError(400, f"line {number} of the file is not a JSON object a batch can take: {exc}", "file",
                           code="invalid_json_line") from None
        if not isinstance(value, dict):
            raise ApiError(400, f"line {number} of the file is not a JSON object; a batch input has one JSON "
                           "request per line", "file", code="invalid_json_line")
