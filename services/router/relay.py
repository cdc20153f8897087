"""One client stream, relayed from one or more engine attempts.

A `Stream` holds what the client has been sent: token ids, the incremental detokenizer and
the stop-string matcher.  It outlives an attempt: when an engine dies or stalls mid-stream,
the router opens a new attempt elsewhere with `resume_ids = stream.ids` (same sampling seed;
the engine continues the seeded random stream by position), and the client sees one stream,
with no token lost or repeated.

`attempt()` turns an engine's failure into `EngineFailed` (retryable: the process is gone, it
stalled past its timeout, it refused transiently) and relays anything else, such as a bad
request, as the error it is.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import grpc

from mesh.clients.values import ServedBy
from mesh.detokenize import IncrementalDecoder
from mesh.errors import InvalidArgument
from mesh.grpcutil import caller_limit
from mesh.reasoning import ThinkSplitter
from meshpb.v1 import common_pb2, engine_pb2, engine_pb2_grpc, router_pb2
from services.router.stops import StopMatcher
from services.router.wire import served_by_pb

# Codes an engine answers when it, not the request, is the problem.  DEADLINE_EXCEEDED is not
# here: the engine call carries the client's own deadline, so when it expires nothing is left to retry.
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
                       grpc.StatusCode.CANCELLED, grpc.StatusCode.ABORTED, grpc.StatusCode.RESOURCE_EXHAUSTED})


class EngineFailed(Exception):
    """An attempt ended by the engine, not by the client; another replica may take over."""

    def __init__(self, replica_id: str, reason: str, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE,
                 isolate: bool = False):
        super().__init__(f"engine {replica_id} {reason}")
        self.replica_id, self.reason, self.code = replica_id, reason, code
        self.isolate = isolate      # level 1: the replica looks gone (unreachable, failing health checks)


class Stream:
    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str], prompt_tokens: int,
                 include_ids: bool, reasoning: str = ""):
        self.decode = decode
        self.decoder = IncrementalDecoder(decode)
        self.stops = StopMatcher(list(stop))
        self.think = ThinkSplitter(reasoning)      # a reasoning model's thoughts apart from its answer
        self.prompt_tokens = prompt_tokens
        self.include_ids = include_ids
        self.sent_first = False
        self.finished = False

    @property
    def ids(self) -> list[int]:
        return list(self.decoder.ids)

    def resume(self, ids: Sequence[int]) -> str:
        """Take over a stream another router was relaying: `ids` went to the client already.  Returns
        the text they carried (the detokenizer and stop matcher hold back exactly what that router
        held back, since both depend only on the ids so far), which is not sent again."""
        text, stopped = self.stops.push(self.decoder.push(list(ids), False))
        if stopped:
            raise InvalidArgument("resume_ids already end the stream (they contain a stop string)")
        return self.think.push(text)[1]

    def _split(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, answer) of the text about to be sent; at the end, with what the splitter held back."""
        thought, answer = self.think.push(text)
        if final:
            more = self.think.finish()
            thought, answer = thought + more[0], answer + more[1]
        return thought, answer

    def push(self, chunk: engine_pb2.GenerateResponse, served_by: common_pb2.ServedBy
             ) -> router_pb2.RouterGenerateResponse:
        """The client's message for one engine message; sets `finished` on the last one."""
        final = chunk.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
        for entry in [*chunk.logprobs, *chunk.prompt_logprobs]:   # each token's own text, as OpenAI shows it
            entry.token = self.decode([entry.token_id])
            for alt in entry.top:
                alt.token = self.decode([alt.token_id])
        text = self.decoder.push(list(chunk.ids), final)
        emit, stopped = self.stops.push(text)
        ids = list(chunk.ids) if self.include_ids else []
        if final or stopped:
            if not stopped:
                emit += self.stops.flush()
            thought, emit = self._split(emit, True)
            self.finished = True
            reason = common_pb2.FINISH_REASON_STOP if stopped else chunk.finish_reason
            usage = chunk.usage if final else self.usage()
            return router_pb2.RouterGenerateResponse(text=emit, ids=ids, logprobs=chunk.logprobs,
                                                     finish_reason=reason, usage=usage, served_by=served_by,
                                                     prompt_logprobs=chunk.prompt_logprobs,
                                                     embedding=chunk.embedding, reasoning=thought)
        # The first message names the replica and counts the prompt too, so callers can label the
        # stream early (and account for a stream they end themselves, as the edge's content filter does).
        first, self.sent_first = not self.sent_first, True
        thought, emit = self._split(emit, False)
        return router_pb2.RouterGenerateResponse(text=emit, reasoning=thought, ids=ids, logprobs=chunk.logprobs,
                                                 served_by=served_by if first else None,
                                                 usage=self.usage() if first else None,
                                                 prompt_logprobs=chunk.prompt_logprobs)

    def usage(self) -> common_pb2.Usage:
        return common_pb2.Usage(prompt_tokens=self.prompt_tokens, completion_tokens=len(self.decoder.ids))

    def finish_at_length(self, served_by: ServedBy) -> router_pb2.RouterGenerateResponse:
        """The engine died after the last token but before its final message: end the stream here."""
        emit = self.decoder.push([], True)
        text, _ = self.stops.push(emit)
        thought, text = self._split(text + self.stops.flush(), True)
        self.finished = True
        return router_pb2.RouterGenerateResponse(text=text, reasoning=thought,
                                                 finish_reason=common_pb2.FINISH_REASON_LENGTH,
                                                 usage=self.usage(), served_by=served_by_pb(served_by))


