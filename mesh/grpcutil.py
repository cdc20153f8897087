"""gRPC plumbing every service shares: error mapping, health, graceful shutdown, mutual TLS.

channel() and Service use the process-wide mesh credentials (mesh/credentials.py) unless given
others, so no call site chooses between plaintext and TLS itself.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from mesh import credentials
from mesh.credentials import MeshTLS
from mesh.errors import MeshError

log = logging.getLogger(__name__)

# A 1,500-token prefix of KV blocks must fit in one message; 64 MiB leaves room.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# What a server takes in one message unless it says otherwise (Service's max_receive_bytes): sized to
# the largest valid request of the router, tokenizer and engine (a prompt the tokenizer's input limit
# allows; a context of token ids), so a caller cannot make one parse a 64 MiB message.  The cache
# takes KV blocks: MAX_MESSAGE_BYTES.
REQUEST_MESSAGE_BYTES = 4 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
SERVER_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.so_reuseport", 0),
]


def channel(address: str, tls: MeshTLS | None = None) -> grpc.aio.Channel:
    """A channel to `address`: mutual TLS with `tls`, else with the process's mesh credentials, else plaintext."""
    tls = tls or credentials.current()
    if tls is None:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    return grpc.aio.secure_channel(address, tls.channel_credentials(),
                                   options=CHANNEL_OPTIONS + credentials.TLS_CHANNEL_OPTIONS)


# Trailing metadata on every error a handler answers (rpc_errors), so a caller can tell a status the
# service chose (its answer about this request) from one gRPC made up because the process is gone.
ANSWERED = ("infermesh-answered", "1")


# Trailing metadata on a RESOURCE_EXHAUSTED about the caller's own limit (a tenant's compile rate), not the
# service's capacity: a router relays it to the caller (with its retry-after) instead of failing over, and
# no breaker counts it against the replica.
CALLER_LIMIT = ("infermesh-limit", "caller")


def caller_limit(err: grpc.aio.AioRpcError) -> bool:
    return any((k, str(v)) == CALLER_LIMIT for k, v in err.trailing_metadata() or ())


def retry_after(err: grpc.aio.AioRpcError) -> int:
    """The error's `retry-after` trailer in whole seconds, or 0."""
    for key, value in err.trailing_metadata() or ():
        if key == "retry-after" and str(value).isdigit():
            return int(value)
    return 0


def answered(err: grpc.aio.AioRpcError) -> bool:
    """True when the server itself answered `err` (through rpc_errors), not its transport failing."""
    return any((k, str(v)) == ANSWERED for k, v in err.trailing_metadata() or ())


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    trailing = tuple(context.trailing_metadata() or ())
    if isinstance(exc, MeshError):
        code, message = exc.code, exc.message
        if exc.retry_after_s > 0 and not any(k == "retry-after" for k, _ in trailing):
            trailing += (("retry-after", str(exc.retry_after_s)),)
        if exc.caller_limit:
            trailing += (CALLER_LIMIT,)
    else:
        code, message = grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"
    await context.abort(code, message, trailing_metadata=(*trailing, ANSWERED))


def rpc_errors(handler: Callable[..., Any]) -> Callable[..., Any]:
    """Map exceptions raised by an RPC handler to precise status codes.

    Works for unary handlers and for server-streaming async generators. A MeshError keeps
    its code and message; anything else is logged with its traceback and becomes INTERNAL,
    so one bad request never takes the process down.
    """
    if inspect.isasyncgenfunction(handler):

        @functools.wraps(handler)
        async def stream(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                async for item in handler(self, request, context):
                    yield item
            except (asyncio.CancelledError, GeneratorExit):
                raise
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                if not isinstance(exc, MeshError):
                    log.exception("%s failed", handler.__name__)
                await _abort(context, exc)

        return stream

    @functools.wraps(handler)
    async def unary(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await handler(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            if not isinstance(exc, MeshError):
                log.exception("%s failed", handler.__name__)
            await _abort(context, exc)

    return unary


class Service:
    """A grpc.aio server with the standard health service, server reflection and a clean stop.

    Reflection lists `name`, health and reflection itself, so grpcurl and other stub-less clients
    can call the service without the .proto files.  `ready()` flips health to SERVING; `stop()`
    flips it to NOT_SERVING first so routers stop sending new work, then lets in-flight RPCs
    finish within `grace`.  With mesh credentials (`tls`, else the process's) the port is mutual
    TLS: every caller must present a certificate signed by the mesh CA.
    """

    def __init__(self, name: str, host: str, port: int, tls: MeshTLS | None = None,
                 max_receive_bytes: int = REQUEST_MESSAGE_BYTES):
        self.name = name
        self.address = f"{host}:{port}"
        self.max_receive_bytes = max_receive_bytes
        options = [o for o in SERVER_OPTIONS if o[0] != "grpc.max_receive_message_length"]
        self.server = grpc.aio.server(options=[*options, ("grpc.max_receive_message_length", max_receive_bytes)])
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        tls = tls or credentials.current()
        self.tls = tls is not None
        if tls is None:
            bound = self.server.add_insecure_port(self.address)
        else:
            bound = self.server.add_secure_port(self.address, tls.server_credentials())
        if bound == 0:
            raise OSError(f"{name}: cannot listen on {self.address} (port in use?)")
        self.port = bound

    async def start(self) -> None:
        reflection.enable_server_reflection((self.name, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server)
        await self.server.start()

    async def ready(self, serving: bool = True) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        await self.health.set("", status)
        await self.health.set(self.name, status)

    async def stop(self, grace: float = 5.0) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)


async def check_health(address: str, service: str = "", timeout: float = 1.0, tls: MeshTLS | None = None) -> bool:
    """True when the server at `address` reports SERVING."""
    try:
        async with channel(address, tls) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
            return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
    except grpc.aio.AioRpcError:
        return False


def setup_logging(service: str, replica_id: str) -> None:
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s %(levelname)s {replica_id} %(name)s: %(message)s",
    )
    # aioquic logs every handshake at INFO; keep the mesh's own lines readable.
    logging.getLogger("quic").setLevel(logging.WARNING)
