"""The Router messages <-> the router's plain values (services/router/wire.py): Generate's request and replies both
ways with exact values, and the RPC mixins' conversions.  No sockets."""

from __future__ import annotations

import dataclasses

import pytest

from mesh.chat import Message
from mesh.clients.values import ServedBy, TokenLogprob, Tokens, TopLogprob
from mesh.constraints import Constraint
from mesh.errors import InvalidArgument
from mesh.sampling import Sampling
from meshpb.v1 import common_pb2, router_pb2, tokenizer_pb2
from services.router import wire
from services.router.lora import Lora
from services.router.request import Chat, Reply, RouterRequest, StoredTurn, Tokenization, Usage

SAMPLING = Sampling(temperature=0.5, top_p=0.75, top_k=40, seed=7, max_tokens=64, stop=("\n\n", "END"),
                    logprobs=True, top_logprobs=2, presence_penalty=0.5, logit_bias=((3, -100.0), (9, 2.5)),
                    stop_token_ids=(2,), bad_words=("darn",), bad_words_ids=((11, 12), (13,)),
                    constraint=Constraint("regex", "[a-z]+", "<", ">"), prompt_logprobs=True)
CHAT = Chat((Message("system", "be brief"), Message("user", "hi", name="ann"),
             Message("assistant", "", tool_calls='[{"id": "c1"}]'), Message("tool", "42", tool_call_id="c1")),
            tools='[{"type": "function"}]', template_kwargs='{"enable_thinking": false}')
FULL = RouterRequest(request_id="r-1", model="m@2", chat=CHAT, sampling=SAMPLING, session_id="s", pinned_replica="e0",
                     region="eu", priority="batch", include_token_ids=True, model_version="2", tenant="acme",
                     resume_ids=(5, 6), cache_class="premium", weight=2.5, history_from="s0", caller_stores_turn=True)


def test_a_request_goes_both_ways_with_every_field() -> None:
    msg = wire.request_to_pb(FULL)
    assert msg.WhichOneof("input") == "chat" and msg.priority == common_pb2.PRIORITY_BATCH
    assert [m.role for m in msg.chat.messages] == ["system", "user", "assistant", "tool"]
    assert msg.chat.messages[1].name == "ann" and msg.chat.tools == '[{"type": "function"}]'
    assert msg.sampling.seed == 7 and list(msg.sampling.stop) == ["\n\n", "END"]
    assert msg.sampling.constraint.regex == "[a-z]+" and dict(msg.sampling.logit_bias) == {3: -100.0, 9: 2.5}
    assert list(msg.resume_ids) == [5, 6] and msg.weight == 2.5 and msg.caller_stores_turn
    back = wire.request_from_pb(msg)
    assert back == FULL
    assert back.input == "chat" and back.messages == CHAT.messages


@pytest.mark.parametrize("request_", [
    RouterRequest(prompt="Once upon"), RouterRequest(prompt=""), RouterRequest(prompt_ids=(1, 2, 3)),
    RouterRequest(prompt_ids=()), RouterRequest(chat=Chat()), RouterRequest(),
], ids=["prompt", "empty prompt", "ids", "empty ids", "empty chat", "no input"])
def test_each_input_keeps_its_kind(request_: RouterRequest) -> None:
    msg = wire.request_to_pb(request_)
    assert msg.WhichOneof("input") == request_.input
    assert wire.request_from_pb(msg) == request_


def test_a_native_callers_request_reads_as_the_defaults() -> None:
    got = wire.request_from_pb(router_pb2.RouterGenerateRequest(prompt="x"))
    # An empty SamplingParams is temperature 0 (greedy), the rest defaults.
    assert got == RouterRequest(prompt="x", sampling=Sampling(temperature=0.0))
    assert got.priority == "interactive" and got.messages == ()
    chat = router_pb2.RouterGenerateRequest(chat=router_pb2.ChatInput(messages=[
        tokenizer_pb2.ChatMessage(role="user", content="hi")]))
    assert wire.request_from_pb(chat).chat == Chat((Message("user", "hi"),))


def test_a_constraint_without_a_kind_is_refused() -> None:
    msg = router_pb2.RouterGenerateRequest(prompt="x")
    msg.sampling.constraint.prefix = "<"
    with pytest.raises(InvalidArgument, match="constraint names no kind"):
        wire.request_from_pb(msg)


SERVED = ServedBy("e1", "small", "v2", "eu", True, 0.75, "configured", "capacity")
LOGPROBS = (TokenLogprob(17, " the", -0.5, (TopLogprob(17, " the", -0.5), TopLogprob(3, " a", -1.25))),
            TokenLogprob(4, "!", -2.0))


