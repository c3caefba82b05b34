"""Checkpoints under faults, on every store: a ``def`` try cut by its timeout that keeps
checkpointing on its thread, and a hedged node SIGKILLed between checkpoints (P1, P2, T3)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import tailrace as tr
from tailrace import current_node
from tailrace.stores import RunStore
from tests import fixtures

each_store = fixtures.each_store
GUARD = fixtures.HANG_GUARD


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
    assert [(c.attempt, c.value_json) for c in stored.checkpoints] == [
        (2, '{"try":2,"turn":7}')
    ]
