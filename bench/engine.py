"""In-memory engine benchmark: tailrace vs bare asyncio vs LangGraph, measured in one run.

Run ``python bench/engine.py`` (a few minutes on 2 cores, more when loaded;
``--quick`` for a fast pass). It prints four tables, then the budget of
DESIGN.md "Performance budget" as PASS/MISS lines:

1. throughput of no-op graphs (a chain, and a fan-out from one source to
   N-2 workers joined by one aggregate) at each size, against the bare asyncio
   floor measured in the same process (the chain creates and awaits one task
   at a time; the fan-out creates all tasks and awaits them with
   ``asyncio.gather``), and the per-node cost at each size relative to the
   smallest (it should stay flat);
2. the same workloads on LangGraph when installed, with the same untimed
   warm-up and the same number of timed runs as tailrace had for that cell;
   each run is stopped at ``--langgraph-limit`` seconds, and a size whose
   warm-up plus runs, extrapolated quadratically from the last size
   (LangGraph's cost per node grows with the graph), would take more than
   ``--langgraph-budget`` seconds is skipped;
3. a heavy-tailed 8 x 5 graph of ``asyncio.sleep`` steps (lognormal, seed 7):
   makespan over critical path, where LangGraph's superstep barrier applies
   (both engines: one warm-up, the same number of runs);
4. the README example: a first-answer merge (``aggregate(required=1)``) over a
   10 ms branch and a 0.5 s straggler, with ``late="record"`` (the run waits
   for the straggler) and ``late="cancel"`` (the straggler is cancelled once
   the merge fired).

Graphs are built and compiled before timing, and every timed section starts
with ``gc.collect()``. Every cell reports the median of its runs (the "runs"
columns say how many): tailrace and bare asyncio alternate, at least
``--repeat`` rounds and more until a second is spent. gc stays enabled unless
``--no-gc`` turns it off inside timed sections, for tailrace and the baselines
alike. The machine may be shared: each table prints the load average.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import operator
import random
import statistics
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Annotated, Any, Protocol, TypedDict

from _common import (
    Column,
    Repeat,
    Table,
    Target,
    Timing,
    best_of_async,
    environment,
    fmt_ratio,
    fmt_seconds,
    fmt_size,
    interleaved_best_of_async,
    load_average,
    parse_sizes,
    targets_table,
)

import tailrace as tr

WORKLOADS = ("chain", "fan-out")
DEFAULT_SIZES = "1000,10000,100000"
QUICK_SIZES = "1000,10000"
BARE_FLOOR_SHARE = 0.5  # tailrace nodes/s must reach half of bare asyncio tasks/s
FLAT_COST_LIMIT = 1.2  # per-node cost at the largest size vs the smallest
TAIL_LIMIT = 1.05  # heavy-tail makespan vs critical path
TAIL_BRANCHES, TAIL_STEPS = 8, 5
TAIL_SEED, TAIL_SIGMA, TAIL_MEDIAN = 7, 1.2, 0.010
LANGGRAPH_CALIBRATION = 1000  # nodes of an untabulated run used to extrapolate a first size
THROUGHPUT_MIN_TIME = 1.0  # seconds: small sizes are repeated until this much is spent
THROUGHPUT_MAX_RUNS = 25
LATE_FAST, LATE_SLOW = 0.01, 0.5  # the README example's branches (seconds)
LATE_TARGET = 0.02  # late="cancel" returns within 2x its fast branch


# -- handlers -------------------------------------------------------------------


async def noop(payload: Any) -> Any:
    """A tailrace no-op node (and the bare-asyncio task body)."""
    return payload


async def one(payload: Any) -> int:
    """A tailrace fan-out worker: its 1 is collected by the join."""
    return 1


# -- tailrace graphs --------------------------------------------------------------


def _add_edges(graph: tr.Graph, pairs: Sequence[tuple[str, str]]) -> None:
    for source, target in pairs:
        graph.add_edge(source, target)


def tailrace_chain(n: int) -> tr.Graph:
    """``n0 -> n1 -> ... -> n{n-1}``, every node a no-op; compiled."""
    graph = tr.Graph(f"chain-{n}")
    names = [f"n{i}" for i in range(n)]
    for name in names:
        graph.add_node(name, noop)
    _add_edges(graph, list(itertools.pairwise(names)))
    graph.compile()
    return graph


def tailrace_fanout(n: int) -> tr.Graph:
    """``source -> w0..w{n-3} -> join``: ``n`` nodes, one aggregate with required=n-2; compiled."""
    graph = tr.Graph(f"fanout-{n}")
    workers = [f"w{i}" for i in range(n - 2)]
    graph.add_node("source", noop)
    for name in workers:
        graph.add_node(name, one)
    graph.add_node("join", noop, tr.NodeKind.AGGREGATE, required=len(workers))
    _add_edges(graph, [("source", w) for w in workers] + [(w, "join") for w in workers])
    graph.compile()
    return graph


def _sleeper(seconds: float) -> Callable[[Any], Awaitable[Any]]:
    async def step(payload: Any) -> Any:
        await asyncio.sleep(seconds)
        return payload

    return step


def tailrace_heavy_tail(delays: Sequence[Sequence[float]]) -> tr.Graph:
    """``source -> branch b: step 0..4 (sleeps) -> join`` for each branch; compiled."""
    graph = tr.Graph("heavy-tail")
    graph.add_node("source", noop)
    pairs: list[tuple[str, str]] = []
    for b, branch in enumerate(delays):
        previous = "source"
        for k, seconds in enumerate(branch):
            name = f"b{b}s{k}"
            graph.add_node(name, _sleeper(seconds))
            pairs.append((previous, name))
            previous = name
        pairs.append((previous, "join"))
    graph.add_node("join", noop, tr.NodeKind.AGGREGATE, required=len(delays))
    _add_edges(graph, pairs)
    graph.compile()
    return graph


def tailrace_runner(graph: tr.Graph) -> Callable[[], Awaitable[object]]:
    """A zero-argument coroutine function running ``graph`` on a fresh in-memory engine."""
    engine = tr.Engine()

    async def run() -> object:
        return await engine.run(graph)

    return run


async def check_tailrace(graph: tr.Graph) -> None:
    """Run once untimed (warm-up) and make sure every node completed."""
    result = await tr.Engine().run(graph)
    if result.status != "completed" or len(result.results) != len(graph.nodes):
        raise RuntimeError(f"{graph.name}: {result.status}, {len(result.results)} results")


# -- bare asyncio baselines -----------------------------------------------------------


def bare_runner(workload: str, n: int) -> Callable[[], Awaitable[object]]:
    """The asyncio floor for ``workload``: ``n`` tasks, sequential (chain) or all at once."""

    async def chain() -> None:
        loop = asyncio.get_running_loop()
        for _ in range(n):
            await loop.create_task(noop(None))

    async def fanout() -> None:
        loop = asyncio.get_running_loop()
        await asyncio.gather(*[loop.create_task(noop(None)) for _ in range(n)])

    return chain if workload == "chain" else fanout


# -- LangGraph --------------------------------------------------------------------


class FanState(TypedDict, total=False):
    """LangGraph state: workers append to ``items`` through a list reducer."""

    items: Annotated[list[int], operator.add]


async def lg_noop(state: FanState) -> None:
    """A LangGraph no-op node (no state update)."""
    return None


async def lg_one(state: FanState) -> FanState:
    """A LangGraph fan-out worker: appends 1 to ``items``."""
    return {"items": [1]}


def langgraph_version() -> str | None:
    """The installed LangGraph version, or None when it is not installed."""
    try:
        import langgraph.graph  # noqa: F401
    except ImportError:
        return None
    try:
        return version("langgraph")
    except PackageNotFoundError:
        return "?"


def langgraph_chain(n: int) -> Any:
    """A compiled LangGraph chain of ``n`` no-op nodes."""
    from langgraph.graph import END, START, StateGraph

    builder = StateGraph(FanState)
    names = [f"n{i}" for i in range(n)]
    for name in names:
        builder.add_node(name, lg_noop)
    for source, target in zip([START, *names], [*names, END], strict=True):
        builder.add_edge(source, target)
    return builder.compile()


def langgraph_fanout(n: int) -> Any:
    """A compiled LangGraph ``source -> n-2 parallel workers -> join`` (a waiting edge)."""
    from langgraph.graph import END, START, StateGraph

    builder = StateGraph(FanState)
    workers = [f"w{i}" for i in range(n - 2)]
    builder.add_node("source", lg_noop)
    for name in workers:
        builder.add_node(name, lg_one)
        builder.add_edge("source", name)
    builder.add_node("join", lg_noop)
    builder.add_edge(START, "source")
    builder.add_edge(workers, "join")
    builder.add_edge("join", END)
    return builder.compile()


class LangGraphNode(Protocol):
    """A LangGraph node function (its parameter must be named ``state``)."""

    def __call__(self, state: FanState) -> Coroutine[Any, Any, None]: ...


def _lg_sleeper(seconds: float) -> LangGraphNode:
    async def step(state: FanState) -> None:
        await asyncio.sleep(seconds)

    return step


def langgraph_heavy_tail(delays: Sequence[Sequence[float]]) -> Any:
    """The 8 x 5 heavy-tailed graph on LangGraph (branches joined by a waiting edge)."""
    from langgraph.graph import END, START, StateGraph

    builder = StateGraph(FanState)
    builder.add_node("source", lg_noop)
    builder.add_edge(START, "source")
    lasts = []
    for b, branch in enumerate(delays):
        previous = "source"
        for k, seconds in enumerate(branch):
            name = f"b{b}s{k}"
            builder.add_node(name, _lg_sleeper(seconds))
            builder.add_edge(previous, name)
            previous = name
        lasts.append(previous)
    builder.add_node("join", lg_noop)
    builder.add_edge(lasts, "join")
    builder.add_edge("join", END)
    return builder.compile()


def langgraph_runner(app: Any, n: int) -> Callable[[], Awaitable[object]]:
    """A zero-argument coroutine function: ``app.ainvoke`` in memory, recursion limit above n."""
    config = {"recursion_limit": n + 10}

    async def run() -> object:
        return await app.ainvoke({"items": []}, config)

    return run


LANGGRAPH_BUILDERS: dict[str, Callable[[int], Any]] = {
    "chain": langgraph_chain,
    "fan-out": langgraph_fanout,
}
TAILRACE_BUILDERS: dict[str, Callable[[int], tr.Graph]] = {
    "chain": tailrace_chain,
    "fan-out": tailrace_fanout,
}


# -- measurements -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Options:
    """Command-line options."""

    sizes: list[int]
    repeat: int
    no_gc: bool
    langgraph_limit: float
    langgraph_budget: float


@dataclass(frozen=True, slots=True)
class Throughput:
    """tailrace and bare asyncio on one workload and size."""

    workload: str
    nodes: int
    tailrace: Timing
    bare: Timing

    @property
    def share(self) -> float:
        """tailrace nodes/s over bare asyncio tasks/s, medians (1.0 would be no overhead)."""
        return self.bare.median / self.tailrace.median


@dataclass(frozen=True, slots=True)
class LangGraphResult:
    """LangGraph on one workload and size: a timing, or why it was skipped."""

    workload: str
    nodes: int
    timing: Timing | None
    note: str = ""


@dataclass(frozen=True, slots=True)
class TailResult:
    """One engine's makespan on the heavy-tailed graph."""

    engine: str
    timing: Timing | None
    note: str = ""


