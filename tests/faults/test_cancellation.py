"""Cancelling a run or a resume never leaks its lease (issue 9, finding 4; D6, D1, D3).

Each test runs over memory, SQLite (a real file) and Postgres (a schema of its
own). Runs and resumes are cancelled at seeded moments, three ways:
``asyncio.wait_for`` with a small random timeout (anywhere, from before the
run is stored to its last write); ``task.cancel()`` from inside the k-th
handler to start; and ``task.cancel()`` just before the m-th call the engine
makes to its store (creating the run, taking the lease, a commit the run is
flushing, the release), through a :class:`_faulty.CancellingStore`. Then:

- no lease is left held: every run the store knows has no live lease owner,
  and no heartbeat task outlives its run (structured concurrency);
- every cut run is resumed at once by another engine (another owner), with
  no ``LeaseHeld``, to the results of an uninterrupted run, and no visit
  committed before a resume runs again (D1);
- a cancellation is never swallowed: the cut call raises ``CancelledError``
  (or the user's ``TimeoutError``), and a run cut mid-flight stays ``running``.

Also: a user ``asyncio.timeout`` around a run whose handler never returns,
and user timeouts on a Postgres pool of one connection, including one that
fires as the pool hands the connection over. The hang guard
(:func:`_faulty.guarded`) only turns a hang into a failure; no assertion
depends on timing.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest

import tailrace as tr
from tailrace.stores import RunStatus, RunStore
from tests import fixtures
from tests.faults import _faulty as faulty

CANCELLATIONS = 40
RESUMED_RUNS = 4
RESUME_ATTEMPTS = 10
AT_ONCE = 4  # runs cancelled concurrently, each by an engine of its own
FANOUT = 6
K = 4
CHAIN = 4
#: Long: a leaked lease must still be live when it is looked for.
TTL = 30.0


store = fixtures.each_store  # the fixture: each backend in turn, on a fresh database


def _plus_one(x: int) -> int:
    return x + 1


def _same(x: Any) -> Any:
    return x


def _branch(j: int) -> Callable[[int], int]:
    return lambda x: x * 10 + j


def build_graph(rec: Any, *, hang: bool = False, chain: int = CHAIN) -> tr.Graph:
    """start -> f0..f5 -> merge (first 4) -> c0.. -> end; with ``hang``, also start -> hang.

    Handlers yield to the loop a few times, so a run spans many loop
    iterations and harvests and a cancellation can land anywhere.
    """
    g = tr.Graph("cancellation")
    g.add_node("start", rec.task(_same, yields=2))
    if hang:
        g.add_node("hang", rec.never_returns("hang done"))
        g.add_edge("start", "hang")
    g.add_node("merge", rec.task(sorted, yields=1), kind="aggregate", required=K)
    for j in range(FANOUT):
        g.add_node(f"f{j}", rec.task(_branch(j), yields=j % 3 + 1))
        g.add_edge("start", f"f{j}")
        g.add_edge(f"f{j}", "merge")
    prev = "merge"
    for i in range(chain):
        g.add_node(f"c{i}", rec.task(sum if i == 0 else _plus_one, yields=2))
        g.add_edge(prev, f"c{i}")
        prev = f"c{i}"
    g.add_node("end", rec.task(_same, yields=1))
    g.add_edge(prev, "end")
    return g


async def _reference(store: RunStore, rec: Any, graph: tr.Graph) -> tr.RunResult:
    rec.phase, rec.hang = "reference", False
    result = await faulty.guarded(
        tr.Engine(store=store).run(graph, 1, run_id=f"ref-{uuid.uuid4().hex}"), "reference run"
    )
    assert result.status == "completed"
    return result


class Canceller:
    """Cancels a run's task from inside the handler that is its k-th start in a phase."""

    def __init__(self, rec: Any) -> None:
        self.plans: dict[tuple[str, str], tuple[int, asyncio.Future[Any]]] = {}
        rec.on_start = self._on_start

    def plan(self, run_id: str, phase: str, k: int, task: asyncio.Future[Any]) -> None:
        self.plans[(run_id, phase)] = (k, task)

    def _on_start(self, run_id: str, phase: str, n: int) -> None:
        plan = self.plans.get((run_id, phase))
        if plan is not None and plan[0] == n:
            plan[1].cancel()


