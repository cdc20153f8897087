"""FallbackChain (services/router/failover/chain.py): level 3's models, confidences, cycles."""

from __future__ import annotations

import pytest

from services.router.failover import FailoverConfig, FallbackChain, Step

CHAIN = {"smollm2-135m": ("smollm2-135m-int8", 0.8), "smollm2-135m-int8": ("tiny", 0.5)}


def test_confidence_multiplies_along_the_chain() -> None:
    chain = FallbackChain(CHAIN)
    assert chain.steps("smollm2-135m") == (
        Step("smollm2-135m", 1.0), Step("smollm2-135m-int8", 0.8), Step("tiny", 0.4))
    assert chain.steps("smollm2-135m-int8") == (Step("smollm2-135m-int8", 1.0), Step("tiny", 0.5))


def test_a_model_without_fallbacks_is_a_chain_of_one() -> None:
    assert FallbackChain(CHAIN).steps("tiny") == (Step("tiny", 1.0),)
    assert FallbackChain({}).steps("other") == (Step("other", 1.0),)


@pytest.mark.parametrize("fallbacks, loop", [
    ({"a": ("a", 0.5)}, "a -> a"),
    ({"a": ("b", 0.5), "b": ("a", 0.5)}, "a -> b -> a"),
    ({"x": ("a", 0.9), "a": ("b", 0.5), "b": ("c", 0.5), "c": ("a", 0.5)}, "x -> a -> b -> c -> a"),
])
def test_cycles_are_refused(fallbacks: dict[str, tuple[str, float]], loop: str) -> None:
    with pytest.raises(ValueError, match=f"cycle: {loop}$"):
        FallbackChain(fallbacks)
    with pytest.raises(ValueError, match="cycle"):
        FailoverConfig(fallbacks=fallbacks)


@pytest.mark.parametrize("confidence", [0.0, -0.5, 1.5])
def test_confidence_must_be_in_0_1(confidence: float) -> None:
    with pytest.raises(ValueError, match="confidence"):
        FallbackChain({"a": ("b", confidence)})
