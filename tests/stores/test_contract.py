"""The store contract, run against every backend (memory, SQLite, Postgres).

Clauses: D1 (one atomic commit per harvest, nothing committed rewritten), D4
(format and schema versions), D6 (leases and fencing tokens).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import os
import sqlite3
import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

import tailrace.stores as stores
from tailrace._errors import (
    LeaseHeld,
    LeaseLost,
    RunExists,
    RunNotFound,
    StoreError,
    UnsupportedFormat,
)
from tailrace.stores import (
    FORMAT_VERSION,
    CheckpointRow,
    EventRow,
    FrozenInput,
    Harvest,
    ItemRow,
    MemoryStore,
    NewRun,
    NodeRow,
    ResultRow,
    RunStatus,
    RunStore,
    SQLiteStore,
    Submission,
    open_store,
)
from tailrace.stores._floor import postgres_raw_commit_rate, sqlite_raw_commit_rate
from tailrace.stores._sql._statements import CREATE_MIGRATIONS_TABLE, MIGRATIONS
from tests.fixtures import POSTGRES_DSN

if TYPE_CHECKING:
    from tests.fixtures import Backend

TTL = 30.0

SRC_DIR = Path(stores.__file__).resolve().parents[2]


def new_run(
    run_id: str = "r1", *, created_at: float = 1.0, version: int = FORMAT_VERSION
) -> NewRun:
    return NewRun(
        run_id=run_id,
        graph_name="g",
        graph_ref="pkg.mod:g",
        fingerprint="fp",
        input_json='{"x":1}',
        created_at=created_at,
        format_version=version,
    )


def event(seq: int, node_id: str | None = "a") -> EventRow:
    return EventRow(
        seq=seq, type="node_completed", node_id=node_id, visit=1, attempt=1, ts=float(seq),
        data_json="{}",
    )  # fmt: skip


def harvest(
    *,
    state: str = '{"step":1}',
    status: RunStatus = RunStatus.RUNNING,
    results: tuple[ResultRow, ...] = (),
    events: tuple[EventRow, ...] = (),
    nodes: tuple[NodeRow, ...] = (),
    frozen: tuple[FrozenInput, ...] = (),
    done: int = 0,
    finished_at: float | None = None,
    error: str | None = None,
) -> Harvest:
    return Harvest(
        state_json=state, status=status, error=error, nodes=nodes, results=results,
        frozen=frozen, events=events, nodes_done_delta=done, finished_at=finished_at,
    )  # fmt: skip


def result(node_id: str, visit: int = 1, value: str = "null") -> ResultRow:
    return ResultRow(node_id=node_id, visit=visit, value_json=value)


async def leased_run(store: RunStore, run_id: str = "r1", owner: str = "A") -> int:
    await store.create_run(new_run(run_id))
    return await store.acquire_lease(run_id, owner, TTL)


# --- create / load --------------------------------------------------------------


async def test_create_then_load_round_trips(store: RunStore) -> None:
    await store.create_run(new_run("r1", created_at=5.0))
    loaded = await store.load_run("r1")
    run = loaded.run
    assert (run.run_id, run.graph_name, run.graph_ref, run.fingerprint) == (
        "r1",
        "g",
        "pkg.mod:g",
        "fp",
    )
    assert (run.status, run.input_json, run.state_json, run.error) == (
        RunStatus.RUNNING,
        '{"x":1}',
        "{}",
        None,
    )
    assert (run.created_at, run.updated_at, run.finished_at, run.nodes_done) == (5.0, 5.0, None, 0)
    assert (run.lease_owner, run.lease_expires, run.lease_token) == (None, None, 0)
    assert run.format_version == FORMAT_VERSION
    assert loaded.nodes == {}
    assert await store.get_run("r1") == run


async def test_create_existing_run_raises_run_exists(store: RunStore) -> None:
    await store.create_run(new_run("r1"))
    with pytest.raises(RunExists, match="r1"):
        await store.create_run(new_run("r1", created_at=9.0))
    assert (await store.get_run("r1")).created_at == 1.0


async def test_unknown_run_raises_run_not_found(store: RunStore) -> None:
    calls = [
        store.load_run("nope"), store.get_run("nope"), store.results("nope"),
        store.frozen_inputs("nope"), store.events("nope"), store.acquire_lease("nope", "A", TTL),
        store.heartbeat("nope", "A", 1, TTL), store.commit("nope", 1, harvest()),
    ]  # fmt: skip
    for call in calls:
        with pytest.raises(RunNotFound, match="nope"):
            await call
    await store.release_lease("nope", "A", 1)  # nothing to release: no error


async def test_commit_applies_every_part_of_a_harvest(store: RunStore) -> None:
    token = await leased_run(store)
    node_a = NodeRow(node_id="a", status="completed", visits=1, data_json='{"k":1}')
    frozen = FrozenInput(node_id="agg", activation=1, payload_json="[1,2]")
    await store.commit(
        "r1", token,
        harvest(nodes=(node_a,), results=(result("a", 1, "null"),), frozen=(frozen,),
                events=(event(1),), done=1),
    )  # fmt: skip
    node_a2 = NodeRow(node_id="a", status="running", visits=2, data_json="{}")
    await store.commit(
        "r1", token,
        harvest(state='{"step":2}', status=RunStatus.FAILED, nodes=(node_a2,),
                error="boom", finished_at=7.0, done=0),
    )  # fmt: skip
    loaded = await store.load_run("r1")
    assert loaded.nodes == {"a": node_a2}  # node rows are upserted
    assert (loaded.run.state_json, loaded.run.status, loaded.run.error) == (
        '{"step":2}', RunStatus.FAILED, "boom",
    )  # fmt: skip
    assert loaded.run.finished_at == 7.0
    assert await store.results("r1") == [result("a", 1, "null")]
    assert await store.frozen_inputs("r1") == [frozen]
    assert await store.events("r1") == [event(1)]


async def test_commit_keeps_finished_at_when_harvest_has_none(store: RunStore) -> None:
    token = await leased_run(store)
    await store.commit("r1", token, harvest(status=RunStatus.SUSPENDED, finished_at=3.0))
    await store.commit("r1", token, harvest(status=RunStatus.RUNNING))
    assert (await store.get_run("r1")).finished_at == 3.0


async def test_commit_reports_a_cancel_requested_from_anywhere(store: RunStore) -> None:
    """W5: the driver of a running run hears a cancel request at its next commit."""
    token = await leased_run(store)
    assert await store.commit("r1", token, harvest(state='{"step":1}')) is False
    assert await store.request_cancel("r1") is RunStatus.RUNNING  # another process asks
    assert await store.commit("r1", token, harvest(state='{"step":2}')) is True
    assert (await store.get_run("r1")).state_json == '{"step":2}'  # and the commit landed


@pytest.mark.parametrize("status", [RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED])
async def test_a_harvest_that_ends_the_run_lets_go_of_its_lease(
    store: RunStore, status: RunStatus
) -> None:
    """The run's end releases its lease in the same write, and says so: no release of its
    own follows (a driver killed right after that commit leaves nothing held)."""
    token = await leased_run(store)
    await store.commit("r1", token, harvest(state='{"step":1}'))
    assert (await store.get_run("r1")).lease_owner == "A"  # a running harvest keeps it
    async with store.changes() as feed:
        await store.commit("r1", token, harvest(status=status, finished_at=3.0))
        kinds = await feed.wait(5.0)
    record = await store.get_run("r1")
    assert (record.status, record.lease_owner, record.lease_expires) == (status, None, None)
    assert record.lease_token == token  # a release keeps the fencing token
    assert "release" in kinds  # workers look at their queues' slots again
    await store.release_lease("r1", "A", token)  # a late release finds nothing held: harmless
    assert await store.get_run("r1") == record


@pytest.mark.parametrize("kind", ["nodes", "items", "checkpoints"])
async def test_load_run_reads_a_run_with_rows_of_one_kind_only(store: RunStore, kind: str) -> None:
    """A run with no node, item or checkpoint rows loads bare (a claimed run, in one read
    on Postgres); one row of any kind, even with no node row, is read with it."""
    token = await leased_run(store)
    bare = await store.load_run("r1")
    assert (bare.nodes, bare.items, bare.checkpoints) == ({}, [], [])
    assert bare.run == await store.get_run("r1")
    rows = {
        "nodes": {"nodes": (NodeRow("a", "running", 1, '{"d":1}'),)},
        "items": {"items": (ItemRow("m", 1, 0, "completed", 1, 1, '"v"', None, None),)},
        "checkpoints": {"checkpoints": (CheckpointRow("a", 1, -1, 1, '{"turn":3}', 2.0),)},
    }[kind]
    await store.commit("r1", token, dataclasses.replace(harvest(), **rows))
    loaded = await store.load_run("r1")
    got = {"nodes": tuple(loaded.nodes.values()), "items": tuple(loaded.items),
           "checkpoints": tuple(loaded.checkpoints)}  # fmt: skip
    assert {k: v for k, v in got.items() if v} == rows
    assert loaded.run.state_json == '{"step":1}'


# --- D1: atomic, append-only ------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        harvest(results=(result("a", 1),)),  # rewrites a committed result
        harvest(results=(result("b", 1), result("b", 1))),  # repeats itself
        harvest(frozen=(FrozenInput(node_id="agg", activation=1, payload_json="[9]"),)),
        harvest(events=(event(1),)),
    ],
    ids=["committed-result", "repeated-result", "committed-frozen", "committed-event"],
)
async def test_a_failing_harvest_writes_nothing(store: RunStore, bad: Harvest) -> None:
    token = await leased_run(store)
    frozen = FrozenInput(node_id="agg", activation=1, payload_json="[1]")
    await store.commit(
        "r1",
        token,
        harvest(results=(result("a", 1),), frozen=(frozen,), events=(event(1),), done=1),
    )
    before = await store.load_run("r1")
    doomed = Harvest(
        state_json='{"step":99}', status=RunStatus.COMPLETED, nodes=(NodeRow(node_id="z", status="completed", visits=1, data_json="{}"),),
        results=(*bad.results, result("c", 1)), frozen=bad.frozen, events=(event(50), *bad.events),
        nodes_done_delta=5, finished_at=9.0,
    )  # fmt: skip
    with pytest.raises(StoreError, match="r1"):
        await store.commit("r1", token, doomed)
    after = await store.load_run("r1")
    assert after.nodes == before.nodes
    assert (after.run.state_json, after.run.status, after.run.nodes_done) == (
        '{"step":1}',
        RunStatus.RUNNING,
        1,
    )
    assert after.run.finished_at is None
    assert await store.results("r1") == [result("a", 1)]
    assert await store.frozen_inputs("r1") == [frozen]
    assert await store.events("r1") == [event(1)]


async def test_illegal_status_transition_is_rejected(store: RunStore) -> None:
    token = await leased_run(store)
    await store.commit("r1", token, harvest(status=RunStatus.COMPLETED, finished_at=2.0))
    with pytest.raises(StoreError, match=r"r1.*completed -> running"):
        await store.commit("r1", token, harvest(state='{"again":1}', results=(result("a"),)))
    assert (await store.get_run("r1")).status == RunStatus.COMPLETED
    assert await store.results("r1") == []


async def test_suspended_run_cannot_complete_without_running(store: RunStore) -> None:
    token = await leased_run(store)
    await store.commit("r1", token, harvest(status=RunStatus.SUSPENDED))
    with pytest.raises(StoreError, match="suspended -> completed"):
        await store.commit("r1", token, harvest(status=RunStatus.COMPLETED))
    await store.commit("r1", token, harvest(status=RunStatus.RUNNING))
    await store.commit("r1", token, harvest(status=RunStatus.COMPLETED))


async def test_nodes_done_accumulates(store: RunStore) -> None:
    token = await leased_run(store)
    for delta in (3, 0, 4):
        await store.commit("r1", token, harvest(done=delta))
    assert (await store.get_run("r1")).nodes_done == 7


# --- D6: leases and fencing -------------------------------------------------------


async def test_takeover_fences_out_the_old_owner(backend: Backend) -> None:
    store = backend.store
    token_a = await leased_run(store, owner="A")
    await store.commit("r1", token_a, harvest(state='{"by":"A"}', results=(result("a"),), done=1))
    backend.clock.advance(TTL + 1)
    token_b = await store.acquire_lease("r1", "B", TTL)
    assert token_b > token_a
    before = await store.load_run("r1")
    with pytest.raises(LeaseLost, match="r1"):
        await store.commit(
            "r1", token_a, harvest(state='{"by":"A2"}', results=(result("b"),), done=1)
        )
    with pytest.raises(LeaseLost, match="r1"):
        await store.heartbeat("r1", "A", token_a, TTL)
    await store.release_lease("r1", "A", token_a)  # stale: does nothing
    after = await store.load_run("r1")
    assert after == before
    assert (after.run.lease_owner, after.run.lease_token) == ("B", token_b)
    assert await store.results("r1") == [result("a")]
    await store.commit("r1", token_b, harvest(state='{"by":"B"}', done=1))
    assert (await store.get_run("r1")).nodes_done == 2


async def test_live_lease_of_another_owner_raises_lease_held(backend: Backend) -> None:
    store = backend.store
    await leased_run(store, owner="A")
    backend.clock.advance(TTL - 1)
    with pytest.raises(LeaseHeld, match=r"r1.*'A'"):
        await store.acquire_lease("r1", "B", TTL)


async def test_same_owner_reacquire_keeps_token_and_extends(backend: Backend) -> None:
    store = backend.store
    token = await leased_run(store, owner="A")
    backend.clock.advance(10)
    assert await store.acquire_lease("r1", "A", TTL) == token
    assert (await store.get_run("r1")).lease_expires == backend.clock.now + TTL


async def test_heartbeat_extends_the_lease(backend: Backend) -> None:
    store = backend.store
    token = await leased_run(store, owner="A")
    backend.clock.advance(TTL - 1)
    await store.heartbeat("r1", "A", token, TTL)
    backend.clock.advance(TTL - 1)  # past the first expiry, not the extended one
    with pytest.raises(LeaseHeld):
        await store.acquire_lease("r1", "B", TTL)


async def test_release_then_acquire_gives_a_larger_token(store: RunStore) -> None:
    token = await leased_run(store, owner="A")
    await store.release_lease("r1", "A", token)
    run = await store.get_run("r1")
    assert (run.lease_owner, run.lease_expires, run.lease_token) == (None, None, token)
    assert await store.acquire_lease("r1", "B", TTL) == token + 1
    with pytest.raises(LeaseLost):
        await store.heartbeat("r1", "A", token, TTL)


async def test_expired_lease_taken_back_by_same_owner_gets_new_token(backend: Backend) -> None:
    token = await leased_run(backend.store, owner="A")
    backend.clock.advance(TTL + 1)
    assert await backend.store.acquire_lease("r1", "A", TTL) == token + 1


@pytest.mark.parametrize("ttl", [0.0, -1.0, float("nan"), float("inf")])
async def test_bad_ttl_is_a_value_error(store: RunStore, ttl: float) -> None:
    await store.create_run(new_run("r1"))
    with pytest.raises(ValueError, match="ttl"):
        await store.acquire_lease("r1", "A", ttl)


async def test_expired_leases_finds_running_orphans_only(backend: Backend) -> None:
    store, now = backend.store, backend.clock.now
    for run_id in ("never-leased", "live", "expired", "done", "parked", "released"):
        await store.create_run(new_run(run_id))
    await store.acquire_lease("live", "A", 100)
    await store.acquire_lease("expired", "A", 5)
    done = await store.acquire_lease("done", "A", 5)
    await store.commit("done", done, harvest(status=RunStatus.COMPLETED))
    parked = await store.acquire_lease("parked", "A", 5)
    await store.commit("parked", parked, harvest(status=RunStatus.SUSPENDED))
    released = await store.acquire_lease("released", "A", 100)
    await store.release_lease("released", "A", released)
    found = await store.expired_leases(now + 10)
    assert sorted(found) == ["expired", "never-leased", "released"]
    assert await store.expired_leases(now + 1) == sorted(["never-leased", "released"])
    assert len(await store.expired_leases(now + 10, limit=2)) == 2


# --- queries ------------------------------------------------------------------------


async def test_events_are_in_seq_order_and_filtered(store: RunStore) -> None:
    token = await leased_run(store)
    await store.commit("r1", token, harvest(events=(event(2), event(1, None))))
    await store.commit("r1", token, harvest(events=(event(4), event(3))))
    assert [e.seq for e in await store.events("r1")] == [1, 2, 3, 4]
    assert await store.events("r1", after_seq=2) == [event(3), event(4)]
    assert await store.events("r1", after_seq=4) == []
    assert (await store.events("r1"))[0].node_id is None


async def test_results_by_node_then_visit_and_filtered(store: RunStore) -> None:
    token = await leased_run(store)
    rows = (result("b", 2, "2"), result("a", 1, "1"), result("b", 1, "3"))
    await store.commit("r1", token, harvest(results=rows))
    assert [(r.node_id, r.visit) for r in await store.results("r1")] == [
        ("a", 1),
        ("b", 1),
        ("b", 2),
    ]
    assert await store.results("r1", "b") == [result("b", 1, "3"), result("b", 2, "2")]
    assert await store.results("r1", "zzz") == []


async def test_list_runs_newest_first_by_status(store: RunStore) -> None:
    for i, run_id in enumerate(("old", "mid", "new", "newest")):
        await store.create_run(new_run(run_id, created_at=float(i)))
    token = await store.acquire_lease("mid", "A", TTL)
    await store.commit("mid", token, harvest(status=RunStatus.COMPLETED))
    assert [r.run_id for r in await store.list_runs()] == ["newest", "new", "mid", "old"]
    assert [r.run_id for r in await store.list_runs(status=RunStatus.RUNNING)] == [
        "newest",
        "new",
        "old",
    ]
    assert [r.run_id for r in await store.list_runs(status=RunStatus.COMPLETED)] == ["mid"]
    assert [r.run_id for r in await store.list_runs(limit=2)] == ["newest", "new"]
    assert await store.list_runs(status=RunStatus.FAILED) == []


async def test_list_runs_pages_by_graph_and_queue_and_run_counts_groups_them(
    store: RunStore,
) -> None:
    graphs = ("alpha", "beta", "alpha", "alpha", "beta")
    for i, graph in enumerate(graphs):
        run = dataclasses.replace(new_run(f"r{i}", created_at=float(i)), graph_name=graph)
        await store.create_run(run)
    queued = dataclasses.replace(new_run("q0", created_at=9.0), graph_name="alpha")
    await store.submit_run(queued, Submission(queue="emails"))
    token = await store.acquire_lease("r2", "A", TTL)
    await store.commit("r2", token, harvest(status=RunStatus.COMPLETED))
    newest_first = ["q0", "r4", "r3", "r2", "r1", "r0"]
    assert [r.run_id for r in await store.list_runs()] == newest_first
    assert [r.run_id for r in await store.list_runs(offset=2, limit=3)] == newest_first[2:5]
    assert [r.run_id for r in await store.list_runs(offset=5)] == ["r0"]
    assert await store.list_runs(offset=6) == []
    alpha = await store.list_runs(graph="alpha")
    assert [r.run_id for r in alpha] == ["q0", "r3", "r2", "r0"]
    assert [r.run_id for r in await store.list_runs(graph="alpha", offset=1, limit=2)] == [
        "r3",
        "r2",
    ]
    assert [r.run_id for r in await store.list_runs(graph="alpha", queue="emails")] == ["q0"]
    assert await store.list_runs(graph="gamma") == []
    counts = [(c.graph_name, c.queue_name, c.status, c.count) for c in await store.run_counts()]
    assert counts == [
        ("alpha", None, RunStatus.COMPLETED, 1),
        ("alpha", None, RunStatus.RUNNING, 2),
        ("alpha", "emails", RunStatus.QUEUED, 1),
        ("beta", None, RunStatus.RUNNING, 2),
    ]
    with pytest.raises(ValueError, match="graph"):
        await store.list_runs(graph="bad\x00name")


# --- concurrency (group commit) -----------------------------------------------------------


async def test_many_concurrent_commits_all_land(store: RunStore) -> None:
    runs = [f"run-{i}" for i in range(20)]
    await asyncio.gather(*(store.create_run(new_run(r)) for r in runs))
    tokens = dict(
        zip(
            runs,
            await asyncio.gather(*(store.acquire_lease(r, "A", TTL) for r in runs)),
            strict=True,
        )
    )
    commits = [
        store.commit(r, tokens[r], harvest(results=(result("n", v),), events=(event(v),), done=1))
        for v in range(1, 11)
        for r in runs
    ]
    await asyncio.gather(*commits)
    for r in runs:
        assert (await store.get_run(r)).nodes_done == 10
        assert [x.visit for x in await store.results(r)] == list(range(1, 11))


async def test_failing_writes_do_not_poison_their_group(store: RunStore) -> None:
    runs = [f"run-{i}" for i in range(10)]
    for r in runs:
        await store.create_run(new_run(r))
    tokens = {r: await store.acquire_lease(r, "A", TTL) for r in runs}
    await store.commit("run-0", tokens["run-0"], harvest(results=(result("dup"),)))
    outcomes = await asyncio.gather(
        *(store.commit(r, tokens[r], harvest(results=(result("x"),), done=1)) for r in runs[1:5]),
        store.commit("run-0", tokens["run-0"], harvest(results=(result("dup"),), done=1)),
        store.commit("run-5", tokens["run-5"] + 7, harvest(results=(result("x"),), done=1)),
        store.create_run(new_run("run-6")),
        *(store.commit(r, tokens[r], harvest(results=(result("x"),), done=1)) for r in runs[6:]),
        return_exceptions=True,
    )
    kinds = [type(o).__name__ for o in outcomes]
    assert kinds == ["bool"] * 4 + ["StoreError", "LeaseLost", "RunExists"] + ["bool"] * 4
    for r in runs[1:5] + runs[6:]:
        assert (await store.get_run(r)).nodes_done == 1
    assert (await store.get_run("run-0")).nodes_done == 0
    assert await store.results("run-5") == []


async def test_cancelled_commit_raises_cancelled_error(store: RunStore) -> None:
    token = await leased_run(store)
    task = asyncio.create_task(store.commit("r1", token, harvest(done=1)))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


# --- D4: formats --------------------------------------------------------------------------


async def test_run_in_newer_format_is_refused(backend: Backend) -> None:
    store = backend.store
    token = await leased_run(store)
    await backend.set_format_version("r1", FORMAT_VERSION + 1)
    with pytest.raises(UnsupportedFormat, match=r"r1.*format"):
        await store.load_run("r1")
    with pytest.raises(UnsupportedFormat, match="r1"):
        await store.commit("r1", token, harvest(done=1))
    assert (await store.get_run("r1")).nodes_done == 0


async def test_creating_a_run_in_a_newer_format_is_refused(store: RunStore) -> None:
    with pytest.raises(UnsupportedFormat, match="r1"):
        await store.create_run(new_run("r1", version=FORMAT_VERSION + 1))
    with pytest.raises(RunNotFound):
        await store.get_run("r1")


# --- several stores on one database ------------------------------------------------------


async def test_two_stores_on_one_database_share_runs_and_fencing(backend: Backend) -> None:
    if backend.sibling is None:
        pytest.skip("a memory store is one process's own")
    async with backend.sibling() as other:
        token_a = await leased_run(backend.store, owner="A")
        assert (await other.get_run("r1")).lease_owner == "A"
        with pytest.raises(LeaseHeld):
            await other.acquire_lease("r1", "B", TTL)
        backend.clock.advance(TTL + 1)
        token_b = await other.acquire_lease("r1", "B", TTL)
        with pytest.raises(LeaseLost):
            await backend.store.commit("r1", token_a, harvest(done=1))
        await other.commit("r1", token_b, harvest(done=2, results=(result("a"),)))
        assert (await backend.store.get_run("r1")).nodes_done == 2
        assert await backend.store.results("r1") == [result("a")]


async def test_open_and_close_are_idempotent(backend: Backend) -> None:
    await backend.store.open()
    await backend.store.create_run(new_run("r1"))
    await backend.store.close()
    await backend.store.close()
    await backend.store.open()
    assert (await backend.store.get_run("r1")).run_id == "r1"


async def test_closed_database_store_refuses_work(backend: Backend) -> None:
    if backend.sibling is None:
        pytest.skip("a memory store keeps working: it has nothing to close")
    await backend.store.close()
    with pytest.raises(StoreError, match="not open"):
        await backend.store.get_run("r1")
    with pytest.raises(StoreError, match="not open"):
        await backend.store.create_run(new_run("r1"))
    await backend.store.open()


# --- SQLite specifics -----------------------------------------------------------------------


def _disk_state(path: Path) -> tuple[str, int]:
    """Digest of the database file and size of its WAL (0 if none)."""
    wal = Path(f"{path}-wal")
    return hashlib.sha256(path.read_bytes()).hexdigest(), wal.stat().st_size if wal.exists() else 0


async def test_sqlite_refuses_a_newer_schema_and_writes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    async with SQLiteStore(path) as store:
        await store.create_run(new_run("r1"))
    with sqlite3.connect(path, isolation_level=None) as conn:
        conn.execute("INSERT INTO schema_migrations (version, applied_at) VALUES (999, 0)")
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    before = _disk_state(path)
    with pytest.raises(UnsupportedFormat, match=r"schema version 999.*upgrade"):
        await SQLiteStore(path).open()
    assert _disk_state(path) == before


async def test_sqlite_records_its_migrations(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    async with SQLiteStore(path):
        pass
    async with SQLiteStore(path):  # a second open applies nothing again
        pass
    with sqlite3.connect(path) as conn:
        rows = conn.execute("SELECT version FROM schema_migrations").fetchall()
        mode = conn.execute("PRAGMA journal_mode").fetchone()[0]
    conn.close()
    assert rows == [(v,) for v, _ in MIGRATIONS]
    assert mode == "wal"


async def test_sqlite_driver_errors_become_store_errors(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="cannot open") as info:
        await SQLiteStore(tmp_path).open()  # a directory, not a database
    assert isinstance(info.value.__cause__, sqlite3.Error)


def test_sqlite_store_needs_a_file() -> None:
    with pytest.raises(ValueError, match="MemoryStore"):
        SQLiteStore(":memory:")
    with pytest.raises(ValueError, match="synchronous"):
        SQLiteStore("x.db", synchronous="off")  # type: ignore[arg-type]


_WORKER = """
import asyncio, sys
from tailrace.stores import SQLiteStore, NewRun, Harvest, ResultRow

