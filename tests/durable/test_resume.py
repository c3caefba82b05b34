"""Durable runs and resume against every store: D1-D6, graph changes, loops.

Each test runs against the memory, SQLite and Postgres stores (Postgres
whenever ``TAILRACE_TEST_POSTGRES_DSN`` is set; each test gets a schema of its
own and unique run ids). A *crash* is simulated in process by cancelling the
task that runs ``Engine.run`` while some handlers are held mid-flight: nothing
more is written for them, so the store looks exactly as after a process
death at that point. The stores take a fake wall clock (``clock=``) so lease
expiry is a step of the test, not a sleep.

Orderings are forced by holding handlers on ``asyncio.Event``s and by polling
the store for the rows a step needs; ``until`` gives up after ``HANG_GUARD``
seconds, which is a deadlock guard, never a timing assertion.
"""

from __future__ import annotations

import asyncio
import importlib
import itertools
import json
import textwrap
import uuid
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

import tailrace as tr
from tailrace._errors import (
    EncodeError,
    GraphMismatch,
    LeaseHeld,
    LeaseLost,
    NotResumable,
    RunNotFound,
    StoreError,
    TailraceError,
    UnsupportedFormat,
)
from tailrace.core._writer import NODE_ROW_VERSION
from tailrace.stores import (
    FORMAT_VERSION,
    Harvest,
    NewRun,
    ResultRow,
    RunStatus,
    RunStore,
)
from tests import fixtures

HANG_GUARD = 15.0
TTL = 30.0  # long: with the fake clock, leases expire only when a test says so


# --- stores -------------------------------------------------------------------


Backend = fixtures.Backend
backend = fixtures.backend


# --- probes, crashes, snapshots ----------------------------------------------------


class Probe:
    """Counts handler executions per (node, visit) and holds chosen ones mid-flight.

    ``held`` names nodes (or ``(node, visit)`` pairs) whose executions wait, each
    on an event of its own, until :meth:`release` or :meth:`release_all`.
    """

    def __init__(self) -> None:
        self.runs: Counter[tuple[str, int]] = Counter()
        self.payloads: defaultdict[tuple[str, int], list[Any]] = defaultdict(list)
        self.order: list[tuple[str, int]] = []
        self.held: set[str | tuple[str, int]] = set()
        self.waiting: defaultdict[str, list[asyncio.Event]] = defaultdict(list)
        self.cancelled: Counter[str] = Counter()

    def executions(self, node: str) -> int:
        return sum(n for (node_id, _), n in self.runs.items() if node_id == node)

    async def enter(self, payload: Any) -> tuple[str, int]:
        ctx = tr.current_node()
        assert ctx is not None
        key = (ctx.node_id, ctx.visit)
        self.runs[key] += 1
        self.payloads[key].append(payload)
        self.order.append(key)
        if ctx.node_id in self.held or key in self.held:
            gate = asyncio.Event()
            self.waiting[ctx.node_id].append(gate)
            try:
                await gate.wait()
            except asyncio.CancelledError:
                self.cancelled[ctx.node_id] += 1
                raise
        return key

    def release(self, node: str, execution: int) -> None:
        """Let the ``execution``-th held execution of ``node`` (0-based) return."""
        self.waiting[node][execution].set()

    def release_all(self) -> None:
        self.held.clear()
        for gates in self.waiting.values():
            for gate in gates:
                gate.set()

    def task(self, fn: Callable[[Any], Any] | None = None) -> Callable[[Any], Awaitable[Any]]:
        """An async handler that records itself, maybe waits, then returns ``fn(payload)``."""

        async def handler(payload: Any) -> Any:
            await self.enter(payload)
            return payload if fn is None else fn(payload)

        return handler


async def until(
    condition: Callable[[], Any], what: str = "condition", guard: float = HANG_GUARD
) -> None:
    """Wait until ``condition()`` (or its awaited value) is true; fail after ``guard`` s."""
    await fixtures.until(condition, what, guard=guard)


async def result_keys(store: RunStore, run_id: str) -> set[tuple[str, int]]:
    try:
        return {(r.node_id, r.visit) for r in await store.results(run_id)}
    except RunNotFound:
        return set()


async def node_statuses(backend: Backend, run_id: str) -> dict[str, str]:
    return {n: row.status for n, row in (await backend.raw_nodes(run_id)).items()}


def committed(backend: Backend, run_id: str, *keys: tuple[str, int]) -> Callable[[], Any]:
    async def check() -> bool:
        return set(keys) <= await result_keys(backend.store, run_id)

    return check


def running(backend: Backend, run_id: str, *nodes: str) -> Callable[[], Any]:
    async def check() -> bool:
        statuses = await node_statuses(backend, run_id)
        return all(statuses.get(n) == "running" for n in nodes)

    return check


async def crash(task: asyncio.Task[Any]) -> None:
    """Kill a run in process: cancel it; it writes nothing more for its running handlers."""
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def snapshot(backend: Backend, run_id: str) -> dict[str, Any]:
    """Everything stored about a run, read without format checks, for 'nothing written'."""
    store = backend.store
    return {
        "run": await store.get_run(run_id),
        "nodes": await backend.raw_nodes(run_id),
        "results": await store.results(run_id),
        "frozen": await store.frozen_inputs(run_id),
        "events": await store.events(run_id),
    }


def new_id(label: str) -> str:
    return f"{label}-{uuid.uuid4().hex[:10]}"


def engine(backend: Backend, **options: Any) -> tr.Engine:
    options.setdefault("lease_ttl", TTL)
    return tr.Engine(store=backend.store, **options)


