"""Trust model: stored data never names code to run unless the reader opted in (docs/trust.md).

Whoever can write the store must not be able to make ``resume``, ``serve`` or
``Graph.from_dict`` execute a Python file. Each hostile file here writes a
marker file when it is executed, so "not executed" is observed, not assumed;
every file is new to the process, so no import cache can hide an execution.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import tailrace as tr
from tailrace.gates import Server
from tailrace.graph import load_file_module, resolve_reference
from tailrace.stores import NewRun, QuestionStatus, RunStore
from tests import fixtures

HOSTILE = """\
import os

import tailrace as tr

# Executing this file leaves a trace: one line per execution.
with open({marker!r}, "a") as fh:
    fh.write("executed\\n")


class Boom(Exception):
    pass


def start(x):
    return x


graph = tr.Graph("hostile")
graph.add_node("start", start)
"""


@dataclass
class Hostile:
    """A ``.py`` file that appends to ``marker`` each time it is executed."""

    path: Path
    marker: Path

    def ref(self, attr: str) -> str:
        return f"{self.path}:{attr}"

    def executions(self) -> int:
        return len(self.marker.read_text().splitlines()) if self.marker.exists() else 0


@pytest.fixture
def hostile(tmp_path: Path) -> Hostile:
    # A unique name: load_file_module caches by path, and a cached module would
    # hide a second execution.
    path = tmp_path / f"hostile_{uuid.uuid4().hex[:8]}.py"
    marker = tmp_path / "executed.marker"
    path.write_text(HOSTILE.format(marker=str(marker)))
    return Hostile(path, marker)


# -- backends ---------------------------------------------------------------------------


class Backend(fixtures.Database):
    """A database under test; ``store()`` opens another store instance on it."""

    async def engine(self) -> tr.Engine:
        """A fresh engine (its own owner, no graphs known) on another store instance."""
        return tr.Engine(store=await self.store())


@pytest.fixture(params=fixtures.ALL_STORES)
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    async with fixtures.database(
        request.param, tmp_path, cls=Backend, filename="trust.db", max_size=2
    ) as opened:
        yield opened


async def orphan_row(store: RunStore, graph_ref: str) -> str:
    """A ``running`` run with no lease, created long ago: what serve adopts (D6)."""
    run_id = f"orphan-{uuid.uuid4().hex[:8]}"
    await store.create_run(
        NewRun(
            run_id=run_id,
            graph_name="hostile",
            graph_ref=graph_ref,
            fingerprint="0" * 16,
            input_json="1",
            created_at=time.time() - 3600,
        )
    )
    return run_id


# -- a gate graph whose handlers live here (so only its *reference* is hostile) -----------

approval = tr.Graph("approval")


@approval.task()
def prepare(x: Any) -> Any:
    return x


@approval.gate()
def review(x: Any) -> Any:
    return f"ship {x}?"


@approval.task()
def ship(answer: Any) -> Any:
    return {"shipped": answer}


approval.chain("prepare", "review", "ship")


async def suspended(engine: tr.Engine, graph_ref: str) -> tuple[str, str]:
    """Run ``approval`` to its gate, recording ``graph_ref``; the run id and its question."""
    result = await engine.run(approval, "v1", graph_ref=graph_ref)
    assert result.status == "suspended"
    [question] = result.questions
    return result.run_id, question.question_id


# -- stored references: resume and serve -------------------------------------------------


async def test_resume_never_executes_a_stored_file_reference(
    backend: Backend, hostile: Hostile
) -> None:
    store = await backend.store()
    ref = hostile.ref("graph")
    run_id = await orphan_row(store, ref)
    with pytest.raises(tr.GraphError) as info:
        await (await backend.engine()).resume(run_id)
    assert hostile.executions() == 0
    message = str(info.value)
    assert run_id in message and ref in message
    # ... and it says how to opt in.
    assert "engine.resume(run_id, graph)" in message
    assert "engine.register(graph)" in message
    assert f"tailrace resume {run_id} --graphs {hostile.path}" in message
    assert f"tailrace serve --graphs {hostile.path}" in message
    assert (await store.get_run(run_id)).status.value == "running"  # nothing was written


async def test_serve_adopting_an_orphan_never_executes_its_file_reference(
    backend: Backend, hostile: Hostile, caplog: pytest.LogCaptureFixture
) -> None:
    store = await backend.store()
    run_id = await orphan_row(store, hostile.ref("graph"))
    server = Server(await backend.engine())
    with caplog.at_level(logging.WARNING):
        await server.once()
    assert hostile.executions() == 0
    assert server.stats.adopted == 0
    assert run_id in caplog.text  # the daemon says which run it could not adopt


async def test_serve_applying_an_answer_never_executes_the_runs_file_reference(
    backend: Backend, hostile: Hostile
) -> None:
    """Q4's sweep resumes answered runs: a stored file reference is refused there too."""
    owner = await backend.engine()
    run_id, question_id = await suspended(owner, hostile.ref("graph"))
    await owner.answer(question_id, "yes", resume=False)
    store = await backend.store()

    await Server(await backend.engine()).once()
    assert hostile.executions() == 0
    assert (await store.get_run(run_id)).status.value == "suspended"
    [row] = await store.list_questions(run_id=run_id)
    assert row.status is QuestionStatus.ANSWERED  # kept for a reader that opts in


