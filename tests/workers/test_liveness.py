"""A worker cut off from the store stops driving before the fleet can adopt its runs, and says so (W7).

Real workers on a real Postgres. Two ways to lose the store:

- its store session ends while its process lives (an admin terminates the
  backend with ``pg_terminate_backend``): the session watching it buries it,
  its leases are fenced and another worker adopts the run at once; the
  worker takes its session back, learns it was buried, stops the run (its
  handler is cancelled) and says so, once;
- the network to the server is cut (:class:`Cable`, a proxy in front of the
  server's socket that stops passing bytes without closing anything, as a
  pulled cable does): nothing it sends is answered, so the lease it holds
  cannot be renewed; it stops the run before the lease could expire and
  says so, once, then says when the store answers again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import pytest

import tailrace as tr
from tailrace import Engine
from tailrace.stores import PostgresStore, RunStore, SQLiteStore
from tailrace.workers import Worker
from tests import fixtures
from tests.workers.test_worker import working

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.skipif(
        fixtures.POSTGRES_DSN is None, reason="TAILRACE_TEST_POSTGRES_DSN is not set"
    ),
]

until = fixtures.until
TTL = 3.0

#: What the handler of the run under test saw, per test.
STARTED: list[tuple[str, float]] = []
STOPPED: list[tuple[str, float]] = []
GO = asyncio.Event()

cut_graph = tr.Graph("liveness_cut")


@cut_graph.task()
async def warm(x: int) -> int:
    return x


@cut_graph.task()
async def long(x: int) -> int:
    """Runs until the test says ``GO``; records when it started and when it was stopped."""
    run_id = tr.current_node().run_id
    STARTED.append((run_id, time.time()))
    try:
        await GO.wait()
    except asyncio.CancelledError:
        STOPPED.append((run_id, time.time()))
        raise
    return x + 1


cut_graph.add_edge("warm", "long")


@pytest.fixture(autouse=True)
def fresh() -> None:
    global GO
    STARTED.clear()
    STOPPED.clear()
    GO = asyncio.Event()


class Cable(fixtures.SocketProxy):
    """A proxy in front of the server's socket, which can be cut and mended.

    Cut, it passes no byte either way and closes nothing: what a client sends
    is never answered, as when a cable is pulled. Mended, the bytes held back
    flow again.
    """

    def __init__(self, target: str, directory: Path) -> None:
        super().__init__(target, directory)
        self._flowing = asyncio.Event()
        self._flowing.set()

    async def __aexit__(self, *exc_info: object) -> None:
        self.mend()
        await super().__aexit__(*exc_info)

    def cut(self) -> None:
        self._flowing.clear()

    def mend(self) -> None:
        self._flowing.set()

    async def link(self, client: fixtures.Ends, server: fixtures.Ends) -> None:
        (reader, writer), (up_reader, up_writer) = client, server
        async with asyncio.TaskGroup() as group:
            group.create_task(self._pump(up_reader, writer))
            await self._pump(reader, up_writer)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while chunk := await reader.read(65536):
            await self._flowing.wait()
            writer.write(chunk)
            await writer.drain()
        writer.close()


async def owner_of(store: RunStore, run_id: str) -> str | None:
    return (await store.get_run(run_id)).lease_owner


def warnings_of(caplog: pytest.LogCaptureFixture, owner: str, words: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("tailrace.") and r.levelno == logging.WARNING
        and owner in r.getMessage() and words in r.getMessage()
    ]  # fmt: skip


async def test_a_worker_whose_session_the_server_ended_stops_its_run_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    async with (
        fixtures.postgres_schema("liveness") as schema,
        PostgresStore(fixtures.POSTGRES_DSN or "", schema=schema) as observer,
        PostgresStore(fixtures.POSTGRES_DSN or "", schema=schema) as mine,
        PostgresStore(fixtures.POSTGRES_DSN or "", schema=schema) as theirs,
    ):
        engine = Engine(store=observer)
        run_id = await engine.submit(cut_graph, 1)
        cut = Worker(mine, graphs=[cut_graph], lease_ttl=30.0)
        watcher = Worker(theirs, graphs=[cut_graph], lease_ttl=30.0)
        async with working(cut):
            await until(lambda: len(STARTED) == 1, "the run to start on the first worker")
            assert await owner_of(observer, run_id) == cut.owner
            async with working(watcher):
                await until(
                    lambda: _sessions(observer, 2), "both workers present, each in its session"
                )
                await until(
                    lambda: _watched(observer, schema, cut.owner), "the first worker watched"
                )
                await _terminate_session(observer, schema, cut.owner)
                await until(lambda: STOPPED, "the first worker to stop its run")
                await until(lambda: len(STARTED) == 2, "a worker to adopt and start it")
                GO.set()
                result = await engine.wait(run_id, timeout=fixtures.HANG_GUARD)
    assert (result.status, result.output) == ("completed", 2)
    assert STOPPED[0][1] <= STARTED[1][1] + 1.0  # stopped as it learnt, not a lease later
    said = warnings_of(caplog, cut.owner, "the fleet took it for gone")
    assert len(said) == 1, said
    assert "it stops the 1 run(s) it drove" in said[0]
    # Adopted once: by the watcher, or by the worker itself, back in its session.
    assert cut.stats.lapsed == 1 and cut.stats.adopted + watcher.stats.adopted == 1


async def _sessions(store: RunStore, count: int) -> bool:
    return len({w.session for w in await store.workers() if w.session is not None}) >= count


async def _session_locks(store: RunStore, schema: str, worker_id: str) -> list[tuple[Any, ...]]:
    """(pid, mode, granted) of each ``pg_locks`` row of ``worker_id``'s session's key."""
    from tailrace.stores.postgres._presence import session_key

    session = next(w.session for w in await store.workers() if w.worker_id == worker_id)
    assert session is not None
    key = session_key(schema, session)
    return await _server(
        "SELECT pid, mode, granted FROM pg_locks WHERE locktype = 'advisory' "
        "AND classid = %s::bigint::oid AND objid = %s::bigint::oid AND objsubid = 1",
        ((key >> 32) & 0xFFFFFFFF, key & 0xFFFFFFFF),
    )


async def _server(query: str, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
    import psycopg

    async with await psycopg.AsyncConnection.connect(
        fixtures.POSTGRES_DSN or "", autocommit=True
    ) as conn:
        cur = await conn.execute(query, params)
        return list(await cur.fetchall())


async def _watched(store: RunStore, schema: str, worker_id: str) -> bool:
    """Whether another session waits for ``worker_id``'s session's lock."""
    locks = await _session_locks(store, schema, worker_id)
    return any((mode, granted) == ("ShareLock", False) for _, mode, granted in locks)


async def _terminate_session(store: RunStore, schema: str, worker_id: str) -> None:
    """End the Postgres connection holding ``worker_id``'s store session, as an admin would."""
    locks = await _session_locks(store, schema, worker_id)
    holders = [pid for pid, mode, granted in locks if mode == "ExclusiveLock" and granted]
    assert len(holders) == 1, locks
    assert await _server("SELECT pg_terminate_backend(%s)", (holders[0],)) == [(True,)]