async def _resume_elsewhere(
    store: RunStore, rec: Any, graph: tr.Graph, run_id: str, reference: tr.RunResult
) -> None:
    """Another engine resumes ``run_id`` at once: no LeaseHeld, reference results, no re-run (D1)."""
    committed = await faulty.committed_keys(store, run_id)
    phase = rec.phase_of_run[run_id] = f"resume:{run_id}"
    result = await faulty.guarded(tr.Engine(store=store).resume(run_id, graph), f"resume {run_id}")
    assert result.status == "completed"
    assert result.results == reference.results
    rerun = sorted(set(rec.started[phase]) & set(committed))
    assert not rerun, f"run {run_id!r}: committed visits ran again on resume: {rerun}"


async def _measured_reference(
    store: RunStore, rec: Any, graph: tr.Graph
) -> tuple[tr.RunResult, int, float]:
    """The reference run, the number of store calls it made, and its wall time.

    Both only spread the seeded cancellation moments over a whole run; no
    assertion depends on them.
    """
    counting = faulty.CancellingStore(store)
    began = time.monotonic()
    result = await _reference(counting, rec, graph)
    return result, len(counting.calls), time.monotonic() - began


async def test_forty_cancelled_runs_leave_no_lease_and_resume_at_once_elsewhere(
    store: RunStore,
) -> None:
    rec = faulty.Recorder()
    graph = build_graph(rec)
    reference, calls, seconds = await _measured_reference(store, rec, graph)
    rec.phase = "run"
    canceller = Canceller(rec)
    cancelled: dict[str, str] = {}  # run id -> how it was cancelled
    every: list[str] = []

    async def one(i: int) -> None:
        rng = random.Random(f"cancel-run-{i}")
        how = ("wait_for", "handler start", "store call")[i % 3]
        run_id = f"cancel-{i}-{uuid.uuid4().hex[:8]}"
        every.append(run_id)
        wrapper = faulty.CancellingStore(store, at=rng.randint(1, calls) if i % 3 == 2 else 0)
        task = asyncio.ensure_future(
            tr.Engine(store=wrapper, lease_ttl=TTL).run(graph, 1, run_id=run_id)
        )
        if how == "wait_for":
            try:
                await asyncio.wait_for(task, rng.choice([0.0, rng.uniform(0.0, 1.5 * seconds)]))
            except TimeoutError:
                cancelled[run_id] = how
            return
        wrapper.target = task
        if how == "handler start":
            canceller.plan(run_id, "run", rng.randint(1, len(graph.nodes)), task)
        await asyncio.wait({task})  # not ``await task``: that would swallow a cancellation of ours
        # Never swallowed: cut at a handler start, or at a store call it made, it raises.
        assert task.cancelled() is (how == "handler start" or wrapper.fired), (how, task)
        if task.cancelled():
            cancelled[run_id] = how
        else:
            task.result()

    i = 0
    while len(cancelled) < CANCELLATIONS:
        assert i < 3 * CANCELLATIONS, f"only {len(cancelled)} of {i} runs were cancelled"
        batch = (one(j) for j in range(i, i + AT_ONCE))
        await faulty.guarded(asyncio.gather(*batch), f"cancellations from {i}")
        i += AT_ONCE
    assert not rec.unfinished("run")
    assert not faulty.lease_tasks()
    await faulty.assert_no_lease_held(store, every)

    resumed = 0
    for run_id, how in cancelled.items():
        record = await _record_or_none(store, run_id)
        if record is None or record.status is RunStatus.COMPLETED:
            # Cut before it was stored, or in its last write or its release.
            assert how != "handler start", (run_id, record)
            continue
        assert record.status is RunStatus.RUNNING, (run_id, record.status, record.error)
        await _resume_elsewhere(store, rec, graph, run_id, reference)
        resumed += 1
    assert resumed >= sum(how == "handler start" for how in cancelled.values())
    assert not faulty.lease_tasks()
    await faulty.assert_no_lease_held(store, every)


async def _record_or_none(store: RunStore, run_id: str) -> Any:
    try:
        return await store.get_run(run_id)
    except tr.RunNotFound:
        return None


