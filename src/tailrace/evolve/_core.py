"""What both evolution loops share: rollouts with retries, held-out scoring, limits, the result.

:class:`Evolution` owns the ledger, the head (or the Pareto pool) and every
counter. User calls go through :meth:`Evolution.call`, which records
failures and retries transient ones (:mod:`._failures`); units of work that
still fail are dropped and counted in an error window. The merge sweep
(:mod:`._sweep`) is the only place that writes the ledger, so whichever loop
drives it has one writer. :meth:`Evolution.limit_reached` is where every
budget (``max_calls``, ``max_cost``, ``patience``, the error rate, the oracle)
turns into a stop reason; ``max_seconds`` is a deadline the loops enforce.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
import math
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any

from ..core import Engine
from ..executors import Executor
from ..graph import Graph
from ..stores import RunStatus
from ..tail import DurationEstimator
from ..tail._hooks import MIN_STRAGGLER_DELAY
from ._accept import mean
from ._audit import AuditScheduler
from ._failures import ErrorWindow, FailedAttempt, UnitFailed, error_name
from ._ledger import Ledger, Version
from ._model import (
    Artifact,
    ProposeFn,
    RewardFn,
    RolloutContext,
    RunFn,
    Task,
    call_user,
    check_edit,
    check_reward,
    set_rollout,
)
from ._options import Progress, Proposal, Settings
from ._pool import Member, Pool
from ._remote import RemoteCalls
from ._result import EvolutionResult, Sweep
from ._threads import DaemonExecutor
from ._usage import UsageMeter, install_meter, uninstall_meter

#: Most backup attempts a hedged held-out rollout starts.
EVAL_BACKUPS = 2


class Evolution:
    """The shared state of one evolution: ledger, head or pool, limits, counters.

    With an ``executor``, every attempt of a ``run``, ``reward`` or
    ``propose`` call is an ``executor.invoke`` (:mod:`._remote`) and a graph
    ``run`` gets ``Engine(executor=executor)`` unless ``engine`` is given;
    the ledger, the merger and the audit stay here.
    """

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
        executor: Executor | None = None,
    ) -> None:
        if executor is not None and not isinstance(executor, Executor):
            raise TypeError(
                f"executor: {executor!r} is not an executor (it needs invoke and aclose)"
            )
        self.train = train
        self.held_out = held_out
        self.by_id = {t.id: t for t in (*train, *held_out)}
        self.reward_fn = reward
        self.run_fn = run
        self.propose_fn = propose
        self.ledger = ledger
        self.settings = settings
        self.audit = audit
        if engine is None and isinstance(run, Graph):
            engine = Engine(executor=executor)
        self.engine = engine
        self.executor = executor
        self.rank_size = _rank_size(settings.rank_size, len(held_out))
        self.head: Version | None = None
        self.head_member: Member | None = None
        self.pool: Pool | None = None
        self.member_ids = itertools.count(1)
        self.initial_held_out = 0.0
        self.history: list[Sweep] = []
        self.started = time.perf_counter()
        self.deadline: float | None = None  # loop time; set by start() from max_seconds
        self.rollouts = 0
        self.eval_rollouts = 0
        self.calls = 0
        self.commits = 0
        self.proposals = 0
        self.stale_dropped = 0
        self.stragglers = 0
        self.resumed = 0
        #: Seconds after which a held-out rollout gets a backup (None: never); set by the loop.
        self.eval_limit: Callable[[Task], float] | None = None
        self.eval_hedges = 0
        self.audits_bought = 0
        self.partial: list[Mapping[str, Any]] = []
        self.reversals: list[Mapping[str, Any]] = []
        #: (parent member id, edit) pairs a sweep decided on: never judged again.
        self.judged: set[tuple[int, str]] = set()
        self.errors: list[FailedAttempt] = []
        self.window = ErrorWindow(settings.error_window, settings.max_error_rate)
        self.meter = UsageMeter(settings.prices)
        self.quality_at: tuple[float, float, int] | None = None
        self.last_score = 0.0
        self.best_held_out = 0.0
        self.flat_sweeps = 0
        self.meter_token: contextvars.Token[UsageMeter | None] | None = None
        self.stop_reason: str | None = None
        self.threads = DaemonExecutor()
        #: The user's callables by role (no ``run`` when it is a graph).
        self.functions: dict[str, Callable[..., Any]] = {"reward": reward, "propose": propose}
        if not isinstance(run, Graph):
            self.functions["run"] = run
        self.remote: RemoteCalls | None = None
        if executor is not None:
            run_id = f"evolve:{ledger.artifact_id}"
            self.remote = RemoteCalls(executor, self.functions, run_id, self.meter)

    def install(self) -> None:
        """Meter the usage of every call made from the current context on (see :meth:`close`)."""
        self.meter_token = install_meter(self.meter)

    def close(self) -> None:
        """Stop metering; release the executor of user sync callables without waiting for them."""
        if self.meter_token is not None:
            uninstall_meter(self.meter_token)
            self.meter_token = None
        self.threads.shutdown(wait=False)

    # -- user calls ---------------------------------------------------------------

    async def attempt(
        self,
        stage: str,
        phase: str,
        task: Task,
        version: int,
        call: Callable[[], Awaitable[Any]],
    ) -> Any:
        """Await ``call()`` under the retry policy; record every failed attempt.

        Args:
            stage: ``"run"``, ``"reward"`` or ``"propose"`` (recorded).
            phase: ``"train"`` or ``"eval"`` (recorded).
            task: The task the call is for.
            version: The ledger version it renders.
            call: Makes one attempt.

        Raises:
            UnitFailed: every attempt failed, or the error was not transient.
        """
        retry = self.settings.retry
        for attempt in range(1, retry.attempts + 1):
            self.calls += 1
            try:
                return await call()
            except Exception as exc:  # a user's failure: recorded, maybe retried
                again = attempt < retry.attempts and retry.transient(exc)
                failure = FailedAttempt(
                    task_id=task.id,
                    phase=phase,
                    stage=stage,
                    attempt=attempt,
                    error=error_name(exc),
                    message=str(exc),
                    version=version,
                    retried=again,
                )
                self.errors.append(failure)
                if not again:
                    raise UnitFailed(failure) from exc
                await retry.sleep(retry.delay(attempt, exc))
        raise AssertionError("unreachable")  # pragma: no cover

    def failed(
        self, stage: str, phase: str, task: Task, version: int, exc: Exception
    ) -> UnitFailed:
        """Record ``exc`` as a failed, not retried attempt; return the error that drops the unit.

        Args:
            stage: ``"run"``, ``"reward"`` or ``"propose"``.
            phase: ``"train"`` or ``"eval"``.
            task: The task.
            version: The version rendered.
            exc: What was raised.
        """
        failure = FailedAttempt(
            task_id=task.id,
            phase=phase,
            stage=stage,
            attempt=1,
            error=error_name(exc),
            message=str(exc),
            version=version,
            retried=False,
        )
        self.errors.append(failure)
        return UnitFailed(failure)

    def user(self, role: str, *args: Any) -> Callable[[], Awaitable[Any]]:
        """The attempts of one call of the user's ``role`` callable with ``args``.

        With an executor each attempt is one ``executor.invoke`` (:mod:`._remote`);
        without, the callable runs here, sync ones on the evolution's daemon threads.

        Args:
            role: ``"run"``, ``"reward"`` or ``"propose"``.
            args: The callable's positional arguments.
        """
        if self.remote is not None:
            return self.remote.call(role, args)
        fn = self.functions[role]
        return lambda: call_user(fn, *args, executor=self.threads)

    # -- rollouts -------------------------------------------------------------

    async def rollout(
        self, task: Task, head: Version, *, phase: str, resumed: bool = False
    ) -> tuple[Any, float]:
        """Run ``head`` on ``task`` and score it; returns ``(output, reward)``.

        Runs in its own task so the rollout context stays with this call.

        Raises:
            UnitFailed: the run or the reward failed on every attempt.
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
            graph = self.run_fn
            output = await self.attempt(
                "run", phase, task, head.version, lambda: self._run_graph(graph, rendered, task)
            )
        else:
            output = await self.attempt(
                "run", phase, task, head.version, self.user("run", rendered, task)
            )
        return output, await self.score(task, output, phase=phase, version=head.version)

    async def _run_graph(self, graph: Graph, rendered: str, task: Task) -> Any:
        assert self.engine is not None
        result = await self.engine.run(graph, {"rendered": rendered, "task": task.to_dict()})
        if result.status is not RunStatus.COMPLETED:
            raise RuntimeError(
                f"rollout graph {graph.name!r} on task {task.id!r} ended {result.status}"
            )
        return result.output

    async def score(self, task: Task, output: Any, *, phase: str, version: int = 0) -> float:
        """The checked reward of ``output`` on ``task``; counts held-out rollouts.

        Args:
            task: The task the output is for.
            output: What the rollout produced.
            phase: ``"train"`` or ``"eval"`` (counted in ``eval_rollouts``).
            version: The version the output came from (recorded with failures).

        Raises:
            UnitFailed: the reward failed on every attempt.
            ValueError: the reward is not a number in ``[0, 1]`` (a bug, never retried).
        """
        value = await self.attempt(
            "reward", phase, task, version, self.user("reward", task, output)
        )
        if phase == "eval":
            self.eval_rollouts += 1
        return check_reward(task, value)

    async def propose(
        self, task: Task, head: Version, output: Any, value: float, parent: Member | None = None
    ) -> Proposal | None:
        """Ask the proposer for an edit from one training rollout; None when it had none or failed."""
        call = self.user("propose", head.rendered, task, output, value)
        try:
            proposed = await self.attempt("propose", "train", task, head.version, call)
        except UnitFailed:
            self.window.add(True)
            return None
        self.window.add(False)
        edit = check_edit(task, proposed)
        if edit is None:
            return None
        self.proposals += 1
        return Proposal(
            edit=edit, base_version=head.version, task_id=task.id, reward=value, parent=parent
        )

    async def evaluate(
        self, artifact: Artifact, version: int, tasks: Sequence[Task]
    ) -> list[float]:
        """Rewards of ``artifact`` on ``tasks``, all run concurrently; a failed one scores 0."""
        probe = Version(version=version, artifact=artifact, meta={})
        with first_error():
            async with asyncio.TaskGroup() as tg:
                runs = [tg.create_task(self._eval_one(t, probe)) for t in tasks]
        return [r.result() for r in runs]

    async def _eval_one(self, task: Task, probe: Version) -> float:
        try:
            if self.eval_limit is None:
                _, value = await self.rollout(task, probe, phase="eval")
            else:
                value = await self._hedged_eval(task, probe, self.eval_limit(task))
        except UnitFailed:
            self.window.add(True)
            return 0.0  # a candidate that cannot be scored is not accepted on that task
        self.window.add(False)
        return value

    async def _hedged_eval(self, task: Task, probe: Version, limit: float) -> float:
        """A held-out rollout with backups: each ``limit`` seconds without a result starts one.

        The first attempt to succeed counts and the others are cancelled; a
        held-out score does not depend on which attempt produced it.

        Raises:
            UnitFailed: every attempt failed.
        """
        attempts = [asyncio.create_task(self.rollout(task, probe, phase="eval"))]
        failure: UnitFailed | None = None
        try:
            while attempts:
                done, _ = await asyncio.wait(
                    attempts, timeout=limit, return_when=asyncio.FIRST_COMPLETED
                )
                for attempt in done:
                    attempts.remove(attempt)
                    error = attempt.exception()
                    if error is None:
                        return float(attempt.result()[1])
                    if not isinstance(error, UnitFailed):
                        raise error  # a contract violation: a bug, not a failure
                    failure = error
                if not done and len(attempts) <= EVAL_BACKUPS:
                    self.eval_hedges += 1
                    attempts.append(asyncio.create_task(self.rollout(task, probe, phase="eval")))
            assert failure is not None
            raise failure
        finally:
            for attempt in attempts:
                attempt.cancel()
            if attempts:
                await asyncio.wait(attempts)

    # -- the head and the pool ------------------------------------------------------

    async def start(self) -> None:
        """Open the ledger (resuming a stored head) and score the head on the held-out set.

        The scoring obeys the loop's time limits (:meth:`_score_start`); when
        ``max_seconds`` cuts it, the loop stops before any rollout.
        """
        self.head = await self.ledger.open()
        rewards = await self._score_start(self.head)
        self.set_head(self.head, self.new_member(self.head.artifact, rewards, None))
        if self.settings.selection == "pareto":
            assert self.head_member is not None
            self.pool = Pool(self.head_member, self.settings.shuffle_seed or 0)
        self.initial_held_out = self.best_held_out = mean(rewards)
        self.started = time.perf_counter()
        if self.settings.max_seconds is not None:
            self.deadline = asyncio.get_running_loop().time() + self.settings.max_seconds
        self.note_quality(0.0)

    async def _score_start(self, head: Version) -> list[float]:
        """The head's held-out rewards, each rollout cut at ``max_seconds`` or ``round_timeout``.

        A cut rollout scores 0 and is recorded as a failed attempt
        (``TimeoutError``); one cut by ``round_timeout`` counts towards
        ``max_error_rate``, one cut by ``max_seconds`` does not (the loop's own
        deadline is no failure of the backend). A sync call still running on its daemon thread
        cannot be stopped, so it is abandoned (and said so in the record).
        """
        s = self.settings
        limits = [x for x in (s.max_seconds, s.round_timeout) if x is not None]
        limit = min(limits, default=None)
        runs = [asyncio.create_task(self._eval_one(t, head)) for t in self.held_out]
        try:
            done, _ = await asyncio.wait(runs, timeout=limit)
        finally:
            for run in runs:
                run.cancel()  # a no-op for finished ones; never leaves one behind
            await asyncio.wait(runs)
        rewards = []
        for task, run in zip(self.held_out, runs, strict=True):
            if run in done:
                rewards.append(run.result())  # re-raises a contract violation (a bug)
                continue
            which = "max_seconds" if limit == s.max_seconds else "round_timeout"
            message = (
                f"held-out rollout cut after {limit} s ({which}) while scoring the starting "
                "artifact; a sync call still running on its thread is abandoned"
            )
            self.failed("run", "eval", task, head.version, TimeoutError(message))
            rewards.append(0.0)
            if which == "max_seconds":
                # The loop's own deadline cut it: time ran out, the backend did not
                # fail, so the cut is no failed unit of work (no "errors" stop).
                self.stop("max_seconds")
            else:
                self.window.add(True)
        return rewards

    def set_head(self, head: Version, member: Member | None) -> None:
        """Make ``head`` the head, scored as ``member`` (None: not measured yet)."""
        self.head = head
        self.head_member = member  # None after a rebased commit: measured before the next sweep
        if member is not None:
            self.last_score = member.mean

    def new_member(
        self, artifact: Artifact, rewards: Sequence[float], parent: Member | None
    ) -> Member:
        """A pool member for a scored candidate."""
        return Member(
            id=next(self.member_ids),
            artifact=artifact,
            rewards=tuple(rewards),
            parent=None if parent is None else parent.id,
        )

    async def measured_head(self) -> Member:
        """The head as a member, scoring it first when a rebased commit left it unmeasured."""
        if self.head_member is None:
            head = self.head
            assert head is not None
            rewards = await self.evaluate(head.artifact, head.version, self.held_out)
            self.set_head(head, self.new_member(head.artifact, rewards, None))
        assert self.head_member is not None
        return self.head_member

    def parent_for_rollout(self) -> tuple[Version, Member | None]:
        """What the next training rollout renders: the head, or a parent sampled from the pool."""
        head = self.head
        assert head is not None
        if self.pool is None:
            return head, self.head_member
        parent = self.pool.sample()
        return Version(version=head.version, artifact=parent.artifact, meta={}), parent

    @property
    def held_out_score(self) -> float:
        """Mean held-out reward of the head (its last measured scores)."""
        return self.head_member.mean if self.head_member is not None else self.last_score

    def reached_target(self) -> bool:
        """Whether the head's held-out reward reached ``target``."""
        target = self.settings.target
        return target is not None and self.head_member is not None and self.held_out_score >= target

    def note_quality(self, elapsed: float) -> None:
        """Remember when, at what cost and after how many rollouts the quality bar was first met.

        Args:
            elapsed: Seconds since the rollout phase started (a sweep's ``elapsed``).
        """
        bar = self.settings.quality_bar
        if bar is None or self.quality_at is not None or self.head_member is None:
            return
        if self.held_out_score >= bar:
            self.quality_at = (elapsed, self.meter.cost, self.rollouts)

    def note_sweep(self, elapsed: float) -> None:
        """Count sweeps without a held-out improvement (``patience``); note the quality bar.

        Args:
            elapsed: The sweep's ``elapsed``.
        """
        score = self.held_out_score
        if score > self.best_held_out + 1e-12:
            self.best_held_out = score
            self.flat_sweeps = 0
        else:
            self.flat_sweeps += 1
        self.note_quality(elapsed)

    # -- limits ---------------------------------------------------------------------

    def limit_reached(self) -> str | None:
        """The stop reason of the first budget exhausted, or None (sticky once set)."""
        if self.stop_reason is not None:
            return self.stop_reason
        s = self.settings
        reason = None
        if self.window.exceeded():
            reason = "errors"
        elif s.max_calls is not None and self.calls >= s.max_calls:
            reason = "max_calls"
        elif s.max_cost is not None and self.meter.cost >= s.max_cost:
            reason = "max_cost"
        elif s.patience is not None and self.flat_sweeps >= s.patience:
            reason = "patience"
        elif self.deadline is not None and asyncio.get_running_loop().time() >= self.deadline:
            reason = "max_seconds"
        self.stop_reason = reason
        return reason

    def stop(self, reason: str) -> None:
        """Stop for ``reason`` unless a stop reason is already set."""
        if self.stop_reason is None:
            self.stop_reason = reason

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
                calls=self.calls,
                cost=self.meter.cost,
                errors=len(self.errors),
            )
        )

    def backend_failure(self) -> str | None:
        """Why the backend failed when units of work failed and not one succeeded, else None."""
        window = self.window
        if window.ok_units or not window.failed_units or not self.errors:
            return None
        last = self.errors[-1]
        return (
            f"the backend failed: all {window.failed_units} units of work failed; the last, "
            f"the {last.stage} of task {last.task_id!r} ({last.phase}), raised "
            f"{last.error}: {last.message}"
        )

    # -- the result -----------------------------------------------------------------

    def result(
        self,
        *,
        mode: str,
        stop_reason: str,
        wall: float,
        busy: Sequence[float],
        used: Sequence[float],
    ) -> EvolutionResult:
        """Build the :class:`EvolutionResult`."""
        head = self.head
        assert head is not None
        workers = max(1, len(busy))
        quality = self.quality_at
        failure = self.backend_failure()
        return EvolutionResult(
            failure=failure,
            mode=mode,
            artifact_id=self.ledger.artifact_id,
            version=head.version,
            entries=dict(head.artifact.entries),
            rendered=head.rendered,
            held_out=self.held_out_score,
            initial_held_out=self.initial_held_out,
            history=tuple(self.history),
            stop_reason="errors" if failure else self.stop_reason or stop_reason,
            rollouts=self.rollouts,
            eval_rollouts=self.eval_rollouts,
            commits=self.commits,
            proposals=self.proposals,
            stale_dropped=self.stale_dropped,
            stragglers=self.stragglers,
            resumed=self.resumed,
            eval_hedges=self.eval_hedges,
            wall=wall,
            worker_busy=tuple(busy),
            worker_used=tuple(used),
            utilisation=min(1.0, math.fsum(used) / (workers * wall)) if wall > 0 else 0.0,
            rollouts_per_second=self.rollouts / wall if wall > 0 else 0.0,
            audit_trust=self.audit.trust(self.ledger.artifact_id),
            trust=self.audit.trust_by_artifact(),
            audits=self.audits_bought,
            oracle_refused=self.audit.oracle_refused,
            reversals=tuple(self.reversals),
            partial=tuple(self.partial),
            errors=tuple(self.errors),
            failed_units=self.window.failed_units,
            calls=self.calls,
            usage=self.meter.snapshot(),
            cost=self.meter.cost,
            quality=self.settings.quality_bar,
            time_to_quality=None if quality is None else quality[0],
            cost_to_quality=None if quality is None else quality[1],
            rollouts_to_quality=None if quality is None else quality[2],
            selection=self.settings.selection,
            pool=tuple(
                {
                    "id": m.id,
                    "parent": m.parent,
                    "held_out": m.mean,
                    "entries": dict(m.artifact.entries),
                }
                for m in (self.pool.front if self.pool is not None else [])
            ),
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
