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
