"""T1: DurationEstimator fits seconds ~ b + m*cost online, thread-safe, never negative."""

from __future__ import annotations

import math
import random
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tailrace.tail
from tailrace.tail import DurationEstimator

B, M = 0.05, 0.0008


class _YieldingCost(float):
    """A cost whose subtraction gives up the GIL, so an unlocked update would interleave.

    Under the GIL a few float statements without calls run as one block, so
    without this the concurrent test would pass even with the lock removed.
    """

    def __sub__(self, other: float) -> float:
        time.sleep(0)
        return float(self) - other


def test_tail_facade_exports_exactly_the_public_names() -> None:
    public = {name for name in vars(tailrace.tail) if not name.startswith("_")}
    assert tailrace.tail.__all__ == sorted(tailrace.tail.__all__)
    assert set(tailrace.tail.__all__) == public
    for name in tailrace.tail.__all__:
        assert getattr(tailrace.tail, name).__module__.startswith("tailrace.tail._")


def test_t1_recovers_exact_linear_law() -> None:
    est = DurationEstimator()
    for cost in range(1, 101):
        est.observe(float(cost), B + M * cost)
    b, m = est.params
    assert b == pytest.approx(B, abs=1e-6)
    assert m == pytest.approx(M, abs=1e-6)
    assert est.estimate(5000.0) == pytest.approx(B + M * 5000.0, abs=1e-6)
    assert est.count == 100


def test_t1_large_costs_keep_precision() -> None:
    # Costs near 1e9 with a spread of 100: the uncentred Σxx - (Σx)²/n would
    # cancel to noise here; the centred updates keep the slope exact.
    est = DurationEstimator()
    for cost in range(1_000_000_000, 1_000_000_100):
        est.observe(float(cost), 3.0 + 2e-3 * (cost - 1_000_000_000))
    _, m = est.params
    assert m == pytest.approx(2e-3, rel=1e-6)
    assert est.estimate(1_000_000_050.0) == pytest.approx(3.1, abs=1e-6)


def _noisy_rollouts(rng: random.Random, k: int) -> list[tuple[float, float]]:
    out = []
    for _ in range(k):
        cost = rng.uniform(10.0, 5000.0)
        out.append((cost, max(0.0, B + M * cost + rng.gauss(0.0, 0.2))))
    return out


def _held_out_mae(est: DurationEstimator, held_out: list[float]) -> float:
    # Error against the noise-free law: what the estimator can still learn.
    return sum(abs(est.estimate(c) - (B + M * c)) for c in held_out) / len(held_out)


def test_t1_error_shrinks_with_observations() -> None:
    rng = random.Random(1234)
    held_out = [rng.uniform(10.0, 5000.0) for _ in range(200)]
    est = DurationEstimator()
    rollouts = _noisy_rollouts(rng, 500)
    for cost, seconds in rollouts[:5]:
        est.observe(cost, seconds)
    mae_5 = _held_out_mae(est, held_out)
    for cost, seconds in rollouts[5:]:
        est.observe(cost, seconds)
    mae_500 = _held_out_mae(est, held_out)
    assert mae_500 < mae_5 / 3
    assert mae_500 < 0.05  # noise sd is 0.2 s; 500 points pin the line well inside it


def test_t1_prior_with_no_data() -> None:
    est = DurationEstimator(prior=2.5)
    assert est.estimate(0.0) == 2.5
    assert est.estimate(1e6) == 2.5
    assert est.params == (2.5, 0.0)
    assert est.count == 0


def test_t1_mean_below_min_samples() -> None:
    est = DurationEstimator(prior=100.0, min_samples=3)
    est.observe(10.0, 1.0)
    assert est.estimate(1e6) == 1.0
    est.observe(20.0, 3.0)
    assert est.estimate(1e6) == 2.0
    assert est.params == (2.0, 0.0)
    est.observe(30.0, 5.0)  # third sample: now a line, 0.2 s per unit
    assert est.params == pytest.approx((-1.0, 0.2))


def test_t1_identical_costs_give_the_mean() -> None:
    est = DurationEstimator(min_samples=1)
    for seconds in (1.0, 2.0, 6.0):
        est.observe(7.0, seconds)
    assert est.params == (3.0, 0.0)
    assert est.estimate(1e9) == 3.0


def test_t1_never_negative_when_the_line_dips_below_zero() -> None:
    est = DurationEstimator(min_samples=2)
    est.observe(0.0, 10.0)
    est.observe(10.0, 0.0)  # slope -1: the line is negative beyond cost 10
    assert est.params == pytest.approx((10.0, -1.0))
    assert est.estimate(5.0) == pytest.approx(5.0)
    assert est.estimate(50.0) == 0.0


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"prior": -1.0}, "prior"),
        ({"prior": math.nan}, "prior"),
        ({"prior": math.inf}, "prior"),
        ({"min_samples": 0}, "min_samples"),
    ],
)
def test_t1_constructor_rejects_bad_arguments(kwargs: dict[str, float], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        DurationEstimator(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("cost", "seconds", "name"),
    [
        (1.0, -0.5, "seconds"),
        (1.0, math.nan, "seconds"),
        (1.0, math.inf, "seconds"),
        (math.nan, 1.0, "cost"),
        (-math.inf, 1.0, "cost"),
    ],
)
def test_t1_observe_rejects_bad_arguments(cost: float, seconds: float, name: str) -> None:
    est = DurationEstimator()
    with pytest.raises(ValueError, match=name):
        est.observe(cost, seconds)
    assert est.count == 0  # a refused observation leaves no trace


@pytest.mark.parametrize("cost", [math.nan, math.inf])
def test_t1_estimate_rejects_non_finite_cost(cost: float) -> None:
    with pytest.raises(ValueError, match="cost"):
        DurationEstimator().estimate(cost)


def test_t1_concurrent_observers_lose_nothing() -> None:
    n_threads, per_thread = 8, 500
    est = DurationEstimator()
    barrier = threading.Barrier(n_threads)

    def observer(offset: int) -> None:
        barrier.wait()
        for k in range(per_thread):
            cost = float(offset + k * n_threads)
            est.observe(_YieldingCost(cost), B + M * cost)

    threads = [threading.Thread(target=observer, args=(i,)) for i in range(n_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert est.count == n_threads * per_thread
    b, m = est.params
    assert b == pytest.approx(B, abs=1e-6)
    assert m == pytest.approx(M, abs=1e-6)


finite = st.floats(allow_nan=False, allow_infinity=False)
non_negative = st.floats(min_value=0.0, allow_nan=False, allow_infinity=False)


@settings(max_examples=500)
@given(
    prior=non_negative,
    min_samples=st.integers(1, 4),
    observations=st.lists(st.tuples(finite, non_negative), max_size=30),
    query=finite,
)
def test_t1_estimate_never_negative(
    prior: float, min_samples: int, observations: list[tuple[float, float]], query: float
) -> None:
    est = DurationEstimator(prior=prior, min_samples=min_samples)
    for cost, seconds in observations:
        est.observe(cost, seconds)
    value = est.estimate(query)
    assert value >= 0.0  # also rules out NaN, for which every comparison is False