async def measure_throughput(workload: str, n: int, opts: Options) -> Throughput:
    """tailrace and bare asyncio on ``workload`` at ``n`` nodes, timed in alternation."""
    graph = TAILRACE_BUILDERS[workload](n)
    await check_tailrace(graph)
    bare_run = bare_runner(workload, n)
    await bare_run()  # warm-up, as check_tailrace is for tailrace
    repeat = Repeat(runs=opts.repeat, min_time=THROUGHPUT_MIN_TIME, max_runs=THROUGHPUT_MAX_RUNS)
    tailrace, bare = await interleaved_best_of_async(
        [tailrace_runner(graph), bare_run], repeat, no_gc=opts.no_gc
    )
    return Throughput(workload, n, tailrace, bare)


async def fixed_runs(fn: Callable[[], Awaitable[object]], runs: int, opts: Options) -> Timing:
    """One untimed warm-up call of ``fn``, then exactly ``runs`` timed ones."""
    await fn()
    return await best_of_async(fn, Repeat(runs=runs, max_runs=runs), no_gc=opts.no_gc)


async def time_langgraph(workload: str, n: int, runs: int, opts: Options) -> Timing | None:
    """LangGraph on ``workload`` at ``n`` nodes: a warm-up, then ``runs`` timed runs;
    None if one passes ``langgraph_limit``."""
    run = langgraph_runner(LANGGRAPH_BUILDERS[workload](n), n)

    async def run_with_deadline() -> object:
        async with asyncio.timeout(opts.langgraph_limit):
            return await run()

    try:
        return await fixed_runs(run_with_deadline, runs, opts)
    except TimeoutError:
        return None


