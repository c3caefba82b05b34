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
   Rows: no stall; stalls without hedging; stalls with ``hedge=True`` backed up
   at the hedge delay (factor 2, and the engine default 3, until the key has
   enough observations); stalls with the hedge policy
   (:class:`tailrace.tail.HedgePolicy` with a 20% budget: clones at launch,
   backups ahead of queued work, a budget). Each row has its own engine,
   warmed up by two stall-free runs so its estimator knows the tasks (and its
   hedge delay is the p99 of their durations, relative to their estimates).
   Node latency is from a node's first ``NODE_STARTED`` to its
   ``NODE_COMPLETED`` (event timestamps from the bus), pooled over all
   measured runs. ``extra`` is the clones and backups started per run, and
   their share of all attempts.

   A stalled task of length ``l`` is detected at its hedge delay, ``r * l``
   (``r`` the p99 ratio of the durations to their estimates, at most
   ``factor``, read from the row's hooks after the warm-up), and its backup
   takes ``l`` more, so the threshold-hedged makespan is about
   ``max(longest, (1 + r) * longest stalled)``: the ``model`` column. No
   threshold rescues the longest task. The policy clones the tasks whose late
   backup would end past ``tolerance x longest`` and backs up the others at
   the same delay, so its model is
   ``max(longest, max over stalled, uncloned tasks of (1 + r) * l)``.

3. **Many runs at once.** 100 runs of ``src -> 8 branches x 5 steps -> join``
   (lognormal sleeps, sigma 1.2, a fresh seeded draw per run), all started
   together on one engine with ``capacity=8``, under ``admission="fifo"``,
   ``"priority"`` (branch priorities: the first branch highest) and ``"lpt"``
   (steps declare their length as ``cost``; the engine was warmed up by one
   run). Makespan is compared with the lower bound ``max(total / 8, longest)``
   of all nodes' planned sleeps, and, because every sleep overshoots by the
   event loop's timer granularity, also of the nodes' measured durations.

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

from _common import (
    Column,
    Table,
    Target,
    environment,
    fmt_ratio,
    fmt_seconds,
    load_average,
    targets_table,
)

import tailrace as tr
from tailrace.tail import HedgePolicy, TailHooks, makespan_lower_bound

WORKERS = 4
LPT_TASKS = 40
HEDGE_TASKS = 64
STALL_SHARE = 0.10
STALL_FACTOR = 20.0
WARMUPS = 2
LPT_TARGET = 1.05
HEDGE_TARGET = 1.5
EXTRA_TARGET = 0.20  # extra attempts / all attempts of the hedge policy
#: 6 of 64 tasks stall here (10%): the policy's budget must cover them and the clones.
POLICY = HedgePolicy(budget=0.2)
RUNS, BRANCHES, STEPS, RUN_CAPACITY = 100, 8, 5, 8
MANY_SIGMA = 1.2


@dataclass(frozen=True, slots=True)
class Config:
    """Sizes of one invocation (``--quick`` halves the times and the repetitions)."""

    seed: int
    bound_seconds: float  # table 1: lower bound of the makespan
    longest_seconds: float  # table 2: the longest task
    reps: int
    step_median: float  # table 3: median step sleep


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
    policy: HedgePolicy | None = None
    makespans: list[float] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    stragglers: int = 0
    hedges: int = 0
    attempts: int = 0
    model: float = 0.0
    #: The hedge delay over the estimate after the warm-up (the p99 ratio, at most factor).
    delay_ratio: float = 0.0

    @property
    def extra_share(self) -> float:
        """Clones and backups over all attempts started, over the measured runs."""
        return self.hedges / self.attempts if self.attempts else 0.0


async def measure_hedge_row(
    row: HedgeRow, seconds: list[float], lengths: list[float], draws: list[frozenset[str]]
) -> None:
    stalls = Stalls()
    graph = fan_out(row.name, seconds, lengths, stalls, hedge=row.hedge)
    tail = TailHooks(factor=row.factor, hedging=row.policy)
    engine = tr.Engine(straggler_factor=row.factor, tail=tail)
    for _ in range(WARMUPS):
        stalls.reset(frozenset())
        await engine.run(graph, 0)
    task = graph.nodes["t00"]
    delay = tail.hedge_delay(task, 0)
    assert delay is not None
    row.delay_ratio = delay.delay / delay.estimate
    latencies = Latencies(engine.bus)
    for stalled in draws:
        stalls.reset(stalled if row.stall else frozenset())
        made, result = await timed_run(engine, graph)
        row.makespans.append(made)
        row.stragglers += result.stragglers
        row.hedges += result.hedges
        row.attempts += len(graph.nodes) + result.hedges
    row.latencies = latencies.seconds


def hedge_model(row: HedgeRow, seconds: list[float], draws: list[frozenset[str]]) -> float:
    """Median over the draws of the makespan the formula in the module docstring predicts."""
    longest = max(seconds)
    by_id = {f"t{k:02d}": s for k, s in enumerate(seconds)}
    if not row.stall:
        return longest
    policy = row.policy
    if policy is not None:  # clones finish on time; the others are backed up at the delay
        return statistics.median(
            max(
                longest,
                *(
                    (1.0 + row.delay_ratio) * by_id[t]
                    for t in stalled
                    if not policy.clones_at_launch(by_id[t], longest)
                ),
            )
            for stalled in draws
        )
    stretch = 1.0 + row.delay_ratio if row.hedge else STALL_FACTOR
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
        HedgeRow("stalls, hedge at the delay (factor 2)", stall=True, hedge=True, factor=2.0),
        HedgeRow("stalls, hedge at the delay (factor 3)", stall=True, hedge=True, factor=3.0),
        HedgeRow("stalls, hedge policy", stall=True, hedge=True, factor=3.0, policy=POLICY),
    ]
    for row in rows:
        await measure_hedge_row(row, seconds, lengths, draws)
        row.model = hedge_model(row, seconds, draws)

    table = Table(
        f"2. hedging: {HEDGE_TASKS} lognormal(6.0, 0.9) sleeps, no capacity bound, "
        f"{n_stalled} of {HEDGE_TASKS} stall {STALL_FACTOR:g}x on the first attempt "
        f"(seed {cfg.seed}, {cfg.reps} measured runs)",
        columns("case", "p50 node", "p99 node", "makespan", "model", "/ no stall")
        + columns("stragglers", "extra/run", "extra share", first_left=False),
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
            f"{row.hedges / len(row.makespans):.1f}",
            f"{row.extra_share:.1%}",
        )
    table.add_note(
        f"longest task {fmt_seconds(max(seconds))}, median {fmt_seconds(statistics.median(seconds))}; "
        "model: see the module docstring; extra = clones + backups, share = extra / all attempts; "
        f"hedge delay after warm-up: {rows[-1].delay_ratio:.2f} x estimate"
    )
    table.add_note(f"hedge policy: {POLICY}; {load_average()}")
    targets = []
    for row in rows:
        if row.policy is None:  # the threshold rows are the baseline the policy must beat
            continue
        ratio = statistics.median(row.makespans) / baseline
        ok = ratio <= HEDGE_TARGET and row.extra_share <= EXTRA_TARGET
        targets.append(
            Target(
                f"{row.name.removeprefix('stalls, ')}: makespan / no stall, extra share",
                f"{fmt_ratio(ratio)}, {row.extra_share:.0%}",
                f"<= {HEDGE_TARGET}x, <= {EXTRA_TARGET:.0%}",
                ok,
            )
        )
    return table, targets


