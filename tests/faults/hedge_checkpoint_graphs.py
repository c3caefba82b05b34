"""A hedged node for crash tests: a child process runs it and is SIGKILLed between checkpoints.

The primary checkpoints turns 1 to 90 and stalls; the node is backed up (T3),
and the backup, which starts afresh, checkpoints its turn 1, publishes a
stream chunk saying so (committed with that checkpoint, ``durability="sync"``)
and stalls too. The parent kills the process once that chunk is stored, then
resumes the run: the node continues from the furthest progress of its visit.
"""

from __future__ import annotations

import asyncio
import sys

import tailrace as tr
from tailrace import current_node
from tailrace.stores import open_store
from tailrace.tail._hooks import TailHooks

PRIMARY_TURNS = 90

graph = tr.Graph("hedged_turns")
#: Attempts started in this process: the first is the primary, the next its backup.
STARTED: list[int] = []


@graph.task(hedge=True)
async def long(n: int) -> int:
    ctx = current_node()
    assert ctx is not None
    if ctx.resumed_from is not None:  # the resume after the kill: done from where it stood
        return int(ctx.resumed_from.value)
    STARTED.append(ctx.attempt)
    if len(STARTED) == 1:
        for turn in range(1, PRIMARY_TURNS + 1):
            ctx.checkpoint(turn)
    else:
        ctx.checkpoint(1)
        ctx.stream("backup saved turn 1")
    await asyncio.Event().wait()  # stalls until the process is killed (or the run stopped)
    return 0


def trained_hooks() -> TailHooks:
    """Tail hooks that expect ``long`` to take 10 ms, so its stalled primary is backed up."""
    hooks = TailHooks(factor=3.0)
    for _ in range(3):
        hooks.estimator("long").observe(1.0, 0.01)
    return hooks


async def child(target: str, run_id: str) -> None:
    async with open_store(target) as store:
        engine = tr.Engine(store=store, durability="sync", tail=trained_hooks())
        await engine.run(graph, 1, run_id=run_id)


if __name__ == "__main__":
    asyncio.run(child(sys.argv[1], sys.argv[2]))
