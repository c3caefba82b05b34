"""Cancelled store calls either did not happen or happened completely (issue 9, finding 4).

The contract part runs against every backend: 40 ``acquire_lease`` calls
cancelled at seeded random moments leave no lease held, and cancelled commits
are all-or-nothing with the store still usable. The SQLite part pins down the
writer thread's protocol deterministically, by parking the writer inside a
request of our own (a test back door through ``SQLiteStore._write``): a
request cancelled before the writer claimed it is skipped; one cancelled while
its group runs is committed, and ``acquire_lease`` then releases the lease it
granted before ``CancelledError`` reaches the caller.
"""

from __future__ import annotations

import asyncio
import datetime
import random
import sqlite3
import threading
from collections import Counter
from collections.abc import Awaitable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import pytest

from tailrace.stores import (
    Claim,
    Harvest,
    NewRun,
    Queue,
    ResultRow,
    RunStatus,
    ScheduleRow,
    SQLiteStore,
    Submission,
)

if TYPE_CHECKING:
    from tests.fixtures import Backend

T = TypeVar("T")
TTL = 30.0
ROUNDS = 40


def new_run(run_id: str) -> NewRun:
    return NewRun(
        run_id=run_id, graph_name="g", graph_ref=None, fingerprint="fp", input_json="null",
        created_at=1.0,
    )  # fmt: skip


async def cancel_at_random(rng: random.Random, call: Awaitable[T]) -> T | None:
    """Run ``call`` as a task, cancel it after 0-40 loop iterations; its result if it finished first.

    A fifth of the calls are cancelled before they start; the rest at any
    point of their life, the writer thread running alongside.
    """
    task = asyncio.ensure_future(call)
    for _ in range(max(0, rng.randrange(-10, 40))):  # yields, not sleeps: the moment varies
        await asyncio.sleep(0)
    task.cancel()
    try:
        return await task
    except asyncio.CancelledError:
        return None


async def held_leases(backend: Backend, run_ids: list[str]) -> dict[str, str]:
    """Runs whose lease is held, read back through a fresh store on the same database."""
    if backend.sibling is None:
        records = [await backend.store.get_run(r) for r in run_ids]
    else:
        async with backend.sibling() as fresh:
            records = [await fresh.get_run(r) for r in run_ids]
    return {r.run_id: r.lease_owner for r in records if r.lease_owner is not None}


@pytest.mark.parametrize("seed", [1, 2])
async def test_cancelled_lease_acquisitions_leave_no_lease_behind(
    backend: Backend, seed: int
) -> None:
    store, rng = backend.store, random.Random(seed)
    run_ids = [f"run-{i}" for i in range(ROUNDS)]
    cancelled = 0
    for run_id in run_ids:
        await store.create_run(new_run(run_id))
        token = await cancel_at_random(rng, store.acquire_lease(run_id, "engine", TTL))
        if token is None:
            cancelled += 1
        else:  # it finished before the cancel: ours to release, like any lease
            await store.release_lease(run_id, "engine", token)
    assert cancelled > 0
    assert await held_leases(backend, run_ids) == {}
    for run_id in run_ids:  # and nothing is stuck: every run can be leased again
        await store.acquire_lease(run_id, "other", TTL)


async def test_cancelled_commits_are_all_or_nothing(backend: Backend) -> None:
    store, rng = backend.store, random.Random(7)
    await store.create_run(new_run("r1"))
    token = await store.acquire_lease("r1", "engine", TTL)
    finished = 0
    for visit in range(1, ROUNDS + 1):
        harvest = Harvest(
            state_json=f'{{"visit":{visit}}}', nodes_done_delta=1,
            results=(ResultRow(node_id="n", visit=visit, value_json="1"),),
        )  # fmt: skip
        if await cancel_at_random(rng, store.commit("r1", token, harvest)) is None:
            continue
        finished += 1
    await store.commit("r1", token, Harvest(state_json='{"after":true}'))  # still usable
    record, results = await store.get_run("r1"), await store.results("r1")
    assert record.nodes_done == len(results)  # each harvest landed whole or not at all
    assert finished <= record.nodes_done <= ROUNDS
    assert record.state_json == '{"after":true}'


