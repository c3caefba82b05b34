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
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Literal, TypeVar

from ..._errors import RunExists, StoreError
from .._artifacts import stale_version
from .._changes import ChangeHub
from .._contract import ChangeFeed, RunStore
from .._queue_rules import (
    graph_from_row,
    paused_names,
    queue_params,
    queue_rows,
    schedule_from_row,
    stats_from_counts,
    worker_params,
    worker_rows,
)
from .._records import (
    ArtifactVersion,
    ChunkRow,
    Claim,
    EventRow,
    FrozenInput,
    GraphRow,
    Harvest,
    NewRun,
    ParkedRow,
    ParkedStatus,
    Pulse,
    QuestionRow,
    QuestionStatus,
    Queue,
    QueueStats,
    ResultRow,
    RunCount,
    RunRecord,
    RunStatus,
    ScheduleRow,
    StoredRun,
    StreamHead,
    Submission,
    WorkerRow,
)
from .._rules import (
    read_only_refusal,
)
from .._sql import _transactions as bodies
from .._sql._queues import (
    ANSWER_CANDIDATES,
    ANY_QUEUED,
    CANCEL_REQUESTS,
    DEDUP_HOLDER,
    DELETE_SCHEDULE,
    DELETE_WORKER,
    LEASED_BY,
    QUEUE_COUNTS,
    RETURN_CLAIM,
    RUN_COUNTS,
    RUN_DURATIONS,
    SELECT_GRAPHS_NAMED,
    SELECT_QUEUES,
    SELECT_SCHEDULES,
    SELECT_WORKERS,
    UPSERT_GRAPH,
    UPSERT_QUEUE,
    UPSERT_WORKER,
    list_runs_query,
    run_counts_from_rows,
)
from .._sql._statements import (
    APPLY_QUESTION,
    ARTIFACT_HEAD_VERSION,
    DEFER_ANSWER,
    DUE_ANSWERS,
    EXPIRED_LEASES,
    INSERT_ARTIFACT,
    INSERT_QUEUED_RUN,
    INSERT_RUN,
    INSERT_SHAPE,
    QUESTION_COUNTS,
    SELECT_ARTIFACT_HEAD,
    SELECT_ARTIFACT_HISTORY,
    SELECT_QUESTION,
    SUPERSEDE_QUESTION,
    artifact_from_row,
    artifact_params,
    list_questions_query,
    new_run_params,
    question_counts_from,
    question_from_row,
    queued_run_params,
    record_from_row,
    shape_params,
)
from .._sql._transactions import run_now
from ._errors import mapped_errors
from ._files import prepare_for_writing, read_only_connection, read_only_uri
from ._queues import DataVersionWatch, bump, claim_queued, lease_answers, release_all
from ._threads import (
    Checkpointer,
    Readers,
    Undo,
    Writer,
    finish_despite_cancellation,
)
from ._tx import SQLiteTx

T = TypeVar("T")


def _body(
    body: Callable[..., Coroutine[Any, Any, T]], *args: Any, **kwargs: Any
) -> Callable[[sqlite3.Connection], T]:
    """What a thread runs on its connection: the shared ``body(tx, *args, **kwargs)``, at once."""
    return lambda conn: run_now(body(SQLiteTx(conn), *args, **kwargs))


