"""Every refusal the edge answers itself: its status, OpenAI error body and Retry-After (services/edge/errors.py)."""

import asyncio
import json
from collections.abc import AsyncIterator

import grpc
import pytest

from mesh.apikeys import digest
from mesh.clients.router_client import Delta, GenerateSpec
from services.edge.errors import ApiError, from_grpc
from tests.fakes.edge_router import CHAT_JSON, FakeRouter, asgi, edge_app


def _rpc_error(code: grpc.StatusCode, details: str, retry_after: str | None = None) -> grpc.aio.AioRpcError:
    trailing = grpc.aio.Metadata(("retry-after", retry_after)) if retry_after else grpc.aio.Metadata()
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details)


class FailingRouter(FakeRouter):
    def __init__(self, err: grpc.aio.AioRpcError | None):
        super().__init__()
        self.deltas = [Delta("Hi")]           # never a final message
        self.err = err

    async def generate(self, spec: GenerateSpec, timeout: float | None = None) -> AsyncIterator[Delta]:
        self.calls.append(spec)
        if self.err is not None:
            raise self.err
        for d in self.deltas:
            yield d


def _error(body: bytes) -> dict[str, object]:
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error  # type: ignore[no-any-return]


@pytest.mark.parametrize("method,path,headers,status,kind,code", [
    ("GET", "/nowhere", {}, 404, "not_found_error", None),
    ("DELETE", "/v1/models", {}, 405, "invalid_request_error", "method_not_allowed"),
    ("GET", "/admin/models/m/routing", {}, 403, "permission_error", "admin_disabled"),
])
def test_routes_and_admin_refusals(method: str, path: str, headers: dict[str, str], status: int, kind: str,
                                   code: str | None) -> None:
    got, _, body = asyncio.run(asgi(edge_app(), method, path, b"", headers))
    error = _error(body)
    assert (got, error["type"], error["code"]) == (status, kind, code)


def test_admin_keys_are_checked_and_admin_paths_are_exact() -> None:
    app = edge_app(admin_key_digests=(digest("admin"),))
    status, _, body = asyncio.run(asgi(app, "GET", "/admin/models/m/routing", b"", {"authorization": "Bearer no"}))
    assert status == 401 and _error(body)["code"] == "invalid_admin_key"
    status, _, body = asyncio.run(asgi(app, "GET", "/admin/models/m/other", b"", {"authorization": "Bearer admin"}))
    assert status == 404 and _error(body)["type"] == "not_found_error"
    status, _, body = asyncio.run(asgi(app, "POST", "/admin/models/m/routing", b""))
    assert status == 405 and _error(body)["code"] == "method_not_allowed"


@pytest.mark.parametrize("code,status,kind,retry_after", [
    (grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error", None),
    (grpc.StatusCode.NOT_FOUND, 404, "not_found_error", None),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error", "1"),
    (grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable", "1"),
    (grpc.StatusCode.DEADLINE_EXCEEDED, 504, "timeout", None),
])
def test_router_errors_become_http_statuses(code: grpc.StatusCode, status: int, kind: str,
                                            retry_after: str | None) -> None:
    for stream in (False, True):
        body = json.dumps({**json.loads(CHAT_JSON), "stream": stream}).encode()
        got, headers, raw = asyncio.run(asgi(edge_app(FailingRouter(_rpc_error(code, "why"))), "POST",
                                             "/v1/chat/completions", body))
        error = _error(raw)
        assert (got, error["type"], error["code"], error["message"]) == (status, kind, code.name.lower(), "why")
        assert headers.get("retry-after") == retry_after


def test_router_retry_after_is_kept() -> None:
    err = from_grpc(_rpc_error(grpc.StatusCode.UNAVAILABLE, "all replicas busy", "7"))
    assert (err.status, err.retry_after_s, err.body()["error"]["type"]) == (503, 7, "service_unavailable")


def test_a_stream_without_a_final_message_is_a_502() -> None:
    got, _, raw = asyncio.run(asgi(edge_app(FailingRouter(None)), "POST", "/v1/chat/completions", CHAT_JSON))
    assert got == 502 and _error(raw)["type"] == "server_error"


def test_api_error_defaults_are_a_400_invalid_value() -> None:
    err = ApiError(400, "bad", "temperature")
    assert err.body() == {"error": {"message": "bad", "type": "invalid_request_error", "param": "temperature",
                                    "code": "invalid_value"}}
    assert (err.retry_after_s, err.close) == (0, False)
