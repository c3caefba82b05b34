"""The Postgres store's queues, claims, workers and wake-ups.

Claims select candidate rows with ``FOR UPDATE OF r SKIP LOCKED``, so
workers claiming at once never wait on, nor take, each other's rows. A queue
whose limits need counting (``concurrency``, a rate limit) is claimed under a
transaction-scoped advisory lock on the queue's name: the count and the claim
are then one step, and READ COMMITTED lets the next claimer's count see the
runs the previous one marked. Partitions need no lock: a run qualifies only
while no run of its partition is live or older, and a concurrent claimer's
uncommitted claim still reads as ``queued`` and older.

A claim whose COMMIT answer was lost returns the runs it marked (they are
known before COMMIT); a cancelled claim releases what it leased, shielded,
so those runs are adopted at once rather than after their ttl.

Wake-ups: ``submit_run``, ``answer``, ``release_lease`` and
``request_cancel`` send ``NOTIFY`` on the schema's channel inside their
transaction (delivered on commit). :class:`PostgresQueues` keeps one
``LISTEN`` connection per store object while anyone subscribes, and falls
back to polling (every kind reported every half second) while it is down.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from typing import Any

import psycopg
from psycopg import sql

from ..._errors import RunExists, RunNotFound
from .._changes import ChangeHub, Stop
from .._contract import ChangeFeed
from .._queue_rules import (
    check_claim,
    check_worker,
    free_slots,
    queue_from_row,
    queue_params,
    stats_from_counts,
    worker_from_row,
    worker_params,
)
from .._records import (
    CHANGE_KINDS,
    NewRun,
    QuestionRow,
    Queue,
    QueueStats,
    RunStatus,
    Submission,
    WorkerRow,
)
from .._rules import check_name, check_names, check_new_format, check_ttl, parse_status
from .._sql._queues import (
    ACTIVE_IN_QUEUE,
    ANSWER_CANDIDATES,
    ANY_QUEUED,
    CANCEL_QUEUED,
    CANCEL_REQUESTS,
    CLAIM_RUN,
    DEDUP_HOLDER,
    DELETE_WORKER,
    LEASE_FOR_ANSWER,
    LEASED_BY,
    QUEUE_COUNTS,
    REQUEST_CANCEL,
    RUN_DURATIONS,
    SELECT_QUEUE,
    SELECT_QUEUES,
    SELECT_WORKERS,
    STARTED_SINCE,
    UPSERT_QUEUE,
    UPSERT_WORKER,
    claim_candidates,
)
from .._sql._statements import INSERT_QUEUED_RUN, queued_run_params
from ._connections import XID, Attempt, Conn, Landed, PostgresConnections, T, Work
from ._sql import fetch_all, pg, select_question

logger = logging.getLogger("tailrace.stores.postgres")

#: First key of the advisory lock that serialises counted claims of one queue ("tq").
_QUEUE_LOCK = 0x7471
#: Seconds between two "anything may have changed" while the listening connection is down.
FALLBACK_POLL = 0.5
_SKIP_LOCKED = " FOR UPDATE OF r SKIP LOCKED"
_INSERT_QUEUED = (
    f"{pg(INSERT_QUEUED_RUN)} ON CONFLICT DO NOTHING RETURNING pg_current_xact_id()::text"
)


def notify_channel(schema: str) -> str:
    """The ``NOTIFY`` channel of a schema's store (an identifier of at most 63 bytes)."""
    name = f"tailrace.{schema}"
    if len(name.encode()) <= 63:
        return name
    return "tailrace." + hashlib.sha256(schema.encode()).hexdigest()[:32]


async def notify(conn: Conn, channel: str, kind: str) -> None:
    """Send a change of ``kind``; delivered to listeners when the transaction commits."""
    await conn.execute("SELECT pg_notify(%s, %s)", (channel, kind))


async def _declared(conn: Conn, name: str) -> Queue:
    cur = await conn.execute(pg(SELECT_QUEUE), (name,))
    row = await cur.fetchone()
    return Queue(name) if row is None else queue_from_row(row)


async def _count(conn: Conn, query: str, params: tuple[object, ...]) -> int:
    cur = await conn.execute(pg(query), params)
    row = await cur.fetchone()
    return int(row[0]) if row is not None else 0


async def _xid(conn: Conn) -> str | None:
    """The transaction's id, assigned now (before any write), for ``pg_xact_status``."""
    cur = await conn.execute(f"SELECT {XID}")
    row = await cur.fetchone()
    return None if row is None else str(row[0])


async def _lock_queue(conn: Conn, schema: str, queue: str) -> None:
    await conn.execute(
        "SELECT pg_advisory_xact_lock(%s, hashtext(%s))", (_QUEUE_LOCK, f"{schema}:{queue}")
    )