def _keep_shape(conn: sqlite3.Connection, run: NewRun) -> None:
    """Keep ``run``'s graph structure, once per graph version (V1)."""
    params = shape_params(run)
    if params is not None:
        conn.execute(INSERT_SHAPE, params)


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
        self._checkpointer: Checkpointer | None = None
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
                prepare_for_writing(conn, where, self._busy_timeout)
                conn.execute("PRAGMA wal_autocheckpoint = 0")  # the Checkpointer's thread does it
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
            self._checkpointer = Checkpointer(self._connect)
            self._writer = Writer(
                conn,
                max_batch=self._max_batch,
                name="tailrace-sqlite-writer",
                on_commit=self._checkpointer.written,
            )
        self._readers = Readers(self._connect, self._reader_count)

    async def close(self) -> None:
        """Commit every write already submitted, then stop the threads. Idempotent.

        Once begun, closing completes even if the caller is cancelled meanwhile
        (the cancellation is re-raised afterwards), so no thread or connection
        is left behind.
        """
        await self._hub.close()
        writer, readers, checkpointer = self._writer, self._readers, self._checkpointer
        self._writer = self._readers = self._checkpointer = None

        def stop() -> None:
            if writer is not None:
                writer.stop()
            if checkpointer is not None:
                checkpointer.stop()
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
            _keep_shape(conn, run)

        await self._write(f"run {run.run_id!r}", apply)

    async def _commit(self, run_id: str, token: int, harvest: Harvest) -> bool:
        def apply(conn: sqlite3.Connection) -> bool:
            tx = SQLiteTx(conn)
            return run_now(bodies.commit_harvest(tx, run_id, token, harvest, self._clock()))

        return await self._write(f"run {run_id!r}", apply)

    async def _load_run(self, run_id: str) -> StoredRun:
        return await self._read(f"run {run_id!r}", _body(bodies.load_run, run_id))

    async def _move_run(
        self,
        run_id: str,
        owner: str,
        token: int,
        *,
        fingerprint: str,
        graph_ref: str | None,
        expected: str,
    ) -> None:
        move = _body(
            bodies.move_run, run_id, owner, token, fingerprint=fingerprint,
            graph_ref=graph_ref, expected=expected, now=self._clock(),
        )  # fmt: skip
        await self._write(f"run {run_id!r}", move)

    async def _frontiers(self, graph_name: str) -> dict[str, tuple[str, ...]]:
        return await self._read(f"graph {graph_name!r}", _body(bodies.frontiers, graph_name))

    async def _graph_shape(self, graph_name: str, fingerprint: str) -> str | None:
        read = _body(bodies.graph_shape, graph_name, fingerprint)
        return await self._read(f"graph {graph_name!r}", read)

    async def _get_run(self, run_id: str) -> RunRecord:
        return await self._read(f"run {run_id!r}", _body(bodies.get_run, run_id))

    async def _list_runs(
        self,
        *,
        status: RunStatus | None = None,
        limit: int | None = None,
        queue: str | None = None,
        graph: str | None = None,
        offset: int = 0,
        parent: str | None = None,
    ) -> list[RunRecord]:
        value = None if status is None else status.value
        sql, params = list_runs_query(value, queue, graph, parent)
        params += (-1 if limit is None else max(limit, 0), max(offset, 0))
        return await self._read(
            "listing runs", lambda conn: [record_from_row(r) for r in conn.execute(sql, params)]
        )

    async def _wake_suspended(self, run_id: str) -> bool:
        wake = _body(bodies.wake_suspended, run_id, self._clock())
        return await self._write(f"run {run_id!r}", wake)

    async def _overdue_runs(self, now: float, *, limit: int) -> list[str]:
        return await self._read("finding overdue runs", _body(bodies.overdue_runs, now, limit))

    async def _run_counts(self) -> list[RunCount]:
        return await self._read(
            "counting runs", lambda conn: run_counts_from_rows(conn.execute(RUN_COUNTS))
        )

    async def _results(self, run_id: str, node_id: str | None = None) -> list[ResultRow]:
        return await self._read(f"run {run_id!r}", _body(bodies.results, run_id, node_id))

    async def _outputs(self, run_ids: list[str]) -> dict[str, str]:
        return await self._read(f"outputs of {len(run_ids)} runs", _body(bodies.outputs, run_ids))

    async def _frozen_inputs(self, run_id: str) -> list[FrozenInput]:
        return await self._read(f"run {run_id!r}", _body(bodies.frozen_inputs, run_id))

    async def _events(self, run_id: str, *, after_seq: int = 0) -> list[EventRow]:
        return await self._read(f"run {run_id!r}", _body(bodies.events, run_id, after_seq))

    async def _chunks(self, run_id: str, *, after: int, limit: int) -> list[ChunkRow]:
        return await self._read(f"run {run_id!r}", _body(bodies.chunks, run_id, after, limit))

    async def _stream_head(self, run_id: str) -> StreamHead:
        return await self._read(f"run {run_id!r}", _body(bodies.stream_head, run_id))

    async def _prune_streams(self, finished_before: float) -> int:
        return await self._write("pruning streams", _body(bodies.prune_streams, finished_before))

    async def _acquire_lease(
        self, run_id: str, owner: str, ttl: float, *, steal_from: str | None = None
    ) -> int:
        # Cancelled once the writer has started it, the call waits for it and
        # releases a lease it newly granted before CancelledError propagates.
        take = _body(bodies.take_lease, run_id, owner, ttl, steal_from, self._clock)

        def undo(granted: tuple[int, bool]) -> Callable[[sqlite3.Connection], object] | None:
            token, new = granted  # a renewal is left alone: the caller held that lease before
            return (lambda conn: _release(conn, run_id, owner, token)) if new else None

        token, _ = await self._write(f"run {run_id!r}", take, undo=undo)
        return token

    async def _heartbeat(self, run_id: str, owner: str, token: int, ttl: float) -> None:
        extend = _body(bodies.extend_lease, run_id, owner, token, ttl, self._clock)
        await self._write(f"run {run_id!r}", extend)

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
        now = self._clock()
        answer = _body(bodies.answer, question_id, answer_json, by, status, now)
        return await self._write(f"question {question_id!r}", answer)

    async def _get_question(self, question_id: str) -> QuestionRow:
        return await self._read(
            f"question {question_id!r}", _body(bodies.get_question, question_id)
        )

    async def _list_questions(
        self,
        *,
        status: QuestionStatus | None = None,
        run_id: str | None = None,
        limit: int | None = None,
        offset: int = 0,
    ) -> list[QuestionRow]:
        query, params = list_questions_query(status, run_id)
        params += (-1 if limit is None else max(limit, 0), offset)
        return await self._read(
            "listing questions",
            lambda conn: [question_from_row(r) for r in conn.execute(query, params)],
        )

    async def _list_parked(
        self,
        *,
        graph_name: str | None,
        node_id: str | None,
        status: ParkedStatus | None,
        claimed_by: str | None,
    ) -> list[ParkedRow]:
        read = _body(bodies.list_parked, graph_name, node_id, status, claimed_by)
        return await self._read("listing parked items", read)

    async def _claim_parked(
        self, graph_name: str, node_id: str, claimant: str, limit: int
    ) -> list[ParkedRow]:
        claim = _body(bodies.claim_parked, graph_name, node_id, claimant, limit, self._clock())
        return await self._write(f"claiming parked items of {node_id!r}", claim)

    async def _drop_parked(self, park_id: str) -> bool:
        return await self._write(f"parked item {park_id!r}", _body(bodies.drop_parked, park_id))

    async def _question_counts(self) -> dict[QuestionStatus, int]:
        return await self._read(
            "counting questions",
            lambda conn: question_counts_from(conn.execute(QUESTION_COUNTS).fetchall()),
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
        cas = _body(bodies.question_cas, DEFER_ANSWER, (error, retry_at, question_id), question_id)
        await self._write(f"question {question_id!r}", cas)

    async def _mark_applied(self, question_id: str) -> bool:
        def apply(conn: sqlite3.Connection) -> bool:
            values = (self._clock(), question_id)
            return run_now(bodies.question_cas(SQLiteTx(conn), APPLY_QUESTION, values, question_id))

        return await self._write(f"question {question_id!r}", apply)

    async def _supersede(self, question_id: str) -> bool:
        cas = _body(bodies.question_cas, SUPERSEDE_QUESTION, (question_id,), question_id)
        return await self._write(f"question {question_id!r}", cas)

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
            _keep_shape(conn, run)
            bump(conn, "submit")
            return run.run_id

        return await self._write(f"run {run.run_id!r}", apply)

    async def _submit_runs(
        self,
        runs: Sequence[tuple[NewRun, Submission]],
        claim: Claim | None,
        skip: tuple[str, ...],
    ) -> tuple[list[str], list[str]]:
        def apply(conn: sqlite3.Connection) -> tuple[list[str], list[str]]:
            stored = []
            for run, q in runs:
                if conn.execute("SELECT 1 FROM runs WHERE run_id = ?", (run.run_id,)).fetchone():
                    continue  # submitted before: left as it is
                conn.execute(INSERT_QUEUED_RUN, queued_run_params(run, q))
                _keep_shape(conn, run)
                stored.append(run.run_id)
            claimed: list[str] = []
            if claim is not None:
                claimed = claim_queued(
                    conn, claim.queue, claim.owner, claim.ttl, claim.limit, self._clock(),
                    skip=skip,
                )  # fmt: skip
            if set(stored) - set(claimed):
                bump(conn, "submit")
            return stored, claimed

        what = f"{len(runs)} runs from {runs[0][0].run_id!r}"
        if claim is None:
            return await self._write(what, apply)
        owner = claim.owner

        def undo(done: tuple[list[str], list[str]]) -> Callable[[sqlite3.Connection], object]:
            return lambda conn: release_all(conn, done[1], owner)  # adopted at once by anyone

        return await self._write(what, apply, undo=undo)

    async def _claim_runs(
        self,
        queue: str,
        owner: str,
        ttl: float,
        *,
        limit: int,
        graphs: tuple[str, ...] | None,
        skip: tuple[str, ...],
    ) -> list[str]:
        waiting = await self._read(
            f"queue {queue!r}", lambda conn: conn.execute(ANY_QUEUED, (queue,)).fetchone()
        )
        if waiting is None:
            return []

        def undo(ids: list[str]) -> Callable[[sqlite3.Connection], object]:
            return lambda conn: release_all(conn, ids, owner)  # adopted at once by anyone

        return await self._write(
            f"queue {queue!r}",
            lambda conn: claim_queued(conn, queue, owner, ttl, limit, self._clock(), graphs, skip),
            undo=undo,
        )

    async def _return_claim(self, run_id: str, owner: str) -> bool:
        def apply(conn: sqlite3.Connection) -> bool:
            if conn.execute(RETURN_CLAIM, (self._clock(), run_id, owner)).rowcount != 1:
                return False
            bump(conn, "submit")  # queued again: wake the workers
            return True

        return await self._write(f"run {run_id!r}", apply)

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
            return run_now(bodies.request_cancel(SQLiteTx(conn), run_id, self._clock()))

        return await self._write(f"run {run_id!r}", apply)

    async def _reopen_cancelled(
        self, run_id: str, owner: str, ttl: float, nodes: tuple[str, ...]
    ) -> bool:
        def apply(conn: sqlite3.Connection) -> bool:
            body = bodies.reopen_cancelled(SQLiteTx(conn), run_id, owner, ttl, nodes, self._clock())
            return run_now(body)

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
            bump(conn, "config")

        await self._write(f"queue {queue.name!r}", apply)

    async def _queues(self) -> list[Queue]:
        return await self._read(
            "listing queues", lambda conn: queue_rows(conn.execute(SELECT_QUEUES))
        )

    async def _register_graph(self, row: GraphRow) -> None:
        params = (row.name, row.fingerprint, row.graph_ref, row.registered_at)
        await self._write(f"graph {row.name!r}", lambda conn: conn.execute(UPSERT_GRAPH, params))

    async def _graphs_named(self, name: str) -> list[GraphRow]:
        return await self._read(
            f"graph {name!r}",
            lambda conn: [graph_from_row(r) for r in conn.execute(SELECT_GRAPHS_NAMED, (name,))],
        )

    async def _declare_schedule(self, row: ScheduleRow) -> None:
        await self._write(
            f"schedule {row.name!r}",
            lambda conn: run_now(bodies.declare_schedule(SQLiteTx(conn), row)),
        )

    async def _schedules(self) -> list[ScheduleRow]:
        return await self._read(
            "listing schedules",
            lambda conn: [schedule_from_row(r) for r in conn.execute(SELECT_SCHEDULES)],
        )

    async def _fire_schedule(self, name: str, tick: float) -> str | None:
        return await self._write(
            f"schedule {name!r}",
            lambda conn: run_now(bodies.fire_schedule(SQLiteTx(conn), name, tick, self._clock())),
        )

    async def _delete_schedule(self, name: str) -> bool:
        return await self._write(
            f"schedule {name!r}",
            lambda conn: conn.execute(DELETE_SCHEDULE, (name,)).rowcount == 1,
        )

    async def _pause_queue(self, name: str) -> None:
        await self._write(
            f"queue {name!r}",
            lambda conn: run_now(bodies.pause_queue(SQLiteTx(conn), name, self._clock())),
        )

    async def _resume_queue(self, name: str) -> bool:
        return await self._write(
            f"queue {name!r}", lambda conn: run_now(bodies.resume_queue(SQLiteTx(conn), name))
        )

    async def _delete_queue(self, name: str) -> bool:
        return await self._write(
            f"queue {name!r}", lambda conn: run_now(bodies.delete_queue(SQLiteTx(conn), name))
        )

    async def _queue_stats(self, now: float, *, window: float = 60.0) -> list[QueueStats]:

        def read(conn: sqlite3.Connection) -> list[QueueStats]:
            counts = conn.execute(QUEUE_COUNTS, (now - window, now)).fetchall()
            rows = conn.execute(SELECT_QUEUES).fetchall()
            workers = worker_rows(conn.execute(SELECT_WORKERS))
            return stats_from_counts(
                counts, queue_rows(rows), workers, now, window, paused_names(rows)
            )

        return await self._read("queue statistics", read)

    async def _worker_seen(self, worker: WorkerRow) -> None:
        await self._write(
            f"worker {worker.worker_id!r}",
            lambda conn: conn.execute(UPSERT_WORKER, worker_params(worker)),
        )

    async def _pulse(self, worker: WorkerRow) -> Pulse:
        return await self._write(
            f"worker {worker.worker_id!r}",
            lambda conn: run_now(bodies.pulse(SQLiteTx(conn), worker, self._clock())),
        )

    async def _workers(self) -> list[WorkerRow]:
        return await self._read(
            "listing workers",
            lambda conn: worker_rows(conn.execute(SELECT_WORKERS)),
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


def _release(conn: sqlite3.Connection, run_id: str, owner: str, token: int) -> None:
    released = conn.execute(
        "UPDATE runs SET lease_owner = NULL, lease_expires = NULL "
        "WHERE run_id = ? AND lease_owner = ? AND lease_token = ?",
        (run_id, owner, token),
    )
    if released.rowcount:
        bump(conn, "release")  # a run finished, suspended or was let go: workers look
