"""Postgres run store: the same contract for many processes and hosts.

Built on psycopg 3 and its async pool. Every write is one transaction; a
commit locks its run row (``SELECT ... FOR UPDATE``) before checking the
fencing token, so two engines can never both write the same run (D6).
Migrations run under a transaction-scoped advisory lock, so processes that
start together do not race. An artifact commit reads the head and inserts the
next version in one transaction; of racing commits, the ``artifact_versions``
primary key lets one insert through and the others' unique violations become
:class:`~tailrace.StaleVersion`. The tables live in ``schema`` (``public`` by
default), which lets several deployments, or tests, share one database.

Requires the ``postgres`` extra: ``pip install 'tailrace[postgres]'``.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

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
from ._memory import (
    answer_status,
    check_commit,
    check_holder,
    check_new_format,
    check_new_questions,
    check_readable,
    check_ttl,
    grant_lease,
    not_applicable,
    not_open,
    parse_question_status,
    parse_status,
    question_not_found,
)
from ._sql import (
    ANSWER_QUESTION,
    APPLY_QUESTION,
    ARTIFACT_HEAD_VERSION,
    CREATE_MIGRATIONS_TABLE,
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
    UNAPPLIED_ANSWERS,
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

#: First key of the advisory lock that serialises migrations ("tr").
_MIGRATION_LOCK = 0x7472
_Conn = psycopg.AsyncConnection[Any]


def _pg(statement: str) -> str:
    """The shared SQL with psycopg's placeholders."""
    return statement.replace("?", "%s")


_SELECT_RUN = f"SELECT {RUN_COLUMNS} FROM runs WHERE run_id = %s"
_SELECT_LEASE = (
    "SELECT lease_owner, lease_expires, lease_token FROM runs WHERE run_id = %s FOR UPDATE"
)


