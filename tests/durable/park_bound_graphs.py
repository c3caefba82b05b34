"""Rounds of a map that parks its straggler, for the starvation bound (P5).

Each round's input is a list of fast items; the map (k=2, ``late="park"``,
``resume_parked=True``, ``max_parks=2``) takes round 1's slow straggler first in
every later round. Every item appends ``start <item> <from>`` to a log file
(fsynced) when its attempt starts and ``done <item>`` when it returns, so a test
sees what ran, how often and from where, across processes. Run as a module, it
drives one round in a child process a test SIGKILLs.
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
#: The slow item's turns, each checkpointed (it takes ``TURNS * TURN`` seconds uninterrupted).
TURNS = 40
TURN = 0.05


def _write(line: str) -> None:
    if not LOG:
        return
    with LOG[0].open("a") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


def rounds_graph(max_parks: int = 2) -> tr.Graph:
    """The map of rounds, bounded at ``max_parks`` parks per item."""
    g = tr.Graph("park_rounds")

    @g.task()
    def prompts(items: list[str]) -> list[str]:
        return items

    async def roll(item: str) -> dict[str, object]:
        ctx = current_node()
        assert ctx is not None
        start = int(ctx.resumed_from.value) if ctx.resumed_from else 0
        _write(f"start {item} {start}")
        if not item.startswith("slow"):
            await asyncio.sleep(0.01)
            _write(f"done {item}")
            return {"item": item, "from": start}
        for turn in range(start + 1, TURNS + 1):
            await asyncio.sleep(TURN)
            ctx.checkpoint(turn)
        _write(f"done {item}")
        return {"item": item, "from": start}

    g.add_node(
        "roll", roll, "map", required=2, late="park", resume_parked=True, max_parks=max_parks
    )
    g.chain("prompts", "roll")
    return g


def log_lines(path: Path) -> list[str]:
    """The log's lines, in order."""
    return path.read_text().splitlines() if path.exists() else []


async def child(target: str, run_id: str, items: list[str]) -> None:
    async with open_store(target) as store:
        await tr.Engine(store=store, durability="sync").run(rounds_graph(), items, run_id=run_id)


if __name__ == "__main__":
    LOG.append(Path(sys.argv[3]))
    asyncio.run(child(sys.argv[1], sys.argv[2], sys.argv[4:]))
