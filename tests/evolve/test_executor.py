"""evolve/async_evolve(..., executor=...): every run, reward and propose attempt is an executor call.

The same small domain runs without an executor, through a counting
pass-through executor over ``LocalExecutor``, and on a local Ray (2 CPUs,
started once per test run; skipped only without Ray). The fault test
SIGKILLs the Ray worker running a training rollout: the evolution goes on,
the lost attempt is recorded and retried on another worker.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

import tailrace as tr
from tailrace.evolve import (
    Edit,
    EvolutionResult,
    Retry,
    Task,
    async_evolve,
    current_rollout,
    evolve,
    record_usage,
)
from tailrace.evolve._partial import durable_engine
from tailrace.executors import AttemptContext, ExecutorLost, LocalExecutor
from tailrace.stores import MemoryStore

GUARD = 120.0  # hang guard (s): fails a test only when something hangs
RULES = {"a": "alpha", "b": "beta"}
VICTIM = "t0"  # a training task (the held-out tasks are the last ones without a shuffle)


def tasks() -> list[Task]:
    return [Task(id=f"t{i}", prompt=f"task {i}", meta={"kind": "ab"[i % 2]}) for i in range(12)]


def answer(rendered: str, kind: str) -> str:
    """What the rules in ``rendered`` say for a task of ``kind``."""
    for line in rendered.splitlines():
        key, _, value = line.partition(": ")
        if key == kind:
            return value
    return "unknown"


def run(rendered: str, task: Task) -> dict[str, Any]:
    rollout = current_rollout()
    if rollout is None or rollout.task_id != task.id:
        raise RuntimeError(f"no rollout context for {task.id}: {rollout}")  # fails the test below
    record_usage(model="m", prompt_tokens=len(task.prompt), completion_tokens=1)
    return {"answer": answer(rendered, task.meta["kind"])}


def reward(task: Task, output: Mapping[str, Any]) -> float:
    return 1.0 if output["answer"] == RULES[task.meta["kind"]] else 0.0


async def propose(rendered: str, task: Task, output: Any, value: float) -> Edit | None:
    if value == 1.0:
        return None
    kind = task.meta["kind"]
    return Edit(set={kind: RULES[kind]}, note=f"from {task.id}")


OPTIONS: dict[str, Any] = dict(run=run, propose=propose, workers=2, max_rollouts=12)


class Counting:
    """A pass-through executor that counts and keeps every call."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: Counter[str] = Counter()
        self.seen: list[tuple[AttemptContext, Any, Any]] = []

    async def invoke(self, node: Any, payload: Any, context: AttemptContext) -> Any:
        self.calls[node.id] += 1
        result = await self.inner.invoke(node, payload, context)
        self.seen.append((context, payload, result))
        return result

    async def aclose(self) -> None:
        await self.inner.aclose()


def outcome(result: EvolutionResult) -> dict[str, Any]:
    """What an async evolution of this domain ends with, whatever the interleaving."""
    return {
        "version": result.version,
        "entries": result.entries,
        "held_out": result.held_out,
        "initial_held_out": result.initial_held_out,
        "rollouts": result.rollouts,
        "commits": result.commits,
        "stop_reason": result.stop_reason,
        "errors": result.errors,
    }


def check_counts(counting: Counting, result: EvolutionResult) -> None:
    """Every user call went through ``counting``, as JSON, and its usage was counted."""
    assert set(counting.calls) == {"run", "reward", "propose"}
    assert sum(counting.calls.values()) == result.calls
    assert counting.calls["run"] == counting.calls["reward"]
    assert counting.calls["run"] == result.rollouts + result.eval_rollouts
    assert counting.calls["propose"] == result.rollouts
    for context, payload, answer_ in counting.seen:
        assert context.run_id == "evolve:artifact" and context.attempt == 1
        assert json.loads(json.dumps(payload)) == payload  # inputs cross as JSON
        assert json.loads(json.dumps(answer_)) == answer_  # and so do results
    visits = [c.visit for c, _, _ in counting.seen if c.node_id == "run"]
    assert sorted(visits) == list(range(1, counting.calls["run"] + 1))
    [usage] = result.usage
    assert usage.calls == counting.calls["run"]  # record_usage inside the call was counted


