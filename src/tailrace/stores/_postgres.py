"""Postgres run store: the same contract for many processes and hosts.

Built on psycopg 3 and its async pool; needs PostgreSQL 13 or newer
(``pg_xact_status``). Every write is one transaction; a commit locks its run
row (``SELECT ... FOR UPDATE``) before checking the fencing token, so two
engines can never both write the same run (D6). Migrations run under a
transaction-scoped advisory lock, so processes that start together do not
race; a database already at this code's version is opened without the lock.
Of racing artifact commits, the ``artifact_versions`` primary key lets one
insert through and the others become :class:`~tailrace.StaleVersion`. The
tables live in ``schema`` (``public`` by default), which lets several
deployments, or tests, share one database.

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
hands a connection over (see :meth:`PostgresStore._checkout`); the store
delivers such a cancellation itself, so a timeout around a call is honoured.

Every psycopg exception becomes ours at this seam (CONVENTIONS 3), naming the
run, question or artifact. Requires the ``postgres`` extra:
``pip install 'tailrace[postgres]'``.
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
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable, Iterator
from typing import Any, TypeVar

import psycopg
import psycopg_pool
from psycopg import sql

from .._errors import RunExists, RunNotFound, StoreError, UnsupportedFormat
from ._artifacts import check_expected, stale_version
from ._base import (
    ArtifactVersion,
    EventRow,
    FrozenInput,
    Harvest,
    NewRun,
    NodeRow,
    QuestionRow,
    QuestionStatus,
    ResultRow,
    RunRecord,
    RunStatus,
    RunStore,
    StoredRun,
)
from ._rules import (
    answer_status,
    check_apply_deferral,
    check_commit,
    check_harvest,
    check_holder,
    check_name,
    check_names,
    check_new_format,
    check_readable,
    check_ttl,
    grant_lease,
    not_applicable,
    not_open,
    parse_question_status,
    parse_status,
    question_not_found,
    read_only_refusal,
)
from ._sql import (
    ANSWER_QUESTION,
    APPLY_QUESTION,
    ARTIFACT_HEAD_VERSION,
    CREATE_MIGRATIONS_TABLE,
    DEFER_ANSWER,
    DUE_ANSWERS,
    EVENT_COLUMNS,
    EXPIRED_LEASES,
    INSERT_ARTIFACT,
    INSERT_RUN,
    MIGRATIONS,
    QUESTION_STATE,
    RUN_COLUMNS,
    SCHEMA_VERSION,
    SELECT_ARTIFACT_HEAD,
    SELECT_ARTIFACT_HISTORY,
    SELECT_QUESTION,
    SUPERSEDE_QUESTION,
    UPDATE_RUN,
    UPSERT_NODE,
    artifact_from_row,
    artifact_params,
    event_from_row,
    harvest_rows,
    list_questions_query,
    new_run_params,
    node_params,
    question_from_row,
    record_from_row,
    run_update_params,
)

logger = logging.getLogger(__name__)

#: First key of the advisory lock that serialises migrations ("tr").
_MIGRATION_LOCK = 0x7472
_Conn = psycopg.AsyncConnection[Any]
_Pool = psycopg_pool.AsyncConnectionPool[_Conn]
_T = TypeVar("_T")

#: SQLSTATEs (besides class 08, connection exceptions) after which re-running the
#: whole transaction on a fresh connection is right: admin shutdown, crash
#: shutdown, "cannot connect now", serialization failure, deadlock.
_RETRIED_SQLSTATES = frozenset({"57P01", "57P02", "57P03", "40001", "40P01"})
#: The first and the longest pause between two attempts of one call, seconds.
_FIRST_PAUSE, _LONGEST_PAUSE = 0.05, 1.0
#: The transaction's id, which ``pg_xact_status`` takes after a lost connection.
_XID = "pg_current_xact_id()::text"


def _pg(statement: str) -> str:
    """The shared SQL with psycopg's placeholders."""
    return statement.replace("?", "%s")


def _returning_xid(statement: str) -> str:
    """``statement`` (an UPDATE or INSERT of the shared SQL) also returning the transaction id."""
    return f"{_pg(statement)} RETURNING {_XID}"


_SELECT_RUN = f"SELECT {RUN_COLUMNS} FROM runs WHERE run_id = %s"
_LOCK_LEASE = (
    f"SELECT lease_owner, lease_expires, lease_token, {_XID} FROM runs WHERE run_id = %s FOR UPDATE"
)
_LOCK_FOR_COMMIT = (
    f"SELECT status, format_version, lease_token, {_XID} FROM runs WHERE run_id = %s FOR UPDATE"
)
_INSERT_RUN = f"{_pg(INSERT_RUN)} ON CONFLICT (run_id) DO NOTHING RETURNING {_XID}"
_ANSWER_QUESTION = f"{_pg(ANSWER_QUESTION)}, {_XID}"  # it already returns the row
_INSERT_ARTIFACT = f"{_pg(INSERT_ARTIFACT)} ON CONFLICT DO NOTHING RETURNING {_XID}"

