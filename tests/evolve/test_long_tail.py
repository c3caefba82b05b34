"""Long tail in the async loop: stragglers while running, re-runs from the resume queue.

Straggler timers here never sit at the 5 ms floor for ordinary rollouts: a
:class:`Scripted` estimator gives the one task meant to straggle (cost
``SLOW``) a short timer and every other rollout an hour, so a loaded machine
cannot turn an ordinary rollout into a straggler and the counts are exact.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from tailrace.evolve import Edit, RolloutContext, Task, async_evolve, current_rollout
from tailrace.stores import MemoryStore
from tailrace.tail import DurationEstimator, ResumeItem, ResumeQueue


@dataclass(frozen=True)
class Call:
    context: RolloutContext
    rendered: str


SLOW = 7.0  # the cost of the task meant to straggle


class Scripted(DurationEstimator):
    """Estimates ``quick`` seconds for a rollout of cost ``SLOW``, an hour for any other."""

    def __init__(self, quick: float) -> None:
        super().__init__(prior=3600.0)
        self.quick = quick

    def estimate(self, cost: float) -> float:
        return self.quick if cost == SLOW else 3600.0


def _tasks(n: int, slow: str | None = None) -> list[Task]:
    return [
        Task(id=f"t{i}", prompt=f"task {i}", meta={"cost": SLOW if f"t{i}" == slow else 1.0})
        for i in range(n)
    ]


async def _straggler_scenario(*, proposals: bool) -> tuple[list[Call], dict[str, int], object]:
    """t0's first training rollout hangs; worker 1 keeps proposing; t0 is cut and re-run.

    Returns the training calls, a map rendered text -> ledger version, and the result.
    """
    calls: list[Call] = []
    counter = iter(range(1, 1000))

    async def run(rendered: str, task: Task) -> str:
        ctx = current_rollout()
        assert ctx is not None
        if ctx.phase == "train":
            calls.append(Call(ctx, rendered))
            if task.id == "t0" and not ctx.resumed:
                await asyncio.Event().wait()  # straggles until the loop cuts it
        return rendered

    def reward(task: Task, output: str) -> float:
        return 0.0 if "rev: 0" in output else 1.0  # any edit beats the first version

    def propose(rendered: str, task: Task, output: str, value: float) -> Edit | None:
        return Edit(set={"rev": str(next(counter))}) if proposals else None

    store = MemoryStore()
    result = await async_evolve(
        _tasks(8, slow="t0"),
        reward,
        run=run,
        propose=propose,
        artifact={"rev": "0"},
        store=store,
        workers=2,  # shards: [t0, t2] and [t1, t3]
        held_out_frac=0.5,
        max_rollouts=6,
        # t0 is cut after 0.6 s: worker 1's proposals (sub-millisecond rollouts)
        # are committed long before, even on a loaded machine.
        duration_estimator=Scripted(quick=0.2),
        resume_queue=ResumeQueue(max_attempts=1),
    )
    versions = {
        v.artifact.render(): v.version
        for v in [await _version(store, n) for n in range(1, result.version + 1)]
    }
    return calls, versions, result


async def _version(store: MemoryStore, n: int):
    from tailrace.evolve import Artifact, Ledger

    history = await Ledger(store, "artifact", Artifact()).history()
    return history[n - 1]


def assert_resumed_call_saw_a_newer_head(calls: list[Call], versions: dict[str, int]) -> None:
    """The re-run of the straggler rendered a strictly newer head than the straggler did."""
    straggler = [c for c in calls if c.context.task_id == "t0" and not c.context.resumed]
    resumed = [c for c in calls if c.context.resumed]
    assert len(straggler) == 1 and len(resumed) == 1
    assert resumed[0].context.task_id == "t0"
    assert versions[resumed[0].rendered] > versions[straggler[0].rendered]
    assert resumed[0].context.version == versions[resumed[0].rendered]


async def test_straggler_is_rerun_against_a_newer_head():
    calls, versions, result = await _straggler_scenario(proposals=True)
    assert result.stragglers == 1
    assert result.resumed == 1
    assert result.commits >= 1
    assert_resumed_call_saw_a_newer_head(calls, versions)


async def test_negative_control_a_resume_that_sees_the_stale_head_fails_the_check():
    calls, versions, result = await _straggler_scenario(proposals=False)  # head never moves
    assert result.stragglers == 1 and result.resumed == 1 and result.commits == 0
    with pytest.raises(AssertionError):
        assert_resumed_call_saw_a_newer_head(calls, versions)


async def test_preloaded_queue_resumes_only_the_worker_shards_tasks():
    tasks = _tasks(8)
    queue = ResumeQueue(max_attempts=1)
    for task in tasks:
        for turn in range(3):
            queue.push(ResumeItem(task_id=task.id, turn=turn, version_at_checkpoint=1))
    seen: list[RolloutContext] = []

    async def run(rendered: str, task: Task) -> str:
        ctx = current_rollout()
        assert ctx is not None
        if ctx.phase == "train":
            seen.append(ctx)
        return "x"

    result = await async_evolve(
        tasks,
        lambda task, output: 1.0,
        run=run,
        propose=lambda *args: None,
        held_out_frac=0.5,
        workers=1,
        max_rollouts=10,
        resume_queue=queue,
    )
    assert result.resumed == 4
    assert queue.dropped == 16 and len(queue) == 4  # the held-out tasks' items stay queued
    assert [c.task_id for c in seen if c.resumed] == ["t0", "t1", "t2", "t3"]
    assert result.rollouts == 10


async def test_stragglers_are_counted_and_finish_without_a_queue():
    async def run(rendered: str, task: Task) -> str:
        ctx = current_rollout()
        if ctx is not None and ctx.phase == "train" and task.id == "t1":
            await asyncio.sleep(0.2)  # a slow rollout, far past its 5 ms timer
        return "x"

    result = await async_evolve(
        _tasks(8, slow="t1"),
        lambda task, output: 1.0,
        run=run,
        propose=lambda *args: None,
        held_out_frac=0.5,
        workers=2,
        max_rollouts=2,  # one rollout each: t0 and t1
        duration_estimator=Scripted(quick=0.001),  # t1's timer: the 5 ms floor
    )
    assert result.stragglers == 1
    assert result.resumed == 0
    assert result.rollouts == 2  # the straggler was not cut: it finished


async def test_queue_refusal_lets_the_straggler_finish():
    queue = ResumeQueue(max_attempts=1)
    queue.push(ResumeItem(task_id="t1", turn=0, version_at_checkpoint=1))
    queue.pop()  # t1 has used its only attempt

    async def run(rendered: str, task: Task) -> str:
        ctx = current_rollout()
        if ctx is not None and ctx.phase == "train" and task.id == "t1":
            await asyncio.sleep(0.2)  # a slow rollout, far past its 5 ms timer
        return "x"

    result = await async_evolve(
        _tasks(8, slow="t1"),
        lambda task, output: 1.0,
        run=run,
        propose=lambda *args: None,
        held_out_frac=0.5,
        workers=2,
        max_rollouts=2,  # one rollout each: t0 and t1
        duration_estimator=Scripted(quick=0.001),  # t1's timer: the 5 ms floor
        resume_queue=queue,
    )
    assert result.stragglers == 1 and result.resumed == 0
    assert queue.dropped == 1  # refused, so the straggler ran to its end
    assert result.rollouts == 2