def decoded(rows: list[ResultRow]) -> dict[tuple[str, int], Any]:
    return {(r.node_id, r.visit): json.loads(r.value_json) for r in rows}


# --- graphs --------------------------------------------------------------------------


def fork_graph(probe: Probe) -> tr.Graph:
    """``a`` (returns None) -> ``b`` -> ``c``; ``a`` -> ``d``; ``c`` and ``d`` -> ``sink``."""
    g = tr.Graph("fork")
    g.add_node("a", probe.task(lambda x: None))
    g.add_node("b", probe.task(lambda x: {"b_saw": x}))
    g.add_node("c", probe.task(lambda x: {"c_saw": x}))
    g.add_node("d", probe.task(lambda x: {"d_saw": x}))
    g.add_node("sink", probe.task(lambda xs: xs), "aggregate")
    g.chain("a", "b", "c", "sink")
    g.chain("a", "d", "sink")
    return g


def wide_graph(probe: Probe) -> tr.Graph:
    """A chain, a fan-out of 6, a first-3 aggregate, a full join, a switch and a self-loop."""
    g = tr.Graph("wide")
    g.add_node("start", probe.task(lambda x: x + 1))
    g.add_node("prep", probe.task(lambda x: None))
    g.chain("start", "prep")
    for i in range(6):
        g.add_node(f"f{i}", probe.task(lambda x, i=i: i))
        g.add_edge("prep", f"f{i}")
    g.add_node("first3", probe.task(lambda xs: len(xs)), "aggregate", required=3)
    g.add_node("join", probe.task(lambda xs: sum(xs)), "aggregate")
    for i in range(6):
        g.add_edge(f"f{i}", "first3")
        g.add_edge(f"f{i}", "join")
    g.add_node("route", probe.task(lambda x: "odd" if x % 2 else "even"), "switch")
    g.add_node("odd", probe.task(lambda x: "odd"))
    g.add_node("even", probe.task(lambda x: "even"))
    g.add_edge("join", "route")
    g.add_edge("route", "odd", route="odd")
    g.add_edge("route", "even", route="even")
    g.add_node("spin", probe.task(lambda x: (x or 0) + 1), max_visits=3)
    g.add_edge("first3", "spin")
    g.add_edge("spin", "spin")
    return g


def loop_graph(probe: Probe) -> tr.Graph:
    """``seed`` -> ``spin`` (self-loop, max_visits=3) -> ``after``."""
    g = tr.Graph("loop")
    g.add_node("seed", probe.task(lambda x: 0))
    g.add_node("spin", probe.task(lambda x: x + 1), max_visits=3)
    g.add_node("after", probe.task(lambda x: {"after": x}))
    g.chain("seed", "spin", "after")
    g.add_edge("spin", "spin")
    return g


def counter_loop_graph(probe: Probe, limit: int = 5) -> tr.Graph:
    """``body`` -> ``check`` (switch) -> ``body`` again until the count reaches ``limit``."""
    g = tr.Graph("counter")
    g.add_node("init", probe.task(lambda x: 0))
    g.add_node("body", probe.task(lambda x: x + 1))
    g.add_node("check", probe.task(lambda x: "again" if x < limit else "done"), "switch")
    g.add_node("done", probe.task(lambda x: {"count": x}))
    g.chain("init", "body", "check")
    g.add_edge("check", "body", route="again")
    g.add_edge("check", "done", route="done")
    return g


# --- D1: one transaction per harvest; one result row per node visit ----------------------


class SpyStore:
    """Wraps a store (by delegation, whatever the contract grows) and keeps every
    harvest in the order the store applied them.

    ``fail_when`` picks the first harvest whose commit raises ``StoreError``
    without reaching the store: a database outage.
    """

    def __init__(self, inner: RunStore, fail_when: Callable[[Harvest], bool] | None = None) -> None:
        self.inner = inner
        self.applied: list[Harvest] = []
        self.fail_when = fail_when

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def commit(self, run_id: str, token: int, harvest: Harvest) -> None:
        if self.fail_when is not None and self.fail_when(harvest):
            self.fail_when = None
            raise StoreError(f"run {run_id!r}: injected outage")
        await self.inner.commit(run_id, token, harvest)
        self.applied.append(harvest)


def spy_engine(spy: SpyStore, **options: Any) -> tr.Engine:
    options.setdefault("lease_ttl", TTL)
    return tr.Engine(store=spy, **options)  # type: ignore[arg-type]


def expected_visits(result: tr.RunResult) -> set[tuple[str, int]]:
    return {
        (node, visit)
        for node, report in result.nodes.items()
        if report.status == "completed"
        for visit in range(1, report.visits + 1)
    }


async def test_d1_one_result_row_per_node_visit(backend: Backend) -> None:
    probe = Probe()
    run_id = new_id("d1-rows")
    result = await engine(backend).run(wide_graph(probe), 1, run_id=run_id)

    rows = await backend.store.results(run_id)
    keys = [(r.node_id, r.visit) for r in rows]
    assert len(keys) == len(set(keys)), "a node visit has two result rows"
    assert set(keys) == expected_visits(result) == set(probe.runs)
    assert all(n == 1 for n in probe.runs.values())
    assert ("spin", 3) in set(keys) and ("spin", 4) not in set(keys)
    last = {}
    for (node, _visit), value in sorted(decoded(rows).items()):
        last[node] = value
    assert last == result.results
    record = await backend.store.get_run(run_id)
    assert record.status == RunStatus.COMPLETED
    assert record.nodes_done == len(rows)
    assert record.lease_owner is None, "a finished run keeps its lease"