#: What a transaction does: statements on ``conn``; a write records its id in the attempt.
_Work = Callable[[_Conn, "_Attempt"], Awaitable[_T]]
#: What a write returns when its earlier attempt turns out to have committed.
_Landed = Callable[[_Conn], Awaitable[_T]]
#: The texts a write stores, by name, to name the one the driver refused.
_Texts = Callable[[], Iterable[tuple[str, str | None]]]


@dataclasses.dataclass(slots=True)
class _Attempt:
    """One run of a transaction; ``xid`` is its id, once the server told it (before any COMMIT)."""

    xid: str | None = None


class _InDoubt(Exception):
    """An earlier attempt's transaction is still in progress on the server: ask again later."""


async def _nothing(conn: _Conn) -> None:
    """The result of a write that returns nothing, once it turned out to have committed."""


class PostgresStore(RunStore):
    """A store in PostgreSQL, shared by any number of engines.

    Args:
        dsn: libpq connection string or URL, e.g. ``postgresql://user@host/db``.
        min_size: connections the pool keeps open.
        max_size: most connections the pool opens.
        schema: schema holding the tables; created on ``open`` if missing.
        clock: wall clock for lease expiry, seconds since the epoch. Engines on
            several hosts need clocks in step within a small part of the ttl.
        connect_timeout: seconds to wait for the server when connecting
            (libpq's rule: whole seconds, at least 2); ``open`` fails after
            that with the driver's reason.
        retry_budget: seconds one call may spend on transient failures (lost
            connections, a server restart, serialization failures, deadlocks)
            and on waiting for a free connection, re-running its transaction;
            then it raises :class:`~tailrace.StoreError` with the last reason.
        read_only: read an existing database and never write to it (see
            :class:`RunStore`); its sessions are read-only on the server too.
    """

    def __init__(
        self,
        dsn: str,
        *,
        min_size: int = 1,
        max_size: int = 8,
        schema: str = "public",
        clock: Callable[[], float] = time.time,
        connect_timeout: float = 5.0,
        retry_budget: float = 15.0,
        read_only: bool = False,
    ) -> None:
        self._dsn = dsn
        self._min_size = min_size
        self._max_size = max_size
        self._schema = schema
        self._clock = clock
        self._connect_timeout = max(2, math.ceil(connect_timeout))
        self._retry_budget = retry_budget
        self._read_only = read_only
        self._where = f"Postgres store (schema {schema!r})"
        self._pool: _Pool | None = None
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

    async def _configure(self, conn: _Conn) -> None:
        await conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(self._schema)))
        if self._read_only:  # the server refuses writes too, whatever a bug might send
            await conn.execute("SET default_transaction_read_only = on")

    async def _connect(self) -> _Conn:
        """A connection of our own (not pooled), in autocommit mode."""
        return await psycopg.AsyncConnection.connect(
            self._dsn, autocommit=True, connect_timeout=self._connect_timeout
        )

    async def open(self) -> None:
        """Connect, check the schema and apply pending migrations (none when read-only). Idempotent.

        One connection is made first, so an unreachable server fails here
        within ``connect_timeout`` with the driver's reason; then the pool opens.
        """
        if self._pool is not None:
            return
        try:
            conn = await self._connect()
        except psycopg.Error as exc:
            raise StoreError(f"{self._where}: cannot connect to the server: {exc}") from exc
        try:
            async with conn:
                await self._configure(conn)
                await self._prepare_schema(conn)
        except psycopg.Error as exc:
            raise StoreError(f"{self._where}: {exc}") from exc
        pool: _Pool = psycopg_pool.AsyncConnectionPool(
            self._dsn,
            min_size=self._min_size,
            max_size=self._max_size,
            open=False,
            kwargs={"autocommit": True, "connect_timeout": self._connect_timeout},
            configure=self._configure,
            check=_check_connection,  # a restart breaks them all
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
            try:
                await pool.close()
            except psycopg.Error as exc:
                raise StoreError(f"{self._where}: closing the pool: {exc}") from exc

    def _open_pool(self, context: str) -> _Pool:
        if self._pool is None:
            raise StoreError(f"{context}: the Postgres store is not open")
        return self._pool

    @contextlib.asynccontextmanager
    async def _checkout(self, pool: _Pool, patience: float) -> AsyncIterator[_Conn]:
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
            await self._shielded(pool.putconn(conn))

    async def _shielded(self, work: Coroutine[Any, Any, _T]) -> _T:
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

    async def _read(self, context: str, work: _Work[_T]) -> _T:
        """Run ``work`` (autocommit statements, or its own read transaction), retried (see ``_run``)."""
        return await self._run(context, work, landed=None, texts=None, transaction=False)

    async def _write(
        self,
        context: str,
        work: _Work[_T],
        *,
        landed: _Landed[_T] | None = None,
        texts: _Texts | None = None,
        transaction: bool = True,
    ) -> _T:
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
        work: _Work[_T],
        *,
        landed: _Landed[_T] | None,
        texts: _Texts | None,
        transaction: bool,
    ) -> _T:
        """Run ``work`` on a pooled connection; re-run it whole on a fresh one after a transient failure.

        Attempts go on, with growing pauses, until ``retry_budget`` is spent.
        A write whose attempt failed once it had an id (its COMMIT may have
        landed) is settled by ``pg_xact_status`` before anything is re-run.
        """
        pool = self._open_pool(context)
        deadline = time.monotonic() + self._retry_budget
        in_doubt: str | None = None
        for attempt in itertools.count(1):
            run = _Attempt()
            try:
                async with self._checkout(pool, deadline - time.monotonic()) as conn:
                    if in_doubt is not None and landed is not None:
                        if await _committed(conn, in_doubt, context):
                            return await landed(conn)
                        in_doubt = None
                    if not transaction:
                        return await work(conn, run)
                    async with conn.transaction():
                        return await work(conn, run)
            except psycopg_pool.PoolTimeout as exc:
                raise await self._no_connection(context, exc, in_doubt=in_doubt) from exc
            except (psycopg.Error, UnicodeEncodeError, _InDoubt) as exc:
                if not _transient(exc):
                    raise _refusal(context, exc, texts) from exc
                in_doubt = run.xid or in_doubt
                await _pause(context, exc, attempt, deadline)
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
            probe = await self._connect()
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

    # -- schema ---------------------------------------------------------------------

    async def _prepare_schema(self, conn: _Conn) -> None:
        """Check the schema version; migrate only when needed, and never when read-only (D4)."""
        current = await self._recorded_version(conn)
        if current is not None and current > SCHEMA_VERSION:
            raise self._newer_schema(current)
        if self._read_only:
            if current is None:
                raise StoreError(
                    f"{self._where}: no tailrace tables in this database and schema "
                    "(opened read-only, so none were created)"
                )
            if current < SCHEMA_VERSION:
                raise StoreError(
                    f"{self._where}: schema version {current} is older than this tailrace's "
                    f"({SCHEMA_VERSION}); open it once without read_only to migrate it"
                )
            return
        if current != SCHEMA_VERSION:
            await self._migrate(conn)

    def _newer_schema(self, current: int) -> UnsupportedFormat:
        return UnsupportedFormat(
            f"{self._where}: database schema version {current} is newer than this tailrace "
            f"supports ({SCHEMA_VERSION}); upgrade tailrace. Nothing was written."
        )

    async def _migrate(self, conn: _Conn) -> None:
        """Apply pending migrations in one transaction, under an advisory lock (D4)."""
        async with conn.transaction():
            await conn.execute(
                "SELECT pg_advisory_xact_lock(%s, hashtext(%s))", (_MIGRATION_LOCK, self._schema)
            )
            current = await self._recorded_version(conn)  # again: another process may have won
            if current is not None and current > SCHEMA_VERSION:
                raise self._newer_schema(current)
            if current is None:
                await self._create_schema(conn)
                await conn.execute(CREATE_MIGRATIONS_TABLE)
                current = 0
            for version, statements in MIGRATIONS:
                if version > current:
                    for statement in statements:
                        await conn.execute(statement)
                    await conn.execute(
                        "INSERT INTO schema_migrations (version, applied_at) VALUES (%s, %s)",
                        (version, time.time()),
                    )

    async def _recorded_version(self, conn: _Conn) -> int | None:
        cur = await conn.execute(
            "SELECT 1 FROM pg_tables WHERE schemaname = %s AND tablename = 'schema_migrations'",
            (self._schema,),
        )
        if await cur.fetchone() is None:
            return None
        cur = await conn.execute("SELECT MAX(version) FROM schema_migrations")
        row = await cur.fetchone()
        return int(row[0]) if row is not None and row[0] is not None else 0

    async def _create_schema(self, conn: _Conn) -> None:
        cur = await conn.execute("SELECT 1 FROM pg_namespace WHERE nspname = %s", (self._schema,))
        if await cur.fetchone() is None:  # CREATE needs a privilege an existing schema does not
            await conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(self._schema)))

    # -- runs -----------------------------------------------------------------------

    async def create_run(self, run: NewRun) -> None:
        """Store ``run`` with status ``running``; ``RunExists`` if its id is taken."""
        check_new_format(run)
        check_names(
            run_id=run.run_id, graph_name=run.graph_name, graph_ref=run.graph_ref,
            fingerprint=run.fingerprint,
        )  # fmt: skip

        async def insert(conn: _Conn, attempt: _Attempt) -> None:
            cur = await conn.execute(_INSERT_RUN, new_run_params(run))
            row = await cur.fetchone()
            if row is None:
                raise RunExists(f"run {run.run_id!r} already exists")
            attempt.xid = row[0]

        await self._write(
            f"run {run.run_id!r}", insert, landed=_nothing,
            texts=lambda: [("input_json", run.input_json)],
        )  # fmt: skip

    async def commit(self, run_id: str, token: int, harvest: Harvest) -> None:
        """Apply ``harvest`` to ``run_id`` in one transaction if ``token`` is current (D1, D6, Q3).

        Idempotent across a lost connection: when the answer to the COMMIT is
        lost, the retry finds the transaction committed and returns, and the
        harvest is not applied a second time.
        """
        check_harvest(run_id, harvest)
        now = self._clock()  # once, so that a re-run writes the very same rows

        async def write(conn: _Conn, attempt: _Attempt) -> None:
            status, version, lease_token, attempt.xid = await _fetch_run_row(
                conn, _LOCK_FOR_COMMIT, run_id
            )
            check_commit(
                run_id, current=parse_status(run_id, status), format_version=version,
                lease_token=lease_token, token=token, new=harvest.status,
            )  # fmt: skip
            try:
                await _write_harvest(conn, run_id, harvest, now)
            except psycopg.errors.UniqueViolation as exc:  # nothing committed is rewritten (D1)
                raise StoreError(
                    f"run {run_id!r}: harvest would rewrite a committed row "
                    f"({exc.diag.message_detail}); nothing of it was written"
                ) from exc
            await _apply_question_changes(conn, run_id, harvest, now)  # may refuse it all

        await self._write(
            f"run {run_id!r}", write, landed=_nothing, texts=lambda: _harvest_texts(harvest)
        )

    async def load_run(self, run_id: str) -> StoredRun:
        """Return run ``run_id`` with its node rows; ``UnsupportedFormat`` if written by a newer tailrace."""
        check_name("run_id", run_id)

        async def read(conn: _Conn, attempt: _Attempt) -> StoredRun:
            async with conn.transaction():
                await conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
                record = record_from_row(await _fetch_run_row(conn, _SELECT_RUN, run_id))
                check_readable(run_id, record.format_version)
                cur = await conn.execute(
                    "SELECT node_id, status, visits, data_json FROM node_states WHERE run_id = %s",
                    (run_id,),
                )
                nodes = {
                    r[0]: NodeRow(node_id=r[0], status=r[1], visits=r[2], data_json=r[3])
                    for r in await cur.fetchall()
                }
            return StoredRun(run=record, nodes=nodes)

        return await self._read(f"run {run_id!r}", read)

    async def get_run(self, run_id: str) -> RunRecord:
        """Return the record of run ``run_id``; ``RunNotFound`` if absent."""
        check_name("run_id", run_id)

        async def read(conn: _Conn, attempt: _Attempt) -> RunRecord:
            return record_from_row(await _fetch_run_row(conn, _SELECT_RUN, run_id))

        return await self._read(f"run {run_id!r}", read)

    async def list_runs(
        self, *, status: RunStatus | None = None, limit: int | None = None
    ) -> list[RunRecord]:
        """Runs newest first (``created_at``, then ``run_id``), only ``status`` ones if given, at most ``limit``."""
        where = "" if status is None else "WHERE status = %s"
        params: tuple[object, ...] = () if status is None else (status.value,)
        params += (None if limit is None else max(limit, 0),)
        query = (
            f"SELECT {RUN_COLUMNS} FROM runs {where} ORDER BY created_at DESC, run_id DESC LIMIT %s"
        )
        rows = await self._read("listing runs", _fetch_all(query, params))
        return [record_from_row(r) for r in rows]

    async def results(self, run_id: str, node_id: str | None = None) -> list[ResultRow]:
        """Result rows of ``run_id`` (only ``node_id``'s if given), by node then visit."""
        check_names(run_id=run_id, node_id=node_id)
        query = "SELECT node_id, visit, value_json FROM results WHERE run_id = %s"
        params: tuple[object, ...] = (run_id,)
        if node_id is not None:
            query, params = query + " AND node_id = %s", (run_id, node_id)
        rows = await self._select_of_run(run_id, query + " ORDER BY node_id, visit", params)
        return [ResultRow(node_id=r[0], visit=r[1], value_json=r[2]) for r in rows]

    async def frozen_inputs(self, run_id: str) -> list[FrozenInput]:
        """First-k decisions of ``run_id``, by node then activation (E4)."""
        check_name("run_id", run_id)
        rows = await self._select_of_run(
            run_id,
            "SELECT node_id, activation, payload_json FROM frozen_inputs WHERE run_id = %s "
            "ORDER BY node_id, activation",
            (run_id,),
        )
        return [FrozenInput(node_id=r[0], activation=r[1], payload_json=r[2]) for r in rows]

    async def events(self, run_id: str, *, after_seq: int = 0) -> list[EventRow]:
        """Events of ``run_id`` with ``seq > after_seq``, in seq order."""
        check_name("run_id", run_id)
        rows = await self._select_of_run(
            run_id,
            f"SELECT {EVENT_COLUMNS} FROM events WHERE run_id = %s AND seq > %s ORDER BY seq",
            (run_id, after_seq),
        )
        return [event_from_row(r) for r in rows]

    async def _select_of_run(
        self, run_id: str, query: str, params: tuple[object, ...]
    ) -> list[tuple[Any, ...]]:
        """Rows of ``query``, or :class:`RunNotFound` when the run does not exist."""

        async def read(conn: _Conn, attempt: _Attempt) -> list[tuple[Any, ...]]:
            cur = await conn.execute(query, params)
            rows = await cur.fetchall()
            if not rows:
                await _fetch_run_row(conn, "SELECT 1 FROM runs WHERE run_id = %s", run_id)
            return rows

        return await self._read(f"run {run_id!r}", read)

    # -- leases (D6) ------------------------------------------------------------------

    async def acquire_lease(
        self, run_id: str, owner: str, ttl: float, *, steal_from: str | None = None
    ) -> int:
        """Lease ``run_id`` to ``owner`` for ``ttl`` seconds, from ``steal_from`` if it holds it; return the token (D6).

        A call that fails or is cancelled after granting a new lease releases
        it (shielded) before raising, so it leaves no lease behind.
        """
        check_ttl(ttl)
        check_names(run_id=run_id, owner=owner, steal_from=steal_from)
        granted: list[int] = []  # new tokens this call wrote (a re-acquire keeps its token)

        async def grant(conn: _Conn, attempt: _Attempt) -> int:
            holder, expires, lease_token, attempt.xid = await _fetch_run_row(
                conn, _LOCK_LEASE, run_id
            )
            now = self._clock()
            token = grant_lease(
                run_id, owner, now=now, holder=holder, expires=expires, lease_token=lease_token,
                steal_from=steal_from,
            )  # fmt: skip
            if token != lease_token:
                granted.append(token)
            await conn.execute(
                "UPDATE runs SET lease_owner = %s, lease_expires = %s, lease_token = %s "
                "WHERE run_id = %s",
                (owner, now + ttl, token, run_id),
            )
            return token

        try:
            return await self._write(f"run {run_id!r}", grant)  # a re-run finds it ours: same token
        except BaseException:
            if granted:
                with contextlib.suppress(Exception):  # never hide the original failure
                    await self._shielded(self.release_lease(run_id, owner, granted[-1]))
            raise

    async def heartbeat(self, run_id: str, owner: str, token: int, ttl: float) -> None:
        """Extend ``owner``'s lease on ``run_id`` to ``ttl`` from now; ``LeaseLost`` if ``token`` is stale."""
        check_ttl(ttl)
        check_names(run_id=run_id, owner=owner)

        async def extend(conn: _Conn, attempt: _Attempt) -> None:
            holder, _expires, lease_token, _xid = await _fetch_run_row(conn, _LOCK_LEASE, run_id)
            check_holder(run_id, owner, token, holder=holder, lease_token=lease_token)
            await conn.execute(
                "UPDATE runs SET lease_expires = %s WHERE run_id = %s",
                (self._clock() + ttl, run_id),
            )

        await self._write(f"run {run_id!r}", extend)

    async def release_lease(self, run_id: str, owner: str, token: int) -> None:
        """Drop ``owner``'s lease on ``run_id`` if still held with ``token``; else do nothing."""
        check_names(run_id=run_id, owner=owner)

        async def release(conn: _Conn, attempt: _Attempt) -> None:
            await conn.execute(
                "UPDATE runs SET lease_owner = NULL, lease_expires = NULL "
                "WHERE run_id = %s AND lease_owner = %s AND lease_token = %s",
                (run_id, owner, token),
            )

        await self._write(f"run {run_id!r}", release, transaction=False)

    async def expired_leases(self, now: float, *, limit: int = 100) -> list[str]:
        """Ids of ``running`` runs with no lease or one that expired before ``now``, at most ``limit``."""
        query = _pg(EXPIRED_LEASES)
        rows = await self._read("finding expired leases", _fetch_all(query, (now, max(limit, 0))))
        return [r[0] for r in rows]

    # -- the question ledger (Q2-Q5) ---------------------------------------------

    async def answer(
        self,
        question_id: str,
        answer_json: str,
        *,
        by: str | None = None,
        status: QuestionStatus = QuestionStatus.ANSWERED,
    ) -> QuestionRow:
        """First answer wins: one atomic ``UPDATE ... WHERE status = 'open'`` (Q2); returns the new row.

        Args:
            question_id: the question to answer.
            answer_json: the encoded answer.
            by: who answered (a person, a poller), stored as ``answered_by``.
            status: ``answered``, or ``expired`` when the deadline passed (Q5).

        ``AlreadyAnswered`` if the question is not ``open`` (nothing changes),
        ``QuestionNotFound`` if unknown, ``ValueError`` for another ``status``.
        """
        new_status = answer_status(question_id, status)
        check_name("question_id", question_id)
        check_name("by", by, context=f"question {question_id!r}: ")
        values = (new_status.value, answer_json, by, self._clock(), question_id)

        async def set_answer(conn: _Conn, attempt: _Attempt) -> QuestionRow:
            cur = await conn.execute(_ANSWER_QUESTION, values)
            row = await cur.fetchone()
            if row is None:  # a question never goes back to open: this state is final enough
                raise not_open(question_id, (await _question_state(conn, question_id))[0])
            attempt.xid = row[-1]
            return question_from_row(row[:-1])

        return await self._write(
            f"question {question_id!r}", set_answer,
            landed=lambda conn: _select_question(conn, question_id),
            texts=lambda: [("answer_json", answer_json)],
        )  # fmt: skip

    async def get_question(self, question_id: str) -> QuestionRow:
        """Return question ``question_id``; ``QuestionNotFound`` if absent."""
        check_name("question_id", question_id)
        return await self._read(
            f"question {question_id!r}", lambda conn, _: _select_question(conn, question_id)
        )

    async def list_questions(
        self,
        *,
        status: QuestionStatus | None = None,
        run_id: str | None = None,
        limit: int | None = None,
    ) -> list[QuestionRow]:
        """Questions oldest first (``created_at``, then id), only those in ``status`` and of ``run_id`` if given, at most ``limit``."""
        check_name("run_id", run_id)
        query, params = list_questions_query(status, run_id)
        params += (None if limit is None else max(limit, 0),)
        rows = await self._read("listing questions", _fetch_all(_pg(query), params))
        return [question_from_row(r) for r in rows]

    async def unapplied_answers(
        self, *, limit: int = 100, now: float | None = None
    ) -> list[QuestionRow]:
        """Unapplied answers due at ``now`` (default: the clock): fresh ones, then deferred ones (Q4)."""
        params = (self._clock() if now is None else now, max(limit, 0))
        rows = await self._read("listing unapplied answers", _fetch_all(_pg(DUE_ANSWERS), params))
        return [question_from_row(r) for r in rows]

    async def defer_answer(self, question_id: str, *, error: str, retry_at: float) -> None:
        """Record a failed apply of ``question_id``'s answer in one atomic update, if still unapplied.

        ``QuestionNotFound`` if absent.
        """
        check_name("question_id", question_id)
        text = check_apply_deferral(question_id, error, retry_at)
        values = (text, float(retry_at), question_id)
        cas = _question_cas(_returning_xid(DEFER_ANSWER), values, question_id)
        await self._write(f"question {question_id!r}", cas, landed=_true)  # changed or not: done

    async def mark_applied(self, question_id: str) -> bool:
        """Apply question ``question_id``'s answer outside a harvest; False if it cannot be (Q3).

        The same atomic compare-and-set as a harvest's ``applied``: ``answered``
        becomes ``applied``, ``expired`` stays so, both get ``applied_at``.
        ``QuestionNotFound`` if absent.
        """
        check_name("question_id", question_id)
        values = (self._clock(), question_id)
        cas = _question_cas(_returning_xid(APPLY_QUESTION), values, question_id)
        return await self._write(f"question {question_id!r}", cas, landed=_true)

    async def supersede(self, question_id: str) -> bool:
        """Mark question ``question_id`` ``superseded``; False if already applied or superseded.

        ``QuestionNotFound`` if absent.
        """
        check_name("question_id", question_id)
        cas = _question_cas(_returning_xid(SUPERSEDE_QUESTION), (question_id,), question_id)
        return await self._write(f"question {question_id!r}", cas, landed=_true)

    # -- the evolve ledger --------------------------------------------------------

    async def artifact_head(self, artifact_id: str) -> ArtifactVersion | None:
        """The newest version of ``artifact_id``, or None if it has none."""
        check_name("artifact_id", artifact_id)
        rows = await self._read(
            f"artifact {artifact_id!r}", _fetch_all(_pg(SELECT_ARTIFACT_HEAD), (artifact_id,))
        )
        return artifact_from_row(rows[0]) if rows else None

    async def commit_artifact(
        self, artifact_id: str, expected: int, entries_json: str, meta_json: str = "{}"
    ) -> ArtifactVersion:
        """Store version ``expected + 1`` of ``artifact_id`` if its head is ``expected`` (0: none).

        One transaction reads the head and inserts the next version; a racing
        transaction that inserted it first makes ours insert nothing (the
        primary key decides), and that loss is reported like any stale
        ``expected``: ``StaleVersion``, nothing written. ``entries_json``/
        ``meta_json`` are stored as given.
        """
        check_expected(artifact_id, expected)
        version = ArtifactVersion(
            artifact_id=artifact_id, version=expected + 1, entries_json=entries_json,
            meta_json=meta_json, created_at=self._clock(),
        )  # fmt: skip

        async def insert(conn: _Conn, attempt: _Attempt) -> ArtifactVersion:
            head = await _artifact_head_version(conn, artifact_id)
            if head == expected:
                cur = await conn.execute(_INSERT_ARTIFACT, artifact_params(version))
                row = await cur.fetchone()
                if row is not None:
                    attempt.xid = row[0]
                    return version
                head = await _artifact_head_version(conn, artifact_id)  # the winner's
            raise stale_version(artifact_id, expected, head)

        async def landed(conn: _Conn) -> ArtifactVersion:
            return version

        return await self._write(
            f"artifact {artifact_id!r}", insert, landed=landed,
            texts=lambda: [("entries_json", entries_json), ("meta_json", meta_json)],
        )  # fmt: skip

    async def artifact_history(self, artifact_id: str) -> list[ArtifactVersion]:
        """Every version of ``artifact_id``, oldest first."""
        check_name("artifact_id", artifact_id)
        rows = await self._read(
            f"artifact {artifact_id!r}", _fetch_all(_pg(SELECT_ARTIFACT_HISTORY), (artifact_id,))
        )
        return [artifact_from_row(r) for r in rows]


