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
import dataclasses
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import grpc

from mesh.clients.values import ServedBy, TokenLogprob
from mesh.detokenize import IncrementalDecoder
from mesh.errors import InvalidArgument
from mesh.grpcutil import caller_limit
from mesh.reasoning import ThinkSplitter
from services.router.engines import EngineReply, EngineRequest, Engines
from services.router.request import LENGTH, STOP, Reply, Usage
from services.router.stops import StopMatcher

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

    def push(self, chunk: EngineReply, served_by: ServedBy) -> Reply:
        """The client's message for one engine message; sets `finished` on the last one."""
        final = bool(chunk.finish_reason)
        logprobs, prompt_logprobs = self._named(chunk.logprobs), self._named(chunk.prompt_logprobs)
        text = self.decoder.push(list(chunk.ids), final)
        emit, stopped = self.stops.push(text)
        ids = chunk.ids if self.include_ids else ()
        if final or stopped:
            if not stopped:
                emit += self.stops.flush()
            thought, emit = self._split(emit, True)
            self.finished = True
            return Reply(emit, ids, logprobs, STOP if stopped else chunk.finish_reason,
                         chunk.usage if final else self.usage(), served_by, prompt_logprobs, chunk.embedding, thought)
        # The first message names the replica and counts the prompt too, so callers can label the
        # stream early (and account for a stream they end themselves, as the edge's content filter does).
        first, self.sent_first = not self.sent_first, True
        thought, emit = self._split(emit, False)
        return Reply(emit, ids, logprobs, "", self.usage() if first else None, served_by if first else None,
                     prompt_logprobs, reasoning=thought)

    def _named(self, entries: tuple[TokenLogprob, ...]) -> tuple[TokenLogprob, ...]:
        """Each token's own text, as OpenAI shows it."""
        return tuple(dataclasses.replace(e, token=self.decode([e.token_id]), top=tuple(
            dataclasses.replace(t, token=self.decode([t.token_id])) for t in e.top)) for e in entries)

    def usage(self) -> Usage:
        return Usage(self.prompt_tokens, len(self.decoder.ids))

    def finish_at_length(self, served_by: ServedBy) -> Reply:
        """The engine died after the last token but before its final message: end the stream here."""
        emit = self.decoder.push([], True)
        text, _ = self.stops.push(emit)
        thought, text = self._split(text + self.stops.flush(), True)
        self.finished = True
        return Reply(text, finish_reason=LENGTH, usage=self.usage(), served_by=served_by, reasoning=thought)


@dataclass(frozen=True)
class EngineCall:
    """One attempt's engine call: the engine client, the replica's id and address, the request, what the
    client's messages name as served_by, the call's metadata and deadline (None: none), the timeouts before the
    first message and between messages, how an engine's request error is relayed, and the replica's
    health (polled while waiting)."""
    engines: Engines
    replica_id: str
    address: str
    request: EngineRequest
    served_by: ServedBy
    metadata: Sequence[tuple[str, str]]
    deadline_s: float | None
    first_token_timeout_s: float
    stall_timeout_s: float
    relay_error: Callable[[str, grpc.aio.AioRpcError], Exception]
    healthy: Callable[[], bool]


async def attempt(engine: EngineCall, stream: Stream) -> AsyncIterator[Reply]:
    """Relay one engine call into `stream` until it finishes; raise EngineFailed if the engine fails:
    an error it answers, silence past the timeout, or its health check failing while we wait
    (a hung process is caught by the prober within seconds, well before a stall timeout)."""
    replica_id, relay_error = engine.replica_id, engine.relay_error
    call = engine.engines.generate(engine.address, engine.request, engine.metadata, engine.deadline_s)
    waited_for_first = True
    try:
        while not stream.finished:
            limit = engine.first_token_timeout_s if waited_for_first else engine.stall_timeout_s
            try:
                chunk = await _next(call, limit, engine.healthy)
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
            yield stream.push(chunk, engine.served_by)
    finally:
        call.cancel()


class _Unhealthy(Exception):
    pass


async def _next(messages: AsyncIterator[EngineReply], limit: float, healthy: Callable[[], bool]) -> EngineReply:
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
