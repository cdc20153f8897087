"""A fake model for the engine's scheduler: no model runs.

`FakeModel` writes each chunk's tokens into a simulated paged KV cache and "samples" the next token
from what it reads back through the request's block table (the sum of the tokens read back, % 100), so
a block that is shared, evicted or reused wrongly changes the output.  A request alone, with no cache,
would generate token after token the sum of all its ids so far % 100 (tests/unit/test_scheduler.py's
`reference`).
"""

from __future__ import annotations

from services.engine.core.request import Request
from services.engine.core.scheduler import Batch, Scheduler


class FakeModel:
    """Paged KV cache simulation: next token = sum of the tokens read back from the cache % 100."""

    def __init__(self, s: Scheduler):
        self.s = s
        self.bs = s.blocks.block_size
        self.kv: dict[int, list[int | None]] = {}

    def _slot(self, r: Request, pos: int) -> tuple[int, int]:
        return r.table.blocks[pos // self.bs], pos % self.bs

    def step(self) -> Batch:
        """One engine step: schedule, run, commit, sample, finish the requests that are done."""
        batch = self.s.schedule()
        for block, kv in batch.imports:             # staged "KV" here is the block's tokens
            self.kv[block] = list(kv)  # type: ignore[call-overload]
        for c in batch.chunks:
            for pos in range(c.start, c.start + c.num_tokens):
                block, off = self._slot(c.request, pos)
                self.kv.setdefault(block, [None] * self.bs)[off] = c.request.all_ids[pos]
        self.s.commit(batch)
        for c in batch.chunks:
            if c.sample:
                end = c.start + c.num_tokens
                seen = [self.kv[b][o] for b, o in (self._slot(c.request, p) for p in range(end))]
                assert None not in seen, f"{c.request.request_id} reads KV that was never written"
                c.request.append(sum(t or 0 for t in seen) % 100)
                if len(c.request.output_ids) == c.request.max_tokens:
                    self.s.finish(c.request)
        return batch
