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
import logging
import sqlite3
import threading
from collections.abc import Callable
from typing import TypeVar

from .._changes import ChangeHub, Stop
from .._queue_rules import (
    claim_window,
    claimable_queue,
    declared_queue,
    free_slots,
)
from .._records import (
    Queue,
)
from .._sql._queues import (
    ACTIVE_IN_QUEUE,
    ANSWER_CANDIDATES,
    ANY_KEYED,
    BUMP_SIGNAL,
    CLAIM_RUN,
    LEASE_FOR_ANSWER,
    SELECT_QUEUE,
    SELECT_SIGNALS,
    STARTED_SINCE,
    claim_candidates,
)

T = TypeVar("T")
logger = logging.getLogger("tailrace.stores")

#: Seconds between two ``data_version`` checks of a watcher.
WATCH_INTERVAL = 0.002


def declared(conn: sqlite3.Connection, name: str) -> Queue | None:
    """The declared limits of queue ``name`` (defaults if never declared; None: unusable)."""
    return declared_queue(name, conn.execute(SELECT_QUEUE, (name,)).fetchone())


def bump(conn: sqlite3.Connection, kind: str) -> None:
    """Tell watchers, in this transaction, that a change of ``kind`` happened."""
    conn.execute(BUMP_SIGNAL, (kind,))


def claim_queued(
    conn: sqlite3.Connection,
    queue: str,
    owner: str,
    ttl: float,
    limit: int,
    now: float,
    graphs: tuple[str, ...] | None = None,
    skip: tuple[str, ...] = (),
) -> list[str]:
    """Claim up to ``limit`` runs of ``queue`` within its limits (the writer's transaction)."""
    spec = claimable_queue(queue, conn.execute(SELECT_QUEUE, (queue,)).fetchone())
    if spec is None:
        return []  # paused, or its row cannot be used (said once): nothing is claimed
    active = conn.execute(ACTIVE_IN_QUEUE, (queue, now)).fetchone()[0] if spec.concurrency else 0
    started = (
        conn.execute(STARTED_SINCE, (queue, now - spec.period)).fetchone()[0] if spec.limit else 0
    )
    free = free_slots(spec, want=limit, active=active, started_recently=started)
    if free <= 0:
        return []
    window = claim_window(free, skipping=False)
    keyed = conn.execute(ANY_KEYED, (queue,)).fetchone() is not None
    query, params = claim_candidates(spec, now, free, window, graphs, skip, keyed=keyed)
    ids = [row[0] for row in conn.execute(query, params)]
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
            if spec is None:
                continue  # its row cannot be used: paused until declared again
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