async def test_d1_harvest_rows_land_together(backend: Backend) -> None:
    spy = SpyStore(backend.store)
    probe = Probe()
    run_id = new_id("d1-together")
    await spy_engine(spy).run(wide_graph(probe), 1, run_id=run_id)

    seen: set[tuple[str, int]] = set()
    for harvest in spy.applied:
        completed = {(e.node_id, e.visit) for e in harvest.events if e.type == "node_completed"}
        results = {(r.node_id, r.visit) for r in harvest.results}
        assert completed == results, "a completion event and its result row were split"
        fired = {(e.node_id, e.visit) for e in harvest.events if e.type == "aggregate_fired"}
        assert fired == {(f.node_id, f.activation) for f in harvest.frozen}
        rows = {n.node_id: n for n in harvest.nodes}
        for node, visit in results:
            assert node in rows and rows[node].visits >= visit, (node, visit)
        assert harvest.nodes_done_delta == len(harvest.results)
        assert not (results & seen), "a result committed by two harvests"
        seen |= results
    assert seen == await result_keys(backend.store, run_id)
    frozen = await backend.store.frozen_inputs(run_id)
    assert {(f.node_id, f.activation) for f in frozen} == {("first3", 1), ("join", 1)}


# --- D2: write ordering -------------------------------------------------------------


async def test_d2_completion_committed_no_later_than_its_dependents(backend: Backend) -> None:
    spy = SpyStore(backend.store)
    probe = Probe()
    g = tr.Graph("d2")
    names = [f"n{i:02d}" for i in range(40)]
    for name in names:
        g.add_node(name, probe.task(lambda x: (x or 0) + 1))
    g.chain(*names)
    for i in range(4):  # a fan-out and a first-2 merge behind the chain
        g.add_node(f"w{i}", probe.task(lambda x, i=i: i))
        g.add_edge(names[-1], f"w{i}")
    g.add_node("merge", probe.task(len), "aggregate", required=2)
    for i in range(4):
        g.add_edge(f"w{i}", "merge")
    g.add_node("tail", probe.task())
    g.add_edge("merge", "tail")
    run_id = new_id("d2")
    await spy_engine(spy).run(g, 0, run_id=run_id)

    at = {(r.node_id, r.visit): index for index, h in enumerate(spy.applied) for r in h.results}
    for before, after in itertools.pairwise(names):
        assert at[(before, 1)] <= at[(after, 1)], (before, after)
    assert at[(names[-1], 1)] <= min(at[(f"w{i}", 1)] for i in range(4))
    frozen = await backend.store.frozen_inputs(run_id)
    payload = json.loads(next(f.payload_json for f in frozen if f.node_id == "merge"))
    winners = [f"w{i}" for i in payload]
    assert len(winners) == 2
    assert max(at[(w, 1)] for w in winners) <= at[("merge", 1)] <= at[("tail", 1)]


# --- D3: resume re-runs exactly the running nodes --------------------------------------


async def test_d3_resume_reruns_running_nodes_and_reuses_completed(backend: Backend) -> None:
    probe = Probe()
    g = fork_graph(probe)
    probe.held = {"c", "d"}
    run_id = new_id("d3")
    task = asyncio.create_task(engine(backend).run(g, "in", run_id=run_id))
    await until(committed(backend, run_id, ("a", 1), ("b", 1)), "a and b committed")
    await until(running(backend, run_id, "c", "d"), "c and d committed as running")
    await crash(task)

    assert await result_keys(backend.store, run_id) == {("a", 1), ("b", 1)}
    record = await backend.store.get_run(run_id)
    assert record.status == RunStatus.RUNNING
    probe.held.clear()
    result = await engine(backend).resume(run_id, g)

    assert result.status == "completed"
    assert probe.runs == {("a", 1): 1, ("b", 1): 1, ("c", 1): 2, ("d", 1): 2, ("sink", 1): 1}
    assert probe.cancelled == {"c": 1, "d": 1}
    # a's None result was reused: d re-ran with payload None, and b's stored result fed c.
    assert probe.payloads[("d", 1)] == [None, None]
    assert probe.payloads[("c", 1)] == [{"b_saw": None}, {"b_saw": None}]
    assert "a" in result.results and result.results["a"] is None
    assert result.results["sink"] == [{"c_saw": {"b_saw": None}}, {"d_saw": None}]
    assert set(decoded(await backend.store.results(run_id))) == expected_visits(result)


async def test_d3_none_results_survive_resume_when_nothing_was_running(backend: Backend) -> None:
    probe = Probe()
    g = tr.Graph("nones")
    g.add_node("a", probe.task(lambda x: None))
    g.add_node("b", probe.task(lambda x: None))
    g.add_node("c", probe.task(lambda x: [x]))
    g.chain("a", "b", "c")
    probe.held = {"c"}
    run_id = new_id("nones")
    task = asyncio.create_task(engine(backend).run(g, None, run_id=run_id))
    await until(running(backend, run_id, "c"), "c running")
    await crash(task)
    probe.held.clear()

    result = await engine(backend).resume(run_id, g)
    assert result.results == {"a": None, "b": None, "c": [None]}
    assert probe.runs == {("a", 1): 1, ("b", 1): 1, ("c", 1): 2}
    assert decoded(await backend.store.results(run_id)) == {
        ("a", 1): None,
        ("b", 1): None,
        ("c", 1): [None],
    }


