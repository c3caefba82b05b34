"""A claimer of the claim fault test: a process of its own on the store, killed at random.

``python claimer.py URL LOG OWNER SEED`` claims runs of queue ``q`` as
``OWNER``, one to four at a time (seeded), for as long as it lives: after
each claim it appends one line ``OWNER RUN_ID`` per run to LOG (flushed),
then completes the run with the lease token the claim gave it, as an engine
would. It prints ``ready`` once its store is open. The test SIGKILLs it
mid-claim, mid-finish or in between.
"""

from __future__ import annotations

import asyncio
import random
import sys
from pathlib import Path

from tailrace.stores import Harvest, RunStatus, open_store

TTL = 600.0  # a killed claimer's runs stay its own: the test settles them itself


async def claim_forever(url: str, log: Path, owner: str, seed: int) -> None:
    rng = random.Random(seed)
    async with open_store(url) as store:
        print("ready", flush=True)
        with log.open("a") as out:
            while True:
                claimed = await store.claim_runs("q", owner, TTL, limit=rng.randint(1, 4))
                for run_id in claimed:
                    out.write(f"{owner} {run_id}\n")
                out.flush()
                for run_id in claimed:
                    token = (await store.get_run(run_id)).lease_token
                    done = Harvest(state_json="{}", status=RunStatus.COMPLETED, finished_at=1.0)
                    await store.commit(run_id, token, done)
                if not claimed:
                    await asyncio.sleep(0.005)


if __name__ == "__main__":
    url, log, owner, seed = sys.argv[1:]
    asyncio.run(claim_forever(url, Path(log), owner, int(seed)))
