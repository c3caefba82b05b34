"""Checkpoints under faults, on every store: a ``def`` try cut by its timeout that keeps
checkpointing on its thread, and a hedged node SIGKILLed between checkpoints (P1, P2, T3)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

import tailrace as tr
from tailrace import current_node
from tailrace.stores import RunStore, open_store
from tests import fixtures

each_store = fixtures.each_store
GUARD = fixtures.HANG_GUARD
ROOT = Path(__file__).resolve().parents[2]


@contextlib.asynccontextmanager
async def shared_target(kind: str, tmp_path: Path, prefix: str) -> AsyncIterator[str]:
    """A store another process can open: a SQLite file, or a Postgres schema of its own."""
    if kind == "sqlite":
        yield str(tmp_path / "runs.db")
        return
    assert fixtures.POSTGRES_DSN is not None
    async with fixtures.postgres_schema(prefix) as schema:
        separator = "&" if "?" in fixtures.POSTGRES_DSN else "?"
        yield f"{fixtures.POSTGRES_DSN}{separator}schema={schema}"


@contextlib.asynccontextmanager
async def child_process(module: str, *args: str) -> AsyncIterator[asyncio.subprocess.Process]:
    """``python -m module args`` from the repository's root; killed on the way out if alive."""
    child = await asyncio.create_subprocess_exec(sys.executable, "-m", module, *args, cwd=ROOT)
    try:
        yield child
    finally:
        if child.returncode is None:
            child.kill()
            await child.wait()


# -- a try that is no longer current -----------------------------------------------------------


def cut_sync_graph(seen: list[Any], late_saved: threading.Event) -> tr.Graph:
    """A ``def`` node whose first try is cut by its timeout and checkpoints on afterwards."""
    g = tr.Graph("cut_sync")
    released = threading.Event()

    def session(n: int) -> str:
        ctx = current_node()
        assert ctx is not None
        if ctx.attempt == 1:
            ctx.checkpoint({"try": 1, "turn": 0})
            released.wait(GUARD)  # the timeout cuts this try meanwhile; its thread runs on
            ctx.checkpoint({"try": 1, "turn": 1})  # late: try 1 is no longer current
            late_saved.set()
            return "late"
        if ctx.attempt == 2:
            ctx.checkpoint({"try": 2, "turn": 7})
            released.set()
            late_saved.wait(GUARD)
            raise ConnectionError("the tool's socket dropped")
        seen.append(None if ctx.resumed_from is None else ctx.resumed_from.value)
        return "done"

    retry = tr.RetryPolicy(attempts=3, retry_on=(TimeoutError, ConnectionError), resume=True)
    g.add_node("session", session, retry=retry, timeout=0.2)
    return g


async def test_a_cut_sync_try_that_keeps_checkpointing_is_dropped(each_store: RunStore) -> None:
    seen: list[Any] = []
    late_saved = threading.Event()
    engine = tr.Engine(store=each_store, durability="sync")
    result = await engine.run(cut_sync_graph(seen, late_saved), 1, run_id="cut-sync")
    assert result.output == "done"
    assert late_saved.is_set()
    assert seen == [{"try": 2, "turn": 7}]  # try 3 continues try 2's progress, not try 1's
    stored = await each_store.load_run("cut-sync")
    assert [(c.attempt, c.value_json) for c in stored.checkpoints] == [(2, '{"try":2,"turn":7}')]


# -- a hedged node: the furthest progress of its visit ------------------------------------------


async def test_a_hedge_backup_never_replaces_the_primarys_further_checkpoint(
    each_store: RunStore,
) -> None:
    from tests.faults import hedge_checkpoint_graphs as graphs

    graphs.STARTED.clear()
    engine = tr.Engine(store=each_store, durability="sync", tail=graphs.trained_hooks())
    run = asyncio.ensure_future(engine.run(graphs.graph, 1, run_id="hedged-cp"))
    await fixtures.until(lambda: graphs.STARTED, "the primary started")
    chunks = []
    async for chunk in engine.stream("hedged-cp"):
        chunks.append(chunk)
        break  # the backup saved its turn 1, committed with this chunk
    assert chunks[0].hedge
    run.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await run
    stored = await each_store.load_run("hedged-cp")
    assert [c.value_json for c in stored.checkpoints] == [str(graphs.PRIMARY_TURNS)]
    result = await tr.Engine(store=each_store).resume("hedged-cp", graphs.graph, force=True)
    assert result.output == graphs.PRIMARY_TURNS  # continued from the primary's turn 90


@pytest.mark.slow  # a child process per store, killed between checkpoints of a hedged node
@pytest.mark.parametrize("kind", fixtures.SHARED_STORES)
async def test_sigkill_between_checkpoints_of_a_hedged_node_resumes_from_the_furthest(
    kind: str, tmp_path: Path
) -> None:
    from tests.faults import hedge_checkpoint_graphs as graphs

    async with (
        shared_target(kind, tmp_path, "tailrace_hedge_kill") as target,
        child_process("tests.faults.hedge_checkpoint_graphs", target, "hedge-kill") as child,
        open_store(target) as store,
    ):

        async def backup_saved() -> bool:
            try:
                rows = await store.chunks("hedge-kill", after=0, limit=10)
            except tr.RunNotFound:
                return False
            return any(r.hedge for r in rows)

        await fixtures.until(backup_saved, "the backup's turn 1 committed", guard=GUARD)
        os.kill(child.pid, signal.SIGKILL)
        await child.wait()
        stored = await store.load_run("hedge-kill")
        result = await tr.Engine(store=store).resume("hedge-kill", graphs.graph)
    assert [c.value_json for c in stored.checkpoints] == [str(graphs.PRIMARY_TURNS)]
    assert result.output == graphs.PRIMARY_TURNS


# -- a checkpoint the handler waits to be durable ---------------------------------------------


@pytest.mark.slow  # a child process per store, killed by its handler
@pytest.mark.parametrize("kind", fixtures.SHARED_STORES)
async def test_a_process_killed_right_after_checkpoint_durable_resumes_from_it(
    kind: str, tmp_path: Path
) -> None:
    from tests.faults import durable_checkpoint_graphs as graphs

    async with (
        shared_target(kind, tmp_path, "tailrace_durable_cp") as target,
        child_process("tests.faults.durable_checkpoint_graphs", target, "durable-cp") as child,
    ):
        assert await asyncio.wait_for(child.wait(), GUARD) == -signal.SIGKILL
        async with open_store(target) as store:
            result = await tr.Engine(store=store).resume("durable-cp", graphs.graph)
    assert result.output == 16


async def test_checkpoint_durable_returns_once_committed_and_at_once_without_a_store(
    each_store: RunStore,
) -> None:
    seen: list[list[str]] = []
    g = tr.Graph("durable_now")

    @g.task()
    async def session(n: int) -> int:
        ctx = current_node()
        assert ctx is not None
        await ctx.checkpoint_durable({"turn": 1})
        stored = await each_store.load_run(ctx.run_id)
        seen.append([c.value_json for c in stored.checkpoints])
        return 1

    await tr.Engine(store=each_store).run(g, 0, run_id="durable-now")
    assert seen == [['{"turn":1}']]

    no_store = tr.Graph("durable_nowhere")

    @no_store.task()
    async def nowhere(n: int) -> int:
        ctx = current_node()
        assert ctx is not None
        await ctx.checkpoint_durable({"turn": 1})  # nothing to commit to: returns at once
        return 1

    assert (await tr.Engine().run(no_store, 0)).output == 1
