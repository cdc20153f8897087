"""Fair scheduling between tenants inside the engine (services/engine/core/fairness.py, scheduler.py).

Exact orders and token counts, stepped with tests/fakes/model.py (whose outputs change if a
block is shared, evicted or reused wrongly, so a paused or preempted request that resumed wrongly
would show it).
"""

from __future__ import annotations

import pytest

from services.engine.core.block_manager import BlockManager
from services.engine.core.fairness import StepTimes, TenantClocks, check_weight, row_cap
from services.engine.core.request import Request, RequestStatus, SamplingParams
from services.engine.core.scheduler import Batch, Chunk, Scheduler, SchedulerConfig
from services.engine.stats import EngineStats
from tests.fakes.model import FakeModel
from tests.unit.test_scheduler import reference


def req(rid: str, tenant: str, prompt: list[int], max_tokens: int = 8, weight: float = 1.0,
        priority: int = 0) -> Request:
    r = Request(rid, prompt_ids=list(prompt), sampling=SamplingParams(max_tokens=max_tokens), max_tokens=max_tokens)
    r.tenant, r.weight, r.priority = tenant, weight, priority
    return r


def sched(num_blocks: int = 64, block_size: int = 4, **config: object) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size), SchedulerConfig(**config))  # type: ignore[arg-type]


def rows(batch: Batch) -> list[str]:
    return [c.request.request_id for c in batch.chunks]


# -- virtual time ----------------------------------------------------------------------
def test_virtual_time_is_tokens_over_weight_and_an_idle_tenant_banks_no_credit() -> None:
    clocks = TenantClocks()
    clocks.arrive("a", 1.0)
    clocks.charge("a", 30)
    clocks.arrive("b", 3.0)                    # joins at the lowest active time: a's 30
    assert clocks.vtime == {"a": 30.0, "b": 30.0}
    clocks.charge("b", 30)
    assert clocks.vtime["b"] == 40.0           # 30 tokens at weight 3
    clocks.leave("b")                          # idle, but ahead of a: remembered
    assert clocks.vtime["b"] == 40.0
    clocks.charge("a", 100)
    clocks.leave("a")                          # nobody active: the floor stays at 130 when c comes
    clocks.arrive("c", 1.0)
    assert clocks.vtime["c"] == 130.0
    clocks.arrive("b", 3.0)                    # b's 40 is behind the floor: it starts at 130 too
    assert clocks.vtime["b"] == 130.0
    clocks.leave("b")
    clocks.leave("c")
    assert set(clocks.vtime) == set()          # idle tenants at or behind the floor are forgotten


def test_keep_up_raises_the_tenants_whose_work_all_ran_to_the_lowest_backlogged_time() -> None:
    clocks = TenantClocks()
    for tenant in "abcd":
        clocks.arrive(tenant, 1.0)
    for tenant, tokens in (("a", 50), ("b", 20), ("c", 5), ("d", 90)):
        clocks.charge(tenant, tokens)
    clocks.keep_up({"a", "d"})                 # a and d had requests waiting; b and c ran all they asked
    assert clocks.vtime == {"a": 50.0, "b": 50.0, "c": 50.0, "d": 90.0}
    clocks.keep_up(set())                      # nobody waited: nothing to keep up with
    assert clocks.vtime == {"a": 50.0, "b": 50.0, "c": 50.0, "d": 90.0}


@pytest.mark.parametrize("weight", [0.0, -1.0, 1000.5])
def test_a_weight_out_of_range_is_refused(weight: float) -> None:
    with pytest.raises(ValueError, match="weight"):
        check_weight(weight)


# -- rows between tenants -------------------------------------------------------------
def flood(s: Scheduler, tenant: str, n: int, max_tokens: int = 50, weight: float = 1.0,
          priority: int = 0) -> list[Request]:
    rs = [req(f"{tenant}{i}", tenant, [i + 1], max_tokens, weight, priority) for i in range(n)]
    for r in rs:
        s.add(r)
    return rs


