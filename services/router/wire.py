"""The Router service's messages <-> the router's plain values (request.py, admin.py, events.py): the servicer's
conversions, kept out of server.py so that it holds only handlers (tests/unit/test_layout.py keeps it thin), and
those of its RPC mixins (tokenize_rpcs.py, conversations.py, lora_rpcs.py), which name the messages through the
aliases below.  Generate's request becomes a RouterRequest here, its replies come back from Reply; a request
whose fields are plain scalars (Detokenize's, ForgetConversation's, the LoRA calls') is read as it is, and every
answer is built here."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from mesh import chat, sampling_pb
from mesh.clients.values import ServedBy, TokenLogprob, Tokens
from mesh.errors import InvalidArgument
from meshpb.v1 import common_pb2, router_pb2
from services.router.admin import Routing
from services.router.engines import logprobs_from_pb
from services.router.events import RecentEvents
from services.router.lora import Lora
from services.router.request import (
    ABORT,
    BATCH,
    ERROR,
    INTERACTIVE,
    LENGTH,
    STOP,
    Chat,
    Reply,
    RouterRequest,
    StoredTurn,
    Tokenization,
    Usage,
)

# The messages the RPC mixins take and answer, by name (only wire.py and server.py import protobuf).
TokenizeRequest = router_pb2.TokenizeRequest
TokenizeResponse = router_pb2.TokenizeResponse
DetokenizeRequest = router_pb2.DetokenizeRequest
DetokenizeResponse = router_pb2.DetokenizeResponse
ForgetConversationRequest = router_pb2.ForgetConversationRequest
ForgetConversationResponse = router_pb2.ForgetConversationResponse
StoreTurnRequest = router_pb2.StoreTurnRequest
StoreTurnResponse = router_pb2.StoreTurnResponse
LoadLoraAdapterRequest = router_pb2.LoadLoraAdapterRequest
UnloadLoraAdapterRequest = router_pb2.UnloadLoraAdapterRequest
ListLoraAdaptersRequest = router_pb2.ListLoraAdaptersRequest
LoraAdaptersResponse = router_pb2.LoraAdaptersResponse

_FINISH = {"": common_pb2.FINISH_REASON_UNSPECIFIED, STOP: common_pb2.FINISH_REASON_STOP,
           LENGTH: common_pb2.FINISH_REASON_LENGTH, ABORT: common_pb2.FINISH_REASON_ABORT,
           ERROR: common_pb2.FINISH_REASON_ERROR}
_FINISH_NAMES = {v: k for k, v in _FINISH.items()}


def _chat_from_pb(c: router_pb2.ChatInput) -> Chat:
    return Chat(tuple(chat.from_pb(m) for m in c.messages), c.tools, c.template_kwargs)


def _chat_to_pb(c: Chat, out: router_pb2.ChatInput) -> None:
    out.SetInParent()                   # an empty conversation is still the chat input
    out.messages.extend(chat.to_pb(m) for m in c.messages)
    out.tools, out.template_kwargs = c.tools, c.template_kwargs


def request_from_pb(m: router_pb2.RouterGenerateRequest) -> RouterRequest:
    """Raises InvalidArgument for a priority that is neither interactive nor batch, and for a constraint that
    names no kind (mesh/sampling_pb.py)."""
    if m.priority not in (common_pb2.PRIORITY_INTERACTIVE, common_pb2.PRIORITY_BATCH):
        raise InvalidArgument(f"priority {m.priority} is not PRIORITY_INTERACTIVE (0) or PRIORITY_BATCH (1)")
    kind = m.WhichOneof("input")
    return RouterRequest(
        request_id=m.request_id, model=m.model, chat=_chat_from_pb(m.chat) if kind == "chat" else None,
        prompt=m.prompt if kind == "prompt" else None,
        prompt_ids=tuple(m.prompt_ids.ids) if kind == "prompt_ids" else None,
        sampling=sampling_pb.from_pb(m.sampling), session_id=m.session_id, pinned_replica=m.pinned_replica,
        region=m.region, priority=BATCH if m.priority == common_pb2.PRIORITY_BATCH else INTERACTIVE,
        include_token_ids=m.include_token_ids, model_version=m.model_version, tenant=m.tenant,
        resume_ids=tuple(m.resume_ids), cache_class=m.cache_class, weight=m.weight, history_from=m.history_from,
        caller_stores_turn=m.caller_stores_turn)


def request_to_pb(r: RouterRequest) -> router_pb2.RouterGenerateRequest:
    m = router_pb2.RouterGenerateRequest(
        request_id=r.request_id, model=r.model, sampling=sampling_pb.to_pb(r.sampling), session_id=r.session_id,
        pinned_replica=r.pinned_replica, region=r.region,
        priority=common_pb2.PRIORITY_BATCH if r.priority == BATCH else common_pb2.PRIORITY_INTERACTIVE,
        include_token_ids=r.include_token_ids, model_version=r.model_version, tenant=r.tenant,
        resume_ids=r.resume_ids, cache_class=r.cache_class, weight=r.weight, history_from=r.history_from,
        caller_stores_turn=r.caller_stores_turn)
    if r.chat is not None:
        _chat_to_pb(r.chat, m.chat)
    elif r.prompt is not None:
        m.prompt = r.prompt
    elif r.prompt_ids is not None:
        m.prompt_ids.SetInParent()
        m.prompt_ids.ids.extend(r.prompt_ids)
    return m


def served_by_pb(s: ServedBy) -> common_pb2.ServedBy:
    return common_pb2.ServedBy(replica=s.replica, model=s.model, model_version=s.model_version, region=s.region,
                               degraded=s.degraded, confidence=s.confidence, confidence_source=s.confidence_source,
                               degraded_by=s.degraded_by)


def _logprobs_pb(entries: Sequence[TokenLogprob]) -> list[common_pb2.TokenLogprob]:
    return [common_pb2.TokenLogprob(token_id=e.token_id, logprob=e.logprob, token=e.token, top=[
        common_pb2.TopLogprob(token_id=t.token_id, logprob=t.logprob, token=t.token) for t in e.top]) for e in entries]


def reply_pb(r: Reply) -> router_pb2.RouterGenerateResponse:
    """A Generate reply's message; `usage` and `served_by` only where the reply has them (None: unset)."""
    u = r.usage
    return router_pb2.RouterGenerateResponse(
        text=r.text, ids=r.ids, logprobs=_logprobs_pb(r.logprobs) if r.logprobs else None,
        finish_reason=_FINISH[r.finish_reason],
        usage=None if u is None else common_pb2.Usage(prompt_tokens=u.prompt_tokens,
                                                      completion_tokens=u.completion_tokens,
                                                      cached_tokens=u.cached_tokens),
        served_by=None if r.served_by is None else served_by_pb(r.served_by),
        prompt_logprobs=_logprobs_pb(r.prompt_logprobs) if r.prompt_logprobs else None,
        embedding=r.embedding, reasoning=r.reasoning)


