"""Errors that carry their gRPC status, so every hop can fail precisely.

Service code raises these; `mesh.grpcutil.rpc_errors` turns them into the status code
at the RPC edge, and the edge turns status codes into HTTP statuses.
"""

from __future__ import annotations

import grpc


class MeshError(Exception):
    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, retry_after_s: int = 0, caller_limit: bool = False):
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s      # > 0: sent as `retry-after` trailing metadata (HTTP Retry-After)
        # The caller's own limit (a tenant's rate), not this service's state: sent as `infermesh-limit: caller`
        # (mesh.grpcutil.CALLER_LIMIT), which a router relays instead of failing over.
        self.caller_limit = caller_limit


class InvalidArgument(MeshError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class ResourceExhausted(MeshError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class NotFound(MeshError):
    code = grpc.StatusCode.NOT_FOUND


class Unauthenticated(MeshError):
    code = grpc.StatusCode.UNAUTHENTICATED


class Unavailable(MeshError):
    code = grpc.StatusCode.UNAVAILABLE


class FailedPrecondition(MeshError):
    code = grpc.StatusCode.FAILED_PRECONDITION


# gRPC status -> (HTTP status, OpenAI error type) for the edge.
HTTP_STATUS: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
    grpc.StatusCode.UNIMPLEMENTED: (501, "not_implemented"),
}


def http_status(code: grpc.StatusCode) -> tuple[int, str]:
    return HTTP_STATUS.get(code, (500, "server_error"))
