"""Map-node benchmark: per-item cost, first-k over heavy tails, over-provisioning, hedged items.

Run as::

    python bench/map.py [--quick] [--seed N] [--tables 1234]

Every ratio is against a baseline measured in the same run.

1. **Per-item cost.** ``src -> map(noop) -> join`` over N items against the
   static fan-out of the same width, ``src -> N noop tasks -> join`` (an
   aggregate of all N), in memory and on SQLite (a fresh file per run,
   durability ``"async"``). The two are timed in alternation; the ratio is map
   time / static time at the median. Target: at most 1.2x, flat from 1k to 10k.

2. **First-k over a heavy tail.** 1,000 items whose handlers sleep lognormal
   durations (sigma 1.0, median ``--median`` s), ``required=900,
   late="cancel"``. The reference is the 900th completion, from the run's
   start to the 900th item's ``NODE_COMPLETED`` (the planned 900th smallest
   sleep is shown too: the difference is the time it takes to start 1,000
   items on this machine). The peer is LangGraph's ``Send``
   over the same durations (its superstep barrier waits for all 1,000), when
   LangGraph is installed. Target: tailrace within 1.05x of the 900th completion.

3. **Over-provisioning.** Keep k = 400 results: launch 500 items with
   ``required=400, late="cancel"`` against launching 400 and waiting for all of
   them, the same lognormal distribution (fresh seeded draws per round, the
   same draws for both). Target: at least 1.5x faster.

4. **Hedged items under a full queue.** 1,000 items of about twice ``--median``
   s (lognormal sigma 0.1) at ``capacity=50``, as a map and as the static
   fan-out of the same shape (a node per item into an aggregate of all);
   in each measured round a seeded 2% of the items stall 20x on their first
   attempt only (``current_node().backup`` is false), the same draw for every
   row. Rows: no stall and stalls, each without hedging (the control: the same
   engine and tail hooks, ``hedge=False``) and with
   ``HedgePolicy(budget=0.05)``; stalls with ``budget=0.01``. Every engine is
   warmed up by two stall-free runs, so its hedge delay is the p99 of the
   items' observed durations; rows are interleaved round by round. Item
   latency is from an item's first ``NODE_STARTED`` to its
   ``NODE_COMPLETED``; ``extra`` is the backups per item. Targets: p99 item
   latency within 2.5x the median for at most 5% extra attempts, the control
   missing it; without stalls, at most 2% more makespan and 1% extra
   attempts. A backup ends no sooner than the hedge delay plus one item's
   time, so the bound holds while the items' own p99 stays within about 1.5x
   their median (sigma up to about 0.17).

Nothing here asserts; the ``targets`` table reports PASS/MISS.
"""

from __future__ import annotations

import argparse
import asyncio
import operator
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Annotated, Any, TypedDict

from _common import (
    Column,
    Repeat,
    Table,
    environment,
    fmt_ratio,
    fmt_seconds,
    fmt_size,
    interleaved_best_of_async,
    load_average,
    verdict,
)

import tailrace as tr
from tailrace import current_node
from tailrace.stores import SQLiteStore
from tailrace.tail import HedgePolicy, TailHooks

# -- 1. per-item cost against a static fan-out ---------------------------------------------


async def noop(payload: Any) -> Any:
    return None


def static_fanout(n: int) -> tr.Graph:
    g = tr.Graph(f"static_{n}")
    g.add_node("src", noop)
    g.add_node("join", noop, "aggregate")
    for i in range(n):
        name = f"t{i}"
        g.add_node(name, noop)
        g.add_edge("src", name)
        g.add_edge(name, "join")
    g.compile()
    return g


def map_fanout(n: int) -> tr.Graph:
    g = tr.Graph(f"map_{n}")

    async def src(payload: Any) -> list[int]:
        return list(range(n))

    g.add_node("src", src)
    g.add_node("each", noop, "map")
    g.add_node("join", noop)
    g.chain("src", "each", "join")
    g.compile()
    return g


def runner(graph: tr.Graph, durable: bool, workdir: Path) -> Callable[[], Awaitable[object]]:
    counter = iter(range(10**9))

    async def run() -> object:
        if not durable:
            return await tr.Engine().run(graph, None)
        async with SQLiteStore(workdir / f"{graph.name}-{next(counter)}.db") as store:
            return await tr.Engine(store=store).run(graph, None)

    return run


