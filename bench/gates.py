"""Gates benchmark: how fast serve picks up an answer, and how many resumes it applies per second.

Run as::

    python bench/gates.py [--quick] [--postgres DSN]

(a) *Answer -> downstream start.* A :class:`~tailrace.gates.Server` runs in this
process over its own engine and store instance; a separate engine on another
store instance records each answer with ``resume=False``, so the serve loop
has to find it. Each sample suspends a run at a gate, idles a random 0-300 ms
(a person answers at any moment of serve's idle backoff), records the answer
and waits for the run to complete. Reported from the durable event log:
``answer -> apply`` (the ``question_answered`` event's ts, i.e. serve's
pickup), ``apply -> start`` (the downstream node's ``node_started``), and the
whole ``answer -> start``, at p50/p99. Two serve configurations: the
defaults (``interval`` 0.05 s doubling to ``max_interval`` 2 s while idle) and
a tight one (both 0.01 s).

(b) *Resumes per second.* N runs (1,000; 200 with ``--quick``) are suspended
at a gate, all answered at once with ``resume=False``, then 1 or 4 serve
loops (each its own engine and store instance, in this process) are started
and timed until every run has completed (its answer applied and its downstream
node done).

SQLite (one file, WAL, ``synchronous=normal``) and Postgres (DSN from
``--postgres`` or ``TAILRACE_TEST_POSTGRES_DSN``, a fresh schema dropped
afterwards; skipped with a note when there is none). Nothing asserts: the
targets are informational (PASS/MISS).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tailrace as tr
from tailrace.gates import Server
from tailrace.stores import QuestionStatus, RunStatus, RunStore, SQLiteStore

# -- the graph (serve imports it from this file by reference) --------------------------

graph = tr.Graph("bench-gate")


@graph.gate()
async def review(x: Any) -> Any:
    return {"ask": "ship?", "n": x}


@graph.task()
async def ship(answer: Any) -> Any:
    return answer


graph.chain("review", "ship")
GRAPH_REF = f"{Path(__file__).resolve()}:graph"

#: Serve configurations for (a): name -> (interval, max_interval).
CONFIGS = {"default": (0.05, 2.0), "tight": (0.01, 0.01)}


# -- databases -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Database:
    """A fresh database: ``store()`` opens another store instance on it."""

    name: str
    store: Callable[[], RunStore]


@contextlib.asynccontextmanager
async def sqlite_db(scratch: Path) -> AsyncIterator[Database]:
    path = scratch / f"gates-{uuid.uuid4().hex[:8]}.db"
    yield Database("sqlite", lambda: SQLiteStore(path))


@contextlib.asynccontextmanager
async def postgres_db(dsn: str) -> AsyncIterator[Database]:
    import psycopg
    from psycopg import sql

    from tailrace.stores import PostgresStore

    schema = f"tailrace_bench_gates_{uuid.uuid4().hex[:10]}"
    try:
        yield Database("postgres", lambda: PostgresStore(dsn, schema=schema, max_size=8))
    finally:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            await conn.execute(
                sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema))
            )


@contextlib.asynccontextmanager
async def serving(
    db: Database, n: int = 1, *, interval: float = 0.05, max_interval: float = 2.0
) -> AsyncIterator[list[Server]]:
    """``n`` serve loops, each with its own engine and store instance, until the block ends."""
    stores = [db.store() for _ in range(n)]
    servers = []
    for store in stores:
        await store.open()
        engine = tr.Engine(store=store)
        engine.register(graph)  # a stored file reference is never executed (trust model)
        servers.append(Server(engine, interval=interval, max_interval=max_interval))
    stop = asyncio.Event()
    tasks = [asyncio.create_task(s.run(stop)) for s in servers]
    try:
        yield servers
    finally:
        stop.set()
        await asyncio.gather(*tasks)
        for store in stores:
            await store.close()


async def completed(store: RunStore, run_id: str, within: float = 30.0) -> None:
    """Poll until run ``run_id`` completed (TimeoutError after ``within`` seconds)."""
    deadline = time.monotonic() + within
    while (await store.get_run(run_id)).status is not RunStatus.COMPLETED:
        if time.monotonic() > deadline:
            raise TimeoutError(f"run {run_id} did not complete in {within}s")
        await asyncio.sleep(0.002)


async def all_completed(store: RunStore, runs: int) -> None:
    """Poll until ``runs`` runs have completed: the clock stops then, not when the answers
    are applied (an applied answer's run may still be running its downstream node)."""
    while True:
        if not await store.unapplied_answers(limit=1):
            done = await store.list_runs(status=RunStatus.COMPLETED, limit=runs)
            if len(done) >= runs:
                return
        await asyncio.sleep(0.005)


# -- (a) latency -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Latency:
    store: str
    config: str
    pickup: list[float]
    start: list[float]
    total: list[float]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def latency(db: Database, config: str, samples: int, seed: int) -> Latency:
    interval, max_interval = CONFIGS[config]
    rng = random.Random(seed)
    pickup, start, total = [], [], []
    async with db.store() as store, serving(db, interval=interval, max_interval=max_interval):
        client = tr.Engine(store=store)
        for n in range(samples):
            result = await client.run(graph, n, graph_ref=GRAPH_REF)
            [question] = result.questions
            await asyncio.sleep(rng.uniform(0.0, 0.3))
            t0 = time.time()
            await client.answer(question.question_id, "yes", resume=False)
            await completed(store, result.run_id)
            events = await store.events(result.run_id)
            applied = next(e.ts for e in events if e.type == "question_answered")
            started = next(e.ts for e in events if e.type == "node_started" and e.node_id == "ship")
            pickup.append(applied - t0)
            start.append(started - applied)
            total.append(started - t0)
    return Latency(db.name, config, pickup, start, total)


# -- (b) throughput ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Throughput:
    store: str
    servers: int
    runs: int
    seconds: float
    setup: float
    busy: int


async def throughput(db: Database, runs: int, servers: int) -> Throughput:
    async with db.store() as store:
        client = tr.Engine(store=store)
        t_setup = time.perf_counter()
        questions: list[str] = []
        for lo in range(0, runs, 50):
            results = await asyncio.gather(
                *(client.run(graph, n, graph_ref=GRAPH_REF) for n in range(lo, min(lo + 50, runs)))
            )
            questions += [r.questions[0].question_id for r in results]
        for qid in questions:
            await client.answer(qid, "yes", resume=False)
        setup = time.perf_counter() - t_setup
        t0 = time.perf_counter()
        async with serving(db, servers, interval=0.01, max_interval=0.05) as loops:
            await all_completed(store, runs)
            seconds = time.perf_counter() - t0
            busy = sum(s.stats.outcomes.get("busy", 0) for s in loops)
        applied = await store.list_questions(status=QuestionStatus.APPLIED)
        done = await store.list_runs(status=RunStatus.COMPLETED)
        assert len(applied) == runs and len(done) == runs, (len(applied), len(done))
    return Throughput(db.name, servers, runs, seconds, setup, busy)


# -- report --------------------------------------------------------------------------------------


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


async def bench(args: argparse.Namespace) -> None:
    from _common import (
        Column,
        Table,
        Target,
        environment,
        fmt_rate,
        load_average,
        targets_table,
    )

    print(environment(no_gc=False), end="\n\n")
    samples = 8 if args.quick else 25
    runs = 200 if args.quick else 1000
    notes = []
    with tempfile.TemporaryDirectory(prefix="tailrace-bench-gates-") as scratch:
        dbs: list[Callable[[], contextlib.AbstractAsyncContextManager[Database]]] = [
            lambda: sqlite_db(Path(scratch))
        ]
        if args.postgres:
            dsn = args.postgres
            dbs.append(lambda: postgres_db(dsn))
        else:
            notes.append("postgres skipped: no --postgres and no TAILRACE_TEST_POSTGRES_DSN")
        lat: list[Latency] = []
        thr: list[Throughput] = []
        for make in dbs:
            for config in CONFIGS:
                async with make() as db:
                    lat.append(await latency(db, config, samples, seed=len(lat)))
            for servers in (1, 4):
                async with make() as db:
                    thr.append(await throughput(db, runs, servers))

    table = Table(
        f"(a) answer -> downstream node start, serve in process, {samples} samples each",
        [Column("store"), Column("serve (interval..max)")]
        + [Column(h, right=True) for h in ("answer->apply p50", "p99", "apply->start p50", "p99", "answer->start p50", "p99")],
    )  # fmt: skip
    for r in lat:
        interval, max_interval = CONFIGS[r.config]
        table.add_row(
            r.store, f"{r.config} ({interval:g}..{max_interval:g} s)",
            ms(pct(r.pickup, 0.5)), ms(pct(r.pickup, 0.99)),
            ms(pct(r.start, 0.5)), ms(pct(r.start, 0.99)),
            ms(pct(r.total, 0.5)), ms(pct(r.total, 0.99)),
        )  # fmt: skip
    table.add_note("answer recorded with resume=False by another engine and store instance")
    table.add_note("each answer comes after a random 0-300 ms idle, anywhere in serve's backoff;")
    table.add_note(
        "after a long idle, default serve polls every max_interval (2 s): expect ~1 s p50"
    )
    for note in notes:
        table.add_note(note)
    table.add_note(load_average())
    table.print()

    table = Table(
        "(b) resumes/s: N suspended runs answered at once, then serve applies them all",
        [Column("store"), Column("serve loops", right=True), Column("runs", right=True)]
        + [Column(h, right=True) for h in ("seconds", "resumes/s", "busy outcomes", "setup s")],
    )  # fmt: skip
    for r in thr:
        table.add_row(
            r.store, r.servers, r.runs, f"{r.seconds:.2f}", fmt_rate(r.runs / r.seconds),
            r.busy, f"{r.setup:.1f}",
        )  # fmt: skip
    table.add_note("each serve loop: its own engine and store instance; interval 0.01..0.05 s")
    table.add_note("setup (not timed): suspend N runs and record N answers with resume=False")
    table.add_note("timed until every run has completed; " + load_average())
    table.print()

    targets = []
    for r in lat:
        if r.config == "tight":
            p99 = pct(r.total, 0.99)
            targets.append(
                Target(f"{r.store} tight answer->start p99", ms(p99), "<= 100 ms", p99 <= 0.1)
            )
        else:
            p99 = pct(r.total, 0.99)
            bound = CONFIGS["default"][1] + 0.1
            targets.append(
                Target(
                    f"{r.store} default answer->start p99", ms(p99), f"<= {bound:g} s", p99 <= bound
                )
            )
    for r in thr:
        rate = r.runs / r.seconds
        targets.append(
            Target(f"{r.store} x{r.servers} resumes/s", fmt_rate(rate), ">= 100/s", rate >= 100)
        )
    targets_table(targets, "targets (informational)").print()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="fewer samples and 200 runs")
    parser.add_argument(
        "--postgres",
        default=os.environ.get("TAILRACE_TEST_POSTGRES_DSN"),
        help="Postgres DSN (default $TAILRACE_TEST_POSTGRES_DSN)",
    )
    args = parser.parse_args(argv)
    asyncio.run(bench(args))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
