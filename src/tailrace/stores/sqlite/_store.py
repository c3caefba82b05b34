"""SQLite run store: WAL, one writer thread with group commit, reader threads.

Writes never run on the event loop. Each write is a request on a queue; the
single writer thread drains every request waiting, applies them in one
``BEGIN IMMEDIATE ... COMMIT`` with each request inside its own SAVEPOINT (so
a fenced-out or failing request is rolled back alone), and only after COMMIT
resolves each caller's future on its own loop. Reads run on a small pool of
threads with their own read-only connections; WAL lets them proceed while the
writer commits. Several processes may share one file: ``BEGIN IMMEDIATE`` and
the busy timeout serialise their writers. The threads live in
``_threads``; the schema and SQL, shared with Postgres, in ``_sql``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import time
from collections.abc import Callable
from typing import Any, Literal, TypeVar

from ..._errors import RunExists, RunNotFound, StoreError
from .._artifacts import stale_version
from .._changes import ChangeHub
from .._contract import ChangeFeed, RunStore
from .._queue_rules import (
    queue_from_row,
    queue_params,
    stats_from_counts,
    worker_from_row,
    worker_params,
)
from .._records import (
    ArtifactVersion,
    EventRow,
    FrozenInput,
    Harvest,
    NewRun,
    NodeRow,
    QuestionRow,
    QuestionStatus,
    Queue,
    QueueStats,
    ResultRow,
    RunCount,
    RunRecord,
    RunStatus,
    StoredRun,
    Submission,
    WorkerRow,
)
from .._rules import (
    check_commit,
    check_holder,
    check_readable,
    grant_lease,
    not_applicable,
    not_open,
    parse_question_status,
    parse_status,
    question_not_found,
    read_only_refusal,
)
from .._sql._queues import (
    ANSWER_CANDIDATES,
    ANY_QUEUED,
    CANCEL_QUEUED,
    CANCEL_REQUESTS,
    DEDUP_HOLDER,
    DELETE_WORKER,
    LEASED_BY,
    QUEUE_COUNTS,
    REQUEST_CANCEL,
    RUN_COUNTS,
    RUN_DURATIONS,
    SELECT_QUEUES,
    SELECT_WORKERS,
    UPSERT_QUEUE,
    UPSERT_WORKER,
    list_runs_query,
    run_counts_from_rows,
)
from .._sql._statements import (
    ANSWER_QUESTION,
    APPLY_QUESTION,
    ARTIFACT_HEAD_VERSION,
    DEFER_ANSWER,
    DUE_ANSWERS,
    EVENT_COLUMNS,
    EXPIRED_LEASES,
    INSERT_ARTIFACT,
    INSERT_EVENT,
    INSERT_QUEUED_RUN,
    INSERT_RESULT,
    INSERT_RUN,
    QUESTION_STATE,
    RUN_COLUMNS,
    SELECT_ARTIFACT_HEAD,
    SELECT_ARTIFACT_HISTORY,
    SELECT_QUESTION,
    SUPERSEDE_QUESTION,
    UPDATE_RUN,
    UPSERT_NODE,
    append_only_rows,
    artifact_from_row,
    artifact_params,
    event_from_row,
    harvest_rows,
    list_questions_query,
    new_run_params,
    question_from_row,
    queued_run_params,
    record_from_row,
    run_update_params,
)
from ._errors import mapped_errors
from ._files import prepare_for_writing, read_only_connection, read_only_uri
from ._queues import DataVersionWatch, bump, claim, lease_answers, release_all
from ._threads import (
    Readers,
    Undo,
    Writer,
    finish_despite_cancellation,
    insert_rows,
    insert_run_rows,
)

T = TypeVar("T")


def first_duplicate(conn: sqlite3.Connection, run_id: str, harvest: Harvest) -> str:
    """Describe the first row of ``harvest`` that is already stored (the slow path of an error)."""
    conn.execute("ROLLBACK TO tailrace_write")  # forget this harvest's partial inserts
    for sql, values, what in harvest_rows(run_id, harvest):
        try:
            conn.execute(sql, values)
        except sqlite3.IntegrityError:
            return what
    return f"run {run_id!r}: a row of this harvest"


async def _open_in_thread(connect: Callable[[], sqlite3.Connection]) -> sqlite3.Connection:
    """``connect()`` on a thread; if the caller is cancelled meanwhile, the connection is closed."""
    opening = asyncio.ensure_future(asyncio.to_thread(connect))
    try:
        return await asyncio.shield(opening)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):  # it failed to open: nothing to close
            (await finish_despite_cancellation(opening)).close()
        raise


# --- the store -----------------------------------------------------------------


class SQLiteStore(RunStore):
    """The embedded default store: one SQLite file in WAL mode.

    Args:
        path: the database file; created, with its schema, on ``open`` (unless
            ``read_only``).
        synchronous: ``"normal"`` (default; a commit survives a process crash,
            the last ones may be lost on power failure) or ``"full"`` (survives
            power failure, several times slower).
        busy_timeout: seconds to wait for another process's write lock.
        readers: number of reader threads (each has its own connection).
        max_batch: most write requests grouped into one transaction.
        clock: wall clock for lease expiry, seconds since the epoch.
        read_only: read an existing database and never write to it: no
            migrations, no WAL switch, no file created; writes raise
            ``StoreError``. Works next to a writer in another process and on
            read-only media (see ``_files``).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        synchronous: Literal["normal", "full"] = "normal",
        busy_timeout: float = 5.0,
        readers: int = 2,
        max_batch: int = 512,
        clock: Callable[[], float] = time.time,
        read_only: bool = False,
    ) -> None:
        self._path = os.fspath(path)
        if self._path in ("", ":memory:") or self._path.startswith("file:"):
            raise ValueError(
                f"SQLiteStore needs a file path, got {self._path!r}; use MemoryStore for memory"
            )
        if synchronous not in ("normal", "full"):
            raise ValueError(f"synchronous must be 'normal' or 'full', got {synchronous!r}")
        if readers < 1 or max_batch < 1:
            raise ValueError("readers and max_batch must be at least 1")
        self._synchronous = synchronous
        self._busy_timeout = busy_timeout
        self._reader_count = readers
        self._max_batch = max_batch
        self._clock = clock
        self._read_only = read_only
        self._read_uri: str | None = None  # the read-only URI, once open
        self._writer: Writer | None = None
        self._readers: Readers | None = None
        self._hub = ChangeHub(lambda hub: DataVersionWatch(self._connect).start(hub))

    @property
    def path(self) -> str:
        """The database file."""
        return self._path

    @property
    def read_only(self) -> bool:
        """Whether this store reads only (it then refuses every write)."""
        return self._read_only

    def _connect(self) -> sqlite3.Connection:
        if self._read_uri is not None:
            return read_only_connection(self._read_uri, self._busy_timeout)
        conn = sqlite3.connect(
            self._path, timeout=self._busy_timeout, isolation_level=None, check_same_thread=False
        )
        conn.execute(f"PRAGMA synchronous = {self._synchronous.upper()}")
        return conn

    def _open_writer_connection(self) -> sqlite3.Connection:
        where = f"SQLite store {self._path!r}"
        with mapped_errors(where, "cannot open: "):
            conn = self._connect()
            try:
                prepare_for_writing(conn, where)
            except BaseException:
                conn.close()
                raise
        return conn

    async def open(self) -> None:
        """Create or migrate the database (or check it, read-only), start the threads. Idempotent."""
        if self._readers is not None:
            return
        if self._read_only:
            self._read_uri = await asyncio.to_thread(read_only_uri, self._path, self._busy_timeout)
        else:
            conn = await _open_in_thread(self._open_writer_connection)
            self._writer = Writer(conn, max_batch=self._max_batch, name="tailrace-sqlite-writer")
        self._readers = Readers(self._connect, self._reader_count)

    async def close(self) -> None:
        """Commit every write already submitted, then stop the threads. Idempotent.

        Once begun, closing completes even if the caller is cancelled meanwhile
        (the cancellation is re-raised afterwards), so no thread or connection
        is left behind.
        """
        await self._hub.close()
        writer, readers = self._writer, self._readers
        self._writer = self._readers = None

        def stop() -> None:
            if writer is not None:
                writer.stop()
            if readers is not None:
                readers.close()

        stopping = asyncio.ensure_future(asyncio.to_thread(stop))
        try:
            await asyncio.shield(stopping)
        except asyncio.CancelledError:
            await finish_despite_cancellation(stopping)
            raise

    async def _write(
        self,
        context: str,
        apply: Callable[[sqlite3.Connection], T],
        *,
        undo: Undo[T] | None = None,
    ) -> T:
        if self._readers is None:
            raise StoreError(f"{context}: the SQLite store is not open")
        if self._writer is None:
            raise read_only_refusal(f"SQLite store {self._path!r}", context)
        return await self._writer.submit(context, apply, undo=undo)

    async def _read(self, context: str, read: Callable[[sqlite3.Connection], T]) -> T:
        if self._readers is None:
            raise StoreError(f"{context}: the SQLite store is not open")
        return await self._readers.run(context, read)

    async def _create_run(self, run: NewRun) -> None:

        def apply(conn: sqlite3.Connection) -> None:
            if conn.execute("SELECT 1 FROM runs WHERE run_id = ?", (run.run_id,)).fetchone():
                raise RunExists(f"run {run.run_id!r} already exists")
            conn.execute(INSERT_RUN, new_run_params(run))

        await self._write(f"run {run.run_id!r}", apply)

    async def _commit(self, run_id: str, token: int, harvest: Harvest) -> None:
        await self._write(
            f"run {run_id!r}", lambda conn: self._apply_harvest(conn, run_id, token, harvest)
        )

    def _apply_harvest(
        self, conn: sqlite3.Connection, run_id: str, token: int, harvest: Harvest
    ) -> None:
        status, format_version, lease_token = _one(
            conn, "SELECT status, format_version, lease_token FROM runs WHERE run_id = ?", run_id
        )
        check_commit(
            run_id, current=parse_status(run_id, status), format_version=format_version,
            lease_token=lease_token, token=token, new=harvest.status,
        )  # fmt: skip
        insert_run_rows(conn, UPSERT_NODE, run_id, harvest.nodes)
        try:
            insert_run_rows(conn, INSERT_RESULT, run_id, harvest.results)
            insert_run_rows(conn, INSERT_EVENT, run_id, harvest.events)
            for sql, rows in append_only_rows(run_id, harvest):
                insert_rows(conn, sql, rows)
        except sqlite3.IntegrityError as exc:  # nothing committed is rewritten (D1)
            what = first_duplicate(conn, run_id, harvest)
            raise StoreError(f"{what} already committed; nothing of it was written") from exc
        now = self._clock()
        _apply_question_changes(conn, run_id, harvest, now)  # in the savepoint: may refuse all
        conn.execute(UPDATE_RUN, run_update_params(run_id, harvest, now))

    async def _load_run(self, run_id: str) -> StoredRun:

        def read(conn: sqlite3.Connection) -> StoredRun:
            record = _select_run(conn, run_id)
            check_readable(run_id, record.format_version)
            rows = conn.execute(
                "SELECT node_id, status, visits, data_json FROM node_states WHERE run_id = ?",
                (run_id,),
            )
            nodes = {
                r[0]: NodeRow(node_id=r[0], status=r[1], visits=r[2], data_json=r[3]) for r in rows
            }
            return StoredRun(run=record, nodes=nodes)

        return await self._read(f"run {run_id!r}", read)

    async def _get_run(self, run_id: str) -> RunRecord:
        return await self._read(f"run {run_id!r}", lambda conn: _select_run(conn, run_id))

    async def _list_runs(
        self,
        *,
        status: RunStatus | None = None,
        limit: int | None = None,
        queue: str | None = None,
        graph: str | None = None,
        offset: int = 0,
    ) -> list[RunRecord]:
        sql, params = list_runs_query(None if status is None else status.value, queue, graph)
        params += (-1 if limit is None else max(limit, 0), max(offset, 0))
        return await self._read(
            "listing runs", lambda conn: [record_from_row(r) for r in conn.execute(sql, params)]
        )

    async def _run_counts(self) -> list[RunCount]:
        return await self._read(
            "counting runs", lambda conn: run_counts_from_rows(conn.execute(RUN_COUNTS))
        )

    async def _results(self, run_id: str, node_id: str | None = None) -> list[ResultRow]:

        def read(conn: sqlite3.Connection) -> list[ResultRow]:
            _require_run(conn, run_id)
            rows = conn.execute(
                "SELECT node_id, visit, value_json FROM results WHERE run_id = ? "
                "AND (? IS NULL OR node_id = ?) ORDER BY node_id, visit",
                (run_id, node_id, node_id),
            )
            return [ResultRow(node_id=r[0], visit=r[1], value_json=r[2]) for r in rows]

        return await self._read(f"run {run_id!r}", read)

    async def _frozen_inputs(self, run_id: str) -> list[FrozenInput]:

        def read(conn: sqlite3.Connection) -> list[FrozenInput]:
            _require_run(conn, run_id)
            rows = conn.execute(
                "SELECT node_id, activation, payload_json FROM frozen_inputs WHERE run_id = ? "
                "ORDER BY node_id, activation",
                (run_id,),
            )
            return [FrozenInput(node_id=r[0], activation=r[1], payload_json=r[2]) for r in rows]

        return await self._read(f"run {run_id!r}", read)

    async def _events(self, run_id: str, *, after_seq: int = 0) -> list[EventRow]:

        def read(conn: sqlite3.Connection) -> list[EventRow]:
            _require_run(conn, run_id)
            rows = conn.execute(
                f"SELECT {EVENT_COLUMNS} FROM events WHERE run_id = ? AND seq > ? ORDER BY seq",
                (run_id, after_seq),
            )
            return [event_from_row(r) for r in rows]

        return await self._read(f"run {run_id!r}", read)

    async def _acquire_lease(
        self, run_id: str, owner: str, ttl: float, *, steal_from: str | None = None
    ) -> int:

        def apply(conn: sqlite3.Connection) -> tuple[int, bool]:
            holder, expires, lease_token = _select_lease(conn, run_id)
            now = self._clock()
            token = grant_lease(
                run_id, owner, now=now, holder=holder, expires=expires, lease_token=lease_token,
                steal_from=steal_from,
            )  # fmt: skip
            conn.execute(
                "UPDATE runs SET lease_owner = ?, lease_expires = ?, lease_token = ? WHERE run_id = ?",
                (owner, now + ttl, token, run_id),
            )
            return token, token != lease_token  # a new grant, not a renewal of one's own

        def undo(granted: tuple[int, bool]) -> Callable[[sqlite3.Connection], object] | None:
            token, new = granted  # a renewal is left alone: the caller held that lease before
            return (lambda conn: _release(conn, run_id, owner, token)) if new else None

        token, _ = await self._write(f"run {run_id!r}", apply, undo=undo)
        return token

    async def _heartbeat(self, run_id: str, owner: str, token: int, ttl: float) -> None:

        def apply(conn: sqlite3.Connection) -> None:
            holder, _expires, lease_token = _select_lease(conn, run_id)
            check_holder(run_id, owner, token, holder=holder, lease_token=lease_token)
            conn.execute(
                "UPDATE runs SET lease_expires = ? WHERE run_id = ?", (self._clock() + ttl, run_id)
            )

        await self._write(f"run {run_id!r}", apply)

    async def _release_lease(self, run_id: str, owner: str, token: int) -> None:
        await self._write(f"run {run_id!r}", lambda conn: _release(conn, run_id, owner, token))

    async def _expired_leases(self, now: float, *, limit: int = 100) -> list[str]:
        params = (now, max(limit, 0))
        return await self._read(
            "finding expired leases",
            lambda conn: [r[0] for r in conn.execute(EXPIRED_LEASES, params)],
        )

    # -- the question ledger (Q2-Q5) ---------------------------------------------

    async def _answer(
        self,
        question_id: str,
        answer_json: str,
        *,
        by: str | None = None,
        status: QuestionStatus = QuestionStatus.ANSWERED,
    ) -> QuestionRow:

        def apply(conn: sqlite3.Connection) -> QuestionRow:
            values = (status.value, answer_json, by, self._clock(), question_id)
            rows = conn.execute(ANSWER_QUESTION, values).fetchall()
            if not rows:
                raise not_open(question_id, _question_state(conn, question_id)[0])
            bump(conn, "answer")
            return question_from_row(rows[0])

        return await self._write(f"question {question_id!r}", apply)

    async def _get_question(self, question_id: str) -> QuestionRow:

        def read(conn: sqlite3.Connection) -> QuestionRow:
            row = conn.execute(SELECT_QUESTION, (question_id,)).fetchone()
            if row is None:
                raise question_not_found(question_id)
            return question_from_row(row)

        return await self._read(f"question {question_id!r}", read)

    async def _list_questions(
        self,
        *,
        status: QuestionStatus | None = None,
        run_id: str | None = None,
        limit: int | None = None,
    ) -> list[QuestionRow]:
        query, params = list_questions_query(status, run_id)
        params += (-1 if limit is None else max(limit, 0),)
        return await self._read(
            "listing questions",
            lambda conn: [question_from_row(r) for r in conn.execute(query, params)],
        )

    async def _unapplied_answers(
        self, *, limit: int = 100, now: float | None = None
    ) -> list[QuestionRow]:
        params = (self._clock() if now is None else now, max(limit, 0))
        return await self._read(
            "listing unapplied answers",
            lambda conn: [question_from_row(r) for r in conn.execute(DUE_ANSWERS, params)],
        )

    async def _defer_answer(self, question_id: str, *, error: str, retry_at: float) -> None:
        values = (error, retry_at, question_id)
        await self._write(
            f"question {question_id!r}",
            lambda conn: _changed_one(conn, DEFER_ANSWER, values, question_id),
        )

    async def _mark_applied(self, question_id: str) -> bool:

        def apply(conn: sqlite3.Connection) -> bool:
            return _changed_one(conn, APPLY_QUESTION, (self._clock(), question_id), question_id)

        return await self._write(f"question {question_id!r}", apply)

    async def _supersede(self, question_id: str) -> bool:
        return await self._write(
            f"question {question_id!r}",
            lambda conn: _changed_one(conn, SUPERSEDE_QUESTION, (question_id,), question_id),
        )

    # -- the evolve ledger --------------------------------------------------------

    async def _artifact_head(self, artifact_id: str) -> ArtifactVersion | None:

        def read(conn: sqlite3.Connection) -> ArtifactVersion | None:
            row = conn.execute(SELECT_ARTIFACT_HEAD, (artifact_id,)).fetchone()
            return None if row is None else artifact_from_row(row)

        return await self._read(f"artifact {artifact_id!r}", read)

    async def _commit_artifact(
        self, artifact_id: str, expected: int, entries_json: str, meta_json: str = "{}"
    ) -> ArtifactVersion:

        def apply(conn: sqlite3.Connection) -> ArtifactVersion:
            head = _artifact_head_version(conn, artifact_id)
            if head != expected:
                raise stale_version(artifact_id, expected, head)
            version = ArtifactVersion(
                artifact_id=artifact_id, version=expected + 1, entries_json=entries_json,
                meta_json=meta_json, created_at=self._clock(),
            )  # fmt: skip
            try:
                conn.execute(INSERT_ARTIFACT, artifact_params(version))
            except sqlite3.IntegrityError as exc:
                head = _artifact_head_version(conn, artifact_id)
                raise stale_version(artifact_id, expected, head) from exc
            return version

        return await self._write(f"artifact {artifact_id!r}", apply)

    async def _artifact_history(self, artifact_id: str) -> list[ArtifactVersion]:
        return await self._read(
            f"artifact {artifact_id!r}",
            lambda conn: [
                artifact_from_row(r) for r in conn.execute(SELECT_ARTIFACT_HISTORY, (artifact_id,))
            ],
        )

    def changes(self) -> contextlib.AbstractAsyncContextManager[ChangeFeed]:
        """Wake-ups from the ``data_version`` watcher (see :meth:`RunStore.changes`)."""
        return self._hub.subscribe()

    async def _submit_run(self, run: NewRun, submission: Submission) -> str:
        q = submission

        def apply(conn: sqlite3.Connection) -> str:
            if q.dedup_key is not None:
                row = conn.execute(DEDUP_HOLDER, (q.queue, q.dedup_key)).fetchone()
                if row is not None:
                    return str(row[0])
            if conn.execute("SELECT 1 FROM runs WHERE run_id = ?", (run.run_id,)).fetchone():
                raise RunExists(f"run {run.run_id!r} already exists")
            conn.execute(INSERT_QUEUED_RUN, queued_run_params(run, q))
            bump(conn, "submit")
            return run.run_id

        return await self._write(f"run {run.run_id!r}", apply)

    async def _claim_runs(self, queue: str, owner: str, ttl: float, *, limit: int) -> list[str]:
        waiting = await self._read(
            f"queue {queue!r}", lambda conn: conn.execute(ANY_QUEUED, (queue,)).fetchone()
        )
        if waiting is None:
            return []

        def undo(ids: list[str]) -> Callable[[sqlite3.Connection], object]:
            return lambda conn: release_all(conn, ids, owner)  # adopted at once by anyone

        return await self._write(
            f"queue {queue!r}",
            lambda conn: claim(conn, queue, owner, ttl, limit, self._clock()),
            undo=undo,
        )

    async def _claim_answers(self, owner: str, ttl: float, *, limit: int) -> list[QuestionRow]:
        now = self._clock()
        any_due = await self._read(
            "claiming answers",
            lambda conn: conn.execute(ANSWER_CANDIDATES, (now, now, 1)).fetchone(),
        )
        if any_due is None:
            return []

        def apply(conn: sqlite3.Connection) -> list[QuestionRow]:
            ids = lease_answers(conn, owner, ttl, limit, self._clock())
            return [question_from_row(conn.execute(SELECT_QUESTION, (q,)).fetchone()) for q in ids]

        def undo(rows: list[QuestionRow]) -> Callable[[sqlite3.Connection], object]:
            return lambda conn: release_all(conn, [q.run_id for q in rows], owner)

        return await self._write("claiming answers", apply, undo=undo)

    async def _request_cancel(self, run_id: str) -> RunStatus:

        def apply(conn: sqlite3.Connection) -> RunStatus:
            now = self._clock()
            conn.execute(CANCEL_QUEUED, (now, now, run_id))
            conn.execute(REQUEST_CANCEL, (now, run_id))
            row = conn.execute("SELECT status FROM runs WHERE run_id = ?", (run_id,)).fetchone()
            if row is None:
                raise RunNotFound(f"no run {run_id!r} in the store")
            bump(conn, "cancel")
            return parse_status(run_id, row[0])

        return await self._write(f"run {run_id!r}", apply)

    async def _cancel_requests(self, owner: str) -> list[str]:
        return await self._read(
            "listing cancel requests",
            lambda conn: [r[0] for r in conn.execute(CANCEL_REQUESTS, (owner,))],
        )

    async def _runs_leased_by(self, owner: str, *, limit: int = 100) -> list[str]:
        return await self._read(
            "listing leased runs",
            lambda conn: [r[0] for r in conn.execute(LEASED_BY, (owner, max(limit, 0)))],
        )

    async def _declare_queue(self, queue: Queue) -> None:

        def apply(conn: sqlite3.Connection) -> None:
            conn.execute(UPSERT_QUEUE, queue_params(queue, self._clock()))
            bump(conn, "submit")  # new limits may let more runs start

        await self._write(f"queue {queue.name!r}", apply)

    async def _queues(self) -> list[Queue]:
        return await self._read(
            "listing queues", lambda conn: [queue_from_row(r) for r in conn.execute(SELECT_QUEUES)]
        )

    async def _queue_stats(self, now: float, *, window: float = 60.0) -> list[QueueStats]:

        def read(conn: sqlite3.Connection) -> list[QueueStats]:
            counts = conn.execute(QUEUE_COUNTS, (now - window, now)).fetchall()
            declared_queues = [queue_from_row(r) for r in conn.execute(SELECT_QUEUES)]
            workers = [worker_from_row(r) for r in conn.execute(SELECT_WORKERS)]
            return stats_from_counts(counts, declared_queues, workers, now, window)

        return await self._read("queue statistics", read)

    async def _worker_seen(self, worker: WorkerRow) -> None:
        await self._write(
            f"worker {worker.worker_id!r}",
            lambda conn: conn.execute(UPSERT_WORKER, worker_params(worker)),
        )

    async def _workers(self) -> list[WorkerRow]:
        return await self._read(
            "listing workers",
            lambda conn: [worker_from_row(r) for r in conn.execute(SELECT_WORKERS)],
        )

    async def _forget_worker(self, worker_id: str) -> None:
        await self._write(
            f"worker {worker_id!r}", lambda conn: conn.execute(DELETE_WORKER, (worker_id,))
        )

    async def _run_durations(
        self, fingerprint: str, *, limit: int = 200
    ) -> list[tuple[float, float]]:
        return await self._read(
            "run durations",
            lambda conn: [
                (float(c), float(s))
                for c, s in conn.execute(RUN_DURATIONS, (fingerprint, max(limit, 0)))
            ],
        )