async def main(path, prefix):
    async with SQLiteStore(path, busy_timeout=30) as store:
        for i in range(40):
            run_id = f"{prefix}-{i}"
            await store.create_run(NewRun(run_id=run_id, graph_name="g", graph_ref=None,
                                          fingerprint="f", input_json="null", created_at=i))
            token = await store.acquire_lease(run_id, prefix, 30)
            await store.commit(run_id, token, Harvest(state_json="{}", nodes_done_delta=1,
                               results=(ResultRow(node_id="n", visit=1, value_json="1"),)))

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


async def test_sqlite_is_safe_across_processes(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    src = str(SRC_DIR)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")])),
    }
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable, "-c", _WORKER, str(path), name, env=env
        )
        for name in ("p1", "p2", "p3")
    ]
    assert [await p.wait() for p in procs] == [0, 0, 0]
    async with SQLiteStore(path) as store:
        runs = await store.list_runs()
        assert len(runs) == 120
        assert all(r.nodes_done == 1 for r in runs)


# --- Postgres specifics -----------------------------------------------------------------------


@pytest.mark.postgres
async def test_postgres_refuses_a_newer_schema_and_writes_nothing(pg_backend: Backend) -> None:
    backend = pg_backend
    import psycopg
    from psycopg import sql

    from tailrace.stores import PostgresStore

    assert isinstance(backend.store, PostgresStore)
    schema = backend.store.schema
    dsn = POSTGRES_DSN
    assert dsn is not None
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(
            sql.SQL("INSERT INTO {}.schema_migrations VALUES (999, 0)").format(
                sql.Identifier(schema)
            )
        )
        with pytest.raises(UnsupportedFormat, match=r"schema version 999.*upgrade"):
            await PostgresStore(dsn, schema=schema).open()
        cur = await conn.execute(
            sql.SQL("SELECT version FROM {}.schema_migrations ORDER BY version").format(
                sql.Identifier(schema)
            )
        )
        assert await cur.fetchall() == [(v,) for v, _ in MIGRATIONS] + [(999,)]