async def test_every_call_goes_through_the_executor_and_the_outcome_is_unchanged() -> None:
    plain = await async_evolve(tasks(), reward, **OPTIONS)
    counting = Counting(LocalExecutor())
    via = await async_evolve(tasks(), reward, executor=counting, **OPTIONS)

    check_counts(counting, via)
    assert outcome(via) == outcome(plain)
    assert via.entries == RULES and via.held_out == 1.0 and via.errors == ()


async def test_sync_rounds_through_an_executor_equal_the_rounds_without() -> None:
    plain = await evolve(tasks(), reward, shuffle_seed=3, **OPTIONS)
    counting = Counting(LocalExecutor())
    via = await evolve(tasks(), reward, shuffle_seed=3, executor=counting, **OPTIONS)

    check_counts(counting, via)
    timing = ("wall", "worker_busy", "worker_used", "utilisation", "rollouts_per_second")
    mine, theirs = via.to_dict(), plain.to_dict()
    for data in (mine, theirs):
        for key in timing:
            data.pop(key)
        for sweep in data["history"]:
            sweep.pop("elapsed")
    assert mine == theirs


async def test_a_graph_run_runs_its_nodes_on_the_executor() -> None:
    graph = tr.Graph("rollout")

    @graph.task()
    def respond(payload: Mapping[str, Any]) -> dict[str, Any]:
        return {"answer": answer(payload["rendered"], payload["task"]["meta"]["kind"])}

    counting = Counting(LocalExecutor())
    result = await async_evolve(
        tasks(), reward, run=graph, propose=propose, workers=2, max_rollouts=8, executor=counting
    )

    assert set(counting.calls) == {"respond", "reward", "propose"}
    assert counting.calls["respond"] == counting.calls["reward"]
    assert result.entries == RULES and result.errors == ()


async def test_partial_rollouts_run_their_graph_on_the_executor() -> None:
    graph = tr.Graph("turns")
    graph.add_node("turn", lambda payload: payload["rendered"])
    counting = Counting(LocalExecutor())
    async with MemoryStore() as store:
        engine = durable_engine(None, store, counting)  # what async_evolve makes for them
        result = await engine.run(graph, {"rendered": "a: alpha", "task": tasks()[0].to_dict()})

    assert engine.store is store and result.output == "a: alpha"
    assert counting.calls == {"turn": 1}


def bad_reward(task: Task, output: Any) -> Any:
    return True


def bad_propose(rendered: str, task: Task, output: Any, value: float) -> Any:
    return "add a rule"


async def test_contract_violations_still_raise_here_naming_the_task() -> None:
    options = dict(workers=1, max_rollouts=2, executor=LocalExecutor())
    with pytest.raises(ValueError, match=r"reward for task 't\d+' must be a number .* got True"):
        await async_evolve(tasks(), bad_reward, run=run, propose=propose, **options)
    with pytest.raises(
        TypeError, match=r"propose for task 't0' must return an Edit .*'add a rule'"
    ):
        await async_evolve(tasks(), reward, run=run, propose=bad_propose, **options)


def test_a_lost_worker_is_transient_whatever_retry_on_says() -> None:
    lost = ExecutorLost("run 'evolve:artifact': node 'run' (visit 1, try 1): lost")
    assert Retry(retry_on=()).transient(lost)
    assert not Retry(retry_on=()).transient(RuntimeError("boom"))


async def test_an_executor_must_have_invoke_and_aclose() -> None:
    with pytest.raises(TypeError, match="executor: 'ray' is not an executor"):
        await async_evolve(tasks(), reward, executor="ray", **OPTIONS)


