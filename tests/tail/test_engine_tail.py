"""The engine's long-tail hooks: LPT admission (T2), stragglers while running and hedges (T3).

Estimators are pre-trained through ``TailHooks.estimator(key).observe`` wherever
learning is not the point, so admission order and straggler timers are
deterministic. Sleeps appear only as generous ordering guards (a 30 ms timer
against a handler that waits for an event, never a bound on elapsed time), and
every run that a bug could hang is wrapped in ``asyncio.timeout``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

import tailrace as tr
from tailrace.stores import MemoryStore, RunStore, SQLiteStore
from tailrace.tail._hooks import TailHooks

GUARD = 10.0  # seconds; only there so that a bug fails the test instead of hanging it
FAST = 0.01  # pre-trained estimate: the straggler timer fires after 3 x 10 ms


def trained(factor: float = 3.0, **seconds: float) -> TailHooks:
    """A TailHooks whose estimator for each key already answers ``seconds`` (cost 1.0)."""
    hooks = TailHooks(factor=factor)
    for key, value in seconds.items():
        for _ in range(3):
            hooks.estimator(key).observe(1.0, value)
    return hooks


def recorded(engine_kwargs: dict[str, Any] | None = None) -> tuple[tr.Engine, list[tr.Event]]:
    """An engine whose bus records every event."""
    bus = tr.EventBus()
    events: list[tr.Event] = []
    bus.subscribe(events.append)
    return tr.Engine(bus=bus, **(engine_kwargs or {})), events


def of(events: list[tr.Event], type: tr.EventType, node: str | None = None) -> list[tr.Event]:
    return [e for e in events if e.type is type and (node is None or e.node_id == node)]


def started(events: list[tr.Event]) -> list[str]:
    return [e.node_id or "" for e in of(events, tr.EventType.NODE_STARTED)]


async def hang() -> None:
    await asyncio.Event().wait()


def leftover_tasks() -> list[asyncio.Task[Any]]:
    return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]


# -- T2: LPT admission --------------------------------------------------------------------


def fan_out(
    names: list[str], handler: Callable[[str], Callable[[Any], Awaitable[Any]]]
) -> tr.Graph:
    """src -> each of ``names`` (in that definition order) -> join."""
    g = tr.Graph("fan")
    g.add_node("src", lambda x: x)
    for name in names:
        g.add_node(name, handler(name))
        g.add_edge("src", name)

    async def join(xs: list[Any]) -> list[Any]:
        return xs

    g.add_node("join", join, tr.NodeKind.AGGREGATE)
    for name in names:
        g.add_edge(name, "join")
    return g


def instant(name: str) -> Callable[[Any], Awaitable[Any]]:
    async def handler(x: Any) -> str:
        return name

    return handler


async def test_t2_lpt_queued_nodes_start_longest_estimate_first() -> None:
    # Run "holder" keeps the engine's only slot while run "queued" enqueues all its
    # entry nodes, so every one of them is ordered by the policy alone.
    hooks = trained(a=0.001, b=0.002, c=0.003, d=0.004)
    engine, events = recorded({"capacity": 1, "admission": "lpt", "tail": hooks})
    holding, release = asyncio.Event(), asyncio.Event()

    async def hold(x: Any) -> None:
        holding.set()
        await release.wait()

    holder = tr.Graph("holder")
    holder.add_node("hold", hold)
    queued = tr.Graph("queued")
    for name in ["unknown", "a", "c", "b", "d"]:  # "unknown" has no estimate yet
        queued.add_node(name, instant(name))

    enqueued = asyncio.Event()  # RUN_STARTED is published once the entries were admitted
    engine.bus.subscribe(
        lambda e: enqueued.set() if e.data.get("graph") == "queued" else None,
        tr.EventType.RUN_STARTED,
    )

    async with asyncio.timeout(GUARD):
        first = asyncio.create_task(engine.run(holder))
        await holding.wait()
        second = asyncio.create_task(engine.run(queued))
        await enqueued.wait()
        assert engine.slots is not None and engine.slots.waiting() == 5
        release.set()
        await first
        result = await second

    assert result.status == "completed"
    assert started(events) == ["hold", "d", "c", "b", "a", "unknown"]


async def test_t2_lpt_simultaneously_ready_batch_starts_longest_first() -> None:
    # The fan-out becomes ready in one harvest with the slot free: the longest
    # estimate must take it, even though it is defined last.
    hooks = trained(src=0.001, join=0.001, a=0.001, b=0.002, c=0.003, d=0.004)
    engine, events = recorded({"capacity": 1, "admission": "lpt", "tail": hooks})

    async with asyncio.timeout(GUARD):
        await engine.run(fan_out(["a", "b", "c", "d"], instant), 0)

    assert started(events) == ["src", "d", "c", "b", "a", "join"]


class SteppedClock:
    """The run loop's ``time`` module with a monotonic clock that moves only when told to.

    Durations the engine measures are then exactly what the handlers say they
    took, however loaded the machine is; wall-clock time stays real.
    """

    def __init__(self) -> None:
        self.now = 1_000.0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return time.time()


async def test_t2_lpt_learns_estimates_in_one_run_then_orders_the_next(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The first run (no estimates: fifo) teaches each node's duration; the second
    # admits the queued nodes longest first. "d" is defined first and is the
    # longest, so this does not depend on who takes the free slot.
    sleeps = {"d": 0.10, "a": 0.01, "b": 0.03, "c": 0.06}
    clock = SteppedClock()
    monkeypatch.setattr("tailrace.core._loop.time", clock)

    def sleeper(name: str) -> Callable[[Any], Awaitable[Any]]:
        async def handler(x: Any) -> str:
            clock.now += sleeps[name]  # it "took" that long, on the engine's clock
            await asyncio.sleep(0)
            return name

        return handler

    graph = fan_out(list(sleeps), sleeper)
    engine, events = recorded({"capacity": 1, "admission": "lpt"})
    async with asyncio.timeout(GUARD):
        await engine.run(graph, 0)
        assert started(events) == ["src", "d", "a", "b", "c", "join"]  # nothing learnt yet
        events.clear()
        result = await engine.run(graph, 0)

    assert result.status == "completed"
    assert started(events) == ["src", "d", "c", "b", "a", "join"]


async def test_t2_lpt_estimates_from_declared_cost_on_a_shared_key() -> None:
    # One estimator (estimate_key="work") fitted as seconds = 0.001 * cost; each
    # node's cost is a function of its input, so the order follows the input.
    hooks = TailHooks()
    for cost in (10.0, 20.0, 30.0):
        hooks.estimator("work").observe(cost, 0.001 * cost)
    engine, events = recorded({"capacity": 1, "admission": "lpt", "tail": hooks})
    sizes = {"w80": 80.0, "w5": 5.0, "w50": 50.0, "w20": 20.0}

    g = tr.Graph("costed")
    g.add_node("src", lambda x: x)
    for name in sizes:
        g.add_node(name, instant(name), cost=lambda x, name=name: x[name], estimate_key="work")
        g.add_edge("src", name)

    async with asyncio.timeout(GUARD):
        result = await engine.run(g, sizes)

    assert result.status == "completed"
    assert started(events) == ["src", "w80", "w50", "w20", "w5"]
    assert hooks.estimator("work").count == 3 + len(sizes)  # winners are observed


# -- T3: stragglers -----------------------------------------------------------------------


async def test_t3_straggler_event_while_running() -> None:
    # The handler finishes only once a listener has seen its NODE_STRAGGLER event,
    # which proves the event is published while the attempt is still running.
    seen = asyncio.Event()
    engine, events = recorded({"tail": trained(slow=FAST)})
    engine.bus.subscribe(lambda e: seen.set(), tr.EventType.NODE_STRAGGLER)
    g = tr.Graph("straggle")

    async def slow(x: Any) -> str:
        await seen.wait()
        return "done"

    g.add_node("slow", slow)
    async with asyncio.timeout(GUARD):
        result = await engine.run(g, 0)

    assert (result.output, result.stragglers, result.hedges) == ("done", 1, 0)
    [straggler] = of(events, tr.EventType.NODE_STRAGGLER, "slow")
    assert straggler.visit == 1
    assert straggler.data["factor"] == 3.0
    assert straggler.data["estimate"] == pytest.approx(FAST)
    assert straggler.data["elapsed"] >= straggler.data["estimate"]
    [completed] = of(events, tr.EventType.NODE_COMPLETED, "slow")
    assert straggler.seq < completed.seq
    assert len(of(events, tr.EventType.NODE_STARTED, "slow")) == 1  # no hedge asked for
    assert of(events, tr.EventType.NODE_HEDGED) == []


async def test_t3_estimator_learns_across_runs_of_one_engine_then_hedges() -> None:
    # No TailHooks given: hedge=True makes the engine build one and keep it across
    # runs; three quick runs teach it, then a run whose first attempt hangs is hedged.
    engine, events = recorded({"straggler_factor": 2.0})
    calls: list[str] = []

    async def flaky(x: str) -> str:
        calls.append(x)
        if x == "stall" and calls.count(x) == 1:
            await hang()
        return f"{x} {calls.count(x)}"

    g = tr.Graph("learn")
    g.add_node("flaky", flaky, hedge=True)
    async with asyncio.timeout(GUARD):
        quiet = [await engine.run(g, "quick") for _ in range(3)]
        hedged = await engine.run(g, "stall")

    assert [(r.stragglers, r.hedges) for r in quiet] == [(0, 0)] * 3
    assert (hedged.output, hedged.stragglers, hedged.hedges) == ("stall 2", 1, 1)
    [straggler] = of(events, tr.EventType.NODE_STRAGGLER)
    assert straggler.data["factor"] == 2.0


# -- T3: hedges ---------------------------------------------------------------------------


async def test_t3_hedge_first_wins_loser_cancelled() -> None:
    engine, events = recorded({"tail": trained(h=FAST)})
    calls = 0
    loser_cancelled = False

    async def h(x: Any) -> str:
        nonlocal calls, loser_cancelled
        calls += 1
        if calls == 1:
            try:
                await hang()
            except asyncio.CancelledError:
                loser_cancelled = True
                raise
        return f"attempt {calls}"

    g = tr.Graph("hedge")
    g.add_node("h", h, hedge=True)
    async with asyncio.timeout(GUARD):
        result = await engine.run(g, 0)

    assert result.status == "completed"
    assert result.output == result.results["h"] == "attempt 2"
    assert (result.stragglers, result.hedges) == (1, 1)
    assert loser_cancelled  # cancelled *and awaited* before run() returned
    assert leftover_tasks() == []
    assert [e.data.get("hedge", False) for e in of(events, tr.EventType.NODE_STARTED, "h")] == [
        False,
        True,
    ]
    assert len(of(events, tr.EventType.NODE_STRAGGLER, "h")) == 1
    assert len(of(events, tr.EventType.NODE_HEDGED, "h")) == 1
    [completed] = of(events, tr.EventType.NODE_COMPLETED, "h")
    assert completed.data["hedge"] is True
    assert of(events, tr.EventType.NODE_FAILED) == []
    assert result.visits["h"] == 1


async def test_t3_hedge_backup_failure_ignored_while_primary_runs() -> None:
    engine, events = recorded({"tail": trained(h=FAST)})
    backup_failed = asyncio.Event()
    calls = 0

    async def h(x: Any) -> str:
        nonlocal calls
        calls += 1
        if calls == 2:
            backup_failed.set()
            raise RuntimeError("backup broke")
        await backup_failed.wait()
        await asyncio.sleep(0.05)  # ordering guard: the failure is harvested first
        return "primary"

    g = tr.Graph("hedge")
    g.add_node("h", h, hedge=True)
    async with asyncio.timeout(GUARD):
        result = await engine.run(g, 0)

    assert (result.status, result.output, result.hedges) == ("completed", "primary", 1)
    assert len(of(events, tr.EventType.NODE_COMPLETED, "h")) == 1
    assert of(events, tr.EventType.NODE_FAILED) == []


async def test_t3_hedge_primary_failure_ignored_while_backup_runs() -> None:
    engine, events = recorded({"tail": trained(h=FAST)})
    backup_started = asyncio.Event()
    calls = 0

    async def h(x: Any) -> str:
        nonlocal calls
        calls += 1
        if calls == 1:
            await backup_started.wait()
            raise RuntimeError("primary broke")
        backup_started.set()
        await asyncio.sleep(0.05)  # ordering guard: the failure is harvested first
        return "backup"

    g = tr.Graph("hedge")
    g.add_node("h", h, hedge=True)
    async with asyncio.timeout(GUARD):
        result = await engine.run(g, 0)

    assert (result.status, result.output, result.hedges) == ("completed", "backup", 1)
    assert len(of(events, tr.EventType.NODE_COMPLETED, "h")) == 1
    assert of(events, tr.EventType.NODE_FAILED) == []


async def test_t3_hedge_both_attempts_fail_fails_the_run_and_frees_the_slot() -> None:
    engine, events = recorded({"capacity": 1, "tail": trained(h=FAST)})
    backup_failed = asyncio.Event()
    calls = 0

    async def h(x: Any) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            backup_failed.set()
            raise RuntimeError("backup broke")
        await backup_failed.wait()
        await asyncio.sleep(0.05)  # ordering guard: the backup's failure is ignored first
        raise RuntimeError("primary broke")

    g = tr.Graph("hedge")
    g.add_node("h", h, hedge=True)
    async with asyncio.timeout(GUARD):
        with pytest.raises(RuntimeError, match="primary broke"):
            await engine.run(g, 0)

    assert engine.slots is not None and engine.slots.in_use == 0
    [failed] = of(events, tr.EventType.NODE_FAILED, "h")
    assert "primary broke" in failed.data["error"]
    assert leftover_tasks() == []


async def test_t3_hedge_holds_one_slot_and_releases_it_once() -> None:
    # capacity=1: the backup runs beside its primary without a slot of its own,
    # the visit gives back exactly one slot, and the next node gets it.
    engine, events = recorded({"capacity": 1, "tail": trained(h=FAST)})
    calls = 0

    async def h(x: Any) -> str:
        nonlocal calls
        calls += 1
        if calls == 1:
            await hang()
        return "h"

    g = tr.Graph("hedge")
    g.add_node("h", h, hedge=True)
    g.add_node("after", lambda x: x + "!")
    g.add_edge("h", "after")
    async with asyncio.timeout(GUARD):
        result = await engine.run(g, 0)

    assert (result.output, result.hedges) == ("h!", 1)
    assert engine.slots is not None
    assert (engine.slots.in_use, engine.slots.waiting()) == (0, 0)
    assert started(events) == ["h", "h", "after"]


async def test_t3_hedge_rivals_finishing_in_one_harvest_complete_once() -> None:
    # The backup releases the primary and returns: both finish before the loop
    # wakes, so they arrive in the same harvest. Only one may be committed.
    engine, events = recorded({"tail": trained(h=FAST)})
    release = asyncio.Event()
    calls = 0

    async def h(x: Any) -> str:
        nonlocal calls
        calls += 1
        if calls == 1:
            await release.wait()
            return "primary"
        release.set()
        return "backup"

    g = tr.Graph("hedge")
    g.add_node("h", h, hedge=True)
    async with asyncio.timeout(GUARD):
        result = await engine.run(g, 0)

    assert result.status == "completed"
    assert result.output in ("primary", "backup")
    assert len(of(events, tr.EventType.NODE_COMPLETED, "h")) == 1


async def test_t3_hedge_backup_failing_in_the_primarys_harvest_is_ignored() -> None:
    engine, events = recorded({"tail": trained(h=FAST)})
    release = asyncio.Event()
    calls = 0

    async def h(x: Any) -> str:
        nonlocal calls
        calls += 1
        if calls == 1:
            await release.wait()
            return "primary"
        release.set()
        raise RuntimeError("backup broke")

    g = tr.Graph("hedge")
    g.add_node("h", h, hedge=True)
    async with asyncio.timeout(GUARD):
        result = await engine.run(g, 0)

    assert (result.status, result.output) == ("completed", "primary")
    assert len(of(events, tr.EventType.NODE_COMPLETED, "h")) == 1
    assert of(events, tr.EventType.NODE_FAILED) == []


@pytest.mark.parametrize("path", ["direct", "retry", "map item"])
async def test_t5_current_node_tells_a_backup_which_attempt_it_backs_up(path: str) -> None:
    # The primary hangs; its backup sees that it is one, and of which attempt, on each
    # path an attempt takes (the short path, retries and timeouts, a map's item), while
    # its stream chunks and events keep the primary's attempt number and the hedge flag.
    engine, events = recorded({"tail": trained(h=FAST)})
    seen: list[tuple[int, bool, int | None, int | None]] = []

    async def h(x: Any) -> str:
        ctx = tr.current_node(required=True)
        seen.append((ctx.attempt, ctx.backup, ctx.backup_of, ctx.item))
        ctx.stream("backup" if ctx.backup else "primary")
        if not ctx.backup:
            await hang()
        return f"{x} by the backup of attempt {ctx.backup_of}"

    g = tr.Graph("visible")
    if path == "map item":
        g.add_node("h", h, tr.NodeKind.MAP, hedge=True)
        item: int | None = 0
    else:
        retry = tr.RetryPolicy(attempts=2) if path == "retry" else None
        g.add_node("h", h, hedge=True, retry=retry)
        item = None
    chunks: list[tr.Chunk] = []
    with engine.on_chunk("visible", chunks.append):
        async with asyncio.timeout(GUARD):
            result = await engine.run(g, ["x"] if path == "map item" else "x", run_id="visible")

    expected = "x by the backup of attempt 1"
    assert result.output == ([expected] if path == "map item" else expected)
    assert seen == [(1, False, None, item), (1, True, 1, item)]
    tagged = [(c.attempt, c.hedge, c.value) for c in chunks if not c.terminal]
    assert tagged == [(1, False, "primary"), (1, True, "backup")]
    [completed] = [
        e for e in of(events, tr.EventType.NODE_COMPLETED, "h") if e.data.get("item") == item
    ]
    assert completed.data["hedge"] is True  # the winner, recorded with the result


async def test_t3_the_hedge_delay_is_a_high_quantile_of_observed_durations() -> None:
    # 40 observations of 10 ms and one of 40 ms: the 97th percentile is 10 ms, far below
    # factor x estimate (500 ms); with fewer observations, factor x estimate it is.
    hooks = TailHooks(factor=50.0, quantile=0.97, min_observations=30)
    for _ in range(40):
        hooks.estimator("slow").observe(1.0, 0.01)
    hooks.estimator("slow").observe(1.0, 0.04)
    engine, events = recorded({"tail": hooks})
    seen = asyncio.Event()
    engine.bus.subscribe(lambda e: seen.set(), tr.EventType.NODE_STRAGGLER)

    async def slow(x: Any) -> str:
        await seen.wait()
        return "done"

    g = tr.Graph("adaptive")
    g.add_node("slow", slow)
    async with asyncio.timeout(GUARD):
        await engine.run(g, 0)
    [straggler] = of(events, tr.EventType.NODE_STRAGGLER, "slow")
    estimate = straggler.data["estimate"]
    assert straggler.data["quantile"] == 0.97
    assert straggler.data["delay"] == pytest.approx(estimate)  # ratio 1.0 at the 97th
    assert straggler.data["delay"] < hooks.factor * estimate / 10

    fresh = TailHooks(factor=5.0, min_observations=30)
    for _ in range(3):
        fresh.estimator("slow").observe(1.0, 0.01)
    engine, events = recorded({"tail": fresh})
    seen = asyncio.Event()
    engine.bus.subscribe(lambda e: seen.set(), tr.EventType.NODE_STRAGGLER)
    async with asyncio.timeout(GUARD):
        await engine.run(g, 0)
    [straggler] = of(events, tr.EventType.NODE_STRAGGLER, "slow")
    assert "quantile" not in straggler.data
    assert straggler.data["delay"] == pytest.approx(5.0 * 0.01)


async def test_t3_the_engine_learns_its_hedge_delay_from_the_attempts_it_runs() -> None:
    # A map of 30 quick items teaches the engine the items' durations; in the next run
    # the stalled item's backup comes at the learned quantile, which is far below
    # factor x estimate, so the straggler event says so.
    hooks = TailHooks(factor=1000.0, min_observations=20)
    engine, events = recorded({"tail": hooks})
    stall = asyncio.Event()

    async def item(j: int) -> int:
        ctx = tr.current_node(required=True)
        if j == 0 and stall.is_set() and not ctx.backup:
            await hang()
        await asyncio.sleep(0.001)
        return j

    g = tr.Graph("learned")
    g.add_node("each", item, tr.NodeKind.MAP, hedge=True)
    async with asyncio.timeout(GUARD):
        await engine.run(g, list(range(30)))
        stall.set()
        result = await engine.run(g, list(range(30)))

    assert result.output == list(range(30))
    assert result.hedges >= 1
    stalled = [e for e in of(events, tr.EventType.NODE_STRAGGLER) if e.data["item"] == 0]
    assert stalled and stalled[-1].data["quantile"] == hooks.quantile
    assert stalled[-1].data["delay"] < 10 * stalled[-1].data["estimate"]  # not 1000x


@pytest.fixture(params=["memory", "sqlite"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    backend: RunStore = (
        MemoryStore() if request.param == "memory" else SQLiteStore(tmp_path / "x.db")
    )
    async with backend:
        yield backend


async def test_t3_hedged_result_committed_exactly_once(store: RunStore) -> None:
    engine, _ = recorded({"store": store, "tail": trained(h=FAST)})
    calls = 0

    async def h(x: Any) -> str:
        nonlocal calls
        calls += 1
        if calls == 1:
            await hang()
        return f"attempt {calls}"

    g = tr.Graph("hedge")
    g.add_node("h", h, hedge=True)
    g.add_node("after", lambda x: x.upper())
    g.add_edge("h", "after")
    async with asyncio.timeout(GUARD):
        result = await engine.run(g, 0, run_id="hedged")

    assert (result.output, result.hedges) == ("ATTEMPT 2", 1)
    rows = await store.results("hedged", "h")
    assert [(r.visit, r.value_json) for r in rows] == [(1, '"attempt 2"')]
    stored = [e.type for e in await store.events("hedged") if e.node_id == "h"]
    assert stored.count(tr.EventType.NODE_COMPLETED.value) == 1
    assert stored.count(tr.EventType.NODE_STARTED.value) == 2
    assert (await store.get_run("hedged")).status == "completed"


async def test_t3_no_hedge_starts_once_the_run_is_failing() -> None:
    # E9 cancels "slow" while its straggler timer is still armed; the attempt's
    # cleanup outlasts the timer, which fires meanwhile. No backup may start then:
    # it would outlive the run, owned by nobody. "boom" fails as soon as "slow" has
    # started, and the timer sits at 3 x 100 ms, so the failure is harvested
    # long before it fires even on a loaded machine.
    estimate = 0.1
    engine, events = recorded({"tail": trained(slow=estimate)})
    calls: list[str] = []
    slow_started = asyncio.Event()

    async def boom(x: Any) -> None:
        await slow_started.wait()
        raise RuntimeError("boom")

    async def slow(x: Any) -> str:
        calls.append("start")
        started = time.monotonic()
        slow_started.set()
        try:
            await hang()
        except asyncio.CancelledError:
            calls.append("cancelled")
            # Cleanup until well past the timer's due time; the cancellation is
            # re-raised after it.
            await asyncio.sleep(max(0.0, started + 6 * estimate - time.monotonic()))
            raise
        return "slow"

    g = tr.Graph("fail")
    g.add_node("boom", boom)
    g.add_node("slow", slow, hedge=True)
    try:
        async with asyncio.timeout(GUARD):
            with pytest.raises(RuntimeError, match="boom"):
                await engine.run(g, 0)
        orphans = leftover_tasks()
        assert orphans == []
        assert calls == ["start", "cancelled"]
        assert of(events, tr.EventType.NODE_HEDGED) == []
    finally:
        orphans = leftover_tasks()  # do not leak a bug's orphan into other tests
        for task in orphans:
            task.cancel()
        await asyncio.gather(*orphans, return_exceptions=True)
