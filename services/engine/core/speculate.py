"""Prompt-lookup speculative decoding: draft tokens copied from the request's own text, verified in one step.

A chat answer often repeats what it has already read or written (names, code, a list's pattern).
When the last few tokens of a request occurred earlier in its prompt or output, the tokens that
followed them there are a cheap guess at what comes next.  The engine then runs the request's next
token and those drafts as rows of one step (each row attends exactly the positions before it), and
samples every row as a plain decode step would sample it: row i with the generator of the token's
own position (services/engine/runtime/sampler.py).  Drafts are accepted while the sampled token equals the
draft; the first token that differs (or the one after the last draft) is kept too.  So the output
is the one decoding without drafts would produce, token for token, greedy or seeded; an unseeded
sample is drawn from the same distribution.  What speculation changes is how many tokens a step
yields: 1 + the accepted drafts, for one step's cost of 1 + drafts rows.

Rows cost little while a step is bound by reading the weights (a few rows), and as much as any other
row once it is bound by arithmetic, so the engine drafts only while the step's rows stay within a
budget (SpeculationConfig.max_rows, default the plan's small-batch range) and adapts each request's
draft length to how often its drafts were taken.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from services.engine.core.fairness import StepTimes

if TYPE_CHECKING:
    from services.engine.runtime.plan import ExecutionPlan


@dataclass(frozen=True)
class SpeculationConfig:
    max_draft: int = 3        # draft tokens per request and step; 0: no speculation
    max_rows: int = 4         # draft only while the step's rows (decode rows + drafts) stay within this
    max_ngram: int = 3        # the longest suffix looked up; shorter ones are tried after it
    min_ngram: int = 2
    measure: bool = True      # a draft model drafts only where DraftGain measured it to pay; False: always

    def __post_init__(self) -> None:
        if self.max_draft < 0 or self.max_rows < 1 or not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError("speculation: max_draft >= 0, max_rows >= 1 and 1 <= min_ngram <= max_ngram")


@dataclass
class Lookup:
    """One request's n-gram index: where each n-gram (n = min..max) last ended, for positions
    indexed so far.  Only ever extended: a request's tokens are appended, never changed."""

    min_n: int
    max_n: int
    last: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed: int = 0          # n-grams ending before this position are in `last`
    draft_len: int = 0        # the adaptive draft length; 0: not set yet (starts at the maximum)

    def propose(self, ids: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix."""
        end = len(ids) - 1              # the suffix ends here; index every n-gram ending before it
        for pos in range(max(self.indexed, self.min_n - 1), end):
            for n in range(self.min_n, min(self.max_n, pos + 1) + 1):
                self.last[tuple(ids[pos - n + 1:pos + 1])] = pos
        self.indexed = max(self.indexed, end)
        for n in range(min(self.max_n, end), self.min_n - 1, -1):
            found = self.last.get(tuple(ids[end - n + 1:end + 1]))
            if found is not None:
                return list(ids[found + 1:found + 1 + k])
        return []

    def update(self, drafted: int, accepted: int, most: int) -> None:
        """After a verified step: lengthen the draft when all of it was taken, shorten it when none was."""
        if accepted == drafted:
            self.draft_len = min(most, self.draft_len + 1)
        elif accepted == 0:
            self.draft_len = max(1, self.draft_len - 1)


class DraftGain:
    """Where a draft model's speculation pays, by batch size (running requests), as measured: a drafted step's
    tokens a second (the draft's passes and the verifying step together) against a plain decode step's at the
    same size (StepTimes, which records only those).  A size drafts while its smoothed speed-up is at least 1;
    the first decision at a size is a plain step (the other side's measure), and every PROBE-th one tries the
    other side again, so a size turned off by a slow stretch comes back when drafting pays again."""

    SMOOTHING = 0.2        # a drafted step's weight in its size's speed-up
    PROBE = 32

    def __init__(self, times: StepTimes | None = None):
        self.times = times or StepTimes()
        self.speedup: dict[int, float] = {}      # requests -> smoothed speed-up of its drafted steps
        self._asked: dict[int, int] = {}
        self.last = 0.0                          # the last drafted step's speed-up (a metric)

    def allowed(self, requests: int) -> bool:
        asked = self._asked[requests] = self._asked.get(requests, 0) + 1
        if requests not in self.times.seconds:
            return False                         # no plain step of this size measured yet
        measured = self.speedup.get(requests)
        pays = measured is None or measured >= 1.0
        return pays != (asked % self.PROBE == 0)

    def record(self, requests: int, seconds: float, tokens: int) -> None:
        """A drafted step of `requests` rows took `seconds` (drafting included) and yielded `tokens`."""
        plain = self.times.seconds.get(requests)
        if plain is None or seconds <= 0:
            return
        self.last = ratio = (tokens / seconds) / (requests / plain)
        old = self.speedup.get(requests)
        self.speedup[requests] = ratio if old is None else old + self.SMOOTHING * (ratio - old)


def for_plan(plan: ExecutionPlan, max_draft: int = -1, max_rows: int = 0, draft: bool = False) -> SpeculationConfig:
    """The engine's speculation: max_draft -1 (auto) drafts up to 3 tokens on the CPU (4 from a draft model) and
    none on a GPU (its pure-decode steps replay CUDA graphs, which a step with drafts would leave); max_rows 0
    (auto): the plan's small-batch range (the rows its weight-read-bound kind serves), else 4; with a draft
    model 16, since DraftGain measures where drafting pays."""
    if max_draft < 0:
        max_draft = 0 if plan.device != "cpu" else 4 if draft else 3
    if max_rows <= 0:
        max_rows = 16 if draft else plan.split_rows if plan.matmul_large else 4
    return SpeculationConfig(max_draft=max_draft, max_rows=max_rows)
