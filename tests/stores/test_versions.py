"""The store contract for graph versions and forks, against every backend (V2-V5, D6).

``move_run`` is one fenced write: the lease holder with its token moves a
live run whose fingerprint is still the one it checked, and anything else is
refused with nothing written. ``graph_shape`` keeps the first structure of a
version; a fork's origin round-trips with its run.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import pytest

from tailrace._errors import GraphMismatch, LeaseLost, NotResumable, RunNotFound
from tailrace.stores import (
    ChunkRow,
    FrozenInput,
    Harvest,
    NewRun,
    NodeRow,
    ResultRow,
    RunSnapshot,
    RunStatus,
    Submission,
)

if TYPE_CHECKING:
    from tests.fixtures import Backend

TTL = 30.0


def new_run(run_id: str, **fields: object) -> NewRun:
    base = NewRun(
        run_id=run_id, graph_name="g", graph_ref="pkg.mod:g", fingerprint="v1",
        input_json="null", created_at=1.0, shape_json='{"nodes":[],"edges":[]}',
    )  # fmt: skip
    return dataclasses.replace(base, **fields)  # type: ignore[arg-type]


async def test_v2_the_lease_holder_moves_a_live_run_in_one_write(backend: Backend) -> None:
    store = backend.store
    await store.create_run(new_run("r1"))
    token = await store.acquire_lease("r1", "me", TTL)

    await store.move_run("r1", "me", token, fingerprint="v2", graph_ref="pkg.new:g", expected="v1")

    record = await store.get_run("r1")
    assert (record.fingerprint, record.graph_ref) == ("v2", "pkg.new:g")
    assert record.status is RunStatus.RUNNING and record.lease_token == token


async def test_v2_a_move_is_fenced_and_refused_whole(backend: Backend) -> None:
    store, clock = backend.store, backend.clock
    await store.create_run(new_run("r1"))
    old = await store.acquire_lease("r1", "a", TTL)
    clock.advance(TTL + 1)  # a's lease expired; b takes the run over (D6)
    new = await store.acquire_lease("r1", "b", TTL)
    before = await store.get_run("r1")

    with pytest.raises(LeaseLost):
        await store.move_run("r1", "a", old, fingerprint="v2", graph_ref=None, expected="v1")
    with pytest.raises(LeaseLost):
        await store.move_run("r1", "c", new, fingerprint="v2", graph_ref=None, expected="v1")
    with pytest.raises(GraphMismatch, match="moved meanwhile"):
        await store.move_run("r1", "b", new, fingerprint="v3", graph_ref=None, expected="v0")
    assert await store.get_run("r1") == before

    await store.commit("r1", new, Harvest(state_json="{}", status=RunStatus.COMPLETED))
    with pytest.raises(NotResumable, match="completed"):
        await store.move_run("r1", "b", new, fingerprint="v2", graph_ref=None, expected="v1")
    assert (await store.get_run("r1")).fingerprint == "v1"
    with pytest.raises(RunNotFound):
        await store.move_run("absent", "b", 1, fingerprint="v2", graph_ref=None, expected="v1")
    with pytest.raises(ValueError, match="fingerprint"):
        await store.move_run("r1", "b", new, fingerprint="v\x002", graph_ref=None, expected="v1")


async def test_v1_a_version_structure_is_kept_once_with_its_first_run(backend: Backend) -> None:
    store = backend.store
    assert await store.graph_shape("g", "v1") is None
    await store.create_run(new_run("r1", shape_json='{"first":1}'))
    await store.create_run(new_run("r2", shape_json='{"second":2}'))
    await store.create_run(new_run("r3", shape_json=None, fingerprint="v9"))
    await store.submit_run(
        new_run("q1", fingerprint="v2", shape_json='{"queued":1}'), Submission(queue="q")
    )

    assert await store.graph_shape("g", "v1") == '{"first":1}'
    assert await store.graph_shape("g", "v2") == '{"queued":1}'
    assert await store.graph_shape("g", "v9") is None
    assert await store.graph_shape("other", "v1") is None  # a version is its name and fingerprint


async def test_v4_a_fork_records_its_origin(backend: Backend) -> None:
    store = backend.store
    await store.create_run(new_run("src"))
    await store.create_run(new_run("fork", forked_from="src", forked_at="node"))

    fork, source = await store.get_run("fork"), await store.get_run("src")
    assert (fork.forked_from, fork.forked_at) == ("src", "node")
    assert (source.forked_from, source.forked_at) == (None, None)
    listed = {r.run_id: r.forked_from for r in await store.list_runs()}
    assert listed == {"src": None, "fork": "src"}
    with pytest.raises(ValueError, match="forked_at"):
        await store.create_run(new_run("bad", forked_from="src", forked_at="n\x00"))


async def test_v2_frontiers_lists_the_nodes_with_rows_of_live_runs_in_one_read(
    backend: Backend,
) -> None:
    store = backend.store
    for run_id, graph in (("live", "g"), ("done", "g"), ("other", "h"), ("empty", "g")):
        await store.create_run(new_run(run_id, graph_name=graph))
    for run_id, status in (("live", RunStatus.SUSPENDED), ("done", RunStatus.COMPLETED),
                           ("other", RunStatus.RUNNING)):  # fmt: skip
        token = await store.acquire_lease(run_id, "me", TTL)
        rows = [NodeRow(node_id=n, status="completed", visits=1, data_json="{}") for n in "ab"]
        await store.commit(run_id, token, Harvest(state_json="{}", status=status, nodes=rows))

    assert await store.frontiers("g") == {"live": ("a", "b")}
    assert await store.frontiers("h") == {"other": ("a", "b")}
    assert await store.frontiers("none") == {}


async def test_v4_a_snapshot_holds_a_run_with_its_results_decisions_and_streams(
    backend: Backend,
) -> None:
    """What a fork copies, read in one go: what ``load_run``, ``results``, ``frozen_inputs``
    and ``chunks`` return, none of it written after another part was read."""
    store = backend.store
    await store.create_run(new_run("src"))
    token = await store.acquire_lease("src", "me", TTL)
    for visit, status in ((1, "completed"), (2, "running")):
        nodes = [NodeRow(node_id="a", status=status, visits=visit, data_json="{}")]
        chunk = ChunkRow(
            seq=visit, stream=1, node_id="a", visit=1, item=None, attempt=1, hedge=0,
            kind="chunk" if visit == 1 else "accepted", data_json='"x"' if visit == 1 else None,
            ts=1.0,
        )  # fmt: skip
        harvest = Harvest(
            state_json="{}", nodes=nodes, chunks=[chunk],
            results=[ResultRow(node_id="a", visit=visit, value_json=str(visit))],
            frozen=[FrozenInput(node_id="agg", activation=visit, payload_json="[]")],
        )  # fmt: skip
        await store.commit("src", token, harvest)

    taken = await store.snapshot("src")

    assert isinstance(taken, RunSnapshot)
    assert taken.stored == await store.load_run("src")
    assert taken.results == await store.results("src")
    assert [r.visit for r in taken.results] == [1, 2]
    assert taken.frozen == await store.frozen_inputs("src")
    assert taken.chunks == await store.chunks("src") and len(taken.chunks) == 2
    with pytest.raises(RunNotFound):
        await store.snapshot("absent")
    with pytest.raises(ValueError, match="run_id"):
        await store.snapshot("a\x00b")
