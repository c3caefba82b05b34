"""The graph the network-namespace test's workers load with ``--graphs``.

Each handler appends ``run node visit pid`` to the file named by
``$TAILRACE_TEST_SIDE`` as it starts (one ``os.write``, O_APPEND): the hosts
share the file system, only their networks differ. ``crawl`` sleeps
``$TAILRACE_TEST_CRAWL`` seconds and returns the pid of the process that ran
it, so the committed result names the worker whose attempt won; it notes when
it started and when it was stopped (cancelled) in the side file's ``.times``.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import tailrace as tr

SIDE_ENV = "TAILRACE_TEST_SIDE"
CRAWL_ENV = "TAILRACE_TEST_CRAWL"


def _append(path: str, line: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def _log() -> None:
    ctx = tr.current_node()
    _append(os.environ[SIDE_ENV], f"{ctx.run_id} {ctx.node_id} {ctx.visit} {os.getpid()}\n")


def _when(event: str) -> None:
    """``run node pid event time`` in the side file's ``.times`` sibling (one clock: one host)."""
    ctx = tr.current_node()
    line = f"{ctx.run_id} {ctx.node_id} {os.getpid()} {event} {time.time()!r}\n"
    _append(os.environ[SIDE_ENV] + ".times", line)


hops = tr.Graph("netns_hops")


@hops.task()
async def hop(x: int) -> int:
    _log()
    return x


@hops.task()
async def crawl(x: int) -> dict[str, Any]:
    _log()
    _when("started")
    try:
        await asyncio.sleep(float(os.environ.get(CRAWL_ENV, "1")))
    except asyncio.CancelledError:
        _when("stopped")
        raise
    return {"x": x, "pid": os.getpid()}


@hops.task()
async def land(crawled: dict[str, Any]) -> dict[str, Any]:
    _log()
    return {**crawled, "landed": os.getpid()}


hops.chain("hop", "crawl", "land")