async def test_d3_first_k_decision_is_reused_unchanged(backend: Backend) -> None:
    probe = Probe()
    g = tr.Graph("diamond")
    g.add_node("s", probe.task(lambda x: x))
    g.add_node("x", probe.task(lambda v: f"x{v}"))
    g.add_node("y", probe.task(lambda v: f"y{v}"))
    g.add_node("agg", probe.task(lambda xs: {"picked": xs}), "aggregate", required=1)
    g.add_node("z", probe.task(lambda v: v))
    g.chain("s", "x", "agg", "z")
    g.chain("s", "y", "agg")
    probe.held = {"y", "agg"}
    run_id = new_id("first-k")
    task = asyncio.create_task(engine(backend).run(g, 7, run_id=run_id))
    await until(running(backend, run_id, "agg", "y"), "agg fired while y still runs")
    await crash(task)

    frozen = await backend.store.frozen_inputs(run_id)
    assert [(f.node_id, f.activation, json.loads(f.payload_json)) for f in frozen] == [
        ("agg", 1, ["x7"])
    ]
    # On resume y is fast and agg slow: were the decision re-made, y could win it.
    probe.held = {"agg"}
    resumed = asyncio.create_task(engine(backend).resume(run_id, g))
    await until(lambda: probe.runs[("y", 1)] == 2, "y re-ran")
    await until(committed(backend, run_id, ("y", 1)), "y committed")
    probe.release_all()
    result = await resumed

    assert probe.payloads[("agg", 1)] == [["x7"], ["x7"]]
    assert result.results["agg"] == {"picked": ["x7"]}
    assert result.results["z"] == {"picked": ["x7"]}
    assert probe.runs[("x", 1)] == 1 and probe.runs[("s", 1)] == 1
    assert probe.runs[("agg", 1)] == 2 and probe.runs[("z", 1)] == 1
    assert [(f.node_id, f.activation) for f in await backend.store.frozen_inputs(run_id)] == [
        ("agg", 1)
    ]
    late = [(li.node_id, li.source_id) for li in result.late_inputs]
    assert ("agg", "y") in late


async def test_d3_completed_aggregate_is_not_rerun(backend: Backend) -> None:
    probe = Probe()
    g = tr.Graph("agg-done")
    g.add_node("s", probe.task(lambda x: x))
    for name in ("p", "q", "r"):
        g.add_node(name, probe.task(lambda v, name=name: name))
        g.add_edge("s", name)
    g.add_node("agg", probe.task(lambda xs: "+".join(xs)), "aggregate", required=2)
    g.add_node("z", probe.task(lambda v: v.upper()))
    for name in ("p", "q", "r"):
        g.add_edge(name, "agg")
    g.add_edge("agg", "z")
    probe.held = {"r", "z"}
    run_id = new_id("agg-done")
    task = asyncio.create_task(engine(backend).run(g, 0, run_id=run_id))
    await until(committed(backend, run_id, ("agg", 1)), "agg committed")
    await until(running(backend, run_id, "z", "r"), "z and r running")
    await crash(task)
    probe.held.clear()

    result = await engine(backend).resume(run_id, g)
    assert result.results["agg"] == "p+q" and result.results["z"] == "P+Q"
    assert probe.runs == {
        ("s", 1): 1,
        ("p", 1): 1,
        ("q", 1): 1,
        ("r", 1): 2,
        ("agg", 1): 1,
        ("z", 1): 2,
    }


async def test_d3_resume_of_a_run_created_but_never_committed(backend: Backend) -> None:
    probe = Probe()
    g = fork_graph(probe)
    run_id = new_id("fresh")
    await backend.store.create_run(
        NewRun(
            run_id=run_id,
            graph_name=g.name,
            graph_ref=None,
            fingerprint=g.fingerprint(),
            input_json='"in"',
            created_at=1.0,
        )
    )
    result = await engine(backend).resume(run_id, g)
    assert result.status == "completed"
    assert all(n == 1 for n in probe.runs.values()) and len(probe.runs) == 5
    assert probe.payloads[("a", 1)] == ["in"]


async def test_d3_store_outage_mid_run_then_resume(backend: Backend) -> None:
    spy = SpyStore(backend.store, fail_when=lambda h: any(r.node_id == "route" for r in h.results))
    probe = Probe()
    g = wide_graph(probe)
    probe.held = {"route"}
    run_id = new_id("outage")
    task = asyncio.create_task(spy_engine(spy).run(g, 1, run_id=run_id))
    await until(committed(backend, run_id, ("join", 1), ("first3", 1)), "join committed")
    await until(lambda: probe.runs[("route", 1)] == 1, "route started")
    probe.release_all()  # route's completion meets the outage
    with pytest.raises(StoreError, match="injected outage"):
        await task
    done_before = await result_keys(backend.store, run_id)
    assert ("route", 1) not in done_before and ("join", 1) in done_before
    assert (await backend.store.get_run(run_id)).status == RunStatus.RUNNING

    result = await engine(backend).resume(run_id, g)
    assert result.status == "completed"
    for key in done_before:
        assert probe.runs[key] == 1, f"{key} was committed, yet ran again"
    assert probe.runs[("route", 1)] == 2
    assert set(probe.runs) == expected_visits(result)


# --- loops ------------------------------------------------------------------------------


