"""Online duration estimate for heavy-tailed work (T1).

The admission policy (T2) and the straggler detector (T3) both need a guess of
how long a piece of work will take before it runs. Durations of rollouts and
tool calls grow roughly linearly with a cost the caller knows up front (prompt
length, number of files, ...), so :class:`DurationEstimator` fits
``seconds ~ b + m * cost`` by ordinary least squares, one observation at a time.

The fit keeps the centred form of the running sums ``(n, Σx, Σy, Σxx, Σxy)``:
the means of cost and seconds and the co-moments ``Σ(x - x̄)²`` and
``Σ(x - x̄)(y - ȳ)``, updated Welford-style. The textbook form
``Σxx - (Σx)² / n`` subtracts two huge, nearly equal numbers when costs are
large (say 1e9 tokens) and loses every significant digit of the variance; the
centred form never does.

A line says how long work takes on average; the hedge delay (T3) needs how
long it takes when it is slow. Each observation therefore also records how it
compared with the estimate made just before it (``seconds / estimate``), in a
window of the most recent ones: :meth:`DurationEstimator.quantile` is a high
quantile of those ratios times the estimate of the cost asked about, which,
for work of one cost, is that quantile of its observed durations. A ratio
past ``max_ratio`` is a stall and is recorded as ``max_ratio``: the quantile
follows how slow work really gets up to there, and stalls, however many,
never lift it past ``max_ratio`` times the estimate.
"""

from __future__ import annotations

import math
import sys
import threading
from collections import deque

# Costs whose spread is within a few ulps of their mean are indistinguishable
# from rounding noise, so they carry no information about the slope.
_DEGENERATE_SPREAD = 8.0 * sys.float_info.epsilon


def _require_finite(name: str, value: float) -> None:
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")