class PostgresStore(RunStore):
    """A store in PostgreSQL, shared by any number of engines.

    Args:
        dsn: libpq connection string or URL, e.g. ``postgresql://user@host/db``.
        min_size: connections the pool keeps open.
        max_size: most connections the pool opens.
        schema: schema holding the tables; created on ``open`` if missing.
        clock: wall clock for lease expiry, seconds since the epoch. Engines on
            several hosts need clocks in step within a small part of the ttl.
    """

    def __init__(
        self,
        dsn: str,
        *,
        min_size: int = 1,
        max_size: int = 8,
        schema: str = "public",
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._dsn = dsn
        self._min_size = min_size
        self._max_size = max_size
        self._schema = schema
        self._clock = clock
        self._pool: psycopg_pool.AsyncConnectionPool[_Conn] | None = None

    @property
    def schema(self) -> str:
        """The schema holding the tables."""
        return self._schema

    async def _configure(self, conn: _Conn) -> None:
        await conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(self._schema)))

    async def open(self) -> None:
        """Open the pool and apply pending migrations. Idempotent."""
        if self._pool is not None:
            return
        pool: psycopg_pool.AsyncConnectionPool[_Conn] = psycopg_pool.AsyncConnectionPool(
            self._dsn,
            min_size=self._min_size,
            max_size=self._max_size,
            open=False,
            kwargs={"autocommit": True},
            configure=self._configure,
        )
        try:
            await pool.open(wait=True)
            async with pool.connection() as conn:
                await self._migrate(conn)
        except psycopg.Error as exc:
            await pool.close()
            raise StoreError(f"Postgres store (schema {self._schema!r}): {exc}") from exc
        except BaseException:
            await pool.close()
            raise
        self._pool = pool

    async def _migrate(self, conn: _Conn) -> None:
        """Apply pending migrations in one transaction, under an advisory lock (D4)."""
        where = f"Postgres store (schema {self._schema!r})"
        async with conn.transaction():
            await conn.execute(
                "SELECT pg_advisory_xact_lock(%s, hashtext(%s))", (_MIGRATION_LOCK, self._schema)
            )
            current = await self._recorded_version(conn)
            if current is not None and current > SCHEMA_VERSION:
                raise UnsupportedFormat(
                    f"{where}: database schema version {current} is newer than this tailrace "
                    f"supports ({SCHEMA_VERSION}); upgrade tailrace. Nothing was written."
                )
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

    async def close(self) -> None:
        """Wait for connections in use, then close the pool. Idempotent."""
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.close()

    @contextlib.asynccontextmanager
    async def _connection(self, context: str) -> AsyncIterator[_Conn]:
        """A pooled connection; psycopg errors inside become :class:`StoreError` naming ``context``."""
        if self._pool is None:
            raise StoreError(f"{context}: the Postgres store is not open")
        try:
            async with self._pool.connection() as conn:
                yield conn
        except psycopg.Error as exc:
            raise StoreError(f"{context}: {exc}") from exc

    async def create_run(self, run: NewRun) -> None:
        """Store ``run`` with status ``running``; ``RunExists`` if its id is taken."""
        check_new_format(run)
        async with self._connection(f"run {run.run_id!r}") as conn:
            cur = await conn.execute(
                _pg(INSERT_RUN) + " ON CONFLICT (run_id) DO NOTHING", new_run_params(run)
            )
            if cur.rowcount == 0:
                raise RunExists(f"run {run.run_id!r} already exists")

    async def commit(self, run_id: str, token: int, harvest: Harvest) -> None:
        """Apply ``harvest`` to ``run_id`` in one transaction if ``token`` is current (D1, D6, Q3)."""
        check_new_questions(run_id, harvest)
        async with self._connection(f"run {run_id!r}") as conn, conn.transaction():
            row = await _fetch_run_row(
                conn,
                "SELECT status, format_version, lease_token FROM runs WHERE run_id = %s FOR UPDATE",
                run_id,
            )
            check_commit(
                run_id, current=parse_status(run_id, row[0]), format_version=row[1],
                lease_token=row[2], token=token, new=harvest.status,
            )  # fmt: skip
            now = self._clock()
            try:
                await _write_harvest(conn, run_id, harvest, now)
            except psycopg.errors.UniqueViolation as exc:  # nothing committed is rewritten (D1)
                raise StoreError(
                    f"run {run_id!r}: harvest would rewrite a committed row "
                    f"({exc.diag.message_detail}); nothing of it was written"
                ) from exc
            await _apply_question_changes(conn, run_id, harvest, now)  # may refuse it all

    async def load_run(self, run_id: str) -> StoredRun:
        """Return run ``run_id`` with its node rows; ``UnsupportedFormat`` if written by a newer tailrace."""
        async with self._connection(f"run {run_id!r}") as conn, conn.transaction():
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

    async def get_run(self, run_id: str) -> RunRecord:
        """Return the record of run ``run_id``; ``RunNotFound`` if absent."""
        async with self._connection(f"run {run_id!r}") as conn:
            return record_from_row(await _fetch_run_row(conn, _SELECT_RUN, run_id))

    async def list_runs(
        self, *, status: RunStatus | None = None, limit: int | None = None
    ) -> list[RunRecord]:
        """Runs newest first (``created_at``, then ``run_id``), only ``status`` ones if given, at most ``limit``."""
        where = "" if status is None else "WHERE status = %s"
        params: tuple[object, ...] = () if status is None else (status.value,)
        params += (None if limit is None else max(limit, 0),)
        async with self._connection("listing runs") as conn:
            cur = await conn.execute(
                f"SELECT {RUN_COLUMNS} FROM runs {where} "
                "ORDER BY created_at DESC, run_id DESC LIMIT %s",
                params,
            )
            return [record_from_row(r) for r in await cur.fetchall()]

    async def results(self, run_id: str, node_id: str | None = None) -> list[ResultRow]:
        """Result rows of ``run_id`` (only ``node_id``'s if given), by node then visit."""
        query = "SELECT node_id, visit, value_json FROM results WHERE run_id = %s"
        params: tuple[object, ...] = (run_id,)
        if node_id is not None:
            query, params = query + " AND node_id = %s", (run_id, node_id)
        rows = await self._select_of_run(run_id, query + " ORDER BY node_id, visit", params)
        return [ResultRow(node_id=r[0], visit=r[1], value_json=r[2]) for r in rows]

    async def frozen_inputs(self, run_id: str) -> list[FrozenInput]:
        """First-k decisions of ``run_id``, by node then activation (E4)."""
        rows = await self._select_of_run(
            run_id,
            "SELECT node_id, activation, payload_json FROM frozen_inputs WHERE run_id = %s "
            "ORDER BY node_id, activation",
            (run_id,),
        )
        return [FrozenInput(node_id=r[0], activation=r[1], payload_json=r[2]) for r in rows]

    async def events(self, run_id: str, *, after_seq: int = 0) -> list[EventRow]:
        """Events of ``run_id`` with ``seq > after_seq``, in seq order."""
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
        async with self._connection(f"run {run_id!r}") as conn:
            cur = await conn.execute(query, params)
            rows = await cur.fetchall()
            if not rows:
                await _fetch_run_row(conn, "SELECT 1 FROM runs WHERE run_id = %s", run_id)
            return rows

    async def acquire_lease(self, run_id: str, owner: str, ttl: float) -> int:
        """Lease ``run_id`` to ``owner`` for ``ttl`` seconds; return the fencing token (D6)."""
        check_ttl(ttl)
        async with self._connection(f"run {run_id!r}") as conn, conn.transaction():
            holder, expires, lease_token = await _fetch_run_row(conn, _SELECT_LEASE, run_id)
            now = self._clock()
            token = grant_lease(
                run_id, owner, now=now, holder=holder, expires=expires, lease_token=lease_token
            )
            await conn.execute(
                "UPDATE runs SET lease_owner = %s, lease_expires = %s, lease_token = %s "
                "WHERE run_id = %s",
                (owner, now + ttl, token, run_id),
            )
            return token

    async def heartbeat(self, run_id: str, owner: str, token: int, ttl: float) -> None:
        """Extend ``owner``'s lease on ``run_id`` to ``ttl`` from now; ``LeaseLost`` if ``token`` is stale."""
        check_ttl(ttl)
        async with self._connection(f"run {run_id!r}") as conn, conn.transaction():
            holder, _expires, lease_token = await _fetch_run_row(conn, _SELECT_LEASE, run_id)
            check_holder(run_id, owner, token, holder=holder, lease_token=lease_token)
            await conn.execute(
                "UPDATE runs SET lease_expires = %s WHERE run_id = %s",
                (self._clock() + ttl, run_id),
            )

    async def release_lease(self, run_id: str, owner: str, token: int) -> None:
        """Drop ``owner``'s lease on ``run_id`` if still held with ``token``; else do nothing."""
        async with self._connection(f"run {run_id!r}") as conn:
            await conn.execute(
                "UPDATE runs SET lease_owner = NULL, lease_expires = NULL "
                "WHERE run_id = %s AND lease_owner = %s AND lease_token = %s",
                (run_id, owner, token),
            )

    async def expired_leases(self, now: float, *, limit: int = 100) -> list[str]:
        """Ids of ``running`` runs with no lease or one that expired before ``now``, at most ``limit``."""
        async with self._connection("finding expired leases") as conn:
            cur = await conn.execute(_pg(EXPIRED_LEASES), (now, max(limit, 0)))
            return [r[0] for r in await cur.fetchall()]

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
        values = (new_status.value, answer_json, by, self._clock(), question_id)
        async with self._connection(f"question {question_id!r}") as conn:
            cur = await conn.execute(_pg(ANSWER_QUESTION), values)
            row = await cur.fetchone()
            if row is None:  # a question never goes back to open: this state is final enough
                raise not_open(question_id, (await _question_state(conn, question_id))[0])
            return question_from_row(row)

    async def get_question(self, question_id: str) -> QuestionRow:
        """Return question ``question_id``; ``QuestionNotFound`` if absent."""
        async with self._connection(f"question {question_id!r}") as conn:
            cur = await conn.execute(_pg(SELECT_QUESTION), (question_id,))
            row = await cur.fetchone()
        if row is None:
            raise question_not_found(question_id)
        return question_from_row(row)

    async def list_questions(
        self,
        *,
        status: QuestionStatus | None = None,
        run_id: str | None = None,
        limit: int | None = None,
    ) -> list[QuestionRow]:
        """Questions oldest first (``created_at``, then id), only those in ``status`` and of ``run_id`` if given, at most ``limit``."""
        query, params = list_questions_query(status, run_id)
        params += (None if limit is None else max(limit, 0),)
        return await self._questions("listing questions", _pg(query), params)

    async def unapplied_answers(self, *, limit: int = 100) -> list[QuestionRow]:
        """Answered or expired questions not applied yet, oldest ``answered_at`` first, at most ``limit`` (Q4)."""
        return await self._questions(
            "listing unapplied answers", _pg(UNAPPLIED_ANSWERS), (max(limit, 0),)
        )

    async def _questions(
        self, context: str, query: str, params: tuple[object, ...]
    ) -> list[QuestionRow]:
        async with self._connection(context) as conn:
            cur = await conn.execute(query, params)
            return [question_from_row(r) for r in await cur.fetchall()]

    async def mark_applied(self, question_id: str) -> bool:
        """Apply question ``question_id``'s answer outside a harvest; False if it cannot be (Q3).

        The same atomic compare-and-set as a harvest's ``applied``: ``answered``
        becomes ``applied``, ``expired`` stays so, both get ``applied_at``.
        ``QuestionNotFound`` if absent.
        """
        async with self._connection(f"question {question_id!r}") as conn:
            values = (self._clock(), question_id)
            return await _changed_one(conn, _pg(APPLY_QUESTION), values, question_id)

    async def supersede(self, question_id: str) -> bool:
        """Mark question ``question_id`` ``superseded``; False if already applied or superseded.

        ``QuestionNotFound`` if absent.
        """
        async with self._connection(f"question {question_id!r}") as conn:
            return await _changed_one(conn, _pg(SUPERSEDE_QUESTION), (question_id,), question_id)

    # -- the evolve ledger --------------------------------------------------------

    async def artifact_head(self, artifact_id: str) -> ArtifactVersion | None:
        """The newest version of ``artifact_id``, or None if it has none."""
        async with self._connection(f"artifact {artifact_id!r}") as conn:
            cur = await conn.execute(_pg(SELECT_ARTIFACT_HEAD), (artifact_id,))
            row = await cur.fetchone()
        return None if row is None else artifact_from_row(row)

    async def commit_artifact(
        self, artifact_id: str, expected: int, entries_json: str, meta_json: str = "{}"
    ) -> ArtifactVersion:
        """Store version ``expected + 1`` of ``artifact_id`` if its head is ``expected`` (0: none).

        One transaction reads the head and inserts the next version; a racing
        transaction that inserted it first makes ours fail on the primary key,
        and that loss is reported like any stale ``expected``: ``StaleVersion``,
        nothing written. ``entries_json``/``meta_json`` are stored as given.
        """
        check_expected(artifact_id, expected)
        version = ArtifactVersion(
            artifact_id=artifact_id, version=expected + 1, entries_json=entries_json,
            meta_json=meta_json, created_at=self._clock(),
        )  # fmt: skip
        async with self._connection(f"artifact {artifact_id!r}") as conn:
            try:
                async with conn.transaction():
                    head = await _artifact_head_version(conn, artifact_id)
                    if head != expected:
                        raise stale_version(artifact_id, expected, head)
                    await conn.execute(_pg(INSERT_ARTIFACT), artifact_params(version))
            except psycopg.errors.UniqueViolation as exc:  # lost the race: the winner committed
                head = await _artifact_head_version(conn, artifact_id)
                raise stale_version(artifact_id, expected, head) from exc
        return version

    async def artifact_history(self, artifact_id: str) -> list[ArtifactVersion]:
        """Every version of ``artifact_id``, oldest first."""
        async with self._connection(f"artifact {artifact_id!r}") as conn:
            cur = await conn.execute(_pg(SELECT_ARTIFACT_HISTORY), (artifact_id,))
            return [artifact_from_row(r) for r in await cur.fetchall()]


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
        await _changed_one(conn, _pg(SUPERSEDE_QUESTION), (question_id,), question_id)


async def _question_state(conn: _Conn, question_id: str) -> tuple[QuestionStatus, Any]:
    """``(status, applied_at)`` of question ``question_id``; :class:`QuestionNotFound` if absent."""
    cur = await conn.execute(_pg(QUESTION_STATE), (question_id,))
    row = await cur.fetchone()
    if row is None:
        raise question_not_found(question_id)
    return parse_question_status(question_id, row[0]), row[1]


async def _changed_one(
    conn: _Conn, update: str, values: tuple[object, ...], question_id: str
) -> bool:
    """Run a question compare-and-set: True if it changed the row, False if it did not apply."""
    cur = await conn.execute(update, values)
    if cur.rowcount == 1:
        return True
    await _question_state(conn, question_id)  # QuestionNotFound when there is no such question
    return False


async def _fetch_run_row(conn: _Conn, query: str, run_id: str) -> tuple[Any, ...]:
    """The one row ``query`` selects for ``run_id``; :class:`RunNotFound` if there is none."""
    cur = await conn.execute(query, (run_id,))
    row = await cur.fetchone()
    if row is None:
        raise RunNotFound(f"no run {run_id!r} in the store")
    return tuple(row)