def test_a_second_tenants_request_takes_a_row_at_once_and_the_flooders_streams_take_turns() -> None:
    s = sched(max_running=4)
    model = FakeModel(s)
    a = flood(s, "A", 8)
    model.step()
    model.step()
    assert rows(model.step()) == ["A0", "A1", "A2", "A3"]        # A's four oldest: first come first served
    b = req("B0", "B", [9], max_tokens=3)
    s.add(b)
    batch = model.step()
    assert rows(batch) == ["A0", "B0", "A1", "A2"]               # B joins at A's time: a row at once
    assert (a[3].status, len(a[3].table.blocks)) == (RequestStatus.RUNNING, 1)   # paused, KV kept
    assert batch.preempted == [] and batch.paused == 1
    # B (1 token a step) stays below A's time; A's streams share the other rows, least recently served first.
    assert rows(model.step()) == ["B0", "A3", "A0", "A1"]
    assert rows(model.step()) == ["B0", "A2", "A0", "A1"]        # B's third and last token
    assert rows(model.step()) == ["A3", "A0", "A1", "A2"]
    assert a[4].status is RequestStatus.WAITING                  # never admitted while A's own streams wait


def test_a_stream_left_out_too_long_goes_first_whatever_the_weights() -> None:
    s = sched(num_blocks=256, max_running=2, max_paused_steps=5)
    model = FakeModel(s)
    light = flood(s, "light", 1, max_tokens=100, weight=0.001)
    model.step()                                                 # light's stream runs alone, then heavy floods
    flood(s, "heavy", 4, max_tokens=100, weight=1000.0)
    served = [light[0].request_id in rows(model.step()) for _ in range(30)]
    assert served == ([True] + [False] * 5) * 5                  # one row in every 6 steps: 5 left out at most


def test_without_fairness_the_same_request_waits_behind_the_flood() -> None:
    s = sched(max_running=4, fair=False)
    model = FakeModel(s)
    flood(s, "A", 8, max_tokens=5)
    model.step()
    b = req("B0", "B", [9], max_tokens=3)
    s.add(b)
    steps = 1
    while b.num_computed == 0:
        model.step()
        steps += 1
    assert steps == 11          # A0-A3 run their 5 tokens (steps 1-5), then A4-A7 (6-10): only then B


def test_weights_split_the_tokens_exactly_while_both_tenants_saturate() -> None:
    s = sched(num_blocks=256, max_running=8)
    model = FakeModel(s)
    flood(s, "premium", 12, max_tokens=200, weight=3.0)
    flood(s, "free", 12, max_tokens=200, weight=1.0)
    served = {"premium": 0, "free": 0}
    for _ in range(100):
        for c in model.step().chunks:
            served[c.request.tenant] += c.num_tokens
    assert served == {"premium": 600, "free": 200}


def test_a_tenant_below_its_share_banks_no_credit_for_a_later_burst() -> None:
    s = sched(num_blocks=512, max_running=4)
    model = FakeModel(s)
    flood(s, "H", 8, max_tokens=500)
    flood(s, "L", 1, max_tokens=500)
    for _ in range(40):                  # L's one stream runs every step: 1 token of 4 a step, below its half
        model.step()
    for i in range(8):                   # then L bursts: from here on the two split the rows
        s.add(req(f"Lb{i}", "L", [50 + i], max_tokens=500))
    served = {"H": 0, "L": 0}
    for _ in range(20):
        for c in model.step().chunks:
            served[c.request.tenant] += c.num_tokens
    assert served == {"H": 39, "L": 41}  # without keep_up, L's clock 80 behind H's: L 80, H 0 (starved)


def test_paused_and_resumed_requests_generate_what_they_would_alone() -> None:
    s = sched(num_blocks=40, max_running=3)
    model = FakeModel(s)
    rs = [req(f"a{i}", "A", [i + 1, 2 * i + 3, 5], 9) for i in range(5)]
    rs += [req(f"b{i}", "B", [7, i + 2], 6, weight=2.0) for i in range(3)]
    rs += [req(f"c{i}", "C", [4 + i], 7, priority=1) for i in range(2)]
    for r in rs:
        s.add(r)
    for _ in range(200):
        if not s.has_work():
            break
        model.step()
    assert {r.request_id: r.output_ids for r in rs} == reference(rs)