def _artifact_head_version(conn: sqlite3.Connection, artifact_id: str) -> int:
    """The head version of ``artifact_id``, 0 when it has none."""
    return int(conn.execute(ARTIFACT_HEAD_VERSION, (artifact_id,)).fetchone()[0])


def _question_state(conn: sqlite3.Connection, question_id: str) -> tuple[QuestionStatus, Any]:
    """``(status, applied_at)`` of question ``question_id``; :class:`QuestionNotFound` if absent."""
    row = conn.execute(QUESTION_STATE, (question_id,)).fetchone()
    if row is None:
        raise question_not_found(question_id)
    return parse_question_status(question_id, row[0]), row[1]


def _changed_one(
    conn: sqlite3.Connection, update: str, values: tuple[object, ...], question_id: str
) -> bool:
    """Run a question compare-and-set: True if it changed the row, False if it did not apply."""
    if conn.execute(update, values).rowcount == 1:
        return True
    _question_state(conn, question_id)  # QuestionNotFound when there is no such question
    return False


def _apply_question_changes(
    conn: sqlite3.Connection, run_id: str, harvest: Harvest, now: float
) -> None:
    """Apply, then supersede, the questions of ``harvest`` (inserted already); refuse it all on a lost CAS.

    Each apply is one ``UPDATE ... WHERE`` checked by its row count, so across
    connections and processes exactly one harvest applies an answer (Q3).
    """
    for question_id in harvest.applied:
        if conn.execute(APPLY_QUESTION, (now, question_id)).rowcount != 1:
            status, applied_at = _question_state(conn, question_id)
            raise not_applicable(question_id, status, applied_at, run_id=run_id)
    for question_id in harvest.superseded:
        _changed_one(conn, SUPERSEDE_QUESTION, (question_id,), question_id)


