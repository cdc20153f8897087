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

if TYPE_CHECKING:
    from services.engine.runtime.plan import ExecutionPlan


@dataclass(frozen=True)
class SpeculationConfig:
    max_draft: int = 3        # draft tokens per request and step; 0: no speculation
    max_rows: int = 4         # draft only while the step's rows (decode rows + drafts) stay within this
    max_ngram: int = 3        # the longest suffix looked up; shorter ones are tried after it
    min_ngram: int = 2

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


def for_plan(plan: ExecutionPlan, max_draft: int = -1, max_rows: int = 0) -> SpeculationConfig:
    """The engine's speculation: max_draft -1 (auto) drafts up to 3 tokens on the CPU and none on a GPU
    (its pure-decode steps replay CUDA graphs, which a step with drafts would leave); max_rows 0 (auto):
    the plan's small-batch range (the rows its weight-read-bound kind serves), else 4."""
    if max_draft < 0:
        max_draft = 3 if plan.device == "cpu" else 0
    if max_rows <= 0:
        max_rows = plan.split_rows if plan.matmul_large else 4
    return SpeculationConfig(max_draft=max_draft, max_rows=max_rows)