def test_a_final_reply_goes_both_ways() -> None:
    reply = Reply("text", (17, 4), LOGPROBS, "stop", Usage(12, 2, 8), SERVED, LOGPROBS[1:], (0.25, -1.5), "hmm")
    msg = wire.reply_pb(reply)
    assert msg.finish_reason == common_pb2.FINISH_REASON_STOP and msg.usage.cached_tokens == 8
    assert msg.served_by.confidence_source == "configured" and msg.served_by.degraded_by == "capacity"
    assert msg.logprobs[0].top[1].token == " a" and msg.logprobs[0].top[1].logprob == -1.25
    assert list(msg.embedding) == [0.25, -1.5] and msg.reasoning == "hmm" and list(msg.ids) == [17, 4]
    assert wire.reply_from_pb(msg) == reply


@pytest.mark.parametrize("reason,code", [("", common_pb2.FINISH_REASON_UNSPECIFIED),
                                         ("length", common_pb2.FINISH_REASON_LENGTH),
                                         ("abort", common_pb2.FINISH_REASON_ABORT),
                                         ("error", common_pb2.FINISH_REASON_ERROR)])
def test_each_finish_reason(reason: str, code: int) -> None:
    msg = wire.reply_pb(Reply(finish_reason=reason, usage=Usage()))
    assert msg.finish_reason == code and wire.reply_from_pb(msg).finish_reason == reason


def test_a_middle_reply_names_neither_usage_nor_replica() -> None:
    msg = wire.reply_pb(Reply(" more", (8,)))
    assert not msg.HasField("usage") and not msg.HasField("served_by")
    assert wire.reply_from_pb(msg) == Reply(" more", (8,))
    first = wire.reply_pb(Reply("", usage=Usage(5, 0), served_by=SERVED))
    assert first.HasField("usage") and first.usage.prompt_tokens == 5 and first.served_by.replica == "e1"


def test_a_tokenize_request_and_its_answer() -> None:
    chat = router_pb2.TokenizeRequest(model="m", add_generation_prompt=True, return_token_strs=True,
                                      chat=router_pb2.ChatInput(tools="[]", messages=[
                                          tokenizer_pb2.ChatMessage(role="user", content="hi")]))
    assert wire.tokenization(chat) == Tokenization("m", Chat((Message("user", "hi"),), "[]"), None, False, True, True)
    prompt = router_pb2.TokenizeRequest(prompt="", add_special_tokens=True)
    assert wire.tokenization(prompt) == Tokenization(prompt="", add_special_tokens=True)
    assert wire.tokenization(router_pb2.TokenizeRequest()) == Tokenization()
    answer = wire.tokens_pb(Tokens("m", (1, 2), 4096, ("<s>", "Ġhi")))
    assert (list(answer.ids), answer.model, answer.max_context, list(answer.token_strs)) == \
        ([1, 2], "m", 4096, ["<s>", "Ġhi"])
    assert list(wire.tokens_pb(Tokens("m", (1,), 8)).token_strs) == []


def test_a_stored_turn_and_the_small_answers() -> None:
    msg = router_pb2.StoreTurnRequest(tenant="acme", session_id="s", history_from="h", messages=[
        tokenizer_pb2.ChatMessage(role="user", content="hi")], answer=tokenizer_pb2.ChatMessage(
            role="assistant", content="hello", tool_calls="[]"))
    assert wire.stored_turn(msg) == StoredTurn("acme", "s", "h", (Message("user", "hi"),),
                                               Message("assistant", "hello", tool_calls="[]"))
    assert wire.detokenized("hi").text == "hi" and wire.forgotten(True).found
    assert wire.turn_stored() == router_pb2.StoreTurnResponse()
    listing = wire.lora_listing_pb([(Lora("alpha", "base", "/a"), ["e0", "e1"]), (Lora("beta", "base", "/b"), [])])
    assert [(a.name, a.model, a.path, list(a.replicas)) for a in listing.adapters] == \
        [("alpha", "base", "/a", ["e0", "e1"]), ("beta", "base", "/b", [])]


def test_the_request_names_the_messages_fields() -> None:
    """Every RouterGenerateRequest field has its place in RouterRequest (the input's three as chat / prompt /
    prompt_ids): a field added to the message and not here fails."""
    names = {f.name for f in dataclasses.fields(RouterRequest)}
    assert set(router_pb2.RouterGenerateRequest.DESCRIPTOR.fields_by_name) == names
    replies = {f.name for f in dataclasses.fields(Reply)}
    assert set(router_pb2.RouterGenerateResponse.DESCRIPTOR.fields_by_name) == replies


def test_an_unknown_priority_is_refused() -> None:
    from mesh.errors import InvalidArgument
    from meshpb.v1 import router_pb2
    from services.router.wire import request_from_pb

    with pytest.raises(InvalidArgument, match="priority 5 is not PRIORITY_INTERACTIVE"):
        request_from_pb(router_pb2.RouterGenerateRequest(model="m", prompt="x", priority=5))