async def per_item_cost(sizes: Sequence[int], repeat: Repeat, workdir: Path) -> tuple[Table, dict]:
    table = Table(
        "1. per-item cost: a map of N items vs a static fan-out of N nodes",
        [Column("store"), Column("N", right=True), Column("static", right=True),
         Column("map", right=True), Column("per item", right=True), Column("map/static", right=True)],
    )  # fmt: skip
    ratios: dict[str, list[float]] = {}
    for durable in (False, True):
        store = "sqlite" if durable else "memory"
        for n in sizes:
            static, mapped = static_fanout(n), map_fanout(n)
            await runner(static, durable, workdir)()  # warm up: imports, caches
            await runner(mapped, durable, workdir)()
            t_static, t_map = await interleaved_best_of_async(
                [runner(static, durable, workdir), runner(mapped, durable, workdir)], repeat
            )
            ratio = t_map.median / t_static.median
            ratios.setdefault(store, []).append(ratio)
            table.add_row(
                store, fmt_size(n), fmt_seconds(t_static.median), fmt_seconds(t_map.median),
                fmt_seconds(t_map.median / n), fmt_ratio(ratio),
            )  # fmt: skip
    return table, ratios


# -- 2 and 3. first-k over heavy tails --------------------------------------------------------


def sleeper_map(delays: Sequence[float], required: int | None, late: str) -> tr.Graph:
    g = tr.Graph("heavy_map")

    async def src(payload: Any) -> list[float]:
        return list(delays)

    async def sleep(seconds: float) -> float:
        await asyncio.sleep(seconds)
        return seconds

    g.add_node("src", src)
    g.add_node("each", sleep, "map", required=required, late=late)
    g.chain("src", "each")
    return g


class SendState(TypedDict):
    """The LangGraph peer's state: every finished item's seconds, appended."""

    done: Annotated[list[float], operator.add]


class SendItem(TypedDict):
    seconds: float


def langgraph_send(delays: Sequence[float]) -> Any:
    from langgraph.graph import END, START, StateGraph  # optional peer
    from langgraph.types import Send

    async def work(item: SendItem) -> dict[str, list[float]]:
        await asyncio.sleep(item["seconds"])
        return {"done": [item["seconds"]]}

    def fan(state: SendState) -> list[Any]:
        return [Send("work", {"seconds": s}) for s in delays]

    builder = StateGraph(SendState)
    builder.add_node("work", work)
    builder.add_conditional_edges(START, fan, ["work"])
    builder.add_edge("work", END)
    return builder.compile()


def lognormal(rng: random.Random, n: int, median: float, sigma: float) -> list[float]:
    return [median * rng.lognormvariate(0.0, sigma) for _ in range(n)]


async def timed(fn: Callable[[], Awaitable[object]]) -> float:
    start = time.perf_counter()
    await fn()
    return time.perf_counter() - start


async def first_k(median: float, rounds: int, seed: int) -> tuple[Table, dict]:
    table = Table(
        "2. 1,000 lognormal items (sigma 1.0), required=900, late=cancel",
        [Column("round"), Column("900th sleep", right=True), Column("900th done", right=True),
         Column("tailrace", right=True), Column("ratio", right=True),
         Column("langgraph Send", right=True),
         Column("slowest item", right=True), Column("Send / tailrace", right=True)],
    )  # fmt: skip
    rng = random.Random(seed)
    ratios, peers = [], []
    have_langgraph = _has_langgraph()
    for r in range(rounds):
        delays = lognormal(rng, 1000, median, 1.0)
        planned = sorted(delays)[899]
        graph = sleeper_map(delays, 900, "cancel")
        engine = tr.Engine()
        done: list[float] = []

        def completed(e: tr.Event, done: list[float] = done) -> None:
            if "item" in e.data:
                done.append(time.time())

        engine.bus.subscribe(completed, tr.EventType.NODE_COMPLETED)
        t0 = time.time()
        ours = await timed(lambda graph=graph, engine=engine: engine.run(graph, None))
        kth = sorted(done)[899] - t0
        ratios.append(ours / kth)
        peer = "-"
        speedup = "-"
        if have_langgraph:
            app = langgraph_send(delays)
            theirs = await timed(lambda app=app: app.ainvoke({"done": []}))
            peers.append(theirs / ours)
            peer, speedup = fmt_seconds(theirs), fmt_ratio(theirs / ours)
        table.add_row(
            str(r + 1), fmt_seconds(planned), fmt_seconds(kth), fmt_seconds(ours),
            fmt_ratio(ours / kth, 3), peer,
            fmt_seconds(max(delays)), speedup,
        )  # fmt: skip
    if not have_langgraph:
        table.notes.append("LangGraph is not installed: no peer column.")
    return table, {"ratio": statistics.median(ratios), "peer": peers}


