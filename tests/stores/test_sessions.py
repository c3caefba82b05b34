"""Store sessions: a worker is alive while its store session is, and the fleet sees it die (W7).

Run against every backend that other processes share. A process present in
the fleet (``tests/stores/session_holder.py``) claims runs and is SIGKILLed
for real; the session watching it finds its token free (the Postgres server
drops the advisory lock with the connection, the kernel the SQLite lock
file) and buries it: its leases expire at once with a new fencing token,
its row goes. Nothing here waits out a lease: leases are an hour long.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tailrace._errors import LeaseLost
from tailrace.stores import RunStore, SQLiteStore
from tailrace.stores._presence import GRACE, Outlived
from tailrace.stores.sqlite._presence import FileTokens
from tests import fixtures
from tests.stores.test_queues import TTL, submit, worker

if TYPE_CHECKING:
    from tests.fixtures import Backend

HOLDER = Path(__file__).with_name("session_holder.py")
until = fixtures.until


def url_of(store: RunStore) -> str:
    """Where another process opens ``store``'s database."""
    if isinstance(store, SQLiteStore):
        return store.path
    assert fixtures.POSTGRES_DSN is not None
    sep = "&" if "?" in fixtures.POSTGRES_DSN else "?"
    return f"{fixtures.POSTGRES_DSN}{sep}schema={store.schema}"


