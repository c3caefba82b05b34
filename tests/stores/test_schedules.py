"""Delayed runs and schedules in the store (W4), against every backend.

A run submitted with ``not_before`` is not claimed before that time and
takes no turn of its partition meanwhile. A schedule is declared once (a bad
cron is refused, nothing stored); ``fire_schedule`` submits a tick's run
once however many callers race for it, never an older tick, and keeps the
ticks already submitted when the schedule is declared again.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from typing import TYPE_CHECKING

import pytest

from tailrace.stores import NewRun, RunStatus, ScheduleRow, Submission, next_tick
from tailrace.tail import Cron
from tests.stores.test_queues import finish

if TYPE_CHECKING:
    from tests.fixtures import Backend

TTL = 30.0
UTC = dt.UTC


def new_run(run_id: str, at: float) -> NewRun:
    return NewRun(
        run_id=run_id, graph_name="g", graph_ref="pkg.mod:g", fingerprint="fp",
        input_json="1", created_at=at,
    )  # fmt: skip


def schedule(declared_at: float, cron: str = "*/5 * * * *", name: str = "nightly") -> ScheduleRow:
    return ScheduleRow(
        name=name, cron=cron, graph_name="g", graph_ref="pkg.mod:g", fingerprint="fp",
        input_json='{"days": 1}', queue="reports", declared_at=declared_at,
    )  # fmt: skip


def minute(hour: int, minute: int) -> float:
    return dt.datetime(2026, 12, 2, hour, minute, tzinfo=UTC).timestamp()


async def test_a_delayed_run_waits_and_holds_no_turn_of_its_partition(backend: Backend) -> None:
    store, now = backend.store, backend.clock.now
    delayed = Submission(queue="q", partition="A", not_before=now + 60)
    await store.submit_run(new_run("later", now - 2), delayed)
    await store.submit_run(new_run("sooner", now - 1), Submission(queue="q", partition="A"))
    assert (await store.get_run("later")).not_before == now + 60
    assert await store.claim_runs("q", "w", TTL, limit=5) == ["sooner"]
    assert await store.claim_runs("q", "w", TTL, limit=5) == []
    backend.clock.advance(61)
    assert await store.claim_runs("q", "w", TTL, limit=5) == []  # A's one slot is taken
    await finish(store, "sooner", "w")
    assert await store.claim_runs("q", "w", TTL, limit=5) == ["later"]


async def test_a_delayed_run_joins_its_partitions_line_when_it_comes_due(
    backend: Backend,
) -> None:
    """Its place in line is its ``not_before``: a run submitted while it was delayed, and
    waiting when it came due, goes first (W2, W4)."""
    store, now = backend.store, backend.clock.now
    await store.submit_run(new_run("busy", now - 3), Submission(queue="q", partition="A"))
    assert await store.claim_runs("q", "w", TTL, limit=5) == ["busy"]
    delayed = Submission(queue="q", partition="A", not_before=now + 10)
    await store.submit_run(new_run("delayed", now - 2), delayed)
    await store.submit_run(new_run("meanwhile", now + 5), Submission(queue="q", partition="A"))
    backend.clock.advance(20)  # both wait behind the busy run, the delayed one came due
    await finish(store, "busy", "w")
    assert await store.claim_runs("q", "w", TTL, limit=5) == ["meanwhile"]
    await finish(store, "meanwhile", "w")
    assert await store.claim_runs("q", "w", TTL, limit=5) == ["delayed"]


async def test_runs_come_due_in_a_busy_partition_hold_up_no_other(backend: Backend) -> None:
    """However many delayed runs came due behind a partition's running run, the claim still
    reaches the due runs of other partitions and the unkeyed ones."""
    store, now = backend.store, backend.clock.now
    await store.submit_run(new_run("busy", now - 9), Submission(queue="q", partition="A"))
    assert await store.claim_runs("q", "w", TTL, limit=5) == ["busy"]
    behind = [
        (new_run(f"a{n:03}", now - 8), Submission(queue="q", partition="A", not_before=now + 1))
        for n in range(150)
    ]
    await store.submit_runs(behind)
    await store.submit_run(
        new_run("b", now - 1), Submission(queue="q", partition="B", not_before=now + 2)
    )
    await store.submit_run(new_run("loose", now - 1), Submission(queue="q", not_before=now + 3))
    backend.clock.advance(5)
    claimed = [await store.claim_runs("q", "w", TTL, limit=1) for _ in range(3)]
    assert sorted(claimed) == [[], ["b"], ["loose"]]


async def test_a_schedule_is_declared_checked_and_its_first_tick_follows_the_declaration(
    backend: Backend,
) -> None:
    store = backend.store
    backend.clock.now = minute(11, 0)  # the memory and SQLite stores' clock; Postgres's is later
    with pytest.raises(ValueError, match="minute 61 is outside"):
        await store.declare_schedule(schedule(minute(10, 7), cron="61 * * * *"))
    with pytest.raises(ValueError, match="schedule"):
        await store.declare_schedule(schedule(minute(10, 7), name="bad\x00name"))
    assert await store.schedules() == []  # nothing stored
    await store.declare_schedule(schedule(minute(10, 7)))
    (row,) = await store.schedules()
    assert (row.name, row.queue, row.last_tick) == ("nightly", "reports", minute(10, 5))
    assert await store.fire_schedule("nightly", minute(10, 5)) is None  # before it: not due
    fired = await store.fire_schedule("nightly", minute(10, 10))
    assert fired == "nightly@2026-12-02T10:10Z"
    run = await store.get_run(fired)
    assert (run.status, run.queue_name, run.input_json) == (
        RunStatus.QUEUED,
        "reports",
        '{"days": 1}',
    )
    assert await store.fire_schedule("nightly", minute(10, 10)) is None  # once per tick
    await store.declare_schedule(schedule(minute(11, 0), cron="0 * * * *"))  # declared again
    (row,) = await store.schedules()
    assert (row.cron, row.last_tick) == ("0 * * * *", minute(10, 10))  # its ticks are kept
    assert await store.fire_schedule("nightly", minute(10, 5)) is None  # never an older tick
    assert await store.fire_schedule("missing", minute(10, 5)) is None
    assert await store.delete_schedule("nightly") is True
    assert await store.delete_schedule("nightly") is False
    assert (await store.get_run(fired)).status is RunStatus.QUEUED  # its runs stay


async def test_racing_callers_submit_each_tick_once(backend: Backend) -> None:
    backend.clock.now = minute(10, 0)
    if backend.sibling is None:
        stores = [backend.store] * 4
    else:
        stores = [backend.store, *(backend.sibling() for _ in range(3))]
        for other in stores[1:]:
            await other.open()
    try:
        await backend.store.declare_schedule(schedule(minute(9, 0)))
        for tick in (minute(9, 5), minute(9, 10), minute(9, 15)):
            won = await asyncio.gather(*(s.fire_schedule("nightly", tick) for s in stores))
            assert [w for w in won if w is not None] == [
                "nightly@" + dt.datetime.fromtimestamp(tick, UTC).strftime("%Y-%m-%dT%H:%MZ")
            ]
    finally:
        for other in stores[1:]:
            if other is not backend.store:
                await other.close()
    runs = await backend.store.list_runs(queue="reports", limit=10)
    assert len(runs) == 3


async def test_a_tick_is_judged_by_the_stores_clock(backend: Backend) -> None:
    """A tick that has not come by the store's clock is refused, whatever the caller's clock
    says, and nothing moves; on Postgres that clock is the server's, not the store's ``clock=``."""
    store = backend.store
    now = await store.now()
    if backend.name == "postgres":
        assert abs(now - time.time()) < 60  # the server's clock (same host), not the fake one
    else:
        assert now == backend.clock.now
    every_minute = Cron("* * * * *")
    await store.declare_schedule(schedule(now - 600, cron="* * * * *"))
    (before,) = await store.schedules()
    an_hour_ahead = every_minute.latest_at(now + 3600)
    assert an_hour_ahead is not None
    with pytest.raises(ValueError, match="has not come by the store's clock"):
        await store.fire_schedule("nightly", an_hour_ahead)
    assert await store.schedules() == [before]
    assert await store.list_runs(queue="reports", limit=10) == []
    latest = every_minute.latest_at(now)
    assert latest is not None
    assert await store.fire_schedule("nightly", latest) is not None


async def test_a_last_tick_ahead_of_the_stores_clock_holds_no_tick_back(backend: Backend) -> None:
    """A schedule stamped by a clock an hour ahead (declared then, or its last tick moved
    there) still submits the ticks that come meanwhile, each once."""
    store = backend.store
    now = await store.now()
    every_minute = Cron("* * * * *")
    await store.declare_schedule(schedule(now + 3600, cron="* * * * *"))
    (row,) = await store.schedules()
    assert row.last_tick is not None and row.last_tick > now
    latest = every_minute.latest_at(now)
    assert latest is not None
    fired = await store.fire_schedule("nightly", latest)
    assert fired is not None
    assert await store.fire_schedule("nightly", latest) is None  # once per tick, still
    (row,) = await store.schedules()
    assert row.last_tick == latest
    assert next_tick(row, now) == every_minute.next_after(now)
