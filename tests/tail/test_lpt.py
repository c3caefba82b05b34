"""T2: lpt_schedule / fifo_makespan / list_makespan / makespan_lower_bound, and what LPT guarantees.

Integer weights keep every load an exact float sum, so the bounds are checked
exactly (cross-multiplied, no division); float weights get a relative tolerance.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tailrace.tail import fifo_makespan, list_makespan, lpt_schedule, makespan_lower_bound

int_weights = st.lists(st.integers(0, 1000), max_size=30)
float_weights = st.lists(
    st.floats(min_value=0.0, max_value=1e6, allow_nan=False, allow_infinity=False), max_size=30
)
workers = st.integers(1, 8)


def _loads(weights: Sequence[float], assignment: list[list[int]]) -> list[float]:
    return [sum((weights[t] for t in tasks), 0.0) for tasks in assignment]


def _brute_force_opt(weights: Sequence[int], n_workers: int) -> int:
    if not weights:
        return 0
    best = sum(weights)
    # Workers are interchangeable, so task 0 may as well go to worker 0.
    for rest in itertools.product(range(n_workers), repeat=len(weights) - 1):
        loads = [0] * n_workers
        loads[0] = weights[0]
        for task, worker in enumerate(rest, start=1):
            loads[worker] += weights[task]
        best = min(best, max(loads))
    return best


# --- the schedule itself -------------------------------------------------------------


@settings(max_examples=300)
@given(weights=float_weights, n_workers=workers)
def test_t2_assignment_is_a_partition_and_makespan_is_its_max_load(
    weights: list[float], n_workers: int
) -> None:
    assignment, makespan = lpt_schedule(weights, n_workers)
    assert len(assignment) == n_workers
    assert sorted(itertools.chain.from_iterable(assignment)) == list(range(len(weights)))
    assert makespan == max(_loads(weights, assignment))


@settings(max_examples=300)
@given(weights=float_weights, n_workers=workers)
def test_t2_each_task_goes_longest_first_to_the_least_loaded_worker(
    weights: list[float], n_workers: int
) -> None:
    # Replays the assignment and checks each step against the definition.
    assignment, _ = lpt_schedule(weights, n_workers)
    worker_of = {t: w for w, tasks in enumerate(assignment) for t in tasks}
    loads = [0.0] * n_workers
    for task in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        least = min(range(n_workers), key=lambda w: (loads[w], w))
        assert worker_of[task] == least
        loads[least] += weights[task]


def test_t2_ties_break_by_lower_worker_then_lower_task() -> None:
    assert lpt_schedule([1, 1, 1, 1, 1], 2) == ([[0, 2, 4], [1, 3]], 3.0)
    assert lpt_schedule([2, 5, 2, 5], 3) == ([[1], [3], [0, 2]], 5.0)


def test_t2_empty_and_single_worker() -> None:
    assert lpt_schedule([], 3) == ([[], [], []], 0.0)
    assert fifo_makespan([], 3) == 0.0
    assert makespan_lower_bound([], 3) == 0.0
    assert lpt_schedule([2.5, 1.0, 4.0], 1) == ([[2, 0, 1]], 7.5)


def test_t2_round_robin_assigns_task_i_to_worker_i_mod_n() -> None:
    assert fifo_makespan([5, 1, 1, 1, 5], 2) == 11.0  # worker 0 gets tasks 0, 2, 4
    assert fifo_makespan([1, 2, 3], 5) == 3.0


def test_t2_list_scheduling_sends_each_arrival_to_the_least_loaded_worker() -> None:
    assert list_makespan([5, 1, 1, 1, 5], 2) == 8.0  # 5 | 1+1+1+5
    assert list_makespan([1, 1, 1, 1], 3) == 2.0
    assert list_makespan([], 3) == 0.0
    assert list_makespan([2.5, 1.0, 4.0], 1) == 7.5


@settings(max_examples=500)
@given(weights=float_weights, n_workers=workers)
def test_t2_list_scheduling_matches_a_work_conserving_queue(
    weights: list[float], n_workers: int
) -> None:
    # Simulate n workers each taking the next task in arrival order when it frees up:
    # the makespan is the time the last one finishes, which list scheduling computes.
    free_at = [0.0] * n_workers
    for weight in weights:
        worker = min(range(n_workers), key=lambda w: (free_at[w], w))
        free_at[worker] += weight
    assert list_makespan(weights, n_workers) == max(free_at, default=0.0)


@settings(max_examples=300, deadline=None)
@given(weights=st.lists(st.integers(0, 60), max_size=8), n_workers=st.integers(1, 3))
def test_t2_list_scheduling_within_two_minus_one_over_n_of_optimum(
    weights: list[int], n_workers: int
) -> None:
    # Graham 1966: list <= (2 - 1/n) * OPT, i.e. n * list <= (2n - 1) * OPT.
    greedy = list_makespan(weights, n_workers)
    opt = _brute_force_opt(weights, n_workers)
    assert opt <= greedy
    assert n_workers * greedy <= (2 * n_workers - 1) * opt


@settings(max_examples=1000)
@given(weights=int_weights, n_workers=workers)
def test_t2_list_scheduling_within_average_plus_longest(weights: list[int], n_workers: int) -> None:
    # The last task on the busiest worker started when that worker was least loaded:
    # n * list <= total + (n - 1) * max weight.
    greedy = list_makespan(weights, n_workers)
    assert greedy >= makespan_lower_bound(weights, n_workers)
    assert n_workers * greedy <= sum(weights) + (n_workers - 1) * max(weights, default=0)


def test_t2_lower_bound_is_average_or_longest() -> None:
    assert makespan_lower_bound([1, 1, 1, 1], 2) == 2.0
    assert makespan_lower_bound([10, 1, 1], 2) == 10.0


@pytest.mark.parametrize("fn", [lpt_schedule, fifo_makespan, list_makespan, makespan_lower_bound])
@pytest.mark.parametrize(
    ("weights", "n_workers", "name"),
    [
        ([1.0], 0, "n_workers"),
        ([1.0], -2, "n_workers"),
        ([1.0, -0.1], 2, r"weights\[1\]"),
        ([math.nan], 2, r"weights\[0\]"),
        ([1.0, math.inf], 2, r"weights\[1\]"),
    ],
)
def test_t2_rejects_bad_arguments(
    fn: Callable[[Sequence[float], int], object], weights: list[float], n_workers: int, name: str
) -> None:
    with pytest.raises(ValueError, match=name):
        fn(weights, n_workers)


# --- what LPT guarantees ---------------------------------------------------------------


@settings(max_examples=1000)
@given(weights=int_weights, n_workers=workers)
def test_t2_never_below_the_lower_bound(weights: list[int], n_workers: int) -> None:
    _, makespan = lpt_schedule(weights, n_workers)
    assert makespan >= makespan_lower_bound(weights, n_workers)


@settings(max_examples=500)
@given(weights=float_weights, n_workers=workers)
def test_t2_never_below_the_lower_bound_float_weights(weights: list[float], n_workers: int) -> None:
    # Per-worker sums and the fsum-ed total may round apart by an ulp or so.
    _, makespan = lpt_schedule(weights, n_workers)
    assert makespan >= makespan_lower_bound(weights, n_workers) * (1 - 1e-12)


@settings(max_examples=300, deadline=None)
@given(weights=st.lists(st.integers(0, 60), max_size=8), n_workers=st.integers(1, 3))
def test_t2_within_four_thirds_minus_one_over_3n_of_optimum(
    weights: list[int], n_workers: int
) -> None:
    # Graham's bound: lpt <= (4/3 - 1/(3n)) * OPT, i.e. 3n * lpt <= (4n - 1) * OPT.
    _, makespan = lpt_schedule(weights, n_workers)
    opt = _brute_force_opt(weights, n_workers)
    assert opt <= makespan
    assert 3 * n_workers * makespan <= (4 * n_workers - 1) * opt


def test_t2_graham_bound_is_tight() -> None:
    # 3+3 | 2+2+2 is optimal (6); LPT pairs the 3s with 2s and ends at 7 = 7/6 * OPT.
    assert lpt_schedule([3, 3, 2, 2, 2], 2)[1] == 7.0
    assert _brute_force_opt([3, 3, 2, 2, 2], 2) == 6


@settings(max_examples=1000)
@given(weights=int_weights, n_workers=workers)
def test_t2_within_2n_over_n_plus_1_of_the_lower_bound(weights: list[int], n_workers: int) -> None:
    # Proof: the last task on the busiest worker either started at 0 (one of the
    # n longest; then lpt = its weight <= max) or is at most the (n+1)-th longest
    # p, so lpt <= total/n + (1 - 1/n) * p with p <= total/(n+1).
    _, makespan = lpt_schedule(weights, n_workers)
    bound = makespan_lower_bound(weights, n_workers)
    assert makespan * (n_workers + 1) <= 2 * n_workers * bound * (1 + 1e-12)


@settings(max_examples=1000)
@given(weights=int_weights, n_workers=workers)
def test_t2_within_the_n_plus_1_th_longest_task_of_the_average(
    weights: list[int], n_workers: int
) -> None:
    # The sharper form of the bound above: lpt <= max(p1, total/n + (1 - 1/n) * p_{n+1}).
    _, makespan = lpt_schedule(weights, n_workers)
    ranked = sorted(weights, reverse=True)
    if len(ranked) <= n_workers:
        assert makespan == max(ranked, default=0)
        return
    total = sum(weights)
    # n * lpt <= total + (n - 1) * p_{n+1}, cross-multiplied to stay in integers.
    assert (
        makespan <= ranked[0] or n_workers * makespan <= total + (n_workers - 1) * ranked[n_workers]
    )


@settings(max_examples=1000)
@given(weights=int_weights, n_workers=st.integers(1, 2))
def test_t2_within_four_thirds_of_the_lower_bound_on_two_workers(
    weights: list[int], n_workers: int
) -> None:
    # 2n/(n+1) is exactly 4/3 at n = 2 (and 1 at n = 1); from n = 3 on it is not.
    _, makespan = lpt_schedule(weights, n_workers)
    assert 3 * makespan <= 4 * makespan_lower_bound(weights, n_workers) * (1 + 1e-12)


def test_t2_can_exceed_four_thirds_of_the_lower_bound_from_three_workers() -> None:
    # Four unit tasks on three workers: the bound is 4/3 but no schedule beats 2.
    assert makespan_lower_bound([1, 1, 1, 1], 3) == pytest.approx(4 / 3)
    assert lpt_schedule([1, 1, 1, 1], 3)[1] == 2.0 == _brute_force_opt([1, 1, 1, 1], 3)
    # Nor do many tasks save it (found by Hypothesis): 12 tasks on 4 workers, 1.36x the bound.
    weights = [1, 1, 1, 1, 1, 1, 1, 8, 8, 8, 8, 8]
    assert lpt_schedule(weights, 4)[1] == 16.0
    assert makespan_lower_bound(weights, 4) == 11.75


# --- LPT against round-robin ------------------------------------------------------------


def test_t2_lpt_can_lose_to_round_robin() -> None:
    # Round-robin happens to split 2+2+2 | 3+3 perfectly; LPT is the 7/6 case above.
    weights = [2, 3, 2, 3, 2]
    assert fifo_makespan(weights, 2) == 6.0
    assert lpt_schedule(weights, 2)[1] == 7.0


@settings(max_examples=1000)
@given(weights=int_weights, n_workers=workers)
def test_t2_within_graham_factor_of_round_robin(weights: list[int], n_workers: int) -> None:
    # OPT <= round-robin, so Graham's bound carries over: 3n * lpt <= (4n - 1) * rr.
    _, makespan = lpt_schedule(weights, n_workers)
    assert 3 * n_workers * makespan <= (4 * n_workers - 1) * fifo_makespan(weights, n_workers)


@settings(max_examples=500)
@given(weights=st.lists(st.integers(0, 1000), max_size=8), n_workers=workers)
def test_t2_never_worse_than_round_robin_with_at_most_one_task_per_worker(
    weights: list[int], n_workers: int
) -> None:
    # With no more tasks than workers LPT gives each its own worker: optimal.
    weights = weights[:n_workers]
    assert lpt_schedule(weights, n_workers)[1] <= fifo_makespan(weights, n_workers)


def test_t2_lpt_beats_or_ties_round_robin_on_heavy_tailed_batches() -> None:
    # Statistical, not universal: 1000 seeded lognormal(6.0, 0.9) batches of 40
    # tasks on 4 workers. (With light tails, sigma 0.25, LPT loses ~3 in 1000.)
    rng = random.Random(20240611)
    ratios = []
    for _ in range(1000):
        weights = [rng.lognormvariate(6.0, 0.9) for _ in range(40)]
        lpt = lpt_schedule(weights, 4)[1]
        rr = fifo_makespan(weights, 4)
        assert lpt <= rr
        ratios.append(rr / lpt)
    assert sorted(ratios)[len(ratios) // 2] > 1.2  # the typical gain is large, not a tie


# --- LPT against greedy list scheduling (a real queue) ------------------------------------


def test_t2_lpt_can_lose_to_list_scheduling() -> None:
    # Arrival order 3, 3, 2, 2, 2 is longest-first already: list scheduling is LPT (7).
    assert list_makespan([3, 3, 2, 2, 2], 2) == lpt_schedule([3, 3, 2, 2, 2], 2)[1] == 7.0
    # 3, 2, 2, 3, 2 happens to fall into 3+3 | 2+2+2 in arrival order.
    weights = [3, 2, 2, 3, 2]
    assert list_makespan(weights, 2) == 6.0 < lpt_schedule(weights, 2)[1]


def test_t2_lpt_gain_over_a_real_queue_is_much_smaller_than_over_round_robin() -> None:
    # The same 1000 heavy-tailed batches: against list scheduling (what a
    # work-conserving queue achieves) LPT still wins almost always (2 losses),
    # by far less: a median gain of 1.09x against 1.32x over round-robin.
    rng = random.Random(20240611)
    over_rr, over_list, losses = [], [], 0
    for _ in range(1000):
        weights = [rng.lognormvariate(6.0, 0.9) for _ in range(40)]
        lpt = lpt_schedule(weights, 4)[1]
        greedy = list_makespan(weights, 4)
        losses += lpt > greedy
        over_rr.append(fifo_makespan(weights, 4) / lpt)
        over_list.append(greedy / lpt)
    median_rr = sorted(over_rr)[500]
    median_list = sorted(over_list)[500]
    assert losses <= 10
    assert 1.0 < median_list < 1.15 < 1.2 < median_rr
