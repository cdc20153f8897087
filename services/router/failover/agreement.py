"""Agreement: the confidence of a degraded answer, from how often the fallback agrees with its primary.

The evidence for a pair (primary, fallback) is `agreed` of `compared` answers, summed over:

    offline   evaluations the operator ran (--fallback-eval FILE): JSON
              {"primary": "m", "fallback": "m-int8", "agreement": 0.91, "samples": 500}, or a list of them;
    shadow    shadow comparisons at run time: --fallback-shadow-share mirrors that share of the
              primary's requests to the fallback model and compares the texts like version shadows
              (shadow.py: matched or diverged; failed mirrors are no evidence).

The confidence is the posterior mean of the agreement rate under a Beta prior centred on the
configured confidence c of the link (--fallback MODEL=NEXT:c) and worth k = prior_samples comparisons:

    confidence = (k * c + agreed) / (k + compared)

Nothing measured: c, the configured value.  A few comparisons move it little (3 of 3 agreeing is not a
confidence of 1.0: with c = 0.8 and k = 20 it is 0.83); many make it the measured rate (500
comparisons weigh 96% against k = 20).  A mean rather than a lower bound (Wilson's) so that the
configured value stays what an unmeasured link reports and the value moves smoothly as evidence comes.

Further down a chain (m -> m-int8 -> tiny), a step whose pair with the requested model was measured
directly (an offline evaluation of m against tiny) uses that evidence with the chain's configured
product as its prior; otherwise its confidence is the product of its links' confidences, as the
configured values multiply (chain.py).  `source` says what went in: "configured", "offline",
"shadow", or several joined by "+" ("offline+shadow"; "configured+offline" for a chain whose links
were measured in part).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NamedTuple

from services.router.failover.chain import FallbackChain


class Evaluation(NamedTuple):
    """An offline comparison of `fallback` with `primary`: `agreement` of `samples` answers agreed."""

    primary: str
    fallback: str
    agreement: float
    samples: int


class Estimate(NamedTuple):
    confidence: float
    source: str              # configured | offline | shadow | several joined by "+"; "" for the primary itself
    agreed: float            # the evidence behind it (0 of 0: configured)
    compared: float


def posterior(prior: float, agreed: float, compared: float, prior_samples: float) -> float:
    """The posterior mean of the agreement rate: (k * prior + agreed) / (k + compared)."""
    return (prior_samples * prior + agreed) / (prior_samples + compared)


def load_evaluations(path: str) -> list[Evaluation]:
    """An offline evaluation file: one JSON object {"primary", "fallback", "agreement", "samples"} or a
    list of them; ValueError naming the file and the entry on anything else."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"fallback evaluation file {path}: {exc}") from None
    entries = data if isinstance(data, list) else [data]
    out = []
    for i, e in enumerate(entries):
        where = f"fallback evaluation file {path}, entry {i}"
        if not isinstance(e, dict) or set(e) != {"primary", "fallback", "agreement", "samples"}:
            raise ValueError(f"{where}: expected exactly the keys primary, fallback, agreement, samples")
        primary, fallback, agreement, samples = e["primary"], e["fallback"], e["agreement"], e["samples"]
        if not isinstance(primary, str) or not isinstance(fallback, str) or not primary or not fallback:
            raise ValueError(f"{where}: primary and fallback must be model names")
        if primary == fallback:
            raise ValueError(f"{where}: a model compared with itself ({primary!r})")
        if isinstance(agreement, bool) or not isinstance(agreement, int | float) or not 0 <= agreement <= 1:
            raise ValueError(f"{where}: agreement must be a fraction in [0, 1], not {agreement!r}")
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
            raise ValueError(f"{where}: samples must be a whole number >= 1, not {samples!r}")
        out.append(Evaluation(primary, fallback, float(agreement), samples))
    return out


class Agreement:
    def __init__(self, chain: FallbackChain, evaluations: Iterable[Evaluation] = (), prior_samples: float = 20.0):
        self.chain, self.prior_samples = chain, prior_samples
        self.offline: dict[tuple[str, str], tuple[float, float]] = {}    # (primary, fallback) -> (agreed, compared)
        for e in evaluations:
            agreed, compared = self.offline.get((e.primary, e.fallback), (0.0, 0.0))
            self.offline[(e.primary, e.fallback)] = (agreed + e.agreement * e.samples, compared + e.samples)
        # (primary, fallback) -> (matched, compared) of the shadow comparisons: set by the dispatcher
        # to Shadows.agreement; None: no shadow evidence.
        self.live: Callable[[str, str], tuple[int, int]] | None = None

    def evidence(self, primary: str, fallback: str) -> tuple[float, float, list[str]]:
        """(agreed, compared, sources) for the pair, offline and shadow together."""
        agreed, compared, sources = 0.0, 0.0, []
        if (primary, fallback) in self.offline:
            a, n = self.offline[(primary, fallback)]
            agreed, compared = agreed + a, compared + n
            sources.append("offline")
        if self.live is not None:
            a, n = self.live(primary, fallback)
            if n > 0:
                agreed, compared = agreed + a, compared + n
                sources.append("shadow")
        return agreed, compared, sources

    def pair(self, primary: str, fallback: str, prior: float) -> Estimate:
        agreed, compared, sources = self.evidence(primary, fallback)
        if not compared:
            return Estimate(prior, "configured", 0.0, 0.0)
        return Estimate(posterior(prior, agreed, compared, self.prior_samples), "+".join(sources), agreed, compared)

    def estimate(self, model: str, index: int) -> Estimate:
        """The confidence of an answer from step `index` of `model`'s chain (0: the model itself, 1.0)."""
        steps = self.chain.steps(model)
        if index == 0:
            return Estimate(1.0, "", 0.0, 0.0)
        served = steps[index].model
        direct = self.pair(model, served, steps[index].confidence)
        if index == 1 or direct.compared:
            return direct
        confidence, sources, agreed, compared = 1.0, set(), 0.0, 0.0
        for before, step in zip(steps[:index], steps[1:index + 1], strict=True):
            link = self.pair(before.model, step.model, self.chain.fallbacks[before.model][1])
            confidence *= link.confidence
            sources.update(link.source.split("+"))
            agreed, compared = agreed + link.agreed, compared + link.compared
        return Estimate(confidence, "+".join(sorted(sources)), agreed, compared)
