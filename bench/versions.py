"""Versions benchmark: a migration dry run over many suspended runs, and a fork against a re-run.

Run as::

    python bench/versions.py [--quick] [--runs N] [--postgres DSN]

(a) *Migrate dry run.* N suspended runs (10,000; 1,000 with ``--quick``) of a
gate graph wait on their gate; a new version adds a step after the gate.
Timed: ``Engine.migrate(new)`` (a dry run: it reads and writes nothing) on a
fresh engine and store instance, and the same from the shell,
``tailrace migrate --graphs FILE --dry-run`` in a subprocess (its start-up and
imports included). Setup (not timed) runs the N runs through the engine.

(b) *Fork at the last node.* A chain of 1,000 nodes (200 with ``--quick``)
runs once; then a fork at its last node is timed against re-running the whole
chain (the same-run baseline), with the rows each stores (node rows, results,
events, first-k decisions).

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
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tailrace as tr
from tailrace.stores import RunStatus, RunStore, SQLiteStore

GRAPHS = """
import tailrace as tr

old = tr.Graph("bench-deploy")


@old.task()
async def prep(x):
    return {"draft": x}


@old.gate()
async def review(draft):
    return {"ask": "ship?", "draft": draft}


@old.task()
async def ship(answer):
    return answer


old.chain("prep", "review", "ship")

