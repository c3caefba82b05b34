"""The SQL claim query hands out runs in the order of its Python mirror (W2).

SQLite and Postgres (the shared SQL of ``stores/_sql``, Postgres with its
``LATERAL`` probes) and the memory store (``claim_order`` in
``stores/_queue_rules``) get the same random backlog: keyed and unkeyed
runs, priorities and estimates, runs submitted at the same moment, delayed
runs (some due, more than a claim's window of them; some not), two graphs, in
each queue order, with and without a partition rate limit; claimed a few at a
time, some claims filtered by graph (none finishing, so partition limits
bite), both hand out the same sequence.
"""

from __future__ import annotations

import contextlib
import random
from pathlib import Path

import pytest

from tailrace.stores import (
    MemoryStore,
    NewRun,
    PostgresStore,
    Queue,
    RunStore,
    SQLiteStore,
    Submission,
)
from tests import fixtures
from tests.fixtures import FakeClock

RUNS = 220


async def claim_sequence(store: RunStore, queue: Queue, seed: int, clock: FakeClock) -> list[str]:
    rng = random.Random(seed)
    await store.declare_queue(queue)
    for n in range(RUNS):
        delay = rng.choice(
            [None, None, -rng.uniform(1, 500), -rng.uniform(1, 500), rng.uniform(1, 30)]
        )
        await store.submit_run(
            NewRun(
                run_id=f"r{n:03d}", graph_name=rng.choice(["g", "g", "h"]), graph_ref=None,
                fingerprint="fp", input_json="null", created_at=float(rng.randint(0, RUNS // 2)),
            ),
            Submission(
                queue=queue.name,
                priority=rng.choice([0, 0, 0, 1, 2]),
                partition=rng.choice([None, None, None, "a", "b", "c", "d", "e"]),
                estimate=float(rng.randint(0, 9)),
                not_before=None if delay is None else clock.now + delay,
            ),
        )  # fmt: skip
    order = []
    for step in range(RUNS):
        graphs = rng.choice([None, None, [("g", "fp")], [("h", "fp")]])
        skip = rng.choice([(), (), (), [("h", "fp")]])
        ids = await store.claim_runs(
            queue.name, "w", 30.0, limit=rng.choice([1, 1, 2, 3]), graphs=graphs, skip=skip
        )
        order.append(ids)
        clock.advance(rng.choice([0.0, 0.5, 2.0]))  # delayed runs come due as claims go on
        if step > 20 and not any(order[-20:]):
            break
    return [run_id for ids in order for run_id in ids]


@pytest.mark.parametrize("sql", ["sqlite", fixtures.POSTGRES])
@pytest.mark.parametrize("ordering", ["fifo", "priority", "lpt"])
@pytest.mark.parametrize("rate", [None, 2])
@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_sql_claims_follow_the_python_claim_order(
    tmp_path: Path, sql: str, ordering: str, rate: int | None, seed: int
) -> None:
    queue = Queue(
        "q", order=ordering, partition_concurrency=2, partition_limit=rate,  # type: ignore[arg-type]
        period=10.0,
    )  # fmt: skip
    sql_clock, memory_clock = FakeClock(), FakeClock()
    async with contextlib.AsyncExitStack() as stack:
        if sql == "sqlite":
            store: RunStore = SQLiteStore(str(tmp_path / "claims.db"), clock=sql_clock)
        else:
            schema = await stack.enter_async_context(fixtures.postgres_schema("claim_order"))
            store = PostgresStore(fixtures.POSTGRES_DSN or "", schema=schema, clock=sql_clock)
        await stack.enter_async_context(store)
        from_sql = await claim_sequence(store, queue, seed, sql_clock)
    memory = MemoryStore(clock=memory_clock)
    await memory.open()
    from_python = await claim_sequence(memory, queue, seed, memory_clock)
    assert from_sql == from_python
    assert 60 <= len(from_sql) < RUNS  # keyed runs past their partitions' limits wait