class PostgresQueues(PostgresConnections):
    """Queue methods of :class:`~tailrace.stores.PostgresStore` (see :class:`~tailrace.stores.RunStore`)."""

    _hub_of: ChangeHub | None = None

    @property
    def _channel(self) -> str:
        return notify_channel(self._schema)

    @property
    def _hub(self) -> ChangeHub:
        if self._hub_of is None:
            self._hub_of = ChangeHub(self._listen)
        return self._hub_of

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
                async with await self._connect() as conn:
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
        """Stop listening, then close the pool (see :class:`PostgresConnections`). Idempotent."""
        if self._hub_of is not None:
            await self._hub_of.close()
        await super().close()

    # -- submitting ------------------------------------------------------------------

    async def submit_run(self, run: NewRun, submission: Submission) -> str:
        """Store ``run`` queued, or return the live run holding its dedup key; one transaction.

        The dedup index decides between racing submits: the loser inserts
        nothing and returns the winner's id.
        """
        check_new_format(run)
        q = submission
        check_names(
            run_id=run.run_id, graph_name=run.graph_name, graph_ref=run.graph_ref,
            fingerprint=run.fingerprint, queue=q.queue, partition=q.partition,
            dedup_key=q.dedup_key,
        )  # fmt: skip
        channel = self._channel

        async def insert(conn: Conn, attempt: Attempt) -> str:
            for _ in range(3):  # a dedup holder may finish between the insert and the look
                cur = await conn.execute(_INSERT_QUEUED, queued_run_params(run, q))
                row = await cur.fetchone()
                if row is not None:
                    attempt.xid = row[0]
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

        return await self._write(
            f"run {run.run_id!r}", insert, landed=landed,
            texts=lambda: [("input_json", run.input_json)],
        )  # fmt: skip

    # -- claiming --------------------------------------------------------------------

    async def claim_runs(self, queue: str, owner: str, ttl: float, *, limit: int) -> list[str]:
        """Claim up to ``limit`` runs of ``queue`` (``SKIP LOCKED``; a counted queue under its lock)."""
        check_claim(queue, owner, ttl, limit)
        if limit <= 0:
            return []
        rows = await self._read(f"queue {queue!r}", fetch_all(pg(ANY_QUEUED), (queue,)))
        if not rows:
            return []
        claimed: list[str] = []

        async def claim(conn: Conn, attempt: Attempt) -> list[str]:
            claimed.clear()
            attempt.xid = await _xid(conn)
            spec = await _declared(conn, queue)
            active = started = 0
            if spec.concurrency is not None or spec.limit is not None:
                await _lock_queue(conn, self._schema, queue)
            now = self._clock()  # once the lock is ours: what the previous holder claimed is in
            if spec.concurrency is not None:
                active = await _count(conn, ACTIVE_IN_QUEUE, (queue, now))
            if spec.limit is not None:
                started = await _count(conn, STARTED_SINCE, (queue, now - spec.period))
            free = free_slots(spec, want=limit, active=active, started_recently=started)
            if free <= 0:
                return []
            cur = await conn.execute(pg(claim_candidates(spec)) + _SKIP_LOCKED, (queue, free))
            ids = [r[0] for r in await cur.fetchall()]
            # Stamped after the look: a run of a partition then never starts
            # "before" the finish of the one it waited for (same clock).
            stamp = max(now, self._clock())
            for run_id in ids:
                await conn.execute(pg(CLAIM_RUN), (owner, stamp + ttl, stamp, stamp, run_id))
            claimed.extend(ids)
            return ids

        async def landed(conn: Conn) -> list[str]:
            return list(claimed)

        return await self._leasing(f"queue {queue!r}", claim, landed, owner, lambda: claimed)

    async def claim_answers(self, owner: str, ttl: float, *, limit: int) -> list[QuestionRow]:
        """Lease up to ``limit`` suspended runs with a due answer (``SKIP LOCKED``)."""
        check_name("owner", owner)
        check_ttl(ttl)
        if limit <= 0:
            return []
        now = self._clock()
        first = await self._read(
            "claiming answers", fetch_all(pg(ANSWER_CANDIDATES), (now, now, 1))
        )
        if not first:
            return []
        taken: list[QuestionRow] = []

        async def lease(conn: Conn, attempt: Attempt) -> list[QuestionRow]:
            taken.clear()
            attempt.xid = await _xid(conn)
            now = self._clock()
            cur = await conn.execute(
                pg(ANSWER_CANDIDATES) + _SKIP_LOCKED, (now, now, limit * 4 + 8)
            )
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
                    taken.append(await select_question(conn, question_id))
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
            spec = await _declared(conn, queue)
            if spec.concurrency is None:
                active[queue] = None
            else:
                await _lock_queue(conn, self._schema, queue)
                count = await _count(conn, ACTIVE_IN_QUEUE, (queue, now))
                active[queue] = spec.concurrency - count
        free = active[queue]
        if free is None:
            return True
        if free <= 0:
            return False
        active[queue] = free - 1
        return True

    async def _leasing(
        self, context: str, work: Work[T], landed: Landed[T], owner: str, leased: Any
    ) -> T:
        """Run a claim (its ids known before COMMIT, so a lost COMMIT answer is settled by
        ``landed``); if it fails or its caller is cancelled, release what it may have
        leased, shielded, so those runs are adopted at once instead of after their ttl."""
        try:
            return await self._write(context, work, landed=landed)
        except BaseException:
            run_ids = list(leased())
            if run_ids:
                with contextlib.suppress(Exception):
                    await self._shielded(self._release_all(run_ids, owner))
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

        await self._write("releasing claimed runs", release)

    # -- cancelling ------------------------------------------------------------------

    async def request_cancel(self, run_id: str) -> RunStatus:
        """Cancel a queued run, or mark a running or suspended one, in one transaction."""
        check_name("run_id", run_id)
        channel = self._channel

        async def cancel(conn: Conn, attempt: Attempt) -> RunStatus:
            now = self._clock()
            await conn.execute(pg(CANCEL_QUEUED), (now, now, run_id))
            await conn.execute(pg(REQUEST_CANCEL), (now, run_id))
            cur = await conn.execute("SELECT status FROM runs WHERE run_id = %s", (run_id,))
            row = await cur.fetchone()
            if row is None:
                raise RunNotFound(f"no run {run_id!r} in the store")
            await notify(conn, channel, "cancel")
            return parse_status(run_id, row[0])

        return await self._write(f"run {run_id!r}", cancel)  # idempotent: a re-run changes nothing

    async def cancel_requests(self, owner: str) -> list[str]:
        """Running runs leased to ``owner`` with a cancel request."""
        check_name("owner", owner)
        rows = await self._read("listing cancel requests", fetch_all(pg(CANCEL_REQUESTS), (owner,)))
        return [r[0] for r in rows]

    async def runs_leased_by(self, owner: str, *, limit: int = 100) -> list[str]:
        """Running runs whose lease ``owner`` holds."""
        check_name("owner", owner)
        rows = await self._read(
            "listing leased runs", fetch_all(pg(LEASED_BY), (owner, max(limit, 0)))
        )
        return [r[0] for r in rows]

    # -- queues and workers ------------------------------------------------------------

    async def declare_queue(self, queue: Queue) -> None:
        """Store ``queue``'s limits (an upsert)."""
        check_name("queue", queue.name)
        channel = self._channel

        async def upsert(conn: Conn, attempt: Attempt) -> None:
            await conn.execute(pg(UPSERT_QUEUE), queue_params(queue, self._clock()))
            await notify(conn, channel, "submit")  # new limits may let more runs start

        await self._write(f"queue {queue.name!r}", upsert)

    async def queues(self) -> list[Queue]:
        """Every declared queue, by name."""
        rows = await self._read("listing queues", fetch_all(pg(SELECT_QUEUES), ()))
        return [queue_from_row(r) for r in rows]

    async def queue_stats(self, now: float, *, window: float = 60.0) -> list[QueueStats]:
        """Per-queue counts at ``now``, read in one repeatable-read transaction."""

        async def read(conn: Conn, attempt: Attempt) -> list[QueueStats]:
            async with conn.transaction():
                await conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
                counts = await (
                    await conn.execute(pg(QUEUE_COUNTS), (now - window, now))
                ).fetchall()
                queues = await (await conn.execute(pg(SELECT_QUEUES))).fetchall()
                workers = await (await conn.execute(pg(SELECT_WORKERS))).fetchall()
            return stats_from_counts(
                counts, [queue_from_row(r) for r in queues], [worker_from_row(r) for r in workers],
                now, window,
            )  # fmt: skip

        return await self._read("queue statistics", read)

    async def worker_seen(self, worker: WorkerRow) -> None:
        """Record ``worker``'s report (an upsert)."""
        check_worker(worker)

        async def upsert(conn: Conn, attempt: Attempt) -> None:
            await conn.execute(pg(UPSERT_WORKER), worker_params(worker))

        await self._write(f"worker {worker.worker_id!r}", upsert)

    async def workers(self) -> list[WorkerRow]:
        """Every reported worker, by id."""
        rows = await self._read("listing workers", fetch_all(pg(SELECT_WORKERS), ()))
        return [worker_from_row(r) for r in rows]

    async def forget_worker(self, worker_id: str) -> None:
        """Drop ``worker_id``'s report."""
        check_name("worker_id", worker_id)

        async def delete(conn: Conn, attempt: Attempt) -> None:
            await conn.execute(pg(DELETE_WORKER), (worker_id,))

        await self._write(f"worker {worker_id!r}", delete)

    async def run_durations(
        self, fingerprint: str, *, limit: int = 200
    ) -> list[tuple[float, float]]:
        """``(cost, seconds)`` of the latest completed queued runs of ``fingerprint``."""
        check_name("fingerprint", fingerprint)
        rows = await self._read(
            "run durations", fetch_all(pg(RUN_DURATIONS), (fingerprint, max(limit, 0)))
        )
        return [(float(c), float(s)) for c, s in rows]