async def measure_langgraph(
    workload: str, rows: Sequence[Throughput], opts: Options
) -> list[LangGraphResult]:
    """LangGraph at every size with tailrace's warm-up and number of runs for that cell;
    sizes it could not finish within ``langgraph_budget`` are skipped, with the estimate."""
    results: list[LangGraphResult] = []
    known: tuple[int, float] | None = None  # (nodes, seconds) of the largest finished run
    limit, budget = opts.langgraph_limit, opts.langgraph_budget
    for n in opts.sizes:
        runs = next(r.tailrace.runs for r in rows if r.workload == workload and r.nodes == n)
        if known is None and n > LANGGRAPH_CALIBRATION:
            calibration = await time_langgraph(workload, LANGGRAPH_CALIBRATION, 1, opts)
            known = (LANGGRAPH_CALIBRATION, calibration.median) if calibration else (1, limit)
        estimate = known[1] * (n / known[0]) ** 2 if known else 0.0
        if (
            (runs + 1) * estimate > budget
            or estimate > limit
            or (results and not results[-1].timing)
        ):
            note = f"skipped: est. {fmt_seconds(estimate)} x {runs + 1} runs > {budget:g} s"
            results.append(LangGraphResult(workload, n, None, note))
            continue
        timing = await time_langgraph(workload, n, runs, opts)
        if timing is None:
            note = f"stopped at the {limit:g} s limit (est. {fmt_seconds(estimate)})"
            results.append(LangGraphResult(workload, n, None, note))
            continue
        known = (n, timing.median)
        results.append(LangGraphResult(workload, n, timing))
    return results


