"""Queues, workers, submit/wait/cancel in one process, on every store (issue 10).

Each test runs real :class:`~tailrace.Worker` objects on real stores (a SQLite
file, a Postgres schema, memory); engines and workers use store instances of
their own on one database, as processes would. Waits poll observed state
under a hang guard; nothing asserts on time.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tailrace import Engine, Schedule
from tailrace._codec import DEFAULT_CODEC
from tailrace._errors import GraphError, NotResumable, StoreError
from tailrace.core import stretches_of
from tailrace.core._queued import estimates_of
from tailrace.stores import ChangeFeed, NewRun, QuestionStatus, Queue, RunStatus, RunStore
from tailrace.workers import DuplicateRun, RunFailed, Worker
from tailrace.workers._schedules import ScheduleTicker
from tests import fixtures

graphs = fixtures.load_module("fleet_graphs", Path(__file__).with_name("fleet_graphs.py"))
until = fixtures.until
UTC = datetime.UTC


@pytest.fixture(params=fixtures.ALL_STORES)
async def db(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[fixtures.Database]:
    graphs.reset()
    async with fixtures.database(
        request.param, tmp_path, cls=fixtures.Database, filename="fleet.db", max_size=4
    ) as database:
        yield database


@contextlib.asynccontextmanager
async def working(worker: Worker) -> AsyncIterator[Worker]:
    """``worker`` running in the background; stopped (drained) on the way out."""
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        yield worker
    finally:
        stop.set()
        await task


async def engine_on(db: fixtures.Database) -> Engine:
    return Engine(store=await db.store())


async def worker_on(db: fixtures.Database, **options: object) -> Worker:
    options.setdefault("graphs", [graphs.chain, graphs.failing, graphs.gated, graphs.held])
    options.setdefault("poll_interval", 0.2)
    return Worker(await db.store(), **options)  # type: ignore[arg-type]


# --- submit and wait -----------------------------------------------------------------------


async def test_a_worker_runs_what_was_submitted_and_anyone_waits_for_it(
    db: fixtures.Database,
) -> None:
    submitter, waiter = await engine_on(db), await engine_on(db)
    run_id = await submitter.submit(graphs.chain, 20, queue="default")
    assert (await (await db.store()).get_run(run_id)).status is RunStatus.QUEUED
    async with working(await worker_on(db)):
        result = await waiter.wait(run_id, timeout=fixtures.HANG_GUARD)
    expected = await Engine().run(graphs.chain, 20)
    assert (result.status, result.output, result.results) == (
        "completed", expected.output, expected.results,
    )  # fmt: skip
    events = [e.type for e in await (await db.store()).events(run_id)]
    assert events[0] == "run_started" and events[-1] == "run_completed"


async def test_a_live_dedup_key_returns_its_run_or_raises(db: fixtures.Database) -> None:
    engine = await engine_on(db)
    first = await engine.submit(graphs.chain, 1, dedup_key="order-7")
    assert await engine.submit(graphs.chain, 2, dedup_key="order-7") == first
    with pytest.raises(DuplicateRun, match="order-7") as info:
        await engine.submit(graphs.chain, 3, dedup_key="order-7", on_duplicate="raise")
    assert info.value.run_id == first
    assert len(await (await db.store()).list_runs(queue="default")) == 1


async def test_a_failed_run_raises_its_stored_error_to_the_waiter(db: fixtures.Database) -> None:
    engine = await engine_on(db)
    run_id = await engine.submit(graphs.failing, 3)
    async with working(await worker_on(db)) as worker:
        with pytest.raises(RunFailed, match="bad input 3") as info:
            await engine.wait(run_id, timeout=fixtures.HANG_GUARD)
    assert info.value.result.status == "failed"
    assert worker.stats.failed == 1


async def test_waiting_for_a_run_nobody_works_on_times_out_naming_it(
    db: fixtures.Database,
) -> None:
    engine = await engine_on(db)
    run_id = await engine.submit(graphs.chain, 1, run_id="lonely")
    with pytest.raises(TimeoutError, match="'lonely' is still queued"):
        await engine.wait(run_id, timeout=0.05)


# --- cancel ----------------------------------------------------------------------------------


async def test_a_queued_run_cancelled_is_never_started(db: fixtures.Database) -> None:
    engine = await engine_on(db)
    doomed = await engine.submit(graphs.chain, 1)
    assert await engine.cancel(doomed) == "cancelled"
    later = await engine.submit(graphs.chain, 2)
    async with working(await worker_on(db)):
        await engine.wait(later, timeout=fixtures.HANG_GUARD)  # the worker went past it
    result = await engine.wait(doomed)
    assert (result.status, result.results) == ("cancelled", {})
    assert await (await db.store()).events(doomed) == []


async def test_a_running_run_is_cancelled_at_its_next_harvest_by_its_worker(
    db: fixtures.Database,
) -> None:
    engine = await engine_on(db)
    run_id = await engine.submit(graphs.held, 5)
    async with working(await worker_on(db)):
        await until(graphs.HOLD["started"].is_set, "the held handler to start")
        # Another engine (not the driver) asks; the worker's engine ends it (it may
        # have done so already when the answer comes back).
        assert await (await engine_on(db)).cancel(run_id) in ("running", "cancelled")
        result = await engine.wait(run_id, timeout=fixtures.HANG_GUARD)
    assert result.status == "cancelled"
    assert graphs.SEEN["cancelled"] == [run_id]  # the in-flight handler was cancelled
    events = await (await db.store()).events(run_id)
    assert [e.type for e in events][-2:] == ["node_cancelled", "run_cancelled"]
    assert result.nodes["hold"].status == "cancelled"
    assert await (await db.store()).results(run_id, "hold") == []  # nothing committed after


async def test_a_run_driven_by_a_plain_engine_run_hears_a_cancel_from_another_engine(
    db: fixtures.Database,
) -> None:
    # No worker: engine.run drives it, and another engine (another process, as far
    # as the store can tell) asks; the driver hears it at a lease heartbeat.
    driver = Engine(
        store=await db.store(), lease_ttl=3.0
    )  # long enough that a busy machine never lets it lapse
    running = asyncio.create_task(driver.run(graphs.held, 5, run_id="plain"))
    try:
        await until(graphs.HOLD["started"].is_set, "the held handler to start")
        # Not theirs to end: "running", or already "cancelled" when the driver heard the
        # request at a commit of its own between the request and the status read.
        assert await (await engine_on(db)).cancel("plain") in ("running", "cancelled")
        async with asyncio.timeout(fixtures.HANG_GUARD):
            result = await running
    finally:
        running.cancel()
    assert (result.status, result.nodes["hold"].status) == ("cancelled", "cancelled")
    assert graphs.SEEN["cancelled"] == ["plain"]  # the in-flight handler was cancelled
    stored = await db.store()
    assert (await stored.get_run("plain")).status is RunStatus.CANCELLED
    assert [e.type for e in await stored.events("plain")][-1] == "run_cancelled"


async def test_a_suspended_run_is_cancelled_at_once_and_its_question_superseded(
    db: fixtures.Database,
) -> None:
    engine = await engine_on(db)
    run_id = await engine.submit(graphs.gated, "deploy?")
    async with working(await worker_on(db)):
        suspended = await engine.wait(run_id, timeout=fixtures.HANG_GUARD)
    (question,) = suspended.questions
    assert await engine.cancel(run_id) == "cancelled"
    store = await db.store()
    assert (await store.get_question(question.question_id)).status is QuestionStatus.SUPERSEDED
    assert [e.type for e in await store.events(run_id)][-1] == "run_cancelled"


# --- answers ----------------------------------------------------------------------------------


async def test_an_answer_recorded_elsewhere_is_applied_by_a_worker(db: fixtures.Database) -> None:
    engine = await engine_on(db)
    run_id = await engine.submit(graphs.gated, "ship it?")
    async with working(await worker_on(db)) as worker:
        (question,) = (await engine.wait(run_id, timeout=fixtures.HANG_GUARD)).questions
        await (await engine_on(db)).answer(question.question_id, "yes", resume=False)
        await until(
            lambda: _status_is(db, run_id, RunStatus.COMPLETED), "the answered run to complete"
        )
    result = await engine.wait(run_id)
    assert result.output == {"answer": "yes"}
    assert worker.stats.applied == 1
    row = await (await db.store()).get_question(question.question_id)
    assert row.status is QuestionStatus.APPLIED


async def _status_is(db: fixtures.Database, run_id: str, status: RunStatus) -> bool:
    return (await (await db.store()).get_run(run_id)).status is status


# --- limits ------------------------------------------------------------------------------------


async def test_queue_limits_hold_across_workers_and_within_one(db: fixtures.Database) -> None:
    engine = await engine_on(db)
    await engine.store.declare_queue(Queue("q", concurrency=3, worker_concurrency=2))
    ids = [await engine.submit(graphs.held, n, queue="q") for n in range(7)]
    # Named only: each worker keeps the limits declared in the store.
    a = await worker_on(db, queues=["q"], concurrency=4)
    b = await worker_on(db, queues=["q"], concurrency=4)
    async with working(a), working(b):
        await until(lambda: len(graphs.SEEN["starts"]) >= 3, "three held runs")
        store = await db.store()
        running = [r for r in await store.list_runs(queue="q") if r.status is RunStatus.RUNNING]
        owners = [r.lease_owner for r in running]
        assert len(running) == 3
        assert max(owners.count(a.owner), owners.count(b.owner)) == 2  # worker_concurrency
        graphs.HOLD["release"].set()
        for run_id in ids:
            await engine.wait(run_id, timeout=fixtures.HANG_GUARD)
    assert max(graphs.SEEN["peak"]) == 3
    assert a.stats.claimed + b.stats.claimed == 7


async def test_partition_concurrency_holds_across_workers(db: fixtures.Database) -> None:
    engine = await engine_on(db)
    await engine.store.declare_queue(Queue("q", partition_concurrency=2))
    ids = [await engine.submit(graphs.held, n, queue="q", partition="A") for n in range(5)]
    lone = await engine.submit(graphs.chain, 1, queue="q", partition="B")
    a = await worker_on(db, queues=["q"], concurrency=4, poll_interval=0.05)
    b = await worker_on(db, queues=["q"], concurrency=4, poll_interval=0.05)
    async with working(a), working(b):
        await engine.wait(lone, timeout=fixtures.HANG_GUARD)  # B is not held up by A (W2)
        await until(lambda: len(graphs.SEEN["starts"]) >= 2, "two held runs of A")
        rounds = a.stats.rounds + b.stats.rounds
        await until(lambda: a.stats.rounds + b.stats.rounds >= rounds + 6, "more rounds")
        assert len(graphs.SEEN["starts"]) == 2  # the third of A waits for a slot of A
        graphs.HOLD["release"].set()
        for run_id in ids:
            await engine.wait(run_id, timeout=fixtures.HANG_GUARD)
    assert max(graphs.SEEN["peak"]) == 2
    assert sorted(graphs.SEEN["starts"]) == sorted(ids)  # each started once


async def test_a_paused_queue_lets_runs_in_flight_finish_and_starts_none(
    db: fixtures.Database,
) -> None:
    engine = await engine_on(db)
    first = await engine.submit(graphs.held, 1, queue="q")
    worker = await worker_on(db, queues=["q"], poll_interval=0.05)
    async with working(worker):
        await until(lambda: bool(graphs.SEEN["starts"]), "the held run")
        await engine.store.pause_queue("q")
        later = [await engine.submit(graphs.chain, n, queue="q") for n in range(2)]
        graphs.HOLD["release"].set()
        assert (await engine.wait(first, timeout=fixtures.HANG_GUARD)).status == "completed"
        rounds = worker.stats.rounds
        await until(lambda: worker.stats.rounds >= rounds + 6, "rounds while paused")
        store = await db.store()
        assert [(await store.get_run(r)).status for r in later] == [RunStatus.QUEUED] * 2
        assert worker.stats.claimed == 1
        assert await engine.store.resume_queue("q")
        for run_id in later:
            assert (await engine.wait(run_id, timeout=fixtures.HANG_GUARD)).status == "completed"
    assert worker.stats.claimed == 3


async def test_a_delayed_run_starts_no_sooner_than_asked(db: fixtures.Database) -> None:
    engine = await engine_on(db)
    with pytest.raises(ValueError, match="timezone-aware"):
        await engine.submit(graphs.chain, 1, not_before=datetime.datetime(2030, 1, 1))
    with pytest.raises(ValueError, match="not_before"):
        await engine.submit(graphs.chain, 1, not_before=float("nan"))
    soon = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=0.5)
    delayed = await engine.submit(graphs.chain, 1, not_before=soon)
    at_once = await engine.submit(graphs.chain, 2)
    async with working(await worker_on(db, poll_interval=0.05)):
        for run_id in (at_once, delayed):
            await engine.wait(run_id, timeout=fixtures.HANG_GUARD)
    store = await db.store()
    record = await store.get_run(delayed)
    assert record.not_before == soon.timestamp()
    assert record.started_at is not None and record.started_at >= soon.timestamp()


async def test_schedules_submit_each_tick_once_across_workers_and_one_catch_up(
    db: fixtures.Database,
) -> None:
    """W4 through the public API: three workers' tickers race for every tick; after ticks
    were missed (no worker ran), only the latest is submitted."""
    store = await db.store()
    nightly = Schedule(graphs.chain, "*/5 * * * *", 4, name="every5", queue="q")
    # Two days ago by the store's clock: every tick below has come.
    day = datetime.datetime.fromtimestamp(await store.now(), UTC) - datetime.timedelta(days=2)
    at = day.replace(hour=10, minute=7, second=0, microsecond=0)
    start = at.timestamp()
    await store.declare_schedule(nightly.row(DEFAULT_CODEC, start))
    tickers = [ScheduleTicker(await db.store(), refresh=0.0) for _ in range(3)]
    for now in (start, start + 60, start + 200, start + 500):  # 10:07, :08, :10:20, :15:20
        await asyncio.gather(*(t.tick(now) for t in tickers))
    assert sum(t.fired for t in tickers) == 2  # 10:10 and 10:15, once each
    # No worker for an hour: eleven ticks missed, one catch-up run (the latest).
    await asyncio.gather(*(t.tick(start + 500 + 3600) for t in tickers))
    ids = sorted(r.run_id for r in await store.list_runs(queue="q", limit=10))
    stamp = at.strftime("%Y-%m-%d")
    assert ids == [f"every5@{stamp}T10:10Z", f"every5@{stamp}T10:15Z", f"every5@{stamp}T11:15Z"]
    later = ScheduleTicker(store, refresh=600.0)  # the next look: the next tick, 11:20
    assert await later.tick(start + 500 + 3600) == pytest.approx(4 * 60 + 40)
    async with working(await worker_on(db, queues=["q"], schedules=[nightly])):
        results = [await Engine(store=store).wait(r, timeout=fixtures.HANG_GUARD) for r in ids]
        # Its declaration kept the ticks submitted, so its own ticker submits the latest tick
        # by the store's clock: the catch-up of the two days.
        caught_up = await until(lambda: _runs_after(store, ids), "the catch-up of two days")
    assert {r.output for r in results} == {(4 + 1) * 2}
    (row,) = await store.schedules()
    assert row.last_tick is not None and row.last_tick > at.replace(hour=11, minute=15).timestamp()
    assert caught_up == [
        f"every5@{datetime.datetime.fromtimestamp(row.last_tick, UTC):%Y-%m-%dT%H:%MZ}"
    ]


async def _runs_after(store: RunStore, ids: list[str]) -> list[str]:
    return sorted(
        r.run_id for r in await store.list_runs(queue="q", limit=10) if r.run_id not in ids
    )


async def test_a_cancelled_run_continues_where_it_stopped_only_when_asked(
    db: fixtures.Database,
) -> None:
    """W5: ``resume`` refuses a cancelled run; ``resume(cancelled=True)`` re-runs what the
    cancellation stopped and reuses what it committed. W6: the run records both drivers."""
    engine = await engine_on(db)
    store = await db.store()
    run_id = await engine.submit(graphs.held, 5)
    never = await engine.submit(graphs.held, 6, queue="unserved")
    await engine.cancel(never)
    worker = await worker_on(db, poll_interval=0.05)
    async with working(worker):
        await until(lambda: bool(graphs.SEEN["starts"]), "hold to start")
        await engine.cancel(run_id)
        await until(lambda: _status_is(db, run_id, RunStatus.CANCELLED), "the cancel")
    with pytest.raises(NotResumable, match="is cancelled"):
        await engine.resume(run_id, graphs.held)
    with pytest.raises(NotResumable, match="cancelled before it started"):
        await engine.resume(never, graphs.held, cancelled=True)
    graphs.HOLD["release"].set()
    result = await engine.resume(run_id, graphs.held, cancelled=True)
    assert (result.status, result.output) == ("completed", 105)
    events = await store.events(run_id)
    started = [e.node_id for e in events if e.type == "node_started"]
    assert started.count("first") == 1 and started.count("hold") == 2  # first reused
    assert graphs.SEEN["cancelled"] == [run_id]
    record = await store.get_run(run_id)
    assert (record.cancel_requested_at, record.error) == (None, None)
    drivers = stretches_of(events)
    assert [(d.owner, d.how) for d in drivers] == [
        (worker.owner, "started"), (engine.owner, "resumed"),
    ]  # fmt: skip
    assert sum(d.events for d in drivers) == len(events)


async def test_a_reopened_run_whose_driver_died_is_adopted_and_finished(
    db: fixtures.Database,
) -> None:
    """W5 fault: the reopening and the re-queued nodes are one commit, so a driver that
    dies right after it leaves a run any worker adopts and finishes (D3)."""
    engine = await engine_on(db)
    store = await db.store()
    run_id = await engine.submit(graphs.held, 1)
    async with working(await worker_on(db, poll_interval=0.05)):
        await until(lambda: bool(graphs.SEEN["starts"]), "hold to start")
        await engine.cancel(run_id)
        await until(lambda: _status_is(db, run_id, RunStatus.CANCELLED), "the cancel")
    events = await store.events(run_id)
    from tailrace.core._queued import stopped_by_cancel

    assert stopped_by_cancel(events) == ["hold"]
    # A "dead" resumer: it reopened the run with a lease of 0.2 s, then vanished.
    assert await store.reopen_cancelled(run_id, "ghost:1:0:dead", 0.2, nodes=["hold"])
    assert not await store.reopen_cancelled(run_id, "other", 30.0)  # once only
    graphs.HOLD["release"].set()
    async with working(await worker_on(db, poll_interval=0.05)) as adopter:
        result = await engine.wait(run_id, timeout=fixtures.HANG_GUARD)
    assert (result.status, result.output) == ("completed", 101)
    assert adopter.stats.adopted == 1
    assert (await store.get_run(run_id)).recoveries == 1  # taken from the ghost


async def test_a_run_is_submitted_by_a_registered_graph_name_alone(
    db: fixtures.Database,
) -> None:
    submitter = Engine(store=await db.store())  # no graph code at all
    with pytest.raises(GraphError, match="no worker registered a graph named 'fleet_chain'"):
        await submitter.submit("fleet_chain", 3)
    async with working(await worker_on(db, graphs=[graphs.chain])):
        await until(lambda: submitter.store.graphs_named("fleet_chain"), "the registration")
        run_id = await submitter.submit("fleet_chain", 3)
        result = await submitter.wait(run_id, timeout=fixtures.HANG_GUARD)
    record = await submitter.store.get_run(run_id)
    assert (result.status, record.graph_name) == ("completed", "fleet_chain")
    assert record.fingerprint == graphs.chain.compile().fingerprint
    assert (await submitter.store.events(run_id))[-1].type == "run_completed"


async def test_an_lpt_queue_starts_the_longest_estimate_first(db: fixtures.Database) -> None:
    engine = await engine_on(db)
    await (await db.store()).declare_queue(Queue("lpt", order="lpt"))
    estimates = {"short": 1.0, "long": 30.0, "middle": 5.0}
    for run_id, seconds in estimates.items():
        await engine.submit(graphs.chain, 1, queue="lpt", run_id=run_id, estimate=seconds)
    async with working(await worker_on(db, queues=["lpt"], concurrency=1)):
        for run_id in estimates:
            await engine.wait(run_id, timeout=fixtures.HANG_GUARD)
    store = await db.store()
    records = {run_id: await store.get_run(run_id) for run_id in estimates}
    assert sorted(records, key=lambda r: records[r].started_at or 0.0) == [
        "long",
        "middle",
        "short",
    ]


async def test_the_estimator_fits_completed_runs_and_submit_stores_its_estimate(
    tmp_path: Path,
) -> None:
    clock = fixtures.FakeClock()
    from tailrace.stores import Harvest, NewRun, SQLiteStore, Submission

    async with SQLiteStore(tmp_path / "est.db", clock=clock) as store:
        fingerprint = graphs.chain.compile().fingerprint
        for n, cost in enumerate([1.0, 2.0, 3.0, 4.0]):
            run = NewRun(
                run_id=f"h{n}", graph_name="g", graph_ref=None, fingerprint=fingerprint,
                input_json="1", created_at=clock.now,
            )  # fmt: skip
            await store.submit_run(run, Submission(queue="q", cost=cost))
            (claimed,) = await store.claim_runs("q", "w", 30.0, limit=1)
            token = (await store.get_run(claimed)).lease_token
            done = Harvest(
                state_json="{}", status=RunStatus.COMPLETED, finished_at=clock.now + 2 * cost
            )
            await store.commit(claimed, token, done)
        assert await estimates_of(store).estimate(fingerprint, 10.0) == pytest.approx(20.0)
        run_id = await Engine(store=store).submit(graphs.chain, 1, queue="q", cost=6.0)
        assert (await store.get_run(run_id)).estimate == pytest.approx(12.0)


# --- draining and adoption -------------------------------------------------------------------


async def test_orphans_no_target_here_drives_never_hide_the_ones_it_does(
    db: fixtures.Database, caplog: pytest.LogCaptureFixture
) -> None:
    # Five orphans of a graph this worker does not have sort before one it has, and
    # a worker of concurrency 1 asks the store for 4 at a time: it must still find it.
    store = await db.store()
    old = time.time() - 3600  # long enough ago that no engine is about to lease them
    for i in range(5):
        await store.create_run(
            NewRun(run_id=f"a-elsewhere-{i}", graph_name="elsewhere", graph_ref=None,
                   fingerprint="not-here", input_json="1", created_at=old)
        )  # fmt: skip
    fingerprint = graphs.chain.compile().fingerprint
    await store.create_run(
        NewRun(run_id="z-ours", graph_name=graphs.chain.name, graph_ref=None,
               fingerprint=fingerprint, input_json="1", created_at=old)
    )  # fmt: skip
    engine = await engine_on(db)
    with caplog.at_level(logging.INFO, logger="tailrace.serve"):
        worker = await worker_on(db, concurrency=1)
        async with working(worker):
            result = await engine.wait("z-ours", timeout=fixtures.HANG_GUARD, graph=graphs.chain)
    assert (result.status, result.output) == ("completed", 4)
    assert worker.stats.adopted == 1
    left = [r.getMessage() for r in caplog.records if "no target here drives it" in r.getMessage()]
    assert sorted(m.split()[1] for m in left) == [f"a-elsewhere-{i}" for i in range(5)]  # once each
    for i in range(5):
        assert (await store.get_run(f"a-elsewhere-{i}")).status is RunStatus.RUNNING  # untouched


async def test_a_stopped_worker_lets_go_of_its_runs_and_another_adopts_them(
    db: fixtures.Database,
) -> None:
    engine = await engine_on(db)
    run_id = await engine.submit(graphs.held, 9)
    first = await worker_on(db, grace=0.0)
    async with working(first):
        await until(graphs.HOLD["started"].is_set, "the held handler to start")
    record = await (await db.store()).get_run(run_id)
    assert (record.status, record.lease_owner) == (RunStatus.RUNNING, None)  # let go, not done
    assert graphs.SEEN["cancelled"] == [run_id]
    graphs.HOLD["release"].set()
    second = await worker_on(db)
    async with working(second):
        result = await engine.wait(run_id, timeout=fixtures.HANG_GUARD)
    assert (result.status, result.output) == ("completed", 109)
    assert second.stats.adopted == 1
    types = [e.type for e in await (await db.store()).events(run_id)]
    assert types.count("run_started") == 1 and "run_resumed" in types


async def test_an_orphan_released_just_after_a_scan_is_adopted_without_waiting_a_heartbeat(
    db: fixtures.Database,
) -> None:
    """Orphan scans are at most four a second: a release heard within that is scanned for
    once the quarter second has passed, not dropped until the next heartbeat (an hour)."""
    engine, store = await engine_on(db), await db.store()
    first, second = [await engine.submit(graphs.chain, n) for n in (1, 2)]
    assert await store.claim_runs("default", "ghost", 3600.0, limit=2) == [first, second]
    tokens = {r: (await store.get_run(r)).lease_token for r in (first, second)}
    async with working(await worker_on(db, heartbeat=3600.0, poll_interval=None)) as worker:
        await until(lambda: worker.stats.rounds > 0, "the worker's first round")
        await store.release_lease(first, "ghost", tokens[first])  # an orphan: adopted at once
        await engine.wait(first, timeout=fixtures.HANG_GUARD)
        await store.release_lease(second, "ghost", tokens[second])  # a moment after that scan
        result = await engine.wait(second, timeout=fixtures.HANG_GUARD)
    assert (result.status, result.output) == ("completed", 6)
    assert worker.stats.adopted == 2


async def test_a_look_kept_for_later_survives_a_round_woken_for_something_else(
    db: fixtures.Database,
) -> None:
    """A release heard just after an orphan scan is kept for a look a moment later; a round
    woken meanwhile for another reason (a cancel request elsewhere) does not drop that look."""
    engine, store = await engine_on(db), await db.store()
    first, second, other = [await engine.submit(graphs.chain, n) for n in (1, 2, 3)]
    assert await store.claim_runs("default", "ghost", 3600.0, limit=3) == [first, second, other]
    tokens = {r: (await store.get_run(r)).lease_token for r in (first, second)}
    async with working(await worker_on(db, heartbeat=3600.0, poll_interval=None)) as worker:
        await until(lambda: worker.stats.rounds > 0, "the worker's first round")
        await store.release_lease(first, "ghost", tokens[first])
        await until(lambda: worker.stats.adopted == 1, "the first orphan adopted")  # a scan
        rounds = worker.stats.rounds
        await store.release_lease(second, "ghost", tokens[second])  # kept for a look soon
        await until(lambda: worker.stats.rounds > rounds, "the round that heard the release")
        await store.request_cancel(other)  # wakes a round that has no look to make yet
        result = await engine.wait(second, timeout=fixtures.HANG_GUARD)
    assert (result.status, result.output) == ("completed", 6)
    assert worker.stats.adopted == 2


async def test_a_round_that_fails_is_made_again_with_what_woke_it(
    db: fixtures.Database, caplog: pytest.LogCaptureFixture
) -> None:
    """A round whose store call fails keeps its wake-up: the orphan it was woken for is
    adopted by a round made again a moment later, not left for the next heartbeat (an hour)."""
    from tests.faults import _faulty as faulty

    class FailsOnce(faulty.DelegatingStore):
        failed = 0

        def changes(self) -> contextlib.AbstractAsyncContextManager[ChangeFeed]:
            return self.inner.changes()  # the store's own wake-ups, not a polling fallback

        async def expired_leases(self, now: float, *, limit: int = 100) -> list[str]:
            found = await self.inner.expired_leases(now, limit=limit)
            if run_id in found and not self.failed:  # the first scan that finds it fails
                self.failed += 1
                raise StoreError("the store is away for a moment")
            return found

    engine, store = await engine_on(db), await db.store()
    run_id = await engine.submit(graphs.chain, 1)
    assert await store.claim_runs("default", "ghost", 3600.0, limit=1) == [run_id]
    token = (await store.get_run(run_id)).lease_token
    wrapped = FailsOnce(await db.store())
    worker = Worker(wrapped, graphs=[graphs.chain], heartbeat=3600.0, poll_interval=None)
    async with working(worker):
        await until(lambda: worker.stats.rounds > 0, "the worker's first round")
        await store.release_lease(run_id, "ghost", token)
        result = await engine.wait(run_id, timeout=fixtures.HANG_GUARD)
    assert (result.status, result.output) == ("completed", 4)
    assert wrapped.failed == 1 and worker.stats.errors >= 1
    assert worker.stats.adopted == 1
    assert "the store is away for a moment" in caplog.text


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
async def test_a_bad_max_recoveries_is_refused_naming_it(bad: object) -> None:
    from tailrace.stores import MemoryStore

    with pytest.raises(ValueError, match="max_recoveries"):
        Worker(MemoryStore(), max_recoveries=bad)  # type: ignore[arg-type]


def test_stretches_read_from_events_of_any_age() -> None:
    from tailrace.stores import EventRow

    def ev(seq: int, type: str, ts: float, data: str = "{}") -> EventRow:
        return EventRow(seq=seq, type=type, node_id=None, visit=None, attempt=None, ts=ts,
                        data_json=data)  # fmt: skip

    events = [
        ev(1, "node_started", 1.0),  # before any opener: a stretch of its own
        ev(2, "run_started", 2.0, '{"graph": "g"}'),  # written before owners were recorded
        ev(3, "node_completed", 3.5),
        ev(4, "run_resumed", 9.0, '{"owner": "h:2:0:x"}'),
        ev(5, "run_completed", 9.5, "not json"),
    ]
    got = [(s.owner, s.how, s.started_at, s.ended_at, s.events) for s in stretches_of(events)]
    assert got == [
        (None, "started", 1.0, 1.0, 1), (None, "started", 2.0, 3.5, 2),
        ("h:2:0:x", "resumed", 9.0, 9.5, 2),
    ]  # fmt: skip
    assert stretches_of([]) == []
