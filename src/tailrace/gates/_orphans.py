"""The orphan scan: taking over runs whose owner died, for serve and the worker (D6, W3).

An orphan is a running run whose lease expired (its owner crashed), or one
leased by an owner that provably died on this host. :class:`OrphanScan` reads
each, leaves alone those no target of this daemon drives, and hands the
others to the daemon's ``take``: the server adopts on the spot, a worker
starts a job that holds one of its slots.

The store returns the oldest ``limit`` runs whose lease expired. A daemon that
has no target for some of them (another deployment's graph, a LangGraph
thread it does not serve) would be handed the same ones on every pass and
never see the runs behind them. The scan remembers the runs it leaves to
others, asks for that many more, skips them without reading them again, and
says once that it leaves each one.

A row it cannot handle never stops the scan: a run its target marked failed
(it can never be adopted) is counted once (E9, Q6); any other failure is
retried with backoff and logged once.

Dead letters (W3): a run already taken over ``max_recoveries`` times (each
time its owner died holding it, or its lease expired; the store counts them
in ``RunRecord.recoveries``) is not adopted again: it is marked ``failed``
with the reason, so a run that kills every worker that drives it stops
killing them.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Container, Iterable
from dataclasses import dataclass
from typing import Protocol

from .._errors import LeaseHeld, LeaseLost, NotResumable, RunNotFound
from ..core import mark_failed
from ..stores import RunRecord, RunStatus, RunStore
from ._worker import ResumeWorker, describe

logger = logging.getLogger("tailrace.serve")

#: The most orphans one pass asks for, however many are left to others.
MAX_SCAN = 10_000
#: Takeovers of one run after which it is a dead letter, unless a daemon is told otherwise.
MAX_RECOVERIES = 10


class AdoptionCounts(Protocol):
    """Where a daemon counts the runs it adopted, those that failed, and other failures."""

    adopted: int
    failed: int
    errors: int


@dataclass(frozen=True, slots=True)
class Orphan:
    """A run to take over, and the ``adopt`` of the target here that drives it."""

    record: RunRecord
    adopt: Callable[[str], Awaitable[None]]


#: What a daemon does with an orphan it may take over.
Take = Callable[[Orphan], Awaitable[None]]


async def adopt_now(orphan: Orphan) -> None:
    """Take over ``orphan`` on the spot, through its target's ``adopt``."""
    await orphan.adopt(orphan.record.run_id)


def _always() -> bool:
    return True