# -- classes ---------------------------------------------------------------------------
def test_an_interactive_request_takes_a_batch_requests_row_which_keeps_its_blocks() -> None:
    s = sched(max_running=2)
    model = FakeModel(s)
    flood(s, "jobs", 2, max_tokens=10, priority=1)
    model.step()
    chat = req("chat", "jobs", [5], max_tokens=3)                # the same tenant, interactive
    s.add(chat)
    assert rows(model.step()) == ["chat"]                        # its prefill: no batch rows in that step
    batch = model.step()
    assert rows(batch) == ["chat", "jobs0"] and batch.paused == 1
    assert s.running[1].request_id == "jobs1" and s.running[1].table.blocks    # paused with its KV


def test_an_interactive_request_preempts_batch_work_for_blocks_and_the_batch_text_is_unchanged() -> None:
    s = sched(num_blocks=4, block_size=2, max_running=4)
    model = FakeModel(s)
    jobs = flood(s, "jobs", 2, max_tokens=4, priority=1)
    for j, prompt in zip(jobs, ([1, 2, 3], [4, 5, 6]), strict=True):
        j.prompt_ids[:] = j.all_ids[:] = prompt
    model.step()                                                 # both hold 2 of the 4 blocks
    chat = req("chat", "user", [7, 8], max_tokens=2)
    s.add(chat)
    batch = model.step()
    assert batch.preempted == [jobs[1]]                          # the newest batch request gives way
    assert rows(batch) == ["chat"]
    while s.has_work():
        model.step()
    assert {r.request_id: r.output_ids for r in [*jobs, chat]} == reference([*jobs, chat])
    assert jobs[1].num_preemptions == 1


# -- the row cap for light tenants (fairness.row_cap) --------------------------------------
def timed(**seconds: float) -> StepTimes:
    """StepTimes measured as given: rows -> seconds (keys r1, r4, ...)."""
    times = StepTimes()
    for rows_, s in seconds.items():
        times.record(int(rows_[1:]), s)
    return times


def test_step_times_average_per_row_count_and_interpolate_between_them() -> None:
    times = timed(r1=0.010, r4=0.016, r8=0.040)
    times.record(8, 0.020)                                       # averaged: 0.040 + 0.1 * (0.020 - 0.040)
    assert times.predict(8) == pytest.approx(0.038)
    times.record(1, 1.0)                                         # a pause: counted as 3x the average
    assert times.predict(1) == pytest.approx(0.010 + 0.1 * (0.030 - 0.010))
    assert times.predict(2) == pytest.approx(0.012 + (0.016 - 0.012) / 3)
    assert times.predict(6) == pytest.approx(0.016 + (0.038 - 0.016) / 2)
    assert times.predict(16) == pytest.approx(0.038)             # above the largest: its time, a lower bound
    assert timed(r4=0.016).predict(2) is None                    # below every measured row count: unknown
    assert timed(r1=0.030, r4=0.016, r8=0.040).predict(6) == pytest.approx(0.028)   # neighbours only


def test_the_cap_keeps_a_light_tenants_steps_within_slowdown_times_its_share() -> None:
    # Steps of n rows take 5 + 2n ms; B's single stream alone takes 7 ms steps; its share is half the engine,
    # so at slowdown 1.5 the steps may last 1.5 * 7 / 0.5 = 21 ms: 8 rows.
    times = timed(**{f"r{n}": (5 + 2 * n) / 1000 for n in range(1, 17)})
    weights = {"A": 1.0, "B": 1.0}
    assert row_cap(16, {"A": 48, "B": 1}, weights, times, 1.5) == 8
    assert row_cap(16, {"A": 48, "B": 1}, weights, times, 3.0) == 16                # 42 ms allowed
    assert row_cap(16, {"A": 48, "B": 1}, {"A": 1.0, "B": 3.0}, times, 1.5) == 4    # share 3/4: 14 ms
    assert row_cap(16, {"A": 48, "B": 1}, weights, times, 0) == 16                  # 0: no cap
    assert row_cap(16, {"A": 48}, {"A": 1.0}, times, 1.5) == 16                     # one tenant: nobody to shield
    assert row_cap(16, {"A": 8, "B": 8}, weights, times, 1.5) == 16                 # T(16) <= 3 * T(8)
    # Three light tenants of one row and a heavy one: each light one's share is a quarter; the cap leaves the
    # heavy tenant a row even where the bound (1.5 * 7 / 0.25 = 42 ms) would allow fewer rows than that.
    assert row_cap(16, {"A": 48, "B": 1, "C": 1, "D": 1}, dict.fromkeys("ABCD", 1.0), times, 1.5) == 16
    assert row_cap(4, {"A": 48, "B": 1, "C": 1, "D": 1}, dict.fromkeys("ABCD", 1.0), timed(r1=0.001, r4=1.0),
                   1.5) == 4