def _require_finite_non_negative(name: str, value: float) -> None:
    if not (math.isfinite(value) and value >= 0.0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


class DurationEstimator:
    """Online least-squares estimate of ``seconds ~ b + m * cost`` (T1).

    Each :meth:`observe` costs O(1) time and memory. Until ``min_samples``
    observations have arrived, and whenever every observed cost is the same
    (no spread, so no slope can be fitted), the estimate is the mean of the
    observed seconds; with no observation at all it is ``prior``. An estimate
    is never negative. Every method is safe to call from several threads.

    Args:
        prior: The estimate, in seconds, before any observation; finite, >= 0.
        min_samples: How many observations the estimator needs before it fits
            a line rather than answering the mean; at least 1.
        window: How many recent observations :meth:`quantile` reads; at least 1.
        max_ratio: The largest ratio of an observation to its estimate that
            :meth:`quantile` records as it is (None: no bound); > 0.

    Raises:
        ValueError: ``prior`` is negative or not finite, ``min_samples < 1``,
            ``window < 1`` or ``max_ratio <= 0``.

    >>> est = DurationEstimator(prior=2.0)
    >>> est.estimate(100.0)
    2.0
    >>> for cost in (10.0, 20.0, 30.0):
    ...     est.observe(cost, 1.0 + 0.5 * cost)
    >>> est.params
    (1.0, 0.5)
    >>> est.estimate(40.0)
    21.0
    >>> est.estimate(-1000.0)  # a line may dip below zero; a duration may not
    0.0
    """

    __slots__ = (
        "_lock", "_max_ratio", "_mean_x", "_mean_y", "_min_samples", "_n", "_prior", "_ratios",
        "_sorted", "_stale", "_sxx", "_sxy",
    )  # fmt: skip

    def __init__(
        self,
        prior: float = 1.0,
        min_samples: int = 3,
        window: int = 512,
        max_ratio: float | None = None,
    ) -> None:
        _require_finite_non_negative("prior", prior)
        if min_samples < 1:
            raise ValueError(f"min_samples must be >= 1, got {min_samples!r}")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window!r}")
        if max_ratio is not None and not max_ratio > 0.0:
            raise ValueError(f"max_ratio must be > 0, got {max_ratio!r}")
        self._lock = threading.Lock()
        self._max_ratio = math.inf if max_ratio is None else max_ratio
        #: The latest observations' seconds over the estimate made just before each.
        self._ratios: deque[float] = deque(maxlen=window)
        self._sorted: list[float] | None = None  # the ratios sorted, as of ``_stale`` ago
        self._stale = 0
        self._prior = float(prior)
        self._min_samples = min_samples
        self._n = 0
        self._mean_x = 0.0
        self._mean_y = 0.0
        self._sxx = 0.0  # Σ(x - x̄)²
        self._sxy = 0.0  # Σ(x - x̄)(y - ȳ)

    def observe(self, cost: float, seconds: float, *, fit_cap: float | None = None) -> None:
        """Record that work of ``cost`` took ``seconds``.

        Args:
            cost: The cost known before the work ran (any finite number).
            seconds: How long it took; finite and >= 0.
            fit_cap: The most seconds the line learns from this observation
                (a stall's, so that one stall does not drag the fit off
                course); the quantile's window still records ``seconds``.

        Raises:
            ValueError: ``cost`` is not finite, or ``seconds`` is negative or
                not finite. Nothing is recorded then.
        """
        _require_finite("cost", cost)
        _require_finite_non_negative("seconds", seconds)
        with self._lock:
            if self._n:
                before = self._estimate(cost)
                if before > 0.0:
                    self._ratios.append(min(seconds / before, self._max_ratio))
                    self._stale += 1
            if fit_cap is not None:
                seconds = min(seconds, fit_cap)
            self._n += 1
            dx = cost - self._mean_x
            self._mean_x += dx / self._n
            self._mean_y += (seconds - self._mean_y) / self._n
            # Old deviation times new deviation is Welford's exact co-moment
            # update; identical costs leave _sxx at exactly 0.0.
            self._sxx += dx * (cost - self._mean_x)
            self._sxy += dx * (seconds - self._mean_y)

    def estimate(self, cost: float) -> float:
        """Return the expected seconds for work of ``cost``, never negative.

        Args:
            cost: The cost of the work to estimate (any finite number).

        Raises:
            ValueError: ``cost`` is not finite.
        """
        _require_finite("cost", cost)
        with self._lock:
            return self._estimate(cost)

    def quantile(self, cost: float, q: float, min_observations: int) -> float | None:
        """Seconds that work of ``cost`` takes at quantile ``q``: the ``q`` quantile
        (nearest rank) of the recent observations' ratios to their estimates, times the
        estimate for ``cost``; None until the window holds ``min_observations``.

        Args:
            cost: The cost of the work (any finite number).
            q: The quantile, within 0..1 (0.99: slower than 99% of the work seen).
            min_observations: How many ratios it needs before it answers; at least 1.

        Raises:
            ValueError: ``cost`` is not finite, ``q`` is outside 0..1 or
                ``min_observations < 1``.

        >>> est = DurationEstimator()
        >>> for seconds in (1.0, 1.0, 1.0, 1.0, 3.0):
        ...     est.observe(1.0, seconds)
        >>> est.quantile(1.0, 0.5, min_observations=4)  # ratios 1, 1, 1, 3; the estimate 1.4
        1.4
        >>> print(est.quantile(1.0, 0.5, min_observations=5))
        None
        """
        _require_finite("cost", cost)
        if not 0.0 < q <= 1.0:
            raise ValueError(f"q must be within 0..1, got {q!r}")
        if min_observations < 1:
            raise ValueError(f"min_observations must be >= 1, got {min_observations!r}")
        with self._lock:
            ratios = self._ratios
            if len(ratios) < min_observations:
                return None
            ordered = self._sorted
            # Sorting a full window per attempt would cost more than the attempt's
            # bookkeeping; a quantile a few observations old is as good a delay.
            if ordered is None or self._stale > len(ratios) // 32:
                ordered = self._sorted = sorted(ratios)
                self._stale = 0
            ratio = ordered[max(0, math.ceil(q * len(ordered)) - 1)]
            return ratio * self._estimate(cost)

    @property
    def params(self) -> tuple[float, float]:
        """The line the estimate uses, as ``(intercept b, slope m)``.

        Before a line can be fitted it is flat: ``(prior, 0.0)`` with no data,
        ``(mean seconds, 0.0)`` below ``min_samples`` or with no cost spread.
        :meth:`estimate` additionally clamps the line at zero.
        """
        with self._lock:
            if self._n == 0:
                return (self._prior, 0.0)
            if not self._has_line():
                return (self._mean_y, 0.0)
            slope = self._sxy / self._sxx
            return (self._mean_y - slope * self._mean_x, slope)

    @property
    def count(self) -> int:
        """How many observations have been recorded."""
        with self._lock:
            return self._n

    def __repr__(self) -> str:
        b, m = self.params
        return f"DurationEstimator(count={self.count}, b={b!r}, m={m!r})"

    def _estimate(self, cost: float) -> float:
        # Caller holds the lock.
        if self._n == 0:
            return self._prior
        mean_y = self._mean_y
        if not self._has_line():
            return max(0.0, mean_y)
        # Centred prediction: b + m*cost would cancel catastrophically for
        # large costs, since b = ȳ - m*x̄ is itself a difference of big terms.
        value = mean_y + self._sxy / self._sxx * (cost - self._mean_x)
        if math.isnan(value):  # overflow for costs ~1e308 away from the data
            return max(0.0, mean_y)
        return max(0.0, value)

    def _has_line(self) -> bool:
        # Caller holds the lock. A comparison with NaN is False, so a fit whose
        # co-moments overflowed counts as degenerate and falls back to the mean.
        if self._n < self._min_samples:
            return False
        # Multiply rather than `** 2`: float power raises OverflowError, product gives inf.
        spread = _DEGENERATE_SPREAD * abs(self._mean_x)
        return self._sxx > self._n * spread * spread