async def test_cancelled_resumes_leave_no_lease_and_never_rerun_committed_visits(
    store: RunStore,
) -> None:
    rec = faulty.Recorder()
    graph = build_graph(rec, chain=12)
    reference, calls, seconds = await _measured_reference(store, rec, graph)
    canceller = Canceller(rec)
    cuts = 0
    for r in range(RESUMED_RUNS):
        run_id = f"resume-cancel-{r}-{uuid.uuid4().hex[:8]}"
        rec.phase = "crash"  # the run itself is cut at its third handler start
        task = asyncio.ensure_future(tr.Engine(store=store).run(graph, 1, run_id=run_id))
        canceller.plan(run_id, "crash", 3, task)
        await faulty.guarded(asyncio.wait({task}), "the first run")
        assert task.cancelled()
        for attempt in range(RESUME_ATTEMPTS):
            rec.phase = f"resume{r}-{attempt}"
            rng = random.Random(f"cancel-resume-{r}-{attempt}")
            if not await _cut_resume(store, rec, graph, canceller, run_id, rng, calls, seconds):
                break  # it finished: nothing left to resume
            cuts += 1
        record = await store.get_run(run_id)
        if record.status is RunStatus.RUNNING:
            rec.phase = f"last{r}"
            await _resume_elsewhere(store, rec, graph, run_id, reference)
        else:
            assert record.status is RunStatus.COMPLETED, (run_id, record.status, record.error)
        stored = await faulty.committed_keys(store, run_id)
        assert {key: json.loads(value) for key, value in stored.items()} == {
            (node, 1): value for node, value in reference.results.items()
        }
    assert cuts >= RESUMED_RUNS  # the first resume of each run, at least, was really cut


async def _cut_resume(
    store: RunStore,
    rec: Any,
    graph: tr.Graph,
    canceller: Canceller,
    run_id: str,
    rng: random.Random,
    calls: int,
    seconds: float,
) -> bool:
    """Resume ``run_id`` with a new engine and cancel it at a seeded moment; True if it was cut.

    Whether cut or not: no lease is left held, no visit committed before it
    ran again (D1), and the run is ``running`` (cut) or ``completed``.
    """
    phase = rec.phase
    committed = await faulty.committed_keys(store, run_id)
    how = rng.choice(["wait_for", "handler start", "store call"])
    # The first try of a run is always cut at a handler start, so every run is cut once.
    if phase.endswith("-0"):
        how = "handler start"
    # Every node not committed yet starts before the resume can finish (none may be
    # left: a run cut between its last result and its final status).
    starts = len(graph.nodes) - len(committed)
    if how == "handler start" and starts == 0:
        how = "store call"
    wrapper = faulty.CancellingStore(store, at=rng.randint(1, calls) if how == "store call" else 0)
    task = asyncio.ensure_future(tr.Engine(store=wrapper, lease_ttl=TTL).resume(run_id, graph))
    wrapper.target = task
    if how == "handler start":
        canceller.plan(run_id, phase, rng.randint(1, starts), task)
    if how == "wait_for":
        timeout = rng.choice([0.0, rng.uniform(0.0, 1.5 * seconds)])
        waited = asyncio.ensure_future(asyncio.wait_for(task, timeout))
        await faulty.guarded(asyncio.wait({waited}), f"{phase} under wait_for")
        cut = isinstance(waited.exception(), TimeoutError)
    else:
        await faulty.guarded(asyncio.wait({task}), phase)
        cut = task.cancelled()
        assert cut is (how == "handler start" or wrapper.fired), (phase, how, task)
    if not cut:
        assert task.result().status == "completed"
    assert not rec.unfinished(phase)
    assert not faulty.lease_tasks()
    await faulty.assert_no_lease_held(store, [run_id])
    rerun = sorted(set(rec.started[phase]) & set(committed))
    assert not rerun, f"{phase} ({how}): committed visits ran again: {rerun}"
    status = (await store.get_run(run_id)).status
    assert status in (RunStatus.RUNNING, RunStatus.COMPLETED), status
    assert cut or status is RunStatus.COMPLETED
    return cut and status is RunStatus.RUNNING


async def _under_user_timeout(call: Callable[[], Any], seconds: float) -> bool:
    """Run ``call()`` under ``asyncio.timeout(seconds)``; True when that timeout cut it."""
    try:
        async with asyncio.timeout(seconds) as scope:
            await call()
    except TimeoutError:
        assert scope.expired()
        return True
    return False


