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

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import psycopg
from psycopg import sql

from ..._errors import RunExists
from .._artifacts import stale_version
from .._changes import ChangeHub, Stop
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
    CHANGE_KINDS,
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
from .._sql import _transactions as bodies
from .._sql._queues import (
    ACTIVE_IN_QUEUE,
    ANSWER_CANDIDATES,
    ANY_QUEUED,
    CANCEL_REQUESTS,
    DEDUP_HOLDER,
    DELETE_SCHEDULE,
    DELETE_WORKER,
    LEASE_FOR_ANSWER,
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
    DEFER_ANSWER,
    DUE_ANSWERS,
    EXPIRED_LEASES,
    INSERT_SHAPE,
    QUESTION_COUNTS,
    SELECT_ARTIFACT_HEAD,
    SELECT_ARTIFACT_HISTORY,
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
from ._connections import (
    Attempt,
    Conn,
    Landed,
    PostgresConnections,
    T,
    Work,
    nothing,
)
from ._errors import Texts, harvest_texts
from ._queues import (
    FALLBACK_POLL,
    INSERT_QUEUED,
    SKIP_LOCKED,
    claim_queued,
    count_rows,
    declared,
    lock_queue,
    logger,
    notify_channel,
    transaction_id,
)
from ._sql import (
    PG_INSERT_ARTIFACT,
    PG_INSERT_RUN,
    PostgresTx,
    artifact_head_version,
    changed,
    fetch_all,
    notify,
    pg,
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
        self._db = PostgresConnections(
            dsn, min_size=min_size, max_size=max_size, schema=schema,
            connect_timeout=connect_timeout, retry_budget=retry_budget, read_only=read_only,
        )  # fmt: skip
        self._clock = clock
        self._channel = notify_channel(schema)
        self._hub = ChangeHub(self._listen)
        #: Queues whose last claim here got all it asked for: the next claims without
        #: looking first (a busy fleet's queue; the look only spares idle queues a write).
        self._full_queues: set[str] = set()

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

    # -- runs -----------------------------------------------------------------------

    async def _create_run(self, run: NewRun) -> None:

        async def insert(conn: Conn, attempt: Attempt) -> None:
            cur = await conn.execute(PG_INSERT_RUN, new_run_params(run))
            row = await cur.fetchone()
            if row is None:
                raise RunExists(f"run {run.run_id!r} already exists")
            attempt.xid = row[0]
            await _keep_shapes(conn, [run])

        await self._db.write(
            f"run {run.run_id!r}", insert, landed=nothing,
            texts=lambda: [("input_json", run.input_json)],
        )  # fmt: skip

    async def _commit(self, run_id: str, token: int, harvest: Harvest) -> bool:
        # Idempotent across a lost connection: when the answer to the COMMIT is
        # lost, the retry finds the transaction committed and returns, and the
        # harvest is not applied a second time.
        now = self._clock()  # once, so that a re-run writes the very same rows

        async def write(conn: Conn, attempt: Attempt) -> bool:
            tx = PostgresTx(conn, attempt, self._channel)
            return await bodies.commit_harvest(tx, run_id, token, harvest, now)

        async def landed(conn: Conn) -> bool:
            return False  # the request, if any, is heard by the driver's lease heartbeat

        return await self._db.write(
            f"run {run_id!r}", write, landed=landed, texts=lambda: harvest_texts(harvest)
        )

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
        move = self._body(
            bodies.move_run, run_id, owner, token, fingerprint=fingerprint,
            graph_ref=graph_ref, expected=expected, now=self._clock(),
        )  # fmt: skip
        await self._db.write(f"run {run_id!r}", move, landed=nothing)

    async def _frontiers(self, graph_name: str) -> dict[str, tuple[str, ...]]:
        read = self._body(bodies.frontiers, graph_name)
        return await self._db.read(f"graph {graph_name!r}", read)

    async def _graph_shape(self, graph_name: str, fingerprint: str) -> str | None:
        read = self._body(bodies.graph_shape, graph_name, fingerprint)
        return await self._db.read(f"graph {graph_name!r}", read)

    async def _load_run(self, run_id: str) -> StoredRun:
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
                await conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
                reads = [await conn.execute(pg(sql), (run_id,)) for sql in bodies.LOAD_RUN]
            return bodies.stored_run(run_id, [await cur.fetchall() for cur in reads])

        return await self._db.read(f"run {run_id!r}", read)

    async def _get_run(self, run_id: str) -> RunRecord:
        return await self._db.read(f"run {run_id!r}", self._body(bodies.get_run, run_id))

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
        query, params = list_runs_query(value, queue, graph, parent)
        params += (None if limit is None else max(limit, 0), max(offset, 0))
        rows = await self._db.read("listing runs", fetch_all(pg(query), params))
        return [record_from_row(r) for r in rows]

    async def _wake_suspended(self, run_id: str) -> bool:
        wake = self._body(bodies.wake_suspended, run_id, self._clock())
        return await self._db.write(f"run {run_id!r}", wake)

    async def _overdue_runs(self, now: float, *, limit: int) -> list[str]:
        read = self._body(bodies.overdue_runs, now, limit)
        return await self._db.read("finding overdue runs", read)

    async def _run_counts(self) -> list[RunCount]:
        rows = await self._db.read("counting runs", fetch_all(pg(RUN_COUNTS), ()))
        return run_counts_from_rows(rows)

    async def _results(self, run_id: str, node_id: str | None = None) -> list[ResultRow]:
        read = self._body(bodies.results, run_id, node_id)
        return await self._db.read(f"run {run_id!r}", read)

    async def _outputs(self, run_ids: list[str]) -> dict[str, str]:
        read = self._body(bodies.outputs, run_ids)
        return await self._db.read(f"outputs of {len(run_ids)} runs", read)

    async def _frozen_inputs(self, run_id: str) -> list[FrozenInput]:
        read = self._body(bodies.frozen_inputs, run_id)
        return await self._db.read(f"run {run_id!r}", read)

    async def _events(self, run_id: str, *, after_seq: int = 0) -> list[EventRow]:
        read = self._body(bodies.events, run_id, after_seq)
        return await self._db.read(f"run {run_id!r}", read)

    async def _chunks(self, run_id: str, *, after: int, limit: int) -> list[ChunkRow]:
        read = self._body(bodies.chunks, run_id, after, limit)
        return await self._db.read(f"run {run_id!r}", read)

    async def _stream_head(self, run_id: str) -> StreamHead:
        return await self._db.read(f"run {run_id!r}", self._body(bodies.stream_head, run_id))

    async def _prune_streams(self, finished_before: float) -> int:
        prune = self._body(bodies.prune_streams, finished_before)
        return await self._db.write("pruning streams", prune)

    def _body(self, body: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> Work[T]:
        """Work running the shared ``body(tx, *args, **kwargs)`` on a pooled connection."""
        channel = self._channel

        async def work(conn: Conn, attempt: Attempt) -> T:
            return await body(PostgresTx(conn, attempt, channel), *args, **kwargs)

        return work

    # -- leases (D6) ------------------------------------------------------------------

    async def _acquire_lease(
        self, run_id: str, owner: str, ttl: float, *, steal_from: str | None = None
    ) -> int:
        # A call that fails or is cancelled after granting a new lease releases
        # it (shielded) before raising, so it leaves no lease behind.
        granted: list[int] = []  # new tokens this call wrote (a re-acquire keeps its token)

        async def grant(conn: Conn, attempt: Attempt) -> int:
            tx = PostgresTx(conn, attempt, self._channel)
            token, new = await bodies.take_lease(tx, run_id, owner, ttl, steal_from, self._clock)
            if new:
                granted.append(token)
            return token

        try:
            return await self._db.write(f"run {run_id!r}", grant)  # a re-run finds it ours
        except BaseException:
            if granted:
                with contextlib.suppress(Exception):  # never hide the original failure
                    await self._db.shielded(self.release_lease(run_id, owner, granted[-1]))
            raise

    async def _heartbeat(self, run_id: str, owner: str, token: int, ttl: float) -> None:
        extend = self._body(bodies.extend_lease, run_id, owner, token, ttl, self._clock)
        await self._db.write(f"run {run_id!r}", extend)

    async def _release_lease(self, run_id: str, owner: str, token: int) -> None:

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

    async def _submit_runs(
        self,
        runs: Sequence[tuple[NewRun, Submission]],
        claim: Claim | None,
        skip: tuple[str, ...],
    ) -> tuple[list[str], list[str]]:
        channel = self._channel
        claimed: list[str] = []

        async def insert(conn: Conn, attempt: Attempt) -> tuple[list[str], list[str]]:
            claimed.clear()
            # Pipelined: every insert (with its origin) goes in one round trip, then the
            # shapes (one per graph version) and (with no claim) the wake-up in one more.
            async with conn.pipeline():
                cursors = [
                    await conn.execute(INSERT_QUEUED, queued_run_params(run, q)) for run, q in runs
                ]
                stored: list[NewRun] = []
                for (run, _), cur in zip(runs, cursors, strict=True):
                    row = await cur.fetchone()
                    if row is not None:  # else submitted before: left as it is
                        attempt.xid = row[0]
                        stored.append(run)
                await _keep_shapes(conn, stored)
                if claim is None and stored:
                    await notify(conn, channel, "submit")
            if claim is not None:
                ids, xid = await claim_queued(
                    conn, self._db.schema, claim.queue, claim.owner, claim.ttl, claim.limit,
                    self._clock, skip=skip,
                )  # fmt: skip
                attempt.xid = attempt.xid or xid
                claimed.extend(ids)
                if {run.run_id for run in stored} - set(claimed):
                    await notify(conn, channel, "submit")
            return [run.run_id for run in stored], list(claimed)

        async def landed(conn: Conn) -> tuple[list[str], list[str]]:
            # The lost COMMIT stored what it inserted, and leased what it claimed.
            return [run.run_id for run, _ in runs], list(claimed)

        def texts() -> list[tuple[str, str | None]]:
            return [("input_json", run.input_json) for run, _ in runs]

        context = f"{len(runs)} runs from {runs[0][0].run_id!r}"
        if claim is None:
            return await self._db.write(context, insert, landed=landed, texts=texts)
        return await self._leasing(context, insert, landed, claim.owner, lambda: claimed, texts)

    async def _return_claim(self, run_id: str, owner: str) -> bool:
        channel = self._channel

        async def give_back(conn: Conn, attempt: Attempt) -> bool:
            cur = await conn.execute(pg(RETURN_CLAIM), (self._clock(), run_id, owner))
            if cur.rowcount != 1:
                return False
            await notify(conn, channel, "submit")  # queued again: wake the workers
            return True

        return await self._db.write(f"run {run_id!r}", give_back)

    async def _expired_leases(self, now: float, *, limit: int = 100) -> list[str]:
        query = pg(EXPIRED_LEASES)
        rows = await self._db.read("finding expired leases", fetch_all(query, (now, max(limit, 0))))
        return [r[0] for r in rows]

    # -- the question ledger (Q2-Q5) ---------------------------------------------

    async def _answer(
        self,
        question_id: str,
        answer_json: str,
        *,
        by: str | None = None,
        status: QuestionStatus = QuestionStatus.ANSWERED,
    ) -> QuestionRow:
        answer = self._body(bodies.answer, question_id, answer_json, by, status, self._clock())
        question = self._body(bodies.get_question, question_id)
        return await self._db.write(
            f"question {question_id!r}", answer,
            landed=lambda conn: question(conn, Attempt()),
            texts=lambda: [("answer_json", answer_json)],
        )  # fmt: skip

    async def _get_question(self, question_id: str) -> QuestionRow:
        read = self._body(bodies.get_question, question_id)
        return await self._db.read(f"question {question_id!r}", read)

    async def _list_questions(
        self,
        *,
        status: QuestionStatus | None = None,
        run_id: str | None = None,
        limit: int | None = None,
        offset: int = 0,
    ) -> list[QuestionRow]:
        query, params = list_questions_query(status, run_id)
        params += (None if limit is None else max(limit, 0), offset)
        rows = await self._db.read("listing questions", fetch_all(pg(query), params))
        return [question_from_row(r) for r in rows]

    async def _list_parked(
        self,
        *,
        graph_name: str | None,
        node_id: str | None,
        status: ParkedStatus | None,
        claimed_by: str | None,
    ) -> list[ParkedRow]:
        read = self._body(bodies.list_parked, graph_name, node_id, status, claimed_by)
        return await self._db.read("listing parked items", read)

    async def _claim_parked(
        self, graph_name: str, node_id: str, claimant: str, limit: int
    ) -> list[ParkedRow]:
        # Idempotent (a claimant gets back what it holds), so a lost COMMIT is re-run.
        claim = self._body(bodies.claim_parked, graph_name, node_id, claimant, limit, self._clock())
        return await self._db.write(f"claiming parked items of {node_id!r}", claim)

    async def _drop_parked(self, park_id: str) -> bool:
        drop = self._body(bodies.drop_parked, park_id)
        return await self._db.write(f"parked item {park_id!r}", drop)

    async def _question_counts(self) -> dict[QuestionStatus, int]:
        rows = await self._db.read("counting questions", fetch_all(pg(QUESTION_COUNTS), ()))
        return question_counts_from(rows)

    async def _unapplied_answers(
        self, *, limit: int = 100, now: float | None = None
    ) -> list[QuestionRow]:
        params = (self._clock() if now is None else now, max(limit, 0))
        rows = await self._db.read("listing unapplied answers", fetch_all(pg(DUE_ANSWERS), params))
        return [question_from_row(r) for r in rows]

    async def _defer_answer(self, question_id: str, *, error: str, retry_at: float) -> None:
        values = (error, retry_at, question_id)
        cas = self._body(bodies.question_cas, DEFER_ANSWER, values, question_id)
        await self._db.write(f"question {question_id!r}", cas, landed=changed)  # changed or not

    async def _mark_applied(self, question_id: str) -> bool:
        values = (self._clock(), question_id)
        cas = self._body(bodies.question_cas, APPLY_QUESTION, values, question_id)
        return await self._db.write(f"question {question_id!r}", cas, landed=changed)

    async def _supersede(self, question_id: str) -> bool:
        cas = self._body(bodies.question_cas, SUPERSEDE_QUESTION, (question_id,), question_id)
        return await self._db.write(f"question {question_id!r}", cas, landed=changed)

    # -- the evolve ledger --------------------------------------------------------

    async def _artifact_head(self, artifact_id: str) -> ArtifactVersion | None:
        rows = await self._db.read(
            f"artifact {artifact_id!r}", fetch_all(pg(SELECT_ARTIFACT_HEAD), (artifact_id,))
        )
        return artifact_from_row(rows[0]) if rows else None

    async def _commit_artifact(
        self, artifact_id: str, expected: int, entries_json: str, meta_json: str = "{}"
    ) -> ArtifactVersion:
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

        return await self._db.write(
            f"artifact {artifact_id!r}", insert, landed=landed,
            texts=lambda: [("entries_json", entries_json), ("meta_json", meta_json)],
        )  # fmt: skip

    async def _artifact_history(self, artifact_id: str) -> list[ArtifactVersion]:
        rows = await self._db.read(
            f"artifact {artifact_id!r}", fetch_all(pg(SELECT_ARTIFACT_HISTORY), (artifact_id,))
        )
        return [artifact_from_row(r) for r in rows]

    def changes(self) -> contextlib.AbstractAsyncContextManager[ChangeFeed]:
        """Wake-ups from ``LISTEN`` on the schema's channel (see :meth:`RunStore.changes`)."""
        return self._hub.subscribe()

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
                async with await self._db.connect() as conn:
                    await conn.execute(listen)
                    if ready.is_set():
                        hub.deliver_all()  # back after an outage: what was missed meanwhile
                    ready.set()
                    async for note in conn.notifies():
                        kinds = frozenset(note.payload.split(",")) & CHANGE_KINDS
                        hub.deliver(kinds or CHANGE_KINDS)
            except (psycopg.Error, OSError) as exc:
                logger.warning("listening for changes failed (%s); polling meanwhile", exc)
            ready.set()
            hub.deliver_all()
            await asyncio.sleep(FALLBACK_POLL)

    async def close(self) -> None:
        """Stop listening, finish cleanups left by cancelled callers, close the pool. Idempotent."""
        await self._hub.close()
        await self._db.close()

    async def _submit_run(self, run: NewRun, submission: Submission) -> str:
        q = submission
        channel = self._channel

        async def insert(conn: Conn, attempt: Attempt) -> str:
            for _ in range(3):  # a dedup holder may finish between the insert and the look
                cur = await conn.execute(INSERT_QUEUED, queued_run_params(run, q))
                row = await cur.fetchone()
                if row is not None:
                    attempt.xid = row[0]
                    await _keep_shapes(conn, [run])
                    await notify(conn, channel, "submit")
                    return run.run_id
                if q.dedup_key is not None:
                    cur = await conn.execute(pg(DEDUP_HOLDER), (q.queue, q.dedup_key))
                    holder = await cur.fetchone()
                    if holder is not None:
                        return str(holder[0])
                cur = await conn.execute("SELECT 1 FROM runs WHERE run_id = %s", (run.run_id,))
                if await cur.fetchone() is not None:
                    raise RunExists(f"run {run.run_id!r} already exists")
            raise RunExists(
                f"run {run.run_id!r}: its dedup key {q.dedup_key!r} keeps changing hands"
            )

        async def landed(conn: Conn) -> str:
            return run.run_id

        return await self._db.write(
            f"run {run.run_id!r}", insert, landed=landed,
            texts=lambda: [("input_json", run.input_json)],
        )  # fmt: skip

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
        if queue not in self._full_queues:
            rows = await self._db.read(f"queue {queue!r}", fetch_all(pg(ANY_QUEUED), (queue,)))
            if not rows:
                return []
        claimed: list[str] = []

        async def claim(conn: Conn, attempt: Attempt) -> list[str]:
            claimed.clear()
            ids, xid = await claim_queued(
                conn, self._db.schema, queue, owner, ttl, limit, self._clock, graphs, skip
            )
            attempt.xid = xid
            claimed.extend(ids)
            return list(claimed)

        async def landed(conn: Conn) -> list[str]:
            return list(claimed)

        ids = await self._leasing(f"queue {queue!r}", claim, landed, owner, lambda: claimed)
        if len(ids) >= limit:
            self._full_queues.add(queue)
        else:
            self._full_queues.discard(queue)
        return ids

    async def _claim_answers(self, owner: str, ttl: float, *, limit: int) -> list[QuestionRow]:
        now = self._clock()
        first = await self._db.read(
            "claiming answers", fetch_all(pg(ANSWER_CANDIDATES), (now, now, 1))
        )
        if not first:
            return []
        taken: list[QuestionRow] = []

        async def lease(conn: Conn, attempt: Attempt) -> list[QuestionRow]:
            taken.clear()
            attempt.xid = await transaction_id(conn)
            now = self._clock()
            cur = await conn.execute(pg(ANSWER_CANDIDATES) + SKIP_LOCKED, (now, now, limit * 4 + 8))
            active: dict[str, int | None] = {}
            seen: set[str] = set()
            for question_id, run_id, queue_name in await cur.fetchall():
                if len(taken) >= limit or run_id in seen:
                    continue
                seen.add(run_id)
                if queue_name is not None and not await self._slot_for(
                    conn, queue_name, active, now
                ):
                    continue
                done = await conn.execute(pg(LEASE_FOR_ANSWER), (owner, now + ttl, run_id, now))
                if done.rowcount == 1:
                    taken.append(
                        await bodies.get_question(
                            PostgresTx(conn, attempt, self._channel), question_id
                        )
                    )
            return list(taken)

        async def landed(conn: Conn) -> list[QuestionRow]:
            return list(taken)

        return await self._leasing(
            "claiming answers", lease, landed, owner, lambda: [q.run_id for q in taken]
        )

    async def _slot_for(
        self, conn: Conn, queue: str, active: dict[str, int | None], now: float
    ) -> bool:
        """Whether ``queue`` has a free slot for one more run (counted once, under its lock)."""
        if queue not in active:
            spec = await declared(conn, queue)
            if spec is None:
                active[queue] = 0  # its row cannot be used: paused until declared again
            elif spec.concurrency is None:
                active[queue] = None
            else:
                await lock_queue(conn, self._db.schema, queue)
                count = await count_rows(conn, ACTIVE_IN_QUEUE, (queue, now))
                active[queue] = spec.concurrency - count
        free = active[queue]
        if free is None:
            return True
        if free <= 0:
            return False
        active[queue] = free - 1
        return True

    async def _leasing(
        self,
        context: str,
        work: Work[T],
        landed: Landed[T],
        owner: str,
        leased: Any,
        texts: Texts | None = None,
    ) -> T:
        """Run a claim (its ids known before COMMIT, so a lost COMMIT answer is settled by
        ``landed``); if it fails or its caller is cancelled, release what it may have
        leased, shielded, so those runs are adopted at once instead of after their ttl."""
        try:
            return await self._db.write(context, work, landed=landed, texts=texts)
        except BaseException:
            run_ids = list(leased())
            if run_ids:
                with contextlib.suppress(Exception):
                    await self._db.shielded(self._release_all(run_ids, owner))
            raise

    async def _release_all(self, run_ids: list[str], owner: str) -> None:
        channel = self._channel

        async def release(conn: Conn, attempt: Attempt) -> None:
            for run_id in run_ids:
                await conn.execute(
                    "UPDATE runs SET lease_owner = NULL, lease_expires = NULL "
                    "WHERE run_id = %s AND lease_owner = %s",
                    (run_id, owner),
                )
            await notify(conn, channel, "release")

        await self._db.write("releasing claimed runs", release)

    async def _request_cancel(self, run_id: str) -> RunStatus:
        async def cancel(conn: Conn, attempt: Attempt) -> RunStatus:
            tx = PostgresTx(conn, attempt, self._channel)
            return await bodies.request_cancel(tx, run_id, self._clock())

        return await self._db.write(f"run {run_id!r}", cancel)  # a re-run changes nothing

    async def _reopen_cancelled(
        self, run_id: str, owner: str, ttl: float, nodes: tuple[str, ...]
    ) -> bool:
        async def reopen(conn: Conn, attempt: Attempt) -> bool:
            tx = PostgresTx(conn, attempt, self._channel)
            return await bodies.reopen_cancelled(tx, run_id, owner, ttl, nodes, self._clock())

        # A re-run after a lost COMMIT finds the run running: False, and the caller's
        # resume then finds its own lease.
        return await self._db.write(f"run {run_id!r}", reopen)

    async def _cancel_requests(self, owner: str) -> list[str]:
        rows = await self._db.read(
            "listing cancel requests", fetch_all(pg(CANCEL_REQUESTS), (owner,))
        )
        return [r[0] for r in rows]

    async def _runs_leased_by(self, owner: str, *, limit: int = 100) -> list[str]:
        rows = await self._db.read(
            "listing leased runs", fetch_all(pg(LEASED_BY), (owner, max(limit, 0)))
        )
        return [r[0] for r in rows]

    async def _declare_queue(self, queue: Queue) -> None:
        channel = self._channel

        async def upsert(conn: Conn, attempt: Attempt) -> None:
            await conn.execute(pg(UPSERT_QUEUE), queue_params(queue, self._clock()))
            await notify(conn, channel, "submit")  # new limits may let more runs start
            await notify(conn, channel, "config")

        await self._db.write(f"queue {queue.name!r}", upsert)

    async def _queues(self) -> list[Queue]:
        rows = await self._db.read("listing queues", fetch_all(pg(SELECT_QUEUES), ()))
        return queue_rows(rows)

    async def _register_graph(self, row: GraphRow) -> None:
        params = (row.name, row.fingerprint, row.graph_ref, row.registered_at)

        async def upsert(conn: Conn, attempt: Attempt) -> None:
            await conn.execute(pg(UPSERT_GRAPH), params)

        await self._db.write(f"graph {row.name!r}", upsert)

    async def _graphs_named(self, name: str) -> list[GraphRow]:
        rows = await self._db.read(f"graph {name!r}", fetch_all(pg(SELECT_GRAPHS_NAMED), (name,)))
        return [graph_from_row(r) for r in rows]

    async def _declare_schedule(self, row: ScheduleRow) -> None:
        async def declare(conn: Conn, attempt: Attempt) -> None:
            await bodies.declare_schedule(PostgresTx(conn, attempt, self._channel), row)

        await self._db.write(f"schedule {row.name!r}", declare)

    async def _schedules(self) -> list[ScheduleRow]:
        rows = await self._db.read("listing schedules", fetch_all(pg(SELECT_SCHEDULES), ()))
        return [schedule_from_row(r) for r in rows]

    async def _fire_schedule(self, name: str, tick: float) -> str | None:
        fired: list[str | None] = [None]

        async def fire(conn: Conn, attempt: Attempt) -> str | None:
            attempt.xid = await transaction_id(conn)
            tx = PostgresTx(conn, attempt, self._channel)
            fired[0] = await bodies.fire_schedule(tx, name, tick, self._clock())
            return fired[0]

        async def landed(conn: Conn) -> str | None:
            return fired[0]  # its COMMIT landed: the run it stored is the tick's

        return await self._db.write(f"schedule {name!r}", fire, landed=landed)

    async def _delete_schedule(self, name: str) -> bool:
        async def delete(conn: Conn, attempt: Attempt) -> bool:
            cur = await conn.execute(pg(DELETE_SCHEDULE), (name,))
            return cur.rowcount == 1

        return await self._db.write(f"schedule {name!r}", delete)

    async def _pause_queue(self, name: str) -> None:
        async def pause(conn: Conn, attempt: Attempt) -> None:
            tx = PostgresTx(conn, attempt, self._channel)
            await bodies.pause_queue(tx, name, self._clock())

        await self._db.write(f"queue {name!r}", pause)  # a re-run changes nothing

    async def _resume_queue(self, name: str) -> bool:
        async def resume(conn: Conn, attempt: Attempt) -> bool:
            return await bodies.resume_queue(PostgresTx(conn, attempt, self._channel), name)

        return await self._db.write(f"queue {name!r}", resume)

    async def _delete_queue(self, name: str) -> bool:
        async def delete(conn: Conn, attempt: Attempt) -> bool:
            return await bodies.delete_queue(PostgresTx(conn, attempt, self._channel), name)

        return await self._db.write(f"queue {name!r}", delete)

    async def _queue_stats(self, now: float, *, window: float = 60.0) -> list[QueueStats]:

        async def read(conn: Conn, attempt: Attempt) -> list[QueueStats]:
            async with conn.transaction():
                await conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
                counts = await (
                    await conn.execute(pg(QUEUE_COUNTS), (now - window, now))
                ).fetchall()
                queues = await (await conn.execute(pg(SELECT_QUEUES))).fetchall()
                workers = await (await conn.execute(pg(SELECT_WORKERS))).fetchall()
            return stats_from_counts(
                counts, queue_rows(queues), worker_rows(workers),
                now, window, paused_names(queues),
            )  # fmt: skip

        return await self._db.read("queue statistics", read)

    async def _worker_seen(self, worker: WorkerRow) -> None:

        async def upsert(conn: Conn, attempt: Attempt) -> None:
            await conn.execute(pg(UPSERT_WORKER), worker_params(worker))

        await self._db.write(f"worker {worker.worker_id!r}", upsert)

    async def _pulse(self, worker: WorkerRow) -> Pulse:
        async def beat(conn: Conn, attempt: Attempt) -> Pulse:
            tx = PostgresTx(conn, attempt, self._channel)
            return await bodies.pulse(tx, worker, self._clock())

        return await self._db.write(f"worker {worker.worker_id!r}", beat)  # a re-run: the same

    async def _workers(self) -> list[WorkerRow]:
        rows = await self._db.read("listing workers", fetch_all(pg(SELECT_WORKERS), ()))
        return worker_rows(rows)

    async def _forget_worker(self, worker_id: str) -> None:

        async def delete(conn: Conn, attempt: Attempt) -> None:
            await conn.execute(pg(DELETE_WORKER), (worker_id,))

        await self._db.write(f"worker {worker_id!r}", delete)

    async def _run_durations(
        self, fingerprint: str, *, limit: int = 200
    ) -> list[tuple[float, float]]:
        rows = await self._db.read(
            "run durations", fetch_all(pg(RUN_DURATIONS), (fingerprint, max(limit, 0)))
        )
        return [(float(c), float(s)) for c, s in rows]


async def _keep_shapes(conn: Conn, runs: Sequence[NewRun]) -> None:
    """Keep the graph structure of ``runs``, once per graph version (V1)."""
    shapes: dict[tuple[str, str], tuple[object, ...]] = {}
    for run in runs:
        params = shape_params(run)
        if params is not None:
            shapes.setdefault((run.graph_name, run.fingerprint), params)
    for params in shapes.values():
        await conn.execute(pg(INSERT_SHAPE), params)
