"""Finding 4 of issue 31: structured outputs let any caller spend an engine's memory and CPU on grammars.
Each compiled grammar cost ~16 MB and the cache kept 256 of them (~4 GB: 48 distinct 60-property schemas
grew one engine from 2.14 to 2.91 GB), every distinct constraint was compiled (~5 s of CPU each) with no
limit per tenant or in total, and nothing bounded one compile's time.

Now compiled grammars are kept within a byte budget (--grammar-cache-mb, least recently used out first, by
xgrammar's own memory_size_bytes); a cache miss is a compile, limited per tenant (the request's cache_salt,
--grammar-compile-rate) and across tenants (--grammar-compiles running, a short queue behind them), refused
with RESOURCE_EXHAUSTED and a retry-after; cache hits never count.  A compile runs in a child process that is
killed at --grammar-compile-timeout-s (INVALID_ARGUMENT naming the constraint), and that constraint is refused
at once from then on.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from pathlib import Path

import grpc
import pytest
from prometheus_client import REGISTRY

from mesh.constraints import Constraint
from mesh.errors import InvalidArgument, ResourceExhausted
from mesh.models import eos_token_ids
from mesh.ratelimit import Rate
from services.engine.config import EngineConfig
from services.engine.runtime.grammar import Grammars
from services.engine.runtime.grammar_limits import CompileGate, CompileRefused, GrammarCache, GrammarLimits


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def schema(name: str, properties: int = 2) -> Constraint:
    props = {f"{name}_{i}": {"type": "string", "maxLength": 20} for i in range(properties)}
    return Constraint("json_schema", json.dumps({"title": name, "type": "object", "properties": props,
                                                 "required": list(props), "additionalProperties": False}))


def heavy(name: str = "Heavy0") -> Constraint:
    """60 properties, each with its own pattern: ~3.6 s and ~19 MB compiled on the 2-core test box."""
    props = {f"f{i}": {"type": "string", "pattern": f"^[A-Z][a-z]{{2,{20 + i}}}-[0-9]{{1,{1 + i % 5}}}$"}
             for i in range(60)}
    return Constraint("json_schema", json.dumps({"title": name, "type": "object", "properties": props,
                                                 "required": list(props), "additionalProperties": False}))


OPEN_BRACE = 107                  # "{" in SmolLM2's vocabulary


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# -- the pure parts -------------------------------------------------------------------------------------

def test_the_cache_is_bounded_by_bytes_and_evicts_the_least_recently_used() -> None:
    cache = GrammarCache(100)
    assert cache.put("a", "A", 40) and cache.put("b", "B", 40)
    assert cache.get("a") == "A"                      # a is now the most recently used
    assert cache.put("c", "C", 40)                    # 120 > 100: b goes, not a
    assert cache.keys() == ["a", "c"] and cache.bytes == 80 and cache.evictions == 1
    assert cache.get("b") is None
    assert cache.put("d", "D", 90)                    # room for d alone: both others go, oldest first
    assert cache.keys() == ["d"] and cache.bytes == 90 and cache.evictions == 3


def test_a_grammar_larger_than_the_whole_budget_is_not_kept_and_evicts_nothing() -> None:
    cache = GrammarCache(100)
    cache.put("a", "A", 60)
    assert not cache.put("huge", "H", 101)
    assert cache.keys() == ["a"] and cache.bytes == 60 and cache.get("huge") is None


def test_compiles_are_limited_per_tenant_on_a_fake_clock() -> None:
    gate = CompileGate(GrammarLimits(compile_rate=Rate(2, 60), compiles=4))
    for now in (0.0, 1.0):
        gate.enter(b"tenant-a", now)
        gate.leave()
    with pytest.raises(CompileRefused) as refused:
        gate.enter(b"tenant-a", 2.0)
    assert refused.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED and refused.value.reason == "rate_limited"
    assert 27 <= refused.value.retry_after_s <= 29          # one compile back every 30 s
    assert "--grammar-compile-rate" in refused.value.message and "2/m" in refused.value.message
    gate.enter(b"tenant-b", 2.0)                             # another tenant has its own bucket
    gate.leave()
    gate.enter(b"tenant-a", 31.0)                            # and tenant a's refills
    gate.leave()


def test_compiles_running_at_once_are_limited_across_tenants_with_a_short_queue() -> None:
    gate = CompileGate(GrammarLimits(compile_rate=Rate(1, 60), compiles=1, queue=1))
    assert gate.enter(b"a", 0.0) is True                     # runs now
    assert gate.enter(b"b", 0.0) is False                    # waits for the slot
    with pytest.raises(CompileRefused) as refused:
        gate.enter(b"c", 0.0)                                # the queue is full too
    assert refused.value.reason == "busy" and refused.value.retry_after_s >= 1
    assert "--grammar-compiles 1" in refused.value.message
    assert not gate.start()                                  # a still runs
    busy = gate.give_up(b"b", 0.0)                           # b waited a compile's time limit in vain
    assert busy.reason == "busy" and (gate.running, gate.waiting) == (1, 0)
    gate.leave()
    assert gate.enter(b"b", 0.0) is True                     # b's one compile a minute was given back ...
    gate.leave()
    assert gate.enter(b"c", 0.0) is True                     # ... and c's was never spent
    assert gate.enter(b"d", 0.0) is False
    gate.leave()
    assert gate.start() and (gate.running, gate.waiting) == (1, 0)    # d takes the freed slot


def test_refused_constraints_are_remembered_within_a_bound() -> None:
    gate = CompileGate(GrammarLimits(remembered=2))
    for key in (b"k1", b"k2", b"k3"):
        gate.remember(key, f"{key!r} was too slow")
    assert gate.refusal(b"k1") is None                       # the oldest went
    assert gate.refusal(b"k3") == "b'k3' was too slow"


def test_the_engine_flags_and_the_default_budget() -> None:
    from services.engine.__main__ import parse

    config = parse(["--kv-cache-mb", "2048"])
    assert config.grammar_compile_rate == Rate(20, 60) and config.grammar_compiles == 1
    assert config.grammar_compile_timeout_s == 10.0
    assert config.grammar_cache_bytes == 256 << 20            # an eighth of the KV budget ...
    assert EngineConfig(model_path="m", kv_cache_mb=16).grammar_cache_bytes == 64 << 20       # ... a floor
    assert EngineConfig(model_path="m", kv_cache_mb=100_000).grammar_cache_bytes == 512 << 20  # ... a ceiling
    config = parse(["--grammar-cache-mb", "32", "--grammar-compile-rate", "5/s", "--grammar-compiles", "2",
                    "--grammar-compile-timeout-s", "2.5"])
    assert (config.grammar_cache_bytes, config.grammar_compile_rate, config.grammar_compiles,
            config.grammar_compile_timeout_s) == (32 << 20, Rate(5, 1), 2, 2.5)
    assert parse(["--grammar-compile-rate", "0"]).grammar_compile_rate is None
    for bad in (["--grammar-compile-rate", "fast"], ["--grammar-compiles", "0"],
                ["--grammar-compile-timeout-s", "0"]):
        with pytest.raises(SystemExit):
            parse(bad)


# -- the real engine's Grammars, on the default model's tokenizer -----------------------------------------

def grammars(model_dir: Path, clock: Clock | None = None, **limits: object) -> Grammars:
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    return Grammars(model_dir, vocab_size, eos_token_ids(model_dir), GrammarLimits(**limits),  # type: ignore[arg-type]
                    clock=clock or time.monotonic)


def test_real_grammars_are_kept_by_their_memory_size(model_dir: Path) -> None:
    a, b, c = schema("alpha"), schema("bravo"), schema("charlie")
    probe = grammars(model_dir, cache_bytes=1 << 30)
    sizes = {k: probe.compile(k).memory_size_bytes for k in (a, b, c)}
    assert probe.cache.bytes == sum(sizes.values()) and all(s > 10_000 for s in sizes.values())

    g = grammars(model_dir, cache_bytes=sum(sizes.values()) - 1)   # all three do not fit
    for k in (a, b, a, c):                                         # a used again after b: b is the oldest
        g.compile(k)
    assert (g.compiles, g.hits) == (3, 1)
    assert g.cache.bytes == sizes[a] + sizes[c] <= g.cache.budget
    g.compile(a)
    g.compile(b)                                                   # compiled again
    assert (g.compiles, g.hits) == (4, 2)

    tiny = grammars(model_dir, cache_bytes=1)                      # smaller than any grammar
    m = tiny.matcher(schema("delta"))                              # still usable by its request ...
    assert m.accept(OPEN_BRACE) and not m.accept(OPEN_BRACE)
    tiny.compile(schema("delta"))
    assert tiny.cache.bytes == 0 and tiny.compiles == 2            # ... but not kept


def test_real_compiles_are_limited_per_tenant_and_hits_never_count(model_dir: Path) -> None:
    clock = Clock()
    g = grammars(model_dir, clock, compile_rate=Rate(2, 60))
    g.compile(schema("one"), b"acme")
    g.compile(schema("two"), b"acme")
    for _ in range(5):
        g.compile(schema("one"), b"acme")                          # cache hits: free
    with pytest.raises(ResourceExhausted, match="--grammar-compile-rate") as refused:
        g.compile(schema("three"), b"acme")
    assert refused.value.retry_after_s == 30
    g.compile(schema("three"), b"globex")                          # another tenant
    g.compile(schema("three"), b"acme")                            # now a hit for acme too
    clock.now += 30
    g.compile(schema("four"), b"acme")
    assert (g.compiles, g.hits) == (4, 6)


def compile_at_once(g: Grammars, names: list[str]) -> list[BaseException]:
    """Compile a schema per name, each in its own thread, all at once; what was raised."""
    raised: list[BaseException] = []

    def compile_one(name: str) -> None:
        try:
            g.compile(schema(name), b"acme")
        except BaseException as exc:
            raised.append(exc)

    threads = [threading.Thread(target=compile_one, args=(name,)) for name in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return raised


def test_a_burst_of_new_schemas_waits_its_turn_instead_of_being_refused(model_dir: Path) -> None:
    """An application's first requests: 6 distinct schemas at once, one compile at a time."""
    g = grammars(model_dir, compiles=1)
    refused = compile_at_once(g, [f"burst{i}" for i in range(6)])
    assert not refused and g.compiles == 6 and g.cached_matcher(schema("burst3")) is not None