def tail_delays() -> list[list[float]]:
    """8 branches x 5 steps of lognormal seconds (seed 7), scaled to a 10 ms median step."""
    rng = random.Random(TAIL_SEED)
    raw = [rng.lognormvariate(0.0, TAIL_SIGMA) for _ in range(TAIL_BRANCHES * TAIL_STEPS)]
    scale = TAIL_MEDIAN / statistics.median(raw)
    flat = [d * scale for d in raw]
    return [flat[b * TAIL_STEPS : (b + 1) * TAIL_STEPS] for b in range(TAIL_BRANCHES)]


def critical_path(delays: Sequence[Sequence[float]]) -> float:
    """The longest branch: no schedule can finish sooner."""
    return max(sum(branch) for branch in delays)


def superstep_bound(delays: Sequence[Sequence[float]]) -> float:
    """Sum over steps of the slowest branch's step: the best a barrier per step allows."""
    return sum(max(branch[k] for branch in delays) for k in range(len(delays[0])))


async def measure_heavy_tail(delays: list[list[float]], opts: Options) -> list[TailResult]:
    """Makespan of the heavy-tailed graph on tailrace and (when installed) LangGraph:
    each engine gets one warm-up and the same number of timed runs."""
    graph = tailrace_heavy_tail(delays)
    await check_tailrace(graph)
    runs = max(opts.repeat, 5)
    results = [TailResult("tailrace", await fixed_runs(tailrace_runner(graph), runs, opts))]
    if langgraph_version() is None:
        return [*results, TailResult("LangGraph", None, "not installed")]
    run = langgraph_runner(langgraph_heavy_tail(delays), len(graph.nodes))
    return [*results, TailResult("LangGraph", await fixed_runs(run, runs, opts))]


def readme_graph(late: str) -> tr.Graph:
    """The README example: fetch -> (search 10 ms, blame 0.5 s) -> answer (first of them)."""
    g = tr.Graph(f"triage-{late}")

    async def fetch(ticket: str) -> str:
        return f"logs for {ticket}"

    async def search(logs: str) -> str:
        await asyncio.sleep(LATE_FAST)
        return f"similar issues to {logs}"

    async def blame(logs: str) -> str:
        await asyncio.sleep(LATE_SLOW)
        return f"commit behind {logs}"

    g.add_node("fetch", fetch)
    g.add_node("search", search)
    g.add_node("blame", blame)
    g.add_node("answer", lambda findings: findings[0], tr.NodeKind.AGGREGATE, required=1, late=late)
    _add_edges(
        graph=g,
        pairs=[("fetch", "search"), ("fetch", "blame"), ("search", "answer"), ("blame", "answer")],
    )
    g.compile()
    return g