def reply_from_pb(m: router_pb2.RouterGenerateResponse) -> Reply:
    """The way back of reply_pb (its tests)."""
    u, b = m.usage, m.served_by
    return Reply(m.text, tuple(m.ids), logprobs_from_pb(m.logprobs), _FINISH_NAMES[m.finish_reason],
                 Usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens) if m.HasField("usage") else None,
                 ServedBy(b.replica, b.model, b.model_version, b.region, b.degraded, b.confidence,
                          b.confidence_source, b.degraded_by) if m.HasField("served_by") else None,
                 logprobs_from_pb(m.prompt_logprobs), tuple(m.embedding), m.reasoning)


def tokenization(m: router_pb2.TokenizeRequest) -> Tokenization:
    kind = m.WhichOneof("input")
    return Tokenization(m.model, _chat_from_pb(m.chat) if kind == "chat" else None,
                        m.prompt if kind == "prompt" else None, m.add_special_tokens, m.add_generation_prompt,
                        m.return_token_strs)


def tokens_pb(t: Tokens) -> router_pb2.TokenizeResponse:
    return router_pb2.TokenizeResponse(ids=t.ids, model=t.model, max_context=t.max_context,
                                       token_strs=t.token_strs or ())


def detokenized(text: str) -> router_pb2.DetokenizeResponse:
    return router_pb2.DetokenizeResponse(text=text)


def forgotten(found: bool) -> router_pb2.ForgetConversationResponse:
    return router_pb2.ForgetConversationResponse(found=found)


def turn_stored() -> router_pb2.StoreTurnResponse:
    return router_pb2.StoreTurnResponse()


def stored_turn(m: router_pb2.StoreTurnRequest) -> StoredTurn:
    return StoredTurn(m.tenant, m.session_id, m.history_from, tuple(chat.from_pb(x) for x in m.messages),
                      chat.from_pb(m.answer))


def lora_listing_pb(known: Iterable[tuple[Lora, Sequence[str]]]) -> router_pb2.LoraAdaptersResponse:
    reply = router_pb2.LoraAdaptersResponse()
    for lora, replicas in known:
        reply.adapters.add(name=lora.name, model=lora.model, path=lora.path, replicas=replicas)
    return reply


def routing_pb(routing: Routing) -> router_pb2.ModelRouting:
    reply = router_pb2.ModelRouting(model=routing.model, default_version=routing.default_version,
                                    canary=routing.canary, versions=routing.versions,
                                    shadow_version=routing.shadow[0], shadow_share=routing.shadow[1])
    if routing.shadow_stats is not None:
        reply.shadow.CopyFrom(router_pb2.ShadowStats(**routing.shadow_stats))   # type: ignore[arg-type]
    return reply


def fill_recent(reply: router_pb2.ListReplicasResponse, recent: RecentEvents) -> None:
    """The console's part of ListReplicas: the router's recent events and first-token times."""
    reply.ttft_p50_ms, reply.ttft_p95_ms = recent.ttft_ms()
    for e in recent.events:
        reply.events.add(unix_ms=e.unix_ms, kind=e.kind, model=e.model, replica=e.replica, detail=e.detail)