# -- table 3: many runs at once ----------------------------------------------------------


def branches_graph() -> tr.Graph:
    """8 independent chains of 5 steps joined by one aggregate; run ``r``'s sleeps come in
    its input (``{"d": [[seconds] * 5] * 8}``) and each step declares its sleep as ``cost``."""
    g = tr.Graph("many")
    lasts = []
    for b in range(BRANCHES):
        previous = None
        for k in range(STEPS):
            name = f"b{b}s{k}"

            async def step(run: Any, b: int = b, k: int = k) -> Any:
                await asyncio.sleep(run["d"][b][k])
                return run

            def cost(run: Any, b: int = b, k: int = k) -> float:
                return float(run["d"][b][k])

            g.add_node(name, step, cost=cost, estimate_key="step", priority=BRANCHES - b)
            if previous is not None:
                g.add_edge(previous, name)
            previous = name
        lasts.append(previous)
    g.add_node("join", lambda runs: len(runs), tr.NodeKind.AGGREGATE)
    for last in lasts:
        g.add_edge(last, "join")
    return g


def run_sleeps(rng: random.Random, median: float) -> list[list[float]]:
    """One run's sleeps: 8 x 5 lognormal(sigma 1.2) seconds with the given median."""
    return [
        [median * rng.lognormvariate(0.0, MANY_SIGMA) for _ in range(STEPS)]
        for _ in range(BRANCHES)
    ]