async def measure_late(opts: Options) -> list[TailResult]:
    """``Engine.run`` wall time of the README example with late="record" and late="cancel"."""
    runs = max(opts.repeat, 5)
    out = []
    for late in ("record", "cancel"):
        graph = readme_graph(late)
        engine = tr.Engine()

        async def run(graph: tr.Graph = graph, engine: tr.Engine = engine) -> object:
            result = await engine.run(graph, "TICKET-7")
            if result.output != "similar issues to logs for TICKET-7":
                raise RuntimeError(f"{graph.name}: output {result.output!r}")
            return result

        out.append(TailResult(f'late="{late}"', await fixed_runs(run, runs, opts)))
    return out


# -- report ---------------------------------------------------------------------------


def base_size(opts: Options) -> int:
    """The size per-node costs are compared with (the smallest)."""
    return min(opts.sizes)


def throughput_table(rows: Sequence[Throughput], opts: Options) -> Table:
    """Table 1: nodes/s, bare asyncio tasks/s, their ratio and per-node cost growth."""
    base = fmt_size(base_size(opts))
    table = Table(
        "1. in-memory throughput, tailrace vs bare asyncio (median run of each)",
        [
            Column("workload"),
            Column("nodes", right=True),
            Column("tailrace nodes/s", right=True),
            Column("bare tasks/s", right=True),
            Column("tailrace/bare", right=True),
            Column("tailrace us/node", right=True),
            Column(f"cost vs {base}", right=True),
            Column(f"bare cost vs {base}", right=True),
            Column("excess", right=True),
            Column("runs", right=True),
        ],
    )
    for row in rows:
        first = next(r for r in rows if r.workload == row.workload and r.nodes == base_size(opts))
        table.add_row(*_throughput_cells(row, first))
    table.add_note("chain: one node (task) at a time; fan-out: source -> n-2 workers -> 1 join")
    table.add_note("bare: create+await one task at a time (chain), create all then gather them")
    table.add_note(
        f"tailrace/bare = tailrace nodes/s / bare tasks/s (target >= {BARE_FLOOR_SHARE})"
    )
    table.add_note(
        f"cost vs {base}: us/node relative to {base} (target <= {FLAT_COST_LIMIT}x at the largest "
        "size); excess = tailrace's growth / bare asyncio's growth"
    )
    table.add_note(
        f"runs: tailrace + bare runs, alternated, each after an untimed warm-up: at least "
        f"{opts.repeat}, more until {THROUGHPUT_MIN_TIME:g} s is spent (at most "
        f"{THROUGHPUT_MAX_RUNS}); the median is kept; " + load_average()
    )
    return table


def _throughput_cells(row: Throughput, first: Throughput) -> list[str]:
    growth = _cost_growth(row.tailrace, row.nodes, first.tailrace, first.nodes)
    bare_growth = _cost_growth(row.bare, row.nodes, first.bare, first.nodes)
    return [
        row.workload,
        fmt_size(row.nodes),
        f"{row.tailrace.rate(row.nodes):,.0f}",
        f"{row.bare.rate(row.nodes):,.0f}",
        f"{row.share:.2f}",
        f"{row.tailrace.per_item(row.nodes) * 1e6:.2f}",
        fmt_ratio(growth),
        fmt_ratio(bare_growth),
        fmt_ratio(growth / bare_growth),
        f"{row.tailrace.runs}+{row.bare.runs}",
    ]


def _cost_growth(timing: Timing, n: int, base: Timing, base_n: int) -> float:
    return timing.per_item(n) / base.per_item(base_n)