async def test_a_worker_cut_off_from_the_store_stops_before_its_lease_can_expire_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    dsn = fixtures.POSTGRES_DSN or ""
    async with (
        fixtures.postgres_schema("liveness") as schema,
        Cable.before(dsn, tmp_path) as cable,
        PostgresStore(dsn, schema=schema) as observer,
        PostgresStore(cable.dsn(dsn), schema=schema, retry_budget=60.0) as mine,
    ):
        engine = Engine(store=observer)
        ids = [await engine.submit(cut_graph, n) for n in (1, 2)]
        worker = Worker(mine, graphs=[cut_graph], lease_ttl=TTL, heartbeat=1.0)
        async with working(worker):
            await until(lambda: len(STARTED) == 2, "both runs to start")
            cable.cut()
            try:  # mended whatever happens: the worker stops (drains) only when it answers
                await until(lambda: len(STOPPED) == 2, "the worker to stop both runs")
                leases = {r: (await observer.get_run(r)).lease_expires for r in ids}
                assert [await owner_of(observer, r) for r in ids] == [worker.owner] * 2
                said = warnings_of(caplog, worker.owner, "is cut off from the store")
            finally:
                cable.mend()
            await until(
                lambda: warnings_of(caplog, worker.owner, "the store answers again"),
                "the worker to hear from the store again",
            )
            GO.set()
            results = [await engine.wait(r, timeout=fixtures.HANG_GUARD) for r in ids]
    for run_id, stopped_at in STOPPED:
        lease = leases[run_id]
        assert lease is not None and stopped_at < lease, (stopped_at, lease)  # before it expired
    assert len(said) == 1, said  # once, however many runs it stopped
    assert "LeaseLapsed" not in said[0] and "did not answer in time" in said[0]
    assert worker.stats.lapsed == 2
    assert [(r.status, r.output) for r in results] == [("completed", 2), ("completed", 3)]
    # Adopted again once their leases expired (by this worker, back in touch): each run's
    # long visit started twice, its warm visit, committed before the cut, once.
    assert sorted(r for r, _ in STARTED) == sorted(ids * 2)