@pytest.mark.postgres
async def test_postgres_driver_errors_become_store_errors(pg_backend: Backend) -> None:
    backend = pg_backend
    import psycopg
    from psycopg import sql

    from tailrace.stores import PostgresStore

    assert isinstance(backend.store, PostgresStore) and POSTGRES_DSN is not None
    async with await psycopg.AsyncConnection.connect(POSTGRES_DSN, autocommit=True) as conn:
        table = sql.Identifier(backend.store.schema, "runs")
        await conn.execute(sql.SQL("DROP TABLE {} CASCADE").format(table))
    with pytest.raises(StoreError, match="bad") as info:
        await backend.store.create_run(new_run("bad"))
    assert isinstance(info.value.__cause__, psycopg.Error)


@pytest.mark.postgres
@pytest.mark.skipif(POSTGRES_DSN is None, reason="TAILRACE_TEST_POSTGRES_DSN is not set")
async def test_postgres_concurrent_opens_of_a_fresh_schema_migrate_once() -> None:
    import psycopg
    from psycopg import sql

    from tailrace.stores import PostgresStore

    assert POSTGRES_DSN is not None
    schema = f"tailrace_race_{uuid.uuid4().hex[:12]}"
    racers = [PostgresStore(POSTGRES_DSN, schema=schema) for _ in range(4)]
    try:
        await asyncio.gather(*(s.open() for s in racers))
        await racers[0].create_run(new_run("r1"))
        assert (await racers[3].get_run("r1")).run_id == "r1"
        async with await psycopg.AsyncConnection.connect(POSTGRES_DSN) as conn:
            cur = await conn.execute(
                sql.SQL("SELECT version FROM {}.schema_migrations").format(sql.Identifier(schema))
            )
            assert await cur.fetchall() == [(v,) for v, _ in MIGRATIONS]
    finally:
        await asyncio.gather(*(s.close() for s in racers))
        async with await psycopg.AsyncConnection.connect(POSTGRES_DSN, autocommit=True) as conn:
            await conn.execute(
                sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema))
            )