# --- faults ---------------------------------------------------------------------------


async def _check_connection(conn: _Conn) -> None:
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
    if _readable(conn.pgconn.socket):
        await psycopg_pool.AsyncConnectionPool.check_connection(conn)


def _readable(fd: int) -> bool:
    """Whether socket ``fd`` has data or an end of file waiting, without blocking."""
    if hasattr(select, "poll"):  # no FD_SETSIZE limit
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return bool(poller.poll(0))
    return bool(select.select([fd], [], [], 0)[0])


def _transient(exc: BaseException) -> bool:
    """Whether re-running the whole transaction on a fresh connection may succeed after ``exc``.

    Connection exceptions (no SQLSTATE: the client lost the connection; or
    class 08), a shutting-down or starting-up server, serialization failures
    and deadlocks. Not a pool that is closed or has too many waiters, nor an
    error in the statement or the data.
    """
    if isinstance(exc, _InDoubt):
        return True
    if isinstance(exc, psycopg_pool.PoolClosed | psycopg_pool.TooManyRequests):
        return False
    if not isinstance(exc, psycopg.OperationalError):
        return False
    state = exc.sqlstate
    return state is None or state.startswith("08") or state in _RETRIED_SQLSTATES


async def _pause(context: str, exc: BaseException, attempt: int, deadline: float) -> None:
    """Sleep before attempt ``attempt + 1``: exponential, jittered, within ``deadline``; else give up."""
    left = deadline - time.monotonic()
    if left <= 0:
        unknown = " (the connection was lost during COMMIT: whether it was written is unknown)"
        outcome = unknown if isinstance(exc, _InDoubt) else ""
        raise StoreError(f"{context}: {exc}{outcome} (gave up after {attempt} attempts)") from exc
    # Full jitter: engines that lost the server together do not come back in step.
    pause = random.uniform(0, min(_LONGEST_PAUSE, _FIRST_PAUSE * 2 ** (attempt - 1)))
    log = logger.warning if attempt == 1 else logger.info
    log("%s: %s; retrying (attempt %d)", context, _one_line(exc), attempt + 1)
    await asyncio.sleep(min(pause, left))


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