async def over_provisioning(median: float, rounds: int, seed: int) -> tuple[Table, dict]:
    table = Table(
        "3. keep 400: launch 500 and cancel the rest vs launch 400 and wait for all",
        [Column("round"), Column("launch 400, all", right=True),
         Column("launch 500, first 400", right=True), Column("speed-up", right=True)],
    )  # fmt: skip
    rng = random.Random(seed + 1)
    speedups = []
    for r in range(rounds):
        delays = lognormal(rng, 500, median, 1.0)
        exact = sleeper_map(delays[:400], None, "record")
        over = sleeper_map(delays, 400, "cancel")
        t_exact = await timed(lambda g=exact: tr.Engine().run(g, None))
        t_over = await timed(lambda g=over: tr.Engine().run(g, None))
        speedups.append(t_exact / t_over)
        table.add_row(str(r + 1), fmt_seconds(t_exact), fmt_seconds(t_over),
                      fmt_ratio(t_exact / t_over))  # fmt: skip
    return table, {"speedup": statistics.median(speedups)}


# -- 4. hedged items under a full queue -------------------------------------------------------


HEDGED_ITEMS = 1000
HEDGE_CAPACITY = 50
STALL_SHARE = 0.02
STALL_FACTOR = 20.0
ITEM_SIGMA = 0.1
#: (row, stalls, hedge, budget): budget None is the control (the same engine, no hedging).
HEDGE_ROWS = (
    ("no stall, control", False, None),
    ("no stall, hedged 5%", False, 0.05),
    ("stall, control", True, None),
    ("stall, hedged 5%", True, 0.05),
    ("stall, hedged 1%", True, 0.01),
)


class Stalls:
    """Which items (by index) stall on their first attempt in the current run."""

    def __init__(self) -> None:
        self.items: frozenset[int] = frozenset()


def hedged_shape(shape: str, delays: Sequence[float], stalls: Stalls, hedge: bool) -> tr.Graph:
    """A map of ``len(delays)`` items, or the static fan-out of the same shape (a node per
    item into an aggregate of all of them); an item's first attempt stalls 20x when drawn.

    The stall reads ``current_node().backup``: a backup of a stalled item is fast.
    """
    g = tr.Graph(f"hedged_{shape}")

    def work(j: int, seconds: float) -> Callable[[], Awaitable[float]]:
        async def run() -> float:
            ctx = current_node(required=True)
            stalled = not ctx.backup and j in stalls.items
            await asyncio.sleep(seconds * (STALL_FACTOR if stalled else 1.0))
            return seconds

        return run

    g.add_node("src", lambda x: list(range(len(delays))))
    if shape == "map":

        async def item(j: int) -> float:
            return await work(j, delays[j])()

        g.add_node("each", item, "map", hedge=hedge, cost=1.0, estimate_key="item")
        g.chain("src", "each")
        return g
    g.add_node("join", lambda xs: len(xs), "aggregate")
    for j, seconds in enumerate(delays):
        run = work(j, seconds)

        async def node(x: Any, run: Callable[[], Awaitable[float]] = run) -> float:
            return await run()

        g.add_node(f"t{j}", node, hedge=hedge, cost=1.0, estimate_key="item")
        g.add_edge("src", f"t{j}")
        g.add_edge(f"t{j}", "join")
    return g


class ItemTimes:
    """Each item's latency in one run: its first ``NODE_STARTED`` to its ``NODE_COMPLETED``
    (an item of the map, or a task node of the static fan-out)."""

    def __init__(self, engine: tr.Engine, shape: str) -> None:
        self.started: dict[Any, float] = {}
        self.ended: dict[Any, float] = {}
        self._shape = shape
        self.unsubscribe = engine.bus.subscribe(
            self._on, tr.EventType.NODE_STARTED, tr.EventType.NODE_COMPLETED
        )

    def _on(self, e: tr.Event) -> None:
        key = e.data.get("item") if self._shape == "map" else e.node_id
        if key is None or e.node_id in ("src", "join"):
            return
        if e.type is tr.EventType.NODE_STARTED:
            self.started.setdefault(key, e.ts)
        else:
            self.ended[key] = e.ts

    def latencies(self) -> list[float]:
        return [self.ended[k] - self.started[k] for k in self.ended]