class NodeTimes:
    """Measured seconds of every node visit (NODE_STARTED to NODE_COMPLETED) from the bus."""

    def __init__(self, bus: tr.EventBus) -> None:
        self.started: dict[tuple[str, str | None], float] = {}
        self.seconds: list[float] = []
        self.unsubscribe = bus.subscribe(
            self._on_event, tr.EventType.NODE_STARTED, tr.EventType.NODE_COMPLETED
        )

    def _on_event(self, event: tr.Event) -> None:
        key = (event.run_id, event.node_id)
        if event.type is tr.EventType.NODE_STARTED:
            self.started[key] = event.ts
        elif event.node_id != "join":
            self.seconds.append(event.ts - self.started.pop(key))


@dataclass(slots=True)
class ManyRow:
    policy: str
    makespans: list[float] = field(default_factory=list)
    measured_bounds: list[float] = field(default_factory=list)


async def measure_many(
    policy: str, graph: tr.Graph, inputs: list[list[dict[str, Any]]], warmup: dict[str, Any]
) -> ManyRow:
    """``RUNS`` runs started together on one engine, once per entry of ``inputs``."""
    engine = tr.Engine(capacity=RUN_CAPACITY, admission=policy)
    await engine.run(graph, warmup)  # LPT learns its estimates; the others the same for fairness
    row = ManyRow(policy)
    for batch in inputs:
        times = NodeTimes(engine.bus)
        start = time.perf_counter()
        results = await asyncio.gather(*(engine.run(graph, run) for run in batch))
        row.makespans.append(time.perf_counter() - start)
        times.unsubscribe()
        if any(r.status != "completed" for r in results):
            raise RuntimeError(f"{policy}: a run did not complete")
        row.measured_bounds.append(makespan_lower_bound(times.seconds, RUN_CAPACITY))
    return row


async def many_runs_table(cfg: Config) -> tuple[Table, list[Target]]:
    rng = random.Random(cfg.seed + 3)
    graph = branches_graph()
    warmup = {"d": run_sleeps(rng, cfg.step_median)}
    repeats = 2 if cfg.reps >= 5 else 1
    inputs = [
        [{"d": run_sleeps(rng, cfg.step_median)} for _ in range(RUNS)] for _ in range(repeats)
    ]
    planned = [
        makespan_lower_bound([d for run in batch for br in run["d"] for d in br], RUN_CAPACITY)
        for batch in inputs
    ]
    rows = [await measure_many(p, graph, inputs, warmup) for p in ("fifo", "priority", "lpt")]
    table = Table(
        f"3. many runs at once: {RUNS} runs x ({BRANCHES} branches x {STEPS} lognormal steps, "
        f"median {fmt_seconds(cfg.step_median)}, sigma {MANY_SIGMA}) on one engine, "
        f"capacity {RUN_CAPACITY} ({repeats} draw(s), median)",
        columns("admission", "makespan", "/ bound (planned)", "/ bound (measured)"),
    )
    bound = statistics.median(planned)
    for row in rows:
        made = statistics.median(row.makespans)
        measured = statistics.median(
            m / b for m, b in zip(row.makespans, row.measured_bounds, strict=True)
        )
        table.add_row(
            row.policy, fmt_seconds(made), fmt_ratio(made / bound, 3), fmt_ratio(measured, 3)
        )
    table.add_row("lower bound max(total/8, max)", fmt_seconds(bound), fmt_ratio(1.0, 3), "")
    table.add_note(
        "planned: the bound of the sleeps asked for; measured: of the nodes' measured durations "
        "(each sleep overshoots by the loop's timer granularity, which no admission order can win back)"
    )
    table.add_note(load_average())
    lpt = rows[-1]
    ratio = statistics.median(lpt.makespans) / bound
    targets = [
        Target(
            f"{RUNS} runs, capacity {RUN_CAPACITY}: LPT makespan / lower bound (planned)",
            fmt_ratio(ratio, 3),
            f"<= {LPT_TARGET}x",
            ratio <= LPT_TARGET,
        )
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
    many, most = await many_runs_table(cfg)
    many.print()
    targets_table(targets + more + most).print()
    print(f"bench/tail.py took {fmt_seconds(time.perf_counter() - started)}")


def parse_args() -> Config:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="half the times and fewer runs")
    parser.add_argument("--seed", type=int, default=1, help="seed of task lengths and stalls")
    args = parser.parse_args()
    if args.quick:
        return Config(
            seed=args.seed, bound_seconds=0.5, longest_seconds=0.1, reps=2, step_median=0.005
        )
    return Config(seed=args.seed, bound_seconds=1.0, longest_seconds=0.2, reps=5, step_median=0.010)


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
