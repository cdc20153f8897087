"""Scheduler: continuous batching, chunked prefill, priorities, preemption, prefix reuse.

No model runs: the fake model of tests/fakes/model.py writes each chunk's tokens into a simulated
paged KV cache and "samples" the next token from what it reads back through the request's block table,
so a block that is shared, evicted or reused wrongly changes the output.
"""

from __future__ import annotations

import pytest

from mesh.prefix import block_hashes
from services.engine.core.block_manager import BlockManager
from services.engine.core.request import Request, RequestStatus, SamplingParams, StagedBlock
from services.engine.core.scheduler import Batch, Chunk, Scheduler, SchedulerConfig
from tests.fakes.model import FakeModel


def req(rid: str, prompt: list[int], max_tokens: int = 8, priority: int = 0) -> Request:
    r = Request(rid, prompt_ids=list(prompt), sampling=SamplingParams(max_tokens=max_tokens), max_tokens=max_tokens)
    r.priority = priority
    return r


def sched(num_blocks: int = 16, block_size: int = 4, **config: int) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size), SchedulerConfig(**config))


def spans(batch: Batch) -> list[tuple[str, int, int, bool]]:
    return [(c.request.request_id, c.start, c.num_tokens, c.sample) for c in batch.chunks]


def step(s: Scheduler) -> Batch:
    """Schedule and commit one step, appending token 7 for every sampled chunk."""
    batch = s.schedule()
    s.commit(batch)
    for c in batch.chunks:
        if c.sample:
            c.request.append(7)
    return batch


def run_to_completion(
    s: Scheduler, requests: list[Request], model: FakeModel | None = None, max_steps: int = 500
) -> tuple[dict[str, list[int]], list[Batch]]:
    model = model or FakeModel(s)
    for r in requests:
        s.add(r)
    batches = []
    while s.has_work():
        assert len(batches) < max_steps, "scheduler made no progress"
        batches.append(model.step())
    return {r.request_id: list(r.output_ids) for r in requests}, batches


def reference(requests: list[Request]) -> dict[str, list[int]]:
    """What each request generates alone, token by token, with no cache and no scheduler."""
    out = {}
    for r in requests:
        ids = list(r.prompt_ids)
        for _ in range(r.max_tokens):
            ids.append(sum(ids) % 100)
        out[r.request_id] = ids[len(r.prompt_ids):]
    return out


