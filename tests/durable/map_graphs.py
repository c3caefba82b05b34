"""A map graph for crash tests: a child process runs it on a store and is SIGKILLed mid-map.

Each item appends ``start <item>`` and ``done <item>`` lines to a log file
(flushed and fsynced), so the parent sees which items ran, and how often,
across the kill. Items take longer the higher their index, so a kill lands
with some items committed and some in flight.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any

import tailrace as tr
from tailrace import current_node
from tailrace.stores import open_store

#: Where items log (set in the child from its arguments, in the parent by the test).
LOG: list[Path] = []
ITEMS = 24


def log(line: str) -> None:
    with LOG[0].open("a") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


graph = tr.Graph("map_crash")


@graph.task()
def items(n: int) -> list[int]:
    return list(range(n))


@graph.map(required=20, late="cancel")
async def work(x: int) -> dict[str, Any]:
    ctx = current_node()
    assert ctx is not None
    log(f"start {ctx.item} {ctx.attempt}")
    await asyncio.sleep(0.02 + 0.01 * x)
    log(f"done {ctx.item}")
    return {"x": x, "square": x * x}


@graph.task()
def total(results: list[dict[str, Any]]) -> int:
    return sum(r["square"] for r in results)


graph.chain("items", "work", "total")


async def child(target: str, run_id: str) -> None:
    """Run ``graph`` as ``run_id`` on the store at ``target`` (the process is killed in it)."""
    async with open_store(target) as store:
        await tr.Engine(store=store, capacity=6).run(graph, ITEMS, run_id=run_id)


if __name__ == "__main__":
    LOG.append(Path(sys.argv[3]))
    asyncio.run(child(sys.argv[1], sys.argv[2]))