async def test_serve_told_the_graph_applies_answers_of_a_run_named_by_file(
    backend: Backend, hostile: Hostile
) -> None:
    """The opt-in of a daemon (``serve --graphs path.py`` registers the file's graphs)."""
    owner = await backend.engine()
    run_id, question_id = await suspended(owner, hostile.ref("graph"))
    await owner.answer(question_id, "yes", resume=False)
    store = await backend.store()
    told = await backend.engine()
    told.register(approval)
    await Server(told).once()
    assert hostile.executions() == 0
    assert (await store.get_run(run_id)).status.value == "completed"
    [row] = await store.list_questions(run_id=run_id)
    assert row.status is QuestionStatus.APPLIED


async def test_a_run_started_from_a_file_resumes_when_the_graph_is_passed(
    backend: Backend, hostile: Hostile
) -> None:
    """The user's own file: loaded once because they asked (the CLI's `run path.py:graph`)."""
    module = load_file_module(str(hostile.path))  # the explicit opt-in: one execution
    assert hostile.executions() == 1
    gated = tr.Graph("from-file")
    gated.add_node("start", module.start)
    gated.add_node("review", review, tr.NodeKind.GATE)
    gated.chain("start", "review")
    result = await (await backend.engine()).run(gated, 1, graph_ref=hostile.ref("graph"))
    [question] = result.questions
    await (await backend.engine()).answer(question.question_id, "ok", resume=False)

    with pytest.raises(tr.GraphError, match=result.run_id):
        await (await backend.engine()).resume(result.run_id)
    done = await (await backend.engine()).resume(result.run_id, gated)
    assert done.status == "completed"
    assert done.results["review"] == "ok"
    assert hostile.executions() == 1


async def test_a_stored_module_reference_still_resumes(backend: Backend) -> None:
    """Importable module references are the default and keep working."""
    owner = await backend.engine()
    ref = f"{__name__}:approval"
    run_id, question_id = await suspended(owner, ref)
    await owner.answer(question_id, "yes", resume=False)
    store = await backend.store()
    assert (await store.get_run(run_id)).graph_ref == ref
    done = await (await backend.engine()).resume(run_id)
    assert done.results["ship"] == {"shipped": "yes"}


async def test_a_stored_reference_to_something_that_is_not_a_graph_names_the_run(
    backend: Backend,
) -> None:
    store = await backend.store()
    run_id = await orphan_row(store, "os:getcwd")
    with pytest.raises(tr.GraphError, match=f"{run_id}.*os:getcwd.*not a Graph"):
        await (await backend.engine()).resume(run_id)


# -- Graph.from_dict and references ------------------------------------------------------


def _document(hostile: Hostile) -> dict[str, Any]:
    g = tr.Graph("doc")
    g.add_node("start", prepare)
    data = g.to_dict()
    data["nodes"][0]["handler"] = hostile.ref("start")
    return data


