"""A degraded answer's confidence from measured agreement (services/router/failover/agreement.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.router.failover import (
    Agreement,
    Evaluation,
    Failover,
    FailoverConfig,
    FallbackChain,
    load_evaluations,
    posterior,
)
from services.router.replicas import Replica

FULL, INT8, TINY = "m", "m-int8", "tiny"
CHAIN = {FULL: (INT8, 0.8), INT8: (TINY, 0.5)}


def agreement(*evaluations: Evaluation, live: dict[tuple[str, str], tuple[int, int]] | None = None) -> Agreement:
    a = Agreement(FallbackChain(CHAIN), evaluations, prior_samples=20)
    if live is not None:
        a.live = lambda p, f: live.get((p, f), (0, 0))
    return a


def test_the_posterior_mean_with_the_configured_confidence_as_prior() -> None:
    assert posterior(0.8, 0, 0, 20) == 0.8
    assert posterior(0.8, 3, 3, 20) == pytest.approx(19 / 23)          # 3 of 3 is not a confidence of 1
    assert posterior(0.8, 455, 500, 20) == pytest.approx((16 + 455) / 520)
    assert posterior(0.8, 5000, 10_000, 20) == pytest.approx(0.5, abs=0.002)   # evidence wins


def test_nothing_measured_is_the_configured_confidence() -> None:
    a = agreement()
    assert a.estimate(FULL, 0) == (1.0, "", 0.0, 0.0)
    assert a.estimate(FULL, 1) == (0.8, "configured", 0.0, 0.0)
    assert a.estimate(FULL, 2).confidence == pytest.approx(0.4) and a.estimate(FULL, 2).source == "configured"


def test_offline_and_shadow_evidence_add_up() -> None:
    a = agreement(Evaluation(FULL, INT8, 0.91, 500))
    assert a.estimate(FULL, 1).confidence == pytest.approx((16 + 455) / 520)
    assert a.estimate(FULL, 1).source == "offline"
    both = agreement(Evaluation(FULL, INT8, 0.91, 500), live={(FULL, INT8): (40, 80)})
    est = both.estimate(FULL, 1)
    assert (est.source, est.agreed, est.compared) == ("offline+shadow", pytest.approx(495), 580)
    assert est.confidence == pytest.approx((16 + 495) / 600)
    shadow = agreement(live={(FULL, INT8): (9, 10)})
    assert shadow.estimate(FULL, 1).source == "shadow"
    assert shadow.estimate(FULL, 1).confidence == pytest.approx((16 + 9) / 30)


def test_several_evaluations_of_one_pair_are_pooled() -> None:
    a = agreement(Evaluation(FULL, INT8, 1.0, 100), Evaluation(FULL, INT8, 0.5, 100))
    assert a.estimate(FULL, 1).confidence == pytest.approx((16 + 150) / 220)


def test_down_the_chain_links_multiply_unless_the_pair_was_measured_directly() -> None:
    a = agreement(Evaluation(FULL, INT8, 0.9, 80))
    link1 = (16 + 72) / 100
    est = a.estimate(FULL, 2)
    assert est.confidence == pytest.approx(link1 * 0.5) and est.source == "configured+offline"
    direct = agreement(Evaluation(FULL, INT8, 0.9, 80), Evaluation(FULL, TINY, 0.6, 180))
    est = direct.estimate(FULL, 2)
    assert est.confidence == pytest.approx((20 * 0.4 + 108) / 200) and est.source == "offline"


def test_a_degraded_plan_carries_the_measured_confidence_and_its_source() -> None:
    f = Failover(FailoverConfig(fallbacks=CHAIN, evaluations=(Evaluation(FULL, INT8, 0.5, 180),)))
    plan = f.plan(FULL, [Replica("q", "q:1", model=INT8, healthy=True)], 0.0)
    assert (plan.model, plan.degraded, plan.degraded_by, plan.confidence_source) == (INT8, True, "capacity",
                                                                                       "offline")
    assert plan.confidence == pytest.approx((16 + 90) / 200)      # not the configured 0.8
    f.agreement.live = lambda p, fb: (20, 20)
    assert f.plan(FULL, [Replica("q", "q:1", model=INT8, healthy=True)], 0.0).confidence == pytest.approx(
        (16 + 90 + 20) / 220)


def test_evaluations_must_name_a_pair_of_the_chain() -> None:
    with pytest.raises(ValueError, match=r"'m-int8' is not in 'tiny'.s fallback chain \(no --fallback\)"):
        FailoverConfig(fallbacks=CHAIN, evaluations=(Evaluation(TINY, INT8, 0.9, 10),))
    with pytest.raises(ValueError, match=r"'other' is not in 'm'.s fallback chain \(m -> m-int8 -> tiny\)"):
        FailoverConfig(fallbacks=CHAIN, evaluations=(Evaluation(FULL, "other", 0.9, 10),))
    FailoverConfig(fallbacks=CHAIN, evaluations=(Evaluation(FULL, TINY, 0.9, 10),))     # further down: fine
    with pytest.raises(ValueError, match="--confidence-prior-samples"):
        FailoverConfig(prior_samples=0)


# -- the evaluation file ------------------------------------------------------------------
def test_an_evaluation_file_is_one_object_or_a_list(tmp_path: Path) -> None:
    one = tmp_path / "one.json"
    one.write_text(json.dumps({"primary": FULL, "fallback": INT8, "agreement": 0.91, "samples": 500}))
    assert load_evaluations(str(one)) == [Evaluation(FULL, INT8, 0.91, 500)]
    many = tmp_path / "many.json"
    many.write_text(json.dumps([{"primary": FULL, "fallback": INT8, "agreement": 1, "samples": 3},
                                {"primary": INT8, "fallback": TINY, "agreement": 0.5, "samples": 8}]))
    assert load_evaluations(str(many)) == [Evaluation(FULL, INT8, 1.0, 3), Evaluation(INT8, TINY, 0.5, 8)]


@pytest.mark.parametrize("content,message", [
    ("{", "fallback evaluation file .*bad.json"),
    (json.dumps({"primary": FULL, "fallback": INT8, "agreement": 0.9}), "exactly the keys"),
    (json.dumps({"primary": FULL, "fallback": INT8, "agreement": 1.5, "samples": 3}), "agreement must be"),
    (json.dumps({"primary": FULL, "fallback": INT8, "agreement": 0.9, "samples": 0}), "samples must be"),
    (json.dumps({"primary": FULL, "fallback": INT8, "agreement": 0.9, "samples": 2.5}), "samples must be"),
    (json.dumps({"primary": FULL, "fallback": INT8, "agreement": True, "samples": 2}), "agreement must be"),
    (json.dumps({"primary": FULL, "fallback": FULL, "agreement": 0.9, "samples": 2}), "compared with itself"),
    (json.dumps([{"primary": "", "fallback": INT8, "agreement": 0.9, "samples": 2}]), "entry 0: primary"),
])
def test_a_bad_evaluation_file_is_refused_naming_the_entry(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_evaluations(str(path))