async def test_resume_continues_a_self_loop_count(backend: Backend) -> None:
    probe = Probe()
    g = loop_graph(probe)
    probe.held = {("spin", 2)}
    run_id = new_id("self-loop")
    task = asyncio.create_task(engine(backend).run(g, None, run_id=run_id))
    await until(committed(backend, run_id, ("spin", 1), ("after", 1)), "spin visit 1")
    await until(lambda: probe.runs[("spin", 2)] == 1, "spin visit 2 started")
    await until(running(backend, run_id, "spin"), "spin visit 2 committed as running")
    await crash(task)
    probe.held.clear()

    result = await engine(backend).resume(run_id, g)
    assert probe.runs == {
        ("seed", 1): 1,
        ("spin", 1): 1,
        ("spin", 2): 2,
        ("spin", 3): 1,
        ("after", 1): 1,
    }
    assert result.visits["spin"] == 3 and result.results["spin"] == 3
    assert probe.payloads[("spin", 2)] == [1, 1]
    assert probe.payloads[("spin", 3)] == [2]
    rows = decoded(await backend.store.results(run_id, "spin"))
    assert rows == {("spin", 1): 1, ("spin", 2): 2, ("spin", 3): 3}


async def test_resume_continues_a_switch_loop_count(backend: Backend) -> None:
    probe = Probe()
    g = counter_loop_graph(probe, limit=5)
    probe.held = {("body", 3)}
    run_id = new_id("switch-loop")
    task = asyncio.create_task(engine(backend).run(g, None, run_id=run_id))
    await until(committed(backend, run_id, ("check", 2)), "two rounds committed")
    await until(running(backend, run_id, "body"), "body visit 3 running")
    await crash(task)
    probe.held.clear()

    result = await engine(backend).resume(run_id, g)
    assert result.results["done"] == {"count": 5}
    assert result.visits["body"] == 5 and result.visits["check"] == 5
    assert probe.runs[("body", 3)] == 2
    assert all(probe.runs[("body", v)] == 1 for v in (1, 2, 4, 5))
    assert all(probe.runs[("check", v)] == 1 for v in range(1, 6))
    keys = await result_keys(backend.store, run_id)
    assert {("body", v) for v in range(1, 6)} <= keys and ("body", 6) not in keys


# --- D4: format versions ------------------------------------------------------------------


async def crashed_fork(backend: Backend, probe: Probe, label: str) -> tuple[tr.Graph, str]:
    """A fork run crashed with ``a`` and ``b`` committed and ``c``, ``d`` running."""
    g = fork_graph(probe)
    probe.held = {"c", "d"}
    run_id = new_id(label)
    task = asyncio.create_task(engine(backend).run(g, "in", run_id=run_id))
    await until(running(backend, run_id, "c", "d"), "c and d running")
    await crash(task)
    probe.held.clear()
    return g, run_id


async def test_d4_future_run_format_is_refused_and_nothing_written(backend: Backend) -> None:
    probe = Probe()
    g, run_id = await crashed_fork(backend, probe, "d4-run")
    await backend.set_format_version(run_id, FORMAT_VERSION + 1)
    before = await snapshot(backend, run_id)
    runs_before = Counter(probe.runs)

    with pytest.raises(UnsupportedFormat, match=run_id):
        await engine(backend).resume(run_id, g)
    assert await snapshot(backend, run_id) == before
    assert probe.runs == runs_before


async def test_d4_future_node_format_is_refused_and_nothing_written(backend: Backend) -> None:
    probe = Probe()
    g, run_id = await crashed_fork(backend, probe, "d4-node")
    row = (await backend.raw_nodes(run_id))["b"]
    data = json.loads(row.data_json)
    data["v"] = NODE_ROW_VERSION + 1
    await backend.set_node_data(run_id, "b", json.dumps(data))
    before = await snapshot(backend, run_id)

    with pytest.raises(UnsupportedFormat, match="'b'"):
        await engine(backend).resume(run_id, g)
    assert probe.runs[("c", 1)] == 1, "a handler ran before the format check"
    # D4: nothing is written -- the lease row (owner, expiry, fencing token) included.
    assert await snapshot(backend, run_id) == before


async def test_d4_run_stays_resumable_after_refusal_is_undone(backend: Backend) -> None:
    probe = Probe()
    g, run_id = await crashed_fork(backend, probe, "d4-undo")
    await backend.set_format_version(run_id, FORMAT_VERSION + 1)
    with pytest.raises(UnsupportedFormat):
        await engine(backend).resume(run_id, g)
    await backend.set_format_version(run_id, FORMAT_VERSION)
    result = await engine(backend).resume(run_id, g)
    assert result.status == "completed"
    assert probe.runs[("a", 1)] == 1 and probe.runs[("b", 1)] == 1


# --- D5: payloads are JSON ------------------------------------------------------------------


class Opaque:
    pass


@pytest.mark.parametrize(
    "bad", [Opaque(), {1, 2}, float("nan"), b"bytes"], ids=["object", "set", "nan", "bytes"]
)
async def test_d5_unencodable_result_fails_its_node_before_any_commit(
    backend: Backend, bad: Any
) -> None:
    probe = Probe()
    g = tr.Graph("d5")
    g.add_node("ok", probe.task(lambda x: {"fine": x}))
    g.add_node("bad_node", probe.task(lambda x: bad))
    g.add_node("never", probe.task())
    g.chain("ok", "bad_node", "never")
    run_id = new_id("d5")
    with pytest.raises(EncodeError, match="bad_node") as caught:
        await engine(backend).run(g, 1, run_id=run_id)
    assert run_id in str(caught.value)

    record = await backend.store.get_run(run_id)
    assert record.status == RunStatus.FAILED
    assert record.error is not None and "bad_node" in record.error
    assert decoded(await backend.store.results(run_id)) == {("ok", 1): {"fine": 1}}
    statuses = await node_statuses(backend, run_id)
    assert statuses["ok"] == "completed" and statuses["bad_node"] == "failed"
    assert "never" not in probe.order and ("never", 1) not in probe.runs
    with pytest.raises(NotResumable):
        await engine(backend).resume(run_id, g)