class HedgeRow:
    """One row's engine, graph and what its measured runs gave."""

    def __init__(self, shape: str, label: str, stall: bool, budget: float | None,
                 delays: Sequence[float]) -> None:  # fmt: skip
        self.shape, self.label, self.stall, self.budget = shape, label, stall, budget
        policy = None if budget is None else HedgePolicy(budget=budget)
        self.engine = tr.Engine(capacity=HEDGE_CAPACITY, tail=TailHooks(hedging=policy))
        self.stalls = Stalls()
        self.graph = hedged_shape(shape, delays, self.stalls, hedge=budget is not None)
        self.latencies: list[float] = []
        self.makespans: list[float] = []
        self.extra = 0
        self.refused = 0
        self.runs = 0

    async def run(self, stalled: frozenset[int], *, measure: bool) -> None:
        self.stalls.items = stalled if self.stall else frozenset()
        times = ItemTimes(self.engine, self.shape)
        t0 = time.perf_counter()
        result = await self.engine.run(self.graph, None)
        made = time.perf_counter() - t0
        times.unsubscribe()
        if not measure:
            return
        self.makespans.append(made)
        self.latencies.extend(times.latencies())
        self.extra += result.hedges
        self.refused += result.hedges_refused
        self.runs += 1

    def stats(self) -> dict[str, float]:
        ordered = sorted(self.latencies)
        median = statistics.median(ordered)
        return {
            "median": median, "p99": _quantile(ordered, 0.99), "max": ordered[-1],
            "ratio": _quantile(ordered, 0.99) / median,
            "extra": self.extra / (HEDGED_ITEMS * self.runs),
            "refused": self.refused / self.runs,
            "makespan": statistics.median(self.makespans),
        }  # fmt: skip


async def hedged(median: float, rounds: int, seed: int) -> tuple[Table, dict]:
    rng = random.Random(seed + 2)
    delays = lognormal(rng, HEDGED_ITEMS, median, ITEM_SIGMA)
    draw = random.Random(seed + 3)  # the same stalls for every row of a round
    draws = [
        frozenset(draw.sample(range(HEDGED_ITEMS), round(STALL_SHARE * HEDGED_ITEMS)))
        for _ in range(rounds)
    ]
    rows = [HedgeRow(shape, label, stall, budget, delays)
            for shape in ("map", "static") for label, stall, budget in HEDGE_ROWS]  # fmt: skip
    for row in rows:  # warm up: the estimator and the quantile learn the items (no stall)
        for _ in range(2):
            await row.run(frozenset(), measure=False)
    for stalled in draws:  # rows interleaved, so that load on the machine hits them alike
        for row in rows:
            await row.run(stalled, measure=True)
    table = Table(
        f"4. hedged items under a full queue: {HEDGED_ITEMS} items (lognormal, median "
        f"{fmt_seconds(median)}, sigma {ITEM_SIGMA}) at capacity {HEDGE_CAPACITY}, "
        f"{STALL_SHARE:.0%} stall {STALL_FACTOR:g}x on their first attempt ({rounds} rounds)",
        [Column("shape"), Column("row"), Column("median", right=True), Column("p99", right=True),
         Column("p99/median", right=True), Column("max", right=True), Column("extra", right=True),
         Column("refused", right=True), Column("makespan", right=True),
         Column("/ control", right=True)],
    )  # fmt: skip
    results: dict[str, Any] = {}
    for row in rows:
        stats = row.stats()
        results[f"{row.shape}: {row.label}"] = stats
        control = results[f"{row.shape}: {'stall' if row.stall else 'no stall'}, control"]
        table.add_row(
            row.shape, row.label, fmt_seconds(stats["median"]), fmt_seconds(stats["p99"]),
            fmt_ratio(stats["ratio"]), fmt_seconds(stats["max"]), f"{stats['extra']:.1%}",
            f"{stats['refused']:.1f}", fmt_seconds(stats["makespan"]),
            fmt_ratio(stats["makespan"] / control["makespan"], 3),
        )  # fmt: skip
    table.add_note(
        "latency: an item's first start to its completion; extra: backups / items; refused: "
        "stragglers per run whose backup the budget refused; hedged rows: "
        "TailHooks(hedging=HedgePolicy(budget=...)), delay = p99 of observed durations"
    )
    table.add_note(load_average())
    return table, results