async def test_cancelled_claims_keep_partition_limits_and_lose_no_run(backend: Backend) -> None:
    """Claims cancelled at random moments on a partitioned queue (W2): a partition never
    has more live runs than its limit, and a run whose claim was cancelled is either
    still queued or free to adopt at once (no lease held by the claimer that gave up)."""
    store, rng = backend.store, random.Random(11)
    await store.declare_queue(Queue("q", partition_concurrency=2))
    for n in range(ROUNDS):
        await store.submit_run(new_run(f"r{n:02}"), Submission(queue="q", partition=f"p{n % 4}"))
    handed: list[str] = []
    for _ in range(ROUNDS):
        got = await cancel_at_random(rng, store.claim_runs("q", "w", TTL, limit=3))
        for run_id in got or []:
            handed.append(run_id)
            token = (await store.get_run(run_id)).lease_token
            done = Harvest(state_json="{}", status=RunStatus.COMPLETED, finished_at=2.0)
            await store.commit(run_id, token, done)
            await store.release_lease(run_id, "w", token)
        runs = await store.list_runs(queue="q", limit=100)
        live = Counter(r.partition_key for r in runs if r.status is RunStatus.RUNNING)
        assert max(live.values(), default=0) <= 2
    assert len(handed) == len(set(handed))  # no run handed out twice
    runs = await store.list_runs(queue="q", limit=100)
    stranded = {r.run_id for r in runs if r.status is RunStatus.RUNNING}
    assert all(r.lease_owner is None for r in runs if r.run_id in stranded)
    assert stranded <= set(await store.expired_leases(backend.clock(), limit=100))


async def test_cancelled_submit_and_claims_store_whole_and_strand_no_lease(
    backend: Backend,
) -> None:
    """Child submits that claim in the same write (R4), cancelled at random moments: each
    batch is stored whole or not at all, a run the cancelled call claimed is not left
    leased to it (adopted at once), and no run is handed out twice."""
    store, rng = backend.store, random.Random(13)
    handed: list[str] = []
    submitted: list[list[str]] = []
    for n in range(ROUNDS):
        batch = [f"p/{n:02}/{k}" for k in range(3)]
        submitted.append(batch)
        rows = [(new_run(r), Submission(queue="q")) for r in batch]
        claim = Claim(queue="q", owner="w", ttl=TTL, limit=2)
        call = store.submit_and_claim(rows, claim)
        got = await (call if n % 4 == 0 else cancel_at_random(rng, call))  # some end
        if got is not None:
            handed.extend(got[1])
    assert len(handed) == len(set(handed))  # no run handed out twice
    runs = {r.run_id: r for r in await store.list_runs(queue="q", limit=1000)}
    for batch in submitted:  # whole or not at all
        assert all(r in runs for r in batch) or not any(r in runs for r in batch)
    assert handed and len(runs) > len(handed)
    for run_id, record in runs.items():
        if run_id in handed:
            assert (record.status, record.lease_owner) == (RunStatus.RUNNING, "w")
        elif record.status is RunStatus.RUNNING:  # claimed by a call that gave up
            assert record.lease_owner is None
    again = await store.claim_runs("q", "w2", TTL, limit=1000)
    assert not set(again) & set(handed)


async def test_cancelled_pauses_and_resumes_leave_a_usable_queue(backend: Backend) -> None:
    store, rng = backend.store, random.Random(5)
    for n in range(ROUNDS):
        call = store.pause_queue("q") if n % 2 == 0 else store.resume_queue("q")
        await cancel_at_random(rng, call)
    await store.pause_queue("q")
    stats = {s.name: s for s in await store.queue_stats(backend.clock())}
    assert stats["q"].paused
    assert await store.resume_queue("q") is True
    assert await store.delete_queue("q") is True
    assert await store.queues() == []


async def test_a_cancelled_tick_is_submitted_whole_or_not_at_all(backend: Backend) -> None:
    """``fire_schedule`` cancelled at random moments (W4): the schedule's last tick moved
    exactly when its run was stored, and the schedule goes on."""
    store, rng = backend.store, random.Random(3)
    row = ScheduleRow(
        name="s", cron="* * * * *", graph_name="g", graph_ref=None, fingerprint="fp",
        input_json="null", queue="q", declared_at=0.0,
    )  # fmt: skip
    await store.declare_schedule(row)
    cancelled = 0
    for n in range(1, ROUNDS + 1):
        tick = 60.0 * n
        if await cancel_at_random(rng, store.fire_schedule("s", tick)) is None:
            cancelled += 1
            await store.pause_queue("barrier")  # a write after it: what landed is in
            (now,) = await store.schedules()
            stored = {r.run_id for r in await store.list_runs(queue="q", limit=100)}
            assert (now.last_tick == tick) == any(r.endswith(_stamp(tick)) for r in stored)
    assert cancelled > 0
    assert await store.fire_schedule("s", 60.0 * (ROUNDS + 1)) is not None  # still usable


def _stamp(tick: float) -> str:
    return datetime.datetime.fromtimestamp(tick, datetime.UTC).strftime("%H:%MZ")


