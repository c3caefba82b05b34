"""Two runs for the re-run numbering crash test: a child process drives them, each stuck in a
try that streamed, and is SIGKILLed; the parent resumes them (``HANG`` is then False)."""

from __future__ import annotations

import asyncio
import sys

import tailrace as tr
from tailrace import current_node
from tailrace.stores import open_store

#: Whether a first try hangs after it streamed (only in the child process that is killed).
HANG: list[bool] = [False]

node_graph = tr.Graph("tries_node")


@node_graph.task()
async def summarise(x: int) -> str:
    ctx = current_node()
    assert ctx is not None
    if HANG[0]:  # the cut try streams well after its start: ``show`` draws it up to its chunk
        await asyncio.sleep(0.2)
    ctx.stream(f"summarise try {ctx.attempt}")
    if HANG[0]:
        await asyncio.Event().wait()
    return f"summary {x}"


map_graph = tr.Graph("tries_map")


@map_graph.task()
def prompts(n: int) -> list[int]:
    return list(range(n))


async def rollout(x: int) -> int:
    ctx = current_node()
    assert ctx is not None
    ctx.stream(f"rollout {x} try {ctx.attempt}")
    if HANG[0] and x == 1:
        await asyncio.Event().wait()
    return x


map_graph.add_node("rollout", rollout, "map")
map_graph.chain("prompts", "rollout")


async def child(target: str) -> None:
    HANG[0] = True
    async with open_store(target) as store:
        engine = tr.Engine(store=store, durability="sync")
        await asyncio.gather(
            engine.run(node_graph, 7, run_id="tries-node"),
            engine.run(map_graph, 3, run_id="tries-map"),
        )


if __name__ == "__main__":
    asyncio.run(child(sys.argv[1]))