def _one(conn: sqlite3.Connection, sql: str, run_id: str) -> Any:
    """The one row ``sql`` selects for ``run_id``; :class:`RunNotFound` if there is none."""
    row = conn.execute(sql, (run_id,)).fetchone()
    if row is None:
        raise RunNotFound(f"no run {run_id!r} in the store")
    return row


def _select_run(conn: sqlite3.Connection, run_id: str) -> RunRecord:
    return record_from_row(_one(conn, f"SELECT {RUN_COLUMNS} FROM runs WHERE run_id = ?", run_id))


def _require_run(conn: sqlite3.Connection, run_id: str) -> None:
    _one(conn, "SELECT 1 FROM runs WHERE run_id = ?", run_id)


def _release(conn: sqlite3.Connection, run_id: str, owner: str, token: int) -> None:
    released = conn.execute(
        "UPDATE runs SET lease_owner = NULL, lease_expires = NULL "
        "WHERE run_id = ? AND lease_owner = ? AND lease_token = ?",
        (run_id, owner, token),
    )
    if released.rowcount:
        bump(conn, "release")  # a run finished, suspended or was let go: workers look


def _select_lease(conn: sqlite3.Connection, run_id: str) -> tuple[str | None, float | None, int]:
    sql = "SELECT lease_owner, lease_expires, lease_token FROM runs WHERE run_id = ?"
    holder, expires, token = _one(conn, sql, run_id)
    return holder, expires, token
