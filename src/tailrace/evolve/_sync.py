"""The synchronous loop: rounds with a barrier, the baseline the async loop is measured against.

Each round, every worker runs the next task of its shard against the same
head; the round waits for all of them (the barrier), or for ``round_timeout``
seconds after which the unfinished rollouts are cancelled and counted as
stragglers. The round's proposals then go through one merge sweep, while the
workers wait. One slow rollout holds up every worker, which is the cost the
asynchronous loop removes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence

from .._engine import Engine
from .._graph import Graph
from ..stores import RunStore
from ._accept import Acceptance
from ._audit import AuditScheduler
from ._core import Evolution, Progress, Proposal, Settings, first_error, prepare
from ._ledger import Version
from ._model import Artifact, ProposeFn, RewardFn, RunFn, Task, shard
from ._result import EvolutionResult


async def _train_step(
    evo: Evolution, task: Task, head: Version, busy: list[float], index: int
) -> Proposal | None:
    started = time.perf_counter()
    try:
        output, value = await evo.rollout(task, head, phase="train")
        evo.rollouts += 1
        return await evo.propose(task, head, output, value)
    finally:
        busy[index] += time.perf_counter() - started


async def _round(
    evo: Evolution,
    picks: Sequence[tuple[int, Task]],
    busy: list[float],
    round_timeout: float | None,
) -> list[Proposal]:
    head = evo.head
    assert head is not None
    steps = [
        asyncio.create_task(_train_step(evo, task, head, busy, index)) for index, task in picks
    ]
    try:
        done, pending = await asyncio.wait(steps, timeout=round_timeout)
    finally:
        for step in steps:
            step.cancel()  # a no-op for finished ones; cuts the round's stragglers
        await asyncio.wait(steps)
    evo.stragglers += len(pending)
    proposals = []
    for step in steps:  # in worker order: deterministic
        if step in done:
            proposal = step.result()  # re-raises a rollout's error
            if proposal is not None:
                proposals.append(proposal)
    evo.report()
    return proposals


async def _drive(
    evo: Evolution, workers: int, max_rounds: int | None, round_timeout: float | None
) -> tuple[str, float, list[float]]:
    shards = shard(evo.train, workers)
    busy = [0.0] * workers
    left = evo.settings.max_rollouts
    rounds = 0
    started = time.perf_counter()
    if evo.reached_target():
        return "target", 0.0, busy
    reason = "budget"
    while left > 0:
        if max_rounds is not None and rounds >= max_rounds:
            reason = "rounds"
            break
        picks = [(i, s[rounds % len(s)]) for i, s in enumerate(shards) if s][:left]
        if not picks:
            break
        left -= len(picks)
        rounds += 1
        proposals = await _round(evo, picks, busy, round_timeout)
        if proposals:
            await evo.sweep(proposals)
        if evo.reached_target():
            reason = "target"
            break
    return reason, time.perf_counter() - started, busy


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
    engine: Engine | None = None,
    progress: Callable[[Progress], None] | None = None,
) -> EvolutionResult:
    """Evolve an artifact in synchronous rounds: all workers, then a barrier, then one merge sweep.

    Args:
        tasks: At least 4 tasks with unique ids; split into training and held-out.
        reward: ``reward(task, output) -> float`` in ``[0, 1]`` (checked).
        run: ``run(rendered, task) -> output`` (sync or async), or a tailrace
            ``Graph`` run with input ``{"rendered": ..., "task": task.to_dict()}``.
        propose: ``propose(rendered, task, output, reward) -> Edit | None``.
        artifact: The first version (an :class:`Artifact` or its entries); a
            stored head for ``artifact_id`` is resumed instead.
        store: Where the ledger lives (an in-memory store when None).
        artifact_id: The artifact's id in the ledger.
        workers: Rollouts per round; worker ``i`` owns a round-robin shard.
        max_rollouts: Budget of training rollouts (the last round may be partial).
        max_rounds: Stop after this many rounds (stop reason ``"rounds"``).
        round_timeout: Seconds a round waits before cancelling its unfinished
            rollouts (counted as stragglers); None waits for all.
        target: Stop once the head's mean held-out reward reaches this.
        held_out_frac: Fraction of tasks held out for acceptance (default 0.4).
        shuffle_seed: Shuffle tasks with this seed before splitting; None keeps their order.
        acceptance: The held-out gate (default :class:`Acceptance`).
        rank_size: How many held-out tasks rank candidates cheaply (default a quarter).
        max_candidates: Most candidates ranked per sweep.
        audit: Learns trust in the cheap ranking from every sweep (default a new one).
        engine: Runs ``run`` when it is a graph (default ``Engine()``).
        progress: Called with a :class:`Progress` after every round and sweep.

    Raises:
        ValueError: bad tasks (fewer than 4, duplicate ids), options out of range,
            or a reward outside ``[0, 1]`` (naming the task).
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if round_timeout is not None and not round_timeout > 0:
        raise ValueError(f"round_timeout must be > 0 seconds or None, got {round_timeout}")
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
        with first_error():
            reason, wall, busy = await _drive(evolution, workers, max_rounds, round_timeout)
        return evolution.result(mode="sync", stop_reason=reason, wall=wall, busy=busy)
    finally:
        evolution.close()  # abandoned sync calls (cut stragglers) never hold the caller
        if owned is not None:
            await owned.close()
