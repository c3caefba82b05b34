"""The memory store's queues, claims and workers: ``_queue_rules`` applied under its lock."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..._errors import RunExists, RunNotFound
from .._changes import ChangeHub
from .._contract import ChangeFeed
from .._queue_rules import (
    check_claim,
    check_worker,
    claim_key,
    dedup_holder,
    free_slots,
    holds_slot,
    partition_blocked,
    stats_of,
)
from .._records import (
    NewRun,
    QuestionRow,
    Queue,
    QueueStats,
    RunRecord,
    RunStatus,
    Submission,
    WorkerRow,
)
from .._rules import can_apply, check_name, check_names, check_new_format, check_ttl, due, due_order


class MemoryQueues:
    """Queue methods of :class:`~tailrace.stores.MemoryStore` (see :class:`~tailrace.stores.RunStore`)."""

    _lock: threading.Lock
    _clock: Callable[[], float]
    _runs: dict[str, RunRecord]
    _questions: dict[str, QuestionRow]
    _hub: ChangeHub
    _queues: dict[str, Queue]
    _workers: dict[str, WorkerRow]

    if TYPE_CHECKING:  # the store's own, under its lock; declared for the type checker only

        def _insert_run(self, run: NewRun, submission: Submission | None) -> None: ...

    def changes(self) -> contextlib.AbstractAsyncContextManager[ChangeFeed]:
        """Wake-ups delivered as the writes happen (see :meth:`RunStore.changes`)."""
        return self._hub.subscribe()

    def _declared(self, name: str) -> Queue:
        return self._queues.get(name) or Queue(name)

    async def submit_run(self, run: NewRun, submission: Submission) -> str:
        """Store ``run`` queued, or return the live run holding its dedup key."""
        check_new_format(run)
        check_names(
            run_id=run.run_id, graph_name=run.graph_name, graph_ref=run.graph_ref,
            fingerprint=run.fingerprint, queue=submission.queue, partition=submission.partition,
            dedup_key=submission.dedup_key,
        )  # fmt: skip
        with self._lock:
            holder = dedup_holder(self._runs.values(), submission.queue, submission.dedup_key)
            if holder is not None:
                return holder.run_id
            if run.run_id in self._runs:
                raise RunExists(f"run {run.run_id!r} already exists")
            self._insert_run(run, submission)
        self._hub.deliver(frozenset({"submit"}))
        return run.run_id

    async def claim_runs(self, queue: str, owner: str, ttl: float, *, limit: int) -> list[str]:
        """Claim up to ``limit`` runs of ``queue`` under the store's lock."""
        check_claim(queue, owner, ttl, limit)
        with self._lock:
            now = self._clock()
            spec = self._declared(queue)
            mine = [r for r in self._runs.values() if r.queue_name == queue]
            free = free_slots(
                spec,
                want=limit,
                active=sum(holds_slot(r, now) for r in mine),
                started_recently=sum(
                    r.started_at is not None and r.started_at > now - spec.period for r in mine
                ),
            )
            queued = sorted(
                (r for r in mine if r.status is RunStatus.QUEUED),
                key=lambda r: claim_key(spec, r),
            )
            claimed: list[str] = []
            for run in queued:
                if len(claimed) >= free:
                    break
                if partition_blocked(run, mine):
                    continue
                started = dataclasses.replace(
                    run, status=RunStatus.RUNNING, lease_owner=owner, lease_expires=now + ttl,
                    lease_token=run.lease_token + 1, started_at=now, updated_at=now,
                )  # fmt: skip
                self._runs[run.run_id] = started
                mine = [started if r.run_id == run.run_id else r for r in mine]
                claimed.append(run.run_id)
            return claimed

    async def claim_answers(self, owner: str, ttl: float, *, limit: int) -> list[QuestionRow]:
        """Lease up to ``limit`` suspended runs with a due answer, under the store's lock."""
        check_name("owner", owner)
        check_ttl(ttl)
        with self._lock:
            now = self._clock()
            due_rows = sorted(
                (
                    q
                    for q in self._questions.values()
                    if can_apply(q.status, q.applied_at) and due(q.retry_at, now)
                ),
                key=due_order,
            )
            taken: dict[str, QuestionRow] = {}
            for question in due_rows:
                if len(taken) >= limit:
                    break
                run = self._runs.get(question.run_id)
                if run is None or question.run_id in taken or not self._free_for_answer(run, now):
                    continue
                self._runs[run.run_id] = dataclasses.replace(
                    run, lease_owner=owner, lease_expires=now + ttl, lease_token=run.lease_token + 1
                )
                taken[run.run_id] = question
            return list(taken.values())

    def _free_for_answer(self, run: RunRecord, now: float) -> bool:
        """Whether a worker may take ``run`` to apply an answer now (no live lease, a queue slot)."""
        if run.status is not RunStatus.SUSPENDED:
            return False
        if (
            run.lease_owner is not None
            and run.lease_expires is not None
            and run.lease_expires >= now
        ):
            return False
        if run.queue_name is None:
            return True
        spec = self._declared(run.queue_name)
        active = sum(
            holds_slot(r, now) for r in self._runs.values() if r.queue_name == run.queue_name
        )
        return free_slots(spec, want=1, active=active, started_recently=0) > 0

    async def request_cancel(self, run_id: str) -> RunStatus:
        """Cancel a queued run now, or mark a running or suspended one for its driver."""
        check_name("run_id", run_id)
        with self._lock:
            run = self._runs.get(run_id)
            if run is None:
                raise RunNotFound(f"no run {run_id!r} in the store")
            now = self._clock()
            if run.status is RunStatus.QUEUED:
                run = dataclasses.replace(
                    run, status=RunStatus.CANCELLED, finished_at=now, updated_at=now
                )
            elif run.status in (RunStatus.RUNNING, RunStatus.SUSPENDED):
                run = dataclasses.replace(run, cancel_requested_at=run.cancel_requested_at or now)
            self._runs[run_id] = run
        self._hub.deliver(frozenset({"cancel"}))
        return run.status

    async def cancel_requests(self, owner: str) -> list[str]:
        """Running runs leased to ``owner`` with a cancel request."""
        check_name("owner", owner)
        with self._lock:
            return sorted(
                r.run_id
                for r in self._runs.values()
                if r.lease_owner == owner
                and r.status is RunStatus.RUNNING
                and r.cancel_requested_at is not None
            )

    async def runs_leased_by(self, owner: str, *, limit: int = 100) -> list[str]:
        """Running runs whose lease ``owner`` holds."""
        check_name("owner", owner)
        with self._lock:
            ids = sorted(
                r.run_id
                for r in self._runs.values()
                if r.lease_owner == owner and r.status is RunStatus.RUNNING
            )
        return ids[: max(limit, 0)]

    async def declare_queue(self, queue: Queue) -> None:
        """Store ``queue``'s limits."""
        check_name("queue", queue.name)
        with self._lock:
            self._queues[queue.name] = queue
        self._hub.deliver(frozenset({"submit"}))  # new limits may let more runs start

    async def queues(self) -> list[Queue]:
        """Every declared queue, by name."""
        with self._lock:
            return [self._queues[name] for name in sorted(self._queues)]

    async def queue_stats(self, now: float, *, window: float = 60.0) -> list[QueueStats]:
        """Per-queue counts at ``now``."""
        with self._lock:
            runs = [r for r in self._runs.values() if r.queue_name is not None]
            declared, workers = dict(self._queues), list(self._workers.values())
        names = {r.queue_name for r in runs if r.queue_name is not None}
        return stats_of(names, declared, runs, workers, now, window)

    async def worker_seen(self, worker: WorkerRow) -> None:
        """Record ``worker``'s report."""
        check_worker(worker)
        with self._lock:
            self._workers[worker.worker_id] = worker

    async def workers(self) -> list[WorkerRow]:
        """Every reported worker, by id."""
        with self._lock:
            return [self._workers[w] for w in sorted(self._workers)]

    async def forget_worker(self, worker_id: str) -> None:
        """Drop ``worker_id``'s report."""
        check_name("worker_id", worker_id)
        with self._lock:
            self._workers.pop(worker_id, None)

    async def run_durations(
        self, fingerprint: str, *, limit: int = 200
    ) -> list[tuple[float, float]]:
        """``(cost, seconds)`` of the latest completed queued runs of ``fingerprint``."""
        check_name("fingerprint", fingerprint)
        with self._lock:
            done = [
                r
                for r in self._runs.values()
                if r.fingerprint == fingerprint
                and r.status is RunStatus.COMPLETED
                and r.started_at is not None
                and r.finished_at is not None
            ]
        done.sort(key=lambda r: r.finished_at or 0.0, reverse=True)
        return [
            (r.cost or 0.0, (r.finished_at or 0.0) - (r.started_at or 0.0))
            for r in done[: max(limit, 0)]
        ]
