"""Ray benchmark: CPU-bound nodes on RayExecutor vs the local thread pool, and tailrace's overhead on Ray.

Run ``python bench/ray.py`` (needs the ``ray`` extra; about half a minute on 2
cores, most of it Ray's start; ``--quick`` for one timed run each). It starts a
local Ray with ``--num-cpus`` CPUs (default 2), or connects to ``--address``.
It prints two tables, then the targets of issue 11 as PASS/MISS lines:

1. 64 CPU-bound nodes (a pure-Python loop calibrated to about 50 ms here)
   between a source and a join: sync handlers in the engine's thread pool
   (the GIL keeps them on one core), against the same graph with the 64
   nodes on ``RayExecutor`` (source and join stay local). Target: >= 1.7x.
2. no-op nodes on Ray: tailrace's fan-out of N no-op nodes on
   ``RayExecutor`` against bare ``ray.remote`` tasks of the same function,
   submitted together and gathered with ``await``. Target: tailrace >= 0.8x
   of bare Ray's throughput.
3. ``async_evolve`` whose rollouts are CPU-bound (the same ~50 ms loop; 4
   workers, 32 training rollouts, a quarter of 16 tasks held out): ``run``,
   ``reward`` and ``propose`` on the evolution's daemon threads (the GIL keeps
   the rollouts on one core) against ``executor=RayExecutor`` (the merger and
   the ledger stay local). How many held-out rollouts the merges cost varies
   run to run, so this row compares seconds per rollout, training and
   held-out together. No target: it is reported.

Ray's worker processes are warmed by an untimed run first; each measurement
keeps the best of ``--repeat`` runs, tailrace and its baseline alternating.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _common import (
    Column,
    Repeat,
    Table,
    Target,
    environment,
    fmt_ratio,
    fmt_seconds,
    interleaved_best_of_async,
    targets_table,
)

import tailrace as tr
from tailrace.evolve import Edit, Task, async_evolve
from tailrace.executors import LocalExecutor, RayExecutor

# This file is named ray.py: drop its folder from the path (``_common`` is imported
# already) so that ``import ray``, here and in RayExecutor, finds Ray itself.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

CPU_NODES = 64
CPU_SECONDS = 0.050
NOOP_NODES = 400
EVOLVE_TASKS = 16
EVOLVE_ROLLOUTS = 32
EVOLVE_WORKERS = 4
RULES = {"a": "alpha", "b": "beta", "c": "gamma", "d": "delta"}


def spin(loops: int) -> int:
    """A pure-Python loop: it holds the GIL the whole time."""
    total = 0
    for i in range(loops):
        total += i * i % 7
    return total


def calibrate(seconds: float) -> int:
    """Loops of :func:`spin` that take about ``seconds`` here (best of five)."""
    loops = 100_000
    best = min(_timed_spin(loops) for _ in range(5))
    return max(1, int(loops * seconds / best))


def _timed_spin(loops: int) -> float:
    start = time.perf_counter()
    spin(loops)
    return time.perf_counter() - start


def cpu_node(loops: int) -> int:
    """A node handler: spin ``loops`` times (its input)."""
    return spin(loops)


def noop(x: Any) -> Any:
    """A node handler that does nothing."""
    return x


def source(x: Any) -> Any:
    """The fan-out's source: passes its input on."""
    return x


def join(xs: Any) -> int:
    """The fan-out's join: how many inputs arrived."""
    return len(xs)


def fan_out(name: str, width: int, worker: Any) -> tr.Graph:
    """source -> ``width`` x ``worker`` (on the executor named "work") -> join."""
    g = tr.Graph(name)
    g.add_node("source", source)
    g.add_node("join", join, "aggregate")
    for i in range(width):
        g.add_node(f"w{i}", worker, executor="work")
        g.add_edge("source", f"w{i}")
        g.add_edge(f"w{i}", "join")
    return g


def evolve_tasks(loops: int) -> list[Task]:
    """The evolution's tasks: each names its kind and how long its rollout spins."""
    kinds = sorted(RULES)
    return [
        Task(id=f"t{i}", prompt=f"task {i}", meta={"kind": kinds[i % len(kinds)], "loops": loops})
        for i in range(EVOLVE_TASKS)
    ]