async def _committed(conn: _Conn, xid: str, context: str) -> bool:
    """Whether transaction ``xid``, whose COMMIT's answer was lost, committed; ``_InDoubt`` while it runs."""
    cur = await conn.execute("SELECT pg_xact_status(%s::xid8)", (xid,))
    row = await cur.fetchone()
    status: str | None = row[0] if row is not None else None
    if status == "in progress":  # its backend has not noticed the lost connection yet
        raise _InDoubt(f"transaction {xid} is still in progress on the server")
    if status not in ("committed", "aborted"):
        raise StoreError(
            f"{context}: the connection was lost during COMMIT and the server no longer "
            f"knows transaction {xid} ({status!r}): whether it was written is unknown"
        )
    if status == "committed":
        logger.info("%s: the lost COMMIT of transaction %s had landed", context, xid)
    return status == "committed"


def _refusal(context: str, exc: BaseException, texts: _Texts | None) -> Exception:
    """Our error for ``exc``, a failure a retry cannot cure; a refused text is named."""
    text_refused = isinstance(exc, UnicodeEncodeError) or (
        isinstance(exc, psycopg.DataError) and "NUL" in str(exc)
    )
    if text_refused:
        problem = _bad_text(texts() if texts is not None else ())
        if problem is not None:
            return ValueError(f"{context}: {problem}; nothing was written")
        return ValueError(
            f"{context}: Postgres cannot store this text ({exc}); nothing was written"
        )
    return StoreError(f"{context}: {exc}")


