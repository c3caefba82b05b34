"""``def`` handlers run on their engine's own bounded thread pool.

A ``def`` handler cannot be interrupted: cut (a late map item cancelled, a
timeout, a hedge loser), its thread runs on until it returns while its
result and checkpoints are dropped. The engine's pool counts that thread as
busy until then and has room beyond its capacity for such threads, so other
runs' ``def`` handlers do not queue behind them.
"""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any

import tailrace as tr
from tailrace import current_node
from tests import fixtures

#: What asyncio's default thread pool holds on this machine: that many cut
#: handlers still running used to stop every other ``def`` handler of the process.
DEFAULT_POOL = min(32, (os.cpu_count() or 1) + 4)


def stuck_map(release: threading.Event, started: list[int]) -> tr.Graph:
    """A map whose item 0 wins at once and whose other items block their threads until
    ``release``: ``late="cancel"`` cuts them while they still run."""
    g = tr.Graph("stuck")

    async def win_once_all_started(x: int) -> int:
        await fixtures.until(lambda: len(started) >= DEFAULT_POOL, "every late item started")
        return x

    def each(x: int) -> Any:
        ctx = current_node()
        assert ctx is not None and ctx.item is not None
        if ctx.item == 0:  # the winner waits on the loop, not in a thread
            return win_once_all_started(x)
        started.append(ctx.item)
        release.wait()
        return x

    g.add_node("each", each, "map", required=1, late="cancel")
    return g


def plain() -> tr.Graph:
    g = tr.Graph("plain")

    @g.task()
    def double(x: int) -> int:
        return 2 * x

    return g


async def test_cut_sync_items_do_not_hold_the_threads_another_runs_sync_node_needs() -> None:
    release = threading.Event()
    started: list[int] = []
    engine = tr.Engine(capacity=DEFAULT_POOL + 1)
    try:
        first = await engine.run(stuck_map(release, started), list(range(DEFAULT_POOL + 1)))
        assert first.results["each"] == [0]
        assert sorted(x.item for x in first.late_inputs if x.reason == "cancelled") == list(
            range(1, DEFAULT_POOL + 1)
        )
        assert len(started) == DEFAULT_POOL  # every cut item is still running in its thread
        # The guard only turns a hang (no thread left for the next handler) into a failure.
        async with asyncio.timeout(fixtures.HANG_GUARD):
            second = await engine.run(plain(), 21)
        assert second.output == 42
        assert not release.is_set()  # the cut items had not returned
    finally:
        release.set()


class Wrapped(tr.executors.LocalExecutor):
    """A subclass, so the engine sends attempts through ``invoke`` instead of inline."""


async def test_def_handlers_run_on_the_engines_pool_inline_and_through_a_local_executor() -> None:
    names: list[str] = []
    g = tr.Graph("where")

    @g.task()
    def first(x: int) -> int:
        names.append(threading.current_thread().name)
        return x

    @g.task(executor="wrapped")
    def second(x: int) -> int:
        names.append(threading.current_thread().name)
        return x

    g.add_edge("first", "second")
    engine = tr.Engine(executors={"wrapped": Wrapped()}, handler_threads=1)
    assert (await engine.run(g, 1)).output == 1
    assert len(names) == 2
    assert all(name.startswith("tailrace-def") for name in names), names
