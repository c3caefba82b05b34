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
from collections.abc import Callable, Sequence

import psycopg
from psycopg import sql

from .._changes import ChangeHub, Stop
from .._records import CHANGE_KINDS, Claim, NewRun, QuestionRow, StoredRun, Submission
from .._sql import _transactions as bodies
from .._sql._base import Body, SQLStore, Texts, Undo
from .._sql._queues import ACTIVE_IN_QUEUE, ANSWER_CANDIDATES, ANY_QUEUED, LEASE_FOR_ANSWER
from .._sql._statements import INSERT_SHAPE, queued_run_params, shape_params
from ._connections import Attempt, Conn, Landed, PostgresConnections, T, Work
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
from ._sql import PostgresTx, fetch_all, notify, pg

#: Opens a read that sees one moment (``_read_tx(snapshot=True)``).
SNAPSHOT = "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY"


class PostgresStore(SQLStore):
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

    _no_limit = None

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

    async def _read_tx(self, context: str, body: Body[T], *, snapshot: bool = False) -> T:
        channel = self._channel

        async def read(conn: Conn, attempt: Attempt) -> T:
            if not snapshot:  # autocommit statements
                return await body(PostgresTx(conn, attempt, channel))
            async with conn.transaction():
                await conn.execute(SNAPSHOT)
                return await body(PostgresTx(conn, attempt, channel))

        return await self._db.read(context, read)

    async def _write_tx(
        self,
        context: str,
        body: Body[T],
        *,
        landed: Body[T] | None = None,
        texts: Texts | None = None,
        undo: Undo[T] | None = None,
    ) -> T:
        channel = self._channel
        settled: Landed[T] | None = None
        if landed is not None:
            settle = landed

            async def settled(conn: Conn) -> T:
                return await settle(PostgresTx(conn, Attempt(), channel))

        if undo is None:

            async def work(conn: Conn, attempt: Attempt) -> T:
                return await body(PostgresTx(conn, attempt, channel))

            return await self._db.write(context, work, landed=settled, texts=texts)
        returned: list[T] = []  # by each attempt whose body ran to its end

        async def undoable(conn: Conn, attempt: Attempt) -> T:
            returned.append(await body(PostgresTx(conn, attempt, channel)))
            return returned[-1]

        try:
            return await self._db.write(context, undoable, landed=settled, texts=texts)
        except BaseException:
            # Failed or cancelled: undo the last attempt that left something to undo,
            # shielded, so the call leaves nothing behind (a lease it granted).
            compensation = next(filter(None, map(undo, reversed(returned))), None)
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
        leased: Callable[[], Sequence[str]],
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


async def _keep_shapes(conn: Conn, runs: Sequence[NewRun]) -> None:
    """Keep the graph structure of ``runs``, once per graph version (V1)."""
    shapes: dict[tuple[str, str], tuple[object, ...]] = {}
    for run in runs:
        params = shape_params(run)
        if params is not None:
            shapes.setdefault((run.graph_name, run.fingerprint), params)
    for params in shapes.values():
        await conn.execute(pg(INSERT_SHAPE), params)