# --- the package facade -------------------------------------------------------------------------


def test_open_store_picks_the_backend(tmp_path: Path) -> None:
    assert isinstance(open_store(":memory:"), MemoryStore)
    assert isinstance(open_store("memory:"), MemoryStore)
    sqlite_store = open_store(tmp_path / "x.db")
    assert isinstance(sqlite_store, SQLiteStore)
    assert sqlite_store.path == str(tmp_path / "x.db")
    pg = open_store("postgresql://u@localhost/db")
    assert type(pg).__name__ == "PostgresStore"
    assert type(open_store("postgres://u@localhost/db")).__name__ == "PostgresStore"


def test_postgres_store_without_psycopg_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "psycopg", None)  # as if not installed
    monkeypatch.delitem(sys.modules, "tailrace.stores.postgres", raising=False)
    with pytest.raises(ImportError, match=r"pip install 'tailrace\[postgres\]'"):
        stores.PostgresStore  # noqa: B018
    with pytest.raises(ImportError, match="tailrace"):
        open_store("postgresql://u@localhost/db")
    assert isinstance(open_store("x.db"), SQLiteStore)  # the rest still works


async def test_sqlite_full_synchronous_works(tmp_path: Path) -> None:
    async with SQLiteStore(tmp_path / "full.db", synchronous="full") as store:
        token = await leased_run(store)
        await store.commit("r1", token, harvest(done=1))
        assert (await store.get_run("r1")).nodes_done == 1


