"""Longest-processing-time-first scheduling and its yardsticks (T2).

With heavy-tailed work the order in which tasks start decides when the last
one finishes: a long task started late becomes the tail of the whole batch.
LPT starts the longest task first, always on the least-loaded worker.

What LPT guarantees, with ``n`` workers and OPT the best possible makespan
(Graham 1969):

- ``lpt <= (4/3 - 1/(3n)) * OPT``, tight (``[3, 3, 2, 2, 2]`` on 2 workers:
  LPT 7, OPT 6);
- ``lpt >= makespan_lower_bound`` (any schedule is);
- ``lpt <= max(p1, total/n + (1 - 1/n) * p_{n+1})`` where ``p1`` is the
  largest weight and ``p_{n+1}`` the (n+1)-th largest; since
  ``p_{n+1} <= total/(n+1)``, ``lpt <= 2n/(n+1) * makespan_lower_bound``, tight
  for n+1 equal tasks.

What it does *not* guarantee: it can lose to round-robin when the input order
happens to balance perfectly (``[2, 3, 2, 3, 2]`` on 2 workers: round-robin 6,
LPT 7), and from 3 workers on it can exceed ``4/3 * makespan_lower_bound``,
because that bound is not OPT (four unit tasks on three workers: bound 4/3,
LPT = OPT = 2). Since OPT <= round-robin, LPT is within ``4/3 - 1/(3n)`` of
round-robin, and on heavy-tailed inputs it wins or ties almost always.

Two baselines, and the difference matters. :func:`fifo_makespan` is
*round-robin* (task ``i`` on worker ``i % n``, agentdescent's name and
meaning): it ignores loads, so a long task stalls its worker's whole share.
:func:`list_makespan` is *greedy list scheduling in arrival order* (Graham
1966: each task, as it arrives, goes to the least-loaded worker), what any
work-conserving queue of ``n`` workers does, the engine's fifo admission
included; it is within ``2 - 1/n`` of OPT. LPT is list scheduling after
sorting longest-first, so the gain LPT brings over a real queue is the gap to
:func:`list_makespan`, much smaller than the gap to round-robin.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence


def _validate(weights: Sequence[float], n_workers: int) -> None:
    if n_workers < 1:
        raise ValueError(f"n_workers must be >= 1, got {n_workers!r}")
    for i, weight in enumerate(weights):
        if not (math.isfinite(weight) and weight >= 0):
            raise ValueError(f"weights[{i}] must be a finite number >= 0, got {weight!r}")


def lpt_schedule(weights: Sequence[float], n_workers: int) -> tuple[list[list[int]], float]:
    """Assign tasks to workers longest-first, each onto the least-loaded worker (T2).

    Deterministic: tasks of equal weight go in index order, and among equally
    loaded workers the lowest index wins. Runs in O(t log t + t log n).

    Args:
        weights: Estimated duration of each task (finite, >= 0), by task index.
        n_workers: How many workers run the tasks; at least 1.

    Returns:
        ``(assignment, makespan)``: ``assignment[w]`` lists the task indices of
        worker ``w`` in the order they were assigned, and ``makespan`` is the
        largest per-worker total weight.

    Raises:
        ValueError: ``n_workers < 1``, or a weight is negative or not finite.

    >>> lpt_schedule([3, 3, 2, 2, 2], n_workers=2)
    ([[0, 2, 4], [1, 3]], 7.0)
    >>> lpt_schedule([1, 5, 2], n_workers=2)
    ([[1], [2, 0]], 5.0)
    """
    _validate(weights, n_workers)
    order = sorted(range(len(weights)), key=lambda i: (-weights[i], i))
    # (load, worker) tuples: the heap breaks load ties by the lower worker index.
    heap = [(0.0, worker) for worker in range(n_workers)]
    assignment: list[list[int]] = [[] for _ in range(n_workers)]
    for task in order:
        load, worker = heapq.heappop(heap)
        assignment[worker].append(task)
        heapq.heappush(heap, (load + weights[task], worker))
    return assignment, max(load for load, _ in heap)


def fifo_makespan(weights: Sequence[float], n_workers: int) -> float:
    """Return the makespan of round-robin assignment: task ``i`` runs on worker ``i % n_workers``.

    Round-robin ignores loads (agentdescent's ``fifo_makespan``); compare with
    :func:`list_makespan` too, the baseline a real queue achieves (T2).

    Args:
        weights: Duration of each task (finite, >= 0), by task index.
        n_workers: How many workers run the tasks; at least 1.

    Raises:
        ValueError: ``n_workers < 1``, or a weight is negative or not finite.

    >>> fifo_makespan([2, 3, 2, 3, 2], n_workers=2)
    6.0
    """
    _validate(weights, n_workers)
    loads = [0.0] * n_workers
    for task, weight in enumerate(weights):
        loads[task % n_workers] += weight
    return max(loads)


def list_makespan(weights: Sequence[float], n_workers: int) -> float:
    """Return the makespan of greedy list scheduling in arrival order (T2's fair baseline).

    Each task, in index order, goes to the least-loaded worker (the lowest
    index among equally loaded ones): what a work-conserving queue of
    ``n_workers`` workers does. Graham (1966): within ``2 - 1/n_workers`` of
    the optimum, and at most ``total / n + (1 - 1/n) * max weight``.

    Args:
        weights: Duration of each task (finite, >= 0), by task index.
        n_workers: How many workers run the tasks; at least 1.

    Raises:
        ValueError: ``n_workers < 1``, or a weight is negative or not finite.

    >>> list_makespan([2, 3, 2, 3, 2], n_workers=2)
    6.0
    >>> list_makespan([5, 1, 1, 1, 5], n_workers=2), fifo_makespan([5, 1, 1, 1, 5], n_workers=2)
    (8.0, 11.0)
    """
    _validate(weights, n_workers)
    heap = [(0.0, worker) for worker in range(n_workers)]
    for weight in weights:
        load, worker = heapq.heappop(heap)
        heapq.heappush(heap, (load + weight, worker))
    return max(load for load, _ in heap)


def makespan_lower_bound(weights: Sequence[float], n_workers: int) -> float:
    """Return ``max(total / n_workers, max weight)``, below which no schedule can finish.

    Some worker carries at least the average load, and the longest task runs
    on some worker in one piece.

    Args:
        weights: Duration of each task (finite, >= 0), by task index.
        n_workers: How many workers run the tasks; at least 1.

    Raises:
        ValueError: ``n_workers < 1``, or a weight is negative or not finite.

    >>> makespan_lower_bound([1, 1, 1, 1], n_workers=3)
    1.3333333333333333
    """
    _validate(weights, n_workers)
    return max(math.fsum(weights) / n_workers, float(max(weights, default=0.0)))
