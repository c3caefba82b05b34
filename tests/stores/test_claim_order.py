"""The SQL claim query hands out runs in the order of its Python mirror (W2).

SQLite (the shared SQL of ``stores/_sql``) and the memory store (``claim_order``
in ``stores/_queue_rules``) get the same random backlog: keyed and unkeyed
runs, priorities and estimates, in each queue order; claimed one at a time
(none finishing, so partition limits bite), both hand out the same sequence.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tailrace.stores import MemoryStore, NewRun, Queue, RunStore, SQLiteStore, Submission


async def claim_sequence(store: RunStore, queue: Queue, seed: int) -> list[str]:
    rng = random.Random(seed)
    await store.declare_queue(queue)
    for n in range(60):
        await store.submit_run(
            NewRun(
                run_id=f"r{n:02d}", graph_name="g", graph_ref=None, fingerprint="fp",
                input_json="null", created_at=float(n),
            ),
            Submission(
                queue=queue.name,
                priority=rng.choice([0, 0, 0, 1, 2]),
                partition=rng.choice([None, None, None, "a", "b", "c"]),
                estimate=float(rng.randint(0, 9)),
            ),
        )  # fmt: skip
    order = []
    for _ in range(60):
        ids = await store.claim_runs(queue.name, "w", 30.0, limit=1)
        if not ids:
            break
        order.extend(ids)
    return order


@pytest.mark.parametrize("ordering", ["fifo", "priority", "lpt"])
@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_sql_claims_follow_the_python_claim_order(
    tmp_path: Path, ordering: str, seed: int
) -> None:
    queue = Queue("q", order=ordering, partition_concurrency=2)  # type: ignore[arg-type]
    async with SQLiteStore(str(tmp_path / "claims.db")) as sqlite:
        from_sql = await claim_sequence(sqlite, queue, seed)
    memory = MemoryStore()
    await memory.open()
    from_python = await claim_sequence(memory, queue, seed)
    assert from_sql == from_python
    assert 20 <= len(from_sql) < 60  # keyed runs past their partitions' limit wait