# -- config --------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs", [{"max_batched_tokens": 0}, {"max_running": 0}, {"watermark_blocks": -1}])
def test_config_rejects_non_positive_limits(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        SchedulerConfig(**kwargs)


def test_empty_scheduler_returns_empty_batch() -> None:
    s = sched()
    assert not s.has_work()
    batch = s.schedule()
    assert (batch.chunks, batch.preempted, batch.num_tokens) == ([], [], 0)


# -- continuous batching -------------------------------------------------------------
def test_two_requests_are_admitted_together_with_full_prefills() -> None:
    s = sched()
    a, b = req("a", [1, 2, 3, 4, 5]), req("b", [6, 7, 8])
    s.add(a)
    s.add(b)
    batch = step(s)
    assert spans(batch) == [("a", 0, 5, True), ("b", 0, 3, True)]
    assert batch.num_tokens == 8
    assert (a.status, b.status) == (RequestStatus.RUNNING, RequestStatus.RUNNING)
    assert (a.table.blocks, b.table.blocks) == ([0, 1], [2])
    assert (a.num_computed, b.num_computed) == (5, 3)
    assert s.num_waiting == 0


def test_next_step_decodes_one_token_each() -> None:
    s = sched()
    a, b = req("a", [1, 2, 3, 4, 5]), req("b", [6, 7, 8])
    s.add(a)
    s.add(b)
    step(s)
    assert spans(step(s)) == [("a", 5, 1, True), ("b", 3, 1, True)]
    assert (a.num_computed, b.num_computed) == (6, 4)
    assert (a.output_ids, b.output_ids) == ([7, 7], [7, 7])
    assert (a.table.blocks, b.table.blocks) == ([0, 1], [2])


def test_request_added_later_joins_between_steps() -> None:
    s = sched()
    a, b = req("a", [1, 2, 3, 4, 5]), req("b", [6, 7, 8])
    s.add(a)
    s.add(b)
    step(s)
    step(s)
    c = req("c", [9, 9])
    s.add(c)
    assert spans(step(s)) == [("a", 6, 1, True), ("b", 4, 1, True), ("c", 0, 2, True)]
    assert c.arrival == 2
    assert (b.table.blocks, c.table.blocks) == ([2, 3], [4])  # b's 5th token grew first


# -- chunked prefill -----------------------------------------------------------------
def test_long_prompt_is_prefilled_in_budget_sized_chunks() -> None:
    s = sched(max_batched_tokens=4)
    a = req("a", list(range(10)))
    s.add(a)
    assert spans(step(s)) == [("a", 0, 4, False)]
    assert (a.num_computed, a.output_ids) == (4, [])
    assert spans(step(s)) == [("a", 4, 4, False)]
    assert (a.num_computed, a.output_ids) == (8, [])
    assert spans(step(s)) == [("a", 8, 2, True)]
    assert (a.num_computed, a.output_ids) == (10, [7])
    assert spans(step(s)) == [("a", 10, 1, True)]


def test_chunked_prefill_blocks_are_allocated_up_front_and_committed_as_computed() -> None:
    s = sched(num_blocks=8, block_size=2, max_batched_tokens=3)
    a = req("a", list(range(1, 8)))            # 7 tokens: 4 blocks
    s.add(a)
    step(s)
    assert a.table.blocks == [0, 1, 2, 3]
    assert len(a.table.hashes) == 1            # 3 computed: only block 0 is full
    step(s)
    assert len(a.table.hashes) == 3            # 6 computed


def test_running_decode_goes_before_new_prefill_and_uses_budget_first() -> None:
    s = sched(max_batched_tokens=4)
    a = req("a", list(range(10)))
    s.add(a)
    for _ in range(3):
        step(s)
    b = req("b", [5] * 6)
    s.add(b)
    assert spans(step(s)) == [("a", 10, 1, True), ("b", 0, 3, False)]
    assert spans(step(s)) == [("a", 11, 1, True), ("b", 3, 3, True)]


def test_unfinished_prefill_continues_before_admitting_new_requests() -> None:
    s = sched(max_batched_tokens=4)
    a, b = req("a", list(range(6))), req("b", [1, 2])
    s.add(a)
    s.add(b)
    assert spans(step(s)) == [("a", 0, 4, False)]  # budget spent: b stays waiting
    assert s.num_waiting == 1
    assert spans(step(s)) == [("a", 4, 2, True), ("b", 0, 2, True)]


# -- priority and limits -------------------------------------------------------------
def test_interactive_request_is_admitted_before_earlier_batch_request() -> None:
    s = sched(max_running=1)
    batch_req, interactive = req("batch", [1, 2], priority=1), req("chat", [3, 4])
    s.add(batch_req)
    s.add(interactive)
    assert (batch_req.arrival, interactive.arrival) == (0, 1)
    assert spans(step(s)) == [("chat", 0, 2, True)]
    assert batch_req.status is RequestStatus.WAITING
    s.finish(interactive)
    assert spans(step(s)) == [("batch", 0, 2, True)]


def test_running_requests_are_ordered_interactive_first() -> None:
    s = sched()
    batch_req, interactive = req("batch", [1, 2], priority=1), req("chat", [3, 4])
    s.add(batch_req)
    step(s)
    s.add(interactive)                         # a waiting interactive request goes before a running batch one,
    assert spans(step(s)) == [("chat", 0, 2, True)]    # and its prefill step runs without batch rows
    assert spans(step(s)) == [("chat", 2, 1, True), ("batch", 2, 1, True)]


def test_max_running_limits_admission() -> None:
    s = sched(max_running=2)
    rs = [req(f"r{i}", [i + 1, i + 2]) for i in range(3)]
    for r in rs:
        s.add(r)
    assert spans(step(s)) == [("r0", 0, 2, True), ("r1", 0, 2, True)]
    assert [r.request_id for r in s.waiting[0]] == ["r2"]
    assert spans(step(s)) == [("r0", 2, 1, True), ("r1", 2, 1, True)]
    s.finish(rs[0])
    assert spans(step(s)) == [("r1", 3, 1, True), ("r2", 0, 2, True)]


def test_head_of_line_request_that_does_not_fit_holds_back_the_queue() -> None:
    s = sched(num_blocks=4, block_size=2)
    big, small = req("big", [1] * 9), req("small", [2])
    s.add(big)                                 # needs 5 blocks of 4
    s.add(small)
    assert spans(step(s)) == []
    assert s.num_waiting == 2


# -- watermark -----------------------------------------------------------------------
def test_watermark_holds_back_admission() -> None:
    s = sched(num_blocks=8, block_size=2, watermark_blocks=2)
    a, b = req("a", [1] * 8), req("b", [2] * 5)   # 4 blocks, then 3 more would leave 1 < 2
    s.add(a)
    s.add(b)
    assert spans(step(s)) == [("a", 0, 8, True)]
    assert b.status is RequestStatus.WAITING
    assert s.blocks.num_free_blocks == 4


def test_without_watermark_the_same_request_is_admitted() -> None:
    s = sched(num_blocks=8, block_size=2)
    s.add(req("a", [1] * 8))
    s.add(req("b", [2] * 5))
    assert spans(step(s)) == [("a", 0, 8, True), ("b", 0, 5, True)]
    assert s.blocks.num_free_blocks == 1


def test_watermark_admits_exactly_down_to_the_reserve() -> None:
    s = sched(num_blocks=8, block_size=2, watermark_blocks=2)
    s.add(req("a", [1] * 12))                  # 6 blocks: leaves exactly 2
    assert spans(step(s)) == [("a", 0, 12, True)]
    assert s.blocks.num_free_blocks == 2


def test_running_decode_may_grow_into_the_watermark() -> None:
    s = sched(num_blocks=8, block_size=2, watermark_blocks=2)
    a = req("a", [1] * 12)
    s.add(a)
    step(s)
    assert spans(step(s)) == [("a", 12, 1, True)]
    assert s.blocks.num_free_blocks == 1
    assert step(s).preempted == []


# -- preemption ----------------------------------------------------------------------
def preempting_pair() -> tuple[Scheduler, Request, Request, FakeModel]:
    """4 blocks of 2: a and b fill them after two steps; a's next decode needs a fifth block."""
    s = sched(num_blocks=4, block_size=2)
    a, b = req("a", [1, 2, 3], max_tokens=3), req("b", [4, 5, 6])
    s.add(a)
    s.add(b)
    model = FakeModel(s)
    model.step()
    model.step()
    assert (a.table.blocks, b.table.blocks, s.blocks.num_free_blocks) == ([0, 1], [2, 3], 0)
    return s, a, b, model


def test_decode_without_free_block_preempts_most_recent_request() -> None:
    s, a, b, model = preempting_pair()
    batch = model.step()
    assert batch.preempted == [b]
    assert spans(batch) == [("a", 4, 1, True)]
    assert (b.status, b.num_computed, b.table.blocks, b.num_preemptions) == (RequestStatus.WAITING, 0, [], 1)
    assert b.output_ids == reference([b])["b"][:2]  # what it generated is kept
    assert list(s.waiting[0]) == [b]
    assert s.running == []                     # a reached max_tokens this step and finished
    assert a.table.blocks == []


def test_preempted_blocks_are_freed_tail_first_and_the_tail_is_evicted() -> None:
    s, a, b, model = preempting_pair()
    s.schedule()
    assert a.table.blocks == [0, 1, 3]         # b's freed tail block 3 was evicted for a
    assert s.blocks.ref == [1, 1, 0, 1]
    assert list(s.blocks.evictable) == [2]     # b's head stays cached
    assert s.blocks.match_prefix(b.all_ids) == [2]


def test_preempted_request_is_readmitted_and_recomputes_prompt_and_output() -> None:
    s, a, b, model = preempting_pair()
    model.step()                               # b preempted; a finishes
    assert a.status is RequestStatus.FINISHED
    assert b.all_ids == [4, 5, 6, 15, 30]
    batch = model.step()
    assert spans(batch) == [("b", 2, 3, True)]  # block [4,5] still cached; [6,15] was evicted
    assert b.table.blocks == [2, 3, 1]
    assert (b.num_computed, b.num_cached_tokens) == (5, 2)
    assert b.output_ids == reference([b])["b"][:3]


def test_preempted_request_goes_to_front_of_its_queue() -> None:
    s, a, b, model = preempting_pair()
    c = req("c", [9])
    s.add(c)
    batch = s.schedule()
    assert batch.preempted == [b]
    assert [ch.request for ch in batch.chunks] == [a]
    assert list(s.waiting[0]) == [b, c]


def test_no_admission_in_a_step_that_preempted() -> None:
    s = sched(num_blocks=4, block_size=2)
    batch_req, chat = req("batch", [4, 5, 6], priority=1), req("chat", [1, 2, 3])
    s.add(batch_req)
    s.add(chat)
    step(s)
    step(s)
    late = req("late", [9])                    # interactive, needs one block
    s.add(late)
    batch = step(s)
    assert batch.preempted == [batch_req]
    assert s.blocks.can_allocate(late.all_ids)  # it would have fitted
    assert [ch.request for ch in batch.chunks] == [chat]
    assert list(s.waiting[0]) == [late]
    assert spans(step(s)) == [("chat", 5, 1, True), ("late", 0, 1, True)]


def test_batch_request_is_preempted_before_interactive_one_that_arrived_later() -> None:
    s = sched(num_blocks=4, block_size=2)
    batch_req, chat = req("batch", [4, 5, 6], priority=1), req("chat", [1, 2, 3])
    s.add(batch_req)
    s.add(chat)
    model = FakeModel(s)
    assert spans(model.step()) == [("chat", 0, 3, True)]        # an interactive prefill: no batch rows
    assert spans(model.step()) == [("chat", 3, 1, True), ("batch", 0, 3, True)]
    batch = model.step()                                         # chat needs a third block: none is free
    assert batch.preempted == [batch_req]
    assert spans(batch) == [("chat", 4, 1, True)]
    assert list(s.waiting[1]) == [batch_req]
    assert len(s.waiting[0]) == 0


def test_request_that_cannot_grow_alone_preempts_itself() -> None:
    s = sched(num_blocks=2, block_size=2)
    a = req("a", [1, 2, 3])
    s.add(a)
    step(s)
    step(s)                                    # 4 tokens: both blocks
    batch = s.schedule()
    assert batch.preempted == [a]
    assert batch.chunks == []
    assert (a.status, s.blocks.num_free_blocks) == (RequestStatus.WAITING, 2)


def test_several_victims_in_one_step_wait_in_arrival_order() -> None:
    s = sched(num_blocks=6, block_size=2)
    rs = [req(f"r{i}", [10 * i + 1, 10 * i + 2, 10 * i + 3]) for i in range(3)]
    for r in rs:
        s.add(r)
    step(s)
    step(s)                                    # each holds 2 blocks; none free
    rs[0].append(1)
    rs[0].append(1)                            # r0 now needs 2 more blocks at once
    batch = s.schedule()
    assert batch.preempted == [rs[2], rs[1]]   # r2 makes room for r0; r1 then cannot grow and goes too
    assert list(s.waiting[0]) == [rs[1], rs[2]]
    assert spans(batch) == [("r0", 4, 3, True)]
    assert rs[0].table.blocks == [0, 1, 5, 4]  # r2's blocks, tail first


@pytest.mark.parametrize("num_blocks", [6, 7, 8, 12])
@pytest.mark.parametrize("budget", [3, 64])
def test_preemption_loses_nothing_and_does_not_change_outputs(num_blocks: int, budget: int) -> None:
    def workload() -> list[Request]:
        shared = [3, 1, 4, 1, 5]
        return [
            req("a", shared + [9], max_tokens=6),
            req("b", shared + [2, 6], max_tokens=5, priority=1),
            req("c", [2, 7, 1], max_tokens=7),
            req("d", shared + [9], max_tokens=4),
            req("e", [8, 8, 8, 8], max_tokens=6, priority=1),
        ]

    plenty = Scheduler(BlockManager(64, 2), SchedulerConfig(max_batched_tokens=budget))
    expected, ref_batches = run_to_completion(plenty, workload())
    assert all(not b.preempted for b in ref_batches)
    assert expected == reference(workload())

    tight = Scheduler(BlockManager(num_blocks, 2), SchedulerConfig(max_batched_tokens=budget))
    reqs = workload()
    got, batches = run_to_completion(tight, reqs)
    assert got == expected
    assert all(r.status is RequestStatus.FINISHED and len(r.output_ids) == r.max_tokens for r in reqs)
    assert tight.blocks.ref == [0] * num_blocks
    assert tight.blocks.num_free_blocks == num_blocks
    if num_blocks <= 7:
        assert any(b.preempted for b in batches)


# -- prefix reuse --------------------------------------------------------------------
def test_second_request_with_same_prompt_starts_after_cached_prefix() -> None:
    s = sched(num_blocks=8, block_size=2)
    prompt = [1, 2, 3, 4, 5, 6, 7]             # 3 full blocks + 1 token
    a = req("a", prompt, max_tokens=1)
    s.add(a)
    model = FakeModel(s)
    assert spans(model.step()) == [("a", 0, 7, True)]
    assert a.status is RequestStatus.FINISHED
    b = req("b", prompt, max_tokens=1)
    s.add(b)
    batch = s.schedule()
    assert spans(batch) == [("b", 6, 1, True)]
    assert (b.num_computed, b.num_cached_tokens) == (6, 6)
    assert b.table.blocks == [0, 1, 2, 4]
    assert (s.blocks.hits, s.blocks.queries) == (6, 14)


def test_cached_prefix_gives_same_output_as_full_prefill() -> None:
    s = sched(num_blocks=8, block_size=2)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    model = FakeModel(s)
    got, _ = run_to_completion(s, [req("a", prompt, max_tokens=3)], model)
    got2, _ = run_to_completion(s, [req("b", prompt, max_tokens=3)], model)
    assert got["a"] == got2["b"] == reference([req("a", prompt, max_tokens=3)])["a"]
    assert s.blocks.hits == 6


def test_concurrent_requests_share_prefix_blocks_once_committed() -> None:
    s = sched(num_blocks=8, block_size=2)
    a = req("a", [1, 2, 3, 4, 5])
    s.add(a)
    step(s)
    b = req("b", [1, 2, 3, 4, 9])
    s.add(b)
    assert spans(step(s)) == [("a", 5, 1, True), ("b", 4, 1, True)]
    assert (a.table.blocks, b.table.blocks) == ([0, 1, 2], [0, 1, 3])
    assert s.blocks.ref[:4] == [2, 2, 1, 1]


# -- blocks imported from the shared cache ---------------------------------------------
def staged(prompt: list[int], positions: range, block_size: int = 2) -> list[StagedBlock]:
    """Blocks another engine computed for `prompt`, as the server stages them; their "KV" is their tokens."""
    hashes = block_hashes(prompt, block_size)
    return [StagedBlock(i, hashes[i], prompt[i * block_size:(i + 1) * block_size]) for i in positions]  # type: ignore[arg-type]


def test_staged_blocks_are_imported_at_admission_and_skip_their_prefill() -> None:
    s = sched(num_blocks=8, block_size=2)
    prompt = [1, 2, 3, 4, 5, 6, 7]             # usable: [1,2] [3,4] [5,6]; token 7 is always computed
    b = req("b", prompt, max_tokens=1)
    b.staged = staged(prompt, range(3))
    s.add(b)
    batch = s.schedule()
    assert spans(batch) == [("b", 6, 1, True)]
    assert [(block, kv) for block, kv in batch.imports] == [(0, [1, 2]), (1, [3, 4]), (2, [5, 6])]
    assert b.table.blocks == [0, 1, 2, 3]
    assert b.table.hashes == block_hashes(prompt[:6], 2)
    assert (b.num_computed, b.num_cached_tokens, b.staged) == (6, 6, [])
    assert s.blocks.ref[:4] == [1, 1, 1, 1]
    assert s.blocks.cached == {h: i for i, h in enumerate(block_hashes(prompt[:6], 2))}
    assert (s.blocks.hits, s.blocks.imported, s.blocks.queries) == (6, 6, 7)


def test_imported_prefix_gives_the_output_of_a_full_prefill_and_is_then_a_local_hit() -> None:
    prompt = [1, 2, 3, 4, 5, 6, 7]
    s = sched(num_blocks=8, block_size=2)
    b = req("b", prompt, max_tokens=3)
    b.staged = staged(prompt, range(3))
    got, batches = run_to_completion(s, [b])
    assert got == reference([req("b", prompt, max_tokens=3)])
    assert batches[0].num_tokens == 1
    assert list(s.blocks.evictable) == [3, 2, 1, 0]  # finished: imported blocks stay cached, tail first
    c = req("c", prompt + [8, 9], max_tokens=1)
    s.add(c)
    batch = s.schedule()
    assert spans(batch) == [("c", 6, 3, True)] and batch.imports == []
    assert (s.blocks.hits, s.blocks.imported) == (12, 6)


def test_only_staged_blocks_after_the_local_hit_are_imported() -> None:
    s = sched(num_blocks=8, block_size=2)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    run_to_completion(s, [req("a", [1, 2, 3], max_tokens=1)])   # caches block [1,2] locally as block 0
    b = req("b", prompt, max_tokens=1)
    b.staged = staged(prompt, range(3))
    s.add(b)
    batch = s.schedule()
    assert spans(batch) == [("b", 6, 1, True)]
    assert b.table.blocks[:3] == [0, 2, 3]
    assert [(block, kv) for block, kv in batch.imports] == [(2, [3, 4]), (3, [5, 6])]
    assert (b.num_cached_tokens, s.blocks.imported) == (6, 4)


def test_staged_blocks_after_a_gap_are_not_imported() -> None:
    s = sched(num_blocks=8, block_size=2)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    b = req("b", prompt, max_tokens=1)
    b.staged = staged(prompt, range(1, 3))       # block 0 neither cached here nor staged (evicted since)
    s.add(b)
    batch = s.schedule()
    assert spans(batch) == [("b", 0, 7, True)] and batch.imports == []
    assert (b.num_cached_tokens, b.staged, s.blocks.imported, s.blocks.cached) == (0, [], 0, {})


def test_import_stops_at_a_block_of_another_prompt_or_past_the_usable_blocks() -> None:
    s = sched(num_blocks=16, block_size=2)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    b = req("b", prompt, max_tokens=1)
    b.staged = staged(prompt, range(1)) + staged([1, 2, 9, 9, 5, 6], range(1, 3))
    s.add(b)
    batch = s.schedule()
    assert spans(batch) == [("b", 2, 5, True)] and [block for block, _ in batch.imports] == [0]
    c = req("c", [1, 2, 3, 4, 5], max_tokens=1)     # usable: [1,2] [3,4]; [5,6] is not this prompt's
    c.staged = staged([1, 2, 3, 4, 5, 6, 7], range(3))
    s.add(c)
    batch = s.schedule()
    assert spans(batch)[-1] == ("c", 4, 1, True)
    assert [block for block, _ in batch.imports] == [c.table.blocks[1]]   # block 0 is a local hit now


def test_a_preempted_imported_request_recomputes_from_the_local_cache() -> None:
    s = sched(num_blocks=5, block_size=2)
    prompt = [1, 2, 3, 4, 5]
    a = req("a", prompt, max_tokens=4)
    a.staged = staged(prompt, range(2))
    s.add(a)
    batch = s.schedule()
    assert spans(batch) == [("a", 4, 1, True)] and len(batch.imports) == 2
    s.commit(batch)
    s._preempt(a)
    assert (a.num_computed, a.staged) == (0, [])
    batch = s.schedule()
    assert spans(batch) == [("a", 4, 1, True)] and batch.imports == []   # both blocks are local hits now
    assert (s.blocks.hits, s.blocks.imported) == (8, 4)


# -- finish --------------------------------------------------------------------------
def test_finish_waiting_request_removes_it_from_queue() -> None:
    s = sched(max_running=1)
    a, b = req("a", [1, 2]), req("b", [3, 4], priority=1)
    s.add(a)
    s.add(b)
    step(s)
    s.finish(b)
    assert b.status is RequestStatus.FINISHED
    assert s.num_waiting == 0
    assert s.running == [a]
    assert s.blocks.num_free_blocks == 15


def test_finish_running_request_releases_its_blocks_exactly() -> None:
    s = sched(num_blocks=8, block_size=2)
    a, b = req("a", [1, 2, 3, 4, 5]), req("b", [6, 7, 8])
    s.add(a)
    s.add(b)
    step(s)
    assert s.blocks.num_free_blocks == 3
    s.finish(a)
    assert a.status is RequestStatus.FINISHED
    assert s.running == [b]
    assert s.blocks.num_free_blocks == 6
    assert s.blocks.ref == [0, 0, 0, 1, 1, 0, 0, 0]
    assert list(s.blocks.evictable) == [1, 0]
    s.finish(b)
    assert (s.blocks.num_free_blocks, s.running, s.has_work()) == (8, [], False)


def test_finish_mid_prefill_releases_all_allocated_blocks() -> None:
    s = sched(num_blocks=8, block_size=2, max_batched_tokens=3)
    a = req("a", list(range(1, 8)))
    s.add(a)
    step(s)
    assert s.blocks.num_free_blocks == 4
    s.finish(a)
    assert s.blocks.num_free_blocks == 8
    assert list(s.blocks.evictable) == [0]     # only the computed full block stays cached


def test_finish_of_preempted_request_frees_nothing_twice() -> None:
    s, a, b, model = preempting_pair()
    model.step()
    s.finish(b)
    assert b.status is RequestStatus.FINISHED
    assert not s.has_work()
    assert s.blocks.ref == [0, 0, 0, 0]
    assert s.blocks.num_free_blocks == 4


def test_chunk_is_a_named_tuple_of_request_start_size_sample() -> None:
    r = req("a", [1])
    assert Chunk(r, 0, 1, True) == (r, 0, 1, True, 0)       # draft: 0 unless speculation drafted


def test_a_decode_row_carries_its_draft_and_commit_counts_only_the_real_token() -> None:
    s = sched(num_blocks=8, block_size=4, max_batched_tokens=8)
    a = req("a", [1, 2, 3])
    s.add(a)
    s.commit(s.schedule())
    a.append(7)                                   # decoding: one token to compute, position 3
    a.draft = [8, 9, 10]
    batch = s.schedule()
    assert [(c.start, c.num_tokens, c.sample, c.draft) for c in batch.chunks] == [(3, 4, True, 3)]
    assert len(a.table) == 2                      # blocks for the draft positions 4..6 as well
    s.commit(batch)
    assert a.num_computed == 4                    # the drafts count once accepted (the engine's call)


def test_drafts_are_dropped_when_the_budget_or_the_blocks_run_short() -> None:
    s = sched(num_blocks=8, block_size=4, max_batched_tokens=3)
    a = req("a", [1, 2])
    s.add(a)
    s.commit(s.schedule())
    a.append(5)
    a.draft = [6, 7, 8]                           # 1 + 3 rows > the budget of 3
    assert [(c.num_tokens, c.draft) for c in s.schedule().chunks] == [(1, 0)]
    tight = sched(num_blocks=1, block_size=4, max_batched_tokens=8)
    b = req("b", [1, 2])
    tight.add(b)
    tight.commit(tight.schedule())
    b.append(5)
    b.draft = [6, 7, 8]                           # positions up to 5 need a second block: none is free
    assert [(c.num_tokens, c.draft) for c in tight.schedule().chunks] == [(1, 0)]


def test_scheduling_proposes_drafts_when_every_row_decodes_and_none_waits() -> None:
    from services.engine.core.speculate import SpeculationConfig
    s = Scheduler(BlockManager(16, 4), speculation=SpeculationConfig(max_draft=3, max_rows=4), max_context=64)
    a = req("a", [5, 6, 7, 8, 5, 6], max_tokens=8)
    s.add(a)
    step(s)                                     # the prefill: no drafts while it runs
    assert a.draft == [] and a.output_ids == [7]
    batch = s.schedule()                        # (5, 6, 7) came before: 8, 5, 6 followed
    assert a.draft == [8, 5, 6] and spans(batch) == [("a", 6, 4, True)] and batch.chunks[0].draft == 3
    assert batch.rows == [(a, 0), (a, 1), (a, 2), (a, 3)]
    s.commit(batch)
    a.append(8)
    assert s.schedule(arriving=True).chunks[0].draft == 0 and a.draft == []   # an arrival: no drafts


def test_a_batch_says_whether_it_is_greedy_and_whether_it_is_batch_class_only() -> None:
    a, b = req("a", [1, 2]), req("b", [3, 4], priority=1)
    sampled = Request("s", [5], SamplingParams(temperature=0.5, max_tokens=4), max_tokens=4)
    assert Batch([Chunk(a, 0, 2, True), Chunk(b, 0, 2, True)], [], []).greedy
    assert not Batch([Chunk(a, 0, 2, True), Chunk(sampled, 0, 1, True)], [], []).greedy
    assert Batch([Chunk(a, 0, 2, True), Chunk(sampled, 0, 1, False)], [], []).greedy   # not sampled this step
    assert Batch([Chunk(b, 0, 2, True)], [], []).batch_class
    assert not Batch([Chunk(a, 0, 2, True), Chunk(b, 0, 2, True)], [], []).batch_class
    assert not Batch([], [], []).batch_class


def test_drafts_go_to_the_oldest_decode_rows_within_the_row_budget_never_to_a_processed_one() -> None:
    from services.engine.core.speculate import SpeculationConfig
    s = Scheduler(BlockManager(64, 4), speculation=SpeculationConfig(max_draft=3, max_rows=7), max_context=64)
    penalized = Request("penalized", [1, 2, 7, 9, 1, 2], SamplingParams(max_tokens=8, presence_penalty=1.0),
                        max_tokens=8)
    old, new = req("old", [5, 6, 7, 8, 5, 6]), req("new", [9, 8, 7, 9, 8])
    for r in (penalized, old, new):
        s.add(r)
    step(s)                                     # the prefills; each then ends in 7
    batch = s.schedule()                        # 4 spare rows: old takes 3, new the last one
    assert (penalized.draft, old.draft, new.draft) == ([], [8, 5, 6], [9])
    assert [c.draft for c in batch.chunks] == [0, 3, 1]
    near = Scheduler(BlockManager(64, 4), speculation=SpeculationConfig(max_draft=3, max_rows=4), max_context=9)
    end = req("end", [5, 6, 7, 8, 5, 6])
    near.add(end)
    step(near)
    near.schedule()                             # one draft and the token after it fill the context
    assert end.draft == [8]
