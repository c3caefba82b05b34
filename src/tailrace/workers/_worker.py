"""The worker: claims runs from queues and serves gates, one daemon per process.

A :class:`Worker` does, over one store, everything ``tailrace serve`` did and
what a fleet needs besides:

- claims queued runs (``RunStore.claim_runs``: the queue's limits are kept by
  the store, atomically) and drives them under their leases;
- claims answered runs (``RunStore.claim_answers``: each run goes to one
  worker, so N workers never read and fight over the same answers) and
  applies the answers through the resume worker (Q3, exactly once);
- polls machine gates and fires deadlines (Q5), as serve does;
- is alive while its store session is (W7): it is present in the fleet
  (``RunStore.presence``), whose sessions watch each other and, the moment
  one is gone (its process died, on any host), expire its workers' leases so
  that this worker and others adopt their runs at once; runs whose lease
  expired (a host cut off from the store) are adopted too (D6);
- stops driving a run whose lease the store did not renew in time (cut off
  from it), before anyone may adopt it; the lease says so, once per outage
  (``LeaseLapsed``);
- cancels the runs it drives that someone asked to cancel.

It sleeps on the store's change feed (``LISTEN/NOTIFY`` on Postgres, a
``data_version`` check every few milliseconds on SQLite) and polls every
``poll_interval`` seconds as the fallback. Its loops are the daemon core of
``gates`` (shaped like huey's consumer: a round's error is logged and
survived) and it adopts through the same orphan scan as serve; ``stop``
drains: no more claims, runs in flight get ``grace`` seconds to finish,
then they are stopped where they are and their leases released, so another
worker adopts them at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import math
import time
from collections import Counter
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._codec import DEFAULT_CODEC
from .._errors import (
    GraphError,
    GraphMismatch,
    LeaseHeld,
    LeaseLapsed,
    LeaseLost,
    NotResumable,
    RunNotFound,
    StoreError,
)
from ..core import Engine, RunResult, cancel_undriven
from ..executors import Executor
from ..gates import Outcome, Poller, Resumable, ResumeWorker
from ..gates._daemon import Beside, Daemon, Loop
from ..gates._orphans import MAX_RECOVERIES as MAX_RECOVERIES
from ..gates._orphans import Orphan, OrphanScan
from ..gates._polling import GatePolling
from ..gates._worker import UNRESUMABLE, describe
from ..graph import Graph, guess_reference
from ..stores import (
    CHANGE_KINDS,
    Claim,
    GraphRow,
    Presence,
    QuestionRow,
    Queue,
    RunStatus,
    RunStore,
    WorkerRow,
)
from ..stores._presence import first_of
from ..stores._queue_rules import is_live
from ..stores._records import check_limit
from ._schedules import Schedule, ScheduleTicker

logger = logging.getLogger("tailrace.workers")

#: The most overdue runs one look cancels.
OVERDUE_BATCH = 50

#: Default seconds between two heartbeats of a worker (see ``Worker``'s ``heartbeat``): at
#: most 0.05 transactions a second for an idle worker, whatever the fleet's size.
HEARTBEAT = 30.0
#: Seconds after a pulse's ``due_at`` at which the next pulse looks (past the moment).
DUE_SLACK = 0.05
#: Most seconds between two readings of the queues' limits with no news of a change.
REFRESH = 600.0
#: The change a commit carrying stream rows sends: nothing for a worker to do.
_STREAM = frozenset({"stream"})
#: Seconds before a round that raised is made again with what it was woken for; doubles
#: while rounds keep failing, up to ``ROUND_RETRY_MAX``.
ROUND_RETRY = 0.1
ROUND_RETRY_MAX = 5.0


@dataclass(slots=True)
class WorkerStats:
    """What a worker did so far.

    ``claimed`` queued runs it claimed (``taken`` of them in the write of a
    child submit of its own runs: those children, or runs queued before them
    on that queue); ``applied``
    answers it applied;
    ``adopted`` runs it took over from a dead owner; ``completed``,
    ``suspended``, ``failed`` and ``cancelled`` how the runs it drove ended;
    ``busy`` claims or adoptions another owner won (``failed`` counts dead letters too);
    ``lapsed`` runs it stopped because it could not keep their leases (the store did not
    answer in time to renew them, or the fleet took its session for gone, W7); ``polled`` machine-gate
    polls, ``poll_timeouts`` those cut by the time limit, ``expired`` gate
    deadlines that fired (Q5); ``errors`` failed rounds, jobs and polls
    (logged); ``outcomes`` every answer's outcome by name.
    """

    claimed: int = 0
    taken: int = 0
    applied: int = 0
    adopted: int = 0
    completed: int = 0
    suspended: int = 0
    failed: int = 0
    cancelled: int = 0
    busy: int = 0
    lapsed: int = 0
    polled: int = 0
    poll_timeouts: int = 0
    expired: int = 0
    errors: int = 0
    rounds: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)


#: What a job's first log line says it does.
_STARTED = {"claim": "claimed", "answer": "resuming with an answer", "adopt": "adopted"}


@dataclass(frozen=True, slots=True)
class _Job:
    run_id: str
    kind: str  # "claim", "answer", "adopt"
    queue: str | None = None


class Worker:
    """Claims and drives runs of ``queues`` from ``store``, and serves its gates.

    Args:
        store: the store the fleet shares (opened here if it is not).
        queues: the queues to claim from: :class:`~tailrace.Queue` objects
            (declared in the store, so every worker keeps the same limits) or
            names (their declared limits, or none).
        concurrency: most runs this worker drives at once (claimed, resumed
            after an answer, or adopted).
        graphs: graphs the runs may be of, besides those importable by their
            stored reference (graph files named in the store are never
            executed: trust model). They are registered in the store as the
            worker starts, so a run of one can be submitted by its name alone
            (``engine.submit("name", ...)``, ``tailrace submit NAME``).
        engine: the engine that drives runs (default: ``Engine(store=store,
            lease_ttl=lease_ttl)``); its owner name is the worker's.
        pollers: machine gates' pollers by name (as in :class:`~tailrace.gates.Server`).
        targets: more resume targets, e.g. LangGraph drivers.
        lease_ttl: lease lifetime of the default engine, seconds.
        grace: seconds runs in flight get to finish once the worker stops.
        poll_interval: most seconds between two looks at the store with no
            wake-up (default: ``heartbeat``).
        heartbeat: seconds between two heartbeats: one transaction that
            reports this worker (``tailrace queues`` shows it) and looks, one
            indexed probe each, for queued runs, due answers, expired leases,
            cancel requests, machine gates and overdue runs
            (``RunStore.pulse``); the next one comes sooner when the pulse
            says something comes due sooner (a lease expiry, a delayed run, a
            deadline). Liveness needs no heartbeat: a worker is alive while
            its store session is (W7). Changes (submits, answers, releases,
            declarations) wake workers at once through the store's change
            feed, not the heartbeat.
        executors: the default engine's executors by the names nodes use
            (``executor="ray"``: ``{"ray": RayExecutor(address)}``); a run
            naming one this worker lacks goes back to its queue for a worker
            that has it. Whoever made them closes them.
        max_recoveries: a run already taken over this many times (each time
            the worker driving it died or lost its lease) is not adopted
            again but marked ``failed``, the reason stored (W3; None: adopt
            for ever).
        schedules: :class:`Schedule` s this worker declares on the store as it
            starts (their graphs registered here). Every worker submits the
            store's schedules as their ticks come, one worker per tick (W4).
        take_children: the child runs a run driven here submits to a queue
            this worker serves are claimed in the same write, as many as it has
            free slots for there (the queue's order and limits kept: runs
            queued before them go first), and start here at once; the rest go
            to the fleet (R4). False leaves them all to the fleet's claims
            (spreads CPU-heavy children at the cost of a wake-up and a claim).
    """

    def __init__(
        self,
        store: RunStore,
        *,
        queues: Sequence[Queue | str] = ("default",),
        concurrency: int = 8,
        graphs: Sequence[Graph] = (),
        engine: Engine | None = None,
        pollers: Mapping[str, Poller] | None = None,
        targets: Sequence[Resumable] = (),
        lease_ttl: float = 30.0,
        grace: float = 30.0,
        poll_interval: float | None = None,
        heartbeat: float = HEARTBEAT,
        executors: Mapping[str, Executor] | None = None,
        max_recoveries: int | None = MAX_RECOVERIES,
        schedules: Sequence[Schedule] = (),
        take_children: bool = True,
    ) -> None:
        check_limit("Worker: concurrency", concurrency)
        for what, value in (("grace", grace), ("poll_interval", poll_interval or 0.0)):
            if not _seconds(value) or value < 0:
                raise ValueError(
                    f"Worker: {what} must be a finite number of seconds >= 0, got {value!r}"
                )
        for what, value in (("heartbeat", heartbeat), ("lease_ttl", lease_ttl)):
            if not _seconds(value) or value <= 0:
                raise ValueError(
                    f"Worker: {what} must be a finite number of seconds > 0, got {value!r}"
                )
        if engine is not None and executors:
            raise ValueError("give the executors to the worker's engine, or no engine")
        self.engine = engine or Engine(store=store, lease_ttl=lease_ttl, executors=executors)
        if self.engine.store is not store:
            raise ValueError("the worker's engine must use the worker's store")
        self.engine.register(*graphs, *(s.graph for s in schedules))
        #: Registered in the store as the worker starts: runs of them can be submitted by name.
        self.graphs = [*graphs, *(s.graph for s in schedules)]
        self.schedules = list(schedules)
        #: Submits the store's schedules' ticks (W4).
        self.ticker = ScheduleTicker(store)
        self.store = store
        self.queues = [q if isinstance(q, Queue) else Queue(q) for q in queues]
        self._declare = [q for q in queues if isinstance(q, Queue)]
        names = [q.name for q in self.queues]
        if len(set(names)) != len(names):
            raise ValueError(
                f"queues named twice: {sorted(n for n in set(names) if names.count(n) > 1)}"
            )
        self.concurrency = concurrency
        self.grace = grace
        self.heartbeat = heartbeat
        self.poll_interval = heartbeat if poll_interval is None else min(poll_interval, heartbeat)
        #: Heartbeats between two readings of the queues' limits with no ``config`` news.
        self._refresh_every = max(1, math.ceil(REFRESH / self.poll_interval))
        self._beats = 0
        #: Whether an open question has a poller or a deadline (the heartbeat says).
        self._gates_on = True
        self._gate_wake = asyncio.Event()
        self.owner = self.engine.owner
        self.stats = WorkerStats()
        #: Applies answers exactly once (Q3) and says which target drives a run.
        self.resumer = ResumeWorker(engine=self.engine, targets=targets)
        #: Machine gates and deadlines (Q5), counted in this worker's stats.
        self.gates = GatePolling(
            store, self.engine.codec or DEFAULT_CODEC, pollers or {}, timeout=10.0, threads=16,
            stats=self.stats, wake=lambda: None,  # answers reach the worker through the store
        )  # fmt: skip
        #: Takes over runs whose owner died (D6, W3).
        self.orphans = OrphanScan(store, self.resumer, self.stats, max_recoveries=max_recoveries)
        self._jobs: dict[asyncio.Task[None], _Job] = {}
        self._here: set[str] = set()
        #: Graphs (name, fingerprint) of runs this worker found it cannot drive.
        self._not_here: set[tuple[str, str]] = set()
        #: Of those, the graphs of child runs it handed back, with the queues it did so on:
        #: claimed again (and failed) once no other live worker there can drive them (R3).
        self._handed_back: dict[tuple[str, str], set[str]] = {}
        #: When to look again whether those still have a driver elsewhere.
        self._recheck_at = 0.0
        #: Held by a claim round and by a hand-back, so no round in flight claims a run
        #: again between its hand-back and its graph joining ``_not_here``.
        self._claiming = asyncio.Lock()
        self._by_queue: Counter[str] = Counter()
        self._kinds: set[str] = set()
        self._wake = asyncio.Event()
        self._next_orphan_scan = 0.0
        #: When to poll the store again with no wake-up.
        self._poll_at = 0.0
        #: When to look at the queues again without a wake-up (a rate window may open).
        self._look_at = float("inf")
        #: Seconds before a failed round is made again (doubles while rounds fail).
        self._retry = ROUND_RETRY
        #: When (monotonic) the next pulse is due sooner than a heartbeat away, and the last.
        self._pulse_at = float("inf")
        self._pulsed_at = 0.0
        self._started_at = self.store.clock()
        #: Slots lent to a child submit in flight (``reserve`` .. ``settle``), per queue.
        self._lent: Counter[str] = Counter()
        #: The jobs' task group while the worker runs and claims (not while it drains).
        self._group: asyncio.TaskGroup | None = None
        self._giving_back: set[asyncio.Task[None]] = set()
        if take_children:
            self.engine.child_claims = self

    # -- running ----------------------------------------------------------------------

    async def run(self, stop: asyncio.Event | None = None) -> WorkerStats:
        """Work until ``stop`` is set (forever without one), then drain; returns the stats."""
        stop = stop or asyncio.Event()
        self._poll_at = 0.0  # the first round looks at everything
        await self.store.open()
        for queue in self._declare:
            await self.store.declare_queue(queue)
        for schedule in self.schedules:
            await schedule.declare(self.store, self.engine.codec or DEFAULT_CODEC)
        drives = _with_children(self.graphs)
        for graph in drives:
            await self.store.register_graph(
                GraphRow(
                    name=graph.name, fingerprint=graph.compile().fingerprint,
                    graph_ref=guess_reference(graph), registered_at=self.store.clock(),
                )
            )  # fmt: skip
        # What this worker drives, so the fleet knows whether a child it hands back waits
        # for a worker that can drive it (R3).
        await self.store.register_worker_graphs(
            self.owner, [(g.name, g.compile().fingerprint) for g in drives]
        )
        await self._refresh_queues()
        try:
            async with (
                self.store.changes() as feed,
                contextlib.AsyncExitStack() as present,
                asyncio.TaskGroup() as jobs,
            ):
                presence = await self._be_present(present)
                self._group = jobs
                work = Loop(
                    "worker round", functools.partial(self._work_round, jobs),
                    interval=float("inf"), stats=self.stats, logger=logger, wake=self._wake,
                    due=self._until_look,
                )  # fmt: skip
                heartbeat = Loop(
                    "worker heartbeat", self._heartbeat, interval=self.poll_interval,
                    stats=self.stats, logger=logger, due=self._until_pulse,
                )  # fmt: skip
                gates = Loop(
                    "worker gate tick", self._gate_tick, interval=0.05,
                    max_interval=self.poll_interval, stats=self.stats, logger=logger,
                    wake=self._gate_wake, due=self.gates.until_deadline, on_work=self.gates.wake,
                )  # fmt: skip
                beside: dict[str, Beside] = {
                    "worker:wake-ups": functools.partial(self._forward, feed),
                    "worker:gates": gates.run,
                    "worker:heartbeat": heartbeat.run,
                    "worker:schedules": self.ticker.run,
                }
                if presence is not None:
                    beside["worker:session"] = functools.partial(self._mind_session, presence)
                await Daemon(work, beside, drain=self._drain).run(stop)
        finally:
            self._group = None  # its task group is closed: no child is taken any more
            await self.gates.aclose()
            with contextlib.suppress(Exception):
                await self.store.forget_worker(self.owner)
        return self.stats

    async def _be_present(self, stack: contextlib.AsyncExitStack) -> Presence | None:
        """Join the fleet's ring of store sessions (W7); without a session (the store cannot
        hold one here), the fleet finds this worker dead only as its leases expire."""
        try:
            return await stack.enter_async_context(self.store.presence(self._row()))
        except StoreError as exc:
            logger.warning(
                "worker %s holds no store session (%s): if it dies, its runs are adopted "
                "only as their leases expire", self.owner, describe(exc),
            )  # fmt: skip
            return None

    async def _mind_session(self, presence: Presence, closing: asyncio.Event) -> None:
        """Each time the store session lapses and is taken back: say so, and stop what this
        worker drives if the fleet buried the session meanwhile (its leases are fenced)."""
        while not closing.is_set():
            lapse = await first_of(presence.lapse(), closing.wait())
            if lapse is None:
                return
            if not lapse.buried:
                logger.warning(
                    "worker %s: its store session ended (%s) and was taken back %.3g s later; "
                    "the fleet had not taken it for gone, so its runs go on",
                    self.owner, lapse.reason, lapse.seconds,
                )  # fmt: skip
                continue
            jobs = list(self._jobs)
            logger.warning(
                "worker %s: its store session ended (%s) and the fleet took it for gone before "
                "it was back (%.3g s later): the leases of its runs were expired and fenced, so "
                "it stops the %d run(s) it drove (the fleet adopts them) and goes on",
                self.owner, lapse.reason, lapse.seconds, len(jobs),
            )  # fmt: skip
            self.stats.lapsed += len(jobs)
            for task in jobs:
                task.cancel()

    def _until_pulse(self) -> float:
        """Seconds until the next pulse is due: what the last one said comes due, and, while
        this worker drives runs, half a lease ttl after it (a lapsed lease of another worker
        cut off from the store is found as soon as it expires)."""
        due = self._pulse_at
        if self._jobs:
            due = min(due, self._pulsed_at + self.engine.lease_ttl / 2)
        return due - time.monotonic()

    async def _forward(self, feed: Any, closing: asyncio.Event) -> None:
        while not closing.is_set():
            kinds = await feed.wait(0.5) - _STREAM  # stream rows concern readers only
            if kinds:
                self._kick(kinds)

    def _kick(self, kinds: frozenset[str] | set[str]) -> None:
        self._kinds |= kinds
        self._wake.set()

    def _until_look(self) -> float:
        """Seconds until the next poll of the store, or the next look at a rate window."""
        return min(self._poll_at, self._look_at) - time.monotonic()

    async def _work_round(self, group: asyncio.TaskGroup) -> int:
        now = time.monotonic()
        kinds, self._kinds = frozenset(self._kinds), set()
        if now >= self._poll_at:  # the first round looks at everything; heartbeats after
            kinds, self._poll_at = CHANGE_KINDS | {"slot"}, float("inf")
        if now >= self._look_at:  # a look that came due; one not due yet stays pending
            kinds, self._look_at = kinds | {"slot"}, float("inf")
        self.stats.rounds += 1
        try:
            await self._round(kinds, group)
        except Exception:
            # What woke this round is not seen through: keep it for a round made again soon
            # (the next wake-up may be a heartbeat away), backing off while the store fails.
            self._kinds |= kinds
            self._look_at = min(self._look_at, time.monotonic() + self._retry)
            self._retry = min(self._retry * 2, ROUND_RETRY_MAX)
            raise
        self._retry = ROUND_RETRY
        return 0

    async def _round(self, kinds: frozenset[str], group: asyncio.TaskGroup) -> None:
        """One look at the store, doing only what the wake-up's ``kinds`` can have changed."""
        if "config" in kinds:
            await self._refresh_queues()
            self.ticker.changed()
        if "cancel" in kinds:
            await self._cancel_requested()
        if "answer" in kinds and self._free() > 0:
            # (An answer that found its run leased is applied by the holder as it lets
            # go, Engine._settle; the poll catches any other.)
            for question in await self.store.claim_answers(
                self.owner, self.engine.lease_ttl, limit=self._free()
            ):
                self._start(group, _Job(question.run_id, "answer"), self._answer(question))
        # Another worker's release frees a slot only in a queue with global limits.
        counted = any(q.concurrency is not None or q.limit is not None for q in self.queues)
        if kinds & {"submit", "slot"} or ("release" in kinds and counted):
            await self._claim(group)
        if kinds & {"release", "slot"}:
            if time.monotonic() >= self._next_orphan_scan:
                self._next_orphan_scan = time.monotonic() + min(self.poll_interval, 0.25)
                await self._adopt_orphans(group)
            else:  # scanned a moment ago: scan again once that moment has passed
                self._look_at = min(self._look_at, self._next_orphan_scan)

    # -- claiming -----------------------------------------------------------------------

    def _free(self, queue: Queue | None = None) -> int:
        free = self.concurrency - len(self._jobs) - self._lent.total()
        if queue is not None and queue.worker_concurrency is not None:
            lent = self._lent[queue.name]
            free = min(free, queue.worker_concurrency - self._by_queue[queue.name] - lent)
        return max(free, 0)

    # -- child runs claimed as they are submitted (ChildClaims) ----------------------------

    def reserve(self, queue: str) -> Claim | None:
        """A claim for this worker's free slots on ``queue`` (one it serves), lent until
        :meth:`settle`; None when it has none, or it is draining."""
        served = next((q for q in self.queues if q.name == queue), None)
        if served is None or self._group is None:
            return None
        free = self._free(served)
        if free <= 0:
            return None
        self._lent[queue] += free
        return Claim(
            queue=queue, owner=self.owner, ttl=self.engine.lease_ttl, limit=free,
            skip=tuple(self._not_here),
        )  # fmt: skip

    def settle(self, claim: Claim, claimed: list[str]) -> None:
        """Drive ``claimed``, the runs the submit's ``claim`` got here, as claimed ones; the
        other slots it held go back."""
        self._lent[claim.queue] -= claim.limit
        for run_id in claimed:
            group = self._group
            if group is not None:
                try:
                    self._start(
                        group, _Job(run_id, "claim", claim.queue), self._start_or_fail(run_id)
                    )
                except RuntimeError:  # the task group is shutting down (an abnormal stop)
                    self._group = None
                else:
                    self.stats.claimed += 1
                    self.stats.taken += 1
                    continue
            # Draining (or stopped) since the reserve: back to the queue, for another worker.
            back = asyncio.get_running_loop().create_task(self._give_back(run_id))
            self._giving_back.add(back)
            back.add_done_callback(self._giving_back.discard)

    async def _claim(self, group: asyncio.TaskGroup) -> None:
        await self._recheck_handed_back()
        # Rotate the start so one busy queue does not starve the others.
        start = self.stats.rounds % len(self.queues) if self.queues else 0
        for queue in self.queues[start:] + self.queues[:start]:
            free = self._free(queue)
            if free <= 0:
                continue
            async with self._claiming:
                claimed = await self.store.claim_runs(
                    queue.name, self.owner, self.engine.lease_ttl, limit=free,
                    skip=tuple(self._not_here),
                )  # fmt: skip
            for run_id in claimed:
                self.stats.claimed += 1
                self._start(group, _Job(run_id, "claim", queue.name), self._start_or_fail(run_id))
            if queue.limit is not None and len(claimed) < free:
                # The rate window may be what held runs back: look again when a
                # start may have left it, not a poll later.
                soon = time.monotonic() + queue.period / queue.limit
                self._look_at = min(self._look_at, soon)

    def _start(self, group: asyncio.TaskGroup, job: _Job, work: Awaitable[Any]) -> None:
        """Run ``work`` as a job of this worker: it holds a slot (and its queue's) until it ends."""
        guarded = self._guard(job, work)
        try:
            task = group.create_task(guarded, name=f"worker:{job.kind}:{job.run_id}")
        except RuntimeError:  # the group is shutting down: ``work`` never runs
            guarded.close()
            if inspect.iscoroutine(work):
                work.close()
            raise
        self._here.add(job.run_id)
        if job.queue is not None:
            self._by_queue[job.queue] += 1
        self._jobs[task] = job
        task.add_done_callback(self._job_done)

    def _job_done(self, task: asyncio.Task[None]) -> None:
        job = self._jobs.pop(task, None)
        if job is None:
            return
        self._here.discard(job.run_id)
        if job.queue is not None:
            self._by_queue[job.queue] -= 1
        self._kick({"slot"})  # a slot is free: claim at once, no wake-up from the store needed

    async def _guard(self, job: _Job, work: Awaitable[Any]) -> None:
        """A job's end never ends the worker: a run's failure is counted and logged (Q6).

        Each job says one INFO line as it starts and one as it ends.
        """
        where = f" from queue {job.queue!r}" if job.queue is not None else ""
        logger.info("run %s: %s%s", job.run_id, _STARTED[job.kind], where)
        try:
            result = await work
        except LeaseLapsed:
            self.stats.lapsed += 1  # the lease said so, once per outage (W7)
        except (LeaseHeld, LeaseLost, NotResumable, RunNotFound) as exc:
            self.stats.busy += 1
            logger.debug("run %s: %s (another owner has it, or it ended)", job.run_id, exc)
        except Exception as exc:
            await self._job_failed(job, exc)
        else:
            if isinstance(result, RunResult):
                self._count(result.status)
                logger.info("run %s: %s (%.3g s)", job.run_id, result.status.value, result.duration)

    async def _job_failed(self, job: _Job, exc: Exception) -> None:
        try:
            status = (await self.store.get_run(job.run_id)).status
        except Exception:
            status = None
        if status is RunStatus.FAILED:
            self.stats.failed += 1
            logger.warning("run %s failed: %s", job.run_id, describe(exc))
            return
        self.stats.errors += 1
        logger.error("run %s (%s): %s", job.run_id, job.kind, describe(exc), exc_info=exc)

    def _count(self, status: str) -> None:
        if status in ("completed", "suspended", "cancelled"):
            setattr(self.stats, status, getattr(self.stats, status) + 1)

    async def _start_or_fail(self, run_id: str) -> RunResult | None:
        """Start (or resume) a claimed run, or cancel it undriven if that was asked before it
        started; one whose rows can never be read is failed, once (Q6).

        A run this worker cannot drive (its graph, or an executor it names, is
        not at hand here: another deploy's) goes back to its queue for a worker
        that can, and this worker claims no more runs of that graph. A child run
        goes back so while another live worker of its queue can drive it (it
        registered that version, or registered none); otherwise it is failed,
        and its parent's node with it (R3). Such a graph is claimed again once
        no other live worker of the queue can drive it.
        """
        try:
            return await self.engine.start_claimed(run_id, cancel_first=True)
        except (GraphError, GraphMismatch) as exc:
            record = await self.store.get_run(run_id)
            key = (record.graph_name, record.fingerprint)
            queue = record.queue_name
            if record.parent_run_id is not None and queue is not None:
                # A child run waits for a worker that can drive it only while one is live;
                # otherwise its parent's node fails with the reason, rather than wait on a
                # queue nobody can serve (R3).
                if not await self._driven_elsewhere(queue, key):
                    await self.engine.fail_run(
                        run_id, f"worker {self.owner} cannot drive graph {record.graph_name!r} "
                        f"of this child run, nor can any other live worker of queue {queue!r}: "
                        f"{describe(exc)}",
                    )  # fmt: skip
                    raise
                self._handed_back.setdefault(key, set()).add(queue)
            # This worker claims no more runs of that graph, from the next claim round on.
            first = key not in self._not_here
            self._not_here.add(key)
            async with self._claiming:
                returned = await self.store.return_claim(run_id, self.owner)
            if returned:
                if first:
                    logger.warning(
                        "run %s (graph %r) went back to queue %r: this worker cannot drive it "
                        "(%s); it claims no more runs of that graph",
                        run_id, record.graph_name, record.queue_name, describe(exc),
                    )  # fmt: skip
                return None
            await self.engine.fail_run(run_id, f"cannot be started: {describe(exc)}")
            raise
        except UNRESUMABLE as exc:
            await self.engine.fail_run(run_id, f"cannot be started: {describe(exc)}")
            raise

    async def _driven_elsewhere(self, queue: str, key: tuple[str, str]) -> bool:
        """Whether another live worker of ``queue`` (the store's workers, ``is_live``) can drive
        graph ``key`` (name, fingerprint): it registered that version, or it registered no
        graph (it drives what it imports)."""
        now = self.store.clock()  # seen_at is on the store's clock
        others = [
            w.worker_id
            for w in await self.store.workers()
            if w.worker_id != self.owner and queue in w.queues and is_live(w, now)
        ]
        registered = await self.store.worker_graphs(others)
        return any(w not in registered or key in registered[w] for w in others)

    async def _recheck_handed_back(self) -> None:
        """Claim again, at most once a poll interval, the graphs of child runs this worker
        handed back that no other live worker of their queue can drive any more: the next
        such child claimed here is failed (R3)."""
        if not self._handed_back or time.monotonic() < self._recheck_at:
            return
        self._recheck_at = time.monotonic() + self.poll_interval
        for key, queues in list(self._handed_back.items()):
            for queue in sorted(queues):
                if not await self._driven_elsewhere(queue, key):
                    del self._handed_back[key]
                    self._not_here.discard(key)
                    break

    # -- answers, orphans, cancels ----------------------------------------------------------

    async def _answer(self, question: QuestionRow) -> None:
        """Apply a claimed answer (exactly once, Q3), then let go of the claim's lease."""
        try:
            outcome = await self.resumer.resume(question.question_id)
            self.stats.outcomes[outcome.value] = self.stats.outcomes.get(outcome.value, 0) + 1
            if outcome is Outcome.APPLIED:
                self.stats.applied += 1
        finally:
            await self._let_go(question.run_id)

    async def _let_go(self, run_id: str) -> None:
        """Release this worker's lease on ``run_id`` if a claim left it held (not while driving it)."""
        if self.engine.is_driving(run_id):
            return
        record = await self.store.get_run(run_id)
        if record.lease_owner == self.owner:
            await self.store.release_lease(run_id, self.owner, record.lease_token)

    async def _adopt_orphans(self, group: asyncio.TaskGroup) -> None:
        """Take over runs whose lease expired (D6)."""
        await self.orphans.sweep(
            max(self._free(), 1) * 4, functools.partial(self._take, group),
            room=lambda: self._free() > 0, skip=self._here,
        )  # fmt: skip

    async def _take(self, group: asyncio.TaskGroup, orphan: Orphan) -> None:
        """Drive an orphan as a job: cancel it if asked, start it if it never started, else adopt it."""
        record = orphan.record
        if record.cancel_requested_at is not None:
            work: Awaitable[Any] = cancel_undriven(self.engine, record.run_id)
        elif record.queue_name is not None:
            work = self._start_or_fail(record.run_id)  # maybe claimed and never started: start it
        else:
            work = orphan.adopt(record.run_id)
        self._start(group, _Job(record.run_id, "adopt", record.queue_name), work)

    async def _cancel_requested(self) -> None:
        for run_id in await self.store.cancel_requests(self.owner):
            self.engine.request_cancel(run_id)

    # -- background loops ----------------------------------------------------------------

    async def _heartbeat(self) -> int:
        """One pulse: report this worker, and look (cheaply) at what may need a round."""
        self._pulse_at = float("inf")
        self._pulsed_at = time.monotonic()
        pulse = await self.store.pulse(self._row())
        self._beats += 1
        if pulse.due_at is not None:  # a lease expiry, a delayed run, a deadline: look then
            self._pulse_at = (
                time.monotonic() + max(pulse.due_at - self.store.clock(), 0.0) + DUE_SLACK
            )
        kinds = set(pulse.kinds)
        if self._beats % self._refresh_every == 0:
            kinds.add("config")  # the fallback for a lost notification of new limits
        if "release" in kinds or "submit" in kinds:
            kinds.add("slot")  # a rate window may have opened; orphans may wait
        if pulse.gates and not self._gates_on:
            self._gate_wake.set()
        self._gates_on = pulse.gates
        if pulse.overdue:
            await self._cancel_overdue()
        if kinds:
            self._kick(kinds)
        return 0

    async def _cancel_overdue(self) -> None:
        """Cancel queued and suspended runs past their deadline, with their children (R6).

        Nobody drives them, so no run loop's own timer does it: a pulse says
        when one is overdue (and when the next one will be), and this finds them.
        """
        for run_id in await self.store.overdue_runs(self.store.clock(), limit=OVERDUE_BATCH):
            status = await self.engine.cancel(run_id)
            logger.info("run %s: past its deadline, cancelled (now %s)", run_id, status)

    async def _gate_tick(self) -> int:
        """A machine-gate tick, only while an open question has a poller or a deadline."""
        if not self._gates_on and not self.gates.busy():
            return 0
        return await self.gates.tick()

    async def _refresh_queues(self) -> None:
        """Queues named only take their limits from the store's declaration (re-read each heartbeat)."""
        declared = {q.name: q for q in await self.store.queues()}
        mine = {q.name for q in self._declare}
        self.queues = [
            q if q.name in mine else declared.get(q.name, Queue(q.name)) for q in self.queues
        ]

    def _row(self) -> WorkerRow:
        return WorkerRow(
            worker_id=self.owner, queues=tuple(q.name for q in self.queues),
            concurrency=self.concurrency, started_at=self._started_at, seen_at=self.store.clock(),
            running=len(self._jobs), dead_after=max(60.0, 10 * self.heartbeat),
        )  # fmt: skip

    # -- stopping -------------------------------------------------------------------------

    async def _give_back(self, run_id: str) -> None:
        try:
            await self.store.return_claim(run_id, self.owner)
        except Exception as exc:  # its lease lapses, and any worker adopts it
            logger.warning("run %s: not given back to its queue as this worker drains: %s",
                           run_id, describe(exc))  # fmt: skip

    async def _drain(self) -> None:
        """No more claims; runs in flight get ``grace`` seconds, then are stopped where they are."""
        self._group = None  # nor children claimed as their parents submit them
        jobs = list(self._jobs)
        if jobs:
            logger.info(
                "worker %s draining %d runs (grace %.3g s)", self.owner, len(jobs), self.grace
            )
            _, pending = await asyncio.wait(jobs, timeout=self.grace)
            for task in pending:
                task.cancel()  # each run's lease is released on its way out (RunWriter.leased)
            await asyncio.gather(*pending, return_exceptions=True)
        # A child submit that was writing as the drain began settles after it: the runs it
        # claimed here are given back (the jobs above waited for their parents' submits).
        while self._giving_back:
            await asyncio.gather(*self._giving_back, return_exceptions=True)


def _with_children(graphs: Sequence[Graph]) -> list[Graph]:
    """``graphs`` and the graphs their nodes run as child runs, at any depth, each once."""
    found: list[Graph] = []
    todo = list(graphs)
    while todo:
        graph = todo.pop(0)
        if any(g is graph for g in found):
            continue
        found.append(graph)
        todo.extend(graph.child_graphs())
    return found


def _seconds(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
