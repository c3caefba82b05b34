"""A hedged node under a crash (T3, T5, D1, D3): a real child process SIGKILLed mid-race.

Killed between the backup's start and any commit of the node, the resume runs
the node once more and commits one attempt's result; killed after the
backup's win was committed, the resume reuses that result and the record of
who won, and runs only what came after. Nothing committed runs again.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import tailrace as tr
from tailrace.stores import RunStore, open_store
from tests import fixtures
from tests.faults import hedge_kill_graphs as graphs
from tests.faults.test_checkpoint_faults import child_process, shared_target

GUARD = fixtures.HANG_GUARD


async def work_rows(store: RunStore, run_id: str) -> tuple[list[str], list[bool]]:
    """``work``'s committed results, and the hedge flag of each ``work`` completion stored."""
    results = [json.loads(r.value_json) for r in await store.results(run_id, "work")]
    completed = [
        bool(json.loads(e.data_json).get("hedge"))
        for e in await store.events(run_id)
        if e.node_id == "work" and e.type == tr.EventType.NODE_COMPLETED.value
    ]
    return results, completed


@contextlib.asynccontextmanager
async def killed(kind: str, tmp_path: Path, mode: str, line: str) -> AsyncIterator[RunStore]:
    """Run ``hedge_kill_graphs`` in ``mode`` in a child process, SIGKILL it once its log has
    ``line``; the store it wrote, for the test to resume the run (``mode`` is its id)."""
    graphs.LOG[:] = [tmp_path / "ran.log"]
    async with (
        shared_target(kind, tmp_path, f"tailrace_hedge_{mode}") as target,
        child_process(
            "tests.faults.hedge_kill_graphs", target, mode, mode, str(graphs.LOG[0])
        ) as child,
        open_store(target) as store,
    ):
        await fixtures.until(lambda: line in graphs.lines(graphs.LOG[0]), line, guard=GUARD)
        os.kill(child.pid, signal.SIGKILL)
        await child.wait()
        yield store


async def resumed(store: RunStore, run_id: str) -> tr.RunResult:
    return await tr.Engine(store=store, tail=graphs.trained_hooks()).resume(run_id, graphs.graph)


@pytest.mark.slow  # a child process per store, SIGKILLed
@pytest.mark.parametrize("kind", fixtures.SHARED_STORES)
async def test_sigkill_between_a_backups_start_and_its_commit_reruns_the_node_once(
    kind: str, tmp_path: Path
) -> None:
    async with killed(kind, tmp_path, "racing", "work backup of 1") as store:
        assert await work_rows(store, "racing") == ([], [])  # nothing of work was committed
        killed_lines = graphs.lines(graphs.LOG[0])
        result = await resumed(store, "racing")
        results, completed = await work_rows(store, "racing")

    assert killed_lines == ["src", "work primary", "work backup of 1"]
    rerun = graphs.lines(graphs.LOG[0])[len(killed_lines) :]
    assert rerun == ["work primary", "after"]  # src is not run again
    assert result.output == "input by the primary!"
    assert (results, completed) == (["input by the primary"], [False])  # one attempt's result


@pytest.mark.slow  # a child process per store, SIGKILLed
@pytest.mark.parametrize("kind", fixtures.SHARED_STORES)
async def test_sigkill_after_a_backup_won_reuses_its_result_and_the_record_that_it_won(
    kind: str, tmp_path: Path
) -> None:
    # "sync": after starts only once work's completion (the backup's) is committed.
    async with killed(kind, tmp_path, "won", "after") as store:
        before = await work_rows(store, "won")
        killed_lines = graphs.lines(graphs.LOG[0])
        result = await resumed(store, "won")
        after = await work_rows(store, "won")

    assert killed_lines == ["src", "work primary", "work backup of 1", "after"]
    assert graphs.lines(graphs.LOG[0])[len(killed_lines) :] == ["after"]  # work is not rerun
    assert before == after == (["input by the backup of 1"], [True])  # the backup won
    assert result.output == "input by the backup of 1!"
