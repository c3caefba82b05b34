"""The asynchronous loop: N workers on shards, one merger, no barrier.

Each worker owns a shard of the training tasks and runs rollouts back to back,
always against the newest head (it re-reads the head the merger publishes
before every rollout: resync on commit), or with ``selection="pareto"`` against
a parent sampled from the pool. Proposals go to a single merger, the only
ledger writer, which drops proposals lagging more than ``async_ratio``
versions behind head and sweeps the rest. Nobody waits for the slowest
rollout, so worker utilisation stays near 1 on heavy-tailed latencies.

Long tail: with a ``duration_estimator`` each rollout gets a timer at
``straggler_factor x estimate``; crossing it counts a straggler, and then, in
this order of preference:

- with ``detach_stragglers=n`` and fewer than ``n`` detached, the straggler
  keeps running in the background and its worker takes the next task; its
  result, when it arrives, is used like any other (its proposal is judged
  like any lagging one). Nothing is thrown away: right for spikes that are
  queueing, where a re-run would take as long again or cost a second call.
  Once the rollout budget is spent, idle workers back up the detached
  stragglers (first to finish wins), so the loop does not end on their tail;
- with a ``resume_queue`` that accepts it, the attempt is cut, its task
  queued, and the next idle worker whose shard owns it re-runs it against the
  current head: right for spikes that are transient;
- otherwise the worker waits for it.

When ``run`` is a loop graph the straggler is not cut but preempted at its
next turn boundary and later resumed, conversation intact, against the newer
head (partial rollouts, :mod:`._partial`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..core import Engine
from ..executors import Executor
from ..graph import Graph
from ..stores import RunStore
from ..tail import DurationEstimator, ResumeItem, ResumeQueue
from ._accept import Acceptance
from ._audit import AuditScheduler
from ._core import Evolution, first_error, straggler_limit
from ._failures import Retry, UnitFailed
from ._ledger import Version
from ._model import Artifact, ProposeFn, RewardFn, RunFn, Task, shard
from ._options import Progress, Proposal, settings_from
from ._partial import PartialRollouts, durable_engine
from ._pool import Member
from ._prepare import prepare
from ._result import EvolutionResult
from ._sweep import sweep
from ._usage import Price


@dataclass(slots=True)
class _Budget:
    """Rollout slots: claimed before a rollout starts, given back when it does not complete."""

    left: int

    def claim(self) -> bool:
        if self.left <= 0:
            return False
        self.left -= 1
        return True

    def refund(self) -> None:
        self.left += 1


@dataclass(frozen=True, slots=True)
class _Step:
    """One training rollout a worker runs: the task, what it renders, and who asked."""

    index: int
    task: Task
    head: Version
    parent: Member | None
    item: ResumeItem | None
    started: float


@dataclass(slots=True, eq=False)
class _Detached:
    """A straggler running on in the background, and the attempts racing to finish it."""

    step: _Step
    worker_time: float  # what its worker spent on it before moving on
    attempts: list[asyncio.Task[Any]]
    hedged: bool = False
    settled: bool = False


_CUT = object()  # the attempt was cut (its task queued) or preempted
_DETACHED = object()  # the attempt runs on in the background


class _AsyncLoop:
    def __init__(
        self,
        evolution: Evolution,
        *,
        workers: int,
        async_ratio: int,
        estimator: DurationEstimator | None,
        straggler_factor: float,
        resume_queue: ResumeQueue | None,
        detach_stragglers: int = 0,
        partial: PartialRollouts | None = None,
    ) -> None:
        self.evo = evolution
        self.partial = partial
        self.shards = shard(evolution.train, workers)
        self.async_ratio = async_ratio
        self.estimator = estimator
        self.factor = straggler_factor
        self.resume_queue = resume_queue
        self.detach_limit = detach_stragglers
        self.detached: list[_Detached] = []
        self.budget = _Budget(evolution.settings.max_rollouts)
        self.busy = [0.0] * workers
        self.used = [0.0] * workers
        self.proposals: asyncio.Queue[Proposal | None] = asyncio.Queue()
        self.crew: asyncio.TaskGroup | None = None
        self._detached_attempts: set[asyncio.Task[Any]] = set()  # originals left running

    def stopping(self) -> bool:
        return self.evo.limit_reached() is not None

    async def drive(self) -> float:
        """Run workers and the merger; return the wall time of the rollout phase."""
        if self.evo.reached_target():
            self.evo.stop("target")
            return 0.0
        started = time.perf_counter()
        with first_error():
            return await self._run_all(started)

    async def _run_all(self, started: float) -> float:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._merger())
            try:
                async with asyncio.timeout_at(self.evo.deadline):
                    async with asyncio.TaskGroup() as crew:
                        self.crew = crew
                        for index, tasks in enumerate(self.shards):
                            crew.create_task(self._worker(index, tasks))
            except TimeoutError:  # max_seconds: the rollouts in flight were cut
                self.evo.stop("max_seconds")
            wall = time.perf_counter() - started
            self.proposals.put_nowait(None)  # the merger drains what is left, then exits
        return wall

    # -- workers ------------------------------------------------------------------

    async def _worker(self, index: int, tasks: Sequence[Task]) -> None:
        owned = {t.id for t in tasks}
        cursor = 0
        while not self.stopping():
            if not self.budget.claim():
                # Nothing left to start: back up a straggler still running, so the
                # loop does not end waiting on its tail.
                entry = next((d for d in self.detached if not d.hedged), None)
                if entry is None:
                    return
                await self._hedge(index, entry)
                continue
            item = self.resume_queue.pop_for(owned) if self.resume_queue is not None else None
            if item is not None:
                task = self.evo.by_id[item.task_id]
            elif tasks:
                task = tasks[cursor % len(tasks)]
                cursor += 1
            else:
                self.budget.refund()
                return
            head, parent = self.evo.parent_for_rollout()  # resync: the newest head
            step = _Step(index, task, head, parent, item, time.perf_counter())
            try:
                await self._train_step(step)
            finally:
                self.busy[index] += time.perf_counter() - step.started
            self.evo.report()

    async def _train_step(self, step: _Step) -> None:
        try:
            outcome = await self._attempt(step)
        except UnitFailed:
            self.evo.window.add(True)
            self.budget.refund()  # the slot counts completed rollouts only
            return
        if outcome is _CUT:  # cut (or preempted) as a straggler; its task is queued
            self.budget.refund()
            return
        if outcome is _DETACHED:
            return
        await self._complete(step, outcome, time.perf_counter() - step.started)

    async def _complete(self, step: _Step, outcome: Any, worker_time: float) -> None:
        """A rollout's result is used: count it, ask for a proposal, hand it to the merger."""
        output, value = outcome
        self.evo.rollouts += 1
        self.evo.resumed += int(step.item is not None)
        proposal = await self.evo.propose(step.task, step.head, output, value, step.parent)
        self.used[step.index] += worker_time
        if proposal is not None:
            self.proposals.put_nowait(proposal)

    async def _attempt(self, step: _Step) -> Any:
        """One training rollout: its outcome, or ``_CUT`` / ``_DETACHED`` for a straggler."""
        task, head = step.task, step.head
        if self.partial is not None:
            return await self._partial_attempt(step)
        resumed = step.item is not None
        if self.estimator is None:
            return await self.evo.rollout(task, head, phase="train", resumed=resumed)
        limit = straggler_limit(self.estimator, self.factor, task)
        attempt = asyncio.create_task(self.evo.rollout(task, head, phase="train", resumed=resumed))
        try:
            done, _ = await asyncio.wait({attempt}, timeout=limit)
            if not done:
                self.evo.stragglers += 1
                if self._detach(step, attempt):
                    return _DETACHED
                if self._requeue(task, head):
                    attempt.cancel()
                    await asyncio.wait({attempt})
                    return _CUT
            outcome = await attempt
        finally:
            if not attempt.done() and attempt not in self._detached_attempts:
                attempt.cancel()  # we were cancelled: never leave the attempt behind
                with contextlib.suppress(asyncio.CancelledError):
                    await attempt
        self.estimator.observe(task.cost, time.perf_counter() - step.started)
        return outcome

    async def _partial_attempt(self, step: _Step) -> Any:
        assert self.partial is not None
        try:
            outcome = await self.partial.attempt(step.task, step.head, step.item)
        except UnitFailed:
            raise
        except Exception as exc:  # the graph failed: recorded, the loop goes on
            raise self.evo.failed("run", "train", step.task, step.head.version, exc) from exc
        return _CUT if outcome is None else outcome

    # -- stragglers -------------------------------------------------------------------

    def _detach(self, step: _Step, attempt: asyncio.Task[Any]) -> bool:
        """Leave ``attempt`` running in the background if a detach slot is free."""
        if len(self.detached) >= self.detach_limit or self.crew is None:
            return False
        entry = _Detached(step, time.perf_counter() - step.started, [attempt])
        self.detached.append(entry)
        self._detached_attempts.add(attempt)
        self.crew.create_task(self._settle(entry, attempt, None))
        return True

    async def _hedge(self, index: int, entry: _Detached) -> None:
        """Race a backup attempt of a detached straggler on worker ``index``; first to finish wins."""
        entry.hedged = True
        step = entry.step
        started = time.perf_counter()
        backup = asyncio.create_task(
            self.evo.rollout(step.task, step.head, phase="train", resumed=step.item is not None)
        )
        entry.attempts.append(backup)
        try:
            await self._settle(entry, backup, index)
        finally:
            self.busy[index] += time.perf_counter() - started
            if not backup.done():  # we were cancelled: never leave the backup behind
                backup.cancel()
                await asyncio.wait({backup})

    async def _settle(
        self, entry: _Detached, attempt: asyncio.Task[Any], worker: int | None
    ) -> None:
        """Wait for one attempt of a detached straggler; the first to succeed completes it.

        ``worker`` is the worker running a backup (None: the original attempt,
        whose worker moved on). The winner's worker time counts as used.
        """
        started = time.perf_counter()
        await asyncio.wait({attempt})
        self._detached_attempts.discard(attempt)
        if entry.settled or attempt.cancelled():
            return
        error = attempt.exception()
        if error is not None and not isinstance(error, UnitFailed):
            raise error  # a contract violation: a bug
        entry.attempts.remove(attempt)
        if error is not None and entry.attempts:
            return  # another attempt may still succeed
        entry.settled = True
        self.detached.remove(entry)
        for other in entry.attempts:
            other.cancel()
        if error is not None:
            self.evo.window.add(True)
            self.budget.refund()
            return
        # A straggler's duration is not fed to the estimator (a cut one never is
        # either): the limit tracks the typical rollout, not the tail it flags.
        if worker is None:
            await self._complete(entry.step, attempt.result(), entry.worker_time)
        else:
            backup = dataclasses.replace(entry.step, index=worker)
            await self._complete(backup, attempt.result(), time.perf_counter() - started)

    def _requeue(self, task: Task, head: Version) -> bool:
        if self.resume_queue is None:
            return False
        item = ResumeItem(task_id=task.id, turn=0, version_at_checkpoint=head.version)
        return self.resume_queue.push(item)

    # -- the merger -----------------------------------------------------------------

    async def _merger(self) -> None:
        pending: list[Proposal] = []
        closing = False
        while True:
            if not pending and not closing:
                first = await self.proposals.get()
                closing = first is None
                pending.extend([] if first is None else [first])
            while not self.proposals.empty():
                more = self.proposals.get_nowait()
                closing = closing or more is None
                pending.extend([] if more is None else [more])
            # Newest first: a proposal from a rollout of the current head is the
            # likeliest to still be needed. The sweep ranks the first
            # ``max_candidates`` distinct ones; the older rest are superseded by
            # what the workers propose against the new head.
            batch = self._fresh(pending)[::-1]
            pending.clear()
            if batch and not self.stopping():
                await sweep(self.evo, batch)
                if self.evo.reached_target():
                    self.evo.stop("target")
            if closing:
                return

    def _fresh(self, proposals: Sequence[Proposal]) -> list[Proposal]:
        """Proposals at most ``async_ratio`` versions behind head; the rest are counted and dropped.

        A Pareto proposal is judged against its own parent, which never goes
        stale, so none is dropped.
        """
        if self.evo.pool is not None:
            return list(proposals)
        head = self.evo.head
        assert head is not None
        fresh = [p for p in proposals if head.version - p.base_version <= self.async_ratio]
        self.evo.stale_dropped += len(proposals) - len(fresh)
        return fresh