# -- on a local Ray ---------------------------------------------------------------------


@pytest.fixture(scope="session")
def ray_session() -> Iterator[Any]:
    """A local Ray with 2 CPUs for the whole test run (as in tests/executors); yields ``ray``."""
    try:
        import ray
        from ray import cloudpickle
    except ImportError as exc:
        pytest.skip(f"Ray is not installed (pip install 'tailrace[ray]'): {exc}")
    # Ray's workers cannot import this test module: its functions travel by value.
    module = sys.modules[__name__]
    cloudpickle.register_pickle_by_value(module)
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        cloudpickle.unregister_pickle_by_value(module)
        if started:
            ray.shutdown()


@pytest.mark.slow
async def test_on_ray_every_call_is_a_ray_task_and_the_outcome_is_unchanged(
    ray_session: Any,
) -> None:
    from tailrace.executors import RayExecutor

    plain = await async_evolve(tasks(), reward, **OPTIONS)
    async with RayExecutor() as ray_executor:
        counting = Counting(ray_executor)
        async with asyncio.timeout(GUARD):
            via = await async_evolve(tasks(), reward, executor=counting, **OPTIONS)

    check_counts(counting, via)
    assert outcome(via) == outcome(plain)


class Victim:
    """``run`` whose first training rollout of :data:`VICTIM` writes its pid and waits to be killed."""

    def __init__(self, directory: str) -> None:
        self.directory = Path(directory)

    def __call__(self, rendered: str, task: Task) -> dict[str, Any]:
        if task.id == VICTIM:
            first = self.directory / "pid1"
            mark = first if not first.exists() else self.directory / "pid2"
            if not mark.exists():
                partial = mark.with_suffix(".tmp")
                partial.write_text(str(os.getpid()))
                partial.rename(mark)  # the test never reads a half-written pid
            if mark is first:
                deadline = time.monotonic() + GUARD
                while time.monotonic() < deadline:  # killed here by the test
                    time.sleep(0.05)
                raise RuntimeError("the test did not kill this worker")
        return run(rendered, task)


async def until(predicate: Any, what: str, deadline: float = 60.0) -> None:
    """Poll ``predicate`` until true; fail naming ``what`` past ``deadline``."""
    end = time.monotonic() + deadline
    while not predicate():
        if time.monotonic() > end:
            pytest.fail(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


@pytest.mark.slow
async def test_a_sigkilled_ray_worker_fails_the_rollout_which_is_recorded_and_retried(
    ray_session: Any, tmp_path: Path
) -> None:
    from tailrace.executors import RayExecutor

    first, second = tmp_path / "pid1", tmp_path / "pid2"
    async with RayExecutor() as ray_executor:
        evolution = asyncio.create_task(
            async_evolve(
                tasks(),
                reward,
                run=Victim(str(tmp_path)),
                propose=propose,
                workers=2,
                max_rollouts=8,
                retry=Retry(backoff=0.01),
                executor=ray_executor,
            )
        )
        try:
            await until(first.exists, "the victim rollout's pid")
            pid = int(first.read_text())
            assert pid != os.getpid()  # it runs in a Ray worker
            os.kill(pid, signal.SIGKILL)
            async with asyncio.timeout(GUARD):
                result = await evolution
        finally:
            evolution.cancel()

    [lost] = result.errors
    assert (lost.task_id, lost.phase, lost.stage, lost.attempt) == (VICTIM, "train", "run", 1)
    assert lost.error == "tailrace._errors.ExecutorLost" and lost.retried
    assert "node 'run'" in lost.message and "Ray worker running it was lost" in lost.message
    assert int(second.read_text()) != pid  # the retry ran on another worker
    assert result.failed_units == 0
    assert result.rollouts == 8 and result.stop_reason == "budget"
    assert result.entries == RULES
