"""The serve loop: resume answered runs, poll machine gates, adopt orphaned runs (Q4-Q6).

Built of the daemon core (``_daemon``), shaped like huey's consumer: each
iteration does what work there is; the wait between iterations doubles
while idle and resets when work arrives; an iteration's error is logged and
survived; ``stop`` ends it gracefully. Orphans are adopted by the orphan
scan (``_orphans``) the fleet's worker uses too.

Two loops run side by side: the *work loop* re-drives answers through the
resume worker and adopts runs whose owner died; the *gate loop* fires
deadlines and starts time-limited polls (``_polling``), so neither a slow
resume nor a stuck poller delays a deadline. A poller's answer wakes the
work loop at once.

Nothing is retried in a hot loop: an answer that cannot be applied is
deferred in the store with backoff (``ResumeWorker``); a run that cannot be
adopted is marked failed when it never can be, and otherwise retried with
backoff; each is logged once with its reason.

Several serve loops on one database cooperate: leases make resumes
single-flight and the ledger's compare-and-set makes answers first-wins.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .._codec import DEFAULT_CODEC
from ..core import Engine
from ._daemon import Daemon, Hook, Loop
from ._orphans import OrphanScan
from ._polling import GatePolling, Poller
from ._worker import Outcome, Resumable, ResumeWorker

logger = logging.getLogger("tailrace.serve")


@dataclass(slots=True)
class ServeStats:
    """What a serve loop did so far.

    ``applied``/``superseded`` count answers; ``stuck`` counts deferrals of
    answers that could not be applied (each is retried with backoff);
    ``failed`` counts runs that failed under this loop (a handler error while
    resuming or adopting, or a run marked failed because it can never be
    resumed); ``polled``/``poll_timeouts`` count polls and those cut by the
    time limit; ``expired`` deadlines that fired; ``adopted`` runs taken
    over from a dead owner; ``errors`` failed iterations, polls and
    adoptions; ``outcomes`` every resume outcome by name.
    """

    iterations: int = 0
    applied: int = 0
    superseded: int = 0
    stuck: int = 0
    failed: int = 0
    polled: int = 0
    poll_timeouts: int = 0
    expired: int = 0
    adopted: int = 0
    errors: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)


class Server:
    """One serve loop over ``engine`` (which must have a store).

    Args:
        engine: resumes tailrace runs; its store holds the ledger and leases.
        pollers: maps the names machine gates declare (``poller=``) to
            callables, sync or async, given the question's prompt and
            returning its answer or None while pending.
        targets: more :class:`~tailrace.gates.Resumable` targets besides the
            engine (a :class:`~tailrace.integrations.langgraph.LangGraphDriver`,
            say). A question goes to the first target whose ``handles(run)``
            accepts its run (the engine first); machine gates and deadlines of
            their questions are served exactly like tailrace gates, and a
            target's orphaned runs go to its ``adopt`` if it has one.
        interval: first wait between iterations when idle, seconds.
        max_interval: the idle wait doubles up to this.
        poll_timeout: time limit of one poll, seconds; a poll past it is
            abandoned (an async one cancelled) and tried again later.
        poll_threads: at most this many threads run sync pollers at once
            (daemon threads, so a stuck poller never blocks exit).
        retry_base: first wait before an answer or adoption that failed is
            tried again, seconds; it doubles on each failure.
        retry_max: longest such wait, seconds.
        on_startup: called (or awaited) before the loop starts.
        on_shutdown: called (or awaited) after it stops.

    ``once()`` runs one iteration by hand; polls it starts run on in the
    background until :meth:`aclose` (``run`` closes by itself).
    """

    def __init__(
        self,
        engine: Engine,
        *,
        pollers: Mapping[str, Poller] | None = None,
        targets: Sequence[Resumable] = (),
        interval: float = 0.05,
        max_interval: float = 2.0,
        poll_timeout: float = 10.0,
        poll_threads: int = 16,
        retry_base: float = 1.0,
        retry_max: float = 300.0,
        on_startup: Hook | None = None,
        on_shutdown: Hook | None = None,
    ) -> None:
        if engine.store is None:
            raise ValueError("serve needs an engine with a store")
        self.engine = engine
        self.store = engine.store
        self.interval = interval
        self.max_interval = max_interval
        self.retry_base = retry_base
        self.retry_max = retry_max
        self.on_startup = on_startup
        self.on_shutdown = on_shutdown
        self.worker = ResumeWorker(
            engine=engine, targets=targets, retry_base=retry_base, retry_max=retry_max
        )
        self.stats = ServeStats()
        self._wake = asyncio.Event()
        self.gates = GatePolling(
            self.store,
            engine.codec or DEFAULT_CODEC,
            pollers or {},
            timeout=poll_timeout,
            threads=poll_threads,
            stats=self.stats,
            wake=self._wake.set,
        )
        self.pollers = self.gates.pollers
        self.orphans = OrphanScan(
            self.store, self.worker, self.stats, retry_base=retry_base, retry_max=retry_max
        )
        work = Loop(
            "serve iteration", self._iteration, interval=interval, max_interval=max_interval,
            stats=self.stats, logger=logger, wake=self._wake,
        )  # fmt: skip
        gates = self.gates.loop("serve gate tick", interval=interval, max_interval=max_interval)
        self.daemon = Daemon(
            work,
            {"serve:gates": gates.run},
            on_startup=on_startup,
            on_shutdown=on_shutdown,
            close=self.aclose,
        )

    async def run(self, stop: asyncio.Event) -> ServeStats:
        """Serve until ``stop`` is set; returns the stats."""
        await self.daemon.run(stop)
        return self.stats

    async def once(self) -> int:
        """One iteration: fire deadlines and start due polls, re-drive answers, adopt orphans; returns work done."""
        work = await self.gates.tick()
        return work + await self._iteration()

    async def aclose(self) -> None:
        """Stop the polls in flight (a sync poller's thread is abandoned, not waited for)."""
        await self.gates.aclose()

    async def _iteration(self) -> int:
        self.stats.iterations += 1
        work = self._count(await self.worker.sweep())
        return work + await self.orphans.sweep(100)  # runs whose owner's lease expired (D6)

    def _count(self, outcomes: Mapping[Outcome, int]) -> int:
        for outcome, n in outcomes.items():
            self.stats.outcomes[outcome.value] = self.stats.outcomes.get(outcome.value, 0) + n
        self.stats.applied += outcomes.get(Outcome.APPLIED, 0)
        self.stats.superseded += outcomes.get(Outcome.SUPERSEDED, 0)
        self.stats.stuck += outcomes.get(Outcome.DEFERRED, 0)
        self.stats.failed += outcomes.get(Outcome.FAILED, 0)
        return sum(
            outcomes.get(o, 0)
            for o in (Outcome.APPLIED, Outcome.SUPERSEDED, Outcome.FAILED, Outcome.DEFERRED)
        )


async def serve(
    engine: Engine,
    stop: asyncio.Event,
    *,
    pollers: Mapping[str, Poller] | None = None,
    targets: Sequence[Resumable] = (),
    interval: float = 0.05,
    max_interval: float = 2.0,
    poll_timeout: float = 10.0,
) -> ServeStats:
    """Run a :class:`Server` over ``engine`` until ``stop`` is set.

    ``pollers``, ``targets``, ``interval``, ``max_interval`` and
    ``poll_timeout`` are as in :class:`Server`.
    """
    server = Server(
        engine,
        pollers=pollers,
        targets=targets,
        interval=interval,
        max_interval=max_interval,
        poll_timeout=poll_timeout,
    )
    return await server.run(stop)
