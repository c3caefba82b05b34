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
connection always goes back to the pool. The statements live in
``_sql`` (Postgres's spelling of the shared statements).

Every psycopg exception becomes ours at this seam (CONVENTIONS 3), naming the
run, question or artifact. Requires the ``postgres`` extra:
``pip install 'tailrace[postgres]'``.
"""

from __future__ import annotations

import contextlib
from typing import Any

import psycopg

from ..._errors import RunExists, StoreError
from .._artifacts import check_expected, stale_version
from .._contract import RunStore
from .._records import (
    ArtifactVersion,
    EventRow,
    FrozenInput,
    Harvest,
    NewRun,
    NodeRow,
    QuestionRow,
    QuestionStatus,
    ResultRow,
    RunCount,
    RunRecord,
    RunStatus,
    StoredRun,
)
from .._rules import (
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
    not_open,
    parse_status,
)
from .._sql._queues import RUN_COUNTS, list_runs_query, run_counts_from_rows
from .._sql._statements import (
    APPLY_QUESTION,
    DEFER_ANSWER,
    DUE_ANSWERS,
    EVENT_COLUMNS,
    EXPIRED_LEASES,
    SELECT_ARTIFACT_HEAD,
    SELECT_ARTIFACT_HISTORY,
    SUPERSEDE_QUESTION,
    artifact_from_row,
    artifact_params,
    event_from_row,
    list_questions_query,
    new_run_params,
    question_from_row,
    record_from_row,
)
from ._connections import Attempt, Conn, harvest_texts, nothing
from ._queues import PostgresQueues, notify
from ._sql import (
    LOCK_FOR_COMMIT,
    LOCK_LEASE,
    PG_ANSWER_QUESTION,
    PG_INSERT_ARTIFACT,
    PG_INSERT_RUN,
    SELECT_RUN,
    apply_question_changes,
    artifact_head_version,
    changed,
    fetch_all,
    fetch_run_row,
    pg,
    question_cas,
    question_state,
    returning_xid,
    select_question,
    write_harvest,
)


class PostgresStore(PostgresQueues, RunStore):
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

    # -- runs -----------------------------------------------------------------------

    async def create_run(self, run: NewRun) -> None:
        """Store ``run`` with status ``running``; ``RunExists`` if its id is taken."""
        check_new_format(run)
        check_names(
            run_id=run.run_id, graph_name=run.graph_name, graph_ref=run.graph_ref,
            fingerprint=run.fingerprint,
        )  # fmt: skip

        async def insert(conn: Conn, attempt: Attempt) -> None:
            cur = await conn.execute(PG_INSERT_RUN, new_run_params(run))
            row = await cur.fetchone()
            if row is None:
                raise RunExists(f"run {run.run_id!r} already exists")
            attempt.xid = row[0]

        await self._write(
            f"run {run.run_id!r}", insert, landed=nothing,
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

        async def write(conn: Conn, attempt: Attempt) -> None:
            status, version, lease_token, attempt.xid = await fetch_run_row(
                conn, LOCK_FOR_COMMIT, run_id
            )
            check_commit(
                run_id, current=parse_status(run_id, status), format_version=version,
                lease_token=lease_token, token=token, new=harvest.status,
            )  # fmt: skip
            try:
                await write_harvest(conn, run_id, harvest, now)
            except psycopg.errors.UniqueViolation as exc:  # nothing committed is rewritten (D1)
                raise StoreError(
                    f"run {run_id!r}: harvest would rewrite a committed row "
                    f"({exc.diag.message_detail}); nothing of it was written"
                ) from exc
            await apply_question_changes(conn, run_id, harvest, now)  # may refuse it all

        await self._write(
            f"run {run_id!r}", write, landed=nothing, texts=lambda: harvest_texts(harvest)
        )

    async def load_run(self, run_id: str) -> StoredRun:
        """Return run ``run_id`` with its node rows; ``UnsupportedFormat`` if written by a newer tailrace."""
        check_name("run_id", run_id)

        async def read(conn: Conn, attempt: Attempt) -> StoredRun:
            async with conn.transaction():
                await conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
                record = record_from_row(await fetch_run_row(conn, SELECT_RUN, run_id))
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

        async def read(conn: Conn, attempt: Attempt) -> RunRecord:
            return record_from_row(await fetch_run_row(conn, SELECT_RUN, run_id))

        return await self._read(f"run {run_id!r}", read)

    async def list_runs(
        self,
        *,
        status: RunStatus | None = None,
        limit: int | None = None,
        queue: str | None = None,
        graph: str | None = None,
        offset: int = 0,
    ) -> list[RunRecord]:
        """Runs newest first (``created_at``, then ``run_id``), filtered, ``offset`` skipped, at most ``limit``."""
        check_names(queue=queue, graph=graph)
        query, params = list_runs_query(None if status is None else status.value, queue, graph)
        params += (None if limit is None else max(limit, 0), max(offset, 0))
        rows = await self._read("listing runs", fetch_all(pg(query), params))
        return [record_from_row(r) for r in rows]

    async def run_counts(self) -> list[RunCount]:
        """How many runs there are per graph name, queue and status."""
        rows = await self._read("counting runs", fetch_all(pg(RUN_COUNTS), ()))
        return run_counts_from_rows(rows)

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

        async def read(conn: Conn, attempt: Attempt) -> list[tuple[Any, ...]]:
            cur = await conn.execute(query, params)
            rows = await cur.fetchall()
            if not rows:
                await fetch_run_row(conn, "SELECT 1 FROM runs WHERE run_id = %s", run_id)
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

        async def grant(conn: Conn, attempt: Attempt) -> int:
            holder, expires, lease_token, attempt.xid = await fetch_run_row(
                conn, LOCK_LEASE, run_id
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

        async def extend(conn: Conn, attempt: Attempt) -> None:
            holder, _expires, lease_token, _xid = await fetch_run_row(conn, LOCK_LEASE, run_id)
            check_holder(run_id, owner, token, holder=holder, lease_token=lease_token)
            await conn.execute(
                "UPDATE runs SET lease_expires = %s WHERE run_id = %s",
                (self._clock() + ttl, run_id),
            )

        await self._write(f"run {run_id!r}", extend)

    async def release_lease(self, run_id: str, owner: str, token: int) -> None:
        """Drop ``owner``'s lease on ``run_id`` if still held with ``token``; else do nothing."""
        check_names(run_id=run_id, owner=owner)

        channel = self._channel

        async def release(conn: Conn, attempt: Attempt) -> None:
            # One statement: the release and, if it released, a wake-up for workers.
            await conn.execute(
                "WITH released AS (UPDATE runs SET lease_owner = NULL, lease_expires = NULL "
                "WHERE run_id = %s AND lease_owner = %s AND lease_token = %s RETURNING 1) "
                "SELECT pg_notify(%s, 'release') FROM released",
                (run_id, owner, token, channel),
            )

        await self._write(f"run {run_id!r}", release, transaction=False)

    async def expired_leases(self, now: float, *, limit: int = 100) -> list[str]:
        """Ids of ``running`` runs with no lease or one that expired before ``now``, at most ``limit``."""
        query = pg(EXPIRED_LEASES)
        rows = await self._read("finding expired leases", fetch_all(query, (now, max(limit, 0))))
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

        channel = self._channel

        async def set_answer(conn: Conn, attempt: Attempt) -> QuestionRow:
            cur = await conn.execute(PG_ANSWER_QUESTION, values)
            row = await cur.fetchone()
            if row is None:  # a question never goes back to open: this state is final enough
                raise not_open(question_id, (await question_state(conn, question_id))[0])
            attempt.xid = row[-1]
            await notify(conn, channel, "answer")
            return question_from_row(row[:-1])

        return await self._write(
            f"question {question_id!r}", set_answer,
            landed=lambda conn: select_question(conn, question_id),
            texts=lambda: [("answer_json", answer_json)],
        )  # fmt: skip

    async def get_question(self, question_id: str) -> QuestionRow:
        """Return question ``question_id``; ``QuestionNotFound`` if absent."""
        check_name("question_id", question_id)
        return await self._read(
            f"question {question_id!r}", lambda conn, _: select_question(conn, question_id)
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
        rows = await self._read("listing questions", fetch_all(pg(query), params))
        return [question_from_row(r) for r in rows]

    async def unapplied_answers(
        self, *, limit: int = 100, now: float | None = None
    ) -> list[QuestionRow]:
        """Unapplied answers due at ``now`` (default: the clock): fresh ones, then deferred ones (Q4)."""
        params = (self._clock() if now is None else now, max(limit, 0))
        rows = await self._read("listing unapplied answers", fetch_all(pg(DUE_ANSWERS), params))
        return [question_from_row(r) for r in rows]

    async def defer_answer(self, question_id: str, *, error: str, retry_at: float) -> None:
        """Record a failed apply of ``question_id``'s answer in one atomic update, if still unapplied.

        ``QuestionNotFound`` if absent.
        """
        check_name("question_id", question_id)
        text = check_apply_deferral(question_id, error, retry_at)
        values = (text, float(retry_at), question_id)
        cas = question_cas(returning_xid(DEFER_ANSWER), values, question_id)
        await self._write(f"question {question_id!r}", cas, landed=changed)  # changed or not: done

    async def mark_applied(self, question_id: str) -> bool:
        """Apply question ``question_id``'s answer outside a harvest; False if it cannot be (Q3).

        The same atomic compare-and-set as a harvest's ``applied``: ``answered``
        becomes ``applied``, ``expired`` stays so, both get ``applied_at``.
        ``QuestionNotFound`` if absent.
        """
        check_name("question_id", question_id)
        values = (self._clock(), question_id)
        cas = question_cas(returning_xid(APPLY_QUESTION), values, question_id)
        return await self._write(f"question {question_id!r}", cas, landed=changed)

    async def supersede(self, question_id: str) -> bool:
        """Mark question ``question_id`` ``superseded``; False if already applied or superseded.

        ``QuestionNotFound`` if absent.
        """
        check_name("question_id", question_id)
        cas = question_cas(returning_xid(SUPERSEDE_QUESTION), (question_id,), question_id)
        return await self._write(f"question {question_id!r}", cas, landed=changed)

    # -- the evolve ledger --------------------------------------------------------

    async def artifact_head(self, artifact_id: str) -> ArtifactVersion | None:
        """The newest version of ``artifact_id``, or None if it has none."""
        check_name("artifact_id", artifact_id)
        rows = await self._read(
            f"artifact {artifact_id!r}", fetch_all(pg(SELECT_ARTIFACT_HEAD), (artifact_id,))
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

        async def insert(conn: Conn, attempt: Attempt) -> ArtifactVersion:
            head = await artifact_head_version(conn, artifact_id)
            if head == expected:
                cur = await conn.execute(PG_INSERT_ARTIFACT, artifact_params(version))
                row = await cur.fetchone()
                if row is not None:
                    attempt.xid = row[0]
                    return version
                head = await artifact_head_version(conn, artifact_id)  # the winner's
            raise stale_version(artifact_id, expected, head)

        async def landed(conn: Conn) -> ArtifactVersion:
            return version

        return await self._write(
            f"artifact {artifact_id!r}", insert, landed=landed,
            texts=lambda: [("entries_json", entries_json), ("meta_json", meta_json)],
        )  # fmt: skip

    async def artifact_history(self, artifact_id: str) -> list[ArtifactVersion]:
        """Every version of ``artifact_id``, oldest first."""
        check_name("artifact_id", artifact_id)
        rows = await self._read(
            f"artifact {artifact_id!r}", fetch_all(pg(SELECT_ARTIFACT_HISTORY), (artifact_id,))
        )
        return [artifact_from_row(r) for r in rows]
