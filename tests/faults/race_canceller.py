"""The canceller of the claim-racing-a-cancel fault test: a process of its own on the store.

``python race_canceller.py URL REPORT SEED RUN_ID...`` watches the runs in the
order given (the order a one-slot FIFO worker claims them) and cancels each as
soon as it sees it leave ``queued`` (the claim), or after a seeded short delay
for one run in four, so cancels land right after a claim and in mid-run too.
It writes one JSON line per run to REPORT once done: what it saw just before
cancelling (status, nodes done), the delay, and what ``Engine.cancel`` answered.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
from pathlib import Path

from tailrace import Engine
from tailrace.stores import RunStatus, open_store

GUARD = 120.0  # seconds a run may stay queued before the canceller gives up (a hang, not timing)


async def cancel_each(url: str, seed: int, run_ids: list[str]) -> list[dict[str, object]]:
    rng = random.Random(seed)
    seen_all: list[dict[str, object]] = []
    async with open_store(url) as store:
        engine = Engine(store=store)
        for run_id in run_ids:
            delay = rng.choice((0.0, 0.0, 0.0, rng.uniform(0.001, 0.05)))
            async with asyncio.timeout(GUARD):
                # Polling is the point: the claim is another process's write.
                while (seen := await store.get_run(run_id)).status is RunStatus.QUEUED:  # noqa: ASYNC110
                    await asyncio.sleep(0)  # as tight as the store allows
            if delay:
                await asyncio.sleep(delay)
                seen = await store.get_run(run_id)
            answer = await engine.cancel(run_id)
            seen_all.append({"run_id": run_id, "seen": seen.status.value,
                             "nodes_done": seen.nodes_done, "answer": answer, "delay": delay})  # fmt: skip
    return seen_all


if __name__ == "__main__":
    url, report, seed, *ids = sys.argv[1:]
    lines = asyncio.run(cancel_each(url, int(seed), ids))
    Path(report).write_text("".join(json.dumps(line) + "\n" for line in lines))