@dataclass(frozen=True)
class EngineCall:
    """One attempt's engine call: the engine's stub and replica id, the request, what the client's
    messages name as served_by, the call's metadata and deadline (None: none), the timeouts before the
    first message and between messages, how an engine's request error is relayed, and the replica's
    health (polled while waiting)."""
    stub: engine_pb2_grpc.EngineStub
    replica_id: str
    request: engine_pb2.GenerateRequest
    served_by: ServedBy
    metadata: Sequence[tuple[str, str]]
    deadline_s: float | None
    first_token_timeout_s: float
    stall_timeout_s: float
    relay_error: Callable[[str, grpc.aio.AioRpcError], Exception]
    healthy: Callable[[], bool]


async def attempt(engine: EngineCall, stream: Stream) -> AsyncIterator[router_pb2.RouterGenerateResponse]:
    """Relay one engine call into `stream` until it finishes; raise EngineFailed if the engine fails:
    an error it answers, silence past the timeout, or its health check failing while we wait
    (a hung process is caught by the prober within seconds, well before a stall timeout)."""
    replica_id, relay_error = engine.replica_id, engine.relay_error
    served_by = served_by_pb(engine.served_by)
    call = engine.stub.Generate(engine.request, metadata=tuple(engine.metadata), timeout=engine.deadline_s)
    messages = call.__aiter__()
    waited_for_first = True
    try:
        while not stream.finished:
            limit = engine.first_token_timeout_s if waited_for_first else engine.stall_timeout_s
            try:
                chunk = await _next(messages, limit, engine.healthy)
            except StopAsyncIteration:
                raise EngineFailed(replica_id, "ended the stream without finishing it", isolate=True) from None
            except TimeoutError:
                raise EngineFailed(replica_id, f"stalled: nothing for {limit:g} s") from None
            except _Unhealthy:
                raise EngineFailed(replica_id, "failed its health checks mid-stream", isolate=True) from None
            except grpc.aio.AioRpcError as err:
                if caller_limit(err):       # the caller's own limit: its answer (429 + Retry-After), no failover
                    raise relay_error(f"engine {replica_id}", err) from None
                if err.code() in RETRYABLE:
                    raise EngineFailed(replica_id, f"failed: {err.code().name}: {err.details()}", err.code(),
                                       isolate=err.code() == grpc.StatusCode.UNAVAILABLE) from None
                raise relay_error(f"engine {replica_id}", err) from None
            waited_for_first = False
            yield stream.push(chunk, served_by)
    finally:
        call.cancel()


class _Unhealthy(Exception):
    pass


async def _next(messages: AsyncIterator[engine_pb2.GenerateResponse], limit: float, healthy: Callable[[], bool]
                ) -> engine_pb2.GenerateResponse:
    """The next message within `limit` seconds, checking the replica's health every half second."""
    pending = asyncio.ensure_future(messages.__anext__())
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit
    try:
        while True:
            left = deadline - loop.time()
            if left <= 0:
                raise TimeoutError
            done, _ = await asyncio.wait({pending}, timeout=min(0.5, left))
            if done:
                return pending.result()
            if not healthy():
                raise _Unhealthy
    finally:
        if not pending.done():
            pending.cancel()
