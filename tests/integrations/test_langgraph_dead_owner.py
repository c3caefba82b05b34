"""A LangGraph thread whose driver was SIGKILLed on this host is taken over at once.

A real child process holds the thread's lease (its owner name is the
engine's ``host:pid:start:nonce``); it is killed with SIGKILL. The next
driver's lease on the thread is granted at once, not after the lease's
hour-long ttl, and the dead owner is fenced out (its token is stale).
"""

from __future__ import annotations

import asyncio
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

from tailrace import LeaseLost
from tailrace.core._lease import process_start
from tailrace.integrations._langgraph_leases import ThreadLeases
from tailrace.stores import NewRun, SQLiteStore


async def test_a_thread_leased_by_a_killed_driver_is_taken_over_at_once(tmp_path: Path) -> None:
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "import time; time.sleep(60)"
    )
    try:
        start = process_start(child.pid)
        assert start is not None
        dead = f"{socket.gethostname()}:{child.pid}:{start}:deadbeef"
        async with SQLiteStore(tmp_path / "threads.db") as store:
            await store.create_run(
                NewRun(run_id="t1", graph_name="langgraph:g", graph_ref=None, fingerprint="fp",
                       input_json="null", created_at=time.time())
            )  # fmt: skip
            stale = await store.acquire_lease("t1", dead, 3600.0)
            child.send_signal(signal.SIGKILL)
            await child.wait()
            leases = ThreadLeases(store, "next-driver", 30.0)
            async with leases.own("t1") as lease:
                assert lease.owner == "next-driver" and lease.token > stale
                with pytest.raises(LeaseLost):
                    await store.heartbeat("t1", dead, stale, 30.0)  # fenced out (D6)
            async with leases.for_step("t1") as lease:
                assert lease.own and lease.owner == "next-driver"
    finally:
        if child.returncode is None:
            child.kill()
            await child.wait()
