"""Versions and forks through the public API, against every store (V1-V4).

A run is crashed in process (its task cancelled while handlers are held), so
the store holds exactly what a dead process left; a changed graph is then
checked against it, resumed on it, migrated onto it, or forked from it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

import tailrace as tr
from tailrace._errors import GraphMismatch, Incompatibility
from tailrace.core import stretches_of
from tailrace.stores import RunStatus, SQLiteStore
from tests.durable.test_resume import (
    Backend,
    Probe,
    backend,
    crash,
    crashed_fork,
    engine,
    fork_graph,
    loop_graph,
    new_id,
    running,
    snapshot,
    until,
)

__all__ = ["backend"]


def fan_graph(probe: Probe, tag: str = "v1", *, required: int = 2) -> tr.Graph:
    """``a`` -> ``x``, ``y``, ``z`` -> ``agg`` (first ``required``) -> ``out``."""
    g = tr.Graph("fan")
    g.add_node("a", probe.task())
    for n in "xyz":
        g.add_node(n, probe.task(lambda v, n=n: f"{n}{tag}:{v}"))
        g.add_edge("a", n)
    g.add_node("agg", probe.task(), "aggregate", required=required)
    for n in "xyz":
        g.add_edge(n, "agg")
    g.add_node("out", probe.task(len))
    g.add_edge("agg", "out")
    return g


def gate_graph(probe: Probe, *, extra: bool = False, gate_kind: str = "gate") -> tr.Graph:
    """``prep`` -> ``review`` (a gate) -> ``ship``; with ``extra``, ``ship`` -> ``notify`` too."""
    g = tr.Graph("deploy")
    g.add_node("prep", probe.task(lambda x: {"draft": x}))
    if gate_kind == "gate":
        g.add_node("review", lambda draft: {"ask": draft}, "gate")
    else:
        g.add_node("review", probe.task(), gate_kind)
    g.add_node("ship", probe.task(lambda answer: {"shipped": answer}))
    g.chain("prep", "review", "ship")
    if extra:
        g.add_node("notify", probe.task(lambda x: "notified"))
        g.add_edge("ship", "notify")
    return g


# --- V1: a changed graph against what the run did ------------------------------------------


async def test_v1_a_compatible_change_continues_and_the_move_is_recorded(backend: Backend) -> None:
    probe = Probe()
    _, run_id = await crashed_fork(backend, probe, "compatible")
    changed = fork_graph(probe)
    changed.add_node("extra", probe.task(lambda xs: "extra"))
    changed.add_edge("sink", "extra")

    result = await engine(backend).resume(run_id, changed)

    assert result.status is RunStatus.COMPLETED
    assert result.results["extra"] == "extra"
    assert probe.executions("a") == 1 and probe.executions("b") == 1  # D3: reused
    record = await backend.store.get_run(run_id)
    assert record.fingerprint == changed.fingerprint()


async def test_v1_a_completed_node_whose_kind_changed_is_refused_naming_it(
    backend: Backend,
) -> None:
    probe = Probe()
    g, run_id = await crashed_fork(backend, probe, "kind")
    changed = tr.Graph("fork")
    for node in g.nodes.values():
        kind = "aggregate" if node.id == "b" else node.kind.value
        changed.add_node(node.id, node.handler, kind)
    for edge in g.edges:
        changed.add_edge(edge.source, edge.target)
    before = await snapshot(backend, run_id)

    with pytest.raises(GraphMismatch, match="'b': its kind changed from task to aggregate") as info:
        await engine(backend).resume(run_id, changed)

    assert info.value.incompatible == (
        Incompatibility("b", "its kind changed from task to aggregate"),
    )
    assert await snapshot(backend, run_id) == before  # nothing written
    forced = await engine(backend).resume(run_id, changed, force=True)  # force checks nothing
    assert forced.status is RunStatus.COMPLETED


async def test_v1_required_and_edges_into_the_frontier_are_checked_new_nodes_are_free(
    backend: Backend,
) -> None:
    probe = Probe()
    probe.held = {"out"}
    run_id = new_id("fan")
    task = asyncio.create_task(engine(backend).run(fan_graph(probe), 1, run_id=run_id))
    await until(running(backend, run_id, "out"), "out running")
    await crash(task)
    probe.held.clear()
    eng = engine(backend)

    fewer = fan_graph(probe, required=1)
    report = await eng.check(run_id, fewer)
    assert not report.compatible
    assert report.incompatible == (Incompatibility("agg", "its required changed from 2 to 1"),)

    legal = fan_graph(probe)
    legal.add_node("w", probe.task())
    legal.add_edge("a", "w")
    legal.add_edge("w", "agg")
    report = await eng.check(run_id, legal)
    assert report.incompatible == (Incompatibility("agg", "an edge into it was added: w -> agg"),)

    free = fan_graph(probe)
    free.add_node("after", probe.task())
    free.add_edge("out", "after")
    report = await eng.check(run_id, free)
    assert report.compatible and not report.same_version
    assert set(report.frontier) == {"a", "x", "y", "z", "agg", "out"}


def quota_graph(probe: Probe, required: Callable[[int], int]) -> tr.Graph:
    """``items`` (a list of ``x`` numbers) -> ``each`` (a map, first ``required(n)``) -> ``out``."""
    g = tr.Graph("quota")
    g.add_node("items", probe.task(lambda x: list(range(x))))
    g.add_node("each", probe.task(), "map", required=required)
    g.add_node("out", probe.task(len))
    g.chain("items", "each", "out")
    return g


async def crashed_at_out(
    backend: Backend, probe: Probe, graph: tr.Graph, input: Any, node: str = "out"
) -> str:
    """A run of ``graph`` crashed while its ``node`` ran (everything before it committed)."""
    probe.held = {node}
    run_id = new_id(graph.name)
    task = asyncio.create_task(engine(backend).run(graph, input, run_id=run_id))
    await until(running(backend, run_id, node), f"{node} running")
    await crash(task)
    probe.held.clear()
    return run_id


async def test_v1_a_maps_required_function_is_part_of_the_version_by_its_code(
    backend: Backend,
) -> None:
    probe = Probe()
    every = quota_graph(probe, lambda n: n)
    one = quota_graph(probe, lambda n: 1)
    assert every.fingerprint() != one.fingerprint()  # one name (<lambda>), other code
    assert quota_graph(probe, every.nodes["each"].required).fingerprint() == every.fingerprint()
    run_id = await crashed_at_out(backend, probe, every, 4)

    report = await engine(backend).check(run_id, one)

    assert not report.compatible and not report.same_version
    ((node, reason),) = report.incompatible
    assert node == "each" and reason.startswith("its required changed from ")
    assert f"{__name__}:test_v1_a_maps_required_function_is_part" in reason
    dry = await engine(backend).migrate(one)
    assert [m.outcome for m in dry.runs] == [tr.MoveOutcome.INCOMPATIBLE]
    with pytest.raises(GraphMismatch, match="'each': its required changed"):
        await engine(backend).resume(run_id, one)
    assert (await engine(backend).resume(run_id, every)).results["out"] == 4


def made_with(k: int) -> Callable[[int], int]:
    return lambda n: min(n, k)


def test_v1_a_required_function_made_by_a_factory_differs_by_what_it_closes_over() -> None:
    probe = Probe()
    two, three = quota_graph(probe, made_with(2)), quota_graph(probe, made_with(3))
    assert two.fingerprint() != three.fingerprint()
    assert quota_graph(probe, made_with(2)).fingerprint() == two.fingerprint()


def parent_graph(probe: Probe, child: tr.Graph) -> tr.Graph:
    """``prep`` -> ``kid`` (runs ``child`` as a child run) -> ``out``."""
    g = tr.Graph("parent")
    g.add_node("prep", probe.task())
    g.add_node("kid", child)
    g.add_node("out", probe.task())
    g.chain("prep", "kid", "out")
    return g


def child_graph(probe: Probe, name: str, *steps: str) -> tr.Graph:
    g = tr.Graph(name)
    for step in steps:
        g.add_node(step, probe.task(lambda x, step=step: f"{step}({x})"))
    g.chain(*steps)
    return g


async def test_v1_a_child_nodes_graph_is_part_of_the_version(backend: Backend) -> None:
    probe = Probe()
    v1 = parent_graph(probe, child_graph(probe, "kid", "one"))
    swapped = parent_graph(probe, child_graph(probe, "other", "one"))
    grown = parent_graph(probe, child_graph(probe, "kid", "one", "two"))
    assert len({v1.fingerprint(), swapped.fingerprint(), grown.fingerprint()}) == 3
    run_id = await crashed_at_out(backend, probe, v1, "x")
    kid = v1.nodes["kid"].handler.fingerprint()  # type: ignore[union-attr]

    for changed, to in ((swapped, "'other'"), (grown, "'kid'")):
        report = await engine(backend).check(run_id, changed)
        assert [i.node_id for i in report.incompatible] == ["kid"], report.describe()
        assert report.incompatible[0].reason.startswith(
            f"its child graph changed from graph 'kid' version {kid} to graph {to} version "
        )
        dry = await engine(backend).migrate(changed)
        assert [m.outcome for m in dry.runs] == [tr.MoveOutcome.INCOMPATIBLE]

    early = await crashed_at_out(backend, probe, v1, "x", "prep")  # its child node has not run
    report = await engine(backend).check(early, grown)
    assert report.compatible and not report.same_version


async def stored_before_digests(backend: Backend, run_id: str) -> None:
    """Make run ``run_id`` look as an older tailrace stored it: its version's structure names
    a callable ``required`` by reference alone and holds no child graphs (another fingerprint)."""
    record = await backend.store.get_run(run_id)
    text = await backend.store.graph_shape(record.graph_name, record.fingerprint)
    assert text is not None
    shape = json.loads(text)
    for node in shape["nodes"]:
        del node[5:]
        if isinstance(node[2], list):
            node[2] = node[2][0]
    old, fingerprint = json.dumps(shape, separators=(",", ":")), "0ld" + record.fingerprint[3:]
    if backend.execute is None:
        store: Any = backend.store
        store._runs[run_id] = dataclasses.replace(record, fingerprint=fingerprint)
        store._shapes[(record.graph_name, fingerprint)] = old
        return
    m = backend.mark
    await backend.execute(
        f"UPDATE runs SET fingerprint = {m} WHERE run_id = {m}", (fingerprint, run_id)
    )
    await backend.execute(
        f"INSERT INTO graph_shapes (graph_name, fingerprint, shape_json, created_at) "
        f"VALUES ({m}, {m}, {m}, 0)",
        (record.graph_name, fingerprint, old),
    )


async def test_v1_a_run_stored_before_code_and_child_graphs_were_versioned_continues(
    backend: Backend,
) -> None:
    probe = Probe()
    quota = quota_graph(probe, lambda n: n)
    parent = parent_graph(probe, child_graph(probe, "kid", "one"))
    ids = [await crashed_at_out(backend, probe, g, i) for g, i in ((quota, 3), (parent, "x"))]
    for run_id in ids:
        await stored_before_digests(backend, run_id)

    for run_id, graph in zip(ids, (quota, parent), strict=True):
        report = await engine(backend).check(run_id, graph)
        assert report.compatible and not report.same_version, report.describe()
        result = await engine(backend).resume(run_id, graph)
        assert result.status is RunStatus.COMPLETED
        assert (await backend.store.get_run(run_id)).fingerprint == graph.fingerprint()


# --- V2: check writes nothing and needs no old code --------------------------------------------


async def test_v2_check_reports_without_writing_and_without_the_old_version(
    backend: Backend,
) -> None:
    probe = Probe()
    _, run_id = await crashed_fork(backend, probe, "check")
    before = await snapshot(backend, run_id)
    changed = fork_graph(probe)
    changed.add_node("extra", probe.task())
    changed.add_edge("sink", "extra")

    fresh = engine(backend)  # knows neither version: the store keeps the old structure
    report = await fresh.check(run_id, changed)

    assert isinstance(report, tr.Compatibility)
    assert report.compatible and report.from_fingerprint != report.to_fingerprint
    assert report.status is RunStatus.RUNNING
    assert "compatible" in report.describe()
    assert await snapshot(backend, run_id) == before
    other = tr.Graph("elsewhere")
    other.add_node("a", probe.task())
    report = await fresh.check(run_id, other)
    assert report.incompatible[0].node_id is None
    assert "not 'elsewhere'" in report.incompatible[0].reason


# --- V3: several versions at once ----------------------------------------------------------------


async def test_v3_each_run_continues_on_its_own_version(backend: Backend) -> None:
    probe = Probe()
    v1, v2 = fan_graph(probe, "v1"), fan_graph(probe, "v2")
    v2.add_node("after", probe.task(lambda n: f"after {n}"))
    v2.add_edge("out", "after")
    ids = {}
    for label, graph in (("one", v1), ("two", v2)):
        probe.held = {"out"}
        ids[label] = new_id(label)
        task = asyncio.create_task(engine(backend).run(graph, 1, run_id=ids[label]))
        await until(running(backend, ids[label], "out"), f"{label} running")
        await crash(task)
    probe.held.clear()

    both = engine(backend)
    both.register(v1, v2)
    one = await both.resume(ids["one"])
    two = await both.resume(ids["two"])

    assert "after" not in one.results and one.results["x"] == "xv1:1"
    assert two.results["after"] == "after 2" and two.results["x"] == "xv2:1"
    assert (await backend.store.get_run(ids["one"])).fingerprint == v1.fingerprint()
    assert (await backend.store.get_run(ids["two"])).fingerprint == v2.fingerprint()


# --- V2: migrate the live runs of a graph -------------------------------------------------------


async def test_v2_migrate_dry_run_then_apply_moves_only_the_compatible(backend: Backend) -> None:
    probe = Probe()
    old = gate_graph(probe)
    eng = engine(backend)
    eng.register(old)
    waiting = [new_id("waiting") for _ in range(3)]
    for run_id in waiting:
        result = await eng.run(old, run_id, run_id=run_id)
        assert result.status is RunStatus.SUSPENDED
    done = new_id("done")
    probe.held = {"prep"}
    task = asyncio.create_task(eng.run(old, "x", run_id=done))
    await until(running(backend, done, "prep"), "prep running")
    await crash(task)
    probe.held.clear()
    new = gate_graph(probe, extra=True)
    before = {r: await snapshot(backend, r) for r in [*waiting, done]}

    dry = await engine(backend).migrate(new)

    assert {m.run_id: m.outcome for m in dry.runs} == {
        **{r: tr.MoveOutcome.COMPATIBLE for r in waiting},
        done: tr.MoveOutcome.COMPATIBLE,
    }
    assert "4 compatible" in dry.summary() and "dry run" in dry.summary()
    assert {r: await snapshot(backend, r) for r in before} == before

    broken = gate_graph(probe, gate_kind="task")  # the waiting gate became a task
    refused = await engine(backend).migrate(broken, apply=True)
    assert refused.count(tr.MoveOutcome.INCOMPATIBLE) == 3
    assert refused.count(tr.MoveOutcome.MOVED) == 1  # the run waiting on prep only
    assert all(
        m.incompatible == (Incompatibility("review", "its kind changed from gate to task"),)
        for m in refused.runs
        if m.outcome is tr.MoveOutcome.INCOMPATIBLE
    )

    applied = await engine(backend).migrate(new, apply=True)
    assert applied.count(tr.MoveOutcome.MOVED) == 3
    assert applied.count(tr.MoveOutcome.INCOMPATIBLE) == 1  # done moved to 'broken' above
    for run_id in waiting:
        assert (await backend.store.get_run(run_id)).fingerprint == new.fingerprint()
    question = (await backend.store.list_questions(run_id=waiting[0]))[0]
    after = engine(backend)
    after.register(new)
    result = await after.answer(question.question_id, "approved")
    assert result is not None and result.status is RunStatus.COMPLETED
    assert result.results["notify"] == "notified"
    again = await engine(backend).migrate(new)
    assert again.count(tr.MoveOutcome.CURRENT) == 2


# --- V4: forks -------------------------------------------------------------------------------


async def test_v4_fork_reuses_results_upstream_and_reruns_from_the_node(backend: Backend) -> None:
    probe = Probe()
    g = fork_graph(probe)
    source_id = new_id("source")
    eng = engine(backend)
    source = await eng.run(g, "in", run_id=source_id)
    before = await snapshot(backend, source_id)
    runs_before = dict(probe.runs)

    fork = await eng.fork(source_id, at="c", fork_id=new_id("fork"))

    assert fork.status is RunStatus.COMPLETED and fork.results == source.results
    assert probe.executions("a") == 1 and probe.executions("b") == 1 and probe.executions("d") == 1
    assert probe.executions("c") == 2 and probe.executions("sink") == 2
    assert probe.payloads[("c", 1)][-1] == {"b_saw": None}  # the payload c ran with
    assert await snapshot(backend, source_id) == before  # the source is unchanged
    record = await backend.store.get_run(fork.run_id)
    assert (record.forked_from, record.forked_at) == (source_id, "c")
    assert {r.node_id for r in await backend.store.results(fork.run_id)} == set(source.results)
    assert runs_before[("a", 1)] == 1


async def test_v4_fork_with_an_input_and_a_changed_graph(backend: Backend) -> None:
    probe = Probe()
    source_id = new_id("source")
    await engine(backend).run(fork_graph(probe), "in", run_id=source_id)
    changed = fork_graph(probe)
    changed.add_node("extra", probe.task(lambda xs: len(xs)))
    changed.add_edge("sink", "extra")

    fork = await engine(backend).fork(source_id, at="c", graph=changed, input="new prompt")

    assert fork.results["c"] == {"c_saw": "new prompt"}
    assert fork.results["extra"] == 2
    assert (await backend.store.get_run(fork.run_id)).fingerprint == changed.fingerprint()

    renamed = tr.Graph("fork")  # b's kind changed: b is reused, so the fork is refused
    for node in changed.nodes.values():
        renamed.add_node(node.id, node.handler, "aggregate" if node.id == "b" else node.kind.value)
    for edge in changed.edges:
        renamed.add_edge(edge.source, edge.target)
    with pytest.raises(GraphMismatch, match="'b': its kind changed"):
        await engine(backend).fork(source_id, at="c", graph=renamed)
    fine = await engine(backend).fork(source_id, at="b", graph=renamed)  # b is re-run: free
    assert fine.status is RunStatus.COMPLETED


async def test_v4_fork_behind_a_first_k_decision_reuses_or_redoes_it(backend: Backend) -> None:
    probe = Probe()
    source_id = new_id("source")
    eng = engine(backend)
    source = await eng.run(fan_graph(probe), 1, run_id=source_id)
    assert source.results["agg"] == ["xv1:1", "yv1:1"]
    frozen = await backend.store.frozen_inputs(source_id)

    downstream = await eng.fork(source_id, at="out")  # the decision is reused
    assert downstream.results["agg"] == source.results["agg"]
    assert probe.executions("agg") == 1 and probe.executions("out") == 2
    assert await backend.store.frozen_inputs(downstream.run_id) == frozen

    upstream = await engine(backend).fork(source_id, at="x", graph=fan_graph(probe, "v2"))
    # Redone: reused inputs count as completed before anything the fork runs.
    assert upstream.results["agg"] == ["yv1:1", "zv1:1"]
    assert upstream.results["x"] == "xv2:1"
    assert [late.source_id for late in upstream.late_inputs] == ["x"]


async def test_v4_fork_inside_a_loop_restarts_the_loop_at_the_node(backend: Backend) -> None:
    probe = Probe()
    source_id = new_id("loop")
    g = loop_graph(probe)
    source = await engine(backend).run(g, None, run_id=source_id)
    assert source.results["spin"] == 3 and source.visits["spin"] == 3

    fork = await engine(backend).fork(source_id, at="spin", graph=g)

    # Its latest visit ran with 2; the loop runs its max_visits again from there.
    assert fork.visits["spin"] == 3 and fork.results["spin"] == 5
    assert fork.results["after"] == {"after": 3}
    assert probe.executions("seed") == 1


async def test_v4_fork_of_a_run_still_running_and_of_one_waiting_on_a_gate(
    backend: Backend,
) -> None:
    probe = Probe()
    g = fork_graph(probe)
    probe.held = {"c", "d"}
    source_id = new_id("live")
    live = asyncio.create_task(engine(backend).run(g, "in", run_id=source_id))
    await until(running(backend, source_id, "c", "d"), "c and d running")
    probe.held = set()

    fork = await engine(backend).fork(source_id, at="b", graph=g)  # d was running: runs again

    assert fork.status is RunStatus.COMPLETED
    assert probe.executions("a") == 1
    probe.release_all()
    assert (await live).status is RunStatus.COMPLETED

    waiting = new_id("gate")
    eng = engine(backend)
    assert (await eng.run(gate_graph(probe), "x", run_id=waiting)).status is RunStatus.SUSPENDED
    asked = await eng.fork(waiting, at="ship", input="self-approved")
    assert asked.results["ship"] == {"shipped": "self-approved"}
    again = await eng.fork(waiting, at="prep")
    assert again.status is RunStatus.SUSPENDED
    (question,) = again.questions
    assert question.run_id == again.run_id  # the fork asks in its own name
    assert len(await backend.store.list_questions(run_id=waiting)) == 1


async def test_v4_fork_refuses_bad_input_naming_it(backend: Backend) -> None:
    probe = Probe()
    source_id = new_id("source")
    await engine(backend).run(fork_graph(probe), "in", run_id=source_id)
    eng = engine(backend)
    eng.register(fork_graph(probe))
    with pytest.raises(ValueError, match="no such node"):
        await eng.fork(source_id, at="nope")
    changed = fork_graph(probe)
    changed.add_node("late", probe.task())
    changed.add_edge("sink", "late")
    with pytest.raises(ValueError, match="'late' never ran"):
        await eng.fork(source_id, at="late", graph=changed)
    with pytest.raises(tr.RunNotFound):
        await eng.fork(new_id("absent"), at="a")
    listed = {r.run_id for r in await backend.store.list_runs()}
    assert listed == {source_id}  # nothing was created by a refused fork


async def test_v4_fork_reuses_a_map_upstream_with_its_items_and_reruns_one_downstream(
    backend: Backend,
) -> None:
    calls: list[str] = []
    g = tr.Graph("mapped")

    @g.task()
    async def prompts(n: int) -> list[int]:
        calls.append("prompts")
        return list(range(n))

    @g.map(required=3)
    async def sample(i: int) -> int:
        calls.append(f"sample {i}")
        return i * i

    @g.task()
    async def best(samples: list[int]) -> int:
        calls.append("best")
        return sum(samples)

    g.chain("prompts", "sample", "best")
    eng = engine(backend)
    source_id = new_id("mapped")
    source = await eng.run(g, 4, run_id=source_id)
    items = (await backend.store.load_run(source_id)).items
    assert items and source.results["sample"] == [0, 1, 4]
    calls.clear()

    after = await eng.fork(source_id, at="best")  # the map and its decision are reused

    assert after.results == source.results and calls == ["best"]
    assert sorted((await backend.store.load_run(after.run_id)).items) == sorted(items)
    calls.clear()
    again = await eng.fork(source_id, at="sample", input=[5, 6, 7])  # the map runs again
    assert again.results["sample"] == [25, 36, 49] and again.results["best"] == 110
    assert sorted(calls) == ["best", "sample 5", "sample 6", "sample 7"]


async def test_v4_a_forks_first_stretch_names_the_engine_that_drove_it(tmp_path: Path) -> None:
    """W6 for forks: the fork's ``run_started`` records its owner, like any run's."""
    g = tr.Graph("forked_owner")
    g.add_node("a", lambda x: x + 1)
    g.add_node("b", lambda x: x * 2)
    g.chain("a", "b")
    async with SQLiteStore(str(tmp_path / "fork.db")) as store:
        engine = tr.Engine(store=store)
        await engine.run(g, 1, run_id="src")
        forked = await engine.fork("src", at="b", fork_id="fork")
        drivers = stretches_of(await store.events("fork"))
    assert forked.output == 4
    assert [d.owner for d in drivers] == [engine.owner]


async def test_v4_a_fork_whose_input_does_not_encode_is_refused_before_anything_is_written(
    backend: Backend,
) -> None:
    """D5 for forks: a non-JSON ``input`` is refused naming the fork, its node and the input,
    and no run is created (no ghost left ``running`` with nothing to resume)."""
    probe = Probe()
    source_id = new_id("source")
    eng = engine(backend)
    await eng.run(fork_graph(probe), "in", run_id=source_id)
    fork_id = new_id("fork")

    with pytest.raises(tr.EncodeError) as refused:
        await eng.fork(source_id, at="c", input={"when": object()}, fork_id=fork_id)

    message = str(refused.value)
    assert repr(fork_id) in message and "node 'c'" in message and "input" in message
    assert {r.run_id for r in await backend.store.list_runs()} == {source_id}
    with pytest.raises(tr.RunNotFound):
        await backend.store.get_run(fork_id)
    assert probe.executions("c") == 1  # nothing of the fork ran


def streaming_graph(
    tries: dict[str, int], held: dict[str, asyncio.Event] | None = None
) -> tr.Graph:
    """``fork_graph``'s shape, each node streaming its name and payload; ``b``'s first try
    streams, then fails (its stream is ``discarded``), its second streams and returns. A node
    in ``held`` waits for its event before it streams."""
    g = tr.Graph("fork")

    def streaming(name: str, result: Callable[[Any], Any]) -> Callable[[Any], Awaitable[Any]]:
        async def handler(x: Any) -> Any:
            ctx = tr.current_node()
            assert ctx is not None
            if held and name in held:
                await held[name].wait()
            tries[name] = tries.get(name, 0) + 1
            ctx.stream(f"{name} try {tries[name]}")
            if name == "b" and tries[name] == 1:
                raise RuntimeError("b's first try fails")
            ctx.stream({"node": name, "saw": x})
            return result(x)

        return handler

    g.add_node("a", streaming("a", lambda x: None))
    g.add_node("b", streaming("b", lambda x: {"b_saw": x}), retry=tr.RetryPolicy(attempts=2))
    g.add_node("c", streaming("c", lambda x: {"c_saw": x}))
    g.add_node("d", streaming("d", lambda x: {"d_saw": x}))
    g.add_node("sink", lambda xs: xs, "aggregate")
    g.chain("a", "b", "c", "sink")
    g.chain("a", "d", "sink")
    return g


def stream_rows(chunks: list[tr.Chunk]) -> list[tuple[str, int, int, str, Any]]:
    """What a stream says, cursor-free: node, visit, attempt, kind, value."""
    return [(c.node_id, c.visit, c.attempt, c.kind.value, c.value) for c in chunks]


def assert_numbered(chunks: list[tr.Chunk]) -> None:
    """Rows numbered 1..n in order; each row's ``stream`` is its stream's first row's seq."""
    assert [c.seq for c in chunks] == list(range(1, len(chunks) + 1))
    first: dict[tuple[str, int, int | None, int], int] = {}
    for c in chunks:
        key = (c.node_id, c.visit, c.item, c.attempt)
        assert c.stream == first.setdefault(key, c.seq)


