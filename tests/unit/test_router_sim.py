"""bench/router_sim.py (the real engine Scheduler and BlockManager in simulated time, the router's real
policies): a quick run completes, repeats itself for a seed, and loses nothing."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from mesh.prefix import block_hashes

ROOT = Path(__file__).resolve().parents[2]
POLICIES = ("round_robin", "balancing+prefix+session")


@pytest.fixture(scope="module")
def sim() -> ModuleType:
    spec = importlib.util.spec_from_file_location("router_sim", ROOT / "bench" / "router_sim.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["router_sim"] = module      # dataclasses resolve their annotations through it
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def quick(sim: ModuleType) -> tuple[object, list, list]:
    cfg = sim.SimConfig(seed=3, sessions=60)
    rate, results = sim.run(cfg, POLICIES)
    return cfg, sim.workload(cfg, rate), results


def test_a_quick_run_serves_every_request_and_every_token(quick: tuple) -> None:
    cfg, sessions, results = quick
    turns = [t for s in sessions for t in s.turns]
    for r in results:
        assert r.requests == len(turns) == len(r.finish_s) == len(r.latency_s)
        assert r.output_tokens == sum(t.out_len for t in turns)
        assert r.prompt_tokens == sum(t.prompt_len for t in turns)
        assert 0 <= r.cached_tokens <= r.prompt_tokens
        assert sum(r.reasons.values()) == r.requests
        assert all(0 <= ttft <= lat for ttft, lat in zip(r.ttft_s, r.latency_s, strict=True))
        assert 0.0 <= r.entropy <= 1.0 and 0.0 < r.busy <= 1.0


def test_the_same_seed_gives_the_same_results(sim: ModuleType, quick: tuple) -> None:
    cfg, _, results = quick
    _, again = sim.run(cfg, POLICIES)
    assert again == results
    _, other = sim.run(sim.SimConfig(seed=4, sessions=60), POLICIES[:1])
    assert other[0] != results[0]


def test_sessions_extend_their_previous_turn(quick: tuple) -> None:
    cfg, sessions, _ = quick
    multi = next(s for s in sessions if len(s.turns) > 1)
    first, second = multi.turns[:2]
    history = block_hashes(multi.tokens[:first.prompt_len + first.out_len], cfg.block_size)   # answer included
    assert second.prompt_hashes[:len(history)] == tuple(history)
    assert first.prompt_hashes == tuple(block_hashes(multi.tokens[:first.prompt_len], cfg.block_size))
    assert second.prompt_len > first.prompt_len + first.out_len


def test_quick_prints_the_table_and_plots(sim: ModuleType, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    png = tmp_path / "sim.png"
    assert sim.main(["--quick", "--policies", "round_robin;balancing+prefix", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "| round_robin |" in out and "| balancing+prefix |" in out and "issue target" in out
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "plot skipped" in out
    else:
        assert png.stat().st_size > 10_000