async def async_evolve(
    tasks: Sequence[Task],
    reward: RewardFn,
    *,
    run: RunFn | Graph,
    propose: ProposeFn,
    artifact: Artifact | Mapping[str, str] | None = None,
    store: RunStore | None = None,
    artifact_id: str = "artifact",
    workers: int = 4,
    max_rollouts: int = 100,
    target: float | None = None,
    held_out_frac: float = 0.4,
    shuffle_seed: int | None = None,
    async_ratio: int = 2,
    acceptance: Acceptance | None = None,
    rank_size: int | None = None,
    max_candidates: int = 4,
    audit: AuditScheduler | None = None,
    audits_per_sweep: int = 1,
    selection: str = "head",
    duration_estimator: DurationEstimator | None = None,
    straggler_factor: float = 3.0,
    hedge_factor: float = 1.5,
    resume_queue: ResumeQueue | None = None,
    detach_stragglers: int = 0,
    retry: Retry | None = None,
    max_error_rate: float = 0.5,
    error_window: int = 20,
    max_seconds: float | None = None,
    max_calls: int | None = None,
    max_cost: float | None = None,
    prices: Mapping[str, Price] | None = None,
    patience: int | None = None,
    quality: float | None = None,
    engine: Engine | None = None,
    executor: Executor | None = None,
    progress: Callable[[Progress], None] | None = None,
) -> EvolutionResult:
    """Evolve an artifact with N asynchronous workers and one merger (no barrier).

    Args:
        tasks: At least 4 tasks with unique ids; split into training and held-out.
        reward: ``reward(task, output) -> float`` in ``[0, 1]`` (checked).
        run: ``run(rendered, task) -> output`` (sync or async; sync ones run on
            daemon threads, so one cut while blocked never holds the process
            open), or a tailrace ``Graph`` run with input ``{"rendered": ...,
            "task": task.to_dict()}`` whose ``RunResult.output`` is the output.
            A graph whose turns are visits of a loop gets partial rollouts (with
            ``duration_estimator`` and ``resume_queue``): write it so that every
            turn reads ``rendered`` from the payload going around the loop and
            passes it on (a resumed run has the newer head patched in there),
            and keep the turns so far in the payload (say a ``"conversation"`` list).
        propose: ``propose(rendered, task, output, reward) -> Edit | None``.
        artifact: The first version (an :class:`Artifact` or its entries); when
            the store already holds ``artifact_id`` the stored head is resumed
            and only the artifact's renderer is used.
        store: Where the ledger lives (an in-memory store when None).
        artifact_id: The artifact's id in the ledger.
        workers: How many workers; each owns a round-robin shard of the training tasks.
        max_rollouts: Budget of completed training rollouts.
        target: Stop once the head's mean held-out reward reaches this.
        held_out_frac: Fraction of tasks held out for acceptance (default 0.4).
        shuffle_seed: Shuffle tasks with this seed before splitting; None keeps
            their order. Also seeds Pareto parent sampling (None: 0).
        async_ratio: Proposals whose rollout rendered a head more than this many
            versions behind the current one are dropped (head selection only).
        acceptance: The held-out gate (default :class:`Acceptance`).
        rank_size: How many held-out tasks rank candidates cheaply (default a quarter).
        max_candidates: Most candidates ranked per sweep.
        audit: Routes each sweep's decision to the oracle or the cheap layer,
            learns trust, queues audits and holds ``oracle_budget`` (default a
            new :class:`AuditScheduler`; see :mod:`tailrace.evolve` for the
            routing rules).
        audits_per_sweep: Most queued audits a sweep buys from the oracle budget.
        selection: ``"head"`` (every rollout renders the head) or ``"pareto"``
            (parents sampled from the front of candidates best on some held-out task).
        duration_estimator: Enables straggler detection: a rollout running past
            ``straggler_factor`` times its estimate (for ``task.cost``) is a straggler.
            The merger's held-out rollouts are hedged with it too (see
            ``hedge_factor``).
        straggler_factor: The straggler threshold as a multiple of the estimate.
        hedge_factor: A held-out rollout of the merger running past this
            multiple of its estimate gets a backup attempt (at most two), the
            first to finish counts and the others are cancelled
            (``eval_hedges``). Lower than ``straggler_factor`` by default: a
            hedge loses nothing but a call, and every worker waits on the
            merger's next commit.
        resume_queue: Where straggling tasks are queued for a re-run against the
            current head by a worker owning them; items already in it are run first.
            With a graph ``run``, a straggler is instead preempted at its next
            turn boundary and queued with its run id (``external_handle``), its
            turn, the version it rendered and its parked ``"conversation"``; the
            worker that pops it resumes the run with ``patch={"rendered": <head>}``
            and the pair of versions is recorded in ``EvolutionResult.partial``.
        detach_stragglers: How many stragglers may run on in the background
            while their workers take new tasks (0: none); preferred to cutting.
        retry: How failing ``run``/``reward``/``propose`` calls are retried
            (default :class:`Retry`: 3 attempts, timeouts, connection errors
            and the adapter's 429/5xx, honouring ``Retry-After``).
        max_error_rate: Stop (``"errors"``) once more than this fraction of the
            last ``error_window`` units of work failed every attempt; 1.0 never stops.
        error_window: How many recent units the error rate is measured over.
        max_seconds: Stop (``"max_seconds"``) this many seconds after the
            initial scoring; rollouts and evaluations in flight are cut. The
            initial scoring gets as long: past it, its unfinished rollouts are
            cut and the loop stops before any rollout.
        max_calls: Stop (``"max_calls"``) once this many user calls were made;
            work in flight finishes.
        max_cost: Stop (``"max_cost"``) once the priced usage reaches this.
        prices: Model name mapped to its :class:`Price` (for cost).
        patience: Stop (``"patience"``) after this many merge sweeps in a row
            without a held-out improvement.
        quality: The held-out reward whose first reaching is reported as
            ``time_to_quality``/``cost_to_quality`` (default ``target``); it
            does not stop the loop.
        engine: Runs ``run`` when it is a graph (default ``Engine()``). Partial
            rollouts need a store: training rollouts then run on ``engine`` if
            it has one, else on an engine over ``store`` (the evolution's store).
        executor: Where each ``run``, ``reward`` and ``propose`` attempt runs
            (say ``RayExecutor()``; default: here, sync callables on daemon
            threads). Each attempt is one ``executor.invoke`` on a node
            ``"run"``, ``"reward"`` or ``"propose"``; its input and result
            cross as JSON (the task as ``Task.to_dict()``, an edit as
            ``Edit.to_dict()``, rebuilt here), so a ``run`` output must be
            JSON-able on an executor that ships it; the functions themselves
            are pickled by Ray (cloudpickle). A graph ``run`` gets
            ``Engine(executor=executor)`` unless ``engine`` is given. The
            merger, the ledger and the audit stay in this process. A worker
            lost under a call (:class:`~tailrace.ExecutorLost`) is recorded
            and retried under ``retry`` like any transient failure.
        progress: Called with a :class:`Progress` after every rollout and sweep.

    Raises:
        ValueError: bad tasks (fewer than 4, duplicate ids), options out of range,
            or a reward outside ``[0, 1]`` (naming the task).
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if async_ratio < 0:
        raise ValueError(f"async_ratio must be >= 0, got {async_ratio}")
    if straggler_factor <= 1.0:
        raise ValueError(f"straggler_factor must be > 1, got {straggler_factor}")
    if hedge_factor <= 1.0:
        raise ValueError(f"hedge_factor must be > 1, got {hedge_factor}")
    if detach_stragglers < 0:
        raise ValueError(f"detach_stragglers must be >= 0, got {detach_stragglers}")
    settings = settings_from(locals())
    evolution, owned = await prepare(
        tasks,
        reward,
        run=run,
        propose=propose,
        artifact=artifact,
        store=store,
        artifact_id=artifact_id,
        settings=settings,
        audit=audit,
        engine=engine,
        executor=executor,
    )
    try:
        partial = None
        if isinstance(run, Graph) and duration_estimator is not None and resume_queue is not None:
            partial = PartialRollouts(
                evolution,
                run,
                durable_engine(engine, evolution.ledger.store, executor),
                resume_queue,
                duration_estimator,
                straggler_factor,
            )
        if duration_estimator is not None:  # the merger's held-out rollouts are hedged too
            estimator = duration_estimator
            evolution.eval_limit = lambda task: straggler_limit(estimator, hedge_factor, task)
        loop = _AsyncLoop(
            evolution,
            workers=workers,
            async_ratio=async_ratio,
            estimator=duration_estimator,
            straggler_factor=straggler_factor,
            resume_queue=resume_queue,
            detach_stragglers=detach_stragglers,
            partial=partial,
        )
        wall = await loop.drive()
        return evolution.result(
            mode="async", stop_reason="budget", wall=wall, busy=loop.busy, used=loop.used
        )
    finally:
        evolution.close()  # abandoned sync calls (cut stragglers) never hold the caller
        if owned is not None:
            await owned.close()