async def read_all(backend: Backend, run_id: str, after: int = 0) -> list[tr.Chunk]:
    """The stored stream of ``run_id``, read by an engine that did not drive it."""
    return [c async for c in engine(backend).stream(run_id, after=after)]


async def test_v4_a_fork_carries_the_reused_nodes_accepted_streams_then_its_own(
    backend: Backend,
) -> None:
    tries: dict[str, int] = {}
    g = streaming_graph(tries)
    source_id = new_id("source")
    await engine(backend).run(g, "in", run_id=source_id)
    source = await read_all(backend, source_id)
    assert ("b", 1, 1, "discarded", None) in stream_rows(source)

    fork = await engine(backend).fork(source_id, at="c", graph=g, fork_id=new_id("fork"))

    chunks = await read_all(backend, fork.run_id)
    assert_numbered(chunks)
    reused = [c for c in source if c.node_id in "abd" and (c.node_id, c.attempt) != ("b", 1)]
    carried = stream_rows(reused)
    assert stream_rows(chunks) == [
        *carried,
        ("c", 1, 1, "chunk", "c try 2"),
        ("c", 1, 1, "chunk", {"node": "c", "saw": {"b_saw": None}}),
        ("c", 1, 1, "accepted", None),
    ]
    assert [c.ts for c in chunks[: len(carried)]] == [c.ts for c in reused]
    assert tries == {"a": 1, "b": 2, "c": 2, "d": 1}
    tail = await read_all(backend, fork.run_id, after=len(carried) - 1)  # a cursor into them
    assert [c.seq for c in tail] == list(range(len(carried), len(chunks) + 1))

    again = await engine(backend).fork(
        fork.run_id, at="sink", graph=g
    )  # a fork of a fork carries all
    assert stream_rows(await read_all(backend, again.run_id)) == stream_rows(chunks)