def langgraph_table(
    lg: Sequence[LangGraphResult],
    rows: Sequence[Throughput],
    lg_version: str | None,
    opts: Options,
) -> Table:
    """Table 2: LangGraph nodes/s and how many times faster tailrace is."""
    table = Table(
        f"2. LangGraph {lg_version or '(not installed)'}, in memory, ainvoke, no checkpointer",
        [
            Column("workload"),
            Column("nodes", right=True),
            Column("LangGraph nodes/s", right=True),
            Column("tailrace/LangGraph", right=True),
            Column("runs", right=True),
            Column("note"),
        ],
    )
    if lg_version is None:
        table.add_note("LangGraph is not installed: pip install langgraph")
        return table
    for res in lg:
        ours = next(r for r in rows if r.workload == res.workload and r.nodes == res.nodes)
        if res.timing is None:
            table.add_row(res.workload, fmt_size(res.nodes), "-", "-", "0", res.note)
            continue
        speedup = ours.tailrace.rate(res.nodes) / res.timing.rate(res.nodes)
        table.add_row(
            res.workload,
            fmt_size(res.nodes),
            f"{res.timing.rate(res.nodes):,.0f}",
            fmt_ratio(speedup, 1),
            str(res.timing.runs),
            res.note,
        )
    limit, budget = opts.langgraph_limit, opts.langgraph_budget
    table.add_note("fan-out joins with a waiting edge; workers append to a list reducer")
    table.add_note(
        "runs: one untimed warm-up, then as many timed runs as tailrace had for that cell; "
        "the median is reported (tailrace/LangGraph: medians)"
    )
    table.add_note(
        f"each run is stopped at --langgraph-limit ({limit:g} s); a size whose warm-up and runs, "
        f"extrapolated quadratically from the last size, pass --langgraph-budget ({budget:g} s) "
        "is skipped"
    )
    table.add_note(load_average())
    return table


def tail_table(results: Sequence[TailResult], delays: Sequence[Sequence[float]]) -> Table:
    """Table 3: heavy-tailed makespan against the critical path."""
    path, barrier = critical_path(delays), superstep_bound(delays)
    flat = [d for branch in delays for d in branch]
    table = Table(
        f"3. heavy tail: {TAIL_BRANCHES} branches x {TAIL_STEPS} asyncio.sleep steps, "
        f"lognormal(sigma={TAIL_SIGMA}, seed {TAIL_SEED})",
        [
            Column("engine"),
            Column("makespan", right=True),
            Column("critical path", right=True),
            Column("makespan/critical", right=True),
            Column("runs", right=True),
            Column("note"),
        ],
    )
    for res in results:
        if res.timing is None:
            table.add_row(res.engine, "-", fmt_seconds(path), "-", "0", res.note)
            continue
        table.add_row(
            res.engine,
            fmt_seconds(res.timing.median),
            fmt_seconds(path),
            fmt_ratio(res.timing.median / path, 3),
            str(res.timing.runs),
            res.note,
        )
    table.add_note(
        f"steps: median {fmt_seconds(statistics.median(flat))}, max {fmt_seconds(max(flat))}; "
        f"critical path = longest branch = {fmt_seconds(path)}"
    )
    table.add_note(
        f"a barrier after every step cannot beat {fmt_seconds(barrier)} "
        f"({fmt_ratio(barrier / path)} of the critical path)"
    )
    table.add_note("both engines: one untimed warm-up, the same number of runs, the median")
    table.add_note(load_average())
    return table


def late_table(results: Sequence[TailResult]) -> Table:
    """Table 4: the README example, the straggler recorded or cancelled."""
    table = Table(
        f"4. README example: first answer of a {fmt_seconds(LATE_FAST)} branch and a "
        f"{fmt_seconds(LATE_SLOW)} straggler (aggregate required=1)",
        [Column("late"), Column("Engine.run", right=True), Column("runs", right=True)],
    )
    for res in results:
        assert res.timing is not None
        table.add_row(res.engine, fmt_seconds(res.timing.median), str(res.timing.runs))
    table.add_note(
        'late="record" waits for the straggler and records it as a late input; '
        'late="cancel" cancels it once the merge fired (its output is decided)'
    )
    table.add_note("one untimed warm-up, then the median; " + load_average())
    return table


