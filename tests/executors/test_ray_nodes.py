"""RayExecutor across the nodes of a Ray cluster: a node removed mid-attempt.

A local cluster (``ray_cluster``: a head with no CPUs, two worker raylets of
one CPU each) runs a durable run's attempts. The raylet running ``work``'s
first try is removed while it runs: the try fails with ``ExecutorLost``, the
node's retry policy runs it again on the other raylet, and the run completes
once: one committed result per node, the upstream visit run once. The tries
finish only once the retry has started, so the first cannot win by luck.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import tailrace as tr
from tailrace.executors import RayExecutor
from tailrace.stores import SQLiteStore
from tests import fixtures

GUARD = 120.0  # hang guard (s): fails a test only when something hangs

pytestmark = pytest.mark.slow  # a Ray cluster of three raylets, one removed


async def test_a_node_removed_mid_attempt_retries_it_on_another_and_the_run_completes_once(
    ray_cluster: Any, graphs: ModuleType, tmp_path: Path
) -> None:
    directory = tmp_path / "work"
    directory.mkdir()
    workdir = str(directory)
    bus = tr.EventBus()
    events: list[tr.Event] = []
    bus.subscribe(events.append)
    raylets = {node.node_id: node for node in ray_cluster.worker_nodes}
    assert len(raylets) == 2
    async with SQLiteStore(tmp_path / "runs.db") as store, RayExecutor() as ray_executor:
        engine = tr.Engine(store=store, executor=ray_executor, bus=bus)
        run = asyncio.create_task(engine.run(graphs.across_nodes(workdir), 5, run_id="across"))
        try:
            await fixtures.until(
                lambda: graphs.marked(workdir, "work.1"), "work's first try", guard=60, every=0.02
            )
            doomed = graphs.read_mark(workdir, "work.1")
            assert doomed in raylets
            await asyncio.to_thread(ray_cluster.remove_node, raylets[doomed], False)
            # Only once the retry runs may the tries finish: the first one's raylet is gone.
            await fixtures.until(
                lambda: graphs.marked(workdir, "work.2"), "work's retry", guard=60, every=0.02
            )
            graphs.mark(workdir, "go")
            async with asyncio.timeout(GUARD):
                result = await run
        finally:
            run.cancel()
        committed = Counter(row.node_id for row in await store.results("across"))
        work_rows = await store.results("across", "work")

    (survivor,) = set(raylets) - {doomed}
    assert result.status == "completed"
    assert result.output == {"x": 5, "node": survivor, "try": 2}  # retried on the other raylet
    assert graphs.read_mark(workdir, "work.2") == survivor
    assert committed == {"first": 1, "work": 1, "after": 1}  # the run completed once
    assert len(work_rows) == 1 and '"try":2' in work_rows[0].value_json.replace(" ", "")
    ran = Counter(row[0] for row in graphs.executions(workdir))
    assert ran == {"first": 1, "work": 2, "after": 1}  # committed visits ran once
    [retrying] = [e for e in events if e.type is tr.EventType.NODE_RETRYING]
    assert retrying.data["error"].startswith("ExecutorLost: run "), retrying.data
    assert "node 'work' (visit 1, try 1)" in retrying.data["error"]
    completed = [e for e in events if e.type is tr.EventType.NODE_COMPLETED]
    assert Counter(e.node_id for e in completed) == {"first": 1, "work": 1, "after": 1}


@pytest.mark.parametrize("ray_cluster", [2], indirect=True)  # two raylets of two CPUs
async def test_a_node_removed_mid_map_retries_its_items_elsewhere_and_reruns_nothing_committed(
    ray_cluster: Any, graphs: ModuleType, tmp_path: Path
) -> None:
    """A map's items spread over both raylets; two return at once and are committed, the
    others wait. The raylet running two of the waiting items is removed: those two fail
    with ``ExecutorLost`` and run again on the other raylet; every other item (the
    committed ones, those on the survivor, those not started yet) runs once, and each
    item's result is committed once."""
    directory = tmp_path / "work"
    directory.mkdir()
    workdir = str(directory)
    items, quick = 8, 2
    bus = tr.EventBus()
    events: list[tr.Event] = []
    bus.subscribe(events.append)
    raylets = {node.node_id: node for node in ray_cluster.worker_nodes}
    async with SQLiteStore(tmp_path / "runs.db") as store, RayExecutor() as ray_executor:
        engine = tr.Engine(store=store, executor=ray_executor, bus=bus)
        graph = graphs.spread_across_nodes(workdir, quick)
        run = asyncio.create_task(engine.run(graph, items, run_id="spread"))
        try:

            async def quick_ones_committed_and_cpus_full() -> bool:
                try:
                    stored = await store.load_run("spread")
                except tr.RunNotFound:
                    return False  # not stored yet
                done = {r.item for r in stored.items if r.status == "completed"}
                waiting = [i for i in range(quick, items) if graphs.tries(workdir, i)]
                return done >= set(range(quick)) and len(waiting) == 4  # four CPUs in all

            await fixtures.until(
                quick_ones_committed_and_cpus_full, "the waiting items", guard=60, every=0.02
            )
            on_node = Counter(graphs.tries(workdir, i)[1] for i in range(quick, items)
                              if graphs.tries(workdir, i))  # fmt: skip
            doomed = next(node for node, n in on_node.items() if n == 2)
            assert doomed in raylets and set(on_node.values()) == {2}
            lost = [i for i in range(quick, items) if graphs.tries(workdir, i).get(1) == doomed]
            await asyncio.to_thread(ray_cluster.remove_node, raylets[doomed], False)

            def both_lost() -> bool:
                seen = {e.data.get("item") for e in events if e.type is tr.EventType.NODE_RETRYING}
                return seen >= set(lost)

            # Only once both tries failed may the others finish (the retries need their CPUs).
            await fixtures.until(both_lost, "the lost items' retries", guard=60, every=0.02)
            graphs.mark(workdir, "go")
            async with asyncio.timeout(GUARD):
                result = await run
        finally:
            run.cancel()
        stored = await store.load_run("spread")

    (survivor,) = set(raylets) - {doomed}
    assert result.status == "completed" and result.output == {"items": items}
    ran = {i: graphs.tries(workdir, i) for i in range(items)}
    for i in range(items):
        if i in lost:  # retried on the other raylet
            assert ran[i] == {1: doomed, 2: survivor}, (i, ran[i])
        else:  # committed before the loss, on the survivor, or started after it: once
            assert len(ran[i]) == 1, (i, ran[i])
    assert len(lost) == 2
    assert sorted((r.item, r.status) for r in stored.items) == [
        (i, "completed") for i in range(items)
    ]
    for row in stored.items:
        value = json.loads(row.value_json or "null")
        assert (value["item"], value["try"]) == (row.item, 2 if row.item in lost else 1)
    retrying = [e for e in events if e.type is tr.EventType.NODE_RETRYING]
    assert sorted(e.data.get("item") for e in retrying) == sorted(lost), retrying
    assert all(e.data["error"].startswith("ExecutorLost: run ") for e in retrying)
    completed = Counter(e.data.get("item") for e in events
                        if e.type is tr.EventType.NODE_COMPLETED and e.node_id == "spread")  # fmt: skip
    assert all(n == 1 for n in completed.values()), completed
