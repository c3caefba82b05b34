"""The asynchronous loop: N workers on shards, one merger, no barrier.

Each worker owns a shard of the training tasks and runs rollouts back to back,
always against the newest head (it re-reads the head the merger publishes
before every rollout: resync on commit). Proposals go to a single merger, the
only ledger writer, which drops proposals lagging more than ``async_ratio``
versions behind head and sweeps the rest. Nobody waits for the slowest
rollout, so worker utilisation stays near 1 on heavy-tailed latencies.

Long tail: with a ``duration_estimator`` each rollout gets a timer at
``straggler_factor x estimate``; crossing it counts a straggler. With a
``resume_queue`` the straggling attempt is cut, its task queued, and the next
idle worker whose shard owns it re-runs it against the current head; when the
queue refuses (``max_attempts`` reached) the attempt runs to completion. When
``run`` is a loop graph the straggler is not cut but preempted at its next
turn boundary and later resumed, conversation intact, against the newer head
(partial rollouts, :mod:`._partial`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .._engine import Engine
from .._graph import Graph
from ..stores import RunStore
from ..tail import DurationEstimator, ResumeItem, ResumeQueue
from ._accept import Acceptance
from ._audit import AuditScheduler
from ._core import Evolution, Progress, Proposal, Settings, first_error, prepare, straggler_limit
from ._ledger import Version
from ._model import Artifact, ProposeFn, RewardFn, RunFn, Task, shard
from ._partial import PartialRollouts, durable_engine
from ._result import EvolutionResult


@dataclass(slots=True)
class _Budget:
    """Rollout slots: claimed before a rollout starts, given back when a straggler is cut."""

    left: int

    def claim(self) -> bool:
        if self.left <= 0:
            return False
        self.left -= 1
        return True

    def refund(self) -> None:
        self.left += 1


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
        partial: PartialRollouts | None = None,
    ) -> None:
        self.evo = evolution
        self.partial = partial
        self.shards = shard(evolution.train, workers)
        self.async_ratio = async_ratio
        self.estimator = estimator
        self.factor = straggler_factor
        self.resume_queue = resume_queue
        self.budget = _Budget(evolution.settings.max_rollouts)
        self.busy = [0.0] * workers
        self.proposals: asyncio.Queue[Proposal | None] = asyncio.Queue()
        self.stop = asyncio.Event()
        self.stop_reason = "budget"

    async def drive(self) -> float:
        """Run workers and the merger; return the wall time of the rollout phase."""
        if self.evo.reached_target():
            self.stop_reason = "target"
            return 0.0
        started = time.perf_counter()
        with first_error():
            return await self._run_all(started)

    async def _run_all(self, started: float) -> float:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._merger())
            async with asyncio.TaskGroup() as crew:
                for index, tasks in enumerate(self.shards):
                    crew.create_task(self._worker(index, tasks))
            wall = time.perf_counter() - started
            self.proposals.put_nowait(None)  # the merger drains what is left, then exits
        return wall

    # -- workers ------------------------------------------------------------------

    async def _worker(self, index: int, tasks: Sequence[Task]) -> None:
        owned = {t.id for t in tasks}
        cursor = 0
        while not self.stop.is_set() and self.budget.claim():
            item = self.resume_queue.pop_for(owned) if self.resume_queue is not None else None
            if item is not None:
                task = self.evo.by_id[item.task_id]
            elif tasks:
                task = tasks[cursor % len(tasks)]
                cursor += 1
            else:
                self.budget.refund()
                return
            head = self.evo.head  # resync: the newest head the merger published
            assert head is not None
            started = time.perf_counter()
            try:
                proposal = await self._train_step(task, head, item)
            finally:
                self.busy[index] += time.perf_counter() - started
            if proposal is not None:
                self.proposals.put_nowait(proposal)
            self.evo.report()

    async def _train_step(
        self, task: Task, head: Version, item: ResumeItem | None
    ) -> Proposal | None:
        outcome = await self._attempt(task, head, item)
        if outcome is None:  # cut (or preempted) as a straggler; its task is queued
            self.budget.refund()
            return None
        output, value = outcome
        self.evo.rollouts += 1
        self.evo.resumed += int(item is not None)
        return await self.evo.propose(task, head, output, value)

    async def _attempt(
        self, task: Task, head: Version, item: ResumeItem | None
    ) -> tuple[Any, float] | None:
        """One training rollout; None when it straggled and was cut (or preempted) for a re-run."""
        if self.partial is not None:
            return await self.partial.attempt(task, head, item)
        resumed = item is not None
        if self.estimator is None:
            return await self.evo.rollout(task, head, phase="train", resumed=resumed)
        limit = straggler_limit(self.estimator, self.factor, task)
        started = time.perf_counter()
        attempt = asyncio.create_task(self.evo.rollout(task, head, phase="train", resumed=resumed))
        try:
            done, _ = await asyncio.wait({attempt}, timeout=limit)
            if not done:
                self.evo.stragglers += 1
                if self._requeue(task, head):
                    attempt.cancel()
                    await asyncio.wait({attempt})
                    return None
            outcome = await attempt
        finally:
            if not attempt.done():  # we were cancelled: never leave the attempt behind
                attempt.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await attempt
        self.estimator.observe(task.cost, time.perf_counter() - started)
        return outcome

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
            pending[:] = self._fresh(pending)
            batch = pending[: self.evo.settings.max_candidates]
            del pending[: self.evo.settings.max_candidates]
            if batch and not self.stop.is_set():
                await self.evo.sweep(batch)
                if self.evo.reached_target():
                    self.stop_reason = "target"
                    self.stop.set()
            if closing and not pending:
                return

    def _fresh(self, proposals: Sequence[Proposal]) -> list[Proposal]:
        """Proposals at most ``async_ratio`` versions behind head; the rest are counted and dropped."""
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
    duration_estimator: DurationEstimator | None = None,
    straggler_factor: float = 3.0,
    resume_queue: ResumeQueue | None = None,
    engine: Engine | None = None,
    progress: Callable[[Progress], None] | None = None,
) -> EvolutionResult:
    """Evolve an artifact with N asynchronous workers and one merger (no barrier).

    Args:
        tasks: At least 4 tasks with unique ids; split into training and held-out.
        reward: ``reward(task, output) -> float`` in ``[0, 1]`` (checked).
        run: ``run(rendered, task) -> output`` (sync or async), or a tailrace
            ``Graph`` run with input ``{"rendered": ..., "task": task.to_dict()}``
            whose ``RunResult.output`` is the output. A graph whose turns are
            visits of a loop gets partial rollouts (with ``duration_estimator``
            and ``resume_queue``): write it so that every turn reads
            ``rendered`` from the payload going around the loop and passes it
            on (a resumed run has the newer head patched in there), and keep
            the turns so far in the payload (say a ``"conversation"`` list).
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
        shuffle_seed: Shuffle tasks with this seed before splitting; None keeps their order.
        async_ratio: Proposals whose rollout rendered a head more than this many
            versions behind the current one are dropped.
        acceptance: The held-out gate (default :class:`Acceptance`).
        rank_size: How many held-out tasks rank candidates cheaply (default a quarter).
        max_candidates: Most candidates ranked per sweep.
        audit: Learns trust in the cheap ranking from every sweep (default a new one).
        duration_estimator: Enables straggler detection: a rollout running past
            ``straggler_factor`` times its estimate (for ``task.cost``) is a straggler.
        straggler_factor: The straggler threshold as a multiple of the estimate.
        resume_queue: Where straggling tasks are queued for a re-run against the
            current head by a worker owning them; items already in it are run first.
            With a graph ``run``, a straggler is instead preempted at its next
            turn boundary and queued with its run id (``external_handle``), its
            turn, the version it rendered and its parked ``"conversation"``; the
            worker that pops it resumes the run with ``patch={"rendered": <head>}``
            and the pair of versions is recorded in ``EvolutionResult.partial``.
        engine: Runs ``run`` when it is a graph (default ``Engine()``). Partial
            rollouts need a store: training rollouts then run on ``engine`` if
            it has one, else on an engine over ``store`` (the evolution's store).
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
    settings = Settings(
        max_rollouts=max_rollouts,
        target=target,
        held_out_frac=held_out_frac,
        shuffle_seed=shuffle_seed,
        rank_size=rank_size,
        max_candidates=max_candidates,
        acceptance=acceptance or Acceptance(),
        progress=progress,
    )
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
    )
    try:
        partial = None
        if isinstance(run, Graph) and duration_estimator is not None and resume_queue is not None:
            partial = PartialRollouts(
                evolution,
                run,
                durable_engine(engine, evolution.ledger.store),
                resume_queue,
                duration_estimator,
                straggler_factor,
            )
        loop = _AsyncLoop(
            evolution,
            workers=workers,
            async_ratio=async_ratio,
            estimator=duration_estimator,
            straggler_factor=straggler_factor,
            resume_queue=resume_queue,
            partial=partial,
        )
        wall = await loop.drive()
        return evolution.result(
            mode="async", stop_reason=loop.stop_reason, wall=wall, busy=loop.busy
        )
    finally:
        evolution.close()  # abandoned sync calls (cut stragglers) never hold the caller
        if owned is not None:
            await owned.close()