async def test_d5_unencodable_input_writes_nothing(backend: Backend) -> None:
    probe = Probe()
    run_id = new_id("d5-input")
    with pytest.raises(EncodeError, match=run_id):
        await engine(backend).run(fork_graph(probe), Opaque(), run_id=run_id)
    with pytest.raises(RunNotFound):
        await backend.store.get_run(run_id)
    assert not probe.runs


async def test_d5_resumed_run_sees_the_values_an_uninterrupted_run_sees(
    backend: Backend,
) -> None:
    """JSON turns tuples into lists and int keys into strings: such a result is either
    refused (D5), or the run goes on with the value as it reads back, so that a resumed
    run's handlers and results equal an uninterrupted durable run's."""
    value = {1: (2, 3)}
    probe = Probe()
    g = tr.Graph("lossy")
    g.add_node("make", probe.task(lambda x: value))
    g.add_node("use", probe.task(lambda x: repr(x)))
    g.chain("make", "use")
    probe.held = {"use"}
    run_id = new_id("lossy")
    outcome: list[Any] = []
    task = asyncio.create_task(engine(backend).run(g, 0, run_id=run_id))
    use_running = running(backend, run_id, "use")

    async def refused_or_running() -> bool:
        return task.done() or await use_running()

    await until(refused_or_running, "make refused or use running")
    if task.done():  # refused when it completed: fine by D5
        with pytest.raises(EncodeError, match="make"):
            await task
        return
    await crash(task)
    probe.held.clear()
    try:
        outcome.append(await engine(backend).resume(run_id, g))
    except EncodeError:
        return  # the lossy value was refused: fine by D5
    # A durable run works on values as they read back (JSON), resumed or not.
    uninterrupted = await engine(backend).run(g, 0, run_id=new_id("lossy-whole"))
    assert outcome[0].results == uninterrupted.results


# --- D6: leases and fencing -----------------------------------------------------------------


async def test_d6_live_lease_blocks_resume_and_expiry_fences_old_owner(backend: Backend) -> None:
    probe = Probe()
    g = fork_graph(probe)
    probe.held = {"d"}
    run_id = new_id("d6")
    first = engine(backend, owner="engine-a")
    task_a = asyncio.create_task(first.run(g, "in", run_id=run_id))
    await until(running(backend, run_id, "d"), "d running")
    await until(committed(backend, run_id, ("c", 1)), "c committed")
    token_a = (await backend.store.get_run(run_id)).lease_token

    async with backend.reopen() as other_store:
        second = tr.Engine(store=other_store, owner="engine-b", lease_ttl=TTL)
        before = await snapshot(backend, run_id)
        with pytest.raises(LeaseHeld, match="engine-a"):
            await second.resume(run_id, g)
        assert await snapshot(backend, run_id) == before, "a refused resume wrote something"
        assert probe.runs[("d", 1)] == 1

        backend.clock.advance(TTL + 1)  # engine-a stalls past its lease
        task_b = asyncio.create_task(second.resume(run_id, g))
        await until(lambda: probe.runs[("d", 1)] == 2, "engine-b re-ran d")
        record = await backend.store.get_run(run_id)
        assert record.lease_owner == "engine-b" and record.lease_token > token_a

        probe.release("d", 0)  # engine-a's d finishes late: its commit is fenced
        with pytest.raises(LeaseLost):
            await task_a
        assert ("d", 1) not in await result_keys(backend.store, run_id)
        assert (await backend.store.get_run(run_id)).lease_owner == "engine-b"

        probe.release("d", 1)
        result = await task_b
    assert result.status == "completed"
    assert probe.runs[("a", 1)] == 1 and probe.runs[("c", 1)] == 1
    # engine-a may have started sink before learning its d was fenced (commits are
    # pipelined); it committed nothing of it.
    assert probe.runs[("sink", 1)] in (1, 2)
    rows = await backend.store.results(run_id)
    assert len(rows) == len({(r.node_id, r.visit) for r in rows}) == 5


async def test_d6_heartbeat_notices_takeover_and_stops_the_old_run(backend: Backend) -> None:
    probe = Probe()
    g = fork_graph(probe)
    probe.held = {"d"}
    run_id = new_id("d6-beat")
    first = engine(backend, owner="engine-a", lease_ttl=0.15)  # heartbeat every 50 ms
    task_a = asyncio.create_task(first.run(g, "in", run_id=run_id))
    await until(running(backend, run_id, "d"), "d running")
    backend.clock.advance(10)
    second = engine(backend, owner="engine-b")
    task_b = asyncio.create_task(second.resume(run_id, g))
    with pytest.raises(LeaseLost):
        await asyncio.wait_for(task_a, HANG_GUARD)  # never finishes its d, stops anyway
    assert probe.cancelled["d"] >= 1
    probe.release_all()
    result = await task_b
    assert result.status == "completed"
    assert (await backend.store.get_run(run_id)).status == RunStatus.COMPLETED


async def test_d6_heartbeat_keeps_a_live_lease(backend: Backend) -> None:
    probe = Probe()
    g = fork_graph(probe)
    probe.held = {"d"}
    run_id = new_id("d6-live")
    ttl = 0.6  # heartbeat every 0.2 s of real time
    task = asyncio.create_task(
        engine(backend, owner="engine-a", lease_ttl=ttl).run(g, "in", run_id=run_id)
    )
    await until(running(backend, run_id, "d"), "d running")
    other = engine(backend, owner="engine-b")
    for _ in range(3):  # 1.5 s of lease time pass; only heartbeats keep it live
        await asyncio.sleep(0.5)
        backend.clock.advance(0.5)
        with pytest.raises(LeaseHeld):
            await other.resume(run_id, g)
    probe.release_all()
    assert (await task).status == "completed"
    assert probe.runs[("d", 1)] == 1


