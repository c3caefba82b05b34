"""Checkpoints at the edges of attempts (P1, P2): tries that are no longer current, hedges,
saves on the way out of a cancellation, and checkpoints a handler waits to be durable.

Each test runs on every store; the crash cases (a real process SIGKILLed) are in
``tests/faults/test_checkpoint_faults.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest

import tailrace as tr
from tailrace import current_node
from tailrace.stores import RunStore
from tests import fixtures

each_store = fixtures.each_store
GUARD = fixtures.HANG_GUARD


# -- a hedged node: the furthest progress of its visit ------------------------------------------


async def test_a_backup_that_got_further_than_its_stalled_primary_holds_the_checkpoint(
    each_store: RunStore,
) -> None:
    from tests.faults.hedge_checkpoint_graphs import trained_hooks

    started: list[int] = []
    g = tr.Graph("overtaken")

    @g.task(hedge=True)
    async def long(n: int) -> Any:
        ctx = current_node()
        assert ctx is not None
        if ctx.resumed_from is not None:
            return ctx.resumed_from.value
        started.append(ctx.attempt)
        turns = 2 if len(started) == 1 else 5  # the primary stalls at turn 2
        for turn in range(1, turns + 1):
            ctx.checkpoint({"by": len(started), "turn": turn})
        if len(started) > 1:
            ctx.stream("backup at turn 5")
        await asyncio.Event().wait()

    engine = tr.Engine(store=each_store, durability="sync", tail=trained_hooks())
    run = asyncio.ensure_future(engine.run(g, 1, run_id="overtaken"))
    await fixtures.until(lambda: started, "the primary started")
    async for _chunk in engine.stream("overtaken"):
        break  # committed with the backup's turn 5
    run.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await run
    result = await tr.Engine(store=each_store).resume("overtaken", g, force=True)
    assert result.output == {"by": 2, "turn": 5}


# -- a checkpoint saved on the way out of a cancellation -----------------------------------------


@pytest.mark.parametrize("durability", ["async", "sync"])
@pytest.mark.parametrize("awaits", [0, 3], ids=["at-once", "after-awaiting"])
async def test_an_item_parked_carries_the_checkpoint_it_saved_on_its_way_out(
    each_store: RunStore, durability: str, awaits: int
) -> None:
    """Saved at once, the checkpoint joins the parked row before its write; saved after the
    handler awaited on its way out, it updates the parked row already written."""
    resumed: list[Any] = []
    at_22 = asyncio.Event()
    g = tr.Graph("parked_on_the_way_out")

    async def roll(x: str) -> str:
        ctx = current_node()
        assert ctx is not None
        if ctx.resumed_from is not None:
            resumed.append(ctx.resumed_from.value)
            return x
        if x != "slow":
            await at_22.wait()
            return x
        turn = 0
        try:
            while True:
                turn = min(turn + 1, 22)
                if turn == 22:
                    at_22.set()  # the quick item returns now, and this one is parked
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            for _ in range(awaits):
                await asyncio.sleep(0)
            ctx.checkpoint({"turn": turn})  # on its way out: the parked item carries it
            raise

    g.add_node("roll", roll, "map", required=1, late="park", resume_parked=True)
    g.add_node("after", lambda xs: xs)  # with "sync", the decision is written before it starts
    g.chain("roll", "after")
    engine = tr.Engine(store=each_store, durability=durability)  # type: ignore[arg-type]
    first = await engine.run(g, ["quick", "slow"], run_id="way-out-1")
    assert [x.reason for x in first.late_inputs] == ["parked"]
    (row,) = await engine.parked(g, "roll")
    assert row.checkpoint_json == '{"turn":22}'
    second = await engine.run(g, [], run_id="way-out-2")
    assert second.output == ["slow"]
    assert resumed == [{"turn": 22}]
