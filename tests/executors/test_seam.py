"""The executor seam, in process: node options (G1, G3), routing per node, run-start errors, context.

No Ray here: these use :class:`LocalExecutor` and small executors around it,
shaped like the OpenTelemetry wrapper the seam is meant for.
"""

from __future__ import annotations

import contextvars
import math
from pathlib import Path
from typing import Any

import pytest

import tailrace as tr
from tailrace.executors import AttemptContext, Executor, ExecutorLost, LocalExecutor
from tailrace.executors._base import ExecutorTable
from tailrace.stores import SQLiteStore

#: What a tracing wrapper would make current for the handler (a span, say).
SPAN: contextvars.ContextVar[str | None] = contextvars.ContextVar("span", default=None)


class Traced:
    """Opens a "span" per attempt around an inner executor and records each context."""

    def __init__(self, inner: Executor | None = None) -> None:
        self.inner = inner or LocalExecutor()
        self.seen: list[AttemptContext] = []
        self.closed = False

    async def invoke(self, node: Any, payload: Any, context: AttemptContext) -> Any:
        self.seen.append(context)
        token = SPAN.set(f"{context.run_id}/{context.node_id}/{context.visit}/{context.attempt}")
        try:
            return await self.inner.invoke(node, payload, context)
        finally:
            SPAN.reset(token)

    async def aclose(self) -> None:
        self.closed = True


class LosesFirstTry(Traced):
    """Reports its worker lost on each node's first try, as RayExecutor does when one dies."""

    async def invoke(self, node: Any, payload: Any, context: AttemptContext) -> Any:
        if context.attempt == 1:
            raise ExecutorLost(f"node {context.node_id!r}: worker lost")
        return await super().invoke(node, payload, context)


def span_of(x: Any) -> Any:
    return [x, SPAN.get(), (tr.current_node() or tr.NodeContext).__class__.__name__]


async def async_span_of(x: Any) -> Any:
    return [x, SPAN.get()]


# -- node options (G1, G3) ----------------------------------------------------------------------


def test_options_are_kept_copied_and_round_trip_to_identical_json() -> None:
    resources = {"num_cpus": 2, "num_gpus": 0.5, "memory": 2**30, "accelerator_v5": 1}
    env = {"env_vars": {"MODE": "fast"}, "pip": ["numpy"]}
    g = tr.Graph("placed")
    node = g.add_node("a", span_of, executor="ray", resources=resources, runtime_env=env)
    resources["num_cpus"] = 99
    env["env_vars"]["MODE"] = "changed"  # type: ignore[index]

    assert node.resources == {"num_cpus": 2, "num_gpus": 0.5, "memory": 2**30, "accelerator_v5": 1}
    assert node.runtime_env == {"env_vars": {"MODE": "fast"}, "pip": ["numpy"]}
    assert isinstance(hash(node), int)  # mappings are left out of the hash
    again = tr.Graph.from_dict(g.to_dict())
    assert again.to_json() == g.to_json()
    assert again.nodes["a"].executor == "ray"
    assert again.nodes["a"].resources == node.resources
    # The executor is not structure: a run can resume on another executor (D3).
    plain = tr.Graph("placed")
    plain.add_node("a", span_of)
    assert plain.fingerprint() == g.fingerprint()


def test_decorators_take_the_options() -> None:
    g = tr.Graph("decorated")

    @g.task(executor="gpu", resources={"num_gpus": 1})
    def infer(x: Any) -> Any:
        return x

    assert (g.nodes["infer"].executor, g.nodes["infer"].resources) == ("gpu", {"num_gpus": 1})


@pytest.mark.parametrize(
    ("option", "value", "expected"),
    [
        ("executor", "", "executor must be a non-empty string"),
        ("executor", 3, "executor must be a non-empty string"),
        ("resources", {"num_cpus": -1}, "resources must be a mapping of resource names"),
        ("resources", {"num_cpus": "2"}, "resources must be a mapping of resource names"),
        ("resources", {"num_cpus": math.nan}, "resources must be a mapping of resource names"),
        ("resources", {"num_gpus": True}, "resources must be a mapping of resource names"),
        ("resources", {"": 1}, "resources must be a mapping of resource names"),
        ("resources", [("num_cpus", 1)], "resources must be a mapping of resource names"),
        ("runtime_env", {"env_vars": {"A": object()}}, "runtime_env must be a JSON object"),
        ("runtime_env", {1: "x"}, "runtime_env must be a JSON object"),
        ("runtime_env", {"x": math.inf}, "runtime_env must be a JSON object"),
        ("runtime_env", "pip", "runtime_env must be a JSON object"),
    ],
)
def test_g1_bad_options_are_refused_at_build_time_naming_the_node(
    option: str, value: Any, expected: str
) -> None:
    g = tr.Graph("bad")
    with pytest.raises(tr.GraphError, match=f"node 'n': {expected}"):
        g.add_node("n", span_of, **{option: value})
    assert "n" not in g.nodes


def test_g1_a_document_with_bad_resources_is_refused_naming_the_node() -> None:
    g = tr.Graph("doc")
    g.add_node("n", span_of, resources={"num_cpus": 1})
    doc = g.to_dict()
    doc["nodes"][0]["resources"] = {"num_cpus": "lots"}
    with pytest.raises(tr.GraphError, match="node 'n': resources must be"):
        tr.Graph.from_dict(doc)


