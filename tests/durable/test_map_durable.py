"""Map items are durable (M6): a crash re-runs only the items that were in flight.

In process, a run stopped mid-map (its task cancelled, as a worker letting go
does) and resumed elsewhere re-runs only unfinished items and keeps a first-k
decision made before the stop. Across processes, a child driving a map on a
real SQLite file or Postgres is SIGKILLed while items run; the resume in
this process re-runs none of the items whose completion was committed and
produces the output of an uninterrupted run (M3: the k decision is reused).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

import tailrace as tr
from tailrace import current_node
from tailrace.stores import RunStore, open_store
from tests import fixtures
from tests.durable import map_graphs

each_store = fixtures.each_store
GUARD = 30.0
ROOT = Path(__file__).resolve().parents[2]


def counted_map(
    calls: Counter[int], release: asyncio.Event, *, required: int | None = None
) -> tr.Graph:
    g = tr.Graph("counted")

    @g.task()
    def items(n: int) -> list[int]:
        return list(range(n))

    async def each(x: int) -> int:
        ctx = current_node()
        assert ctx is not None and ctx.item is not None
        calls[ctx.item] += 1
        if x >= 3:
            await release.wait()  # items 3.. run until the test lets them go
        return x * 10

    g.add_node("each", each, "map", required=required)
    g.add_edge("items", "each")
    return g


async def stop_when(task: asyncio.Task[Any], condition: Any) -> None:
    await fixtures.until(condition, "the items the test waits for")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_stopped_map_resumes_running_only_unfinished_items(each_store: RunStore) -> None:
    calls: Counter[int] = Counter()
    hold = asyncio.Event()
    g = counted_map(calls, hold)
    run = asyncio.create_task(tr.Engine(store=each_store).run(g, 6, run_id="m6-stop"))
    await stop_when(run, lambda: sum(calls.values()) == 6)  # 0-2 done, 3-5 held
    stored = await each_store.load_run("m6-stop")
    assert sorted(r.item for r in stored.items if r.status == "completed") == [0, 1, 2]
    calls.clear()
    hold.set()
    result = await tr.Engine(store=each_store).resume("m6-stop", g)
    assert result.status == "completed"
    assert result.output == [0, 10, 20, 30, 40, 50]
    assert calls == Counter({3: 1, 4: 1, 5: 1})  # only the items in flight ran again


async def test_a_decision_made_before_a_stop_is_reused_and_late_items_run_on(
    each_store: RunStore,
) -> None:
    calls: Counter[int] = Counter()
    hold = asyncio.Event()
    g = counted_map(calls, hold, required=2)
    run = asyncio.create_task(tr.Engine(store=each_store).run(g, 5, run_id="m6-decided"))

    async def decided() -> bool:
        stored = await each_store.load_run("m6-decided")
        return stored.nodes.get("each") is not None and stored.nodes["each"].status == "completed"

    await fixtures.until(lambda: sum(calls.values()) == 5, "every item started")
    await stop_when(run, decided)
    calls.clear()
    hold.set()
    result = await tr.Engine(store=each_store).resume("m6-decided", g)
    assert result.results["each"] == [0, 10]  # the decision the first process made (M3)
    assert sorted(calls) == [3, 4]  # the late items ran on (late="record"); none ran twice
    assert all(n == 1 for n in calls.values())
    stored = await each_store.load_run("m6-decided")
    statuses = {r.item: r.status for r in stored.items}
    assert statuses == {0: "completed", 1: "completed", 2: "late", 3: "late", 4: "late"}


async def test_a_retry_count_survives_the_stop(each_store: RunStore) -> None:
    tries: list[int] = []
    gate = asyncio.Event()
    g = tr.Graph("retried")

    @g.task()
    def items(n: int) -> list[int]:
        return list(range(n))

    async def each(x: int) -> int:
        ctx = current_node()
        assert ctx is not None
        if x == 1:
            tries.append(ctx.attempt)
            if ctx.attempt < 3:
                raise ConnectionError("flaky")
            await gate.wait()
        return x

    g.add_node("each", each, "map", retry=tr.RetryPolicy(attempts=4, backoff=0.0))
    g.add_edge("items", "each")
    run = asyncio.create_task(tr.Engine(store=each_store).run(g, 2, run_id="m6-retry"))
    await stop_when(run, lambda: tries == [1, 2, 3])
    gate.set()
    result = await tr.Engine(store=each_store).resume("m6-retry", g)
    assert result.output == [0, 1]
    assert tries == [1, 2, 3, 4]  # the cut third try runs again as the next, not as try 1 (E11)


# -- SIGKILL of a real process ----------------------------------------------------------------


def item_log(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


@contextlib.asynccontextmanager
async def shared_target(kind: str, tmp_path: Path) -> AsyncIterator[str]:
    """A fresh database another process can open: a SQLite file, or a Postgres schema."""
    if kind == "sqlite":
        yield str(tmp_path / "runs.db")
        return
    assert fixtures.POSTGRES_DSN is not None
    async with fixtures.postgres_schema("tailrace_map_kill") as schema:
        separator = "&" if "?" in fixtures.POSTGRES_DSN else "?"
        yield f"{fixtures.POSTGRES_DSN}{separator}schema={schema}"


async def committed_items(store: RunStore, run_id: str) -> list[int]:
    try:
        stored = await store.load_run(run_id)
    except tr.RunNotFound:
        return []
    return [r.item for r in stored.items if r.status == "completed"]


@pytest.mark.slow  # a child process per store, killed mid-map
@pytest.mark.parametrize("kind", fixtures.SHARED_STORES)
async def test_sigkill_mid_map_reruns_only_the_items_in_flight(kind: str, tmp_path: Path) -> None:
    log_path = tmp_path / "items.log"
    run_id = f"m6-kill-{kind}"
    async with shared_target(kind, tmp_path) as target:
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.durable.map_graphs", target, run_id, str(log_path),
            cwd=ROOT,
        )  # fmt: skip
        try:
            async with open_store(target) as store:

                async def six_committed() -> bool:
                    return len(await committed_items(store, run_id)) >= 6

                await fixtures.until(six_committed, "six items committed", guard=GUARD)
                os.kill(child.pid, signal.SIGKILL)
                await child.wait()
                done_at_kill = await committed_items(store, run_id)
                assert len(done_at_kill) < 20, "the kill must land before the decision"
                lines_at_kill = len(item_log(log_path))
                map_graphs.LOG[:] = [log_path]
                result = await tr.Engine(store=store, capacity=6).resume(run_id, map_graphs.graph)
        finally:
            if child.returncode is None:
                child.kill()
                await child.wait()
    assert result.status == "completed"
    rerun = Counter(
        int(line.split()[1])
        for line in item_log(log_path)[lines_at_kill:]
        if line.startswith("start")
    )
    assert not set(rerun) & set(done_at_kill), "an item whose completion was committed ran again"
    assert all(n == 1 for n in rerun.values())
    winners = [r["x"] for r in result.results["work"]]
    assert len(winners) == 20 and winners == sorted(winners)  # k results, in item order (M3)
    assert set(done_at_kill) <= set(winners)  # committed successes before the decision win
    assert result.output == sum(x * x for x in winners)


# -- P4: a map claims at most what it may run -----------------------------------------------


def claiming(log: list[int], **options: Any) -> tr.Graph:
    g = tr.Graph("claims")

    @g.task()
    def own(n: int) -> list[int]:
        return [100 + x for x in range(n)]

    async def each(x: int) -> int:
        log.append(x)
        return x

    g.add_node("each", each, "map", resume_parked=True, **options)
    g.chain("own", "each")
    return g


async def test_a_map_claims_only_what_max_items_leaves_the_rest_stays_parked(
    each_store: RunStore,
) -> None:
    parked = await fixtures.seed_parked(each_store, "claims", "each", list(range(7)))
    log: list[int] = []
    engine = tr.Engine(store=each_store)
    result = await asyncio.wait_for(engine.run(claiming(log, max_items=5), 2), GUARD)
    assert result.output == [0, 1, 2, 100, 101]  # the three oldest parked, then its own
    assert [r.park_id for r in await engine.parked("claims", "each")] == parked[3:]
    # A 2-item map after many parked items takes what fits, and says nothing about the rest.
    result = await asyncio.wait_for(engine.run(claiming(log, max_items=3), 2), GUARD)
    assert result.output == [3, 100, 101]
    assert [r.park_id for r in await engine.parked("claims", "each")] == parked[4:]


def _at_most_four(n: int) -> int:
    if n > 4:
        raise ValueError(f"{n} is too many")
    return n


async def test_a_map_gives_back_what_its_required_function_cannot_take(
    each_store: RunStore,
) -> None:
    parked = await fixtures.seed_parked(each_store, "claims", "each", list(range(5)))
    log: list[int] = []
    engine = tr.Engine(store=each_store)
    result = await asyncio.wait_for(engine.run(claiming(log, required=_at_most_four), 2), GUARD)
    assert result.output == [0, 1, 100, 101]
    assert [r.park_id for r in await engine.parked("claims", "each")] == parked[2:]
