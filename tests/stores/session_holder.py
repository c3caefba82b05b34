"""A process present in the fleet with a worker that holds leases (the session tests kill it).

``python session_holder.py URL WORKER_ID N [fork]`` opens the store at URL,
makes WORKER_ID present (``RunStore.presence``), claims N runs of queue ``q``
for it (an hour's lease), prints ``ready SESSION RUN...`` and waits to be
killed. With ``fork``, it first forks a child that sleeps an hour (as a
``multiprocessing`` worker or a node's own fork would outlive it), and prints
``child PID`` before ``ready``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

from tailrace.stores import WorkerRow, open_store


async def main(url: str, worker_id: str, runs: int, fork: bool) -> None:
    now = time.time()
    row = WorkerRow(
        worker_id=worker_id, queues=("q",), concurrency=runs, started_at=now, seen_at=now
    )
    async with open_store(url) as store, store.presence(row) as presence:
        claimed = await store.claim_runs("q", worker_id, 3600.0, limit=runs)
        if fork:
            child = os.fork()
            if child == 0:  # the child: sleeps, with every descriptor the parent had
                signal.pause()  # until it is killed
                os._exit(0)
            print("child", child, flush=True)
        print("ready", presence.session, *claimed, flush=True)
        await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:] == ["fork"]))