def _quantile(ordered: Sequence[float], q: float) -> float:
    """The ``q`` quantile of sorted values, interpolated linearly between ranks."""
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def hedge_targets(targets: Table, stats: dict[str, Any]) -> None:
    """Table 4's targets: the tail cut within the budget, the control missing, no cost without
    stalls."""
    for shape in ("map", "static"):
        hedged, control = stats[f"{shape}: stall, hedged 5%"], stats[f"{shape}: stall, control"]
        quiet, base = stats[f"{shape}: no stall, hedged 5%"], stats[f"{shape}: no stall, control"]
        thin = stats[f"{shape}: stall, hedged 1%"]
        targets.add_row(f"{shape}: hedged p99 item latency <= 2.5x median",
                        fmt_ratio(hedged["ratio"]), verdict(hedged["ratio"] <= 2.5))  # fmt: skip
        targets.add_row(f"{shape}: hedged extra attempts <= 5%", f"{hedged['extra']:.1%}",
                        verdict(hedged["extra"] <= 0.05))  # fmt: skip
        targets.add_row(f"{shape}: the control misses 2.5x", fmt_ratio(control["ratio"]),
                        verdict(control["ratio"] > 2.5))  # fmt: skip
        made = quiet["makespan"] / base["makespan"]
        targets.add_row(f"{shape}, no stall: hedged makespan <= 1.02x the control",
                        fmt_ratio(made, 3), verdict(made <= 1.02))  # fmt: skip
        targets.add_row(f"{shape}, no stall: extra attempts <= 1%", f"{quiet['extra']:.1%}",
                        verdict(quiet["extra"] <= 0.01))  # fmt: skip
        cut = (control["p99"] - thin["p99"]) / (control["p99"] - hedged["p99"])
        targets.add_row(f"{shape}, 1% budget: share of the 5% budget's p99 cut it keeps",
                        f"{cut:.0%} (p99/median {fmt_ratio(thin['ratio'])})", "")  # fmt: skip


def _has_langgraph() -> bool:
    try:
        import langgraph.graph  # noqa: F401
    except ImportError:
        return False
    return True


# -- main -------------------------------------------------------------------------------------


async def main(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds, smaller sizes")
    parser.add_argument("--seed", type=int, default=20261202)
    parser.add_argument("--median", type=float, default=0.05, help="median item seconds")
    parser.add_argument(
        "--tables", default="1234", help="which tables to measure, e.g. 4 (default: all)"
    )
    opts = parser.parse_args(argv)
    sizes = [1000, 10_000] if not opts.quick else [1000, 5000]
    repeat = Repeat(runs=5 if not opts.quick else 3, min_time=1.0, budget=30.0)
    rounds = 5 if not opts.quick else 2
    print(environment(no_gc=False))
    print()
    targets = Table("targets", [Column("target"), Column("measured", right=True), Column("")])
    if "1" in opts.tables:
        with tempfile.TemporaryDirectory(prefix="tailrace-map-bench-") as tmp:
            cost, cost_ratios = await per_item_cost(sizes, repeat, Path(tmp))
        print(cost.render(), end="\n\n")
        for store, ratios in cost_ratios.items():
            worst = max(ratios)
            targets.add_row(f"map item <= 1.2x a static node ({store})", fmt_ratio(worst),
                            verdict(worst <= 1.2))  # fmt: skip
            flat = ratios[-1] / ratios[0]
            targets.add_row(
                f"map/static at {fmt_size(sizes[-1])} over {fmt_size(sizes[0])} ({store})",
                fmt_ratio(flat), verdict(flat <= 1.2),
            )  # fmt: skip
    if "2" in opts.tables:
        heavy, heavy_stats = await first_k(opts.median, rounds, opts.seed)
        print(heavy.render(), end="\n\n")
        ratio = heavy_stats["ratio"]
        targets.add_row("required=900 returns <= 1.05x the 900th completion",
                        fmt_ratio(ratio, 3), verdict(ratio <= 1.05))  # fmt: skip
        if heavy_stats["peer"]:
            peer = statistics.median(heavy_stats["peer"])
            targets.add_row("LangGraph Send on the same items (slower by)", fmt_ratio(peer),
                            verdict(peer > 1.0))  # fmt: skip
    if "3" in opts.tables:
        over, over_stats = await over_provisioning(opts.median, rounds, opts.seed)
        print(over.render(), end="\n\n")
        speedup = over_stats["speedup"]
        targets.add_row("launch 1.25k keep k vs launch k wait all >= 1.5x", fmt_ratio(speedup),
                        verdict(speedup >= 1.5))  # fmt: skip
    if "4" in opts.tables:
        hedge, hedge_stats = await hedged(opts.median * 2, rounds, opts.seed)
        print(hedge.render(), end="\n\n")
        hedge_targets(targets, hedge_stats)
    print(targets.render())


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
