"""Pareto selection (a pool of candidates each best on some held-out task) and detached stragglers."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from tailrace.evolve import (
    DemoDomain,
    Edit,
    Task,
    async_evolve,
    current_rollout,
    evolve,
)
from tailrace.tail import DurationEstimator, ResumeQueue

LOOPS = [evolve, async_evolve]
HANG_GUARD = 30.0  # only turns a deadlock into a failure


def _tradeoff_tasks() -> list[Task]:
    train = [Task(id=f"r{i}", prompt="") for i in range(4)]
    return [*train, *(Task(id=f"h{i}", prompt="") for i in range(4))]


def _tradeoff_reward(task: Task, output: str) -> float:
    """``mode: a`` solves h0 and h1, ``mode: b`` solves h2 and h3: no artifact solves all."""
    solved = {"mode: a": {"h0", "h1"}, "mode: b": {"h2", "h3"}}.get(output, set())
    return 1.0 if task.id in solved else 0.0


async def _tradeoff(loop, selection: str, seen: list[str]):
    modes = itertools.cycle(["a", "b"])

    def run(rendered: str, task: Task) -> str:
        context = current_rollout()
        if context is not None and context.phase == "train":
            seen.append(rendered)
        return rendered

    def propose(rendered, task, output, value):
        return Edit(set={"mode": next(modes)})

    return await loop(
        _tradeoff_tasks(),
        _tradeoff_reward,
        run=run,
        propose=propose,
        held_out_frac=0.5,
        workers=1,
        max_candidates=1,
        max_rollouts=12,
        selection=selection,
        shuffle_seed=None,
    )


@pytest.mark.parametrize("loop", LOOPS)
async def test_pareto_keeps_candidates_that_are_best_on_different_tasks(loop):
    seen: list[str] = []
    head = await _tradeoff(loop, "head", seen)
    assert head.selection == "head" and head.pool == ()
    assert head.entries == {"mode": "a"} and head.held_out == 0.5  # b never beats a on the mean
    assert set(seen) <= {"", "mode: a"}  # every rollout rendered the head

    seen.clear()
    pareto = await _tradeoff(loop, "pareto", seen)
    assert pareto.selection == "pareto"
    assert sorted(m["entries"]["mode"] for m in pareto.pool) == ["a", "b"]
    assert all(m["held_out"] == 0.5 for m in pareto.pool)
    assert pareto.entries == {"mode": "a"}  # the head moves only when the gate says it beats it
    assert "mode: b" in seen  # parents are sampled from the pool, not only the head
    assert any(s.admitted for s in pareto.history)


async def test_pareto_on_the_demo_domain_learns_and_keeps_a_front():
    demo = DemoDomain(n_tasks=30, seed=2, latency=0.0)
    result = await async_evolve(
        demo.tasks,
        demo.reward,
        run=demo.run,
        propose=demo.propose,
        artifact=demo.initial,
        max_rollouts=80,
        selection="pareto",
        shuffle_seed=1,
    )
    assert result.held_out > result.initial_held_out
    assert result.pool and len({m["id"] for m in result.pool}) == len(result.pool)


class Scripted(DurationEstimator):
    """A 5 ms timer (the floor) for cost-7 rollouts, an hour for any other."""

    def __init__(self) -> None:
        super().__init__(prior=3600.0)

    def estimate(self, cost: float) -> float:
        return 0.001 if cost == 7.0 else 3600.0


async def test_a_detached_straggler_runs_on_while_its_worker_takes_the_next_task():
    release = asyncio.Event()
    tasks = [Task(id=f"t{i}", prompt="", meta={"cost": 7.0 if i == 0 else 1.0}) for i in range(8)]
    order: list[str] = []

    async def run(rendered: str, task: Task) -> str:
        context = current_rollout()
        if context is None or context.phase != "train":
            return "x"
        order.append(f"start {task.id}")
        if task.id == "t0":
            await release.wait()  # set by the worker's next rollout: needs detaching
        else:
            release.set()
        order.append(f"end {task.id}")
        return "x"

    async with asyncio.timeout(HANG_GUARD):
        result = await async_evolve(
            tasks,
            lambda t, o: 1.0,
            run=run,
            propose=lambda *a: None,
            held_out_frac=0.5,
            workers=1,
            max_rollouts=2,
            duration_estimator=Scripted(),
            detach_stragglers=1,
            resume_queue=ResumeQueue(max_attempts=1),  # detaching is preferred to cutting
        )
    # t1 ran while t0 was still running; t0 then finished (its own attempt, or the
    # backup the idle worker starts once the budget is spent, whichever came first).
    assert order[:3] == ["start t0", "start t1", "end t1"] and "end t0" in order
    assert result.stragglers == 1 and result.resumed == 0 and result.rollouts == 2
    assert result.worker_used[0] > 0


async def test_once_the_budget_is_spent_idle_workers_back_up_detached_stragglers():
    tasks = [Task(id=f"t{i}", prompt="", meta={"cost": 7.0 if i == 0 else 1.0}) for i in range(8)]
    first_t0 = True

    async def run(rendered: str, task: Task) -> str:
        nonlocal first_t0
        context = current_rollout()
        if context is not None and context.phase == "train" and task.id == "t0" and first_t0:
            first_t0 = False
            await asyncio.Event().wait()  # the original never finishes: only a backup can
        return "x"

    async with asyncio.timeout(HANG_GUARD):
        result = await async_evolve(
            tasks,
            lambda t, o: 1.0,
            run=run,
            propose=lambda *a: None,
            held_out_frac=0.5,
            workers=2,
            max_rollouts=3,
            duration_estimator=Scripted(),
            detach_stragglers=1,
        )
    assert result.stragglers == 1 and result.rollouts == 3


async def test_utilisation_counts_only_attempts_whose_result_was_used():
    tasks = [Task(id=f"t{i}", prompt="") for i in range(8)]

    async def run(rendered: str, task: Task) -> str:
        context = current_rollout()
        if context is not None and context.phase == "train" and task.id == "t0":
            await asyncio.Event().wait()  # cut by the round timeout every time
        return "x"

    result = await evolve(
        tasks,
        lambda t, o: 1.0,
        run=run,
        propose=lambda *a: None,
        held_out_frac=0.5,
        workers=2,
        max_rollouts=4,
        round_timeout=0.05,
    )
    # Rounds (t0, t1) and (t2, t3): t0 is cut once.
    assert result.stragglers == 1 and result.rollouts == 3
    # Worker 0's cut attempt is busy time but not used time; worker 1's is all used.
    assert result.worker_used[0] < result.worker_busy[0]
    assert result.worker_used[1] == result.worker_busy[1]


async def test_detach_stragglers_is_validated():
    demo = DemoDomain(n_tasks=8, latency=0.0)
    with pytest.raises(ValueError, match="detach_stragglers"):
        await async_evolve(
            demo.tasks, demo.reward, run=demo.run, propose=demo.propose, detach_stragglers=-1
        )


async def test_the_merger_hedges_held_out_rollouts_that_straggle():
    tasks = [Task(id=f"t{i}", prompt="") for i in range(8)]
    hung: set[str] = set()

    async def run(rendered: str, task: Task) -> str:
        context = current_rollout()
        candidate = context is not None and context.phase == "eval" and "k: " in rendered
        if candidate and task.id not in hung:  # the first attempt on each task hangs
            hung.add(task.id)
            await asyncio.Event().wait()
        return rendered

    async with asyncio.timeout(HANG_GUARD):
        result = await async_evolve(
            tasks,
            lambda t, o: 1.0 if "k: " in o else 0.0,
            run=run,
            propose=lambda *a: Edit(set={"k": "v"}),
            held_out_frac=0.5,
            workers=1,
            max_rollouts=1,
            duration_estimator=DurationEstimator(prior=0.001),  # a 5 ms limit
        )
    assert hung == {"t4", "t5", "t6", "t7"}
    assert result.eval_hedges >= 4  # every hung attempt got a backup, which finished
    assert result.commits == 1 and result.held_out == 1.0
