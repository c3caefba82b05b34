"""Postgres connections and faults: the pool, retries, lost COMMITs, cancellation.

The machinery :class:`~tailrace.stores.PostgresStore` runs every call through
(a collaborator of the store, so that the store module holds the contract only).

Faults. A lost connection, a server restart (admin or crash shutdown, "the
database system is starting up"), a serialization failure or a deadlock
makes a call re-run its whole transaction on a fresh connection, with
bounded exponential backoff and jitter, for up to ``retry_budget`` seconds;
the pool checks each connection before handing it out (a ping when the
server sent it something, such as the end of a killed session). A write whose
``COMMIT`` may have reached the server before the connection died is never
applied twice: each write transaction learns its id from the server first,
and the retry asks ``pg_xact_status`` whether that transaction committed
(then the call has succeeded: same harvest, same effect) or not (then it is
re-run). An unreachable server is a :class:`~tailrace.StoreError` carrying
the driver's reason, after ``connect_timeout`` at ``open``.

Cancellation. Every call is cancellation-safe: a transaction either commits
whole or not at all, and a connection always goes back to the pool. On
CPython 3.11, psycopg_pool can drop a cancellation that arrives just as it
hands a connection over (see :meth:`PostgresConnections._checkout`); the
store delivers such a cancellation itself, so a timeout around a call is
honoured.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import math
import random
import select
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import psycopg
import psycopg_pool
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from ..._errors import StoreError
from .._rules import read_only_refusal
from .._sql._base import Texts
from ._errors import InDoubt, mapped_errors, refusal, transient
from ._schema import PostgresSchema

#: Logged under the store's name, where its operators look.
logger = logging.getLogger("tailrace.stores.postgres")

Conn = psycopg.AsyncConnection[Any]
Pool = psycopg_pool.AsyncConnectionPool[Conn]
T = TypeVar("T")

#: The first and the longest pause between two attempts of one call, seconds.
_FIRST_PAUSE, _LONGEST_PAUSE = 0.05, 1.0
#: What a session's connections ask of the client's TCP unless their DSN says otherwise:
#: a dead path is found within 25 s idle (10 s, then 3 probes 5 s apart), and data
#: unacknowledged for 30 s ends the connection.
SESSION_KEEPALIVES = {
    "keepalives": "1",
    "keepalives_idle": "10",
    "keepalives_interval": "5",
    "keepalives_count": "3",
    "tcp_user_timeout": "30000",
}
#: The transaction's id, which ``pg_xact_status`` takes after a lost connection.
XID = "pg_current_xact_id()::text"

#: What a transaction does: statements on ``conn``; a write records its id in the attempt.
Work = Callable[[Conn, "Attempt"], Awaitable[T]]
#: What a write returns when its earlier attempt turns out to have committed.
Landed = Callable[[Conn], Awaitable[T]]


@dataclasses.dataclass(slots=True)
class Attempt:
    """One run of a transaction; ``xid`` is its id, once the server told it (before any COMMIT)."""

    xid: str | None = None


async def nothing(conn: Conn) -> None:
    """The result of a write that returns nothing, once it turned out to have committed."""


class PostgresConnections:
    """Pooled connections to one Postgres schema, and calls run on them with retries.

    The collaborator :class:`~tailrace.stores.PostgresStore` runs every call
    through; it takes the store's arguments (documented there) but the clock.
    """

    def __init__(
        self,
        dsn: str,
        *,
        min_size: int = 1,
        max_size: int = 8,
        schema: str = "public",
        connect_timeout: float = 5.0,
        retry_budget: float = 15.0,
        read_only: bool = False,
        session_dsn: str | None = None,
    ) -> None:
        self._dsn = dsn
        self._session_dsn = dsn if session_dsn is None else session_dsn
        self._min_size = min_size
        self._max_size = max_size
        self._schema = schema
        self._connect_timeout = max(2, math.ceil(connect_timeout))
        self._retry_budget = retry_budget
        self._read_only = read_only
        self._where = f"Postgres store (schema {schema!r})"
        self._pool: Pool | None = None
        #: Work that must finish although its caller was cancelled (connections
        #: going back to the pool, leases released): ``close`` waits for it.
        self._cleanups: set[asyncio.Task[Any]] = set()

    @property
    def schema(self) -> str:
        """The schema holding the tables."""
        return self._schema

    @property
    def read_only(self) -> bool:
        """Whether this store was opened read-only (it then refuses every write)."""
        return self._read_only

    # -- connections, retries, cancellation -----------------------------------------

    async def _configure(self, conn: Conn) -> None:
        await conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(self._schema)))
        if self._read_only:  # the server refuses writes too, whatever a bug might send
            await conn.execute("SET default_transaction_read_only = on")

    async def connect(self) -> Conn:
        """A connection of our own (not pooled), in autocommit mode."""
        return await psycopg.AsyncConnection.connect(
            self._dsn, autocommit=True, connect_timeout=self._connect_timeout
        )

    async def connect_session(self) -> Conn:
        """A connection of our own that keeps a session of the server's (a store session's
        token, W7; the change feed's ``LISTEN``), on the session DSN, in autocommit mode,
        with TCP keepalives and a TCP user timeout (:data:`SESSION_KEEPALIVES`) unless the
        DSN sets them: it sits idle or waiting for a lock, and a path that died under it
        (a NAT that forgot it, a host cut off) must end it within seconds, not hours."""
        given = conninfo_to_dict(self._session_dsn)
        extra = {k: v for k, v in SESSION_KEEPALIVES.items() if k not in given}
        return await psycopg.AsyncConnection.connect(
            make_conninfo(self._session_dsn, **extra),
            autocommit=True,
            connect_timeout=self._connect_timeout,
        )

    async def open(self) -> None:
        """Connect, check the schema and apply pending migrations (none when read-only). Idempotent.

        One connection is made first, so an unreachable server fails here
        within ``connect_timeout`` with the driver's reason; then the pool opens.
        """
        if self._pool is not None:
            return
        with mapped_errors(self._where, "cannot connect to the server: "):
            conn = await self.connect()
        with mapped_errors(self._where):
            async with conn:
                await self._configure(conn)
                await PostgresSchema(self._schema, self._read_only, self._where).prepare(conn)
        pool: Pool = psycopg_pool.AsyncConnectionPool(
            self._dsn,
            min_size=self._min_size,
            max_size=self._max_size,
            open=False,
            kwargs={"autocommit": True, "connect_timeout": self._connect_timeout},
            configure=self._configure,
            check=check_connection,  # a restart breaks them all
            timeout=self._retry_budget,
        )
        await pool.open(wait=False)  # the first call waits for a connection, within its budget
        self._pool = pool

    async def close(self) -> None:
        """Finish cleanups left by cancelled callers, then close the pool. Idempotent."""
        while self._cleanups:
            await asyncio.gather(*self._cleanups, return_exceptions=True)
        pool, self._pool = self._pool, None
        if pool is not None:
            with mapped_errors(self._where, "closing the pool: "):
                await pool.close()

    def _open_pool(self, context: str) -> Pool:
        if self._pool is None:
            raise StoreError(f"{context}: the Postgres store is not open")
        return self._pool

    @contextlib.asynccontextmanager
    async def _checkout(self, pool: Pool, patience: float) -> AsyncIterator[Conn]:
        """A pooled connection, which goes back to the pool whatever happens to the caller.

        psycopg_pool waits for a free connection in ``WaitingClient.wait``
        with ``asyncio.wait_for``. On CPython 3.11, when the wait ends (a
        connection was handed over) in the same loop iteration as a
        ``cancel()`` of the waiting task, ``wait_for`` returns the connection
        and the cancellation is gone (CPython gh-86296, fixed in 3.12 only;
        psycopg issues #1345 and #1413): ``cancel()`` returned True and the
        task's ``cancelling()`` count went up, but no ``CancelledError`` ever
        comes, so an ``asyncio.timeout`` around the call never fires. That
        count tells: if it grew while we waited, we deliver the cancellation.
        """
        task = asyncio.current_task()
        requested = task.cancelling() if task is not None else 0
        conn = await pool.getconn(timeout=max(patience, 0.001))
        try:
            if task is not None and task.cancelling() > requested:
                raise asyncio.CancelledError  # the one the pool swallowed
            yield conn
        finally:
            # The pool takes a connection back under its own locks; a cancellation
            # there would lose the connection, and the pool a slot for good.
            await self.shielded(pool.putconn(conn))

    async def shielded(self, work: Coroutine[Any, Any, T]) -> T:
        """Run ``work`` to its end even if the caller is cancelled meanwhile.

        The caller still gets its ``CancelledError`` at once; the work goes on
        in a task of the store's, which ``close`` waits for.
        """
        task = asyncio.ensure_future(work)
        self._cleanups.add(task)
        task.add_done_callback(self._cleanup_done)
        return await asyncio.shield(task)

    def _cleanup_done(self, task: asyncio.Task[Any]) -> None:
        self._cleanups.discard(task)
        # Retrieve the outcome here: a cancelled caller never awaits it.
        if not task.cancelled() and task.exception() is not None:
            logger.debug("%s: cleanup failed", self._where, exc_info=task.exception())

    async def read(self, context: str, work: Work[T]) -> T:
        """Run ``work`` (autocommit statements, or its own read transaction), retried (see ``_run``)."""
        return await self._run(context, work, landed=None, texts=None, transaction=False)

    async def write(
        self,
        context: str,
        work: Work[T],
        *,
        landed: Landed[T] | None = None,
        texts: Texts | None = None,
        transaction: bool = True,
    ) -> T:
        """Run ``work`` in one transaction, retried; refused by a read-only store.

        ``landed`` gives the result when an earlier attempt, whose COMMIT's
        answer was lost, turns out to have committed; ``work`` must then record
        the transaction's id in its attempt before its first write. Without
        ``landed``, ``work`` must be idempotent (re-running it is harmless).
        """
        if self._read_only:
            raise read_only_refusal(self._where, context)
        return await self._run(
            context, work, landed=landed, texts=texts, transaction=transaction or landed is not None
        )

    async def _run(
        self,
        context: str,
        work: Work[T],
        *,
        landed: Landed[T] | None,
        texts: Texts | None,
        transaction: bool,
    ) -> T:
        """Run ``work`` on a pooled connection; re-run it whole on a fresh one after a transient failure.

        Attempts go on, with growing pauses, until ``retry_budget`` is spent.
        A write whose attempt failed once it had an id (its COMMIT may have
        landed) is settled by ``pg_xact_status`` before anything is re-run.
        """
        pool = self._open_pool(context)
        deadline = time.monotonic() + self._retry_budget
        in_doubt: str | None = None
        for attempt in itertools.count(1):
            run = Attempt()
            try:
                async with self._checkout(pool, deadline - time.monotonic()) as conn:
                    if in_doubt is not None and landed is not None:
                        if await committed(conn, in_doubt, context):
                            return await landed(conn)
                        in_doubt = None
                    if not transaction:
                        return await work(conn, run)
                    async with conn.transaction():
                        return await work(conn, run)
            except psycopg_pool.PoolTimeout as exc:
                raise await self._no_connection(context, exc, in_doubt=in_doubt) from exc
            except (psycopg.Error, UnicodeEncodeError, InDoubt) as exc:
                if not transient(exc):
                    raise refusal(context, exc, texts) from exc
                in_doubt = run.xid or in_doubt
                await pause(context, exc, attempt, deadline)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _no_connection(
        self, context: str, exc: psycopg_pool.PoolTimeout, *, in_doubt: str | None
    ) -> StoreError:
        """The error for a call that got no connection within its budget, with the server's reason.

        ``in_doubt`` is the id of an earlier attempt whose COMMIT may have landed.
        """
        unknown = (
            f"; the connection was lost during the COMMIT of transaction {in_doubt}: "
            "whether it was written is unknown"
            if in_doubt is not None
            else ""
        )
        try:
            probe = await self.connect()
        except psycopg.Error as reason:
            return StoreError(
                f"{context}: cannot reach the Postgres server "
                f"(retried for {self._retry_budget:g} s): {reason}{unknown}"
            )
        await probe.close()
        return StoreError(
            f"{context}: no pooled Postgres connection came free within "
            f"{self._retry_budget:g} s (max_size={self._max_size}): {exc}{unknown}"
        )


# --- faults ---------------------------------------------------------------------------


async def check_connection(conn: Conn) -> None:
    """The pool's check before it hands ``conn`` out: raise if the server closed it.

    A server that restarts, or terminates a backend, closes its socket (after a
    FATAL message), so an idle connection it killed has something to read.
    Only then is the connection pinged (``AsyncConnectionPool.check_connection``,
    one round trip): a quiet socket costs one ``poll`` instead of a round trip
    on every call. A connection that dies unnoticed all the same fails its
    first statement, and the call re-runs on a fresh one.
    """
    if conn.closed or conn.broken:
        raise psycopg.OperationalError("the connection is closed")
    if readable(conn.pgconn.socket):
        await psycopg_pool.AsyncConnectionPool.check_connection(conn)


def readable(fd: int) -> bool:
    """Whether socket ``fd`` has data or an end of file waiting, without blocking."""
    if hasattr(select, "poll"):  # no FD_SETSIZE limit
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return bool(poller.poll(0))
    return bool(select.select([fd], [], [], 0)[0])


async def pause(context: str, exc: BaseException, attempt: int, deadline: float) -> None:
    """Sleep before attempt ``attempt + 1``: exponential, jittered, within ``deadline``; else give up."""
    left = deadline - time.monotonic()
    if left <= 0:
        unknown = " (the connection was lost during COMMIT: whether it was written is unknown)"
        outcome = unknown if isinstance(exc, InDoubt) else ""
        raise StoreError(f"{context}: {exc}{outcome} (gave up after {attempt} attempts)") from exc
    # Full jitter: engines that lost the server together do not come back in step.
    pause = random.uniform(0, min(_LONGEST_PAUSE, _FIRST_PAUSE * 2 ** (attempt - 1)))
    log = logger.warning if attempt == 1 else logger.info
    log("%s: %s; retrying (attempt %d)", context, one_line(exc), attempt + 1)
    await asyncio.sleep(min(pause, left))


def one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


async def committed(conn: Conn, xid: str, context: str) -> bool:
    """Whether transaction ``xid``, whose COMMIT's answer was lost, committed; ``InDoubt`` while it runs."""
    cur = await conn.execute("SELECT pg_xact_status(%s::xid8)", (xid,))
    row = await cur.fetchone()
    status: str | None = row[0] if row is not None else None
    if status == "in progress":  # its backend has not noticed the lost connection yet
        raise InDoubt(f"transaction {xid} is still in progress on the server")
    if status not in ("committed", "aborted"):
        raise StoreError(
            f"{context}: the connection was lost during COMMIT and the server no longer "
            f"knows transaction {xid} ({status!r}): whether it was written is unknown"
        )
    if status == "committed":
        logger.info("%s: the lost COMMIT of transaction %s had landed", context, xid)
    return status == "committed"