# --- benchmark floors (smoke only: rates are measured in bench/, never asserted here) ------------


def test_sqlite_raw_commit_rate_measures_and_cleans_up(tmp_path: Path) -> None:
    path = tmp_path / "floor.db"
    assert sqlite_raw_commit_rate(path, 20) > 0
    assert sqlite_raw_commit_rate(path, 5, "full") > 0
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT name FROM sqlite_master").fetchall() == []
    conn.close()
    with pytest.raises(ValueError, match="n must be"):
        sqlite_raw_commit_rate(path, 0)


@pytest.mark.postgres
@pytest.mark.skipif(POSTGRES_DSN is None, reason="TAILRACE_TEST_POSTGRES_DSN is not set")
def test_postgres_raw_commit_rate_measures(tmp_path: Path) -> None:
    assert POSTGRES_DSN is not None
    assert postgres_raw_commit_rate(POSTGRES_DSN, 20) > 0


# --- parked items: claims bounded and given back (P4) ---------------------------------------


def parked_row(n: int, node_id: str = "roll") -> stores.ParkedRow:
    return stores.ParkedRow(
        park_id=f"p{n}", graph_name="g", node_id=node_id, run_id="seed", visit=1, item=n,
        value_json=str(n), checkpoint_json=None, parked_at=float(n),
    )  # fmt: skip


