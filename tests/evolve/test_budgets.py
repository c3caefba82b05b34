"""Budgets end a loop cleanly with a stop_reason; usage and cost; time and cost to quality."""

from __future__ import annotations

import asyncio

import pytest

from tailrace.evolve import (
    DemoDomain,
    Edit,
    Price,
    Task,
    Usage,
    async_evolve,
    current_rollout,
    evolve,
    record_usage,
)
from tailrace.evolve._demo import DEMO_MODEL, DEMO_PRICES

LOOPS = [evolve, async_evolve]


def _demo(**kwargs) -> DemoDomain:
    return DemoDomain(n_tasks=30, seed=2, latency=0.0, **kwargs)


def _common(demo: DemoDomain) -> dict:
    return dict(run=demo.run, propose=demo.propose, artifact=demo.initial)


@pytest.mark.parametrize("loop", LOOPS)
async def test_max_calls_stops_the_loop(loop):
    demo = _demo()
    result = await loop(
        demo.tasks, demo.reward, max_rollouts=10_000, max_calls=150, **_common(demo)
    )
    assert result.stop_reason == "max_calls"
    assert result.calls >= 150
    assert result.rollouts < 10_000


@pytest.mark.parametrize("loop", LOOPS)
async def test_max_cost_stops_the_loop_and_usage_is_priced(loop):
    demo = _demo()
    result = await loop(
        demo.tasks,
        demo.reward,
        max_rollouts=10_000,
        prices=DEMO_PRICES,
        max_cost=0.0005,
        **_common(demo),
    )
    assert result.stop_reason == "max_cost"
    assert result.cost >= 0.0005
    [usage] = result.usage
    assert isinstance(usage, Usage) and usage.model == DEMO_MODEL
    assert usage.calls == demo.runs  # one usage report per rollout, held-out ones included
    assert usage.completion_tokens == demo.runs
    price = DEMO_PRICES[DEMO_MODEL]
    assert usage.cost == pytest.approx(price.cost(usage.prompt_tokens, usage.completion_tokens))
    assert result.cost == pytest.approx(usage.cost)


@pytest.mark.parametrize("loop", LOOPS)
async def test_patience_stops_after_sweeps_without_improvement(loop):
    tasks = [Task(id=f"t{i}", prompt="") for i in range(8)]
    counter = iter(range(10_000))

    def propose(rendered, task, output, value):
        return Edit(set={"noise": str(next(counter))})  # changes the text, never the reward

    result = await loop(
        tasks,
        lambda t, o: 0.0,
        run=lambda r, t: r,
        propose=propose,
        max_rollouts=10_000,
        patience=3,
    )
    assert result.stop_reason == "patience"
    assert len(result.history) == 3
    assert all(s.held_out == 0.0 for s in result.history)


@pytest.mark.parametrize("loop", LOOPS)
async def test_max_seconds_cuts_rollouts_in_flight(loop):
    tasks = [Task(id=f"t{i}", prompt="") for i in range(8)]
    started = asyncio.Event()

    async def run(rendered, task):
        context = current_rollout()
        if context is not None and context.phase == "train":
            started.set()
            await asyncio.Event().wait()  # never finishes: only the deadline ends the loop
        return rendered

    result = await loop(
        tasks,
        lambda t, o: 1.0,
        run=run,
        propose=lambda *a: None,
        max_rollouts=100,
        max_seconds=0.2,
    )
    assert started.is_set()
    assert result.stop_reason == "max_seconds"
    assert result.rollouts == 0


@pytest.mark.parametrize("loop", LOOPS)
async def test_quality_reports_time_cost_and_rollouts_to_reach_it(loop):
    demo = _demo(noise=0.0)
    result = await loop(
        demo.tasks,
        demo.reward,
        max_rollouts=400,
        quality=0.5,
        prices=DEMO_PRICES,
        **_common(demo),
    )
    assert result.stop_reason == "budget"  # quality is reported, it does not stop the loop
    first = next(s for s in result.history if s.held_out >= 0.5)
    assert result.quality == 0.5
    assert result.rollouts_to_quality == first.rollouts
    assert result.time_to_quality == first.elapsed
    assert 0 < result.cost_to_quality <= result.cost  # type: ignore[operator]


@pytest.mark.parametrize("loop", LOOPS)
async def test_quality_never_reached_is_none_and_defaults_to_target(loop):
    tasks = [Task(id=f"t{i}", prompt="") for i in range(8)]
    result = await loop(
        tasks,
        lambda t, o: 0.0,
        run=lambda r, t: r,
        propose=lambda *a: None,
        max_rollouts=4,
        target=0.9,
    )
    assert result.quality == 0.9 and result.stop_reason == "budget"
    assert result.time_to_quality is None and result.cost_to_quality is None


async def test_record_usage_outside_an_evolution_counts_nothing_and_validates():
    assert record_usage(model="m", prompt_tokens=1, completion_tokens=2) is False
    with pytest.raises(ValueError, match="prompt_tokens"):
        record_usage(model="m", prompt_tokens=-1, completion_tokens=0)
    with pytest.raises(ValueError):
        Price(prompt=-1.0, completion=0.0)


async def test_usage_is_counted_per_evolution_from_sync_callables_too():
    tasks = [Task(id=f"t{i}", prompt="") for i in range(8)]

    def run(rendered, task):  # runs on a thread: the meter still finds its evolution
        record_usage(model="a", prompt_tokens=10, completion_tokens=1)
        return rendered

    async def both():
        return await asyncio.gather(
            evolve(tasks, lambda t, o: 1.0, run=run, propose=lambda *a: None, max_rollouts=4),
            evolve(tasks, lambda t, o: 1.0, run=run, propose=lambda *a: None, max_rollouts=8),
        )

    small, large = await both()
    held = 3  # 40% of 8 tasks, each scored once at the start
    assert small.usage == (Usage(model="a", calls=4 + held, prompt_tokens=70, completion_tokens=7),)
    assert large.usage[0].calls == 8 + held
    assert small.cost == 0.0 and small.usage[0].cost is None  # no price for "a"


@pytest.mark.parametrize("loop", LOOPS)
async def test_budget_options_are_validated(loop):
    demo = _demo()
    for kwargs in (
        {"max_seconds": 0},
        {"max_calls": 0},
        {"max_cost": -1.0},
        {"patience": 0},
        {"quality": 1.5},
        {"selection": "best"},
    ):
        with pytest.raises(ValueError):
            await loop(demo.tasks, demo.reward, **_common(demo), **kwargs)