def test_from_dict_does_not_execute_a_file_handler_unless_allowed(hostile: Hostile) -> None:
    data = _document(hostile)
    with pytest.raises(tr.GraphError, match=r"node 'start'.*allow_files=True"):
        tr.Graph.from_dict(data)
    assert hostile.executions() == 0

    graph = tr.Graph.from_dict(data, allow_files=True)
    assert hostile.executions() == 1
    assert graph.nodes["start"].handler(7) == 7
    assert tr.run(graph, 7).results == {"start": 7}


def test_from_dict_does_not_execute_a_file_named_by_retry_on_or_cost(hostile: Hostile) -> None:
    g = tr.Graph("doc")
    g.add_node("start", prepare, retry=tr.RetryPolicy(attempts=2))
    retrying = g.to_dict()
    retrying["nodes"][0]["retry"]["retry_on"] = [hostile.ref("Boom")]
    costly = g.to_dict()
    costly["nodes"][0]["cost"] = {"ref": hostile.ref("start")}
    for data, field_name in ((retrying, "retry"), (costly, "cost")):
        with pytest.raises(tr.GraphError, match=rf"node 'start': field '{field_name}'"):
            tr.Graph.from_dict(data)
    assert hostile.executions() == 0

    graph = tr.Graph.from_dict(retrying, allow_files=True)
    assert hostile.executions() == 1
    retry = graph.nodes["start"].retry
    assert retry is not None
    [boom] = retry.retry_on
    assert boom.__name__ == "Boom" and issubclass(boom, Exception)


@pytest.mark.parametrize(
    "entry", ["os:getcwd", "builtins:int", "builtins:len", "tailrace:Graph", "math:pi"]
)
def test_retry_on_must_name_an_exception_class(entry: str) -> None:
    g = tr.Graph("doc")
    g.add_node("start", prepare, retry=tr.RetryPolicy(attempts=2))
    data = g.to_dict()
    data["nodes"][0]["retry"]["retry_on"] = ["builtins:ValueError", entry]
    with pytest.raises(tr.GraphError) as info:
        tr.Graph.from_dict(data)
    message = str(info.value)
    assert "node 'start'" in message and "retry" in message and entry in message
    assert "not an exception class" in message


@pytest.mark.parametrize("entry", [int, "ValueError", ValueError()])
def test_retry_policy_built_in_code_refuses_a_non_exception(entry: Any) -> None:
    with pytest.raises(tr.GraphError, match="retry_on"):
        tr.RetryPolicy(retry_on=(entry,))


def test_retry_on_exception_classes_still_resolve() -> None:
    policy = tr.RetryPolicy(retry_on=(KeyboardInterrupt, asyncio.TimeoutError, tr.GraphError))
    assert tr.RetryPolicy.from_dict(policy.to_dict()) == policy


def test_resolve_reference_refuses_files_by_default(hostile: Hostile) -> None:
    for ref in (hostile.ref("graph"), "relative/dir/module:graph"):
        with pytest.raises(tr.GraphError, match="allow_files=True"):
            resolve_reference(ref)
    assert hostile.executions() == 0
    assert isinstance(resolve_reference(hostile.ref("graph"), allow_files=True), tr.Graph)
    assert hostile.executions() == 1


@pytest.mark.parametrize("ref", [".relative:x", "..up:x", "a b:x", "os:", ":x", "os", "os:a-b"])
def test_resolve_reference_refuses_malformed_references_with_graph_error(ref: str) -> None:
    with pytest.raises(tr.GraphError, match="reference"):
        resolve_reference(ref)


def test_resolve_reference_imports_modules() -> None:
    assert resolve_reference("tailrace:Graph") is tr.Graph
    assert resolve_reference("os.path:join") is os.path.join


# -- docs/trust.md says what the code does ---------------------------------------------

TRUST_DOC = Path(__file__).resolve().parents[2] / "docs" / "trust.md"


def test_trust_doc_examples_run() -> None:
    """Each Python block of docs/trust.md runs and its assertions hold."""
    import re

    blocks = re.findall(r"```python\n(.*?)```", TRUST_DOC.read_text(), re.DOTALL)
    assert len(blocks) == 2
    for block in blocks:
        exec(compile(block, str(TRUST_DOC), "exec"), {"__name__": "trust_doc"})