# -- routing --------------------------------------------------------------------------------------


def two_nodes(executor: str | None) -> tr.Graph:
    g = tr.Graph("two")
    g.add_node("here", async_span_of)
    g.add_node("there", span_of, executor=executor)
    g.add_edge("here", "there")
    return g


async def test_named_executor_runs_only_its_nodes_and_its_context_reaches_the_handler() -> None:
    traced = Traced()
    engine = tr.Engine(executors={"traced": traced})
    result = await engine.run(two_nodes("traced"), 1, run_id="r1")

    assert result.results["here"] == [1, None]  # inline: no span
    # The sync handler ran in the thread pool, in a copy of the wrapper's context.
    assert result.results["there"] == [[1, None], "r1/there/1/1", "NodeContext"]
    assert [(c.run_id, c.node_id, c.visit, c.attempt, c.hedge) for c in traced.seen] == [
        ("r1", "there", 1, 1, False)
    ]
    assert not traced.closed  # the engine never closes executors: their maker does


async def test_default_executor_runs_every_node_without_a_name() -> None:
    traced = Traced()
    result = await tr.Engine(executor=traced).run(two_nodes(None), 2, run_id="r2")

    assert result.results["here"] == [2, "r2/here/1/1"]  # async: in the calling task
    assert [c.node_id for c in traced.seen] == ["here", "there"]


async def test_a_lost_worker_is_retried_by_the_nodes_policy() -> None:
    g = tr.Graph("lost")
    g.add_node("n", span_of, retry=tr.RetryPolicy(attempts=2, retry_on=(ExecutorLost,)))
    executor = LosesFirstTry()
    result = await tr.Engine(executor=executor).run(g, 3, run_id="r3")

    assert result.results["n"][:2] == [3, "r3/n/1/2"]
    assert result.nodes["n"].attempts == 2


async def test_a_lost_worker_without_a_retry_policy_fails_the_run_naming_the_node() -> None:
    g = tr.Graph("lost")
    g.add_node("n", span_of)
    with pytest.raises(ExecutorLost, match="node 'n': worker lost"):
        await tr.Engine(executor=LosesFirstTry()).run(g, 3)


def test_a_plain_local_executor_is_the_inline_path_and_a_subclass_is_not() -> None:
    class Mine(LocalExecutor):
        pass

    topo = two_nodes("x").compile()
    assert ExecutorTable(LocalExecutor(), {"x": LocalExecutor()}).plan(topo) is None
    plan = ExecutorTable(None, {"x": Mine()}).plan(topo)
    assert plan is not None
    assert [type(e).__name__ if e else None for e in plan] == [None, "Mine"]


async def test_local_executor_alone_runs_sync_and_async_handlers() -> None:
    g = tr.Graph("alone")
    sync_node = g.add_node("s", span_of)
    async_node = g.add_node("a", async_span_of)
    context = AttemptContext(run_id="r", node_id="s", visit=1, attempt=1)
    executor = LocalExecutor()
    async with executor:
        assert (await executor.invoke(sync_node, 1, context))[:2] == [1, None]
        assert await executor.invoke(async_node, 2, context) == [2, None]


# -- errors at the start, never midway --------------------------------------------------------


def test_executors_that_are_not_executors_are_refused() -> None:
    with pytest.raises(TypeError, match=r"executors\['x'\]: .* is not an executor"):
        tr.Engine(executors={"x": object()})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="executor names must be non-empty strings"):
        tr.Engine(executors={"": LocalExecutor()})
    with pytest.raises(TypeError, match="executor: 3 is not an executor"):
        tr.Engine(executor=3)  # type: ignore[arg-type]


async def test_an_unknown_executor_fails_the_run_before_anything_is_written(
    tmp_path: Path,
) -> None:
    async with SQLiteStore(tmp_path / "runs.db") as store:
        engine = tr.Engine(store=store, executors={"cpu": LocalExecutor()})
        with pytest.raises(tr.GraphError) as caught:
            await engine.run(two_nodes("gpu"), 1, run_id="never")
        assert str(caught.value) == (
            "graph 'two': node 'there' runs on executor 'gpu', which this engine does not "
            "have (its executors: 'cpu')"
        )
        assert await store.list_runs() == []


async def test_a_resume_on_an_engine_without_the_executor_fails_before_writing(
    tmp_path: Path,
) -> None:
    g = tr.Graph("gated")

    @g.gate()
    def ask(x: Any) -> str:
        return "go on?"

    g.add_node("after", span_of, executor="traced")
    g.add_edge("ask", "after")
    async with SQLiteStore(tmp_path / "runs.db") as store:
        first = tr.Engine(store=store, executors={"traced": Traced()})
        suspended = await first.run(g, 1, run_id="gated")
        assert suspended.status == "suspended"
        before = await store.events("gated")

        bare = tr.Engine(store=store)
        with pytest.raises(tr.GraphError, match="node 'after' runs on executor 'traced'"):
            await bare.resume("gated", g)
        assert await store.events("gated") == before
        assert (await store.get_run("gated")).lease_owner is None

        [question] = suspended.questions
        done = await first.answer(question.question_id, "yes")
        assert done is not None
        assert done.results["after"][:2] == ["yes", "gated/after/1/1"]