class FlakyHeartbeat(SpyStore):
    """A store whose first heartbeat fails with a transient ``StoreError``."""

    def __init__(self, inner: RunStore) -> None:
        super().__init__(inner)
        self.beats = 0

    async def heartbeat(self, run_id: str, owner: str, token: int, ttl: float) -> None:
        self.beats += 1
        if self.beats == 1:
            raise StoreError(f"run {run_id!r}: injected hiccup")
        await self.inner.heartbeat(run_id, owner, token, ttl)


async def test_d6_transient_heartbeat_error_is_survived(backend: Backend) -> None:
    """One failed heartbeat must neither end lease renewal for the rest of the run
    nor turn a run that completed into an exception."""
    probe = Probe()
    g = fork_graph(probe)
    probe.held = {"d"}
    flaky = FlakyHeartbeat(backend.store)
    run_id = new_id("d6-hiccup")
    task = asyncio.create_task(
        spy_engine(flaky, lease_ttl=0.15).run(g, "in", run_id=run_id)  # beats every 50 ms
    )
    await until(running(backend, run_id, "d"), "d running")
    try:
        await until(lambda: flaky.beats >= 4, "heartbeats after a failed one", guard=3.0)
    finally:
        probe.release_all()
        result = await task
    assert result.status == "completed"
    assert (await backend.store.get_run(run_id)).status == RunStatus.COMPLETED


class SwallowsACancel(SpyStore):
    """A heartbeat that loses one cancellation, as psycopg_pool does on CPython 3.11.

    psycopg_pool waits for a free connection with ``asyncio.wait_for``; on 3.11,
    when a cancellation races with the pool handing a connection over, wait_for
    returns the connection and the CancelledError is gone (fixed in 3.12). The
    crash torture hit this: a child hung forever in ``leased()``'s ``await beat``
    after its run had completed, its lease renewed by the stray heartbeat.
    """

    def __init__(self, inner: RunStore) -> None:
        super().__init__(inner)
        self.beats = 0
        self.swallowed = 0

    async def heartbeat(self, run_id: str, owner: str, token: int, ttl: float) -> None:
        self.beats += 1
        if self.beats == 1:
            try:
                await asyncio.sleep(0.5)  # waiting for a pooled connection...
            except asyncio.CancelledError:
                self.swallowed += 1  # ...handed over just as the cancel came
        await self.inner.heartbeat(run_id, owner, token, ttl)


async def test_d6_heartbeat_stops_even_if_a_store_call_loses_its_cancellation(
    backend: Backend,
) -> None:
    probe = Probe()
    g = fork_graph(probe)
    probe.held = {"d"}
    store = SwallowsACancel(backend.store)
    run_id = new_id("d6-swallow")
    task = asyncio.create_task(spy_engine(store, lease_ttl=0.15).run(g, "in", run_id=run_id))
    await until(lambda: store.beats >= 1, "a heartbeat in flight")
    probe.release_all()
    done, _ = await asyncio.wait({task}, timeout=5.0)
    if not done:  # hung in leased(): stop it for good, then fail
        task.cancel()
        await asyncio.wait({task}, timeout=5.0)
        pytest.fail("Engine.run hung after its run completed: the heartbeat never stopped")
    assert task.result().status == "completed"
    assert store.swallowed <= 1
    record = await backend.store.get_run(run_id)
    assert record.status == RunStatus.COMPLETED and record.lease_owner is None


async def test_d6_same_owner_may_reacquire_a_dead_engines_lease(backend: Backend) -> None:
    probe = Probe()
    g, run_id = await crashed_fork(backend, probe, "d6-owner")
    token = await backend.store.acquire_lease(run_id, "worker-7", TTL)  # then it died
    with pytest.raises(LeaseHeld, match="worker-7"):
        await engine(backend, owner="worker-8").resume(run_id, g)
    result = await engine(backend, owner="worker-7").resume(run_id, g)
    assert result.status == "completed"
    record = await backend.store.get_run(run_id)
    assert record.lease_owner is None and record.lease_token == token


async def test_d6_expired_lease_of_a_dead_engine_is_taken_over(backend: Backend) -> None:
    probe = Probe()
    g, run_id = await crashed_fork(backend, probe, "d6-dead")
    token = await backend.store.acquire_lease(run_id, "dead-engine", TTL)
    backend.clock.advance(TTL + 0.001)
    result = await engine(backend, owner="rescuer").resume(run_id, g)
    assert result.status == "completed"
    assert (await backend.store.get_run(run_id)).lease_token == token + 1
    with pytest.raises(LeaseLost):
        await backend.store.heartbeat(run_id, "dead-engine", token, TTL)


async def test_resume_race_with_a_finishing_engine_is_not_resumable(backend: Backend) -> None:
    """Two resumes pass the status check; the first completes the run before the
    second gets the lease. The second must see NotResumable, not a store error."""
    probe = Probe()
    g, run_id = await crashed_fork(backend, probe, "race")
    gate = asyncio.Event()
    waiting = asyncio.Event()

    class SlowLease(SpyStore):
        async def acquire_lease(
            self, run_id: str, owner: str, ttl: float, *, steal_from: str | None = None
        ) -> int:
            waiting.set()
            await gate.wait()
            return await self.inner.acquire_lease(run_id, owner, ttl, steal_from=steal_from)

    late = spy_engine(SlowLease(backend.store), owner="late")
    late_task = asyncio.create_task(late.resume(run_id, g))
    await waiting.wait()  # late has read the run (running) and waits for its lease
    assert (await engine(backend, owner="early").resume(run_id, g)).status == "completed"
    runs = Counter(probe.runs)
    gate.set()
    with pytest.raises(NotResumable):
        await late_task
    assert probe.runs == runs
    assert (await backend.store.get_run(run_id)).status == RunStatus.COMPLETED