async def test_user_timeout_around_a_run_whose_handler_never_returns(store: RunStore) -> None:
    rec = faulty.Recorder()
    graph = build_graph(rec, hang=True)
    reference = await _reference(store, rec, graph)
    run_id = f"timeout-{uuid.uuid4().hex[:8]}"
    rec.phase, rec.hang = "hang", True
    engine = tr.Engine(store=store, lease_ttl=TTL)
    scopes: list[asyncio.Timeout] = []

    def arm(run: str, phase: str, n: int) -> None:
        # The user's 0.2 s count from the moment ``hang`` started (so after the run
        # was stored and leased, however slow the machine).
        if rec.started["hang"][("hang", 1)] and scopes[0].when() is None:
            scopes[0].reschedule(asyncio.get_running_loop().time() + 0.2)

    rec.on_start = arm

    async def call() -> bool:
        try:
            async with asyncio.timeout(None) as scope:
                scopes.append(scope)
                await engine.run(graph, 1, run_id=run_id)
        except TimeoutError:
            assert scope.expired()
            return True
        return False

    assert await faulty.guarded(call(), "the run under asyncio.timeout")
    assert rec.cancelled["hang"][("hang", 1)] == 1
    assert not rec.unfinished("hang")
    assert not faulty.lease_tasks()
    record = await store.get_run(run_id)
    assert record.status is RunStatus.RUNNING
    assert record.lease_owner is None
    rec.hang = False
    await _resume_elsewhere(store, rec, graph, run_id, reference)


@pytest.mark.postgres
@pytest.mark.skipif(fixtures.POSTGRES_DSN is None, reason="TAILRACE_TEST_POSTGRES_DSN is not set")
async def test_user_timeouts_are_honoured_on_a_postgres_pool_of_one_connection() -> None:
    rec = faulty.Recorder()
    # A long chain keeps the writer busy on the one connection when a timeout fires,
    # and a short lease keeps the heartbeat contending for it. ``hang`` never
    # returns: only the user's timeout can end these runs.
    graph = build_graph(rec, hang=True, chain=40)
    async with fixtures.postgres_store(min_size=1, max_size=1) as store:
        reference = await _reference(store, rec, graph)
        engine = tr.Engine(store=store, lease_ttl=1.5)
        rec.phase, rec.hang = "hang", True
        run_ids: list[str] = []

        for hops in range(8):  # the timeout fires as the pool hands the connection over
            run_ids.append(f"handover-{hops}-{uuid.uuid4().hex[:8]}")
            await _timeout_at_handover(store, engine, graph, run_ids[-1], hops)

        async def one(i: int) -> bool:
            run_id = f"pool1-{i}-{uuid.uuid4().hex[:8]}"
            run_ids.append(run_id)
            seconds = random.Random(f"pool-{i}").uniform(0.02, 0.6)
            return await _under_user_timeout(lambda: engine.run(graph, 1, run_id=run_id), seconds)

        for first in range(0, 8, 2):  # two runs at once contend for the one connection
            cut = await faulty.guarded(
                asyncio.gather(one(first), one(first + 1)), f"timeouts {first}.."
            )
            assert cut == [True, True]
        assert not rec.unfinished("hang")
        assert not faulty.lease_tasks()
        await faulty.assert_no_lease_held(store, run_ids)

        # The store is usable afterwards: reads, a new run, and resumes by another engine.
        listed = {r.run_id for r in await store.list_runs()}
        for run_id in run_ids:  # a run cut before it was stored is simply absent
            assert run_id in listed or await _record_or_none(store, run_id) is None
        rec.hang = False
        fresh = await faulty.guarded(
            tr.Engine(store=store).run(graph, 1, run_id=f"after-{uuid.uuid4().hex[:8]}"),
            "a run after the timeouts",
        )
        assert fresh.results == reference.results
        for run_id in run_ids[7:10]:
            if (record := await _record_or_none(store, run_id)) is not None:
                assert record.status is RunStatus.RUNNING
                await _resume_elsewhere(store, rec, graph, run_id, reference)


async def _timeout_at_handover(
    store: Any, engine: tr.Engine, graph: tr.Graph, run_id: str, hops: int
) -> None:
    """Start ``run_id`` while the pool's only connection is held; free it and fire the
    user's timeout ``hops`` loop turns later. The run must end with ``TimeoutError``."""
    pool = store._db._pool  # back door: hold the only connection, give it back at a chosen moment
    scopes: list[asyncio.Timeout] = []

    async def call() -> None:
        async with asyncio.timeout(None) as scope:
            scopes.append(scope)
            await engine.run(graph, 1, run_id=run_id)

    async with pool.connection():
        victim = asyncio.ensure_future(call())
        await faulty.until(
            lambda: pool.get_stats().get("requests_waiting", 0) >= 1, "the run to wait for it"
        )
    loop = asyncio.get_running_loop()
    faulty.after_hops(hops, lambda: scopes[0].reschedule(loop.time()))
    await faulty.guarded(asyncio.wait({victim}), f"the run timed out {hops} hops after handover")
    assert isinstance(victim.exception(), TimeoutError), victim
    assert scopes[0].expired()