class _SlowReads:
    """A real store whose reads of a run take ``delay`` seconds once ``slow`` is set (a
    loaded server), its renewals as fast as ever; it counts the slow reads."""

    def __init__(self, inner: RunStore, delay: float) -> None:
        self.inner = inner
        self.delay = delay
        self.slow = False
        self.slow_reads = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def get_run(self, run_id: str) -> Any:
        if self.slow:
            await asyncio.sleep(self.delay)
            self.slow_reads += 1
        return await self.inner.get_run(run_id)


async def test_a_renewed_lease_does_not_lapse_while_a_slow_read_looks_for_a_cancel(
    tmp_path: Path,
) -> None:
    """W7: a lease lapses only when its renewal goes unanswered. A renewal that landed
    moves the lapse, and the look for a cancel request after it has the renewed lease's
    time: a read slower than what was left of the old lease stops nothing."""
    from tailrace.core._lease import LAPSE_SHARE, Lease
    from tests.stores.test_queues import submit

    ttl = 3.0  # a beat every 1 s; 1.5 s left of the old lease then, 2.5 s of the renewed
    async with SQLiteStore(str(tmp_path / "runs.db")) as store:
        await submit(store, "r0", at=1.0)
        assert await store.claim_runs("q", "me", ttl, limit=1) == ["r0"]
        # Past what was left of the old lease at the beat, 0.5 s short of the renewed one.
        slow = _SlowReads(store, delay=(1 - LAPSE_SHARE) * ttl - ttl / 3 + 0.5)
        async with Lease(slow, "r0", "me", ttl, on_cancel_request=lambda: None) as lease:  # type: ignore[arg-type]
            slow.slow = True
            await fixtures.until(lambda: slow.slow_reads >= 2, "two slow looks for a cancel")
            slow.slow = False
        assert lease.lost is None
        assert (await store.get_run("r0")).lease_owner is None  # released on the way out


async def test_a_watchers_wait_that_gets_no_answer_ends_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """W7: a watcher waits for the next session's lock on a connection whose path may die
    without a word (a half-open socket): its wait is bounded past its ``lock_timeout``,
    then the connection is taken for dead (a store error; the watch connects again)."""
    import psycopg

    from tailrace._errors import StoreError
    from tailrace.stores.postgres import _presence as tokens_module
    from tailrace.stores.postgres._connections import PostgresConnections

    monkeypatch.setattr(tokens_module, "WAIT", 1.0)  # the bound: 2 s, not 75
    monkeypatch.setattr(tokens_module, "_SILENCE", 1.0)
    dsn = fixtures.POSTGRES_DSN or ""
    key = tokens_module.session_key("h", "s")
    async with (
        Cable.before(dsn, tmp_path) as cable,
        await psycopg.AsyncConnection.connect(dsn, autocommit=True) as holder,
    ):
        await holder.execute("SELECT pg_advisory_lock(%s)", (key,))
        connect = PostgresConnections(cable.dsn(dsn)).connect_session
        tokens = tokens_module.PostgresTokens(connect, "h", "test")

        async def watch() -> object:
            async with tokens.outlive("s") as outlived:
                return outlived

        async def waiting() -> bool:
            cur = await holder.execute(
                "SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
                "AND classid = %s::bigint::oid AND objid = %s::bigint::oid AND objsubid = 1",
                ((key >> 32) & 0xFFFFFFFF, key & 0xFFFFFFFF),
            )
            return await cur.fetchone() is not None

        task = asyncio.create_task(watch())
        try:
            await fixtures.until(waiting, "the watcher to wait for the lock")
            cable.cut()
            with pytest.raises(StoreError, match="no answer"):
                await asyncio.wait_for(task, fixtures.HANG_GUARD)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await tokens.close()
