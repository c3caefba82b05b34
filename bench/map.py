"""Map-node benchmark: per-item cost, first-k over heavy tails, over-provisioning, hedged items.

Run as::

    python bench/map.py [--quick] [--seed N]

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

4. **Hedged items.** 500 items of about twice ``--median`` s (lognormal sigma
   0.2; long enough that starting 500 items costs little next to one); in
   each measured run a seeded 1% of the items stall 20x on their
   first attempt only (a backup of the same item is fast). Rows: no stall;
   stalls without hedging; stalls with ``hedge=True`` backed up at the
   straggler threshold (factor 1.5). Each engine is warmed up by two
   stall-free runs so its estimator knows the items. Item latency is from an
   item's first ``NODE_STARTED`` to its ``NODE_COMPLETED``; ``extra`` is the
   backups per item. Target: p99 item latency within 2.5x the median, at most
   5% extra attempts. A backup of a stalled item starts at 1.5x the estimate
   and takes one item's time, so a stalled item ends near 2.5x.

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
    verdict,
)

import tailrace as tr
from tailrace import current_node
from tailrace.stores import SQLiteStore
from tailrace.tail import TailHooks

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


# -- 4. hedged items --------------------------------------------------------------------------


HEDGED_ITEMS = 500


class Stalls:
    """Which items stall on their first attempt in the current run (a fresh draw per run)."""

    def __init__(self) -> None:
        self.items: set[int] = set()
        self.seen: set[int] = set()


def hedged_map(delays: Sequence[float], stalls: Stalls, hedge: bool) -> tr.Graph:
    g = tr.Graph("hedged_map")

    async def src(payload: Any) -> list[float]:
        return list(delays)

    async def item(seconds: float) -> float:
        ctx = current_node()
        assert ctx is not None and ctx.item is not None
        first = ctx.item not in stalls.seen
        stalls.seen.add(ctx.item)
        await asyncio.sleep(seconds * (20 if first and ctx.item in stalls.items else 1))
        return seconds

    g.add_node("src", src)
    g.add_node("each", item, "map", hedge=hedge, cost=1.0)
    g.chain("src", "each")
    return g


async def hedged(median: float, rounds: int, seed: int) -> tuple[Table, dict]:
    table = Table(
        "4. 500 items, 1% stall 20x on their first attempt",
        [Column("row"), Column("median", right=True), Column("p99", right=True),
         Column("p99/median", right=True), Column("p99.9", right=True), Column("max", right=True),
         Column("extra", right=True), Column("makespan", right=True)],
    )  # fmt: skip
    rng = random.Random(seed + 2)
    delays = lognormal(rng, HEDGED_ITEMS, median, 0.2)
    results: dict[str, Any] = {}
    rows = (("no stall", False, False), ("stall, no hedge", True, False),
            ("stall, hedge at 1.5x", True, True))  # fmt: skip
    for label, stall, hedge in rows:
        stalls = Stalls()
        engine = tr.Engine(tail=TailHooks(factor=1.5, min_samples=3))
        graph = hedged_map(delays, stalls, hedge)
        for _ in range(2):  # warm up: the estimator learns the items
            stalls.seen.clear()
            await engine.run(graph, None)
        latencies: list[float] = []
        extra, makespans = 0, []
        draw = random.Random(seed + 3)  # the same stalls for every row
        for _ in range(rounds):
            stalls.items = (
                set(draw.sample(range(HEDGED_ITEMS), HEDGED_ITEMS // 100)) if stall else set()
            )
            stalls.seen.clear()
            started: dict[int, float] = {}
            ended: dict[int, float] = {}

            def listen(e: tr.Event, started: dict[int, float] = started,
                       ended: dict[int, float] = ended) -> None:  # fmt: skip
                item = e.data.get("item")
                if e.node_id != "each" or item is None:
                    return
                if e.type is tr.EventType.NODE_STARTED:
                    started.setdefault(item, e.ts)
                elif e.type is tr.EventType.NODE_COMPLETED:
                    ended[item] = e.ts

            unsubscribe = engine.bus.subscribe(listen)
            t0 = time.perf_counter()
            result = await engine.run(graph, None)
            makespans.append(time.perf_counter() - t0)
            unsubscribe()
            extra += result.hedges
            latencies.extend(ended[j] - started[j] for j in ended)
        latencies.sort()
        med = statistics.median(latencies)
        p99 = _quantile(latencies, 0.99)
        share = extra / (HEDGED_ITEMS * rounds)
        results[label] = {"ratio": p99 / med, "extra": share}
        table.add_row(
            label, fmt_seconds(med), fmt_seconds(p99), fmt_ratio(p99 / med),
            fmt_seconds(_quantile(latencies, 0.999)), fmt_seconds(latencies[-1]),
            f"{share:.1%}", fmt_seconds(statistics.median(makespans)),
        )  # fmt: skip
    return table, results


def _quantile(ordered: Sequence[float], q: float) -> float:
    """The ``q`` quantile of sorted values, interpolated linearly between ranks."""
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


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
    opts = parser.parse_args(argv)
    sizes = [1000, 10_000] if not opts.quick else [1000, 5000]
    repeat = Repeat(runs=5 if not opts.quick else 3, min_time=1.0, budget=30.0)
    rounds = 5 if not opts.quick else 2
    print(environment(no_gc=False))
    print()
    with tempfile.TemporaryDirectory(prefix="tailrace-map-bench-") as tmp:
        cost, cost_ratios = await per_item_cost(sizes, repeat, Path(tmp))
    print(cost.render(), end="\n\n")
    heavy, heavy_stats = await first_k(opts.median, rounds, opts.seed)
    print(heavy.render(), end="\n\n")
    over, over_stats = await over_provisioning(opts.median, rounds, opts.seed)
    print(over.render(), end="\n\n")
    hedge, hedge_stats = await hedged(opts.median * 2, rounds, opts.seed)
    print(hedge.render(), end="\n\n")
    targets = Table("targets", [Column("target"), Column("measured", right=True), Column("")])
    for store, ratios in cost_ratios.items():
        worst = max(ratios)
        targets.add_row(f"map item <= 1.2x a static node ({store})", fmt_ratio(worst),
                        verdict(worst <= 1.2))  # fmt: skip
        flat = ratios[-1] / ratios[0]
        targets.add_row(
            f"map/static at {fmt_size(sizes[-1])} over {fmt_size(sizes[0])} ({store})",
            fmt_ratio(flat), verdict(flat <= 1.2),
        )  # fmt: skip
    ratio = heavy_stats["ratio"]
    targets.add_row("required=900 returns <= 1.05x the 900th completion", fmt_ratio(ratio, 3),
                    verdict(ratio <= 1.05))  # fmt: skip
    if heavy_stats["peer"]:
        peer = statistics.median(heavy_stats["peer"])
        targets.add_row("LangGraph Send on the same items (slower by)", fmt_ratio(peer),
                        verdict(peer > 1.0))  # fmt: skip
    speedup = over_stats["speedup"]
    targets.add_row("launch 1.25k keep k vs launch k wait all >= 1.5x", fmt_ratio(speedup),
                    verdict(speedup >= 1.5))  # fmt: skip
    hedge_row = hedge_stats["stall, hedge at 1.5x"]
    targets.add_row("hedged p99 item latency <= 2.5x median", fmt_ratio(hedge_row["ratio"]),
                    verdict(hedge_row["ratio"] <= 2.5))  # fmt: skip
    targets.add_row("hedged extra attempts <= 5%", f"{hedge_row['extra']:.1%}",
                    verdict(hedge_row["extra"] <= 0.05))  # fmt: skip
    print(targets.render())


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
