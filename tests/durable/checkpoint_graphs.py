"""A 100-turn node for crash tests: a child process runs it and is SIGKILLed between checkpoints.

Each turn appends ``turn <n>`` to a log file (fsynced) once it is done, and
checkpoints its count (``durability="sync"``: committed at once), so the
parent sees which turns ran, and how often, across the kill.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import tailrace as tr
from tailrace import current_node
from tailrace.stores import open_store

LOG: list[Path] = []
TURNS = 100

graph = tr.Graph("hundred_turns")


@graph.task()
async def session(n: int) -> int:
    ctx = current_node()
    assert ctx is not None
    start = int(ctx.resumed_from.value) if ctx.resumed_from else 0
    for turn in range(start + 1, TURNS + 1):
        await asyncio.sleep(0.005)  # one turn of work
        with LOG[0].open("a") as f:
            f.write(f"turn {turn}\n")
            f.flush()
            os.fsync(f.fileno())
        ctx.checkpoint(turn)
    return TURNS


def turns_done(path: Path) -> list[int]:
    """The turns the log says ran, in order (a turn run twice appears twice)."""
    if not path.exists():
        return []
    return [int(line.split()[1]) for line in path.read_text().splitlines() if line]


async def child(target: str, run_id: str) -> None:
    async with open_store(target) as store:
        await tr.Engine(store=store, durability="sync").run(graph, 1, run_id=run_id)


if __name__ == "__main__":
    LOG.append(Path(sys.argv[3]))
    asyncio.run(child(sys.argv[1], sys.argv[2]))