async def park(store: RunStore, count: int) -> None:
    token = await leased_run(store, "seed")
    await store.commit("seed", token, dataclasses.replace(
        harvest(), parked=tuple(parked_row(n) for n in range(count))
    ))  # fmt: skip


async def test_parked_items_are_listed_by_the_run_that_parked_them(store: RunStore) -> None:
    await park(store, 3)
    token = await leased_run(store, "other")
    mine = parked_row(7)._replace(park_id="o7", run_id="other")
    await store.commit("other", token, dataclasses.replace(harvest(), parked=(mine,)))
    assert [r.park_id for r in await store.list_parked(run_id="other")] == ["o7"]
    listed = await store.list_parked(graph_name="g", node_id="roll", status=None, run_id="seed")
    assert [r.park_id for r in listed] == ["p0", "p1", "p2"]
    assert await store.list_parked(run_id="nobody") == []


def test_parked_items_are_indexed_by_run_in_databases_made_before_the_index(
    tmp_path: Path,
) -> None:
    path = tmp_path / "old.db"
    index = next(v for v, statements in MIGRATIONS if "parked_by_run" in " ".join(statements))
    with sqlite3.connect(path) as conn:  # a database of the version before the index
        conn.execute(CREATE_MIGRATIONS_TABLE)
        for version, statements in MIGRATIONS:
            if version < index:
                for statement in statements:
                    conn.execute(statement.replace("/*WITHOUT ROWID*/", "WITHOUT ROWID"))
                conn.execute("INSERT INTO schema_migrations VALUES (?, 0)", (version,))
    conn.close()

    async def open_store() -> None:
        async with stores.SQLiteStore(path):
            pass

    asyncio.run(open_store())
    with sqlite3.connect(path) as conn:
        plan = conn.execute(
            "EXPLAIN QUERY PLAN SELECT * FROM parked_items WHERE run_id = 'r'"
        ).fetchall()
    conn.close()
    assert "parked_by_run" in str(plan)


