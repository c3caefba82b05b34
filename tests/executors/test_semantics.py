"""The engine's semantics over every executor: the run loop keeps them, wherever handlers run.

Each test builds a graph from ``_graphs.py`` and asserts the clauses the
engine tests assert in process, over three executors: ``local`` (the
engine's inline default), ``seam`` (a pass-through executor around
:class:`LocalExecutor`, so every attempt crosses the executor seam) and
``ray`` (:class:`RayExecutor` on the session's local Ray). Runs are durable on
a real SQLite file, so "exactly one committed result" is read from the store.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import tailrace as tr
from tailrace.executors import AttemptContext, Executor, LocalExecutor, RayExecutor
from tailrace.stores import SQLiteStore
from tailrace.tail._hooks import TailHooks

#: Hang guard around a run: fails the test only when something hangs.
GUARD = 120.0


class PassThrough:
    """An executor around another that records each attempt's context (an OTel wrapper's shape)."""

    def __init__(self, inner: Executor) -> None:
        self.inner = inner
        self.seen: list[AttemptContext] = []

    async def invoke(self, node: Any, payload: Any, context: AttemptContext) -> Any:
        self.seen.append(context)
        return await self.inner.invoke(node, payload, context)

    async def aclose(self) -> None:
        await self.inner.aclose()


@pytest.fixture(params=["local", "seam", pytest.param("ray", marks=pytest.mark.slow)])
async def executor(request: pytest.FixtureRequest) -> AsyncIterator[Executor | None]:
    """The executor under test (None: the engine's inline default)."""
    if request.param == "local":
        yield None
    elif request.param == "seam":
        yield PassThrough(LocalExecutor())
    else:
        request.getfixturevalue("ray_session")
        async with RayExecutor(cancel_grace=1.0) as ray_executor:
            yield ray_executor


class Harness:
    """An engine on ``executor`` over a SQLite store, recording its events."""

    def __init__(self, store: SQLiteStore, executor: Executor | None, tail: TailHooks | None):
        self.store = store
        self.executor = executor
        self.events: list[tr.Event] = []
        bus = tr.EventBus()
        bus.subscribe(self.events.append)
        self.engine = tr.Engine(store=store, bus=bus, executor=executor, tail=tail)

    async def run(self, graph: tr.Graph, value: Any, run_id: str) -> tr.RunResult:
        async with asyncio.timeout(GUARD):
            return await self.engine.run(graph, value, run_id=run_id)

    def of(self, type: tr.EventType, node: str | None = None) -> list[tr.Event]:
        return [e for e in self.events if e.type is type and (node is None or e.node_id == node)]

    async def committed(self, run_id: str, node: str) -> list[Any]:
        """The node's results as committed in the store."""
        return [json.loads(r.value_json) for r in await self.store.results(run_id, node)]

    async def stored_events(self, run_id: str, type: tr.EventType, node: str) -> list[Any]:
        rows = await self.store.events(run_id)
        return [r for r in rows if r.type == type.value and r.node_id == node]


@pytest.fixture
async def harness(tmp_path: Path, executor: Executor | None) -> AsyncIterator[Harness]:
    async with SQLiteStore(tmp_path / "runs.db") as store:
        yield Harness(store, executor, None)


def workdir(tmp_path: Path) -> str:
    directory = tmp_path / "work"
    directory.mkdir()
    return str(directory)


async def test_e4_e5_first_k_fires_once_on_the_two_earliest(
    harness: Harness, graphs: ModuleType, tmp_path: Path
) -> None:
    result = await harness.run(graphs.first_k(workdir(tmp_path)), 7, "first-k")

    assert result.status == "completed"
    # w3 finishes only after merge ran, so the two earliest are w1 and w2, in definition order.
    assert result.results["merge"] == ["w1:7", "w2:7"]
    assert result.results["w3"] == "w3:7"
    assert result.visits["merge"] == 1
    assert [(i.node_id, i.source_id, i.reason) for i in result.late_inputs] == [
        ("merge", "w3", "fired")
    ]
    assert len(harness.of(tr.EventType.AGGREGATE_FIRED, "merge")) == 1
    assert await harness.committed("first-k", "merge") == [["w1:7", "w2:7"]]


async def test_e9_failure_cancels_and_awaits_the_sibling_and_reraises_unwrapped(
    harness: Harness, graphs: ModuleType, tmp_path: Path
) -> None:
    directory = workdir(tmp_path)
    with pytest.raises(ValueError, match="bad input 3") as caught:
        await harness.run(graphs.teardown(directory), 3, "teardown")

    assert type(caught.value) is ValueError  # the handler's own exception, unwrapped (E9)
    # The sibling was cancelled and awaited before run() raised: its worker saw it.
    assert graphs.marked(directory, "slow.cancelled")
    assert [e.type for e in harness.events][-1] is tr.EventType.NODE_FAILED
    assert harness.of(tr.EventType.NODE_CANCELLED, "slow")
    assert (await harness.store.get_run("teardown")).status.value == "failed"
    assert await harness.committed("teardown", "slow") == []


async def test_e11_retries_follow_the_policy_and_every_try_is_an_event(
    harness: Harness, graphs: ModuleType, tmp_path: Path
) -> None:
    directory = workdir(tmp_path)
    graph = graphs.flaky(directory, fail_with=ConnectionError, retry_on=ConnectionError)
    result = await harness.run(graph, 5, "flaky")

    assert result.results["flaky"] == {"input": 5, "try": 3}
    assert result.nodes["flaky"].attempts == 3
    retrying = harness.of(tr.EventType.NODE_RETRYING, "flaky")
    assert [(e.attempt, e.data["error"]) for e in retrying] == [
        (1, "ConnectionError: try 1 of 5"),
        (2, "ConnectionError: try 2 of 5"),
    ]
    assert [row[2] for row in graphs.executions(directory)] == [1, 2, 3]
    assert await harness.committed("flaky", "flaky") == [{"input": 5, "try": 3}]
    # Where the tries ran: Ray workers are other processes; the local executors run here.
    pids = {row[3] for row in graphs.executions(directory)}
    assert (os.getpid() not in pids) is isinstance(harness.executor, RayExecutor)


async def test_e11_an_exception_outside_retry_on_fails_at_once_with_its_class(
    harness: Harness, graphs: ModuleType, tmp_path: Path
) -> None:
    directory = workdir(tmp_path)
    graph = graphs.flaky(directory, fail_with=KeyError, retry_on=ConnectionError)
    with pytest.raises(KeyError) as caught:
        await harness.run(graph, 5, "not-retried")

    assert type(caught.value) is KeyError
    assert [row[2] for row in graphs.executions(directory)] == [1]
    assert harness.of(tr.EventType.NODE_RETRYING) == []


async def test_e11_a_timed_out_try_is_stopped_then_retried(
    harness: Harness, graphs: ModuleType, tmp_path: Path
) -> None:
    directory = workdir(tmp_path)
    # Long enough for Ray to start the second try on a warm worker; short in process.
    timeout = 2.0 if isinstance(harness.executor, RayExecutor) else 0.5
    result = await harness.run(graphs.timing_out(directory, timeout), 0, "timeout")

    assert result.results["step"] == "try 2"
    [retrying] = harness.of(tr.EventType.NODE_RETRYING, "step")
    assert retrying.data["error"].startswith("TimeoutError")
    # The first try ran and was stopped: a timeout cancels the work, it does not abandon it.
    assert graphs.marked(directory, "try1.started")
    assert graphs.marked(directory, "try1.cancelled")


async def test_t3_hedge_backup_wins_loser_cancelled_one_result_committed(
    tmp_path: Path, executor: Executor | None, graphs: ModuleType
) -> None:
    directory = workdir(tmp_path)
    tail = TailHooks(factor=3.0)
    for _ in range(3):  # trained: the straggler timer fires 0.6 s into an attempt
        tail.estimator("h").observe(1.0, 0.2)
    async with SQLiteStore(tmp_path / "runs.db") as store:
        harness = Harness(store, executor, tail)
        result = await harness.run(graphs.hedged(directory), 1, "hedge")

        assert (result.status, result.output) == ("completed", "backup:1")
        assert (result.stragglers, result.hedges) == (1, 1)
        assert graphs.marked(directory, "primary.cancelled")  # cancelled and awaited
        started = harness.of(tr.EventType.NODE_STARTED, "h")
        assert [e.data.get("hedge", False) for e in started] == [False, True]
        assert len(await harness.stored_events("hedge", tr.EventType.NODE_COMPLETED, "h")) == 1
        assert await harness.committed("hedge", "h") == ["backup:1"]
    if isinstance(executor, PassThrough):
        assert [(c.node_id, c.visit, c.attempt, c.hedge, c.backup_of) for c in executor.seen] == [
            ("h", 1, 1, False, None),
            ("h", 1, 1, True, 1),
        ]


async def test_cancelling_the_run_stops_the_attempt_before_the_cancellation_returns(
    harness: Harness, graphs: ModuleType, tmp_path: Path
) -> None:
    directory = workdir(tmp_path)
    run = asyncio.create_task(harness.run(graphs.lone_slow(directory), 0, "cancelled"))
    assert await graphs.until_marked(directory, "slow.started")  # a file: it crosses processes
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run

    assert graphs.marked(directory, "slow.cancelled")  # stopped, and awaited, on every executor
    assert (await harness.store.get_run("cancelled")).lease_owner is None
