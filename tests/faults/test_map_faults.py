"""Map nodes under faults (M6, E9, D1, D6): a store that fails mid-map, cancellation at every
store call, and a map cancelled whole as an input nobody reads.

Each test runs over memory, SQLite (a real file) and Postgres (a schema of its
own). After the fault, another engine resumes the run: the output is the one
an uninterrupted run gives, no item whose completion was committed runs
again, and no lease is left held.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from typing import Any

import pytest

import tailrace as tr
from tailrace import current_node
from tailrace.stores import RunStatus, RunStore
from tailrace.tail import TailHooks
from tests import fixtures
from tests.faults import _faulty as faulty

store = fixtures.each_store  # the fixture: each backend in turn, on a fresh database
ITEMS = 12
K = 9


class Items:
    """A map graph whose items count their starts, per phase, and take turns finishing."""

    def __init__(self) -> None:
        self.phase = "first"
        self.starts: Counter[tuple[str, int]] = Counter()

    def graph(self) -> tr.Graph:
        g = tr.Graph("map_faults")

        @g.task()
        def items(n: int) -> list[int]:
            return list(range(n))

        async def each(x: int) -> int:
            ctx = current_node()
            assert ctx is not None and ctx.item is not None
            self.starts[(self.phase, ctx.item)] += 1
            await asyncio.sleep(0.008 * x)  # later items finish later, past the group window
            return x * x

        g.add_node("each", each, "map", required=K, late="cancel")
        g.add_node("total", sum)
        g.chain("items", "each", "total")
        return g


EXPECTED = sum(x * x for x in range(K))


async def committed_items(store: RunStore, run_id: str) -> set[int]:
    try:
        stored = await store.load_run(run_id)
    except tr.RunNotFound:
        return set()
    return {r.item for r in stored.items if r.status == "completed"}


@pytest.mark.parametrize("fail_at", [2, 3, 5])
async def test_a_store_failing_mid_map_loses_nothing_committed(
    store: RunStore, fail_at: int
) -> None:
    items = Items()
    graph = items.graph()
    run_id = f"map-fail-{fail_at}"
    failing = faulty.FailingStore(store, fail_at=fail_at)
    with pytest.raises(tr.StoreError) as raised:
        await faulty.guarded(tr.Engine(store=failing).run(graph, ITEMS, run_id=run_id), "run")
    assert raised.value is failing.errors[0]  # E9: the store's own error, unwrapped
    assert not faulty.lease_tasks()
    before = await committed_items(store, run_id)
    if not before and not await _stored(store, run_id):
        return  # the failure came before the run's first write: nothing to resume
    items.phase = "resume"
    result = await faulty.guarded(tr.Engine(store=store).resume(run_id, graph), "resume")
    assert result.output == EXPECTED
    rerun = {j for (phase, j) in items.starts if phase == "resume"}
    assert not rerun & before, "an item whose completion was committed ran again"
    assert sorted(
        r.item for r in (await store.load_run(run_id)).items if r.status == "completed"
    ) == list(range(K))


async def _stored(store: RunStore, run_id: str) -> bool:
    try:
        await store.get_run(run_id)
    except tr.RunNotFound:
        return False
    return True


@pytest.mark.parametrize("at", range(2, 12, 3))
async def test_cancelling_a_map_run_at_a_store_call_leaks_no_lease_and_resumes(
    store: RunStore, at: int
) -> None:
    items = Items()
    graph = items.graph()
    run_id = f"map-cancel-{at}"
    cancelling = faulty.CancellingStore(store, at=at)
    task = asyncio.ensure_future(tr.Engine(store=cancelling).run(graph, ITEMS, run_id=run_id))
    cancelling.target = task
    outcome = await asyncio.gather(task, return_exceptions=True)
    (value,) = outcome
    assert not faulty.lease_tasks()
    if not cancelling.fired:
        assert isinstance(value, tr.RunResult) and value.output == EXPECTED
        return
    assert isinstance(value, asyncio.CancelledError)  # never swallowed
    if not await _stored(store, run_id):
        return
    if (await store.get_run(run_id)).status == "completed":
        return  # cut on its way out, after its last write
    await faulty.assert_no_lease_held(store, [run_id])
    before = await committed_items(store, run_id)
    items.phase = "resume"
    result = await faulty.guarded(tr.Engine(store=store).resume(run_id, graph), "resume")
    assert result.output == EXPECTED
    assert not {j for (phase, j) in items.starts if phase == "resume"} & before


async def test_a_map_nobody_reads_is_cancelled_with_its_items(store: RunStore) -> None:
    release = asyncio.Event()
    cancelled: list[int] = []
    g = tr.Graph("dead_map")

    @g.task()
    def start(n: int) -> list[int]:
        return list(range(n))

    async def slow(x: int) -> int:
        try:
            await release.wait()
        except asyncio.CancelledError:
            cancelled.append(x)
            raise
        return x

    @g.task()
    async def quick(xs: list[int]) -> str:
        return "quick"

    g.add_node("each", slow, "map")
    g.add_node("first", lambda found: found, "aggregate", required=1, late="cancel")
    g.add_edge("start", "each")
    g.add_edge("start", "quick")
    g.add_edge("each", "first")
    g.add_edge("quick", "first")
    engine = tr.Engine(store=store, capacity=3)  # some items wait for a slot
    result: Any = await faulty.guarded(engine.run(g, 5), "the run whose map nobody reads")
    assert result.output == ["quick"]
    assert result.nodes["each"].status == "cancelled"
    # The running items are cancelled and awaited (one may be cancelled before its first step).
    assert sorted(cancelled) in ([0, 1], [0, 1, 2])
    assert engine.slots is not None and engine.slots.in_use == 0  # every slot came back
    assert [(x.node_id, x.source_id, x.reason) for x in result.late_inputs] == [
        ("first", "each", "cancelled")
    ]


# -- a bad cost under capacity 1 (E3, E9) ----------------------------------------------------


def _raising_cost(x: Any) -> float:
    if x == "bad":
        raise RuntimeError("no estimate for this one")
    return 1.0


def _nan_cost(x: Any) -> float:
    return float("nan") if x == "bad" else 1.0


def _text_cost(x: Any) -> Any:
    return "heavy" if x == "bad" else 1.0


def _none_cost(x: Any) -> Any:
    return None if x == "bad" else 1.0


BAD_COSTS = [
    (_raising_cost, r"its cost raised RuntimeError: no estimate for this one"),
    (_nan_cost, r"its cost returned nan \(float\), not a finite number"),
    (_text_cost, r"its cost returned 'heavy' \(str\), not a finite number"),
    (_none_cost, r"its cost returned None \(NoneType\), not a finite number"),
]


@pytest.mark.parametrize(("cost", "message"), BAD_COSTS)
@pytest.mark.parametrize("where", ["task", "map item"])
async def test_a_bad_cost_fails_its_run_naming_the_node_and_frees_its_slot(
    store: RunStore, cost: Any, message: str, where: str
) -> None:
    g = tr.Graph("bad_cost")
    if where == "task":
        g.add_node("a", lambda x: x, cost=cost)
        culprit, first_input = r"node 'a'", "bad"
    else:
        g.add_node("a", lambda x: x)
        g.add_node("each", lambda x: x, "map", cost=cost)
        g.add_edge("a", "each")
        culprit, first_input = r"map 'each' item 1", ["ok", "bad"]
    after = tr.Graph("after")
    after.add_node("b", lambda x: x + 1)
    engine = tr.Engine(store=store, capacity=1, tail=TailHooks())
    async with asyncio.timeout(30):  # a leaked slot hangs the next run: fail instead
        if where == "task":
            assert (await engine.run(g, "ok")).status is RunStatus.COMPLETED  # observed once
        with pytest.raises(ValueError, match=f"{culprit}: {message}"):
            await engine.run(g, first_input, run_id="bad-cost")
        assert (await engine.run(after, 1)).output == 2
    assert (await store.get_run("bad-cost")).status is RunStatus.FAILED  # E9


# -- P4: parked items claimed by a visit that fails, or is cut, are not lost ----------------


class Claimer:
    """A map that takes parked items first; parked values wait for ``go``, 999 raises."""

    def __init__(self) -> None:
        self.go = asyncio.Event()
        self.started: list[int] = []

    def graph(self) -> tr.Graph:
        g = tr.Graph("claimer")

        @g.task()
        def own(values: list[int]) -> list[int]:
            return values

        async def each(x: int) -> int:
            self.started.append(x)
            if x == 999:
                raise RuntimeError("item 999 fails its visit")
            if x < 100:  # a parked item: it runs until let go
                await self.go.wait()
            return x

        g.add_node("each", each, "map", resume_parked=True)
        g.chain("own", "each")
        return g


async def test_a_visit_that_fails_gives_its_claimed_parked_items_back_in_order(
    store: RunStore,
) -> None:
    parked = await fixtures.seed_parked(store, "claimer", "each", [1, 2, 3])
    claimer = Claimer()
    engine = tr.Engine(store=store)
    async with asyncio.timeout(30):
        with pytest.raises(RuntimeError, match="item 999 fails its visit"):
            await engine.run(claimer.graph(), [999], run_id="fails")
        assert (await store.get_run("fails")).status is RunStatus.FAILED
        assert [r.park_id for r in await engine.parked("claimer", "each")] == parked
        claimer.go.set()  # the next visit takes them and finishes them
        result = await engine.run(claimer.graph(), [7], run_id="next")
    assert result.output == [1, 2, 3, 7]
    assert await engine.parked("claimer", "each") == []


async def test_a_parked_item_that_fails_its_visit_goes_back_with_the_others(
    store: RunStore,
) -> None:
    parked = await fixtures.seed_parked(store, "claimer", "each", [1, 999, 3])
    engine = tr.Engine(store=store)
    async with asyncio.timeout(30):
        with pytest.raises(RuntimeError, match="item 999 fails its visit"):
            await engine.run(Claimer().graph(), [5], run_id="fails")
    assert [r.park_id for r in await engine.parked("claimer", "each")] == parked


async def test_a_run_cut_after_claiming_keeps_its_claims_and_its_resume_finishes_them(
    store: RunStore,
) -> None:
    await fixtures.seed_parked(store, "claimer", "each", [1, 2])
    claimer = Claimer()
    engine = tr.Engine(store=store)
    async with asyncio.timeout(30):
        run = asyncio.create_task(engine.run(claimer.graph(), [7], run_id="cut"))
        await fixtures.until(lambda: 1 in claimer.started and 2 in claimer.started, "claimed")
        run.cancel()  # the process stops driving it: the claims stay with its visit
        with contextlib.suppress(asyncio.CancelledError):
            await run
        held = await store.list_parked(status=None, claimed_by="cut/each/1")
        assert [r.status for r in held] == ["claimed", "claimed"]
        claimer.go.set()
        result = await tr.Engine(store=store).resume("cut", claimer.graph())
    assert result.output == [1, 2, 7]
    assert await store.list_parked(graph_name="claimer") == []