def test_a_start_that_ends_while_a_compile_waits_leaves_it_a_whole_compile_limit(
        model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first compile starts the compiler process (importing xgrammar: seconds); a compile waiting behind it is
    refused only after one compile limit of compiling ahead, which the start is not: here a start of nearly two
    limits, which ends just before the waiter's second wake while its compile runs past it (the waiter was
    refused then, at 5 s: the start had ended, and the limit was counted from when it last saw it running).  The
    start and the compile are timed by sleeps; the compile itself is real."""
    from services.engine.runtime import grammar as grammar_mod

    g = grammars(model_dir, compile_timeout_s=2.5, compiles=1)
    real = grammar_mod.CompileWorker(g._tokenizer_info().serialize_json())   # started before the clock runs

    class SlowStart:                   # starts in 4.8 s: the waiter wakes at 2.5 s (starting) and at 5 s (not)
        def __init__(self, _info: str) -> None:
            time.sleep(4.8)

        pid, alive = real.pid, property(lambda self: real.alive)

        def compile(self, c: Constraint, timeout_s: float) -> str:
            time.sleep(0.5)            # a compile that runs past the waiter's 5 s wake
            return real.compile(c, timeout_s)

        def kill(self) -> None:
            real.kill()

    monkeypatch.setattr(grammar_mod, "CompileWorker", SlowStart)
    try:
        refused = compile_at_once(g, ["late0", "late1"])
    finally:
        g.close()                      # the idle pool is the process's, shared by the tests that follow
        real.kill()
    assert not refused and g.compiles == 2


def test_a_slow_compile_is_stopped_refused_by_name_and_refused_at_once_after(model_dir: Path) -> None:
    g = grammars(model_dir, compile_timeout_s=0.5, compiles=1, queue=0)
    g.compile(schema("warm"))                                      # the compiler process is up
    [pid] = g.worker_pids
    outcome: list[BaseException] = []

    def slow() -> None:
        try:
            g.compile(heavy(), b"acme")
        except BaseException as exc:
            outcome.append(exc)

    started = time.monotonic()
    thread = threading.Thread(target=slow)
    thread.start()
    while not g.compiling and thread.is_alive():
        time.sleep(0.01)
    with pytest.raises(ResourceExhausted, match="--grammar-compiles 1") as busy:
        g.compile(schema("other"), b"globex")                      # the one compile slot is taken
    assert busy.value.retry_after_s >= 1
    thread.join()
    elapsed = time.monotonic() - started
    [exc] = outcome
    assert isinstance(exc, InvalidArgument) and not isinstance(exc, ResourceExhausted)
    assert "json_schema" in exc.message and "Heavy0" in exc.message and "--grammar-compile-timeout-s" in exc.message
    assert elapsed < 2.5, elapsed                                  # stopped near 0.5 s, not after ~3.6 s
    assert not alive(pid), "the compile's process must be gone: its CPU stopped"
    started = time.monotonic()
    with pytest.raises(InvalidArgument, match="Heavy0"):
        g.compile(heavy(), b"globex")                              # known too slow: no second compile
    assert time.monotonic() - started < 0.1
    compiles = g.compiles
    g.compile(schema("other"), b"globex")                          # a fresh process takes the next compile
    assert g.compiles == compiles + 1


def test_the_engine_answers_resource_exhausted_with_retry_after_and_counts_it(model_dir: Path) -> None:
    from mesh.grpcutil import Service, caller_limit, channel
    from meshpb.v1 import common_pb2, engine_pb2, engine_pb2_grpc
    from services.engine.engine import Engine
    from services.engine.rpcs import server as engine_server
    from services.engine.runtime.model_runner import ModelRunner
    from services.engine.runtime.plan import decide

    runner = ModelRunner(model_dir, decide(device="cpu", dtype="float32"), kv_cache_bytes=8 << 20, block_size=16)
    engine = Engine(runner, grammar_limits=GrammarLimits(compile_rate=Rate(1, 60)))

    def generate(rid: str, regex: str) -> engine_pb2.GenerateRequest:
        return engine_pb2.GenerateRequest(
            request_id=rid, prompt_ids=[1, 2, 3], cache_salt=b"acme", sampling=common_pb2.SamplingParams(
                max_tokens=2, constraint=common_pb2.Constraint(regex=regex)))

    def counted(grammar: str) -> float:        # constrained requests with this grammar outcome
        return REGISTRY.get_sample_value("infermesh_engine_constrained_requests_total",
                                         {"replica": "engine-g", "grammar": grammar}) or 0.0

    async def main() -> None:
        servicer = engine_server.EngineServicer(engine, EngineConfig(model_path=str(model_dir), replica_id="engine-g"))
        service = Service("meshpb.v1.Engine", "127.0.0.1", 0)
        engine_server.add_to(service, servicer)
        await service.start()
        servicer.start()
        ch = channel(f"127.0.0.1:{service.port}")
        try:
            stub = engine_pb2_grpc.EngineStub(ch)
            outs = [o async for o in stub.Generate(generate("first", "[a-z]+"))]
            assert outs[-1].finish_reason
            hits = counted("cached")
            outs = [o async for o in stub.Generate(generate("again", "[a-z]+"))]      # a hit: no compile
            assert outs[-1].finish_reason and counted("cached") == hits + 1
            before = counted("rate_limited")
            call = stub.Generate(generate("second", "[0-9]+"))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                [o async for o in call]
            assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--grammar-compile-rate" in (err.value.details() or "")
            retry_after = dict(err.value.trailing_metadata() or ()).get("retry-after")
            assert retry_after is not None and 30 < int(retry_after) <= 60      # one compile a minute
            assert caller_limit(err.value)        # the tenant's own limit: the router relays it, no failover
            assert counted("rate_limited") == before + 1
        finally:
            await ch.close()
            await servicer.close()
            await service.stop(0)

    asyncio.run(main())


def test_the_router_relays_a_tenants_compile_limit_with_its_retry_after_and_no_failover() -> None:
    """An engine's RESOURCE_EXHAUSTED about the tenant's own compile rate is that tenant's answer: the router
    neither tries the other replica (it would compile there too) nor counts it against the replica."""
    from mesh.grpcutil import CALLER_LIMIT
    from tests.fakes.router_mesh import FakeEngine, chat, collect, running

    class RateLimited(FakeEngine):
        async def Generate(self, request, context):  # type: ignore[no-untyped-def, override]
            self.script.calls.append((self.replica_id, request))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many new constraints (--grammar-compile-rate)",
                                trailing_metadata=(("retry-after", "42"), CALLER_LIMIT))
            yield  # pragma: no cover - an async generator that aborts

    async def scenario() -> None:
        async with running(engine=RateLimited) as mesh:
            for _ in range(3):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await collect(mesh, chat(("user", "hi")))
                assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "--grammar-compile-rate" in (err.value.details() or "")
                assert ("retry-after", "42") in tuple(err.value.trailing_metadata() or ())
            assert len(mesh.script.calls) == 3                          # one engine call a request
            failover = mesh.servicer.failover
            assert all(failover.isolation(r.replica_id) is None for r in mesh.servicer.table.all())
            breakers = [failover.replica_breaker(r.replica_id) for r in mesh.servicer.table.all()]
            assert all(b._consecutive == 0 and not b.opened for b in breakers)     # no failure recorded

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_a_model_without_an_end_of_sequence_id_still_compiles(model_dir: Path) -> None:
    """generation_config's eos_token_id: [] (a model that never ends by itself): xgrammar refuses an empty
    stop list, so the tokenizer's own end token stands in (a regex constraint failed as INTERNAL before)."""
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    g = Grammars(model_dir, vocab_size, (), GrammarLimits())
    try:
        assert g.compile(Constraint("regex", "[a-z]{4,12}")).memory_size_bytes > 0
    finally:
        g.close()
