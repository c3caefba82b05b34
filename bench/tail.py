"""Long-tail benchmark: LPT admission (T2) and hedged stragglers (T3), measured on the engine.

Run as::

    python bench/tail.py [--quick] [--seed N]

Both tables are measured in the same run, on real ``asyncio.sleep`` handlers.

1. **Admission.** ``src -> 40 tasks -> join`` (an aggregate of all 40) under
   ``capacity=4``. Task lengths are lognormal(6.0, 0.9) with a fixed seed; a task
   sleeps ``unit * length`` seconds, with ``unit`` chosen so that the lower bound
   ``max(total / 4, longest)`` (:func:`tailrace.tail.makespan_lower_bound`) is
   about 1 s (0.5 s with ``--quick``). Every task declares ``cost=length`` and
   shares ``estimate_key="task"``, so one estimator learns ``seconds ~ b + m *
   cost`` online. The LPT engine is warmed up by two runs (the first one has no
   estimate, so it admits in arrival order, like fifo); the fifo engine needs
   none. ``model`` is greedy list scheduling of the exact sleep times in the
   order the policy admits them (fifo: definition order; LPT: longest first).
   Makespan is the wall time of ``Engine.run``, the median of the measured runs.

2. **Hedging.** ``src -> 64 tasks -> join`` with no capacity bound. Lengths are
   again lognormal(6.0, 0.9) (seeded), scaled so the longest task sleeps about
   0.2 s (0.1 s with ``--quick``). In each measured run a seeded 10% of the
   tasks (6 of 64, a fresh draw per run, the same draws for every row) stall 20x
   on their *first* attempt only; a hedge attempt of the same node is fast.
   Rows: no stall; stalls without hedging; stalls with ``hedge=True`` at
   straggler factor 2 and at the engine default 3. Each row has its own engine,
   warmed up by two stall-free runs so its estimator knows the tasks. Node
   latency is from a node's first ``NODE_STARTED`` to its ``NODE_COMPLETED``
   (event timestamps from the bus), pooled over all measured runs.

   A stalled task of length ``l`` is detected at ``factor * l`` and its backup
   takes ``l`` more, so the hedged makespan is about
   ``max(longest, (1 + factor) * longest stalled)``: the ``model`` column. With
   equal task lengths it could never come within 1.5x of the stall-free
   makespan (it is at least ``1 + factor`` times it); heavy-tailed lengths are
   what make the target reachable, and only when no long task stalls.

Nothing here asserts; the ``targets`` table reports PASS/MISS.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import math
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from _common import Column, Table, Target, environment, fmt_ratio, fmt_seconds, targets_table

import tailrace as tr
from tailrace.tail import makespan_lower_bound

WORKERS = 4
LPT_TASKS = 40
HEDGE_TASKS = 64
STALL_SHARE = 0.10
STALL_FACTOR = 20.0
WARMUPS = 2
LPT_TARGET = 1.05
HEDGE_TARGET = 1.5


@dataclass(frozen=True, slots=True)
class Config:
    """Sizes of one invocation (``--quick`` halves the times and the repetitions)."""

    seed: int
    bound_seconds: float  # table 1: lower bound of the makespan
    longest_seconds: float  # table 2: the longest task
    reps: int


def lognormal_lengths(rng: random.Random, n: int) -> list[float]:
    return [rng.lognormvariate(6.0, 0.9) for _ in range(n)]


def list_schedule(seconds: Sequence[float], order: Sequence[int], workers: int) -> float:
    """Makespan of starting tasks in ``order``, each on the first worker to become free."""
    free = [0.0] * workers
    for task in order:
        heapq.heappush(free, heapq.heappop(free) + seconds[task])
    return max(free)


def columns(*headers: str, first_left: bool = True) -> list[Column]:
    """Table columns: the first (a label) left-aligned, numbers right-aligned."""
    return [Column(h, right=not (first_left and k == 0)) for k, h in enumerate(headers)]


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


# -- the workload -------------------------------------------------------------------------


@dataclass(slots=True)
class Stalls:
    """Which tasks stall on their first attempt in the current run."""

    stalled: frozenset[str] = frozenset()
    started: set[str] = field(default_factory=set)

    def reset(self, stalled: frozenset[str]) -> None:
        self.stalled = stalled
        self.started = set()

    def first_attempt(self, name: str) -> bool:
        first = name not in self.started
        self.started.add(name)
        return first


def fan_out(
    name: str, seconds: Sequence[float], lengths: Sequence[float], stalls: Stalls, hedge: bool
) -> tr.Graph:
    """``src -> t00..tNN -> join``; task ``k`` sleeps ``seconds[k]`` and costs ``lengths[k]``."""
    g = tr.Graph(name)
    g.add_node("src", lambda x: x)
    g.add_node("join", lambda xs: len(xs), tr.NodeKind.AGGREGATE)
    for k, (sleep, length) in enumerate(zip(seconds, lengths, strict=True)):
        task_id = f"t{k:02d}"

        async def task(x: Any, task_id: str = task_id, sleep: float = sleep) -> float:
            stall = stalls.first_attempt(task_id) and task_id in stalls.stalled
            await asyncio.sleep(sleep * STALL_FACTOR if stall else sleep)
            return sleep

        g.add_node(task_id, task, cost=length, estimate_key="task", hedge=hedge)
        g.add_edge("src", task_id)
        g.add_edge(task_id, "join")
    return g


class Latencies:
    """Per node visit: first NODE_STARTED to NODE_COMPLETED, from bus events."""

    def __init__(self, bus: tr.EventBus) -> None:
        self.started: dict[tuple[str, str, int | None], float] = {}
        self.seconds: list[float] = []
        bus.subscribe(self._on_event, tr.EventType.NODE_STARTED, tr.EventType.NODE_COMPLETED)

    def _on_event(self, event: tr.Event) -> None:
        if event.node_id in ("src", "join"):
            return
        key = (event.run_id, event.node_id or "", event.visit)
        if event.type is tr.EventType.NODE_STARTED:
            self.started.setdefault(key, event.ts)
        else:
            self.seconds.append(event.ts - self.started[key])


async def timed_run(engine: tr.Engine, graph: tr.Graph) -> tuple[float, tr.RunResult]:
    start = time.perf_counter()
    result = await engine.run(graph, 0)
    return time.perf_counter() - start, result


# -- table 1: admission -------------------------------------------------------------------


async def admission_table(cfg: Config) -> tuple[Table, list[Target]]:
    lengths = lognormal_lengths(random.Random(cfg.seed), LPT_TASKS)
    unit = cfg.bound_seconds / makespan_lower_bound(lengths, WORKERS)
    seconds = [unit * length for length in lengths]
    bound = makespan_lower_bound(seconds, WORKERS)
    graph = fan_out("lpt", seconds, lengths, Stalls(), hedge=False)

    fifo = tr.Engine(capacity=WORKERS, admission="fifo")
    fifo_runs = [(await timed_run(fifo, graph))[0] for _ in range(cfg.reps)]
    lpt = tr.Engine(capacity=WORKERS, admission="lpt")
    cold = [(await timed_run(lpt, graph))[0] for _ in range(WARMUPS)]
    warm = [(await timed_run(lpt, graph))[0] for _ in range(cfg.reps)]

    in_order = list(range(LPT_TASKS))
    longest_first = sorted(in_order, key=lambda k: -seconds[k])
    table = Table(
        f"1. admission: {LPT_TASKS} lognormal(6.0, 0.9) sleeps on capacity {WORKERS} "
        f"(seed {cfg.seed}, unit {unit * 1e6:.1f} us/length, {cfg.reps} measured runs)",
        columns("policy", "runs", "makespan", "model", "/ bound"),
    )
    rows = [
        ("fifo", fifo_runs, list_schedule(seconds, in_order, WORKERS)),
        ("lpt, 1st warm-up (no estimate)", cold[:1], list_schedule(seconds, in_order, WORKERS)),
        ("lpt, after warm-up", warm, list_schedule(seconds, longest_first, WORKERS)),
    ]
    for name, runs, model in rows:
        made = statistics.median(runs)
        table.add_row(
            name, len(runs), fmt_seconds(made), fmt_seconds(model), fmt_ratio(made / bound)
        )
    table.add_row("lower bound max(total/4, max)", "", fmt_seconds(bound), "", fmt_ratio(1.0))
    table.add_note(
        f"total work {fmt_seconds(sum(seconds))}, longest task {fmt_seconds(max(seconds))}"
    )
    lpt_ratio = statistics.median(warm) / bound
    targets = [
        Target(
            "LPT warm makespan / lower bound",
            fmt_ratio(lpt_ratio, 3),
            f"<= {LPT_TARGET}x",
            lpt_ratio <= LPT_TARGET,
        ),
    ]
    return table, targets


# -- table 2: hedging ---------------------------------------------------------------------


@dataclass(slots=True)
class HedgeRow:
    name: str
    stall: bool
    hedge: bool
    factor: float
    makespans: list[float] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    stragglers: int = 0
    hedges: int = 0
    model: float = 0.0


async def measure_hedge_row(
    row: HedgeRow, seconds: list[float], lengths: list[float], draws: list[frozenset[str]]
) -> None:
    stalls = Stalls()
    graph = fan_out(row.name, seconds, lengths, stalls, hedge=row.hedge)
    engine = tr.Engine(straggler_factor=row.factor)
    for _ in range(WARMUPS):
        stalls.reset(frozenset())
        await engine.run(graph, 0)
    latencies = Latencies(engine.bus)
    for stalled in draws:
        stalls.reset(stalled if row.stall else frozenset())
        made, result = await timed_run(engine, graph)
        row.makespans.append(made)
        row.stragglers += result.stragglers
        row.hedges += result.hedges
    row.latencies = latencies.seconds


def hedge_model(row: HedgeRow, seconds: list[float], draws: list[frozenset[str]]) -> float:
    """Median over the draws of the makespan the formula in the module docstring predicts."""
    longest = max(seconds)
    by_id = {f"t{k:02d}": s for k, s in enumerate(seconds)}
    if not row.stall:
        return longest
    stretch = 1.0 + row.factor if row.hedge else STALL_FACTOR
    return statistics.median(
        max(longest, *(stretch * by_id[t] for t in stalled)) for stalled in draws
    )


async def hedging_table(cfg: Config) -> tuple[Table, list[Target]]:
    lengths = lognormal_lengths(random.Random(cfg.seed + 1), HEDGE_TASKS)
    unit = cfg.longest_seconds / max(lengths)
    seconds = [unit * length for length in lengths]
    ids = [f"t{k:02d}" for k in range(HEDGE_TASKS)]
    n_stalled = round(STALL_SHARE * HEDGE_TASKS)
    draw_rng = random.Random(cfg.seed + 2)
    draws = [frozenset(draw_rng.sample(ids, n_stalled)) for _ in range(cfg.reps)]
    rows = [
        HedgeRow("no stall", stall=False, hedge=False, factor=3.0),
        HedgeRow("stalls, no hedge", stall=True, hedge=False, factor=3.0),
        HedgeRow("stalls, hedge, factor 2", stall=True, hedge=True, factor=2.0),
        HedgeRow("stalls, hedge, factor 3", stall=True, hedge=True, factor=3.0),
    ]
    for row in rows:
        await measure_hedge_row(row, seconds, lengths, draws)
        row.model = hedge_model(row, seconds, draws)

    table = Table(
        f"2. hedging: {HEDGE_TASKS} lognormal(6.0, 0.9) sleeps, no capacity bound, "
        f"{n_stalled} of {HEDGE_TASKS} stall {STALL_FACTOR:g}x on the first attempt "
        f"(seed {cfg.seed}, {cfg.reps} measured runs)",
        columns("case", "p50 node", "p99 node", "makespan", "model", "/ no stall")
        + columns("stragglers", "hedges", first_left=False),
    )
    baseline = statistics.median(rows[0].makespans)
    for row in rows:
        made = statistics.median(row.makespans)
        table.add_row(
            row.name,
            fmt_seconds(percentile(row.latencies, 50)),
            fmt_seconds(percentile(row.latencies, 99)),
            fmt_seconds(made),
            fmt_seconds(row.model),
            fmt_ratio(made / baseline),
            row.stragglers,
            row.hedges,
        )
    table.add_note(
        f"longest task {fmt_seconds(max(seconds))}, median {fmt_seconds(statistics.median(seconds))}; "
        "model = median over runs of max(longest, (1+factor) x longest stalled) when hedged"
    )
    targets = [
        Target(
            f"hedged makespan / no stall ({row.name.split(', ')[-1]})",
            fmt_ratio(statistics.median(row.makespans) / baseline),
            f"<= {HEDGE_TARGET}x",
            statistics.median(row.makespans) / baseline <= HEDGE_TARGET,
        )
        for row in rows
        if row.hedge
    ]
    return table, targets


# -- main ---------------------------------------------------------------------------------


async def main(cfg: Config) -> None:
    started = time.perf_counter()
    print(environment(no_gc=False), end="\n\n", flush=True)
    admission, targets = await admission_table(cfg)
    admission.print()
    hedging, more = await hedging_table(cfg)
    hedging.print()
    targets_table(targets + more).print()
    print(f"bench/tail.py took {fmt_seconds(time.perf_counter() - started)}")


def parse_args() -> Config:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="half the times and fewer runs")
    parser.add_argument("--seed", type=int, default=1, help="seed of task lengths and stalls")
    args = parser.parse_args()
    if args.quick:
        return Config(seed=args.seed, bound_seconds=0.5, longest_seconds=0.1, reps=2)
    return Config(seed=args.seed, bound_seconds=1.0, longest_seconds=0.2, reps=5)


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
