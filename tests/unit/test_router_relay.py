"""A client stream's replies from engine replies (services/router/relay.py Stream): what the first, a middle and the
last reply carry, the tokens' own text in their logprobs, stop strings; plain values, no engine."""

from __future__ import annotations

from collections.abc import Sequence

from mesh.clients.values import ServedBy, TokenLogprob, TopLogprob
from services.router.engines import EngineReply
from services.router.relay import Stream
from services.router.request import Reply, Usage

SERVED = ServedBy("e0", "m", "v1", "eu", False, 1.0)


def letters(ids: Sequence[int]) -> str:
    return "".join(chr(96 + i) for i in ids)          # 1 -> "a", 2 -> "b", ...


def test_the_first_reply_names_the_replica_and_the_last_ends_at_a_stop_string() -> None:
    stream = Stream(letters, ["cd"], 3, include_ids=True)
    first = stream.push(EngineReply((1, 2), logprobs=(TokenLogprob(1, "", -0.5, (TopLogprob(2, "", -1.0),)),),
                                    prompt_logprobs=(TokenLogprob(5, "", -2.0),)), SERVED)
    assert first == Reply("ab", (1, 2), (TokenLogprob(1, "a", -0.5, (TopLogprob(2, "b", -1.0),)),), "", Usage(3, 2),
                          SERVED, (TokenLogprob(5, "e", -2.0),))
    assert stream.push(EngineReply((3,)), SERVED) == Reply("", (3,))          # "c" held: a stop string may start
    last = stream.push(EngineReply((4, 5)), SERVED)
    assert last == Reply("", (4, 5), finish_reason="stop", usage=Usage(3, 5), served_by=SERVED) and stream.finished


def test_the_engines_last_reply_keeps_its_usage_and_embedding() -> None:
    stream = Stream(letters, [], 3, include_ids=False)
    assert stream.push(EngineReply((1,)), SERVED) == Reply("a", usage=Usage(3, 1), served_by=SERVED)
    last = stream.push(EngineReply((2,), "length", Usage(3, 2, 1), embedding=(0.5,)), SERVED)
    assert last == Reply("b", finish_reason="length", usage=Usage(3, 2, 1), served_by=SERVED, embedding=(0.5,))


def test_a_stream_cut_after_its_last_token_finishes_at_length() -> None:
    stream = Stream(letters, [], 3, include_ids=False)
    stream.push(EngineReply((1,)), SERVED)
    assert stream.finish_at_length(SERVED) == Reply(finish_reason="length", usage=Usage(3, 1), served_by=SERVED)
