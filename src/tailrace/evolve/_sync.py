"""The synchronous loop: rounds with a barrier, the baseline the async loop is measured against.

Each round, every worker runs the next task of its shard against the same
head (or with ``selection="pareto"`` against a parent sampled from the pool);
the round waits for all of them (the barrier), or for ``round_timeout``
seconds after which the unfinished rollouts are cancelled and counted as
stragglers. The round's proposals then go through one merge sweep, while the
workers wait. One slow rollout holds up every worker, which is the cost the
asynchronous loop removes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence

from ..core import Engine
from ..executors import Executor
from ..graph import Graph
from ..stores import RunStore
from ._accept import Acceptance
from ._audit import AuditScheduler
from ._core import Evolution, first_error
from ._failures import Retry, UnitFailed
from ._ledger import Version
from ._model import Artifact, ProposeFn, RewardFn, RunFn, Task, shard
from ._options import Progress, Proposal, settings_from
from ._pool import Member
from ._prepare import prepare
from ._result import EvolutionResult
from ._sweep import sweep
from ._usage import Price


class _Rounds:
    """Per-worker time accounting of the rounds: busy in attempts, and in attempts that were used."""

    def __init__(self, evo: Evolution, workers: int, round_timeout: float | None) -> None:
        self.evo = evo
        self.round_timeout = round_timeout
        self.busy = [0.0] * workers
        self.used = [0.0] * workers

    async def step(
        self, index: int, task: Task, head: Version, parent: Member | None
    ) -> Proposal | None:
        started = time.perf_counter()
        used = False
        try:
            try:
                output, value = await self.evo.rollout(task, head, phase="train")
            except UnitFailed:
                self.evo.window.add(True)
                return None
            self.evo.rollouts += 1
            proposal = await self.evo.propose(task, head, output, value, parent)
            used = True
            return proposal
        finally:
            elapsed = time.perf_counter() - started
            self.busy[index] += elapsed
            self.used[index] += elapsed if used else 0.0

    async def round(self, picks: Sequence[tuple[int, Task]]) -> list[Proposal]:
        """Run one round; return its proposals in worker order."""
        steps = []
        for index, task in picks:
            head, parent = self.evo.parent_for_rollout()
            steps.append(asyncio.create_task(self.step(index, task, head, parent)))
        try:
            done, pending = await asyncio.wait(steps, timeout=self._timeout())
        finally:
            for step in steps:
                step.cancel()  # a no-op for finished ones; cuts the round's stragglers
            await asyncio.wait(steps)
        self.evo.stragglers += len(pending)
        if pending and self._past_deadline():
            self.evo.stop("max_seconds")
        proposals = []
        for step in steps:  # in worker order: deterministic
            if step in done:
                proposal = step.result()  # re-raises a contract violation (a bug)
                if proposal is not None:
                    proposals.append(proposal)
        self.evo.report()
        return proposals

    def _timeout(self) -> float | None:
        """``round_timeout``, shortened to what is left before the ``max_seconds`` deadline."""
        if self.evo.deadline is None:
            return self.round_timeout
        left = max(0.0, self.evo.deadline - asyncio.get_running_loop().time())
        return left if self.round_timeout is None else min(left, self.round_timeout)

    def _past_deadline(self) -> bool:
        deadline = self.evo.deadline
        return deadline is not None and asyncio.get_running_loop().time() >= deadline


async def _drive(
    evo: Evolution, workers: int, max_rounds: int | None, round_timeout: float | None
) -> tuple[float, _Rounds]:
    shards = shard(evo.train, workers)
    rounds = _Rounds(evo, workers, round_timeout)
    left = evo.settings.max_rollouts
    count = 0
    started = time.perf_counter()
    if evo.reached_target():
        evo.stop("target")
        return 0.0, rounds
    while left > 0 and evo.limit_reached() is None:
        if max_rounds is not None and count >= max_rounds:
            evo.stop("rounds")
            break
        picks = [(i, s[count % len(s)]) for i, s in enumerate(shards) if s][:left]
        if not picks:
            break
        left -= len(picks)
        count += 1
        proposals = await rounds.round(picks)
        if proposals and evo.limit_reached() is None:
            await sweep(evo, proposals)
        if evo.reached_target():
            evo.stop("target")
    return time.perf_counter() - started, rounds


async def evolve(
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
    max_rounds: int | None = None,
    round_timeout: float | None = None,
    target: float | None = None,
    held_out_frac: float = 0.4,
    shuffle_seed: int | None = None,
    acceptance: Acceptance | None = None,
    rank_size: int | None = None,
    max_candidates: int = 4,
    audit: AuditScheduler | None = None,
    audits_per_sweep: int = 1,
    selection: str = "head",
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
    """Evolve an artifact in synchronous rounds: all workers, then a barrier, then one merge sweep.

    Args:
        tasks: At least 4 tasks with unique ids; split into training and held-out.
        reward: ``reward(task, output) -> float`` in ``[0, 1]`` (checked).
        run: ``run(rendered, task) -> output`` (sync or async; sync ones run on
            daemon threads, so one cut by ``round_timeout`` never holds the
            process open), or a tailrace ``Graph`` run with input
            ``{"rendered": ..., "task": task.to_dict()}``.
        propose: ``propose(rendered, task, output, reward) -> Edit | None``.
        artifact: The first version (an :class:`Artifact` or its entries); a
            stored head for ``artifact_id`` is resumed instead.
        store: Where the ledger lives (an in-memory store when None).
        artifact_id: The artifact's id in the ledger.
        workers: Rollouts per round; worker ``i`` owns a round-robin shard.
        max_rollouts: Budget of training rollouts (the last round may be partial).
        max_rounds: Stop after this many rounds (stop reason ``"rounds"``).
        round_timeout: Seconds a round waits before cancelling its unfinished
            rollouts (counted as stragglers); None waits for all. Each held-out
            rollout of the initial scoring is cut after it too (it scores 0,
            recorded as a ``TimeoutError``; a sync call is left on its thread).
        target: Stop once the head's mean held-out reward reaches this.
        held_out_frac: Fraction of tasks held out for acceptance (default 0.4).
        shuffle_seed: Shuffle tasks with this seed before splitting; None keeps
            their order. Also seeds Pareto parent sampling (None: 0).
        acceptance: The held-out gate (default :class:`Acceptance`).
        rank_size: How many held-out tasks rank candidates cheaply (default a quarter).
        max_candidates: Most candidates ranked per sweep.
        audit: Routes each sweep's decision to the oracle or the cheap layer,
            learns trust, queues audits and holds ``oracle_budget`` (default a
            new :class:`AuditScheduler`).
        audits_per_sweep: Most queued audits a sweep buys from the oracle budget.
        selection: ``"head"`` or ``"pareto"`` (see :func:`async_evolve`).
        retry: How failing ``run``/``reward``/``propose`` calls are retried
            (default :class:`Retry`).
        max_error_rate: Stop (``"errors"``) once more than this fraction of the
            last ``error_window`` units of work failed every attempt; 1.0 never stops.
        error_window: How many recent units the error rate is measured over.
        max_seconds: Stop (``"max_seconds"``) this many seconds after the
            initial scoring; the round or evaluation in flight is cut. The
            initial scoring gets as long: past it, its unfinished rollouts are
            cut and the loop stops before any round.
        max_calls: Stop (``"max_calls"``) once this many user calls were made.
        max_cost: Stop (``"max_cost"``) once the priced usage reaches this.
        prices: Model name mapped to its :class:`Price` (for cost).
        patience: Stop (``"patience"``) after this many merge sweeps in a row
            without a held-out improvement.
        quality: The held-out reward whose first reaching is reported as
            ``time_to_quality``/``cost_to_quality`` (default ``target``).
        engine: Runs ``run`` when it is a graph (default ``Engine()``).
        executor: Where each ``run``, ``reward`` and ``propose`` attempt runs
            (say ``RayExecutor()``; default: here); see :func:`async_evolve`.
            The rounds, the merge sweeps and the ledger stay in this process.
        progress: Called with a :class:`Progress` after every round and sweep.

    Raises:
        ValueError: bad tasks (fewer than 4, duplicate ids), options out of range,
            or a reward outside ``[0, 1]`` (naming the task).
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if round_timeout is not None and not round_timeout > 0:
        raise ValueError(f"round_timeout must be > 0 seconds or None, got {round_timeout}")
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
        with first_error():
            wall, rounds = await _drive(evolution, workers, max_rounds, round_timeout)
        return evolution.result(
            mode="sync", stop_reason="budget", wall=wall, busy=rounds.busy, used=rounds.used
        )
    finally:
        evolution.close()  # abandoned sync calls (cut stragglers) never hold the caller
        if owned is not None:
            await owned.close()
