"""Scale-out: run queues and a worker fleet coordinated by the store.

- :class:`Queue`: a named queue's limits (global and per-worker concurrency,
  rate limit, order, partitions).
- :class:`Schedule`: a graph run submitted once per cron tick, by one worker.
- :class:`Worker`: the daemon that claims runs from queues, drives them under
  leases, applies answers, serves machine gates and adopts runs of dead
  workers (``tailrace worker``; ``tailrace serve`` is the same daemon).
- ``Engine.submit`` / ``Engine.wait`` / ``Engine.cancel``: put a run on a
  queue, wait for its result from any process, cancel it.

There is no broker: claims are ``FOR UPDATE SKIP LOCKED`` on Postgres and
``BEGIN IMMEDIATE`` transactions on SQLite, leases fence writers (D6), and
wake-ups are ``LISTEN/NOTIFY`` or a ``data_version`` check. See
``docs/scale-out.md``.
"""

from .._errors import DuplicateRun as DuplicateRun
from .._errors import RunFailed as RunFailed
from ..stores import Queue as Queue
from ._schedules import Schedule as Schedule
from ._worker import HEARTBEAT as HEARTBEAT
from ._worker import MAX_RECOVERIES as MAX_RECOVERIES
from ._worker import Worker as Worker
from ._worker import WorkerStats as WorkerStats

__all__ = [
    "HEARTBEAT",
    "MAX_RECOVERIES",
    "DuplicateRun",
    "Queue",
    "RunFailed",
    "Schedule",
    "Worker",
    "WorkerStats",
]
