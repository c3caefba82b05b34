"""A hedged node for crash tests: a child process runs it and is SIGKILLed mid-race (T3, T5).

``src -> work -> after``; ``work`` is hedged under a :class:`HedgePolicy` and
its primary stalls in the child process. Each handler appends a line to a log
file (what ran, which attempt, whether a backup) before it does anything, so
the parent can tell what ran where and kill the child at the right moment:

- ``racing``: the backup logs its start and stalls too: the parent kills the
  child between the backup's start and any commit of ``work``;
- ``won``: the backup returns at once and wins; ``after`` stalls: the parent
  kills the child once ``after`` started, i.e. once the winner's result (and
  the record that the backup won) was committed (``durability="sync"``).

In the parent's process nothing stalls: its resume runs what the crash left.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import tailrace as tr
from tailrace.stores import open_store
from tailrace.tail import HedgePolicy, TailHooks

graph = tr.Graph("hedged_kill")
#: Set in the child process: there the primary (and, ``racing``, the backup) stall.
CHILD: dict[str, str] = {}
#: Where each process logs what its handlers ran (set by the test, or the child's argv).
LOG: list[Path] = []


def log(line: str) -> None:
    with LOG[0].open("a") as out:
        out.write(line + "\n")


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


@graph.task()
async def src(x: str) -> str:
    log("src")
    return x


@graph.task(hedge=True)
async def work(x: str) -> str:
    ctx = tr.current_node(required=True)
    who = f"backup of {ctx.backup_of}" if ctx.backup else "primary"
    log(f"work {who}")
    if CHILD and (not ctx.backup or CHILD["mode"] == "racing"):
        await asyncio.Event().wait()  # stalls until the process is killed
    return f"{x} by the {who}"


@graph.task()
async def after(x: str) -> str:
    log("after")
    if CHILD.get("mode") == "won":
        await asyncio.Event().wait()
    return x + "!"


graph.chain("src", "work", "after")


def trained_hooks() -> TailHooks:
    """Hooks that expect ``work`` to take 10 ms: its stalled primary is backed up at once."""
    hooks = TailHooks(hedging=HedgePolicy(backup_after=1.0, slack=0.0))
    for _ in range(3):
        hooks.estimator("work").observe(1.0, 0.01)
    return hooks


async def child(target: str, run_id: str) -> None:
    async with open_store(target) as store:
        engine = tr.Engine(store=store, durability="sync", capacity=2, tail=trained_hooks())
        await engine.run(graph, "input", run_id=run_id)


if __name__ == "__main__":
    CHILD["mode"] = sys.argv[3]
    LOG.append(Path(sys.argv[4]))
    asyncio.run(child(sys.argv[1], sys.argv[2]))
