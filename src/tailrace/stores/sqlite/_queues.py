"""The SQLite store's queues, claims, workers and wake-ups.

Claims run on the writer thread inside its ``BEGIN IMMEDIATE`` transaction,
which keeps every other process's writer out while the queue's counts are
read and its runs marked: counting and claiming are one atomic step, across
processes. A claim first looks, on a reader, whether anything waits at all,
so an idle queue costs no write.

Wake-ups: :class:`DataVersionWatch` polls ``PRAGMA data_version`` on a
connection of its own every few milliseconds (it changes whenever another
connection, in this process or another, commits) and then reads the small
``signals`` table, which ``submit_run``, ``answer``, ``release_lease`` and
``request_cancel`` bump in their transactions, to tell which kind changed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

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
    BUMP_SIGNAL,
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
    SELECT_SIGNALS,
    SELECT_WORKERS,
    STARTED_SINCE,
    UPSERT_QUEUE,
    UPSERT_WORKER,
    claim_candidates,
)
from .._sql._statements import (
    INSERT_QUEUED_RUN,
    SELECT_QUESTION,
    question_from_row,
    queued_run_params,
)
from ._threads import Undo

T = TypeVar("T")
logger = logging.getLogger("tailrace.stores")

#: Seconds between two ``data_version`` checks of a watcher.
WATCH_INTERVAL = 0.002


def declared(conn: sqlite3.Connection, name: str) -> Queue:
    """The declared limits of queue ``name`` (the defaults if it was never declared)."""
    row = conn.execute(SELECT_QUEUE, (name,)).fetchone()
    return Queue(name) if row is None else queue_from_row(row)


def bump(conn: sqlite3.Connection, kind: str) -> None:
    """Tell watchers, in this transaction, that a change of ``kind`` happened."""
    conn.execute(BUMP_SIGNAL, (kind,))


def claim(
    conn: sqlite3.Connection, queue: str, owner: str, ttl: float, limit: int, now: float
) -> list[str]:
    """Claim up to ``limit`` runs of ``queue`` within its limits (the writer's transaction)."""
    spec = declared(conn, queue)
    active = conn.execute(ACTIVE_IN_QUEUE, (queue, now)).fetchone()[0] if spec.concurrency else 0
    started = (
        conn.execute(STARTED_SINCE, (queue, now - spec.period)).fetchone()[0] if spec.limit else 0
    )
    free = free_slots(spec, want=limit, active=active, started_recently=started)
    if free <= 0:
        return []
    ids = [row[0] for row in conn.execute(claim_candidates(spec), (queue, free))]
    for run_id in ids:
        conn.execute(CLAIM_RUN, (owner, now + ttl, now, now, run_id))
    return ids


def lease_answers(
    conn: sqlite3.Connection, owner: str, ttl: float, limit: int, now: float
) -> list[str]:
    """Lease suspended runs with a due answer; the ids of one due question per leased run."""
    taken: dict[str, str] = {}
    active: dict[str, int] = {}
    for question_id, run_id, queue_name in conn.execute(
        ANSWER_CANDIDATES, (now, now, limit * 4 + 8)
    ).fetchall():
        if len(taken) >= limit:
            break
        if run_id in taken:
            continue
        if queue_name is not None:
            spec = declared(conn, queue_name)
            if spec.concurrency is not None:
                if queue_name not in active:
                    active[queue_name] = conn.execute(
                        ACTIVE_IN_QUEUE, (queue_name, now)
                    ).fetchone()[0]
                if active[queue_name] >= spec.concurrency:
                    continue
                active[queue_name] += 1
        if conn.execute(LEASE_FOR_ANSWER, (owner, now + ttl, run_id, now)).rowcount == 1:
            taken[run_id] = question_id
    return list(taken.values())


class DataVersionWatch:
    """A thread that turns commits to the database file into wake-ups on a :class:`ChangeHub`."""

    def __init__(
        self, connect: Callable[[], sqlite3.Connection], interval: float = WATCH_INTERVAL
    ) -> None:
        self._connect = connect
        self._interval = interval
        self._stopping = threading.Event()
        self._ready = threading.Event()

    async def start(self, hub: ChangeHub) -> Stop:
        """Start watching for ``hub``; returns once the first reading is taken."""
        thread = threading.Thread(
            target=self._main, args=(hub,), name="tailrace-sqlite-watch", daemon=True
        )
        thread.start()
        await asyncio.to_thread(self._ready.wait)

        async def stop() -> None:
            self._stopping.set()
            await asyncio.to_thread(thread.join)

        return stop

    def _main(self, hub: ChangeHub) -> None:
        conn: sqlite3.Connection | None = None
        try:
            conn = self._connect()
            version, seen = self._read(conn, None, {}, hub)
            self._ready.set()
            while not self._stopping.wait(self._interval):
                version, seen = self._read(conn, version, seen, hub)
        except Exception:  # the file is gone or broken: waiters fall back on their own polls
            logger.exception("SQLite change watcher stopped")
            hub.deliver_all()
        finally:
            self._ready.set()
            if conn is not None:
                conn.close()

    @staticmethod
    def _read(
        conn: sqlite3.Connection, version: int | None, seen: dict[str, int], hub: ChangeHub
    ) -> tuple[int | None, dict[str, int]]:
        try:
            now = conn.execute("PRAGMA data_version").fetchone()[0]
            if now == version:
                return version, seen
            counts = {str(k): int(n) for k, n in conn.execute(SELECT_SIGNALS)}
        except sqlite3.OperationalError:  # busy, or a checkpoint: look again next time
            return version, seen
        if version is not None:
            kinds = frozenset(k for k, n in counts.items() if seen.get(k) != n)
            if kinds:
                hub.deliver(kinds)
        return now, counts


class SQLiteQueues:
    """Queue methods of :class:`~tailrace.stores.SQLiteStore` (see :class:`~tailrace.stores.RunStore`)."""

    _clock: Callable[[], float]
    _hub: ChangeHub

    if TYPE_CHECKING:  # the store's own; declared for the type checker only

        async def _write(
            self,
            context: str,
            apply: Callable[[sqlite3.Connection], T],
            *,
            undo: Undo[T] | None = None,
        ) -> T: ...

        async def _read(self, context: str, read: Callable[[sqlite3.Connection], T]) -> T: ...

    def changes(self) -> contextlib.AbstractAsyncContextManager[ChangeFeed]:
        """Wake-ups from the ``data_version`` watcher (see :meth:`RunStore.changes`)."""
        return self._hub.subscribe()

    async def submit_run(self, run: NewRun, submission: Submission) -> str:
        """Store ``run`` queued, or return the live run holding its dedup key (one write transaction)."""
        check_new_format(run)
        q = submission
        check_names(
            run_id=run.run_id, graph_name=run.graph_name, graph_ref=run.graph_ref,
            fingerprint=run.fingerprint, queue=q.queue, partition=q.partition,
            dedup_key=q.dedup_key,
        )  # fmt: skip

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

    async def claim_runs(self, queue: str, owner: str, ttl: float, *, limit: int) -> list[str]:
        """Claim up to ``limit`` runs of ``queue`` in one write transaction (after a look on a reader)."""
        check_claim(queue, owner, ttl, limit)
        if limit <= 0:
            return []
        waiting = await self._read(
            f"queue {queue!r}", lambda conn: conn.execute(ANY_QUEUED, (queue,)).fetchone()
        )
        if waiting is None:
            return []

        def undo(ids: list[str]) -> Callable[[sqlite3.Connection], object]:
            return lambda conn: _release_all(conn, ids, owner)  # adopted at once by anyone

        return await self._write(
            f"queue {queue!r}",
            lambda conn: claim(conn, queue, owner, ttl, limit, self._clock()),
            undo=undo,
        )

    async def claim_answers(self, owner: str, ttl: float, *, limit: int) -> list[QuestionRow]:
        """Lease up to ``limit`` suspended runs with a due answer, in one write transaction."""
        check_name("owner", owner)
        check_ttl(ttl)
        if limit <= 0:
            return []
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
            return lambda conn: _release_all(conn, [q.run_id for q in rows], owner)

        return await self._write("claiming answers", apply, undo=undo)

    async def request_cancel(self, run_id: str) -> RunStatus:
        """Cancel a queued run, or mark a running or suspended one, in one write transaction."""
        check_name("run_id", run_id)

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

    async def cancel_requests(self, owner: str) -> list[str]:
        """Running runs leased to ``owner`` with a cancel request."""
        check_name("owner", owner)
        return await self._read(
            "listing cancel requests",
            lambda conn: [r[0] for r in conn.execute(CANCEL_REQUESTS, (owner,))],
        )

    async def runs_leased_by(self, owner: str, *, limit: int = 100) -> list[str]:
        """Running runs whose lease ``owner`` holds."""
        check_name("owner", owner)
        return await self._read(
            "listing leased runs",
            lambda conn: [r[0] for r in conn.execute(LEASED_BY, (owner, max(limit, 0)))],
        )

    async def declare_queue(self, queue: Queue) -> None:
        """Store ``queue``'s limits (an upsert)."""
        check_name("queue", queue.name)

        def apply(conn: sqlite3.Connection) -> None:
            conn.execute(UPSERT_QUEUE, queue_params(queue, self._clock()))
            bump(conn, "submit")  # new limits may let more runs start

        await self._write(f"queue {queue.name!r}", apply)

    async def queues(self) -> list[Queue]:
        """Every declared queue, by name."""
        return await self._read(
            "listing queues", lambda conn: [queue_from_row(r) for r in conn.execute(SELECT_QUEUES)]
        )

    async def queue_stats(self, now: float, *, window: float = 60.0) -> list[QueueStats]:
        """Per-queue counts at ``now``, read in one read transaction."""

        def read(conn: sqlite3.Connection) -> list[QueueStats]:
            counts = conn.execute(QUEUE_COUNTS, (now - window, now)).fetchall()
            declared_queues = [queue_from_row(r) for r in conn.execute(SELECT_QUEUES)]
            workers = [worker_from_row(r) for r in conn.execute(SELECT_WORKERS)]
            return stats_from_counts(counts, declared_queues, workers, now, window)

        return await self._read("queue statistics", read)

    async def worker_seen(self, worker: WorkerRow) -> None:
        """Record ``worker``'s report (an upsert)."""
        check_worker(worker)
        await self._write(
            f"worker {worker.worker_id!r}",
            lambda conn: conn.execute(UPSERT_WORKER, worker_params(worker)),
        )

    async def workers(self) -> list[WorkerRow]:
        """Every reported worker, by id."""
        return await self._read(
            "listing workers",
            lambda conn: [worker_from_row(r) for r in conn.execute(SELECT_WORKERS)],
        )

    async def forget_worker(self, worker_id: str) -> None:
        """Drop ``worker_id``'s report."""
        check_name("worker_id", worker_id)
        await self._write(
            f"worker {worker_id!r}", lambda conn: conn.execute(DELETE_WORKER, (worker_id,))
        )

    async def run_durations(
        self, fingerprint: str, *, limit: int = 200
    ) -> list[tuple[float, float]]:
        """``(cost, seconds)`` of the latest completed queued runs of ``fingerprint``."""
        check_name("fingerprint", fingerprint)
        return await self._read(
            "run durations",
            lambda conn: [
                (float(c), float(s))
                for c, s in conn.execute(RUN_DURATIONS, (fingerprint, max(limit, 0)))
            ],
        )


def _release_all(conn: sqlite3.Connection, run_ids: list[str], owner: str) -> None:
    """Drop ``owner``'s leases on ``run_ids`` (a claim whose caller was cancelled)."""
    for run_id in run_ids:
        conn.execute(
            "UPDATE runs SET lease_owner = NULL, lease_expires = NULL "
            "WHERE run_id = ? AND lease_owner = ?",
            (run_id, owner),
        )
    bump(conn, "release")
