"""The router's flags for latency degradation and measured confidence (services/router/__main__.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.router.__main__ import parse
from services.router.config import RouterConfig
from services.router.failover import Evaluation

BASE = ["--engine", "e0=127.0.0.1:1", "--fallback", "m=m-int8:0.8"]


def test_defaults_leave_latency_degradation_off() -> None:
    config = parse(BASE)
    failover = config.failover()
    assert failover.latency.target_s is None and failover.evaluations == () and config.fallback_shadow_share == 0
    assert (failover.latency.window_s, failover.latency.min_samples, failover.latency.after_s,
            failover.latency.share, failover.latency.recover, failover.prior_samples) == (30.0, 20, 10.0, 0.3, 0.9,
                                                                                          20.0)


def test_flags_reach_the_failover_config(tmp_path: Path) -> None:
    evals = tmp_path / "eval.json"
    evals.write_text(json.dumps({"primary": "m", "fallback": "m-int8", "agreement": 0.91, "samples": 500}))
    config = parse([*BASE, "--latency-degrade-p95-ms", "1500", "--latency-degrade-window", "20",
                    "--latency-degrade-min-samples", "50", "--latency-degrade-after", "5",
                    "--latency-degrade-share", "0.25", "--latency-degrade-recover", "0.8",
                    "--fallback-eval", str(evals), "--fallback-shadow-share", "0.02",
                    "--confidence-prior-samples", "10"])
    f = config.failover()
    assert (f.latency.target_s, f.latency.window_s, f.latency.min_samples, f.latency.after_s, f.latency.share,
            f.latency.recover) == (1.5, 20.0, 50, 5.0, 0.25, 0.8)
    assert f.evaluations == (Evaluation("m", "m-int8", 0.91, 500),) and f.prior_samples == 10.0
    assert config.fallback_shadow_share == 0.02


@pytest.mark.parametrize("argv,message", [
    (["--latency-degrade-p95-ms", "500"], "needs a fallback chain"),
    ([*BASE, "--latency-degrade-p95-ms", "500", "--latency-degrade-share", "2"], "--latency-degrade-share"),
    ([*BASE, "--latency-degrade-p95-ms", "-5"], "--latency-degrade-p95-ms"),
    ([*BASE, "--fallback-shadow-share", "1.5"], "--fallback-shadow-share"),
    (["--engine", "e0=127.0.0.1:1", "--fallback-shadow-share", "0.1"], "needs --fallback"),
    ([*BASE, "--fallback-eval", "/nonexistent/eval.json"], "fallback evaluation file /nonexistent/eval.json"),
])
def test_bad_flags_exit_with_a_message_naming_them(argv: list[str], message: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    if "--engine" not in argv:
        argv = ["--engine", "e0=127.0.0.1:1", *argv]
    with pytest.raises(SystemExit) as exit_:
        parse(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_an_evaluation_of_a_pair_outside_the_chain_is_refused(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    evals = tmp_path / "eval.json"
    evals.write_text(json.dumps({"primary": "m", "fallback": "tiny", "agreement": 0.9, "samples": 50}))
    with pytest.raises(SystemExit):
        parse([*BASE, "--fallback-eval", str(evals)])
    assert "'tiny' is not in 'm''s fallback chain (m -> m-int8)" in capsys.readouterr().err


def test_the_config_checks_without_flags_too() -> None:
    with pytest.raises(ValueError, match="--fallback-shadow-share"):
        RouterConfig(tokenizer="t:1", engines=(), discovery="consul", fallbacks=(("m", "f", 0.8),),
                      fallback_shadow_share=-0.1)