def _bad_text(texts: Iterable[tuple[str, str | None]]) -> str | None:
    """What is wrong with the first of ``texts`` Postgres cannot store as text, naming it."""
    for field, value in texts:
        if value is None:
            continue
        if "\x00" in value:
            at = value.index("\x00")
            return f"{field} contains a NUL character (\\x00) at {at}, which Postgres cannot store"
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return (
                f"{field} contains a lone surrogate {value[exc.start]!r} at {exc.start}, "
                "which is not valid Unicode"
            )
    return None


def _harvest_texts(harvest: Harvest) -> Iterator[tuple[str, str | None]]:
    """The payload texts ``harvest`` stores, each named by what it belongs to."""
    yield "state_json", harvest.state_json
    for n in harvest.nodes:
        yield f"data_json of node {n.node_id!r}", n.data_json
    for r in harvest.results:
        yield f"result of node {r.node_id!r} visit {r.visit}", r.value_json
    for f in harvest.frozen:
        yield f"frozen input of node {f.node_id!r} activation {f.activation}", f.payload_json
    for e in harvest.events:
        yield f"data_json of event seq {e.seq}", e.data_json
    for q in harvest.questions:
        yield f"prompt_json of question {q.question_id!r}", q.prompt_json


# --- statements -------------------------------------------------------------------------