def targets(
    rows: Sequence[Throughput],
    tails: Sequence[TailResult],
    lates: Sequence[TailResult],
    opts: Options,
) -> Table:
    """The DESIGN.md budget and issue 13's targets, PASS/MISS per line."""
    lines: list[Target] = []
    for row in rows:
        lines.append(
            Target(
                f"{row.workload} {fmt_size(row.nodes)}: tailrace/bare asyncio",
                f"{row.share:.2f}",
                f">= {BARE_FLOOR_SHARE:.2f}",
                row.share >= BARE_FLOOR_SHARE,
            )
        )
    lines.extend(_flatness_targets(rows, opts))
    for res in tails:
        if res.engine == "tailrace" and res.timing is not None:
            ratio = res.timing.median / critical_path(tail_delays())
            lines.append(
                Target(
                    "heavy tail: makespan/critical path",
                    fmt_ratio(ratio, 3),
                    f"<= {TAIL_LIMIT}x",
                    ratio <= TAIL_LIMIT,
                )
            )
    for res in lates:
        if res.engine == 'late="cancel"' and res.timing is not None:
            lines.append(
                Target(
                    'README example, late="cancel": Engine.run',
                    fmt_seconds(res.timing.median),
                    f"<= {fmt_seconds(LATE_TARGET)}",
                    res.timing.median <= LATE_TARGET,
                )
            )
    table = targets_table(lines)
    table.add_note("benchmarks report, they do not assert: a MISS does not fail the script")
    table.add_note(
        "with gc enabled, bare asyncio's per-node cost grows too (table 1, 'excess' = "
        "tailrace's growth beyond it); --no-gc separates the collector from the engine"
    )
    return table


def _flatness_targets(rows: Sequence[Throughput], opts: Options) -> list[Target]:
    small, large = base_size(opts), max(opts.sizes)
    if small == large:
        return []
    lines = []
    for workload in WORKLOADS:
        by_size = {r.nodes: r for r in rows if r.workload == workload}
        growth = _cost_growth(by_size[large].tailrace, large, by_size[small].tailrace, small)
        lines.append(
            Target(
                f"{workload}: per-node cost {fmt_size(large)} vs {fmt_size(small)}",
                fmt_ratio(growth),
                f"<= {FLAT_COST_LIMIT}x",
                growth <= FLAT_COST_LIMIT,
            )
        )
    return lines


# -- main -----------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> Options:
    """Parse the command line into :class:`Options`."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("--sizes", help=f"node counts (default {DEFAULT_SIZES})")
    parser.add_argument("--repeat", type=int, help="timed runs per measurement (default 3)")
    parser.add_argument(
        "--quick", action="store_true", help=f"sizes {QUICK_SIZES}, 2 runs, LangGraph limit 5 s"
    )
    parser.add_argument(
        "--no-gc", action="store_true", help="disable gc inside timed sections (diagnosis)"
    )
    parser.add_argument(
        "--langgraph-limit",
        type=float,
        help="stop a LangGraph run after this many seconds (default 60)",
    )
    parser.add_argument(
        "--langgraph-budget",
        type=float,
        help="skip a LangGraph size whose warm-up and runs would take longer (default 120 s)",
    )
    args = parser.parse_args(argv)
    sizes = args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES)
    repeat = args.repeat or (2 if args.quick else 3)
    limit = args.langgraph_limit or (5.0 if args.quick else 60.0)
    budget = args.langgraph_budget or (20.0 if args.quick else 120.0)
    return Options(sorted(set(parse_sizes(sizes))), max(1, repeat), args.no_gc, limit, budget)


async def run_all(opts: Options) -> None:
    """Measure everything, then print the tables."""
    print("tailrace engine benchmark (in memory)", flush=True)
    print(environment(no_gc=opts.no_gc), end="\n\n", flush=True)
    rows = [await measure_throughput(w, n, opts) for w in WORKLOADS for n in opts.sizes]
    throughput_table(rows, opts).print()
    lg_version = langgraph_version()
    lg: list[LangGraphResult] = []
    if lg_version is not None:
        for workload in WORKLOADS:
            lg.extend(await measure_langgraph(workload, rows, opts))
    langgraph_table(lg, rows, lg_version, opts).print()
    delays = tail_delays()
    tails = await measure_heavy_tail(delays, opts)
    tail_table(tails, delays).print()
    lates = await measure_late(opts)
    late_table(lates).print()
    targets(rows, tails, lates, opts).print()


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point: ``python bench/engine.py [--sizes ...] [--repeat N] [--quick] [--no-gc]``."""
    asyncio.run(run_all(parse_args(argv)))


if __name__ == "__main__":
    main()