class OrphanScan:
    """One daemon's adoption pass over ``store``.

    ``resumer`` routes a run to the target that drives it (and gives the
    lease time); ``stats`` counts adoptions and failures (dead letters
    included); a run whose adoption failed for a reason that may pass is
    tried again after ``retry_base`` seconds, doubling up to ``retry_max``.
    A run taken over ``max_recoveries`` times already is failed instead of
    adopted (None: never).
    """

    def __init__(
        self,
        store: RunStore,
        resumer: ResumeWorker,
        stats: AdoptionCounts,
        *,
        retry_base: float = 1.0,
        retry_max: float = 300.0,
        max_recoveries: int | None = MAX_RECOVERIES,
    ) -> None:
        if max_recoveries is not None and (
            not isinstance(max_recoveries, int)
            or isinstance(max_recoveries, bool)
            or max_recoveries < 0
        ):
            raise ValueError(f"max_recoveries must be an int >= 0 or None, got {max_recoveries!r}")
        self.max_recoveries = max_recoveries
        self.store = store
        self.resumer = resumer
        self.stats = stats
        self.retry_base = retry_base
        self.retry_max = retry_max
        #: Runs with an expired lease that no target of this daemon drives.
        self.foreign: set[str] = set()
        #: Orphans whose adoption failed for a reason that may pass: (failures, retry time).
        self._backoff: dict[str, tuple[int, float]] = {}

    def limit(self, wanted: int) -> int:
        """How many orphans to ask for, to find ``wanted`` this daemon may drive."""
        return min(wanted + len(self.foreign), MAX_SCAN)

    async def sweep(
        self,
        wanted: int,
        take: Take = adopt_now,
        *,
        room: Callable[[], bool] = _always,
        skip: Container[str] = (),
    ) -> int:
        """Adopt up to about ``wanted`` runs whose lease expired; returns the work done.

        ``take``, ``room`` and ``skip`` are as in :meth:`adopt`.
        """
        now = self.store.clock()  # leases are stamped on the store's clock, not this host's
        orphans = await self.store.expired_leases(now, limit=self.limit(wanted))
        listed = set(orphans)
        self.foreign &= listed  # forget those no longer orphaned
        self._backoff = {r: b for r, b in self._backoff.items() if r in listed}
        return await self.adopt(orphans, take, now=now, room=room, skip=skip)

    async def adopt(
        self,
        run_ids: Iterable[str],
        take: Take = adopt_now,
        *,
        now: float,
        room: Callable[[], bool] = _always,
        skip: Container[str] = (),
    ) -> int:
        """Hand each of ``run_ids`` a target here drives to ``take``; returns the work done.

        Stops when ``room()`` says no; passes over runs in ``skip`` (those the
        daemon drives already), runs left to others and runs waiting out a
        backoff. ``now`` is when the orphans were listed.
        """
        work = 0
        for run_id in run_ids:
            if not room():
                break
            if run_id in skip or run_id in self.foreign or self._waiting(run_id, now):
                continue
            try:
                orphan = await self._read(run_id, now)
                if orphan is None:
                    continue
                await take(orphan)
            except (LeaseHeld, LeaseLost, NotResumable, RunNotFound):
                continue  # another daemon took it, or it finished meanwhile
            except Exception as exc:
                await self._failed(run_id, exc)
            else:
                self._backoff.pop(run_id, None)
                self.stats.adopted += 1
            work += 1
        return work

    def _waiting(self, run_id: str, now: float) -> bool:
        return self._backoff.get(run_id, (0, 0.0))[1] > now

    async def _read(self, run_id: str, now: float) -> Orphan | None:
        """``run_id`` as an orphan a target here adopts, or None (left to others, or not orphaned)."""
        record = await self.store.get_run(run_id)
        if record.status is not RunStatus.RUNNING:
            return None
        fresh = now - record.created_at < self.resumer.lease_ttl
        if record.lease_owner is None and record.queue_name is None and fresh:
            return None  # just created by an engine that is about to lease it
        adopt = getattr(self.resumer.target_for(record), "adopt", None)
        if adopt is None:  # no target here drives it (another driver's thread, an unknown graph)
            self._leave(record)
            return None
        if self.max_recoveries is not None and record.recoveries >= self.max_recoveries:
            await self._dead_letter(record, self.max_recoveries)
            return None
        return Orphan(record=record, adopt=adopt)

    async def _dead_letter(self, record: RunRecord, limit: int) -> None:
        """Fail ``record``'s run instead of adopting it once more (W3), saying why in the store."""
        reason = (
            f"dead letter: taken over {record.recoveries} times (max_recoveries {limit}), each "
            "time after the worker driving it died or lost its lease; not adopted again"
        )
        await mark_failed(
            self.store, record.run_id, self.resumer.owner, self.resumer.lease_ttl, reason
        )
        self.stats.failed += 1
        logger.warning("run %s: %s", record.run_id, reason)

    def _leave(self, record: RunRecord) -> None:
        """No target here drives ``record``'s run: skip it from now on, and say so once."""
        if record.run_id not in self.foreign:
            self.foreign.add(record.run_id)
            logger.info(
                "run %s (graph %r) has an expired lease and no target here drives it; "
                "leaving it to a daemon that has its graph",
                record.run_id,
                record.graph_name,
            )

    async def _failed(self, run_id: str, exc: Exception) -> None:
        """A failed run is counted once (E9, Q6); anything else is retried with backoff, logged once."""
        try:
            status = (await self.store.get_run(run_id)).status
        except Exception:
            status = None
        if status is RunStatus.FAILED:
            self.stats.failed += 1
            logger.warning("run %s failed while being adopted: %s", run_id, describe(exc))
            return
        self.stats.errors += 1
        failures = self._backoff.get(run_id, (0, 0.0))[0]
        delay = min(self.retry_base * 2 ** min(failures, 32), self.retry_max)
        self._backoff[run_id] = (failures + 1, self.store.clock() + delay)
        logger.log(
            logging.WARNING if failures == 0 else logging.DEBUG,
            "cannot adopt run %s (attempt %d, next in %.3g s): %s",
            run_id, failures + 1, delay, describe(exc),
            exc_info=exc if failures == 0 else None,
        )  # fmt: skip