@contextlib.contextmanager
def holder(
    store: RunStore, worker_id: str, runs: int, *, fork: bool = False
) -> Iterator[tuple[subprocess.Popen[str], str, list[str]]]:
    """A process present as ``worker_id`` holding ``runs`` claimed runs: (it, its session, the
    runs); with ``fork``, it forked a child that outlives it (killed on the way out)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("TAILRACE_")}
    environ["PYTHONPATH"] = os.pathsep.join(sys.path)
    proc = subprocess.Popen(
        [sys.executable, str(HOLDER), url_of(store), worker_id, str(runs), *["fork"] * fork],
        stdout=subprocess.PIPE, text=True, env=environ,
    )  # fmt: skip
    child: int | None = None
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().split()
        if fork:
            assert line and line[0] == "child", line
            child = int(line[1])
            line = proc.stdout.readline().split()
        assert line and line[0] == "ready", line
        yield proc, line[1], line[2:]
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        if child is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        if proc.stdout is not None:
            proc.stdout.close()


def shared(backend: Backend) -> RunStore:
    if backend.sibling is None:
        pytest.skip("a memory store is one process's own")
    return backend.store


async def test_a_present_worker_names_its_session_and_its_row_goes_with_it(
    backend: Backend,
) -> None:
    store, now = backend.store, backend.clock.now
    async with store.presence(worker("w1", now)) as presence:
        assert [(w.worker_id, w.session) for w in await store.workers()] == [
            ("w1", presence.session)
        ]
        await store.pulse(worker("w1", now + 1))  # a heartbeat keeps the session it names
        assert [w.session for w in await store.workers()] == [presence.session]
        async with store.presence(worker("w2", now)) as second:
            assert second.session == presence.session  # one session per store object
    assert await store.workers() == []


async def test_a_killed_sessions_leases_expire_fenced_at_once_and_its_row_goes(
    backend: Backend,
) -> None:
    store = shared(backend)
    for n in range(3):
        await submit(store, f"r{n}", at=float(n + 1))
    async with store.presence(worker("watcher", backend.clock.now, queues=("none",))) as mine:
        with holder(store, "doomed:1:0:x", 2) as (proc, theirs, claimed):
            assert claimed == ["r0", "r1"]
            sessions = {w.worker_id: w.session for w in await store.workers()}
            assert sessions == {"watcher": mine.session, "doomed:1:0:x": theirs}
            tokens = {r: (await store.get_run(r)).lease_token for r in claimed}
            proc.kill()
            proc.wait()

            async def fenced() -> bool:
                runs = [await store.get_run(r) for r in claimed]
                return all(r.lease_token == tokens[r.run_id] + 1 for r in runs)

            await until(fenced, "the killed session's leases to be expired and fenced")
        for run_id in claimed:
            record = await store.get_run(run_id)
            assert (record.lease_owner, record.lease_expires) == ("doomed:1:0:x", 0.0)
            with pytest.raises(LeaseLost):  # its writes are refused from now on (D6)
                await store.heartbeat(run_id, "doomed:1:0:x", tokens[run_id], TTL)
        assert [w.worker_id for w in await store.workers()] == ["watcher"]
        # Expired for every clock: an adopter whose clock lags the burier's finds them too.
        assert await store.expired_leases(backend.clock.now - 3600.0, limit=10) == claimed
        # Taking one over counts as a recovery of a run its owner died holding (W3).
        await store.acquire_lease("r0", "watcher", TTL)
        assert (await store.get_run("r0")).recoveries == 1
        assert (await store.get_run("r2")).lease_owner is None  # never claimed: untouched


async def test_a_killed_session_is_buried_though_a_child_it_forked_lives_on(
    backend: Backend,
) -> None:
    """A worker that forked (a ``multiprocessing`` pool, a node's own fork) is SIGKILLed; its
    child lives on, with a copy of every descriptor: the child let go of the session's lock
    and connection as it was forked, so the fleet buries the worker all the same."""
    store = shared(backend)
    await submit(store, "r0", at=1.0)
    async with store.presence(worker("watcher", backend.clock.now, queues=("none",))):
        with holder(store, "forked:1:0:x", 1, fork=True) as (proc, _theirs, claimed):
            token = (await store.get_run("r0")).lease_token
            proc.kill()
            proc.wait()

            async def fenced() -> bool:
                return (await store.get_run("r0")).lease_token == token + 1

            await until(fenced, "the killed session's leases to be expired and fenced")
        assert claimed == ["r0"]
        assert [w.worker_id for w in await store.workers()] == ["watcher"]


async def test_a_session_that_joins_buries_the_dead_one_it_watches(backend: Backend) -> None:
    """Nobody watched the session when it died: the next session to join finds it gone."""
    store = shared(backend)
    await submit(store, "r0", at=1.0)
    with holder(store, "doomed:1:0:x", 1) as (proc, _, claimed):
        proc.kill()
        proc.wait()
    token = (await store.get_run("r0")).lease_token
    assert claimed == ["r0"] and [w.worker_id for w in await store.workers()] == ["doomed:1:0:x"]
    async with store.presence(worker("late", backend.clock.now, queues=("none",))):

        async def fenced() -> bool:
            return (await store.get_run("r0")).lease_token == token + 1

        await until(fenced, "the dead session to be buried by the one that joined")
        assert [w.worker_id for w in await store.workers()] == ["late"]


async def _terminate_session(backend: Backend, session: str) -> None:
    """End ``session``'s Postgres connection from the server's side, as an admin would."""
    from tailrace.stores.postgres._presence import session_key

    assert backend.execute is not None
    key = session_key(backend.store.schema, session)
    rows = await backend.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_locks WHERE locktype = 'advisory' "
        "AND classid = %s::bigint::oid AND objid = %s::bigint::oid AND objsubid = 1 AND granted",
        ((key >> 32) & 0xFFFFFFFF, key & 0xFFFFFFFF),
    )
    assert rows == [(True,)], rows


@pytest.mark.parametrize("watched", [True, False], ids=["watched", "alone"])
async def test_a_session_ended_by_the_server_is_taken_back_and_told_if_it_was_buried(
    pg_backend: Backend, watched: bool
) -> None:
    """Its process lives: the session comes back; its workers learn whether the fleet buried
    it meanwhile (then their leases were fenced: they must stop what they drive)."""
    store, now = pg_backend.store, pg_backend.clock.now
    await submit(store, "r0", at=1.0)
    async with contextlib.AsyncExitStack() as stack:
        if watched:
            other = await stack.enter_async_context(pg_backend.sibling())  # type: ignore[misc]
            await stack.enter_async_context(other.presence(worker("watcher", now, ("none",))))
        mine = await stack.enter_async_context(store.presence(worker("w1", now)))
        assert await store.claim_runs("q", "w1", TTL, limit=1) == ["r0"]
        token = (await store.get_run("r0")).lease_token
        if watched:  # watched indeed: not found free at the watcher's first look
            await until(lambda: _watched(pg_backend, [mine.session]), "the ring to settle")
        await _terminate_session(pg_backend, mine.session)
        lapse = await asyncio.wait_for(mine.lapse(), fixtures.HANG_GUARD)
        assert lapse.buried is watched
        assert "terminat" in lapse.reason or "closed" in lapse.reason, lapse.reason
        record = await store.get_run("r0")
        assert record.lease_token == token + (1 if watched else 0)
        # Back in the ring, with its row, either way.
        assert [w.session for w in await store.workers() if w.worker_id == "w1"] == [mine.session]


async def test_a_worker_that_leaves_while_its_session_is_taken_back_buries_nobody(
    pg_backend: Backend,
) -> None:
    """Two workers share a session the server ended; one leaves while the other takes it
    back: the one that stays is told its session was not buried (its runs go on, its lease
    unfenced), and no row of the one that left is written back."""
    from tailrace.stores import PostgresStore
    from tailrace.stores._records import WorkerRow

    leave, left = asyncio.Event(), asyncio.Event()

    class LeaveDuringRejoin(PostgresStore):
        async def _join_session(
            self, session: str, workers: list[WorkerRow], *, again: bool
        ) -> frozenset[str]:
            if again and not left.is_set():  # w2 leaves now: its row goes before the join
                leave.set()
                await left.wait()
            return await super()._join_session(session, workers, again=again)

    async def w2_present() -> None:
        async with store.presence(worker("w2", now)):
            await leave.wait()
        left.set()

    now = pg_backend.clock.now
    await submit(pg_backend.store, "r0", at=1.0)
    assert fixtures.POSTGRES_DSN is not None
    store = LeaveDuringRejoin(fixtures.POSTGRES_DSN, schema=pg_backend.store.schema)
    async with store, store.presence(worker("w1", now)) as mine:
        w2 = asyncio.create_task(w2_present())
        await until(lambda: _rows(store, {"w1", "w2"}), "both workers present")
        assert await store.claim_runs("q", "w1", TTL, limit=1) == ["r0"]
        token = (await store.get_run("r0")).lease_token
        await _terminate_session(pg_backend, mine.session)
        lapse = await asyncio.wait_for(mine.lapse(), fixtures.HANG_GUARD)
        await w2
        assert not lapse.buried, lapse
        assert (await store.get_run("r0")).lease_token == token
        assert [(w.worker_id, w.session) for w in await store.workers()] == [("w1", mine.session)]


async def _rows(store: RunStore, ids: set[str]) -> bool:
    return {w.worker_id for w in await store.workers()} == ids


async def _watched(backend: Backend, sessions: list[str]) -> bool:
    """Whether each of ``sessions`` is watched (Postgres: a wait for its lock is queued)."""
    from tailrace.stores.postgres._presence import session_key

    assert backend.execute is not None
    keys = [session_key(backend.store.schema, s) for s in sessions]
    rows = await backend.execute(
        "SELECT DISTINCT classid::bigint, objid::bigint FROM pg_locks "
        "WHERE locktype = 'advisory' AND objsubid = 1 AND NOT granted",
        (),
    )
    return {((k >> 32) & 0xFFFFFFFF, k & 0xFFFFFFFF) for k in keys} <= set(rows)


async def test_adjacent_sessions_killed_at_once_are_all_buried_without_a_grace_each(
    backend: Backend,
) -> None:
    """A host's sessions sit side by side in the ring: the watcher buries the first the
    moment it dies, and each next one, found free right after, at once too (no grace:
    no server restarted), not one grace later each."""
    store = shared(backend)
    for n in range(3):
        await submit(store, f"r{n}", at=float(n + 1))
    async with store.presence(worker("watcher", backend.clock.now, queues=("none",))) as mine:
        with contextlib.ExitStack() as stack:
            held = [stack.enter_context(holder(store, f"doomed:{n}", 1)) for n in range(3)]
            sessions = [mine.session] + [session for _, session, _ in held]
            if backend.mark == "%s":  # every session watched, not found free at a first look
                await until(lambda: _watched(backend, sessions), "the ring to settle")
            tokens = {c[0]: (await store.get_run(c[0])).lease_token for _, _, c in held}
            started = time.monotonic()
            for proc, _, _ in held:
                proc.kill()
            for proc, _, _ in held:
                proc.wait()

            async def fenced() -> bool:
                runs = [await store.get_run(r) for r in tokens]
                return all(r.lease_token == tokens[r.run_id] + 1 for r in runs)

            await until(fenced, "the killed sessions to be buried")
            took = time.monotonic() - started
        # A grace given to any of them would take GRACE at least; none takes milliseconds.
        assert took < GRACE, took
        assert [w.worker_id for w in await store.workers()] == ["watcher"]


async def test_sessions_on_one_database_through_a_symbolic_link_see_each_other(
    tmp_path: Path,
) -> None:
    """Two paths to one SQLite file find one lock directory: neither takes the other for
    dead, however long they last."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    real, link = tmp_path / "a" / "x.db", tmp_path / "b" / "x.db"
    first = SQLiteStore(str(real))
    await first.open()
    link.symlink_to(real)
    second = SQLiteStore(_relative(link))
    await second.open()
    now = time.time()
    try:
        async with first.presence(worker("w1", now)), second.presence(worker("w2", now)):
            await asyncio.sleep(GRACE + 2.0)  # a session taken for dead is buried by then
            rows = {w.worker_id: w.session for w in await first.workers()}
            assert set(rows) == {"w1", "w2"} and None not in rows.values(), rows
    finally:
        await second.close()
        await first.close()


async def test_a_session_whose_lock_file_is_missing_is_left_to_its_leases_said_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A lock file missing while its session has rows is not proof of death (a path this
    process cannot see): never buried, its leases untouched, said once."""
    async with _watching_a_holder(tmp_path) as (store, _, theirs, token):
        FileTokens(store.path, "test")._file(theirs).unlink()
        await _nudge(store)
        await asyncio.sleep(GRACE + 2.0)  # a session taken for dead is buried by then
        assert (await store.get_run("r0")).lease_token == token
        assert {w.worker_id: w.session for w in await store.workers()}["hidden"] == theirs
    said = [r for r in caplog.records if "cannot see the token" in r.getMessage()]
    assert len(said) == 1, said


async def _nudge(store: RunStore) -> None:
    """Make ``store``'s watcher look at the ring again, and open the lock file it watches
    afresh: a worker joins its session (on SQLite every watcher is told)."""
    async with store.presence(worker("nudge", time.time(), queues=("none",))):
        pass


@contextlib.asynccontextmanager
async def _watching_a_holder(
    tmp_path: Path,
) -> AsyncIterator[tuple[SQLiteStore, subprocess.Popen[str], str, int]]:
    """A SQLite store present as ``watcher`` and a process present as ``hidden`` holding
    run ``r0``: (the store, the process, its session, the run's lease token)."""
    store = SQLiteStore(str(tmp_path / "db.sqlite"))
    await store.open()
    try:
        await submit(store, "r0", at=1.0)
        async with store.presence(worker("watcher", time.time(), queues=("none",))):
            with holder(store, "hidden", 1) as (proc, theirs, claimed):
                assert claimed == ["r0"]
                yield store, proc, theirs, (await store.get_run("r0")).lease_token
    finally:
        await store.close()


def _relative(path: Path) -> str:
    """``path`` relative to the working directory (one more way to name one file)."""
    return os.path.relpath(path)


@pytest.mark.parametrize("idle", [None, "7"], ids=["default", "dsn"])
async def test_a_sessions_connections_keep_tcp_keepalives_on_both_ends(
    pg_backend: Backend, idle: str | None
) -> None:
    """A holder sits idle and a watcher waits for a lock: a path that dies under them (a NAT
    that forgets it) must end their connections on the client and on the server within
    seconds. A DSN's own keepalive settings win."""
    from tailrace.stores.postgres._connections import PostgresConnections
    from tailrace.stores.postgres._presence import PostgresTokens

    assert fixtures.POSTGRES_DSN is not None
    dsn = fixtures.POSTGRES_DSN
    if idle is not None:
        dsn += f"{'&' if '?' in dsn else '?'}keepalives_idle={idle}"
    conns: list[Any] = []

    async def connect() -> Any:
        conn = await PostgresConnections(dsn).connect_session()
        conns.append(conn)
        return conn

    tokens = PostgresTokens(connect, pg_backend.store.schema, "test")
    held = await tokens.hold("holder")
    try:
        async with tokens.outlive("nobody") as outlived:
            assert outlived is Outlived.FREE
        assert len(conns) == 2  # the holder's and the watcher's
        for conn in conns:
            client = conn.info.get_parameters()
            assert client["keepalives"] == "1" and client["keepalives_idle"] == (idle or "10")
            assert (client["keepalives_interval"], client["keepalives_count"]) == ("5", "3")
            assert client["tcp_user_timeout"] == "30000"
            cur = await conn.execute(
                "SELECT name, source FROM pg_settings WHERE name IN ('tcp_keepalives_idle', "
                "'tcp_keepalives_interval', 'tcp_keepalives_count', 'tcp_user_timeout')"
            )
            assert {source for _, source in await cur.fetchall()} == {"session"}
    finally:
        await held.release(rows_left=False)
        await tokens.close()


async def test_a_worker_cancelled_as_it_leaves_still_takes_its_row_and_session_away(
    backend: Backend,
) -> None:
    """A presence cancelled while it waits its turn to leave (another worker of the store
    object is joining or leaving) leaves all the same: no row outlives it."""
    store = backend.store
    inside, leave = asyncio.Event(), asyncio.Event()

    async def present() -> None:
        async with store.presence(worker("w1", backend.clock.now)):
            inside.set()
            await leave.wait()

    task = asyncio.create_task(present())
    await asyncio.wait_for(inside.wait(), fixtures.HANG_GUARD)
    async with store._sessions._guard:  # type: ignore[attr-defined]  # another's turn
        leave.set()
        await asyncio.sleep(0.2)  # it waits for its turn to leave
        task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await store.workers() == []
    async with store.presence(worker("w2", backend.clock.now)) as presence:
        assert [(w.worker_id, w.session) for w in await store.workers()] == [
            ("w2", presence.session)
        ]


async def test_a_hold_cancelled_while_it_waits_for_its_lock_leaves_no_connection(
    pg_backend: Backend,
) -> None:
    """Taking a session back waits while a watcher holds its lock for a moment; cancelled
    then, it closes the connection it made (which could hold the lock a moment later)."""
    import psycopg

    from tailrace.stores.postgres._connections import PostgresConnections
    from tailrace.stores.postgres._presence import PostgresTokens, session_key

    assert fixtures.POSTGRES_DSN is not None and pg_backend.execute is not None
    name = f"tr_hold_{os.getpid()}_{time.monotonic_ns() % 10**9}"
    dsn = fixtures.POSTGRES_DSN
    dsn += f"{'&' if '?' in dsn else '?'}application_name={name}"
    tokens = PostgresTokens(PostgresConnections(dsn).connect_session, "h", "test")

    async def connections() -> int:
        rows = await pg_backend.execute(  # type: ignore[misc]
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", (name,)
        )
        return int(rows[0][0])

    async with await psycopg.AsyncConnection.connect(fixtures.POSTGRES_DSN, autocommit=True) as w:
        await w.execute("SELECT pg_advisory_lock_shared(%s)", (session_key("h", "s"),))
        task = asyncio.create_task(tokens.hold("s"))
        await until(connections, "the hold to connect and wait")
        await asyncio.sleep(0.3)  # it tries the lock again and again
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await connections() == 0


async def test_a_watch_that_keeps_failing_says_so_once_and_keeps_watching(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A lock file this process cannot open (here a symbolic link to itself) fails every
    look: said once, as a store error, not a traceback every two seconds; the watch goes
    on and buries the session once it can see it die."""
    async with _watching_a_holder(tmp_path) as (store, proc, theirs, token):
        lock = FileTokens(store.path, "test")._file(theirs)
        aside = lock.with_suffix(".aside")
        lock.rename(aside)
        lock.symlink_to(lock.name)  # ELOOP on every open
        await _nudge(store)
        await asyncio.sleep(2 * 2.0 + 1.0)  # several failed looks, two seconds apart
        said = [r for r in caplog.records if "watching the ring" in r.getMessage()]
        assert len(said) == 1 and said[0].exc_info is None, said
        lock.unlink()
        aside.rename(lock)
        proc.kill()
        proc.wait()

        async def fenced() -> bool:
            return (await store.get_run("r0")).lease_token == token + 1

        await until(fenced, "the session to be buried once its lock file is back")


async def test_a_session_keeper_survives_a_failure_that_is_no_store_error(
    pg_backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    """Taking a session back fails with something unforeseen: said once with its
    traceback, tried again; the session comes back and its workers are told."""
    from tailrace.stores import PostgresStore
    from tailrace.stores._records import WorkerRow

    class Unforeseen(PostgresStore):
        failures = 2

        async def _join_session(
            self, session: str, workers: list[WorkerRow], *, again: bool
        ) -> frozenset[str]:
            if again and self.failures:
                self.failures -= 1
                raise RuntimeError("unforeseen")
            return await super()._join_session(session, workers, again=again)

    assert fixtures.POSTGRES_DSN is not None
    store = Unforeseen(fixtures.POSTGRES_DSN, schema=pg_backend.store.schema)
    async with store, store.presence(worker("w1", pg_backend.clock.now)) as mine:
        await _terminate_session(pg_backend, mine.session)
        lapse = await asyncio.wait_for(mine.lapse(), fixtures.HANG_GUARD)
        assert not lapse.buried and store.failures == 0
        assert [w.session for w in await store.workers()] == [mine.session]
    said = [r for r in caplog.records if "unforeseen" in str(r.exc_info)]
    assert len(said) == 1 and said[0].exc_info is not None, said


async def test_a_store_keeps_its_sessions_on_the_session_dsn(pg_backend: Backend) -> None:
    """Behind a pooler in transaction mode the pools use ``dsn``; what keeps a server
    session of its own (the store session's lock, the change feed's ``LISTEN``) connects
    to ``session_dsn``, and never to ``dsn``."""
    from tailrace.stores import PostgresStore
    from tailrace.stores.postgres._presence import session_key

    assert fixtures.POSTGRES_DSN is not None and pg_backend.execute is not None
    tag = f"{os.getpid()}_{time.monotonic_ns() % 10**9}"
    sep = "&" if "?" in fixtures.POSTGRES_DSN else "?"
    pooled = f"{fixtures.POSTGRES_DSN}{sep}application_name=pool_{tag}"
    direct = f"{fixtures.POSTGRES_DSN}{sep}application_name=direct_{tag}"
    schema = pg_backend.store.schema
    store = PostgresStore(pooled, schema=schema, session_dsn=direct)
    await submit(pg_backend.store, "r0", at=1.0)
    # A present worker watches the ring through the change feed: both sessions are up.
    async with store, store.presence(worker("w1", pg_backend.clock.now)) as mine:
        assert await store.claim_runs("q", "w1", TTL, limit=1) == ["r0"]  # through the pool
        assert [w.session for w in await store.workers()] == [mine.session]
        key = session_key(schema, mine.session)
        rows = await pg_backend.execute(
            "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a "
            "ON a.pid = l.pid WHERE l.locktype = 'advisory' AND l.granted "
            "AND l.classid = %s::bigint::oid AND l.objid = %s::bigint::oid "
            "AND l.objsubid = 1",
            ((key >> 32) & 0xFFFFFFFF, key & 0xFFFFFFFF),
        )
        assert rows == [(f"direct_{tag}",)], rows

        async def listening() -> list[tuple[Any, ...]]:
            return await pg_backend.execute(  # type: ignore[misc]
                "SELECT application_name FROM pg_stat_activity WHERE query LIKE 'LISTEN %%' "
                "AND application_name LIKE %s",
                (f"%{tag}",),
            )

        assert await until(listening, "the change feed to listen") == [(f"direct_{tag}",)]


async def test_a_store_closed_under_its_workers_leaves_its_lock_file_for_the_burier(
    tmp_path: Path,
) -> None:
    """A store closed while workers of it are present cannot remove their rows: its
    session's lock file stays, unlocked, and the fleet buries the session at once
    (a lock file gone while the session has rows would prove nothing)."""
    path = str(tmp_path / "db.sqlite")
    first, second = SQLiteStore(path), SQLiteStore(path)
    await first.open()
    await second.open()
    now = time.time()
    try:
        async with second.presence(worker("w2", now)), first.presence(worker("w1", now)):
            await first.close()  # its worker still present

            async def buried() -> bool:
                return [w.worker_id for w in await second.workers()] == ["w2"]

            await until(buried, "the closed store's session to be buried", guard=GRACE)
    finally:
        await first.close()
        await second.close()


async def test_news_of_the_ring_does_not_restart_a_graces_count(pg_backend: Backend) -> None:
    """A Postgres session found free at a first look (it died unwatched) gets its grace
    counted from then: news of the ring meanwhile (joins elsewhere, every second) makes
    the watcher look again but does not put its burial off."""
    from tailrace.stores.postgres._presence import ring_change
    from tailrace.stores.postgres._queues import notify_channel

    store = pg_backend.store
    assert pg_backend.execute is not None
    await submit(store, "r0", at=1.0)
    with holder(store, "doomed:1:0:x", 1) as (proc, _, _):
        proc.kill()
        proc.wait()
    token = (await store.get_run("r0")).lease_token

    async def buried() -> bool:
        return (await store.get_run("r0")).lease_token == token + 1

    async with store.presence(worker("late", pg_backend.clock.now, queues=("none",))) as mine:
        news = (notify_channel(store.schema), ring_change(mine.session))
        for _ in range(int(2 * GRACE)):  # news every second, for twice the grace
            if await buried():
                break
            await pg_backend.execute("SELECT pg_notify(%s, %s)", news)
            await asyncio.sleep(1.0)
        await until(buried, "the dead session to be buried", guard=1.0)


async def test_a_wait_that_ran_out_is_made_again_without_a_look(
    pg_backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """W7's idle cost: a watcher's wait on a live session runs out every ``WAIT`` (its
    snapshot would hold vacuum back) and is made again at once, as the one statement that
    waits (an aborted statement, no commit): no ``pg_try_advisory_lock_shared`` first.
    The holder ending between two waits is then a session that ended while watched."""
    import psycopg

    from tailrace.stores.postgres import _presence as tokens_module
    from tailrace.stores.postgres._connections import PostgresConnections

    assert fixtures.POSTGRES_DSN is not None and pg_backend.execute is not None
    monkeypatch.setattr(tokens_module, "_WATCHING", (("lock_timeout", "200"),))
    said: list[str] = []
    connections = PostgresConnections(fixtures.POSTGRES_DSN)

    async def connect() -> Any:
        conn = await connections.connect_session()
        execute = conn.execute

        async def traced(query: Any, *args: Any, **kwargs: Any) -> Any:
            said.append(str(query))
            return await execute(query, *args, **kwargs)

        conn.execute = traced  # type: ignore[method-assign]
        return conn

    tokens = tokens_module.PostgresTokens(connect, "h", "test")
    key = tokens_module.session_key("h", "s")
    try:
        async with await psycopg.AsyncConnection.connect(
            fixtures.POSTGRES_DSN, autocommit=True
        ) as holder:
            await holder.execute("SELECT pg_advisory_lock(%s)", (key,))
            ends = []
            for _ in range(3):
                async with tokens.outlive("s") as outlived:
                    ends.append(outlived)
            assert ends == [Outlived.WAITED_OUT] * 3
            looks = [q for q in said if "pg_try_advisory_lock_shared" in q]
            waits = [q for q in said if "SELECT pg_advisory_lock_shared" in q]
            assert (len(looks), len(waits)) == (1, 3), said
        # The holder's connection is gone: the next wait is granted at once, and counts as
        # an end seen while watching (buried without a grace), not as a lock found free.
        async with tokens.outlive("s") as outlived:
            assert outlived is Outlived.ENDED
        assert len([q for q in said if "pg_try_advisory_lock_shared" in q]) == 1, said
    finally:
        await tokens.close()
