"""A step's update (services/engine/core/update.py) on hand-built batches: which tokens each request takes,
its finish reason, its logprobs, the drafts kept, and that an ended request ends through `end` alone."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

from services.engine.core.block_manager import BlockManager
from services.engine.core.request import EngineTokenLogprob, FinishReason, Request, SamplingParams, StepOutput
from services.engine.core.scheduler import Batch, Chunk
from services.engine.core.speculate import Lookup
from services.engine.core.update import Rules, finish_reason, update_from_output

EOS = 0
RULES = Rules(frozenset({EOS}), max_context=32, max_draft=3)


def req(rid: str, prompt: list[int], max_tokens: int = 8, **sampling: Any) -> Request:
    return Request(rid, prompt_ids=list(prompt), sampling=SamplingParams(max_tokens=max_tokens, **sampling),
                   max_tokens=max_tokens)


def decoding(blocks: BlockManager, r: Request, draft: Sequence[int] = ()) -> Chunk:
    """`r`'s decode chunk (its last token, then `draft`), its KV computed up to that token."""
    r.draft = list(draft)
    r.table, _ = blocks.allocate(r.all_ids)
    blocks.grow(r.table, len(r.all_ids) + len(draft))
    r.num_computed = len(r.all_ids) - 1
    return Chunk(r, r.num_computed, 1 + len(draft), True, len(draft))


