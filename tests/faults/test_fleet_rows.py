"""Rows an operator or an older writer broke never stop a fleet: each is said once and skipped.

On the SQL stores (a real SQLite file, a Postgres schema): a ``queues`` row
paused by hand (``concurrency = 0``) or holding a word for a number, and a
``workers`` row whose queue list is no JSON. Every other queue keeps working,
real workers start and drive runs, and ``queue_stats`` (``tailrace queues``)
still answers.
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from tailrace import Engine, Graph
from tailrace.stores import Queue, RunStatus, WorkerRow, _queue_rules
from tailrace.workers import Worker
from tests import fixtures
from tests.fixtures import Backend

TTL = 30.0


@pytest.fixture(autouse=True)
def _forget_reported_rows() -> None:
    """Each row is said once per process; each test starts with none said."""
    _queue_rules._REPORTED.clear()


@pytest.fixture(params=fixtures.SHARED_STORES)
async def sql_backend(request: pytest.FixtureRequest, tmp_path):  # type: ignore[no-untyped-def]
    if request.param == "sqlite":
        factory = fixtures._sqlite_backend(tmp_path / "runs.db")
    else:
        factory = fixtures._postgres_backend()
    async for value in factory:
        yield value


def doubling() -> Graph:
    g = Graph("doubling")

    @g.task()
    async def double(x: int) -> int:
        return 2 * x

    return g


async def break_rows(backend: Backend) -> None:
    assert backend.execute is not None
    m = backend.mark
    await backend.store.declare_queue(Queue("paused", concurrency=2))
    await backend.store.declare_queue(Queue("worded", concurrency=2))
    await backend.store.declare_queue(Queue("open", concurrency=2))
    await backend.execute(f"UPDATE queues SET concurrency = 0 WHERE name = {m}", ("paused",))
    # A word where a number goes (SQLite keeps it; Postgres refuses it: the period then).
    if backend.name == "sqlite":
        await backend.execute(
            f"UPDATE queues SET concurrency = 'ten' WHERE name = {m}", ("worded",)
        )
    else:
        await backend.execute(f"UPDATE queues SET rate_period = -1 WHERE name = {m}", ("worded",))


async def test_a_broken_queues_row_pauses_only_its_queue_and_is_said_once(
    sql_backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    store = sql_backend.store
    await break_rows(sql_backend)
    engine = Engine(store=store)
    graph = doubling()
    ids = {q: await engine.submit(graph, 1, queue=q) for q in ("paused", "worded", "open")}
    with caplog.at_level(logging.WARNING, logger="tailrace.stores"):
        for _ in range(3):
            assert [q.name for q in await store.queues()] == ["open"]
            assert await store.claim_runs("paused", "w", TTL, limit=5) == []
            assert await store.claim_runs("worded", "w", TTL, limit=5) == []
        stats = {s.name: s for s in await store.queue_stats(sql_backend.clock())}
    assert stats["open"].queued == 1
    said = [r.getMessage() for r in caplog.records if "row cannot be used" in r.getMessage()]
    assert len(said) == 2 and all("claims nothing" in s for s in said)
    assert await store.claim_runs("open", "w", TTL, limit=5) == [ids["open"]]
    assert (await store.get_run(ids["paused"])).status is RunStatus.QUEUED


async def test_a_broken_workers_row_is_skipped_and_real_workers_go_on(
    sql_backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    store = sql_backend.store
    await break_rows(sql_backend)
    await store.worker_seen(
        WorkerRow(worker_id="gone", queues=("open",), concurrency=1, started_at=1.0, seen_at=1.0)
    )
    assert sql_backend.execute is not None
    await sql_backend.execute(
        f"UPDATE workers SET queues_json = 'not json' WHERE worker_id = {sql_backend.mark}",
        ("gone",),
    )
    with caplog.at_level(logging.WARNING, logger="tailrace.stores"):
        assert await store.workers() == []
        assert await store.workers() == []
    assert sum("workers row cannot be used" in r.getMessage() for r in caplog.records) == 1

    graph = doubling()
    run_id = await Engine(store=store).submit(graph, 21, queue="open")
    worker = Worker(store, queues=["paused", "worded", "open"], graphs=[graph], poll_interval=0.05)
    stop = asyncio.Event()
    running = asyncio.create_task(worker.run(stop))
    try:
        result = await Engine(store=store).wait(run_id, timeout=fixtures.HANG_GUARD)
    finally:
        stop.set()
        await running
    assert result.status is RunStatus.COMPLETED and result.results == {"double": 42}