def _fetch_all(query: str, params: tuple[object, ...]) -> _Work[list[tuple[Any, ...]]]:
    """Work that returns every row of ``query``."""

    async def read(conn: _Conn, attempt: _Attempt) -> list[tuple[Any, ...]]:
        cur = await conn.execute(query, params)
        return list(await cur.fetchall())

    return read


async def _true(conn: _Conn) -> bool:
    """The result of a compare-and-set that turned out to have committed: it changed the row."""
    return True


def _question_cas(update: str, values: tuple[object, ...], question_id: str) -> _Work[bool]:
    """A compare-and-set of ``question_id`` (``update`` returns the transaction id): True if it changed the row."""

    async def cas(conn: _Conn, attempt: _Attempt) -> bool:
        cur = await conn.execute(update, values)
        row = await cur.fetchone()
        if row is not None:
            attempt.xid = row[0]
            return True
        await _question_state(conn, question_id)  # QuestionNotFound when there is none
        return False

    return cas


async def _select_question(conn: _Conn, question_id: str) -> QuestionRow:
    cur = await conn.execute(_pg(SELECT_QUESTION), (question_id,))
    row = await cur.fetchone()
    if row is None:
        raise question_not_found(question_id)
    return question_from_row(row)


async def _artifact_head_version(conn: _Conn, artifact_id: str) -> int:
    """The head version of ``artifact_id``, 0 when it has none."""
    cur = await conn.execute(_pg(ARTIFACT_HEAD_VERSION), (artifact_id,))
    row = await cur.fetchone()
    return int(row[0]) if row is not None else 0


