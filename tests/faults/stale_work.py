"""The handlers both deploys of ``stale_flows`` share (``deploys/old``, ``deploys/new``).

A kid logs its run id to ``$TAILRACE_TEST_SIDE`` when its work starts (one O_APPEND
write), so a test counts how often each child's work ran and where, then sleeps
``sleep`` seconds.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import tailrace as tr

SIDE_ENV = "TAILRACE_TEST_SIDE"


async def work(job: dict[str, Any]) -> int:
    ctx = tr.current_node()
    path = os.environ.get(SIDE_ENV)
    if path and ctx is not None:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{ctx.run_id}\n".encode())
        finally:
            os.close(fd)
    await asyncio.sleep(float(job["sleep"]))
    return int(job["n"]) * 10


def jobs(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"n": n, "sleep": spec["sleep"]} for n in range(int(spec["count"]))]