def test_the_cap_needs_the_light_tenants_step_time_and_interpolates_the_others() -> None:
    assert row_cap(16, {"A": 48, "B": 1}, {"A": 1.0, "B": 1.0}, timed(r16=0.037), 1.5) == 16   # T(1) unknown
    # Only 1 and 16 rows timed: 15..2 interpolate (7 + 2(n - 1) ms), so the cap is 8 rows as above.
    assert row_cap(16, {"A": 48, "B": 1}, {"A": 1.0, "B": 1.0}, timed(r1=0.007, r16=0.037), 1.5) == 8
    # B's 4 streams: T(4) = 13 ms, so steps up to 39 ms are allowed: all 16 rows.
    assert row_cap(16, {"A": 48, "B": 4}, {"A": 1.0, "B": 1.0}, timed(r4=0.013, r12=0.029, r16=0.037), 1.5) == 16
    # B's 2 streams: 4 ms alone, 12 ms allowed; 2.5 ms a row between the 2 and 12 rows timed: 5 rows (11.5 ms).
    assert row_cap(16, {"A": 48, "B": 2}, {"A": 1.0, "B": 1.0}, timed(r2=0.004, r12=0.029, r16=0.037), 1.5) == 5


def test_a_capped_step_takes_the_light_tenants_row_and_fewer_of_the_floods() -> None:
    s = sched(num_blocks=256, max_running=8, fair_slowdown=1.5)
    for n in range(1, 9):
        s.step_times.record(n, (5 + 2 * n) / 1000)        # B's bound: 1.5 * 7 ms / 0.5 = 21 ms: 8 rows
    model = FakeModel(s)
    flood(s, "A", 12)
    assert rows(model.step()) == [f"A{i}" for i in range(8)]       # A alone: every row
    s.add(req("B0", "B", [9], max_tokens=4))
    s.step_times.seconds[8] = 0.030                                  # now 8 rows take 30 ms: 7 rows (19 ms) fit
    batch = model.step()
    assert rows(batch) == ["A0", "B0", "A1", "A2", "A3", "A4", "A5"] and batch.capped
    assert rows(model.step()) == ["B0", "A6", "A7", "A0", "A1", "A2", "A3"]
    s.config = SchedulerConfig(max_running=8, fair_slowdown=0)     # the cap off: all 8 rows again
    assert len(rows(model.step())) == 8


def test_batch_class_work_holds_a_share_and_keeps_a_row_under_the_cap() -> None:
    times = timed(**{f"r{n}": (5 + 2 * n) / 1000 for n in range(1, 17)})
    # B interactive, D's flood batch-class only (no interactive demand): D's weight still counts, B's share is half.
    assert row_cap(16, {"B": 1}, {"B": 1.0, "D": 1.0}, times, 1.5) == 8
    assert row_cap(16, {"B": 1}, {"B": 1.0, "D": 1.0}, timed(r1=0.007, r2=1.0), 1.5) == 2      # D keeps a row


def test_the_engine_times_steps_of_decode_rows_only() -> None:
    stats = EngineStats()
    a, b = req("a", "A", [1, 2, 3]), req("b", "B", [4])
    for chunks in ([Chunk(a, 0, 3, True)], [Chunk(a, 3, 1, True), Chunk(b, 1, 1, True)], [Chunk(a, 4, 3, True, 2)]):
        with stats.step(Batch(chunks, [], [])):
            pass
    assert list(stats.step_times.seconds) == [2]        # a prefill chunk, or a row with a draft: not timed
    with pytest.raises(RuntimeError), stats.step(Batch([Chunk(a, 4, 1, True)], [], [])):
        raise RuntimeError("the model failed")          # a step that raised (or gave way) is not timed either
    assert list(stats.step_times.seconds) == [2]
