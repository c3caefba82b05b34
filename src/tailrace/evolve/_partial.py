"""Partial rollouts: a straggling graph rollout stops at a turn boundary and resumes on a newer head.

When ``run`` is a tailrace :class:`~tailrace.Graph` whose turns are loop
visits, :func:`~tailrace.evolve.async_evolve` with a ``duration_estimator`` and
a ``resume_queue`` runs every training rollout as a durable run. A rollout
that crosses its straggler timer is not cancelled: ``Engine.preempt`` stops it
at its next turn boundary (the turn in flight finishes, the edge back into the
loop is parked), the run is stored suspended, and a
:class:`~tailrace.tail.ResumeItem` naming it (``external_handle`` is the run
id) is queued. The next idle worker whose shard owns the task resumes that run
with ``patch={"rendered": <the current head, rendered>}``: the turns already
taken, and the conversation they built, are kept; the turns still to come read
the newer head. Every such resume is recorded as a cross-version pair in
``EvolutionResult.partial``.

The graph's side of the contract: its input is ``{"rendered": ..., "task":
task.to_dict()}``, and each turn reads ``rendered`` from the payload that goes
around the loop (so every turn's output carries it forward), never from the
first input or a closure. A loop payload may keep the turns so far in a
``"conversation"`` list, which the queued item then carries. Payloads must be
encodable by the engine's codec (JSON by default), since the run is durable.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from .._codec import DEFAULT_CODEC
from .._errors import RunNotFound
from ..core import Engine, RunResult
from ..executors import Executor
from ..graph import Graph
from ..stores import RunStatus, RunStore
from ..tail import DurationEstimator, ResumeItem, ResumeQueue
from ._core import Evolution, straggler_limit
from ._ledger import Version
from ._model import RolloutContext, Task, set_rollout

T = TypeVar("T")


def durable_engine(
    engine: Engine | None, store: RunStore, executor: Executor | None = None
) -> Engine:
    """The engine partial rollouts run on: ``engine`` if it has a store, else one on ``store``.

    A preempted run must be stored to be resumed, so an engine without a store
    (the default for graph rollouts) is replaced, for training rollouts, by an
    ``Engine(store=store, executor=executor)`` on the evolution's own store.

    Args:
        engine: The engine the caller passed to the loop, if any.
        store: The evolution's (opened) store, where the ledger lives.
        executor: The loop's ``executor``, which the graph's nodes run on.
    """
    if engine is not None and engine.store is not None:
        return engine
    return Engine(store=store, executor=executor)


class PartialRollouts:
    """Training rollouts of a loop graph that a straggler timer preempts and a worker resumes.

    Args:
        evolution: The shared evolution state (head, counters, rewards, ``partial``).
        graph: The rollout graph; its turns are visits of a loop.
        engine: Runs the rollouts; it must have a store (see :func:`durable_engine`).
        queue: Where preempted rollouts wait for a worker owning their task.
        estimator: Gives each rollout its straggler timer, and learns from whole rollouts.
        factor: The timer is ``factor`` times the estimate.
    """

    def __init__(
        self,
        evolution: Evolution,
        graph: Graph,
        engine: Engine,
        queue: ResumeQueue,
        estimator: DurationEstimator,
        factor: float,
    ) -> None:
        if engine.store is None:
            raise ValueError("partial rollouts need an engine with a store to resume from")
        self.evo = evolution
        self.graph = graph
        self.engine = engine
        self.store: RunStore = engine.store
        self.queue = queue
        self.estimator = estimator
        self.factor = factor
        topo = graph.compile()
        self._loop_nodes = [topo.ids[i] for i, cyclic in enumerate(topo.cyclic) if cyclic]

    async def attempt(
        self, task: Task, head: Version, item: ResumeItem | None
    ) -> tuple[Any, float] | None:
        """Run ``task`` against ``head``, or resume the run ``item`` names; None when preempted.

        A rollout that straggles is preempted and queued; when the queue
        refuses it (``max_attempts`` reached) it is resumed here at once, on
        the version it started with, and so runs to its end.

        Args:
            task: The training task.
            head: The head to render (for a resume: the value patched into the
                parked turn boundaries).
            item: The queue item this rollout re-runs, if any; when it names a
                suspended run (``external_handle``), that run is resumed.

        Returns:
            ``(output, reward)``, or None when the rollout was preempted and queued.
        """
        handle = await self._suspended_run(item)
        resumed = item is not None
        if handle is not None:
            run_id = handle
            drive = self._resume(run_id, {"rendered": head.rendered})
        else:
            run_id = f"rollout-{task.id}-{uuid.uuid4().hex[:12]}"
            drive = self._start(run_id, {"rendered": head.rendered, "task": task.to_dict()})
        started = time.perf_counter()
        result = await self._timed(task, run_id, _in_rollout(task, head, resumed, drive))
        queued = result.preempted and await self._enqueue(task, head, run_id, result)
        if result.preempted and not queued:  # refused: finish here, on the version it rendered
            result = await _in_rollout(task, head, resumed, self._resume(run_id, None))()
        if handle is not None and item is not None:
            self._record_pair(task, item, head, run_id, result)
        if queued:
            return None
        if handle is None:  # a resumed run's duration is a remainder, not a whole rollout
            self.estimator.observe(task.cost, time.perf_counter() - started)
        output = self._output(task, result)
        value = await _in_rollout(
            task, head, resumed, lambda: self.evo.score(task, output, phase="train")
        )()
        return output, value

    # -- running ------------------------------------------------------------------

    def _start(self, run_id: str, rollout_input: Any) -> Callable[[], Awaitable[RunResult]]:
        return lambda: self.engine.run(self.graph, rollout_input, run_id=run_id)

    def _resume(self, run_id: str, patch: Any) -> Callable[[], Awaitable[RunResult]]:
        return lambda: self.engine.resume(run_id, self.graph, patch=patch)

    async def _timed(
        self, task: Task, run_id: str, drive: Callable[[], Awaitable[RunResult]]
    ) -> RunResult:
        """Drive the run; past the straggler timer, preempt it and wait for its turn boundary."""
        limit = straggler_limit(self.estimator, self.factor, task)
        running = asyncio.ensure_future(drive())
        try:
            done, _ = await asyncio.wait({running}, timeout=limit)
            if not done:
                self.evo.stragglers += 1
                # False: the engine does not drive the run (not yet, or not any
                # more); it then runs to its end, like a straggler the queue refused.
                self.engine.preempt(run_id)
            return await running
        finally:
            if not running.done():  # we were cancelled: never leave the run behind
                running.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await running

    async def _suspended_run(self, item: ResumeItem | None) -> str | None:
        """The run id ``item`` names if that run is stored suspended, else None (run afresh)."""
        if item is None or item.external_handle is None:
            return None
        try:
            record = await self.store.get_run(item.external_handle)
        except RunNotFound:
            return None
        return item.external_handle if record.status == RunStatus.SUSPENDED else None

    def _output(self, task: Task, result: RunResult) -> Any:
        if result.status is not RunStatus.COMPLETED:
            raise RuntimeError(
                f"rollout graph {self.graph.name!r} on task {task.id!r} ended {result.status}"
            )
        return result.output

    # -- bookkeeping ----------------------------------------------------------------

    def turns(self, result: RunResult) -> int:
        """Turns taken so far: visits of the most visited loop node (0 for a graph without loops).

        Args:
            result: A result of the rollout graph.
        """
        return max((result.visits.get(node, 0) for node in self._loop_nodes), default=0)

    async def _enqueue(self, task: Task, head: Version, run_id: str, result: RunResult) -> bool:
        item = ResumeItem(
            task_id=task.id,
            turn=self.turns(result),
            version_at_checkpoint=head.version,
            conversation=await self._parked_conversation(run_id),
            external_handle=run_id,
        )
        return self.queue.push(item)

    async def _parked_conversation(self, run_id: str) -> tuple[Any, ...]:
        """The ``"conversation"`` of the first parked payload that has one, else ``()``.

        The engine keeps parked deliveries only in the run's stored state, so
        this reads them there (``state_json["parked"]``: source, target, value,
        frontier); anything unexpected yields ``()``.
        """
        record = await self.store.get_run(run_id)
        try:
            state = (self.engine.codec or DEFAULT_CODEC).decode(record.state_json)
        except ValueError:
            return ()
        parked = state.get("parked") if isinstance(state, dict) else None
        for entry in parked if isinstance(parked, list) else []:
            value = entry[2] if isinstance(entry, list) and len(entry) > 2 else None
            conversation = value.get("conversation") if isinstance(value, dict) else None
            if isinstance(conversation, list | tuple):
                return tuple(conversation)
        return ()

    def _record_pair(
        self, task: Task, item: ResumeItem, head: Version, run_id: str, result: RunResult
    ) -> None:
        """Record one resume: the version the first turns rendered and the one the rest did."""
        self.evo.partial.append(
            {
                "task_id": task.id,
                "run_id": run_id,
                "from_version": item.version_at_checkpoint,
                "to_version": head.version,
                "turns_before": item.turn,
                "turns_after": self.turns(result),
                "status": "preempted" if result.preempted else result.status,
            }
        )


def _in_rollout(
    task: Task, head: Version, resumed: bool, call: Callable[[], Awaitable[T]]
) -> Callable[[], Awaitable[T]]:
    """``call`` in a task of its own whose rollout context the graph's nodes and the reward see."""

    async def with_context() -> T:
        set_rollout(
            RolloutContext(task_id=task.id, version=head.version, phase="train", resumed=resumed)
        )
        return await call()

    return lambda: asyncio.create_task(with_context())