def rollout(rendered: str, task: Task) -> str:
    """A CPU-bound rollout: spin, then answer what the rendered rules say for the task's kind."""
    spin(task.meta["loops"])
    for line in rendered.splitlines():
        key, _, value = line.partition(": ")
        if key == task.meta["kind"]:
            return value
    return "unknown"


def score(task: Task, output: str) -> float:
    """1 for the right rule's answer, else 0."""
    return 1.0 if output == RULES[task.meta["kind"]] else 0.0


def suggest(rendered: str, task: Task, output: str, reward: float) -> Edit | None:
    """The rule the task's kind needs, when the rollout got it wrong."""
    kind = task.meta["kind"]
    return None if reward == 1.0 else Edit(set={kind: RULES[kind]})


@dataclass(frozen=True, slots=True)
class Options:
    """Parsed command line."""

    repeat: int
    num_cpus: int
    address: str | None


@dataclass(frozen=True, slots=True)
class Pair:
    """One measurement: tailrace's best time against its baseline's."""

    label: str
    tailrace: float
    baseline: float
    runs: int


async def measure_cpu(ray_executor: RayExecutor, loops: int, repeat: Repeat) -> Pair:
    """Table 1: the same graph with its 64 nodes local (thread pool) and on Ray."""
    graph = fan_out("cpu", CPU_NODES, cpu_node)
    local = tr.Engine(executors={"work": LocalExecutor()})
    on_ray = tr.Engine(executors={"work": ray_executor})

    async def run_local() -> None:
        assert (await local.run(graph, loops)).output == CPU_NODES

    async def run_ray() -> None:
        assert (await on_ray.run(graph, loops)).output == CPU_NODES

    await run_ray()  # warm: Ray's workers start and import the handler
    ray_time, local_time = await interleaved_best_of_async([run_ray, run_local], repeat)
    return Pair("64 x 50 ms CPU-bound", ray_time.best, local_time.best, ray_time.runs)


async def measure_noop(ray_executor: RayExecutor, repeat: Repeat) -> Pair:
    """Table 2: N no-op nodes through tailrace on Ray against N bare Ray tasks."""
    import ray

    graph = fan_out("noop", NOOP_NODES, noop)
    engine = tr.Engine(executors={"work": ray_executor})
    bare = ray.remote(noop).options(max_retries=0)

    async def run_tailrace() -> None:
        assert (await engine.run(graph, 1)).output == NOOP_NODES

    async def run_bare() -> None:
        refs = [bare.remote(1) for _ in range(NOOP_NODES)]
        assert len(await asyncio.gather(*refs)) == NOOP_NODES

    await run_tailrace()
    await run_bare()
    ours, theirs = await interleaved_best_of_async([run_tailrace, run_bare], repeat)
    return Pair(f"{NOOP_NODES} no-op nodes", ours.best, theirs.best, ours.runs)


async def measure_evolution(ray_executor: RayExecutor, loops: int, repeat: Repeat) -> Pair:
    """Table 1's last row: async_evolve with CPU-bound rollouts, local threads and on Ray."""

    async def per_rollout(executor: RayExecutor | None) -> float:
        started = time.perf_counter()
        result = await async_evolve(
            evolve_tasks(loops),
            score,
            run=rollout,
            propose=suggest,
            workers=EVOLVE_WORKERS,
            max_rollouts=EVOLVE_ROLLOUTS,
            held_out_frac=0.25,
            executor=executor,
        )
        elapsed = time.perf_counter() - started
        assert result.errors == () and result.rollouts == EVOLVE_ROLLOUTS, result.errors
        return elapsed / (result.rollouts + result.eval_rollouts)

    await per_rollout(ray_executor)  # warm: Ray's workers import the functions
    on_ray: list[float] = []
    local: list[float] = []
    for _ in range(repeat.runs):  # alternating, like the other rows
        on_ray.append(await per_rollout(ray_executor))
        local.append(await per_rollout(None))
    label = f"async_evolve, {CPU_SECONDS * 1000:.0f} ms CPU-bound rollouts, s/rollout"
    return Pair(label, min(on_ray), min(local), len(on_ray))


