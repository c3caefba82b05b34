"""Child runs on queues across a fleet (R2-R6): parents that wait holding nothing.

In-process tests run real :class:`tailrace.Worker` s on a real SQLite file or
Postgres schema; the fault tests SIGKILL real processes: the one driving a
parent, and a worker driving a child.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

import tailrace as tr
from tailrace.stores import Harvest, QuestionStatus, RunStatus, RunStore, open_store
from tests import fixtures

GRAPHS = Path(__file__).with_name("child_graphs.py")
graphs = fixtures.load_module("child_graphs", GRAPHS)
ROOT = Path(__file__).resolve().parents[2]
GUARD = fixtures.HANG_GUARD
until = fixtures.until


@pytest.fixture(params=fixtures.SHARED_STORES)
async def shared(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    """The URL of a fresh SQLite file or Postgres schema that several processes can open."""
    async with fixtures.shared_url(request.param, tmp_path, "children") as url:
        yield url


@contextlib.asynccontextmanager
async def workers(
    store: RunStore,
    count: int,
    *,
    queues: tuple[str, ...] = ("parents", "kids", "asks"),
    **options: Any,
) -> AsyncIterator[list[tr.Worker]]:
    """``count`` workers in this process, each with one slot unless told otherwise."""
    options.setdefault("concurrency", 1)
    options.setdefault("graphs", [graphs.family, graphs.family_k, graphs.mixed])
    options.setdefault("heartbeat", 0.2)
    options.setdefault("grace", 1.0)
    fleet = [tr.Worker(store, queues=list(queues), **options) for _ in range(count)]
    stop = asyncio.Event()
    tasks = [asyncio.create_task(w.run(stop)) for w in fleet]
    try:
        yield fleet
    finally:
        stop.set()
        done, pending = await asyncio.wait(tasks, timeout=GUARD)
        if pending:  # say what a worker still held, then stop it
            held = [(j.run_id, j.kind) for w in fleet for j in w._jobs.values()]
            for task in pending:
                task.cancel()
            pytest.fail(f"workers did not stop within {GUARD} s; jobs: {held}")
        for task in done:
            task.result()


def side_starts(side: Path) -> collections.Counter[str]:
    """How often each child run's work started, from the side file."""
    counts: collections.Counter[str] = collections.Counter()
    if side.exists():
        for line in side.read_text().splitlines():
            counts[line.split()[0]] += 1
    return counts


