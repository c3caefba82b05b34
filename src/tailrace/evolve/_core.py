"""What both evolution loops share: rollouts, held-out scoring, and the merge sweep.

:class:`Evolution` owns the ledger and the head. A *merge sweep* takes the
pending proposals, applies each edit to the head, ranks the candidates on a
cheap subset of the held-out tasks, scores the best on the full held-out set
and commits it when the Beta-posterior gate accepts. The sweep is the only
place that writes the ledger, so whichever loop drives it has one writer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .._engine import Engine
from .._graph import Graph
from ..stores import MemoryStore, RunStore
from ..tail import DurationEstimator
from ..tail._hooks import MIN_STRAGGLER_DELAY
from ._accept import Acceptance, mean
from ._audit import AuditScheduler
from ._ledger import Ledger, Version
from ._model import (
    Artifact,
    Edit,
    ProposeFn,
    RewardFn,
    RolloutContext,
    RunFn,
    Task,
    call_user,
    check_edit,
    check_reward,
    set_rollout,
    split_tasks,
)
from ._result import EvolutionResult, Sweep
from ._threads import DaemonExecutor


@dataclass(frozen=True, slots=True, kw_only=True)
class Proposal:
    """An edit a worker proposed, and the head version its rollout rendered.

    Args:
        edit: The proposed change.
        base_version: The version the rollout ran against.
        task_id: The training task it came from.
        reward: The rollout's reward.
    """

    edit: Edit
    base_version: int
    task_id: str
    reward: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Progress:
    """A progress report passed to the ``progress`` callback of the loops.

    Args:
        rollouts: Training rollouts completed so far.
        max_rollouts: The rollout budget.
        version: The current head version.
        held_out: The head's mean held-out reward.
        sweeps: Merge sweeps so far.
    """

    rollouts: int
    max_rollouts: int
    version: int
    held_out: float
    sweeps: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    """Options both loops accept (see :func:`~tailrace.evolve.async_evolve` for each)."""

    max_rollouts: int
    target: float | None
    held_out_frac: float
    shuffle_seed: int | None
    rank_size: int | None
    max_candidates: int
    acceptance: Acceptance
    progress: Callable[[Progress], None] | None

    def __post_init__(self) -> None:
        if self.max_rollouts < 0:
            raise ValueError(f"max_rollouts must be >= 0, got {self.max_rollouts}")
        if self.max_candidates < 1:
            raise ValueError(f"max_candidates must be >= 1, got {self.max_candidates}")
        if self.target is not None and not 0.0 <= self.target <= 1.0:
            raise ValueError(f"target must be in [0, 1], got {self.target}")


class Evolution:
    """The shared state of one evolution: ledger, head, held-out scores, counters."""

    def __init__(
        self,
        *,
        train: list[Task],
        held_out: list[Task],
        reward: RewardFn,
        run: RunFn | Graph,
        propose: ProposeFn,
        ledger: Ledger,
        settings: Settings,
        audit: AuditScheduler,
        engine: Engine | None,
    ) -> None:
        self.train = train
        self.held_out = held_out
        self.by_id = {t.id: t for t in (*train, *held_out)}
        self.reward_fn = reward
        self.run_fn = run
        self.propose_fn = propose
        self.ledger = ledger
        self.settings = settings
        self.audit = audit
        self.engine = engine if engine is not None or not isinstance(run, Graph) else Engine()
        self.rank_size = _rank_size(settings.rank_size, len(held_out))
        self.head: Version | None = None
        self.head_rewards: list[float] | None = None
        self.initial_held_out = 0.0
        self.history: list[Sweep] = []
        self.started = time.perf_counter()
        self.rollouts = 0
        self.eval_rollouts = 0
        self.commits = 0
        self.proposals = 0
        self.stale_dropped = 0
        self.stragglers = 0
        self.resumed = 0
        self.partial: list[Mapping[str, Any]] = []
        self.executor = DaemonExecutor()

    def close(self) -> None:
        """Release the executor of user sync callables without waiting for abandoned calls."""
        self.executor.shutdown(wait=False)

    # -- rollouts -------------------------------------------------------------

    async def rollout(
        self, task: Task, head: Version, *, phase: str, resumed: bool = False
    ) -> tuple[Any, float]:
        """Run ``head`` on ``task`` and score it; returns ``(output, reward)``.

        Runs in its own task so the rollout context stays with this call.
        """
        return await asyncio.create_task(self._rollout(task, head, phase, resumed))

    async def _rollout(
        self, task: Task, head: Version, phase: str, resumed: bool
    ) -> tuple[Any, float]:
        set_rollout(
            RolloutContext(task_id=task.id, version=head.version, phase=phase, resumed=resumed)
        )
        rendered = head.rendered
        if isinstance(self.run_fn, Graph):
            assert self.engine is not None
            result = await self.engine.run(
                self.run_fn, {"rendered": rendered, "task": task.to_dict()}
            )
            if result.status != "completed":
                raise RuntimeError(
                    f"rollout graph {self.run_fn.name!r} on task {task.id!r} ended {result.status}"
                )
            output = result.output
        else:
            output = await call_user(self.run_fn, rendered, task, executor=self.executor)
        return output, await self.score(task, output, phase=phase)

    async def score(self, task: Task, output: Any, *, phase: str) -> float:
        """The checked reward of ``output`` on ``task``; counts held-out rollouts.

        Args:
            task: The task the output is for.
            output: What the rollout produced.
            phase: ``"train"`` or ``"eval"`` (counted in ``eval_rollouts``).
        """
        value = check_reward(
            task, await call_user(self.reward_fn, task, output, executor=self.executor)
        )
        if phase == "eval":
            self.eval_rollouts += 1
        return value

    async def propose(
        self, task: Task, head: Version, output: Any, value: float
    ) -> Proposal | None:
        """Ask the proposer for an edit from one training rollout."""
        edit = check_edit(
            task,
            await call_user(
                self.propose_fn, head.rendered, task, output, value, executor=self.executor
            ),
        )
        if edit is None:
            return None
        self.proposals += 1
        return Proposal(edit=edit, base_version=head.version, task_id=task.id, reward=value)

    async def evaluate(
        self, artifact: Artifact, version: int, tasks: Sequence[Task]
    ) -> list[float]:
        """Rewards of ``artifact`` on ``tasks``, all run concurrently."""
        probe = Version(version=version, artifact=artifact, meta={})
        with first_error():
            async with asyncio.TaskGroup() as tg:
                runs = [tg.create_task(self.rollout(t, probe, phase="eval")) for t in tasks]
        return [r.result()[1] for r in runs]

    # -- the head ---------------------------------------------------------------

    async def start(self) -> None:
        """Open the ledger (resuming a stored head) and score the head on the held-out set."""
        self.head = await self.ledger.open()
        self.head_rewards = await self.evaluate(
            self.head.artifact, self.head.version, self.held_out
        )
        self.initial_held_out = mean(self.head_rewards)
        self.started = time.perf_counter()

    @property
    def held_out_score(self) -> float:
        """Mean held-out reward of the head (its last known scores)."""
        return mean(self.head_rewards or [])

    def reached_target(self) -> bool:
        """Whether the head's held-out reward reached ``target``."""
        target = self.settings.target
        return (
            target is not None and self.head_rewards is not None and self.held_out_score >= target
        )

    def report(self) -> None:
        """Call the progress callback, if any."""
        if self.settings.progress is None or self.head is None:
            return
        self.settings.progress(
            Progress(
                rollouts=self.rollouts,
                max_rollouts=self.settings.max_rollouts,
                version=self.head.version,
                held_out=self.held_out_score,
                sweeps=len(self.history),
            )
        )

    # -- the merge sweep ----------------------------------------------------------

    async def sweep(self, proposals: Sequence[Proposal]) -> Sweep | None:
        """Rank ``proposals`` on the cheap subset, gate the best on the held-out set, commit it.

        Returns the sweep's record, or None when no proposal changes the head.
        """
        head = self.head
        assert head is not None
        if self.head_rewards is None:  # a rebased commit: the new head was never scored
            self.head_rewards = await self.evaluate(head.artifact, head.version, self.held_out)
        base = self.head_rewards
        edits = _distinct_edits(head, proposals)[: self.settings.max_candidates]
        if not edits:
            return None
        subset = self.held_out[: self.rank_size]
        candidates = [head.artifact.apply(edit) for edit in edits]
        with first_error():
            async with asyncio.TaskGroup() as tg:  # rank every candidate at once
                scoring = [
                    tg.create_task(self.evaluate(c, head.version, subset)) for c in candidates
                ]
        ranked = [(e, c, s.result()) for e, c, s in zip(edits, candidates, scoring, strict=True)]
        edit, candidate, cheap = max(ranked, key=lambda r: mean(r[2]))  # first best wins ties
        rest = await self.evaluate(candidate, head.version, self.held_out[self.rank_size :])
        full = cheap + rest
        verdict = self.settings.acceptance.decide(full, base, head.version)
        cheap_says = mean(cheap) > mean(base[: self.rank_size])
        agreed = cheap_says == verdict.accepted
        self.audit.record(agreed=agreed, artifact_id=self.ledger.artifact_id)
        if verdict.accepted:
            meta = {
                "probability": verdict.probability,
                "threshold": verdict.threshold,
                "held_out": verdict.candidate_mean,
                "sweep": len(self.history) + 1,
            }
            new = await self.ledger.commit(head, edit, meta)
            self.head = current = new
            self.head_rewards = full if new.meta.get("rebased_onto") is None else None
            self.commits += 1
            self.audit.submit(
                str(new.version),
                blast_radius=edit.blast_radius,
                uncertainty=1.0 - abs(2.0 * verdict.probability - 1.0),
                artifact_id=self.ledger.artifact_id,
            )
        else:
            current = head
        record = Sweep(
            index=len(self.history) + 1,
            base_version=head.version,
            candidates=len(edits),
            accepted=verdict.accepted,
            version=current.version,
            probability=verdict.probability,
            threshold=verdict.threshold,
            held_out=self.held_out_score,
            cheap_agreed=agreed,
            rollouts=self.rollouts,
            elapsed=time.perf_counter() - self.started,
        )
        self.history.append(record)
        self.report()
        return record

    # -- the result ---------------------------------------------------------------

    def result(
        self, *, mode: str, stop_reason: str, wall: float, busy: Sequence[float]
    ) -> EvolutionResult:
        """Build the :class:`EvolutionResult`."""
        head = self.head
        assert head is not None
        workers = max(1, len(busy))
        return EvolutionResult(
            mode=mode,
            artifact_id=self.ledger.artifact_id,
            version=head.version,
            entries=dict(head.artifact.entries),
            rendered=head.rendered,
            held_out=self.held_out_score,
            initial_held_out=self.initial_held_out,
            history=tuple(self.history),
            stop_reason=stop_reason,
            rollouts=self.rollouts,
            eval_rollouts=self.eval_rollouts,
            commits=self.commits,
            proposals=self.proposals,
            stale_dropped=self.stale_dropped,
            stragglers=self.stragglers,
            resumed=self.resumed,
            wall=wall,
            worker_busy=tuple(busy),
            utilisation=min(1.0, math.fsum(busy) / (workers * wall)) if wall > 0 else 0.0,
            rollouts_per_second=self.rollouts / wall if wall > 0 else 0.0,
            audit_trust=self.audit.trust(self.ledger.artifact_id),
            partial=tuple(self.partial),
        )


