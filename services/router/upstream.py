"""The router's dependencies besides engines: the tokenizer replicas and the session store.

Each replica sits behind the `circuitbreaker` package's breaker (consecutive failures, fixed
recovery time: all they need): a tokenizer replica that is down passes its calls to the next, and
when all are, requests fail fast; a session store that is down lets requests go on without history,
instead of each waiting out a timeout.  Engines need more (windows, probes, a
fake clock in tests): services/router/failover.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from circuitbreaker import CircuitBreaker, CircuitBreakerError
from tokenizers import Tokenizer as Vocabulary

from mesh.chat import Message, from_pb, to_pb
from mesh.errors import InvalidArgument, MeshError, NotFound, Unavailable
from mesh.grpcutil import channel, retry_after
from mesh.telemetry import client_span, outgoing_metadata
from meshpb.v1 import cache_pb2, cache_pb2_grpc, tokenizer_pb2, tokenizer_pb2_grpc
from services.router.request import Chat, RouterRequest, Tokenization
from services.router.sessions import session_key

# What the dependency breakers count: the service failing, not a request it refused.
_DOWN_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL,
               grpc.StatusCode.UNKNOWN)


def _dependency_down(kind: type[BaseException], err: BaseException) -> bool:
    return isinstance(err, grpc.aio.AioRpcError) and err.code() in _DOWN_CODES


def within(deadline_s: float | None, cap: float) -> float:
    """A hop's timeout: its own cap, or less when the client's deadline comes sooner."""
    return cap if deadline_s is None else max(0.001, min(cap, deadline_s))


def relay_error(hop: str, err: grpc.aio.AioRpcError) -> MeshError:
    """Keep a downstream status that the caller can act on; name the hop that failed."""
    exc = MeshError(f"{hop}: {err.details()}", retry_after(err))
    exc.code = err.code() if err.code() != grpc.StatusCode.UNKNOWN else grpc.StatusCode.INTERNAL
    return exc


def _chat(messages: Sequence[Message]) -> list[tokenizer_pb2.ChatMessage]:
    return [to_pb(m) for m in messages]


class Tokenizer:
    """Token ids from the tokenizer service's replicas; text from ids in process (`decoder`).

    `addresses`: one or more, comma-separated.  Calls go to the replicas in turn; each replica has
    its own breaker, a call that meets a replica down moves on to the next, and only when every
    replica is failing (or its breaker open) does the request fail, fast."""

    def __init__(self, addresses: str, name: str):
        self.addresses = [a for a in addresses.split(",") if a]
        if not self.addresses:
            raise ValueError("the router needs a tokenizer address (--tokenizer HOST:PORT)")
        self.address = ",".join(self.addresses)
        self.stubs = [tokenizer_pb2_grpc.TokenizerStub(channel(a)) for a in self.addresses]
        self.breakers = [CircuitBreaker(failure_threshold=3, recovery_timeout=5, expected_exception=_dependency_down,
                                        name=f"{name}/{a}") for a in self.addresses]
        self.healthy = [True] * len(self.addresses)     # the router's probes (probed), one per replica
        self._turn = 0
        self._decoders: dict[str, Callable[[Sequence[int]], str]] = {}
        self._vocabularies: dict[str, Vocabulary] = {}
        self._loading: dict[str, asyncio.Future[Callable[[Sequence[int]], str]]] = {}

    def probed(self, healthy: list[bool]) -> None:
        """The latest health probe of each replica: calls try the ones that passed first (a hung
        replica, SIGSTOPped say, would hold a call until its timeout)."""
        self.healthy = healthy

    async def _call(self, method: str, request: Any, timeout: float) -> Any:
        """`method` on the next replica that answers; a replica that is down (or whose breaker is
        open) passes the call on to the next."""
        self._turn += 1
        order = sorted(((self._turn + i) % len(self.stubs) for i in range(len(self.stubs))),
                       key=lambda i: not self.healthy[i])
        failures: list[str] = []
        waits: list[int] = []
        for i in order:
            breaker, address = self.breakers[i], self.addresses[i]
            try:
                return await breaker.call_async(getattr(self.stubs[i], method), request,
                                                metadata=outgoing_metadata(), timeout=timeout)
            except CircuitBreakerError:
                waits.append(max(1, breaker.open_remaining))
                failures.append(f"{address}: circuit open")
            except grpc.aio.AioRpcError as err:
                if err.code() not in _DOWN_CODES:
                    raise relay_error("tokenizer", err) from None
                failures.append(f"{address}: {err.code().name}")
        wait = min(waits) if waits else 1
        raise Unavailable(f"every tokenizer replica is failing ({'; '.join(failures)}); retry in {wait} s",
                          retry_after_s=wait)

    async def tokenize(self, request: RouterRequest, model: str, conversation: list[Message],
                       deadline_s: float | None = None) -> tuple[list[int], str]:
        """The prompt's ids: the chat template over `conversation`, the raw prompt encoded, or the ids given
        (the engine checks them against the vocabulary); and the answer's reasoning format (mesh/reasoning.py:
        "" unless a chat template writes think tags)."""
        kind = request.input
        if kind == "prompt_ids":
            if not request.prompt_ids:
                raise InvalidArgument("prompt_ids is empty")
            return list(request.prompt_ids), ""
        if kind not in ("chat", "prompt"):
            raise InvalidArgument("the request has neither chat messages nor a prompt")
        enc = await self._encode(model, request.chat, conversation if request.chat is not None else (),
                                 request.prompt or "", True, True, within(deadline_s, 30.0))
        return list(enc.ids), enc.reasoning if request.chat is not None else ""

    async def encode(self, spec: Tokenization, model: str, timeout: float = 30.0) -> list[int]:
        """A Tokenize request's ids: its conversation through the chat template, or its prompt encoded."""
        messages = spec.chat.messages if spec.chat is not None else ()
        enc = await self._encode(model, spec.chat, messages, spec.prompt or "", spec.add_generation_prompt,
                                 spec.add_special_tokens, timeout)
        return list(enc.ids)

    async def encode_text(self, model: str, text: str, deadline_s: float | None = None) -> list[int]:
        """A text's ids without special tokens (a sampling field's words: mesh/sampling.py at_tokenizer)."""
        return list((await self._encode(model, None, (), text, False, False, within(deadline_s, 30.0))).ids)

    async def _encode(self, model: str, chat: Chat | None, messages: Sequence[Message], prompt: str,
                      add_generation_prompt: bool, add_special_tokens: bool, timeout: float
                      ) -> tokenizer_pb2.EncodeResponse:
        """The tokenizer service's ids for `messages` through the chat template (with `chat`'s tools and
        template variables), or, without `chat`, for `prompt`."""
        with client_span("router.tokenize", model=model, input="chat" if chat is not None else "prompt") as span:
            if chat is not None:
                enc = await self._call("ApplyChatTemplate", tokenizer_pb2.ChatTemplateRequest(
                    model=model, messages=_chat(messages), add_generation_prompt=add_generation_prompt,
                    tools=chat.tools, template_kwargs=chat.template_kwargs), timeout)
            else:
                enc = await self._call("Encode", tokenizer_pb2.EncodeRequest(
                    model=model, text=prompt, add_special_tokens=add_special_tokens), timeout)
            span.set_attribute("prompt_tokens", len(enc.ids))
        return enc

    async def vocabulary(self, model: str) -> Vocabulary:
        """`model`'s `tokenizers` vocabulary (fetched once, as for `decoder`)."""
        await self.decoder(model)
        return self._vocabularies[model]

    async def decoder(self, model: str) -> Callable[[Sequence[int]], str]:
        """ids -> text for `model`, from the tokenizer service's `tokenizers` JSON, fetched once.

        Streams are detokenized here, in process: a round trip to the tokenizer per token
        cost more CPU than the decode itself on a busy machine."""
        decode = self._decoders.get(model)
        if decode is not None:
            return decode
        # One fetch per model however many requests ask at once, parsed off the event loop: a large
        # vocabulary's JSON (Gemma 3's 262k tokens: 33 MB, ~1 s to parse) would otherwise stall every
        # stream and the router's health answers while it parses, once per waiting request.
        loading = self._loading.get(model)
        if loading is None:
            loading = self._loading[model] = asyncio.ensure_future(self._load_decoder(model))
        try:
            return await asyncio.shield(loading)
        finally:
            if loading.done():
                self._loading.pop(model, None)

    async def _load_decoder(self, model: str) -> Callable[[Sequence[int]], str]:
        with client_span("router.tokenizer_json", model=model):
            spec = await self._call("GetTokenizerJson", tokenizer_pb2.ModelInfoRequest(model=model), 30.0)
        vocabulary = await asyncio.to_thread(Vocabulary.from_str, spec.tokenizer_json)

        def decode(ids: Sequence[int]) -> str:
            return str(vocabulary.decode(list(ids), skip_special_tokens=True))

        self._vocabularies[model] = vocabulary
        self._decoders[model] = decode
        return decode


