"""ApiError: every refusal the edge answers, with its HTTP status and OpenAI's error shape.

Clients see `{"error": {"message", "type", "param", "code"}}` (OpenAI's envelope); `type` is
OpenAI's error type (`invalid_request_error`, `authentication_error`, ...) or, for the rate
limits, the limit that refused (`requests`, `tokens`), as OpenAI's own 429s say.
"""

from __future__ import annotations

from typing import Any

import grpc

from mesh.errors import http_status
from mesh.grpcutil import retry_after as grpc_retry_after

# ApiError(retry_after_s=DO_NOT_RETRY): the request can never pass as it is (say, more tokens than its
# tier's whole budget); sent as `x-should-retry: false`, which OpenAI's clients obey instead of retrying
# a 429.  A sentinel rather than another field: the app sends every ApiError with send_json's arguments.
DO_NOT_RETRY = -1
SHOWN_CHARS = 64                # a client's value echoed in an error is cut to this many characters
MAX_MESSAGE_CHARS = 512         # a message relayed from the router, likewise


def shown(text: object, limit: int = SHOWN_CHARS) -> str:
    """A client's value as an error message may echo it: cut to `limit` characters plus an ellipsis,
    so a 10 KB method, header or field name never comes back whole."""
    text = str(text)
    return text if len(text) <= limit else text[:limit] + "..."


class ApiError(Exception):
    """A request the edge answers with `status` instead of a completion."""

    def __init__(self, status: int, message: str, param: str | None = None, *,
                 kind: str = "invalid_request_error", code: str | None = "invalid_value",
                 retry_after_s: int = 0, close: bool = False):
        super().__init__(message)
        self.status, self.message, self.kind, self.code = status, message, kind, code
        self.param = None if param is None else shown(param)
        self.retry_after_s = retry_after_s      # > 0: sent as a Retry-After header (429, 503); or DO_NOT_RETRY
        self.close = close                      # the request was not read to its end: close the connection

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.kind, self.code, self.param)


def error_body(message: str, kind: str, code: str | int | None = None, param: str | None = None
               ) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def from_grpc(err: grpc.aio.AioRpcError) -> ApiError:
    """The router's gRPC status as the client's HTTP answer; its `retry-after` trailer is kept, and
    429/503 always carry one (1 s when the router named none)."""
    status, kind = http_status(err.code())
    retry_after = grpc_retry_after(err)
    if status in (429, 503) and not retry_after:
        retry_after = 1
    # the router's message may quote what the client sent (a model name, a replica pin): bounded too
    return ApiError(status, shown(err.details() or err.code().name, MAX_MESSAGE_CHARS), kind=kind,
                    code=err.code().name.lower(), retry_after_s=retry_after)