async def _write_harvest(conn: _Conn, run_id: str, harvest: Harvest, now: float) -> None:
    """Upsert the node rows, insert the append-only rows and questions, update the run."""
    async with conn.pipeline(), conn.cursor() as cur:
        if harvest.nodes:
            await cur.executemany(_pg(UPSERT_NODE), node_params(run_id, harvest))
        rows = harvest_rows(run_id, harvest)
        for statement, group in itertools.groupby(rows, key=lambda row: row[0]):
            await cur.executemany(_pg(statement), [values for _, values, _ in group])
        await cur.execute(_pg(UPDATE_RUN), run_update_params(run_id, harvest, now))


async def _apply_question_changes(conn: _Conn, run_id: str, harvest: Harvest, now: float) -> None:
    """Apply, then supersede, the questions of ``harvest`` (inserted already); refuse it all on a lost CAS.

    Each apply is one ``UPDATE ... WHERE`` checked by its row count: a racing
    transaction waits for the row lock, then re-checks the condition and finds
    the answer applied, so exactly one harvest applies it (Q3). Ids are taken
    in sorted order so that two harvests never wait on each other's rows.
    """
    for question_id in sorted(harvest.applied):
        cur = await conn.execute(_pg(APPLY_QUESTION), (now, question_id))
        if cur.rowcount != 1:
            status, applied_at = await _question_state(conn, question_id)
            raise not_applicable(question_id, status, applied_at, run_id=run_id)
    for question_id in sorted(harvest.superseded):
        cur = await conn.execute(_pg(SUPERSEDE_QUESTION), (question_id,))
        if cur.rowcount != 1:
            await _question_state(conn, question_id)  # QuestionNotFound when there is none


async def _question_state(conn: _Conn, question_id: str) -> tuple[QuestionStatus, Any]:
    """``(status, applied_at)`` of question ``question_id``; :class:`QuestionNotFound` if absent."""
    cur = await conn.execute(_pg(QUESTION_STATE), (question_id,))
    row = await cur.fetchone()
    if row is None:
        raise question_not_found(question_id)
    return parse_question_status(question_id, row[0]), row[1]


async def _fetch_run_row(conn: _Conn, query: str, run_id: str) -> tuple[Any, ...]:
    """The one row ``query`` selects for ``run_id``; :class:`RunNotFound` if there is none."""
    cur = await conn.execute(query, (run_id,))
    row = await cur.fetchone()
    if row is None:
        raise RunNotFound(f"no run {run_id!r} in the store")
    return tuple(row)