async def test_v4_a_reader_of_a_fork_being_driven_gets_the_carried_streams_before_its_own(
    backend: Backend,
) -> None:
    """A reader in the forking process sees the carried rows once they are committed, while
    the fork's ``c`` is held before publishing anything (S3: no wait for the fork's chunks)."""
    tries: dict[str, int] = {}
    source_id = new_id("source")
    await engine(backend).run(streaming_graph(tries), "in", run_id=source_id)
    release = asyncio.Event()
    g = streaming_graph(tries, {"c": release})
    eng = engine(backend)
    fork_id = new_id("fork")
    seen: list[tr.Chunk] = []

    async def read() -> None:
        await until(lambda: eng.is_driving(fork_id), "the fork driven")
        async for chunk in eng.stream(fork_id):
            seen.append(chunk)

    reader = asyncio.create_task(read())
    fork = asyncio.create_task(eng.fork(source_id, at="c", graph=g, fork_id=fork_id))
    await until(lambda: len(seen) >= 8, "the carried rows read while c is held")
    assert not release.is_set() and {c.node_id for c in seen} == {"a", "b", "d"}
    release.set()
    await fork
    await asyncio.wait_for(reader, 15)
    assert [c.seq for c in seen] == list(range(1, len(seen) + 1))
    assert stream_rows(seen) == stream_rows(await read_all(backend, fork_id))
