"""ASGI 3 (http scope) types for the edge's app and its HTTP/3 adapter, and the app's body I/O.

uvicorn (HTTP/1.1) and services/edge/transports/http3.py (HTTP/3) both call the one app with these.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, TypeVar

from services.edge.errors import ApiError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
T = TypeVar("T")

JSON_HEADERS = [(b"content-type", b"application/json")]


async def send_json(send: Send, status: int, obj: dict[str, Any], retry_after_s: int = 0,
                    close: bool = False) -> None:
    body = json.dumps(obj).encode()
    headers = [*JSON_HEADERS, (b"content-length", str(len(body)).encode())]
    if retry_after_s > 0:
        headers.append((b"retry-after", str(retry_after_s).encode()))
    elif retry_after_s < 0:         # errors.DO_NOT_RETRY: the request cannot pass as it is
        headers.append((b"x-should-retry", b"false"))
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def read_body(receive: Receive, headers: dict[str, str], limit: int, timeout_s: float) -> bytes:
    """The whole body, at most `limit` bytes (413, refused on Content-Length before reading), read
    within `timeout_s` (408: a client trickling its body must not hold the request open)."""
    declared = headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body is larger than {limit} bytes", code="body_too_large")
    deadline = asyncio.get_running_loop().time() + timeout_s
    chunks, size = [], 0
    while True:
        try:
            async with asyncio.timeout_at(deadline):       # (wait_for may swallow a cancellation on 3.11)
                message = await receive()
        except TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {timeout_s:g} s",
                           code="request_timeout", close=True) from None
        if message["type"] == "http.disconnect":
            raise ApiError(499, "client disconnected", code=None)
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body is larger than {limit} bytes", code="body_too_large")
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


async def wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_gone(work: Awaitable[T], receive: Receive) -> T | None:
    """`work`'s result, or None when the client disconnects first: `work` is then cancelled (a
    router call cancelled is its gRPC stream cancelled, and the engine's work aborted)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(wait_disconnect(receive))
    left = True
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        left = not task.done()
    finally:
        for t in (task, gone):
            t.cancel()
        await asyncio.gather(task, gone, return_exceptions=True)
    return None if left else task.result()