async def test_parents_waiting_on_children_never_deadlock_a_fleet_of_single_slots(
    shared: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R4: two workers with one slot each drive 12 parents x 5 children; waiting parents
    suspend (no slot held) and are claimed again when a child ends."""
    side = tmp_path / "side.log"
    monkeypatch.setenv(graphs.SIDE_ENV, str(side))
    async with open_store(shared) as store, workers(store, 2):
        engine = tr.Engine(store=store)
        ids = [
            await engine.submit(graphs.family, {"count": 5, "sleep": 0.01}, queue="parents")
            for _ in range(12)
        ]
        results = [await engine.wait(run_id, timeout=GUARD) for run_id in ids]
        assert [r.output for r in results] == [100] * 12  # 0+10+20+30+40 each
        suspended = [
            e
            for run_id in ids
            for e in await store.events(run_id)
            if e.type == "run_suspended" and '"children"' in e.data_json
        ]
        children = [c for run_id in ids for c in await store.list_runs(parent=run_id)]
    assert suspended, "a parent waiting only on children suspends"
    assert len(children) == 60 and {c.status for c in children} == {RunStatus.COMPLETED}
    assert {c.queue_name for c in children} == {"kids"}
    starts = side_starts(side)
    assert len(starts) == 60 and set(starts.values()) == {1}  # no child started twice (R2)


@pytest.mark.parametrize("depth", [1, 2])
async def test_inline_children_of_queued_parents_never_deadlock_a_fleet_of_single_slots(
    shared: str, depth: int
) -> None:
    """R4 at any depth: a parent on a queue runs an inline child (no ``queue=``) whose node
    is a queued grandchild (``depth`` inline levels between them); two workers of one slot
    each serve both queues, two parents. The inline children, stored on their parent's
    queue, suspend as their parents do, so no slot waits on the grandchildren."""
    graph = graphs.inline_1 if depth == 1 else graphs.inline_2
    async with open_store(shared) as store, workers(store, 2, graphs=[graph]):
        engine = tr.Engine(store=store)
        ids = [await engine.submit(graph, {"n": n, "sleep": 0.01}, queue="parents") for n in (1, 2)]
        results = [await engine.wait(run_id, timeout=GUARD) for run_id in ids]
        tree = [r for run_id in ids for r in await _descendants(store, run_id)]
    assert [r.output for r in results] == [10, 20]
    assert len(tree) == 2 * (depth + 1) and {r.status for r in tree} == {RunStatus.COMPLETED}
    inline = [r for r in tree if r.graph_name != "kid"]
    assert {r.queue_name for r in inline} == {"parents"}  # on their parent's queue


async def _descendants(store: RunStore, run_id: str) -> list[Any]:
    """Every run below ``run_id``, at any depth."""
    found = []
    for child in await store.list_runs(parent=run_id):
        found += [child, *await _descendants(store, child.run_id)]
    return found


async def _owner_of(store: RunStore, run_id: str) -> str:
    """The owner named by the run's first ``run_started`` event (W6)."""
    started = [e for e in await store.events(run_id) if e.type == "run_started"]
    return str(json.loads(started[0].data_json)["owner"])


@pytest.mark.parametrize(("concurrency", "taken"), [(8, 3), (2, 1)])
async def test_a_worker_claims_the_children_its_run_submits_as_it_submits_them(
    shared: str, concurrency: int, taken: int
) -> None:
    """R4: the parent's worker claims as many of the children as it has free slots for in
    the write that submits them (the parent holds one); the rest go to the fleet. With
    ``take_children=False`` every child goes through the fleet's claims."""
    async with open_store(shared) as store:
        async with workers(store, 2, concurrency=concurrency) as fleet:
            engine = tr.Engine(store=store)
            run_id = await engine.submit(graphs.family, {"count": 3, "sleep": 0.2}, queue="parents")
            assert (await engine.wait(run_id, timeout=GUARD)).output == 30
        children = await store.list_runs(parent=run_id)
        parent_owner = await _owner_of(store, run_id)
        owners = [await _owner_of(store, c.run_id) for c in children]
        assert sum(w.stats.taken for w in fleet) == taken
        assert owners.count(parent_owner) >= taken
        assert {c.status for c in children} == {RunStatus.COMPLETED}
        async with workers(store, 2, concurrency=8, take_children=False) as fleet:
            other = await engine.submit(graphs.family, {"count": 3, "sleep": 0.0}, queue="parents")
            assert (await engine.wait(other, timeout=GUARD)).output == 30
        assert sum(w.stats.taken for w in fleet) == 0
        assert sum(w.stats.claimed for w in fleet) >= 4  # the parent and its 3 children


async def test_children_claimed_by_a_submit_that_lands_as_the_worker_drains_go_back(
    shared: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R4 with a stop: a child submit that claims for its worker is still writing when the
    worker is told to stop, and still when its grace is over. The runs it claimed are
    handed back to the queue before ``Worker.run`` returns (a process that exits then leaves none leased until its ttl),
    and another worker completes the parent."""
    async with open_store(shared) as store:
        entered, release = asyncio.Event(), asyncio.Event()
        submit = store._submit_runs
        give_back = store._return_claim

        async def slow_submit(runs: Any, claim: Any, skip: Any) -> Any:
            if claim is not None:
                entered.set()
                await release.wait()
            return await submit(runs, claim, skip)

        async def slow_give_back(run_id: str, owner: str) -> bool:
            await asyncio.sleep(0.3)  # a give-back nobody awaits would not land before run returns
            return await give_back(run_id, owner)

        monkeypatch.setattr(store, "_submit_runs", slow_submit)
        monkeypatch.setattr(store, "_return_claim", slow_give_back)
        engine = tr.Engine(store=store)
        run_id = await engine.submit(graphs.family, {"count": 3, "sleep": 0.0}, queue="parents")
        worker = tr.Worker(
            store, queues=["parents", "kids"], concurrency=4, heartbeat=0.2, grace=0.2,
            graphs=[graphs.family],
        )  # fmt: skip
        stop = asyncio.Event()
        running = asyncio.create_task(worker.run(stop))
        await asyncio.wait_for(entered.wait(), GUARD)
        stop.set()
        await asyncio.sleep(0.5)  # the grace is over: the parent's job is cancelled
        release.set()
        await asyncio.wait_for(running, GUARD)
        children = await store.list_runs(parent=run_id)
        assert len(children) == 3
        assert worker.stats.taken == 0
        held = [c.run_id for c in children if c.lease_owner is not None]
        assert not held, f"children still leased after the worker stopped: {held}"
        assert {c.status for c in children} == {RunStatus.QUEUED}
        monkeypatch.undo()
        async with workers(store, 1, concurrency=2, queues=("parents", "kids")):
            assert (await engine.wait(run_id, timeout=GUARD)).output == 30


async def test_a_suspended_parent_wakes_once_its_map_can_complete_not_per_child(
    shared: str,
) -> None:
    """R4: the children end one after another; the parent waits for all of them in one
    suspension (a child's completion counts down), so it is driven again once."""
    sleeps = [0.3, 0.6, 0.9, 1.2]
    async with open_store(shared) as store, workers(store, 2, concurrency=4):
        engine = tr.Engine(store=store)
        run_id = await engine.submit(graphs.family, {"count": 4, "sleeps": sleeps}, queue="parents")
        result = await engine.wait(run_id, timeout=GUARD)
        types = [e.type for e in await store.events(run_id)]
    assert result.output == 60
    assert types.count("run_suspended") == 1 and types.count("run_resumed") == 1, types


@pytest.mark.parametrize("read", ["stored", "failing", "undecodable"])
async def test_a_woken_parent_reads_its_childrens_stored_outputs_or_their_rows(
    shared: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, read: str
) -> None:
    """R4: a parent resumed after its children reads the outputs their final commits stored
    (``RunStore.outputs``); when that read fails, or an output does not decode, each child
    is read off its own rows instead, and the parent's result is the same."""
    asked: list[str] = []
    async with open_store(shared) as store:
        stored = store.outputs

        async def outputs(run_ids: list[str]) -> dict[str, str]:
            asked.extend(run_ids)
            if read == "failing":
                raise tr.StoreError("the store lost its connection")
            found = await stored(run_ids)
            return {k: "{not json" for k in found} if read == "undecodable" else found

        monkeypatch.setattr(store, "outputs", outputs)
        async with workers(store, 2, concurrency=4):
            engine = tr.Engine(store=store)
            job = {"count": 4, "sleeps": [0.05, 0.1, 0.15, 0.2]}
            run_id = await engine.submit(graphs.family, job, queue="parents")
            result = await engine.wait(run_id, timeout=GUARD)
        children = {c.run_id for c in await store.list_runs(parent=run_id)}
        assert (await stored(sorted(children))).keys() == children  # every output was stored
    assert result.output == 60  # 0+10+20+30, however the outputs were read
    assert set(asked) == children  # each child's output was asked for
    undecodable = [r for r in caplog.records if "does not decode" in r.getMessage()]
    assert bool(undecodable) is (read == "undecodable")


async def test_a_lease_beat_while_the_suspension_lets_go_of_it_is_no_lease_lost(
    shared: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R4: the parent's suspension commit releases its lease, and its answer is slow to
    come back; the lease's beats meanwhile find the lease gone. That is the commit's
    doing, not a takeover: the worker's job is not stopped as one that lost its run
    (``busy``), and the parent completes."""
    async with open_store(shared) as store:
        commit = store.commit

        async def slow_answer(run_id: str, token: int, harvest: Harvest) -> bool:
            cancel = await commit(run_id, token, harvest)
            if harvest.waiting_on:
                await asyncio.sleep(0.8)  # four beats of a 0.6 s lease
            return cancel

        monkeypatch.setattr(store, "commit", slow_answer)
        async with workers(store, 1, concurrency=4, lease_ttl=0.6) as fleet:
            engine = tr.Engine(store=store)
            job = {"count": 3, "sleep": 3.0}  # the children end well after the slow answer
            run_id = await engine.submit(graphs.family, job, queue="parents")
            result = await engine.wait(run_id, timeout=GUARD)
            types = [e.type for e in await store.events(run_id)]
    assert result.output == 30
    assert "run_suspended" in types
    assert fleet[0].stats.busy == 0


async def test_a_worker_stopping_as_the_suspension_lets_go_writes_nothing_after_it(
    shared: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R4: the worker stops (grace over) while the parent's suspension commit, which let go
    of its lease, is still to answer. The parent's driver is cancelled and stages its way
    out; nothing of it is written after the suspension (the run is no longer this
    worker's), so the parent stays suspended, unheld, and the next worker completes it."""
    landed, answered = asyncio.Event(), asyncio.Event()
    async with open_store(shared) as store:
        commit = store.commit

        async def slow_answer(run_id: str, token: int, harvest: Harvest) -> bool:
            cancel = await commit(run_id, token, harvest)
            if harvest.waiting_on:
                landed.set()
                await asyncio.sleep(0.5)  # the worker's grace runs out meanwhile
                answered.set()
            return cancel

        monkeypatch.setattr(store, "commit", slow_answer)
        engine = tr.Engine(store=store)
        job = {"count": 3, "sleep": 0.3}
        parent = await engine.submit(graphs.family, job, queue="parents")
        async with workers(store, 1, concurrency=4, grace=0.05):
            await asyncio.wait_for(landed.wait(), GUARD)
        await asyncio.wait_for(answered.wait(), GUARD)
        await asyncio.sleep(0.2)  # what the writer had left would be written by now
        record = await store.get_run(parent)
        assert record.status in (RunStatus.SUSPENDED, RunStatus.QUEUED)  # not running
        assert record.lease_owner is None
        async with workers(store, 1, concurrency=4):
            result = await engine.wait(parent, timeout=GUARD)
        record = await store.get_run(parent)
    assert result.output == 30
    assert record.recoveries == 0  # never an orphan to adopt


async def test_children_feeding_one_join_wake_their_parent_once_at_the_last(
    shared: str,
) -> None:
    """R4: four child task nodes end one after another into an aggregate; no end but the
    last lets the parent start a node, so it suspends once and is driven again once."""
    async with open_store(shared) as store, workers(store, 2, concurrency=4, graphs=[graphs.fan]):
        engine = tr.Engine(store=store)
        run_id = await engine.submit(graphs.fan, {"n": 1, "stagger": 0.3}, queue="parents")
        result = await engine.wait(run_id, timeout=GUARD)
        types = [e.type for e in await store.events(run_id)]
        children = await store.list_runs(parent=run_id)
    assert result.output == 40
    assert len(children) == 4 and {c.status for c in children} == {RunStatus.COMPLETED}
    assert types.count("run_suspended") == 1 and types.count("run_resumed") == 1, types


async def test_first_k_over_children_on_a_queue_cancels_the_late_ones(
    shared: str, tmp_path: Path
) -> None:
    sleeps = [0.01] * 7 + [30.0] * 3
    async with open_store(shared) as store, workers(store, 2, concurrency=6):
        engine = tr.Engine(store=store)
        run_id = await engine.submit(
            graphs.family_k, {"count": 10, "sleeps": sleeps}, queue="parents"
        )
        result = await engine.wait(run_id, timeout=GUARD)
        assert result.status is RunStatus.COMPLETED
        assert result.results["each"] == [0, 10, 20, 30, 40, 50, 60]
        await until(
            lambda: _statuses(store, run_id, {RunStatus.COMPLETED: 7, RunStatus.CANCELLED: 3}),
            "the late children to be cancelled",
        )
        children = await store.list_runs(parent=run_id)
    # The seven the map needs go before its extras on a busy fleet.
    priorities = {int(c.run_id.rsplit("/", 1)[1]): c.priority for c in children}
    assert priorities == {i: 1 if i < 7 else 0 for i in range(10)}


async def _statuses(store: RunStore, run_id: str, want: dict[RunStatus, int]) -> bool:
    seen = collections.Counter(c.status for c in await store.list_runs(parent=run_id))
    return dict(seen) == want


async def test_a_failing_child_on_a_queue_fails_its_parent_naming_the_child(shared: str) -> None:
    async with open_store(shared) as store, workers(store, 2, concurrency=4):
        engine = tr.Engine(store=store)
        run_id = await engine.submit(graphs.family, {"count": 3, "fail": [1]}, queue="parents")
        with pytest.raises(tr.RunFailed) as failed:
            await engine.wait(run_id, timeout=GUARD)
    assert f"{run_id}/each/1/1" in str(failed.value)  # R3: RunFailed names the child
    assert "kid 1 broke" in str(failed.value)


async def test_cancelling_a_parent_cancels_children_queued_running_and_suspended(
    shared: str, tmp_path: Path
) -> None:
    """R3: one child waits on a person (suspended), one runs, others wait in the queue."""
    async with open_store(shared) as store:
        engine = tr.Engine(store=store)
        run_id = await engine.submit(graphs.mixed, {"count": 4, "sleep": 60.0}, queue="parents")
        async with (
            workers(store, 1, queues=("parents", "asks"), concurrency=4),
            workers(store, 1, queues=("kids",), concurrency=2),  # two kids run, two wait
        ):
            await until(lambda: _has_children(store, run_id, 5), "the children to be submitted")
            await until(
                lambda: _child_statuses(store, run_id, RunStatus.SUSPENDED, RunStatus.RUNNING),
                "a child suspended on its gate and one running",
            )
            before = {c.run_id: c.status for c in await store.list_runs(parent=run_id)}
            assert RunStatus.QUEUED in before.values()
            await engine.cancel(run_id)
            await until(lambda: _all_cancelled(store, run_id), "parent and children cancelled")
        questions = await store.list_questions(status=QuestionStatus.OPEN)
    assert questions == []  # the suspended child's question was superseded


async def _has_children(store: RunStore, run_id: str, n: int) -> bool:
    return len(await store.list_runs(parent=run_id)) >= n


async def _child_statuses(store: RunStore, run_id: str, *wanted: RunStatus) -> bool:
    statuses = {c.status for c in await store.list_runs(parent=run_id)}
    return all(s in statuses for s in wanted)


async def _all_cancelled(store: RunStore, run_id: str) -> bool:
    runs = [await store.get_run(run_id), *await store.list_runs(parent=run_id)]
    return all(r.status is RunStatus.CANCELLED for r in runs)


async def test_a_childs_question_is_listed_for_its_parent_and_answering_finishes_both(
    shared: str,
) -> None:
    """R5 across the fleet: answering the child resumes it, then its parent is queued again."""
    async with open_store(shared) as store, workers(store, 2, concurrency=4):
        engine = tr.Engine(store=store)
        run_id = await engine.submit(graphs.mixed, {"count": 2}, queue="parents")
        parked = await engine.wait(run_id, timeout=GUARD)
        assert parked.status is RunStatus.SUSPENDED
        assert [q.run_id for q in parked.questions] == [f"{run_id}/ask/1"]
        await engine.answer(parked.questions[0].question_id, "yes", resume=False)
        result = await engine.wait(run_id, timeout=GUARD)
    assert result.status is RunStatus.COMPLETED
    assert result.results["ask"] == "done yes"


def _rolling(old: bool) -> tr.Graph:
    """A parent whose map's children go to ``kids``, as the previous deploy had it (``old``:
    its kid has one more node) or the new one. Made here, so no worker imports either by
    reference: a worker drives only the version it was given."""
    kid = tr.Graph("rolling_kid")
    kid.add_node("work", graphs.work)
    if old:
        kid.add_node("extra", lambda n: n)
        kid.add_edge("work", "extra")
    parent = tr.Graph("rolling")
    parent.add_node("plan", graphs.jobs)
    parent.add_node("each", kid, "map", queue="kids")
    parent.add_edge("plan", "each")
    return parent


@contextlib.asynccontextmanager
async def _deploys(
    store: RunStore, new: tr.Graph
) -> AsyncIterator[tuple[tr.Worker, tr.Worker, asyncio.Event, asyncio.Event]]:
    """A worker of the new deploy on ``kids`` whose one slot a run holds until ``release``
    is set, and a worker of the previous deploy on ``kids`` with slots free: it claims the
    children first. ``stop_new`` stops the new one."""
    release, stop_new, stop_old = asyncio.Event(), asyncio.Event(), asyncio.Event()
    blocker = tr.Graph("blocker")

    @blocker.task()
    async def hold(_: Any) -> int:
        await release.wait()
        return 0

    new_worker = tr.Worker(
        store, queues=["kids"], concurrency=1, graphs=[new, blocker], heartbeat=0.2,
        take_children=False, grace=0.2,
    )  # fmt: skip
    old_worker = tr.Worker(
        store, queues=["kids"], concurrency=8, graphs=[_rolling(old=True)], heartbeat=0.2
    )
    running = [asyncio.create_task(new_worker.run(stop_new))]
    try:
        held = await tr.Engine(store=store).submit(blocker, None, queue="kids")
        await until(
            lambda: _status_is(store, held, RunStatus.RUNNING), "the new worker's slot held"
        )
        running.append(asyncio.create_task(old_worker.run(stop_old)))
        yield new_worker, old_worker, release, stop_new
    finally:
        release.set()
        stop_new.set()
        stop_old.set()
        await asyncio.wait_for(asyncio.gather(*running), GUARD)


async def _status_is(store: RunStore, run_id: str, status: RunStatus) -> bool:
    return (await store.get_run(run_id)).status is status


async def _statuses_of(store: RunStore, parents: list[str]) -> collections.Counter[RunStatus]:
    counts: collections.Counter[RunStatus] = collections.Counter()
    for parent in parents:
        counts.update(c.status for c in await store.list_runs(parent=parent))
    return counts


async def test_a_worker_of_the_previous_deploy_hands_children_back_to_one_that_can_drive_them(
    shared: str,
) -> None:
    """R3 in a rolling deploy: a worker of the previous deploy (its kid has one more node)
    claims children it cannot drive while the new deploy's worker is busy. It hands them
    back, since a live worker of ``kids`` registered their version, and claims no more;
    the new worker drives every one, and all 10 parents complete."""
    new = _rolling(old=False)
    async with open_store(shared) as store, _deploys(store, new) as (_, old, release, _stop):
        engine = tr.Engine(store=store)
        parents = [f"rolling-{n}" for n in range(10)]
        runs = [
            asyncio.create_task(engine.run(new, {"count": 3}, run_id=run_id)) for run_id in parents
        ]
        await until(
            lambda: _same(_statuses_of(store, parents), {RunStatus.QUEUED: 30}),
            "every child queued",
        )
        await until(lambda: old.stats.claimed >= 1, "the old worker to claim a child")
        await until(
            lambda: _same(_statuses_of(store, parents), {RunStatus.QUEUED: 30}),
            "what it claimed handed back",
        )
        release.set()
        results = await asyncio.wait_for(asyncio.gather(*runs), GUARD)
        statuses = await _statuses_of(store, parents)
    assert [r.output for r in results] == [[0, 10, 20]] * 10
    assert statuses == {RunStatus.COMPLETED: 30}
    assert old.stats.failed == 0 and old.stats.completed == 0


async def test_children_handed_back_fail_once_no_live_worker_can_drive_them(
    shared: str,
) -> None:
    """R3: the old deploy's worker handed the children back to the new deploy's, which then
    stops before driving them. No live worker of ``kids`` can drive them any more: the old
    worker claims them again and fails them, naming the graph and the queue, and each
    parent fails with its child (never waits on a queue nobody can serve)."""
    new = _rolling(old=False)
    async with open_store(shared) as store, _deploys(store, new) as (_, old, _release, stop):
        engine = tr.Engine(store=store)
        run = asyncio.create_task(engine.run(new, {"count": 2}, run_id="orphaned"))
        await until(lambda: old.stats.claimed >= 1, "the old worker to claim a child")
        await until(
            lambda: _same(_statuses_of(store, ["orphaned"]), {RunStatus.QUEUED: 2}),
            "what it claimed handed back",
        )
        stop.set()  # the new deploy's worker leaves (its slot still held): nobody can drive them
        with pytest.raises(tr.RunFailed) as failed:
            await asyncio.wait_for(run, GUARD)
        children = await store.list_runs(parent="orphaned")
    assert {c.status for c in children} <= {RunStatus.FAILED, RunStatus.CANCELLED}
    errors = [c.error or "" for c in children if c.status is RunStatus.FAILED]
    assert errors and all("nor can any other live worker of queue 'kids'" in e for e in errors)
    assert "rolling_kid" in str(failed.value)


async def _same(counts: Any, want: dict[RunStatus, int]) -> bool:
    return dict(await counts) == want


async def test_a_child_graph_no_worker_has_fails_its_parent_and_never_hangs(shared: str) -> None:
    secret = tr.Graph("secret_kid")  # defined here: no worker has it, no reference imports it
    secret.add_node("work", lambda job: job)
    parent = tr.Graph("has_secret")
    parent.add_node("sub", secret, queue="kids")
    async with open_store(shared) as store:
        engine = tr.Engine(store=store)
        run_id = await engine.submit(parent, 1, queue="parents")
        parents = [tr.Worker(store, queues=["parents"], graphs=[parent], heartbeat=0.2)]
        kids = [tr.Worker(store, queues=["kids"], graphs=[graphs.family], heartbeat=0.2)]
        stop = asyncio.Event()
        tasks = [asyncio.create_task(w.run(stop)) for w in (*parents, *kids)]
        try:
            # The parents' worker could drive the child: it is not on the child's queue.
            with pytest.raises(tr.RunFailed) as failed:
                await engine.wait(run_id, timeout=GUARD)
        finally:
            stop.set()
            await asyncio.gather(*tasks)
        child = await store.get_run(f"{run_id}/sub/1")
    assert child.status is RunStatus.FAILED
    assert child.error is not None and "cannot drive graph 'secret_kid'" in child.error
    assert "secret_kid" in str(failed.value)


async def test_a_deadline_cancels_a_suspended_parent_and_its_queued_children(shared: str) -> None:
    """R6: nobody drives a suspended parent; a worker's sweep cancels it at its deadline."""
    async with open_store(shared) as store:
        engine = tr.Engine(store=store)
        run_id = await engine.submit(
            graphs.family, {"count": 3, "sleep": 60.0}, queue="parents",
            deadline=datetime.timedelta(seconds=1.5),
        )  # fmt: skip
        async with workers(store, 1, queues=("parents",)):  # nobody serves "kids"
            await until(lambda: _has_children(store, run_id, 3), "the children to be queued")
            await until(lambda: _all_cancelled(store, run_id), "the deadline to cancel them")
        record = await store.get_run(run_id)
    assert record.deadline is not None


# --- processes killed for real ---------------------------------------------------------------


def _env(side: Path, **extra: str) -> dict[str, str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("TAILRACE_")}
    environ.update({graphs.SIDE_ENV: str(side), "PYTHONPATH": str(ROOT / "src"), **extra})
    return environ


def _worker(
    procs: fixtures.Procs, url: str, side: Path, *queues: str, **env: str
) -> subprocess.Popen[bytes]:
    """A ``tailrace worker`` process with this folder's child graphs, serving ``queues``."""
    return procs.worker(url, str(GRAPHS), *queues, env=_env(side, **env))


procs = fixtures.procs


PARENT_SCRIPT = """
import asyncio, sys
sys.path.insert(0, {root!r})
import tailrace as tr
from tailrace.stores import open_store
from tests import fixtures
graphs = fixtures.load_module("child_graphs", {graphs!r})

async def main():
    async with open_store({url!r}) as store:
        waiting = tr.Graph("waits_here")  # not on a queue: it waits in this process
        waiting.add_node("plan", graphs.jobs)
        waiting.add_node("each", graphs.kid, "map", queue="kids")
        waiting.add_edge("plan", "each")
        await tr.Engine(store=store, lease_ttl=2.0).run(
            waiting, {{"count": 4, "sleep": 1.5}}, run_id="killed-parent")

asyncio.run(main())
"""


@pytest.mark.slow
async def test_sigkill_of_the_parents_process_leaves_its_children_running_and_it_reattaches(
    shared: str, tmp_path: Path, procs: fixtures.Procs
) -> None:
    side = tmp_path / "side.log"
    script = PARENT_SCRIPT.format(root=str(ROOT), graphs=str(GRAPHS), url=shared)
    parent = procs.start([sys.executable, "-c", script], _env(side))
    _worker(procs, shared, side, "kids")
    async with open_store(shared) as store:
        await until(lambda: _has_children(store, "killed-parent", 4), "the children to start")
        await until(lambda: len(side_starts(side)) == 4, "every child's work to start")
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        # The children run on; a fresh engine adopts the parent, re-attaching to them (R2).
        waiting = tr.Graph("waits_here")
        waiting.add_node("plan", graphs.jobs)
        waiting.add_node("each", graphs.kid, "map", queue="kids")
        waiting.add_edge("plan", "each")
        result = await asyncio.wait_for(
            tr.Engine(store=store).resume("killed-parent", waiting), GUARD
        )
        children = await store.list_runs(parent="killed-parent")
    assert result.output == [0, 10, 20, 30]
    assert len(children) == 4 and {c.status for c in children} == {RunStatus.COMPLETED}
    assert set(side_starts(side).values()) == {1}  # no child ran twice, none was resubmitted


@pytest.mark.slow
async def test_sigkill_of_a_worker_holding_a_parent_and_the_children_it_took(
    shared: str, tmp_path: Path, procs: fixtures.Procs
) -> None:
    """R2/R4: the worker that drove a parent claimed its children as it submitted them, and
    is SIGKILLed while they run. Another worker adopts the children (each child's work runs
    again once, no child is submitted twice), and the parent, woken by the last, completes."""
    side = tmp_path / "side.log"
    async with open_store(shared) as store:
        engine = tr.Engine(store=store)
        run_id = await engine.submit(graphs.family, {"count": 3, "sleep": 0.5}, queue="parents")
        doomed = _worker(procs, shared, side, "parents", "kids", TAILRACE_TEST_KID_SLEEP="3600")
        await until(lambda: len(side_starts(side)) == 3, "the doomed worker to run every child")
        children = await store.list_runs(parent=run_id)
        holder = await _owner_of(store, run_id)
        assert {c.lease_owner for c in children} == {holder}  # taken by the parent's worker
        doomed.send_signal(signal.SIGKILL)
        doomed.wait()  # reaped: provably dead, what it held is adopted at once
        _worker(procs, shared, side, "parents", "kids")
        result = await engine.wait(run_id, timeout=GUARD)
        children = await store.list_runs(parent=run_id)
    assert result.output == 30
    assert len(children) == 3 and {c.status for c in children} == {RunStatus.COMPLETED}
    starts = side_starts(side)
    assert len(starts) == 3 and set(starts.values()) == {2}  # the killed try and the adopter's


@pytest.mark.slow
async def test_sigkill_of_the_worker_driving_an_inline_child_on_a_queue(
    shared: str, tmp_path: Path, procs: fixtures.Procs
) -> None:
    """R2/R4: the worker driving a parent and its inline child (stored on the parent's queue,
    working beside its queued grandchild) is SIGKILLed. Another worker of the queue adopts
    both; the inline child's work runs again, its grandchild is re-attached to (never
    submitted twice), and the parent completes."""
    side = tmp_path / "side.log"
    async with open_store(shared) as store:
        engine = tr.Engine(store=store)
        run_id = await engine.submit(graphs.inline_slow, {"n": 3, "sleep": 0.2}, queue="parents")
        inline, grandchild = f"{run_id}/child/1", f"{run_id}/child/1/grandchild/1"
        doomed = _worker(procs, shared, side, "parents", TAILRACE_TEST_KID_SLEEP="3600")
        await until(lambda: side_starts(side)[inline] == 1, "the inline child's work to start")
        await until(lambda: _has_children(store, inline, 1), "the grandchild to be queued")
        assert (await store.get_run(inline)).queue_name == "parents"
        doomed.send_signal(signal.SIGKILL)
        doomed.wait()  # reaped: provably dead, what it held is adopted at once
        _worker(procs, shared, side, "parents")
        _worker(procs, shared, side, "kids")
        result = await engine.wait(run_id, timeout=GUARD)
        runs = [await store.get_run(inline), await store.get_run(grandchild)]
    assert result.output == {"grandchild": 30, "slow": 30}
    assert {r.status for r in runs} == {RunStatus.COMPLETED}
    starts = side_starts(side)
    assert (starts[inline], starts[grandchild]) == (2, 1)  # killed and adopted; once


@pytest.mark.slow
async def test_sigkill_of_a_worker_driving_a_child_hands_it_to_another(
    shared: str, tmp_path: Path, procs: fixtures.Procs
) -> None:
    side = tmp_path / "side.log"
    async with open_store(shared) as store:
        engine = tr.Engine(store=store)
        run_id = await engine.submit(graphs.family, {"count": 3, "sleep": 0.5}, queue="parents")
        doomed = _worker(procs, shared, side, "kids", TAILRACE_TEST_KID_SLEEP="3600")
        _worker(procs, shared, side, "parents")
        await until(lambda: len(side_starts(side)) == 3, "the doomed worker to run every child")
        doomed.send_signal(signal.SIGKILL)
        doomed.wait()  # reaped: provably dead, its children are adopted at once
        _worker(procs, shared, side, "kids")
        result = await engine.wait(run_id, timeout=GUARD)
    assert result.output == 30
    starts = side_starts(side)
    assert set(starts.values()) == {2}  # each child's work: the killed try and the adopter's
    assert len(starts) == 3