class Ends:
    """The engine's end, recorded: who ended, in which order, with what."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, FinishReason, tuple[int, ...]]] = []

    def __call__(self, r: Request, reason: FinishReason, tokens: tuple[int, ...],
                 logprobs: tuple[EngineTokenLogprob, ...], prompt: tuple[EngineTokenLogprob, ...]) -> StepOutput:
        self.calls.append((r.request_id, reason, tokens))
        return StepOutput(r.request_id, tokens, logprobs, reason, completion_tokens=r.num_generated)


def test_each_sampled_chunk_takes_its_token_and_ends_there_when_it_must() -> None:
    blocks = BlockManager(16, 4)
    a, b, c = req("a", [1, 2, 3]), req("b", [4, 5], max_tokens=1), req("c", [6, 7, 8, 9, 1, 2])
    prefill = Chunk(c, 0, 4, False)             # a chunk that does not reach its end samples nothing
    batch = Batch([decoding(blocks, a), prefill, decoding(blocks, b)], [], [])
    ends = Ends()
    step = update_from_output(batch, [11, 12], torch.tensor([11, 12]), RULES, blocks, ends)
    assert step.outputs == [StepOutput("a", (11,)),
                            StepOutput("b", (12,), (), FinishReason.LENGTH, completion_tokens=1)]
    assert ends.calls == [("b", FinishReason.LENGTH, (12,))]
    assert (a.output_ids, b.output_ids, c.output_ids) == ([11], [12], [])
    assert (step.drafted, step.accepted) == (0, 0)


def test_drafts_are_kept_while_they_equal_what_was_sampled() -> None:
    blocks = BlockManager(16, 4)
    a, b = req("a", [1, 2, 3, 4, 5]), req("b", [6, 7, 8])
    a.lookup, b.lookup = Lookup(2, 3, draft_len=2), Lookup(2, 3, draft_len=2)
    batch = Batch([decoding(blocks, a, [20, 21, 22]), decoding(blocks, b, [30, 31])], [], [])
    # a's rows sample 20, 21, 9, 8: two drafts taken, then the token that differs; b's all, and one more.
    tokens = [20, 21, 9, 8, 30, 31, 32]
    step = update_from_output(batch, tokens, torch.tensor(tokens), RULES, blocks, Ends())
    assert step.outputs == [StepOutput("a", (20, 21, 9)), StepOutput("b", (30, 31, 32))]
    assert (step.drafted, step.accepted) == (5, 4)
    assert (a.num_computed, b.num_computed) == (4 + 1 + 2, 2 + 1 + 2)    # the accepted drafts' KV counts
    assert a.table.hashes == blocks.prefix_hashes(a.all_ids)[:1] and len(b.table.hashes) == 1
    assert (a.lookup.draft_len, b.lookup.draft_len) == (2, 3)           # b took all of its drafts: one more


def test_a_stop_among_the_drafts_ends_the_request_there() -> None:
    blocks = BlockManager(16, 4)
    a = req("a", [1, 2, 3])
    a.lookup = Lookup(2, 3, draft_len=3)
    batch = Batch([decoding(blocks, a, [5, 6, 7])], [], [])
    ends = Ends()
    step = update_from_output(batch, [5, EOS, 7, 8], torch.tensor([5, EOS, 7, 8]), RULES, blocks, ends)
    assert ends.calls == [("a", FinishReason.STOP, (5, EOS))]
    assert step.outputs[0].finish_reason is FinishReason.STOP and (step.drafted, step.accepted) == (3, 1)
    assert a.num_computed == 2 + 1 + 1


@pytest.mark.parametrize(("sampling", "prompt", "max_tokens", "token", "reason"), [
    ({}, [1, 2], 8, EOS, FinishReason.STOP),
    ({"ignore_eos": True}, [1, 2], 8, EOS, None),
    ({"stop_token_ids": (9,)}, [1, 2], 8, 9, FinishReason.STOP),
    ({}, [1, 2], 1, 5, FinishReason.LENGTH),
    ({}, list(range(1, 32)), 8, 5, FinishReason.LENGTH),          # the context (32) is full
    ({}, [1, 2], 8, 5, None),
])
def test_finish_reasons(sampling: dict[str, Any], prompt: list[int], max_tokens: int, token: int,
                        reason: FinishReason | None) -> None:
    r = req("r", prompt, max_tokens, **sampling)
    r.append(token)
    assert finish_reason(r, token, RULES) is reason


class FakeMatcher:
    def __init__(self, allowed: set[int], ends_on: int = -1):
        self.allowed, self.ends_on, self.done = allowed, ends_on, False

    def accept(self, token: int) -> bool:
        self.done = token == self.ends_on
        return token in self.allowed


def test_the_grammar_advances_and_a_complete_one_stops_even_with_ignore_eos() -> None:
    blocks = BlockManager(16, 4)
    a, b, c = req("a", [1, 2]), req("b", [3, 4], ignore_eos=True), req("c", [5, 6])
    a.matcher = FakeMatcher({7})                # type: ignore[assignment]
    b.matcher = FakeMatcher({8}, ends_on=8)     # type: ignore[assignment]
    c.matcher = FakeMatcher({1})                # type: ignore[assignment]   (refuses what was sampled)
    batch = Batch([decoding(blocks, r) for r in (a, b, c)], [], [])
    ends = Ends()
    step = update_from_output(batch, [7, 8, 9], torch.tensor([7, 8, 9]), RULES, blocks, ends)
    assert step.outputs[0] == StepOutput("a", (7,))
    assert ends.calls == [("b", FinishReason.STOP, (8,)), ("c", FinishReason.ERROR, (9,))]


def test_logprobs_come_from_each_tokens_own_row_and_prompt_logprobs_with_the_first_output() -> None:
    blocks = BlockManager(16, 4)
    a, b = req("a", [1, 2], logprobs=True, top_logprobs=1), req("b", [3, 4], logprobs=True)
    b.prompt_logprobs = [EngineTokenLogprob(3, float("nan")), EngineTokenLogprob(4, -0.5)]
    batch = Batch([decoding(blocks, a, [6]), decoding(blocks, b)], [], [])
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 5.0, 1.0],
                           [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 4.0],
                           [3.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    rows = torch.log_softmax(logits, dim=-1)
    step = update_from_output(batch, [6, 6, 2], logits, RULES, blocks, Ends())
    first, second = step.outputs
    assert first.new_ids == (6, 6) and [lp.token_id for lp in first.logprobs] == [6, 6]
    assert [lp.logprob for lp in first.logprobs] == [pytest.approx(float(rows[0, 6])), pytest.approx(float(rows[1, 6]))]
    assert first.logprobs[0].top == ((5, pytest.approx(float(rows[0, 5]))),)
    assert second.logprobs[0].logprob == pytest.approx(float(rows[2, 2])) and second.logprobs[0].top == ()
    assert second.prompt_logprobs == tuple(b.prompt_logprobs) and first.prompt_logprobs == ()
    again = update_from_output(Batch([decoding(BlockManager(16, 4), b)], [], []), [5], logits[2:],
                               RULES, blocks, Ends())
    assert again.outputs[0].prompt_logprobs == ()                    # the first output only
