"""FallbackChain: level 3's list of models to degrade to, with the confidence of each.

Configured as model -> (next model, confidence of its answers relative to the model's):

    {"smollm2-135m": ("smollm2-135m-int8", 0.8), "smollm2-135m-int8": ("tiny", 0.5)}

so the chain of "smollm2-135m" is smollm2-135m (1.0), smollm2-135m-int8 (0.8), tiny (0.4):
confidence multiplies along the chain.  A model with no entry has a chain of itself alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple


class Step(NamedTuple):
    model: str
    confidence: float     # 1.0 for the requested model; the product of the links after it


class FallbackChain:
    def __init__(self, fallbacks: Mapping[str, tuple[str, float]]):
        for model, (nxt, confidence) in fallbacks.items():
            if not model or not nxt:
                raise ValueError(f"fallback {model!r} -> {nxt!r}: model names must not be empty")
            if not 0 < confidence <= 1:
                raise ValueError(f"fallback {model!r} -> {nxt!r}: confidence {confidence} is not in (0, 1]")
        self.fallbacks = dict(fallbacks)
        self._chains = {model: self._walk(model) for model in self.fallbacks}

    def _walk(self, model: str) -> tuple[Step, ...]:
        steps, seen, confidence = [Step(model, 1.0)], {model}, 1.0
        while model in self.fallbacks:
            model, link = self.fallbacks[model]
            if model in seen:
                # A cycle would send a request around the models for ever (or, as we stop at
                # the first repeat, quietly route a degraded request back to a model that
                # already failed it): refuse the configuration.
                loop = " -> ".join([s.model for s in steps] + [model])
                raise ValueError(f"the fallback chain has a cycle: {loop}")
            confidence *= link
            steps.append(Step(model, confidence))
            seen.add(model)
        return tuple(steps)

    def steps(self, model: str) -> tuple[Step, ...]:
        """The models to try for a request for `model`, in order, the model itself first."""
        return self._chains.get(model) or (Step(model, 1.0),)
