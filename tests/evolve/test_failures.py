"""Failures do not stop evolution: recorded, retried when transient, stopped only past the error rate."""

from __future__ import annotations

import random
import threading

import pytest

from tailrace.evolve import (
    DemoDomain,
    EvolutionResult,
    FailedAttempt,
    Retry,
    Task,
    async_evolve,
    current_rollout,
    evolve,
)

LOOPS = [evolve, async_evolve]


class Flaky:
    """Wraps the demo's run: raises ``error`` on a seeded 20% of calls (thread-safe)."""

    def __init__(self, demo: DemoDomain, error: type[Exception], seed: int = 3) -> None:
        self.demo = demo
        self.error = error
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.failures = 0

    async def __call__(self, rendered: str, task: Task) -> str:
        with self.lock:
            fail = self.rng.random() < 0.2
            self.failures += int(fail)
        if fail:
            raise self.error(f"flaky backend on {task.id}")
        return await self.demo.run(rendered, task)


def _demo() -> DemoDomain:
    return DemoDomain(n_tasks=30, seed=2, latency=0.0, noise=0.0)


@pytest.mark.parametrize("loop", LOOPS)
async def test_transient_failures_on_a_fifth_of_calls_are_retried_and_evolution_goes_on(loop):
    demo = _demo()
    run = Flaky(demo, ConnectionError)
    result: EvolutionResult = await loop(
        demo.tasks,
        demo.reward,
        run=run,
        propose=demo.propose,
        artifact=demo.initial,
        max_rollouts=80,
        retry=Retry(attempts=4, backoff=0.0),
    )
    assert run.failures > 10
    assert len(result.errors) == run.failures  # every failed attempt is recorded
    first = result.errors[0]
    assert isinstance(first, FailedAttempt)
    assert first.stage == "run" and first.error == "ConnectionError"
    assert first.message.startswith("flaky backend on ") and first.task_id in first.message
    assert {e.attempt for e in result.errors} >= {1, 2}
    assert any(e.retried for e in result.errors)
    assert result.stop_reason == "budget"
    assert result.held_out > result.initial_held_out
    # Nearly every failure was absorbed by a retry; a unit fails only after 4 in a row.
    assert result.failed_units <= 2


@pytest.mark.parametrize("loop", LOOPS)
async def test_failures_that_are_not_transient_are_dropped_without_retry(loop):
    demo = _demo()
    run = Flaky(demo, KeyError)
    result = await loop(
        demo.tasks,
        demo.reward,
        run=run,
        propose=demo.propose,
        artifact=demo.initial,
        max_rollouts=60,
    )
    assert run.failures > 5 and len(result.errors) == run.failures
    assert all(not e.retried and e.attempt == 1 for e in result.errors)
    assert result.failed_units == run.failures
    assert result.stop_reason == "budget"
    assert result.held_out > result.initial_held_out


@pytest.mark.parametrize("loop", LOOPS)
async def test_a_run_that_always_fails_stops_past_the_error_rate_with_its_errors(loop):
    tasks = [Task(id=f"t{i}", prompt="") for i in range(8)]

    def run(rendered: str, task: Task) -> str:
        raise RuntimeError(f"model unavailable for {task.id}")

    result = await loop(
        tasks,
        lambda t, o: 1.0,
        run=run,
        propose=lambda *a: None,
        max_rollouts=1000,
        error_window=10,
        max_error_rate=0.5,
        retry=Retry(attempts=2, backoff=0.0),
    )
    assert result.stop_reason == "errors"
    assert result.rollouts == 0 and result.errors
    assert all(
        e.error == "RuntimeError" and "model unavailable" in e.message for e in result.errors
    )
    assert result.failed_units >= 10


@pytest.mark.parametrize("loop", LOOPS)
async def test_reward_and_propose_failures_are_recorded_with_their_stage(loop):
    demo = _demo()
    calls = {"reward": 0, "propose": 0}

    async def reward(task, output):
        calls["reward"] += 1
        if calls["reward"] % 7 == 0:
            raise TimeoutError("judge timed out")
        return await demo.reward(task, output)

    async def propose(rendered, task, output, value):
        calls["propose"] += 1
        if calls["propose"] % 5 == 0:
            raise ValueError("proposer returned garbage")
        return await demo.propose(rendered, task, output, value)

    result = await loop(
        demo.tasks,
        reward,
        run=demo.run,
        propose=propose,
        artifact=demo.initial,
        max_rollouts=40,
        retry=Retry(backoff=0.0),
    )
    stages = {(e.stage, e.error) for e in result.errors}
    assert ("reward", "TimeoutError") in stages and ("propose", "ValueError") in stages
    assert all(e.retried for e in result.errors if e.stage == "reward")  # timeouts: transient
    assert not any(e.retried for e in result.errors if e.stage == "propose")
    assert result.stop_reason == "budget"


async def test_retry_waits_the_backoff_or_what_the_error_asks_for():
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)

    class Throttled(Exception):
        retryable = True

        def __init__(self, retry_after: float | None) -> None:
            super().__init__("throttled")
            self.retry_after = retry_after

    answers = iter([Throttled(7.0), Throttled(None), "ok"])

    def run(rendered: str, task: Task) -> str:
        context = current_rollout()
        assert context is not None  # a sync run sees its rollout context in its thread
        if context.phase != "train":
            return "ok"
        answer = next(answers, "ok")
        if isinstance(answer, Exception):
            raise answer
        return answer

    tasks = [Task(id=f"t{i}", prompt="") for i in range(4)]
    result = await evolve(
        tasks,
        lambda t, o: 1.0,
        run=run,
        propose=lambda *a: None,
        workers=1,
        max_rollouts=1,
        retry=Retry(attempts=3, backoff=0.25, multiplier=4.0, sleep=sleep),
    )
    assert waits == [7.0, 1.0]  # Retry-After honoured, then backoff x multiplier
    assert [e.attempt for e in result.errors] == [1, 2]


def test_retry_validates():
    for bad in ({"attempts": 0}, {"backoff": -1.0}, {"multiplier": 0.5}, {"attempts": 1.5}):
        with pytest.raises(ValueError):
            Retry(**bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("loop", LOOPS)
async def test_error_options_are_validated(loop):
    demo = _demo()
    for kwargs in ({"max_error_rate": 1.5}, {"error_window": 0}):
        with pytest.raises(ValueError):
            await loop(demo.tasks, demo.reward, run=demo.run, propose=demo.propose, **kwargs)
