"""Graphs the worker tests submit; a module file, so worker processes load it with ``--graphs``.

Handlers that should leave a trace append ``run node visit`` to the file named
by ``$TAILRACE_TEST_SIDE`` when they start (one ``os.write`` each, O_APPEND).
``HOLD`` lets an in-process test keep a handler running until it says so.
"""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

import tailrace as tr

SIDE_ENV = "TAILRACE_TEST_SIDE"

#: Per test: events that hold handlers, and what they saw (set up by ``reset``).
HOLD: dict[str, asyncio.Event] = {}
SEEN: dict[str, list[Any]] = {}


def reset() -> None:
    """Fresh events for a test (an event binds to the loop it is first awaited on)."""
    HOLD.clear()
    SEEN.clear()
    for name in ("release", "started"):
        HOLD[name] = asyncio.Event()
    for name in ("cancelled", "starts", "running", "peak"):
        SEEN[name] = []


def _log() -> None:
    path = os.environ.get(SIDE_ENV)
    if not path:
        return
    ctx = tr.current_node()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{ctx.run_id} {ctx.node_id} {ctx.visit}\n".encode())
    finally:
        os.close(fd)


# -- a plain chain -------------------------------------------------------------------------

chain = tr.Graph("fleet_chain")


@chain.task()
async def plus_one(x: int) -> int:
    _log()
    return x + 1


@chain.task()
async def doubled(x: int) -> int:
    return x * 2


chain.add_edge("plus_one", "doubled")

# -- one that fails ------------------------------------------------------------------------

failing = tr.Graph("fleet_failing")


@failing.task()
async def refuse(x: int) -> int:
    raise ValueError(f"bad input {x}")


# -- a gate between two tasks ----------------------------------------------------------------

gated = tr.Graph("fleet_gated")


@gated.task()
async def ask(x: Any) -> Any:
    _log()
    return x


@gated.gate()
async def approve(x: Any) -> Any:
    return {"approve?": x}


@gated.task()
async def after(answer: Any) -> Any:
    _log()
    return {"answer": answer}


gated.chain("ask", "approve", "after")

# -- held handlers (in-process tests) -----------------------------------------------------------

held = tr.Graph("fleet_held")


@held.task()
async def first(x: int) -> int:
    return x


@held.task()
async def hold(x: int) -> int:
    """Runs until the test sets ``HOLD['release']``; records cancellation and concurrency."""
    SEEN["starts"].append(tr.current_node().run_id)
    SEEN["running"].append(1)
    SEEN["peak"].append(len(SEEN["running"]))
    HOLD["started"].set()
    try:
        await HOLD["release"].wait()
    except asyncio.CancelledError:
        SEEN["cancelled"].append(tr.current_node().run_id)
        raise
    finally:
        SEEN["running"].pop()
    return x + 100


held.add_edge("first", "hold")

# -- a slow one (processes: a SIGTERM finds it in flight) -------------------------------------------

slow = tr.Graph("fleet_slow")


@slow.task()
async def warm(x: int) -> int:
    _log()
    return x


@slow.task()
async def crawl(x: int) -> int:
    """Sleeps ``$TAILRACE_TEST_CRAWL`` seconds (an hour by default), or, when
    ``$TAILRACE_TEST_CRAWL_UNTIL`` names a file, until that file exists."""
    _log()
    until = os.environ.get("TAILRACE_TEST_CRAWL_UNTIL")
    if until:
        while True:
            if await asyncio.to_thread(os.path.exists, until):
                break
            await asyncio.sleep(0.02)
    else:
        await asyncio.sleep(float(os.environ.get("TAILRACE_TEST_CRAWL", "3600")))
    return x + 1


slow.add_edge("warm", "crawl")

# -- four short steps (a claim racing a cancel, tests/faults) ---------------------------------------

RACE_STEPS = ("first", "second", "third", "last")
race = tr.Graph("claim_race")

for _name in RACE_STEPS:

    async def _race_step(x: int) -> int:
        _log()
        await asyncio.sleep(0.02)  # short: the race is at the claim, not in a long wait
        return x + 1

    race.add_node(_name, _race_step)
race.chain(*RACE_STEPS)
# -- a run that kills every worker that drives it (processes: dead letters) ------------------------

poison = tr.Graph("fleet_poison")


@poison.task()
async def kill_worker(x: int) -> int:
    """Kills the process driving it, each time it runs."""
    _log()
    os.kill(os.getpid(), signal.SIGKILL)
    return x
