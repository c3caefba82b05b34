"""The held-out gate: does a candidate beat the base, with what probability?

Each side's held-out rewards are read as (fractional) Bernoulli outcomes under
a uniform prior, giving ``Beta(1 + Σr, 1 + Σ(1 - r))``. The probability that
the candidate's success rate exceeds the base's is integrated numerically on a
fixed grid (deterministic, no SciPy). The bar rises with the version: early
edits are cheap to accept, late ones must be convincing, because late heads
are good and a spurious merge costs more than a missed one.

>>> round(prob_beats([1, 1, 1, 1], [0, 0, 0, 0]), 3)
0.996
>>> round(prob_beats([1, 0], [1, 0]), 3)
0.5
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

_GRID = 2000


def _log_beta_pdf(alpha: float, beta: float) -> list[float]:
    norm = math.lgamma(alpha + beta) - math.lgamma(alpha) - math.lgamma(beta)
    return [
        norm + (alpha - 1) * math.log(x) + (beta - 1) * math.log1p(-x)
        for x in ((i + 0.5) / _GRID for i in range(_GRID))
    ]


def _masses(alpha: float, beta: float) -> list[float]:
    logs = _log_beta_pdf(alpha, beta)
    top = max(logs)
    weights = [math.exp(v - top) for v in logs]
    total = math.fsum(weights)
    return [w / total for w in weights]


def posterior(rewards: Sequence[float]) -> tuple[float, float]:
    """The Beta posterior ``(alpha, beta)`` of rewards in ``[0, 1]`` under a uniform prior.

    Args:
        rewards: Per-task rewards.
    """
    total = math.fsum(rewards)
    return 1.0 + total, 1.0 + len(rewards) - total


def prob_beats(candidate: Sequence[float], base: Sequence[float]) -> float:
    """Posterior probability that ``candidate``'s success rate exceeds ``base``'s.

    Ties within one grid cell count half, so identical evidence gives 0.5.

    Args:
        candidate: The candidate's rewards on the held-out tasks.
        base: The base's rewards on the same tasks.
    """
    cand = _masses(*posterior(candidate))
    below = 0.0  # mass of the base strictly below the current cell
    prob = 0.0
    for c, b in zip(cand, _masses(*posterior(base)), strict=True):
        prob += c * (below + 0.5 * b)
        below += b
    return min(1.0, max(0.0, prob))


@dataclass(frozen=True, slots=True, kw_only=True)
class Verdict:
    """The held-out gate's decision on one candidate.

    Args:
        probability: Posterior probability that the candidate beats the base.
        threshold: The bar at the base's version.
        accepted: ``probability > threshold``.
        candidate_mean: The candidate's mean held-out reward.
        base_mean: The base's mean held-out reward.
    """

    probability: float
    threshold: float
    accepted: bool
    candidate_mean: float
    base_mean: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Acceptance:
    """When a candidate is merged: ``P(candidate beats base) > threshold_at(version)``.

    Args:
        threshold: The bar at version 1.
        step: How much the bar rises per version.
        max_threshold: The bar never rises above this.

    >>> Acceptance(threshold=0.6, step=0.1, max_threshold=0.75).threshold_at(3)
    0.75
    """

    threshold: float = 0.55
    step: float = 0.01
    max_threshold: float = 0.8

    def __post_init__(self) -> None:
        if not 0.0 <= self.threshold < 1.0 or not 0.0 <= self.max_threshold < 1.0:
            raise ValueError("Acceptance thresholds must be in [0, 1)")
        if self.step < 0:
            raise ValueError(f"Acceptance.step must be >= 0, got {self.step}")

    def threshold_at(self, version: int) -> float:
        """The bar a candidate built on ``version`` must clear.

        Args:
            version: The base's ledger version (from 1).
        """
        return min(
            self.max_threshold, max(self.threshold, self.threshold + self.step * (version - 1))
        )

    def decide(self, candidate: Sequence[float], base: Sequence[float], version: int) -> Verdict:
        """Decide on a candidate from held-out rewards.

        Args:
            candidate: The candidate's rewards on the held-out tasks.
            base: The base's rewards on the same tasks.
            version: The base's ledger version.
        """
        probability = prob_beats(candidate, base)
        threshold = self.threshold_at(version)
        return Verdict(
            probability=probability,
            threshold=threshold,
            accepted=probability > threshold,
            candidate_mean=mean(candidate),
            base_mean=mean(base),
        )


def mean(values: Sequence[float]) -> float:
    """The arithmetic mean, 0.0 for no values.

    Args:
        values: Numbers.
    """
    return math.fsum(values) / len(values) if values else 0.0
