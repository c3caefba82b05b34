"""The hedge policy (T3, issue 13): clones at launch, early backups on idle capacity, a budget.

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


def test_policy_budget_is_a_share_of_first_attempts_rounded_up() -> None:
    policy = HedgePolicy(budget=0.1)
    assert policy.allowed(first_attempts=1, extra=0) == 1
    assert policy.allowed(first_attempts=20, extra=1) == 1
    assert policy.allowed(first_attempts=20, extra=2) == 0
    assert HedgePolicy(budget=0.0).allowed(first_attempts=100, extra=0) == 0


@pytest.mark.parametrize(
    "kwargs",
    [{"budget": 1.5}, {"budget": -0.1}, {"backup_after": 0.0}, {"slack": -1.0}, {"tolerance": 0.9}],
)
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
    assert (hedged.node_id, hedged.data) == ("long", {"reason": "clone"})
    assert attempts.count == {"long": 2, "short": 1}
    assert of(events, tr.EventType.NODE_FAILED) == []


async def test_a_backup_goes_to_the_longest_estimate_first_and_only_on_idle_capacity() -> None:
    # capacity 3: a, b and c run; a and b stall past their backup delay while c
    # holds the third slot. One extra attempt is allowed (ceil(0.25 x 4 first
    # attempts)): when c ends, the freed slot goes to b, whose estimate is longer.
    policy = HedgePolicy(budget=0.25, backup_after=1.0, slack=0.0, tolerance=100.0)
    hooks = trained(policy, factor=1.5, a=0.01, b=0.02, c=0.01)
    engine, events = recorded(tail=hooks, capacity=3)
    both_straggling = asyncio.Event()
    release_a = asyncio.Event()
    attempts = Attempts()

    def on_straggler(event: tr.Event) -> None:
        # A straggler event (1.5 x estimate) comes after its backup delay (1.0 x):
        # once a and b both straggle, both are backup candidates.
        seen = {e.node_id for e in of(events, tr.EventType.NODE_STRAGGLER)}
        if {"a", "b"} <= seen:
            both_straggling.set()

    engine.bus.subscribe(on_straggler, tr.EventType.NODE_STRAGGLER)

    async def a(x: Any) -> str:
        attempts.first("a")
        await release_a.wait()
        return "a"

    async def b(x: Any) -> str:
        if attempts.first("b"):
            await asyncio.Event().wait()
        release_a.set()
        return "b"

    async def c(x: Any) -> str:
        attempts.first("c")
        await both_straggling.wait()
        return "c"

    g = fan({"a": a, "b": b, "c": c})
    async with asyncio.timeout(GUARD):
        result = await engine.run(g, 0)

    assert result.output == ["a", "b", "c"]
    assert (result.hedges, attempts.count) == (1, {"a": 1, "b": 2, "c": 1})
    [hedged] = of(events, tr.EventType.NODE_HEDGED)
    assert (hedged.node_id, hedged.data) == ("b", {"reason": "backup"})
    order = [(e.type, e.node_id) for e in events]
    # Idle capacity only: the backup started after c's slot was freed.
    assert order.index((tr.EventType.NODE_COMPLETED, "c")) < order.index(
        (tr.EventType.NODE_HEDGED, "b")
    )
    assert engine.slots is not None and engine.slots.in_use == 0


async def test_the_budget_bounds_backups_however_many_attempts_stall() -> None:
    # Ten stalled first attempts; 12 first attempts x 0.2 allows three backups.
    policy = HedgePolicy(budget=0.2, backup_after=1.0, slack=0.0, tolerance=100.0)
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
    assert result.hedges == 3
    hedged = of(events, tr.EventType.NODE_HEDGED)
    assert [e.data["reason"] for e in hedged] == ["backup"] * 3
    assert len({e.node_id for e in hedged}) == 3  # one backup per node at most
    starts = of(events, tr.EventType.NODE_STARTED)
    assert sum(bool(e.data.get("hedge")) for e in starts) == 3
    assert sum(attempts.count.values()) == 10 + 3


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
