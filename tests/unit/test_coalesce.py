"""Engine server: outputs that queued while a stream was sending leave as one message, tokens in order."""

from __future__ import annotations

import asyncio

from services.engine.core.request import EngineTokenLogprob, FinishReason, StepOutput
from services.engine.rpcs.server import _coalesced


def test_queued_outputs_go_as_one_message_up_to_the_last() -> None:
    queue: asyncio.Queue[StepOutput] = asyncio.Queue()
    lp = [EngineTokenLogprob(token_id=i, logprob=-0.1 * i, top=()) for i in range(5)]
    for ids, probs in (((2,), lp[2:3]), ((3, 4), lp[3:5])):
        queue.put_nowait(StepOutput("r", ids, tuple(probs)))
    queue.put_nowait(StepOutput("r", (5,), (), FinishReason.LENGTH, prompt_tokens=7, completion_tokens=6))
    out = _coalesced(StepOutput("r", (0, 1), tuple(lp[0:2])), queue)
    assert out.new_ids == (0, 1, 2, 3, 4, 5) and [p.token_id for p in out.logprobs] == [0, 1, 2, 3, 4]
    assert out.finish_reason is FinishReason.LENGTH and out.completion_tokens == 6 and queue.empty()
    queue.put_nowait(StepOutput("r", (8,)))
    final = StepOutput("r", (7,), (), FinishReason.STOP)
    assert _coalesced(final, queue) is final and queue.qsize() == 1      # nothing rides after the last message
    assert _coalesced(StepOutput("r", (9,)), asyncio.Queue()).new_ids == (9,)   # nothing queued: as it was
