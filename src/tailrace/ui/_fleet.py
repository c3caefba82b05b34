"""The queues page: each queue's depth, what runs, how fast runs start, and the workers.

Read from the store's queue ledger (``queue_stats``, ``workers``; the store is
the coordinator, DESIGN.md "Scale-out"). Pure reading; no I/O but the store's.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core import owner_is_dead
from ..stores import Queue, RunStore
from ._format import clock, seconds

#: Seconds of history the start rate and worker liveness look at.
WINDOW = 60.0


@dataclass(frozen=True, slots=True, kw_only=True)
class QueueRow:
    """One queue: its declared limits and its runs now."""

    name: str
    order: str
    limits: str
    queued: int
    running: int
    suspended: int
    per_minute: float
    workers: int
    oldest_wait: str | None


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerInfo:
    """A worker as it last reported itself; ``state`` is live, silent or dead."""

    worker_id: str
    queues: str
    concurrency: int
    running: int
    started: str
    seen: str
    state: str


@dataclass(frozen=True, slots=True, kw_only=True)
class FleetView:
    """Every queue and every worker the store knows."""

    queues: tuple[QueueRow, ...]
    workers: tuple[WorkerInfo, ...]
    window: float


def limits_text(queue: Queue | None) -> str:
    """A queue's declared limits in a few words (``undeclared`` when nobody declared it)."""
    if queue is None:
        return "undeclared: no limits"
    parts = []
    if queue.concurrency is not None:
        parts.append(f"{queue.concurrency} at once")
    if queue.worker_concurrency is not None:
        parts.append(f"{queue.worker_concurrency} per worker")
    if queue.limit is not None:
        parts.append(f"{queue.limit} starts per {seconds(queue.period)}")
    return ", ".join(parts) or "no limits"


async def fleet_view(store: RunStore, now: float) -> FleetView:
    """Read every queue's counts at ``now`` and every worker's last report.

    Args:
        store: where the queues are.
        now: wall clock: waits, start rates and liveness are measured from it.
    """
    stats = await store.queue_stats(now, window=WINDOW)
    queues = tuple(
        QueueRow(
            name=s.name,
            order=s.queue.order if s.queue is not None else "fifo",
            limits=limits_text(s.queue),
            queued=s.queued,
            running=s.running,
            suspended=s.suspended,
            per_minute=s.started * 60.0 / s.window if s.window > 0 else 0.0,
            workers=s.workers,
            oldest_wait=None if s.oldest_queued_at is None else seconds(now - s.oldest_queued_at),
        )
        for s in stats
    )
    workers = tuple(
        WorkerInfo(
            worker_id=w.worker_id,
            queues=", ".join(w.queues),
            concurrency=w.concurrency,
            running=w.running,
            started=clock(w.started_at),
            seen=f"{seconds(now - w.seen_at)} ago",
            state=_state(w.worker_id, w.seen_at, now),
        )
        for w in await store.workers()
    )
    return FleetView(queues=queues, workers=workers, window=WINDOW)


def _state(worker_id: str, seen_at: float, now: float) -> str:
    if owner_is_dead(worker_id):  # on this host and its process is gone
        return "dead"
    return "live" if now - seen_at <= WINDOW else "silent"
