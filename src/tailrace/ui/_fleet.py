"""The queues page: each queue's depth, what runs, how fast runs start, and the workers.

Read from the store's queue ledger (``queue_stats``, ``workers``; the store is
the coordinator, DESIGN.md "Scale-out"). Pure reading; no I/O but the store's.
Start rates are in the units of ``tailrace queues`` (runs started per second
over the window). A dead worker stays on the page, marked dead: both one that
still reports in the ledger and one that no longer does but still holds the
lease of a queued run (its runs wait for adoption).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core import owner_is_dead
from ..stores import Queue, RunStatus, RunStore, WorkerRow
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
    per_second: str
    workers: int
    dead_workers: int
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
    reported = await store.workers()
    workers = [
        WorkerInfo(
            worker_id=w.worker_id,
            queues=", ".join(w.queues),
            concurrency=w.concurrency,
            running=w.running,
            started=clock(w.started_at),
            seen=f"{seconds(now - w.seen_at)} ago",
            state=_state(w.worker_id, w.seen_at, now),
        )
        for w in reported
    ]
    workers += await _unreported_dead(store, {w.worker_id for w in reported}, now)
    dead = [w for w in workers if w.state == "dead"]
    queues = tuple(
        QueueRow(
            name=s.name,
            order=s.queue.order if s.queue is not None else "fifo",
            limits=limits_text(s.queue),
            queued=s.queued,
            running=s.running,
            suspended=s.suspended,
            per_second=rate_text(s.started, s.window),
            workers=max(s.workers - _serving(reported, dead, s.name, now), 0),
            dead_workers=sum(s.name in w.queues.split(", ") for w in dead),
            oldest_wait=None if s.oldest_queued_at is None else seconds(now - s.oldest_queued_at),
        )
        for s in stats
    )
    return FleetView(queues=queues, workers=tuple(workers), window=WINDOW)


def rate_text(started: int, window: float) -> str:
    """Runs started per second over ``window``, as ``tailrace queues`` prints it.

    >>> rate_text(1, 60.0), rate_text(0, 60.0), rate_text(90, 60.0)
    ('0.0167', '0', '1.5')
    """
    return f"{started / window:.3g}" if window > 0 else "0"


def _serving(reported: list[WorkerRow], dead: list[WorkerInfo], queue: str, now: float) -> int:
    """Dead workers the store still counts as serving ``queue`` (seen within the window)."""
    gone = {w.worker_id for w in dead}
    return sum(
        w.worker_id in gone and queue in w.queues and now - w.seen_at <= WINDOW for w in reported
    )


async def _unreported_dead(store: RunStore, known: set[str], now: float) -> list[WorkerInfo]:
    """Owners of queued runs' leases that no longer report and are dead or whose lease lapsed."""
    held: dict[str, list[str]] = {}
    for run in await store.list_runs(status=RunStatus.RUNNING):
        owner = run.lease_owner
        if owner is None or owner in known or run.queue_name is None:
            continue
        lapsed = run.lease_expires is None or run.lease_expires <= now
        if lapsed or owner_is_dead(owner):
            held.setdefault(owner, []).append(run.queue_name)
    return [
        WorkerInfo(worker_id=owner, queues=", ".join(sorted(set(names))), concurrency=0,
                   running=len(names), started="—", seen="no longer reports", state="dead")
        for owner, names in sorted(held.items())
    ]  # fmt: skip


def _state(worker_id: str, seen_at: float, now: float) -> str:
    if owner_is_dead(worker_id):  # on this host and its process is gone
        return "dead"
    return "live" if now - seen_at <= WINDOW else "silent"