async def test_a_claim_holds_at_most_its_limit_even_when_claimed_again(store: RunStore) -> None:
    await park(store, 5)
    first = await store.claim_parked("g", "roll", "run/roll/1", limit=2)
    again = await store.claim_parked("g", "roll", "run/roll/1", limit=2)
    assert [r.park_id for r in first] == [r.park_id for r in again] == ["p0", "p1"]
    more = await store.claim_parked("g", "roll", "run/roll/1", limit=3)
    assert [r.park_id for r in more] == ["p0", "p1", "p2"]
    assert [r.park_id for r in await store.list_parked(graph_name="g")] == ["p3", "p4"]


async def test_unclaimed_items_go_back_to_parked_in_their_order(store: RunStore) -> None:
    await park(store, 4)
    await store.claim_parked("g", "roll", "run/roll/1", limit=3)
    await store.claim_parked("g", "roll", "other/roll/1", limit=1)
    # Only what the claimant holds goes back; an item of another claimant stays claimed.
    assert await store.unclaim_parked("run/roll/1", ["p2", "p0", "p3"]) == 2
    assert await store.unclaim_parked("run/roll/1", ["p2", "p0"]) == 0  # idempotent
    rows = await store.list_parked(graph_name="g")
    assert [(r.park_id, r.claimed_by, r.claimed_at) for r in rows] == [
        ("p0", None, None), ("p2", None, None)
    ]  # fmt: skip
    assert [r.park_id for r in await store.list_parked(status=None, claimed_by="run/roll/1")] == [
        "p1"
    ]
    again = await store.claim_parked("g", "roll", "next/roll/1", limit=5)
    assert [r.park_id for r in again] == ["p0", "p2"]


async def test_a_harvest_gives_claimed_items_back_with_its_other_writes(store: RunStore) -> None:
    await park(store, 3)
    await store.claim_parked("g", "roll", "r1/roll/1", limit=3)
    token = await leased_run(store, "r1")
    ending = dataclasses.replace(
        harvest(status=RunStatus.FAILED, error="boom"),
        unclaimed=(("r1/roll/1", "p1"), ("r1/roll/1", "p2"), ("elsewhere/roll/1", "p0")),
    )
    await store.commit("r1", token, ending)
    assert [r.park_id for r in await store.list_parked(graph_name="g")] == ["p1", "p2"]
    (held,) = await store.list_parked(status=stores.ParkedStatus.CLAIMED)
    assert (held.park_id, held.claimed_by) == ("p0", "r1/roll/1")
    assert (await store.get_run("r1")).status is RunStatus.FAILED