async def test_concurrent_resumes_on_one_engine_run_each_node_once(backend: Backend) -> None:
    """The lease cannot tell two resumes of one engine apart (same owner, same
    token); a second concurrent resume must still not run the handlers again."""
    probe = Probe()
    g, run_id = await crashed_fork(backend, probe, "twice")
    one = engine(backend)
    outcomes = await asyncio.gather(
        one.resume(run_id, g), one.resume(run_id, g), return_exceptions=True
    )
    completed = [o for o in outcomes if isinstance(o, tr.RunResult)]
    refused = [o for o in outcomes if isinstance(o, BaseException)]
    assert len(completed) == 1, outcomes
    assert all(isinstance(o, TailraceError) for o in refused), outcomes
    assert probe.runs[("c", 1)] == 2 and probe.runs[("d", 1)] == 2, probe.runs


# --- graph changes, finished runs, references ------------------------------------------------


async def test_graph_mismatch_is_refused_unless_forced(backend: Backend) -> None:
    """A changed graph is checked against what the run did (V1); ``force`` checks nothing."""
    probe = Probe()
    _, run_id = await crashed_fork(backend, probe, "mismatch")
    incompatible = tr.Graph("fork")
    for node in fork_graph(probe).nodes.values():
        incompatible.add_node(node.id, node.handler, node.kind.value, any_of=node.id == "d")
    for edge in fork_graph(probe).edges:
        incompatible.add_edge(edge.source, edge.target)
    incompatible.add_node("b2", probe.task())
    incompatible.add_edge("a", "b2")
    incompatible.add_edge("b2", "d")  # into d, which was running: refused
    before = await snapshot(backend, run_id)
    runs_before = Counter(probe.runs)

    with pytest.raises(GraphMismatch, match="an edge into it was added: b2 -> d"):
        await engine(backend).resume(run_id, incompatible)
    assert await snapshot(backend, run_id) == before
    assert probe.runs == runs_before

    changed = fork_graph(probe)
    changed.add_node("extra", probe.task(lambda xs: "extra"))
    changed.add_edge("sink", "extra")  # downstream of the frontier: free
    result = await engine(backend).resume(run_id, changed)
    assert result.status == "completed"
    assert result.results["extra"] == "extra"
    assert probe.runs[("a", 1)] == 1 and probe.runs[("b", 1)] == 1
    assert probe.runs[("c", 1)] == 2 and probe.runs[("extra", 1)] == 1

    _, forced_id = await crashed_fork(backend, probe, "forced")
    forced = await engine(backend).resume(forced_id, incompatible, force=True)
    assert forced.status == "completed"
    assert (await backend.store.get_run(forced_id)).fingerprint == fork_graph(probe).fingerprint()


async def test_finished_runs_are_not_resumable(backend: Backend) -> None:
    probe = Probe()
    g = fork_graph(probe)
    done_id = new_id("done")
    await engine(backend).run(g, "in", run_id=done_id)
    before = await snapshot(backend, done_id)
    with pytest.raises(NotResumable, match="completed"):
        await engine(backend).resume(done_id, g)
    with pytest.raises(NotResumable):
        await engine(backend).resume(done_id, g, force=True)
    assert await snapshot(backend, done_id) == before

    def boom(_: Any) -> Any:
        raise ValueError("boom")

    failing = tr.Graph("failing")
    failing.add_node("a", probe.task())
    failing.add_node("b", probe.task(boom))
    failing.chain("a", "b")
    failed_id = new_id("failed")
    with pytest.raises(ValueError, match="boom"):
        await engine(backend).run(failing, 1, run_id=failed_id)
    with pytest.raises(NotResumable, match="failed"):
        await engine(backend).resume(failed_id, failing)
    with pytest.raises(RunNotFound):
        await engine(backend).resume(new_id("nope"), g)
    with pytest.raises(NotResumable):
        await tr.Engine().resume(done_id, g)


GRAPH_MODULE = """
import tailrace as tr

release = None  # set by the test to an asyncio.Event
runs = []

graph = tr.Graph("by-ref")


@graph.task()
async def first(x):
    runs.append("first")
    return x + 1


@graph.task()
async def second(x):
    runs.append("second")
    if release is not None:
        await release.wait()
    return x * 10


graph.chain("first", "second")
"""


async def test_resume_finds_the_graph_by_its_recorded_reference(
    backend: Backend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An importable module reference: stored file references are never executed
    # (trust model, docs/trust.md), module references are imported.
    name = f"graph_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(GRAPH_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module(name)
    module.release = asyncio.Event()
    run_id = new_id("by-ref")
    task = asyncio.create_task(
        engine(backend).run(module.graph, 4, run_id=run_id, graph_ref=f"{name}:graph")
    )
    await until(running(backend, run_id, "second"), "second running")
    await crash(task)
    assert (await backend.store.get_run(run_id)).graph_ref == f"{name}:graph"
    module.release.set()

    result = await engine(backend).resume(run_id)
    assert result.results == {"first": 5, "second": 50}
    assert module.runs == ["first", "second", "second"]
