"""A node that kills its own process right after ``checkpoint_durable`` returns (P1).

Run as a child process under ``durability="async"``: turns 1 to 15 are plain
checkpoints, turn 16 waits for its commit, then the process SIGKILLs itself.
The parent resumes the run: the node continues from turn 16.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import tailrace as tr
from tailrace import current_node
from tailrace.stores import open_store

graph = tr.Graph("durable_turns")


@graph.task()
async def session(n: int) -> int:
    ctx = current_node()
    assert ctx is not None
    if ctx.resumed_from is not None:
        return int(ctx.resumed_from.value)
    for turn in range(1, 16):
        ctx.checkpoint(turn)
    await ctx.checkpoint_durable(16)
    os.kill(os.getpid(), signal.SIGKILL)  # at once: nothing else is written
    return 0


async def child(target: str, run_id: str) -> None:
    async with open_store(target) as store:
        await tr.Engine(store=store, durability="async").run(graph, 1, run_id=run_id)


if __name__ == "__main__":
    asyncio.run(child(sys.argv[1], sys.argv[2]))