# --- SQLite: the writer thread's protocol, step by step ---------------------------------------


class Parked:
    """A request that holds the SQLite writer thread until released."""

    def __init__(self, store: SQLiteStore) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.task = asyncio.ensure_future(store._write("test: parked", self._hold))

    def _hold(self, conn: sqlite3.Connection) -> None:
        self.entered.set()
        assert self.release.wait(timeout=120), "the test never released the writer"

    async def wait_entered(self) -> None:
        assert await asyncio.to_thread(self.entered.wait, 120)

    async def finish(self) -> None:
        self.release.set()
        await self.task


def lease_of(path: Path, run_id: str) -> tuple[str | None, int]:
    """``(lease_owner, lease_token)`` of ``run_id``, read straight from the file."""
    with sqlite3.connect(path) as conn:
        row = conn.execute(
            "SELECT lease_owner, lease_token FROM runs WHERE run_id = ?", (run_id,)
        ).fetchone()
    conn.close()
    return row[0], row[1]


@pytest.fixture
async def sqlite_store(tmp_path: Path) -> SQLiteStore:
    store = SQLiteStore(tmp_path / "runs.db")
    await store.open()
    await store.create_run(new_run("r1"))
    yield store  # type: ignore[misc]
    await store.close()


async def test_a_lease_request_cancelled_before_it_is_claimed_never_happens(
    sqlite_store: SQLiteStore, tmp_path: Path
) -> None:
    parked = Parked(sqlite_store)
    await parked.wait_entered()
    acquiring = asyncio.ensure_future(sqlite_store.acquire_lease("r1", "engine", TTL))
    await asyncio.sleep(0)  # one loop turn: the task queues its request and waits
    acquiring.cancel()
    with pytest.raises(asyncio.CancelledError):
        await acquiring
    await parked.finish()
    await sqlite_store.release_lease("r1", "nobody", 0)  # a write after it: the queue is drained
    assert lease_of(tmp_path / "runs.db", "r1") == (None, 0)  # token 0: it never ran


async def test_a_lease_request_cancelled_while_it_runs_is_released(
    sqlite_store: SQLiteStore, tmp_path: Path
) -> None:
    first = Parked(sqlite_store)
    await first.wait_entered()
    second = Parked(sqlite_store)  # queued behind the first, with the lease request
    acquiring = asyncio.ensure_future(sqlite_store.acquire_lease("r1", "engine", TTL))
    await asyncio.sleep(0)
    first.release.set()
    await second.wait_entered()  # the writer claimed the group [second, acquire]
    acquiring.cancel()
    for _ in range(10):
        await asyncio.sleep(0)
    assert not acquiring.done()  # it waits for its claimed write, to undo it
    await second.finish()
    with pytest.raises(asyncio.CancelledError):
        await acquiring
    await first.task
    assert lease_of(tmp_path / "runs.db", "r1") == (None, 1)  # granted (token 1), then released


async def test_a_cancelled_renewal_keeps_the_lease_the_caller_held(
    sqlite_store: SQLiteStore, tmp_path: Path
) -> None:
    token = await sqlite_store.acquire_lease("r1", "engine", TTL)
    first = Parked(sqlite_store)
    await first.wait_entered()
    second = Parked(sqlite_store)
    renewing = asyncio.ensure_future(sqlite_store.acquire_lease("r1", "engine", TTL))
    await asyncio.sleep(0)
    first.release.set()
    await second.wait_entered()
    renewing.cancel()
    await second.finish()
    with pytest.raises(asyncio.CancelledError):
        await renewing
    await first.task
    assert lease_of(tmp_path / "runs.db", "r1") == ("engine", token)


async def test_a_cancelled_close_still_closes(tmp_path: Path) -> None:
    def writers() -> int:
        return sum(t.name == "tailrace-sqlite-writer" for t in threading.enumerate())

    before = writers()
    store = SQLiteStore(tmp_path / "runs.db")
    await store.open()
    await store.create_run(new_run("r1"))
    closing = asyncio.ensure_future(store.close())
    await asyncio.sleep(0)
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    assert writers() == before
    async with SQLiteStore(tmp_path / "runs.db") as again:
        assert (await again.get_run("r1")).run_id == "r1"


async def test_cancelled_reads_leave_the_readers_working(backend: Backend) -> None:
    store, rng = backend.store, random.Random(3)
    await store.create_run(new_run("r1"))
    for _ in range(ROUNDS):
        await cancel_at_random(rng, store.load_run("r1"))
    assert (await store.load_run("r1")).run.run_id == "r1"