def results_table(cpu: Pair, noop_pair: Pair, evolution: Pair, loops: int, opts: Options) -> Table:
    table = Table(
        "RayExecutor vs its baselines (best run of each)",
        [
            Column("workload"),
            Column("baseline"),
            Column("baseline time", right=True),
            Column("tailrace on Ray", right=True),
            Column("speed-up", right=True),
            Column("runs", right=True),
        ],
    )
    table.add_row(
        cpu.label,
        "local thread pool",
        fmt_seconds(cpu.baseline),
        fmt_seconds(cpu.tailrace),
        fmt_ratio(cpu.baseline / cpu.tailrace),
        cpu.runs,
    )
    table.add_row(
        noop_pair.label,
        "bare ray.remote",
        fmt_seconds(noop_pair.baseline),
        fmt_seconds(noop_pair.tailrace),
        fmt_ratio(noop_pair.baseline / noop_pair.tailrace),
        noop_pair.runs,
    )
    table.add_row(
        evolution.label,
        "local threads",
        fmt_seconds(evolution.baseline),
        fmt_seconds(evolution.tailrace),
        fmt_ratio(evolution.baseline / evolution.tailrace),
        evolution.runs,
    )
    where = opts.address or f"a local Ray with {opts.num_cpus} CPUs"
    table.add_note(f"Ray: {where}; {loops:,} loops of spin() per CPU-bound node")
    table.add_note(
        "speed-up = baseline time / tailrace time (for no-op nodes: relative throughput)"
    )
    table.add_note("source and join run locally; the workers run where the row says")
    table.add_note(
        f"async_evolve: {EVOLVE_WORKERS} workers, {EVOLVE_ROLLOUTS} training rollouts, "
        f"{EVOLVE_TASKS // 4} of {EVOLVE_TASKS} tasks held out; run, reward and propose on "
        "Ray, the merger and the ledger local; time per rollout (training + held-out)"
    )
    return table


def targets(cpu: Pair, noop_pair: Pair) -> Table:
    speed_up = cpu.baseline / cpu.tailrace
    relative = noop_pair.baseline / noop_pair.tailrace
    table = targets_table(
        [
            Target(
                "CPU-bound: Ray / local thread pool",
                fmt_ratio(speed_up),
                ">= 1.7x",
                speed_up >= 1.7,
            ),
            Target(
                "no-op: tailrace / bare Ray throughput",
                fmt_ratio(relative),
                ">= 0.8x",
                relative >= 0.8,
            ),
        ]
    )
    table.add_note("benchmarks report, they do not assert: a MISS does not fail the script")
    return table


async def run_all(opts: Options) -> None:
    """Measure both workloads, then print the tables."""
    print("tailrace Ray benchmark", flush=True)
    print(environment(no_gc=False), end="\n\n", flush=True)
    loops = calibrate(CPU_SECONDS)
    repeat = Repeat(runs=opts.repeat)
    init = {} if opts.address else {"num_cpus": opts.num_cpus}
    async with RayExecutor(opts.address, init=init) as ray_executor:
        cpu = await measure_cpu(ray_executor, loops, repeat)
        noop_pair = await measure_noop(ray_executor, repeat)
        evolution = await measure_evolution(ray_executor, loops, repeat)
    results_table(cpu, noop_pair, evolution, loops, opts).print()
    targets(cpu, noop_pair).print()


def parse_args(argv: Sequence[str] | None = None) -> Options:
    """Parse the command line into :class:`Options`."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("--repeat", type=int, default=3, help="timed runs of each (default 3)")
    parser.add_argument("--quick", action="store_true", help="one timed run of each")
    parser.add_argument("--num-cpus", type=int, default=2, help="CPUs of the local Ray (default 2)")
    parser.add_argument("--address", help="connect to this Ray cluster instead of starting one")
    args = parser.parse_args(argv)
    repeat = 1 if args.quick else max(1, args.repeat)
    return Options(repeat, args.num_cpus, args.address)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point: ``python bench/ray.py [--quick] [--repeat N] [--num-cpus N] [--address A]``."""
    asyncio.run(run_all(parse_args(argv)))


if __name__ == "__main__":
    main()