new = tr.Graph("bench-deploy")
new.add_node("prep", prep)
new.add_node("review", review, "gate")
new.add_node("ship", ship)
new.add_node("announce", lambda x: x)
new.chain("prep", "review", "ship", "announce")
"""


@dataclass(frozen=True)
class Database:
    name: str
    store: Callable[[], RunStore]
    url: str


@contextlib.asynccontextmanager
async def sqlite_db(scratch: Path) -> AsyncIterator[Database]:
    path = scratch / f"versions-{uuid.uuid4().hex[:8]}.db"
    yield Database("sqlite", lambda: SQLiteStore(path), str(path))


@contextlib.asynccontextmanager
async def postgres_db(dsn: str) -> AsyncIterator[Database]:
    import psycopg  # the postgres extra, only when a DSN is given
    from psycopg import sql

    from tailrace.stores import PostgresStore

    schema = f"tailrace_bench_versions_{uuid.uuid4().hex[:10]}"
    url = f"{dsn}{'&' if '?' in dsn else '?'}schema={schema}"
    try:
        yield Database("postgres", lambda: PostgresStore(dsn, schema=schema, max_size=8), url)
    finally:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            await conn.execute(
                sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema))
            )


def load_graphs(path: Path) -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_versions_graphs", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass
class Migration:
    store: str
    runs: int
    setup: float
    in_process: float
    command: float
    compatible: int


async def migration(db: Database, graphs: Any, path: Path, runs: int) -> Migration:
    started = time.perf_counter()
    async with db.store() as store:
        engine = tr.Engine(store=store)
        for first in range(0, runs, 200):
            batch = range(first, min(first + 200, runs))
            done = await asyncio.gather(*(engine.run(graphs.old, i) for i in batch))
            assert all(r.status is RunStatus.SUSPENDED for r in done)
    setup = time.perf_counter() - started
    async with db.store() as store:
        started = time.perf_counter()
        report = await tr.Engine(store=store).migrate(graphs.new)
        in_process = time.perf_counter() - started
    started = time.perf_counter()
    child = await asyncio.create_subprocess_exec(
        Path(sys.executable).parent / "tailrace", "migrate", "--graphs", f"{path}:new",
        "--db", db.url, "--dry-run", stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, _ = await child.communicate()
    command = time.perf_counter() - started
    assert child.returncode == 0 and f"{runs} compatible" in out.decode(), out.decode()
    return Migration(
        db.name, runs, setup, in_process, command, report.count(tr.MoveOutcome.COMPATIBLE)
    )


def chain(n: int) -> tr.Graph:
    g = tr.Graph(f"bench-chain-{n}")
    for i in range(n):
        g.add_node(f"n{i}", lambda x: x + 1)
    g.chain(*(f"n{i}" for i in range(n)))
    return g


@dataclass
class Fork:
    store: str
    nodes: int
    rerun: float
    fork: float
    rerun_rows: dict[str, int]
    fork_rows: dict[str, int]


async def rows_of(store: RunStore, run_id: str) -> dict[str, int]:
    stored = await store.load_run(run_id)
    return {
        "node rows": len(stored.nodes),
        "results": len(await store.results(run_id)),
        "events": len(await store.events(run_id)),
        "first-k": len(await store.frozen_inputs(run_id)),
    }


async def fork_vs_rerun(db: Database, n: int, repeat: int) -> Fork:
    g = chain(n)
    reruns, forks = [], []
    async with db.store() as store:
        engine = tr.Engine(store=store)
        await engine.run(g, 0, run_id="source")
        for i in range(repeat):
            started = time.perf_counter()
            await engine.run(g, 0, run_id=f"rerun-{i}")
            reruns.append(time.perf_counter() - started)
            started = time.perf_counter()
            forked = await engine.fork("source", at=f"n{n - 1}", fork_id=f"fork-{i}")
            forks.append(time.perf_counter() - started)
            assert forked.output == n
        return Fork(
            db.name, n, sorted(reruns)[len(reruns) // 2], sorted(forks)[len(forks) // 2],
            await rows_of(store, "rerun-0"), await rows_of(store, "fork-0"),
        )  # fmt: skip


async def bench(args: argparse.Namespace) -> None:
    from _common import Column, Table, Target, environment, load_average, targets_table

    print(environment(no_gc=False), end="\n\n")
    runs = args.runs or (1000 if args.quick else 10_000)
    nodes = 200 if args.quick else 1000
    notes = []
    migrations: list[Migration] = []
    forks: list[Fork] = []
    with tempfile.TemporaryDirectory(prefix="tailrace-bench-versions-") as scratch:
        path = Path(scratch) / "bench_graphs.py"
        path.write_text(GRAPHS)
        graphs = load_graphs(path)
        dbs: list[Callable[[], contextlib.AbstractAsyncContextManager[Database]]] = [
            lambda: sqlite_db(Path(scratch))
        ]
        if args.postgres:
            dsn = args.postgres
            dbs.append(lambda: postgres_db(dsn))
        else:
            notes.append("postgres skipped: no --postgres and no TAILRACE_TEST_POSTGRES_DSN")
        for make in dbs:
            async with make() as db:
                migrations.append(await migration(db, graphs, path, runs))
            async with make() as db:
                forks.append(await fork_vs_rerun(db, nodes, 3))

    table = Table(
        "(a) migrate dry run over suspended runs (a step added after their gate)",
        [Column("store"), Column("runs", right=True)]
        + [Column(h, right=True) for h in ("in process s", "tailrace migrate s", "compatible", "setup s")],
    )  # fmt: skip
    for m in migrations:
        table.add_row(
            m.store, m.runs, f"{m.in_process:.2f}", f"{m.command:.2f}", m.compatible,
            f"{m.setup:.1f}",
        )  # fmt: skip
    table.add_note("in process: Engine.migrate(new) on a fresh engine and store instance")
    table.add_note("tailrace migrate: a subprocess, start-up and imports included")
    for note in notes:
        table.add_note(note)
    table.add_note(load_average())
    table.print()

    table = Table(
        f"(b) fork at the last node of a {nodes}-node chain vs re-running it (median of 3)",
        [Column("store"), Column("run")]
        + [Column(h, right=True) for h in ("seconds", "node rows", "results", "events", "first-k")],
    )  # fmt: skip
    for f in forks:
        for label, seconds, rows in (
            ("re-run", f.rerun, f.rerun_rows),
            ("fork", f.fork, f.fork_rows),
        ):
            table.add_row(f.store, label, f"{seconds:.3f}", *(str(v) for v in rows.values()))
        table.add_row(f.store, "fork / re-run", f"{f.fork / f.rerun:.2f}x", "", "", "", "")
    table.add_note("the fork copies the reused results as stored and re-runs one node;")
    table.add_note("its events are those of one node, not of the whole chain")
    table.add_note(load_average())
    table.print()

    targets = [
        Target(f"{m.store} migrate dry run, {m.runs} runs", f"{m.command:.2f} s", "<= 2 s",
               m.command <= 2.0)
        for m in migrations
    ]  # fmt: skip
    targets += [
        Target(f"{f.store} fork / re-run", f"{f.fork / f.rerun:.2f}x", "< 1x", f.fork < f.rerun)
        for f in forks
    ]
    targets_table(targets, "targets (informational)").print()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="1,000 runs and a 200-node chain")
    parser.add_argument("--runs", type=int, default=None, help="suspended runs to migrate")
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
