"""The hedge policy (T3, T5): backups ahead of queued first attempts within a token bucket,
clones at launch on idle capacity, adaptive delays.

Estimators are pre-trained, so which attempt is cloned or backed up is decided
by the estimates alone. Nothing here waits on time: handlers wait on events
set by bus listeners (a straggler seen, a hedge started) or by the rival
attempt, and every run is wrapped in ``asyncio.timeout`` so a bug fails
instead of hanging.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

import tailrace as tr
from tailrace.stores import SQLiteStore
from tailrace.tail import HedgePolicy, TailHooks
from tests import fixtures

GUARD = 10.0  # seconds; only there so that a bug fails the test instead of hanging it


def trained(policy: HedgePolicy, factor: float = 1.5, **seconds: float) -> TailHooks:
    """TailHooks with ``policy`` whose estimator for each key answers ``seconds`` (cost 1.0)."""
    hooks = TailHooks(factor=factor, hedging=policy)
    for key, value in seconds.items():
        for _ in range(3):
            hooks.estimator(key).observe(1.0, value)
    return hooks


def recorded(**engine_kwargs: Any) -> tuple[tr.Engine, list[tr.Event]]:
    bus = tr.EventBus()
    events: list[tr.Event] = []
    bus.subscribe(events.append)
    return tr.Engine(bus=bus, **engine_kwargs), events


def of(events: list[tr.Event], type: tr.EventType, node: str | None = None) -> list[tr.Event]:
    return [e for e in events if e.type is type and (node is None or e.node_id == node)]


def fan(handlers: dict[str, Callable[[Any], Awaitable[Any]]], key: str | None = None) -> tr.Graph:
    """src -> each handler (hedge=True, in this order) -> join; estimates keyed by ``key``
    (default: each node's id)."""
    g = tr.Graph("fan")
    g.add_node("src", lambda x: x)
    g.add_node("join", lambda xs: sorted(map(str, xs)), tr.NodeKind.AGGREGATE)
    for name, handler in handlers.items():
        g.add_node(name, handler, hedge=True, estimate_key=key)
        g.add_edge("src", name)
        g.add_edge(name, "join")
    return g


def straggling(**engine_kwargs: Any) -> tuple[TailHooks, tr.Engine, list[tr.Event], asyncio.Event]:
    """An engine whose hedge policy backs "stall" up 10 ms in (it straggles at 15 ms), its
    hooks, its recorded events, and an event set at the first straggler."""
    policy = HedgePolicy(backup_after=1.0, slack=0.0, tolerance=100.0)
    hooks = trained(policy, factor=1.5, stall=0.01, w=0.01)
    engine, events = recorded(tail=hooks, **engine_kwargs)
    straggled = asyncio.Event()
    engine.bus.subscribe(lambda e: straggled.set(), tr.EventType.NODE_STRAGGLER)
    return hooks, engine, events, straggled


class Attempts:
    """Counts each node's attempts; ``first(name)`` is true for its first one."""

    def __init__(self) -> None:
        self.count: dict[str, int] = {}

    def first(self, name: str) -> bool:
        self.count[name] = self.count.get(name, 0) + 1
        return self.count[name] == 1


# -- the policy on its own ---------------------------------------------------------------


def test_policy_clones_only_what_a_late_backup_could_not_save() -> None:
    policy = HedgePolicy(backup_after=1.5, slack=0.0, tolerance=1.5)
    # A stalled attempt backed up after 1.5 x e ends at 2.5 x e: past 1.5 x the
    # longest only when e > 0.6 x longest.
    assert [policy.clones_at_launch(e, 1.0) for e in (1.0, 0.61, 0.6, 0.1)] == [
        True,
        True,
        False,
        False,
    ]
    assert policy.backup_delay(2.0) == 3.0


def test_the_budget_is_a_token_bucket_that_starts_full_and_refills_as_attempts_start() -> None:
    budget = HedgePolicy(budget=0.25, burst=2.0).new_budget()
    assert [budget.take(), budget.take(), budget.take()] == [True, True, False]
    assert [budget.refill() for _ in range(4)] == [False, False, False, True]  # 4 x 0.25
    assert (budget.take(), budget.take()) == (True, False)
    for _ in range(100):
        budget.refill()
    assert budget.tokens == 2.0  # never more than burst
    budget.take()
    budget.refund()
    budget.refund()
    assert budget.tokens == 2.0


def test_a_node_budget_bounds_each_node_within_the_engines() -> None:
    from tailrace.graph import Node

    policy = HedgePolicy(budget=0.0, burst=3.0, node_budget=0.5, node_burst=1.0)
    hooks = TailHooks(hedging=policy)
    a, b = Node(id="a", handler=print), Node(id="b", handler=print)
    assert (hooks.take(a), hooks.take(a), hooks.take(b)) == (True, False, True)
    hooks.started(a)
    hooks.started(a)  # a's own attempts refill a's bucket; the engine's has one left
    assert (hooks.take(a), hooks.take(b), hooks.allowed) == (True, False, 3)
    hooks.refund(a)
    assert (hooks.allowed, hooks.budget is not None and hooks.budget.tokens) == (2, 1.0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"budget": 1.5}, {"budget": -0.1}, {"burst": 0.5}, {"node_budget": 2.0},
        {"node_burst": 0.0}, {"backup_after": 0.0}, {"slack": -1.0}, {"tolerance": 0.9},
    ],
)  # fmt: skip
def test_policy_refuses_nonsense(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        HedgePolicy(**kwargs)


# -- on the engine ------------------------------------------------------------------------


async def test_the_longest_estimated_node_of_a_batch_is_cloned_at_launch() -> None:
    policy = HedgePolicy(budget=0.5, backup_after=1.5, slack=0.0, tolerance=1.5)
    hooks = trained(policy, long=0.5, short=0.01)
    engine, events = recorded(tail=hooks)
    attempts = Attempts()

    async def long(x: Any) -> str:
        if attempts.first("long"):
            await asyncio.Event().wait()  # stalls; only its clone can finish
        return "long"

    async def short(x: Any) -> str:
        attempts.first("short")
        return "short"

    g = fan({"long": long, "short": short})
    async with asyncio.timeout(GUARD):
        result = await engine.run(g, 0)

    assert result.output == ["long", "short"]
    assert result.hedges == 1
    [hedged] = of(events, tr.EventType.NODE_HEDGED)
    assert (hedged.node_id, hedged.data) == ("long", {"reason": "clone", "budget": 0.5})
    assert attempts.count == {"long": 2, "short": 1}
    assert of(events, tr.EventType.NODE_FAILED) == []


async def test_a_backup_takes_the_next_free_slot_ahead_of_queued_first_attempts() -> None:
    # capacity 2: "stall" and "w1" run, "w2" and "w3" wait in the queue. "stall" straggles;
    # its backup asks for a slot ahead of the queue, and gets the one "w1" frees when it
    # ends (w1 is never preempted), before "w2" and "w3" start (T5).
    _, engine, events, straggled = straggling(capacity=2)
    attempts = Attempts()

    async def stall(x: Any) -> str:
        if attempts.first("stall"):
            await asyncio.Event().wait()  # only its backup can finish
        return "stall"

    def worker(name: str) -> Callable[[Any], Awaitable[str]]:
        async def handler(x: Any) -> str:
            attempts.first(name)
            if name == "w1":
                await straggled.wait()  # holds its slot until "stall" straggles
            return name

        return handler

    g = tr.Graph("queue")
    g.add_node("src", lambda x: x)
    g.add_node("join", lambda xs: sorted(xs), tr.NodeKind.AGGREGATE)
    g.add_node("stall", stall, hedge=True)
    for name in ("w1", "w2", "w3"):
        g.add_node(name, worker(name), estimate_key="w")
    for name in ("stall", "w1", "w2", "w3"):
        g.add_edge("src", name)
        g.add_edge(name, "join")
    async with asyncio.timeout(GUARD):
        result = await engine.run(g, 0)

    assert result.output == ["stall", "w1", "w2", "w3"]
    assert (result.hedges, result.hedges_refused) == (1, 0)
    assert attempts.count == {"stall": 2, "w1": 1, "w2": 1, "w3": 1}
    order = [(e.type, e.node_id, bool(e.data.get("hedge"))) for e in events]
    backup = order.index((tr.EventType.NODE_STARTED, "stall", True))
    assert order.index((tr.EventType.NODE_COMPLETED, "w1", False)) < backup
    assert backup < order.index((tr.EventType.NODE_STARTED, "w2", False))
    [hedged] = of(events, tr.EventType.NODE_HEDGED)
    assert (hedged.node_id, hedged.attempt, hedged.data["reason"]) == ("stall", 1, "backup")
    assert of(events, tr.EventType.NODE_CANCELLED) == []  # nothing running was preempted
    assert engine.slots is not None
    assert (engine.slots.in_use, engine.slots.waiting()) == (0, 0)


async def test_the_budget_bounds_backups_and_counts_those_it_refused() -> None:
    # Ten stalled first attempts; a bucket of three tokens that nothing refills: three
    # backups start, and the seven stragglers still waiting for a token when they end
    # are counted refused, in the run's result, its events and the engine's hooks.
    policy = HedgePolicy(budget=0.0, burst=3.0, backup_after=1.0, slack=0.0, tolerance=100.0)
    names = [f"t{k}" for k in range(10)]
    hooks = trained(policy, task=0.01)
    engine, events = recorded(tail=hooks)
    three_hedged = asyncio.Event()
    attempts = Attempts()

    def on_hedged(event: tr.Event) -> None:
        if len(of(events, tr.EventType.NODE_HEDGED)) >= 3:
            three_hedged.set()

    engine.bus.subscribe(on_hedged, tr.EventType.NODE_HEDGED)

    def stalls_once(name: str) -> Callable[[Any], Awaitable[str]]:
        async def handler(x: Any) -> str:
            if attempts.first(name):
                await three_hedged.wait()  # released once the budget is spent
            return name

        return handler

    g = fan({name: stalls_once(name) for name in names}, key="task")
    async with asyncio.timeout(GUARD):
        result = await engine.run(g, 0)

    assert result.status == "completed"
    assert (result.hedges, result.hedges_refused) == (3, 7)
    assert (hooks.allowed, hooks.refused) == (3, 7)
    hedged = of(events, tr.EventType.NODE_HEDGED)
    assert [e.data["reason"] for e in hedged] == ["backup"] * 3
    refused = of(events, tr.EventType.NODE_HEDGE_REFUSED)
    assert {e.node_id for e in refused} | {e.node_id for e in hedged} == set(names)
    assert all(e.data == {"budget": 0.0} and e.attempt == 1 for e in refused)
    starts = of(events, tr.EventType.NODE_STARTED)
    assert sum(bool(e.data.get("hedge")) for e in starts) == 3
    assert sum(attempts.count.values()) == 10 + 3


async def test_a_straggler_waiting_for_a_token_gets_its_backup_as_attempts_start() -> None:
    # One token: "s1" takes it. "s2" waits for one while "c1" and "c2" start, each adding
    # half a token (T5: refilled as attempts start); then its backup starts.
    policy = HedgePolicy(budget=0.5, burst=1.0, backup_after=1.0, slack=0.0, tolerance=100.0)
    hooks = trained(policy, s1=0.01, s2=0.02, c=0.01)
    engine, events = recorded(tail=hooks)
    s2_starved = asyncio.Event()

    def listen(event: tr.Event) -> None:
        # s2 straggles (1.5 x estimate) after its backup came due (1 x): it waits for a token.
        if of(events, tr.EventType.NODE_HEDGED) and of(events, tr.EventType.NODE_STRAGGLER, "s2"):
            s2_starved.set()

    engine.bus.subscribe(listen)
    attempts = Attempts()

    def stalled(name: str) -> Callable[[Any], Awaitable[str]]:
        async def handler(x: Any) -> str:
            if attempts.first(name):
                await asyncio.Event().wait()
            return name

        return handler

    async def c1(x: Any) -> str:
        await s2_starved.wait()
        return "c1"

    g = tr.Graph("refill")
    g.add_node("src", lambda x: x)
    g.add_node("join", lambda xs: sorted(map(str, xs)), tr.NodeKind.AGGREGATE)
    for name in ("s1", "s2"):
        g.add_node(name, stalled(name), hedge=True)
        g.add_edge("src", name)
        g.add_edge(name, "join")
    g.add_node("c1", c1, estimate_key="c")
    g.add_node("c2", lambda x: x, estimate_key="c")
    g.add_node("c3", lambda x: "c3", estimate_key="c")
    g.chain("src", "c1", "c2", "c3", "join")
    async with asyncio.timeout(GUARD):
        result = await engine.run(g, 0)

    assert result.output == ["c3", "s1", "s2"]
    assert (result.hedges, result.hedges_refused) == (2, 0)
    first, second = of(events, tr.EventType.NODE_HEDGED)
    assert (first.node_id, second.node_id) == ("s1", "s2")
    order = [(e.type, e.node_id) for e in events]
    # The bucket was full (one token) until s1 took it; c2 and c3 refilled it.
    assert order.index((tr.EventType.NODE_STARTED, "c3")) < order.index(
        (tr.EventType.NODE_HEDGED, "s2")
    )


async def test_each_node_spends_at_most_its_own_budget() -> None:
    # Three stalled items of map "many" and one of map "one"; the engine's bucket holds
    # four tokens but each node's holds one: one backup per map, the rest refused.
    policy = HedgePolicy(
        budget=0.0, burst=4.0, node_budget=0.0, node_burst=1.0, backup_after=1.0, slack=0.0,
        tolerance=100.0,
    )  # fmt: skip
    hooks = trained(policy, many=0.01, one=0.01)
    engine, events = recorded(tail=hooks)
    two_hedged = asyncio.Event()

    def on_hedged(event: tr.Event) -> None:
        if len(of(events, tr.EventType.NODE_HEDGED)) == 2:
            two_hedged.set()

    engine.bus.subscribe(on_hedged, tr.EventType.NODE_HEDGED)

    async def item(x: str) -> str:
        ctx = tr.current_node(required=True)
        if not ctx.backup:
            await two_hedged.wait()
        return x

    g = tr.Graph("per_node")
    g.add_node("src", lambda x: x)
    g.add_node("three", lambda x: ["a", "b", "c"])
    g.add_node("single", lambda x: ["z"])
    g.add_node("many", item, tr.NodeKind.MAP, hedge=True)
    g.add_node("one", item, tr.NodeKind.MAP, hedge=True)
    g.add_node("join", lambda xs: sorted(map(str, xs)), tr.NodeKind.AGGREGATE)
    g.chain("src", "three", "many", "join")
    g.chain("src", "single", "one", "join")
    async with asyncio.timeout(GUARD):
        result = await engine.run(g, 0)

    assert result.status == "completed"
    hedged = of(events, tr.EventType.NODE_HEDGED)
    assert sorted(str(e.node_id) for e in hedged) == ["many", "one"]
    refused = of(events, tr.EventType.NODE_HEDGE_REFUSED)
    assert [e.node_id for e in refused] == ["many", "many"]
    assert (result.hedges, result.hedges_refused) == (2, 2)


async def test_a_cloned_node_commits_exactly_one_result_on_sqlite(tmp_path: Path) -> None:
    policy = HedgePolicy(budget=0.5, backup_after=1.5, slack=0.0, tolerance=1.5)
    hooks = trained(policy, long=0.5, short=0.01)
    loser_cancelled = asyncio.Event()
    attempts = Attempts()

    async def long(x: Any) -> str:
        if attempts.first("long"):
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                loser_cancelled.set()
                raise
        return "long"

    async def short(x: Any) -> str:
        return "short"

    g = fan({"long": long, "short": short})
    async with SQLiteStore(tmp_path / "runs.db") as store:
        engine = tr.Engine(store=store, tail=hooks)
        async with asyncio.timeout(GUARD):
            result = await engine.run(g, 0, run_id="cloned")
        rows = await store.results("cloned", "long")
        stored = [e for e in await store.events("cloned") if e.node_id == "long"]
        status = (await store.get_run("cloned")).status

    assert (result.output, result.hedges) == (["long", "short"], 1)
    assert loser_cancelled.is_set()  # cancelled and awaited before run() returned
    assert [(r.visit, r.value_json) for r in rows] == [(1, '"long"')]
    types = [e.type for e in stored]
    assert types.count(tr.EventType.NODE_STARTED.value) == 2
    assert types.count(tr.EventType.NODE_COMPLETED.value) == 1
    assert types.count(tr.EventType.NODE_HEDGED.value) == 1
    assert status == "completed"


async def test_without_a_policy_hedge_nodes_still_wait_for_the_straggler_threshold() -> None:
    # hedging=None keeps T3's threshold backup: no clone at launch.
    hooks = TailHooks(factor=3.0)
    for key in ("long", "short"):
        for _ in range(3):
            hooks.estimator(key).observe(1.0, 0.01)
    engine, events = recorded(tail=hooks)

    async def quick(x: Any) -> str:
        return "ok"

    g = fan({"long": quick, "short": quick})
    async with asyncio.timeout(GUARD):
        result = await engine.run(g, 0)
    assert (result.output, result.hedges) == (["ok", "ok"], 0)
    assert of(events, tr.EventType.NODE_HEDGED) == []


# -- backups ahead of the queue: the paths that end a request (T5) ------------------------


def queued_graph(
    stall: Callable[[Any], Awaitable[str]], blocker: Callable[[Any], Awaitable[str]]
) -> tr.Graph:
    """src -> stall (hedge=True), blocker, q -> join: under capacity 2, q waits in the queue."""
    g = tr.Graph("ahead")
    g.add_node("src", lambda x: x)
    g.add_node("join", lambda xs: sorted(map(str, xs)), tr.NodeKind.AGGREGATE)
    g.add_node("stall", stall, hedge=True)
    g.add_node("blocker", blocker, estimate_key="w")
    g.add_node("q", lambda x: "q", estimate_key="w")
    for name in ("stall", "blocker", "q"):
        g.add_edge("src", name)
        g.add_edge(name, "join")
    return g


async def test_a_backup_whose_primary_ends_first_gives_its_token_and_place_back() -> None:
    # stall's backup waits ahead of q for a slot; stall's primary ends meanwhile. Its
    # request is withdrawn and its token returned: the slot blocker frees goes to q.
    hooks, engine, events, straggled = straggling(capacity=2)
    stall_done = asyncio.Event()
    engine.bus.subscribe(
        lambda e: e.node_id == "stall" and stall_done.set(), tr.EventType.NODE_COMPLETED
    )

    async def stall(x: Any) -> str:
        await straggled.wait()  # past its hedge delay (its backup waits), then it ends
        return "stall"

    async def blocker(x: Any) -> str:
        await stall_done.wait()
        return "blocker"

    async with asyncio.timeout(GUARD):
        result = await engine.run(queued_graph(stall, blocker), 0)

    assert result.output == ["blocker", "q", "stall"]
    assert (result.hedges, result.hedges_refused, hooks.allowed) == (0, 0, 0)
    assert of(events, tr.EventType.NODE_HEDGED) == []
    assert hooks.budget is not None and hooks.budget.tokens == hooks.budget.burst
    assert engine.slots is not None
    assert (engine.slots.in_use, engine.slots.waiting()) == (0, 0)


async def test_a_run_cancelled_while_its_backup_waits_ahead_frees_everything() -> None:
    hooks, engine, events, straggled = straggling(capacity=2)

    async def stall(x: Any) -> str:
        await asyncio.Event().wait()
        return "stall"

    async def blocker(x: Any) -> str:
        await asyncio.Event().wait()
        return "blocker"

    async with asyncio.timeout(GUARD):
        run = asyncio.ensure_future(engine.run(queued_graph(stall, blocker), 0))
        await straggled.wait()  # the backup waits ahead of q for a slot
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run

    assert engine.slots is not None
    assert (engine.slots.in_use, engine.slots.waiting()) == (0, 0)
    assert hooks.allowed == 0  # its token came back
    assert of(events, tr.EventType.NODE_HEDGED) == []

    async def quick(x: Any) -> str:
        return "done"

    async with asyncio.timeout(GUARD):  # nothing leaked: the engine runs on
        result = await engine.run(queued_graph(quick, quick), 0)
    assert result.output == ["done", "done", "q"]


@pytest.mark.parametrize("primary_ends_first", [False, True])
async def test_a_backup_goes_ahead_of_another_runs_queue_and_gives_back_what_it_held(
    primary_ends_first: bool,
) -> None:
    # Engine capacity 2, each run's 2. Run a's "stall" holds one engine slot, run b's "b1"
    # the other, b's "b2" and "b3" wait. a's backup takes a's second run slot, then waits
    # for an engine slot ahead of b2 and b3: it gets the one b1 frees. Or a's primary ends
    # first: the backup's request is withdrawn, and the run slot it held is a's again, so
    # a's "x" and "y" can run side by side (each waits until both started).
    hooks, engine, events, straggled = straggling(capacity=2, run_capacity=2)
    stall_done = asyncio.Event()
    engine.bus.subscribe(
        lambda e: e.node_id == "stall" and stall_done.set(), tr.EventType.NODE_COMPLETED
    )
    attempts = Attempts()
    both = asyncio.Barrier(2)

    async def stall(x: Any) -> str:
        if attempts.first("stall"):
            await (straggled.wait() if primary_ends_first else asyncio.Event().wait())
        return "stall"

    async def side(x: Any) -> str:
        await both.wait()
        return "side"

    a = tr.Graph("a")
    a.add_node("stall", stall, hedge=True)
    a.add_node("x", side, estimate_key="w")
    a.add_node("y", side, estimate_key="w")
    a.add_edge("stall", "x")
    a.add_edge("stall", "y")

    async def b1(x: Any) -> str:
        await (stall_done.wait() if primary_ends_first else straggled.wait())
        return "b1"

    b = tr.Graph("b")
    b.add_node("src", lambda x: x)
    b.add_node("b1", b1, estimate_key="w")
    b.add_node("b2", lambda x: "b2", estimate_key="w")
    b.add_node("b3", lambda x: "b3", estimate_key="w")
    for name in ("b1", "b2", "b3"):
        b.add_edge("src", name)
    async with asyncio.timeout(GUARD):
        run_a = asyncio.ensure_future(engine.run(a, 0, run_id="a"))
        await fixtures.until(lambda: of(events, tr.EventType.NODE_STARTED, "stall"), "a started")
        result_b = await engine.run(b, 0, run_id="b")
        result_a = await run_a

    assert (result_a.status, result_b.status) == ("completed", "completed")
    order = [(e.type, e.node_id, bool(e.data.get("hedge"))) for e in events]
    if primary_ends_first:
        assert result_a.hedges == 0 and hooks.allowed == 0
    else:
        assert result_a.hedges == 1
        assert order.index((tr.EventType.NODE_STARTED, "stall", True)) < order.index(
            (tr.EventType.NODE_STARTED, "b2", False)
        )
    assert engine.slots is not None
    assert (engine.slots.in_use, engine.slots.waiting()) == (0, 0)
