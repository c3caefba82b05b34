"""Postgres run store: the same contract for many processes and hosts.

Built on psycopg 3 and its async pool; needs PostgreSQL 13 or newer
(``pg_xact_status``). Every write is one transaction; a commit locks its run
row (``SELECT ... FOR UPDATE``) before checking the fencing token, so two
engines can never both write the same run (D6). Migrations run under a
transaction-scoped advisory lock, so processes that start together do not
race; a database already at this code's version is opened without the lock
(``_schema``). Of racing artifact commits, the ``artifact_versions``
primary key lets one insert through and the others become
:class:`~tailrace.StaleVersion`. The tables live in ``schema`` (``public`` by
default), which lets several deployments, or tests, share one database.

Faults and cancellation (a lost connection, a server restart, a lost
``COMMIT`` answer, a cancelled caller) are handled by the connection layer in
``_connections``: every call re-runs its whole transaction on a fresh
connection within ``retry_budget``, a write is never applied twice, and a
connection always goes back to the pool. The operations are written once
in :class:`~tailrace.stores._sql._base.SQLStore`; this module runs their
bodies (:meth:`PostgresStore._read_tx`, :meth:`PostgresStore._write_tx`) as
:class:`~tailrace.stores.postgres._tx.PostgresTx` on the pool, and keeps the
two it sends in fewer round trips (``load_run``, ``release_lease``). The
statements live in ``_sql`` (Postgres's spelling of the shared statements),
the claims' locking in ``_queues``.

Every psycopg exception becomes ours in one place, ``_connections`` (with
``_errors``), naming the run, question or artifact. Requires the ``postgres`` extra:
``pip install 'tailrace[postgres]'``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import psycopg
from psycopg import sql

from ..._errors import StoreError
from .._changes import ChangeHub, Stop
from .._presence import Sessions
from .._records import StoredRun
from .._sql import _transactions as bodies
from .._sql._base import Body, SQLStore, Texts, Undo
from ._clock import OPEN_SAMPLES, REFRESH_SAMPLES, SERVER_CLOCK, Sample, ServerClock
from ._connections import Attempt, Conn, Landed, PostgresConnections, T
from ._presence import PostgresTokens
from ._queues import (
    FALLBACK_POLL,
    change_kinds,
    logger,
    notify_channel,
)
from ._sql import pg
from ._tx import PostgresTx

#: Opens a read that sees one moment (``_read_tx(snapshot=True)``).
SNAPSHOT = "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY"


class PostgresStore(SQLStore):
    """A store in PostgreSQL, shared by any number of engines.

    Args:
        dsn: libpq connection string or URL, e.g. ``postgresql://user@host/db``.
        min_size: connections the pool keeps open.
        max_size: most connections the pool opens.
        schema: schema holding the tables; created on ``open`` if missing.
        clock: a wall clock to stamp and judge leases' expiry and delays by,
            seconds since the epoch, instead of the server's (a test's fake
            clock; engines on several hosts then need clocks in step within a
            small part of the ttl). By default, the server's clock followed from
            here (``_clock``): every host of a fleet stamps on one timeline,
            within half a round trip plus the drift of a minute. Schedules'
            ticks are always judged by the server's clock (:meth:`now`).
        connect_timeout: seconds to wait for the server when connecting
            (libpq's rule: whole seconds, at least 2); ``open`` fails after
            that with the driver's reason.
        retry_budget: seconds one call may spend on transient failures (lost
            connections, a server restart, serialization failures, deadlocks)
            and on waiting for a free connection, re-running its transaction;
            then it raises :class:`~tailrace.StoreError` with the last reason.
        read_only: read an existing database and never write to it (see
            :class:`RunStore`); its sessions are read-only on the server too.
        session_dsn: where the connections that keep a server session of their
            own connect (each store session's lock, W7, and the change feed's
            ``LISTEN``): the same server as ``dsn``, directly or through a
            session-pooled port, when ``dsn`` goes through a pooler in transaction
            mode. By default, ``dsn``.
    """

    _no_limit = None

    def __init__(
        self,
        dsn: str,
        *,
        min_size: int = 1,
        max_size: int = 8,
        schema: str = "public",
        clock: Callable[[], float] | None = None,
        connect_timeout: float = 5.0,
        retry_budget: float = 15.0,
        read_only: bool = False,
        session_dsn: str | None = None,
    ) -> None:
        self._db = PostgresConnections(
            dsn, min_size=min_size, max_size=max_size, schema=schema,
            connect_timeout=connect_timeout, retry_budget=retry_budget, read_only=read_only,
            session_dsn=session_dsn,
        )  # fmt: skip
        where = f"Postgres store (schema {schema!r})"
        #: The server's clock followed from here, unless a clock was given.
        self._server_clock: ServerClock | None = None
        if clock is None:
            self._server_clock = self._clock = ServerClock(where)
        else:
            self._clock = clock
        self._channel = notify_channel(schema)
        self._hub = ChangeHub(self._listen)
        self._full_queues = set()
        self._sessions = Sessions(
            self, PostgresTokens(self._db.connect_session, schema, where), where
        )

    @property
    def schema(self) -> str:
        """The schema holding the tables."""
        return self._db.schema

    @property
    def read_only(self) -> bool:
        """Whether this store was opened read-only (it then refuses every write)."""
        return self._db.read_only

    async def open(self) -> None:
        """Connect, check the schema and apply pending migrations (none when read-only). Idempotent.

        One connection is made first, so an unreachable server fails here
        within ``connect_timeout`` with the driver's reason; then the pool opens.
        """
        await self._db.open()
        if self._server_clock is not None:
            await self._server_clock.measure(self._clock_sample, OPEN_SAMPLES)

    async def _clock_sample(self) -> Sample:
        """One reading of the server's clock, between two of this host's monotonic clock."""

        async def read(conn: Conn, attempt: Attempt) -> Sample:
            before = time.monotonic()
            cur = await conn.execute(SERVER_CLOCK)
            after = time.monotonic()
            row = await cur.fetchone()
            assert row is not None
            return before, float(row[0]), after

        return await self._db.read("reading the server's clock", read)

    async def _follow_server_clock(self) -> None:
        """Measure the server clock's offset again if it is time to (at most once a minute)."""
        if self._server_clock is not None and self._server_clock.due():
            try:
                await self._server_clock.measure(self._clock_sample, REFRESH_SAMPLES)
            except StoreError as exc:  # the offset held stays; the call meets the fault itself
                logger.info("the server's clock was not read again (%s); its offset stays", exc)

    async def _now(self) -> float:
        row = await self._read_tx("reading the server's clock", lambda tx: tx.one(SERVER_CLOCK, ()))
        assert row is not None
        return float(row[0])

    async def _read_tx(self, context: str, body: Body[T], *, snapshot: bool = False) -> T:
        await self._follow_server_clock()
        channel, schema = self._channel, self._db.schema

        async def read(conn: Conn, attempt: Attempt) -> T:
            if not snapshot:  # autocommit statements
                return await body(PostgresTx(conn, attempt, channel, schema))
            async with conn.transaction():
                await conn.execute(SNAPSHOT)
                return await body(PostgresTx(conn, attempt, channel, schema))

        return await self._db.read(context, read)

    async def _write_tx(
        self,
        context: str,
        body: Body[T],
        *,
        landed: Body[T] | None = None,
        texts: Texts | None = None,
        undo: Undo | None = None,
    ) -> T:
        await self._follow_server_clock()
        channel, schema = self._channel, self._db.schema
        settled: Landed[T] | None = None
        if landed is not None:
            settle = landed

            async def settled(conn: Conn) -> T:
                return await settle(PostgresTx(conn, Attempt(), channel, schema))

        async def work(conn: Conn, attempt: Attempt) -> T:
            return await body(PostgresTx(conn, attempt, channel, schema))

        if undo is None:
            return await self._db.write(context, work, landed=settled, texts=texts)
        try:
            return await self._db.write(context, work, landed=settled, texts=texts)
        except BaseException:
            # Failed or cancelled: undo what the body recorded, shielded, so the call
            # leaves nothing behind (a lease it granted, runs it claimed).
            compensation = undo()
            if compensation is not None:
                with contextlib.suppress(Exception):  # never hide the original failure
                    undoing = self._write_tx(f"{context}: undoing a failed call", compensation)
                    await self._db.shielded(undoing)
            raise

    async def _load_run(self, run_id: str) -> StoredRun:
        # The shared body, sent in fewer round trips: a bare run in one statement, else
        # the four reads pipelined in one snapshot.
        async def read(conn: Conn, attempt: Attempt) -> StoredRun:
            # A run with no node rows yet (a claimed run, about to start) in one statement.
            cur = await conn.execute(pg(bodies.SELECT_BARE_RUN), (run_id,))
            bare = bodies.bare_run(run_id, await cur.fetchone())
            if bare is not None:
                return bare
            # The run and its nodes as of one moment, the four reads sent together. The
            # transaction opens outside the pipeline (as a harvest's does): a caller
            # cancelled mid-pipeline then leaves it rolled back, never open on the pool.
            async with conn.transaction(), conn.pipeline():
                await conn.execute(SNAPSHOT)
                reads = [await conn.execute(pg(sql), (run_id,)) for sql in bodies.LOAD_RUN]
            return bodies.stored_run(run_id, [await cur.fetchall() for cur in reads])

        return await self._db.read(f"run {run_id!r}", read)

    async def _release_lease(self, run_id: str, owner: str, token: int) -> None:
        # The shared body in one autocommit statement, its wake-up included.
        channel = self._channel

        async def release(conn: Conn, attempt: Attempt) -> None:
            # One statement: the release and, if it released, a wake-up for workers.
            await conn.execute(
                "WITH released AS (UPDATE runs SET lease_owner = NULL, lease_expires = NULL "
                "WHERE run_id = %s AND lease_owner = %s AND lease_token = %s RETURNING 1) "
                "SELECT pg_notify(%s, 'release') FROM released",
                (run_id, owner, token, channel),
            )

        await self._db.write(f"run {run_id!r}", release, transaction=False)

    async def _listen(self, hub: ChangeHub) -> Stop:
        ready = asyncio.Event()
        task = asyncio.create_task(self._listen_loop(hub, ready), name="tailrace-pg-listen")
        await ready.wait()

        async def stop() -> None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

        return stop

    async def _listen_loop(self, hub: ChangeHub, ready: asyncio.Event) -> None:
        """Deliver notifications; while the connection is down, poll (report everything)."""
        listen = sql.SQL("LISTEN {}").format(sql.Identifier(self._channel))
        while True:
            try:
                async with await self._db.connect_session() as conn:
                    await conn.execute(listen)
                    if ready.is_set():
                        hub.deliver_all()  # back after an outage: what was missed meanwhile
                    ready.set()
                    async for note in conn.notifies():
                        hub.deliver(change_kinds(note.payload))
            except (psycopg.Error, OSError) as exc:
                logger.warning("listening for changes failed (%s); polling meanwhile", exc)
            ready.set()
            hub.deliver_all()
            await asyncio.sleep(FALLBACK_POLL)

    async def close(self) -> None:
        """Give the session up, stop listening, finish cleanups left by cancelled callers, close
        the pool. Idempotent."""
        await self._sessions.close()
        await self._hub.close()
        await self._db.close()