@contextlib.contextmanager
def first_error() -> Iterator[None]:
    """Re-raise the first error of a task group unwrapped (a user's exception stays itself, E9)."""
    try:
        yield
    except BaseExceptionGroup as group:
        first = group.exceptions[0]
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        raise first from None


def straggler_limit(estimator: DurationEstimator, factor: float, task: Task) -> float:
    """Seconds after which a rollout of ``task`` is a straggler: ``factor`` x its estimate.

    Args:
        estimator: Estimates the rollout's duration from ``task.cost``.
        factor: The multiple of the estimate.
        task: The task about to be run.
    """
    return max(MIN_STRAGGLER_DELAY, factor * estimator.estimate(task.cost))


def _rank_size(requested: int | None, n_held: int) -> int:
    if requested is None:
        return max(1, math.ceil(n_held / 4))
    if requested < 1:
        raise ValueError(f"rank_size must be >= 1, got {requested}")
    return min(requested, n_held)


def _distinct_edits(head: Version, proposals: Sequence[Proposal]) -> list[Edit]:
    """Edits that change the head, each once, in proposal order."""
    seen: set[str] = set()
    edits = []
    for p in proposals:
        key = json.dumps(p.edit.to_dict(), sort_keys=True)
        if key in seen or head.artifact.apply(p.edit).entries == head.artifact.entries:
            continue
        seen.add(key)
        edits.append(p.edit)
    return edits


async def prepare(
    tasks: Sequence[Task],
    reward: RewardFn,
    *,
    run: RunFn | Graph,
    propose: ProposeFn,
    artifact: Artifact | Mapping[str, str] | None,
    store: RunStore | None,
    artifact_id: str,
    settings: Settings,
    audit: AuditScheduler | None,
    engine: Engine | None,
) -> tuple[Evolution, RunStore | None]:
    """Validate, split, open the ledger and score the head; returns the evolution and a store to close."""
    train, held_out = split_tasks(tasks, settings.held_out_frac, settings.shuffle_seed)
    template = artifact if isinstance(artifact, Artifact) else Artifact(entries=artifact or {})
    owned: RunStore | None = None
    if store is None:
        store = owned = MemoryStore()
    await store.open()
    evolution: Evolution | None = None
    try:
        evolution = Evolution(
            train=train,
            held_out=held_out,
            reward=reward,
            run=run,
            propose=propose,
            ledger=Ledger(store, artifact_id, template),
            settings=settings,
            audit=audit if audit is not None else AuditScheduler(),
            engine=engine,
        )
        await evolution.start()
    except BaseException:
        if evolution is not None:
            evolution.close()
        if owned is not None:
            await owned.close()
        raise
    return evolution, owned
