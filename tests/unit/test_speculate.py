"""Prompt lookup (services/engine/core/speculate.py): which drafts it proposes, and how their length adapts."""

from __future__ import annotations

import pytest

from services.engine.core.speculate import Lookup, SpeculationConfig, for_plan
from services.engine.runtime.plan import ExecutionPlan


def test_proposes_what_followed_the_latest_earlier_occurrence_of_the_suffix() -> None:
    lookup = Lookup(min_n=2, max_n=3)
    ids = [5, 6, 7, 8, 9, 1, 5, 6, 7, 2, 3, 5, 6, 7]
    # The suffix (5, 6, 7) occurred at 0..2 and 6..8; the later one was followed by 2, 3, 5.
    assert lookup.propose(ids, 3) == [2, 3, 5]
    assert lookup.propose(ids, 1) == [2]
    ids += [2]                              # incremental: only the new positions are indexed
    assert lookup.propose(ids, 2) == [3, 5]


def test_falls_back_to_shorter_suffixes_and_proposes_nothing_without_a_match() -> None:
    lookup = Lookup(min_n=2, max_n=3)
    assert lookup.propose([1, 2, 3, 4], 3) == []              # no repeated bigram
    assert lookup.propose([1, 2, 3, 4, 9, 3, 4], 3) == [9, 3, 4]  # (3, 4) repeats; (9, 3, 4) does not
    assert Lookup(min_n=2, max_n=3).propose([7], 3) == []       # too short to have a suffix
    assert Lookup(min_n=2, max_n=3).propose([4, 4, 4], 2) == [4]   # only what exists after the match


def test_draft_length_grows_when_taken_and_shrinks_when_refused() -> None:
    lookup = Lookup(min_n=2, max_n=3, draft_len=2)
    lookup.update(drafted=2, accepted=2, most=3)
    assert lookup.draft_len == 3
    lookup.update(drafted=3, accepted=3, most=3)
    assert lookup.draft_len == 3
    lookup.update(drafted=3, accepted=1, most=3)
    assert lookup.draft_len == 3
    lookup.update(drafted=3, accepted=0, most=3)
    lookup.update(drafted=2, accepted=0, most=3)
    lookup.update(drafted=1, accepted=0, most=3)
    assert lookup.draft_len == 1                                # never below one


def test_config_and_the_plans_default() -> None:
    with pytest.raises(ValueError):
        SpeculationConfig(max_draft=-1)
    with pytest.raises(ValueError):
        SpeculationConfig(min_ngram=3, max_ngram=2)
    cpu = ExecutionPlan("cpu", "float32", "q4", "fused", "cpu", "off", "bf16w", 4)
    assert for_plan(cpu) == SpeculationConfig(max_draft=3, max_rows=4)
    assert for_plan(cpu, 0).max_draft == 0 and for_plan(cpu, 5, 8) == SpeculationConfig(max_draft=5, max_rows=8)
    gpu = ExecutionPlan("cuda", "bfloat16", "fused", "triton", "triton", "cuda")
    assert for_plan(gpu).max_draft == 0


def test_draft_gain_measures_a_plain_step_first_then_drafts_while_it_pays() -> None:
    from services.engine.core.fairness import StepTimes
    from services.engine.core.speculate import DraftGain

    times = StepTimes()
    gain = DraftGain(times)
    assert not gain.allowed(1)                  # no plain step of 1 row measured yet: this one is plain
    times.record(1, 0.040)
    assert gain.allowed(1)                      # measured plain, drafting not yet: try it
    gain.record(1, 0.080, 3)                    # 3 tokens in 80 ms against 1 in 40 ms: 1.5x
    assert gain.speedup[1] == pytest.approx(1.5) and gain.last == pytest.approx(1.5)
    assert gain.allowed(1)
    for _ in range(30):
        gain.record(1, 0.100, 2)                # 0.8x, again and again: the average falls below 1
    assert gain.speedup[1] < 1
    decisions = [gain.allowed(1) for _ in range(2 * DraftGain.PROBE)]
    assert decisions.count(True) == 2           # off, but every PROBE-th decision tries drafting again
    gain.record(2, 0.1, 4)                      # a size never measured plain: nothing recorded
    assert 2 not in gain.speedup


def test_for_plan_with_a_draft_model() -> None:
    plan = ExecutionPlan("cpu", "float32", "gguf", "fused", "cpu", "off")
    assert (for_plan(plan, draft=True).max_draft, for_plan(plan, draft=True).max_rows) == (4, 16)
    assert for_plan(plan, 2, 6, draft=True) == SpeculationConfig(max_draft=2, max_rows=6)