class Sessions:
    """The cache service's session store; address "": none (every request stands alone).

    A session's turn is answered with its history or not at all: when the store cannot be read, or
    the turn cannot be stored, the request fails with UNAVAILABLE and a retry hint (the launcher
    restarts the store, which keeps its sessions on disk), since an answer that silently forgot the
    conversation, or a turn missing from the next one's history, is a wrong answer, not a degraded one."""

    def __init__(self, address: str, name: str):
        self.address = address
        self.stub = cache_pb2_grpc.CacheStub(channel(address)) if address else None
        self.breaker = CircuitBreaker(failure_threshold=3, recovery_timeout=3, expected_exception=_dependency_down,
                                      name=name)

    def _unavailable(self, err: grpc.aio.AioRpcError | CircuitBreakerError, what: str) -> Unavailable:
        wait = max(1, self.breaker.open_remaining) if isinstance(err, CircuitBreakerError) else 1
        return Unavailable(f"the session store {self.address} is unreachable ({_why(err)}): {what}; "
                           f"retry in {wait} s", retry_after_s=wait)

    async def continued(self, tenant: str, history_from: str, session: str, chat: bool
                        ) -> tuple[list[Message], bool]:
        """The stored conversation a chat continues (its session's, or `history_from`'s of `tenant`), and
        whether it came from another session (history_from: the whole of it is stored again under `session`)."""
        if not history_from:
            return await self.history(session), False
        if not chat:
            raise InvalidArgument("history_from needs chat messages")
        history = await self.history(session_key(tenant, history_from))
        if not history:
            raise NotFound(f"no stored conversation {history_from!r}")
        return history, True

    async def history(self, session_id: str) -> list[Message]:
        """The stored conversation, or [] (no session store, no session id, or a new session)."""
        if self.stub is None or not session_id:
            return []
        with client_span("router.session_lookup", session_id=session_id) as span:
            found = await self._call(self.stub.GetSession, cache_pb2.SessionRequest(session_id=session_id),
                                     "the session's history cannot be read")
            span.set_attributes({"found": found.found, "messages": len(found.messages)})
        return [from_pb(m) for m in found.messages]

    async def forget(self, session_id: str) -> bool:
        """Delete the session; whether it was there (no store: False)."""
        if self.stub is None or not session_id:
            return False
        reply = await self._call(self.stub.DeleteSession, cache_pb2.SessionRequest(session_id=session_id),
                                 "the conversation was not deleted; send it again")
        return bool(reply.found)

    async def remember_turn(self, session_id: str, history: list[Message], branched: bool, new: Sequence[Message],
                            answer: Message) -> None:
        """Append a turn: a branched conversation's history first (history_from's, stored again under this
        session: `continued`), then the request's new messages and the answer."""
        await self.remember(session_id, [*(history if branched else ()), *new, answer])

    async def remember(self, session_id: str, messages: list[Message]) -> None:
        """Append the turn (before the answer's last message goes out)."""
        if self.stub is None or not session_id or not messages:
            return
        with client_span("router.session_store", session_id=session_id, messages=len(messages)):
            await self._call(self.stub.AppendSession,
                             cache_pb2.AppendSessionRequest(session_id=session_id, messages=_chat(messages)),
                             "this turn could not be stored; send it again")

    async def _call(self, method: Any, request: Any, failed: str) -> Any:
        """`method` behind the breaker; the store down (or its breaker open) is UNAVAILABLE saying `failed`."""
        try:
            return await self.breaker.call_async(method, request, metadata=outgoing_metadata(), timeout=5.0)
        except grpc.aio.AioRpcError as err:
            if err.code() not in _DOWN_CODES:
                raise relay_error("session store", err) from None
            raise self._unavailable(err, failed) from None
        except CircuitBreakerError as err:
            raise self._unavailable(err, failed) from None


def _why(err: grpc.aio.AioRpcError | CircuitBreakerError) -> str:
    return err.code().name if isinstance(err, grpc.aio.AioRpcError) else "circuit open"
