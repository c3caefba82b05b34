"""Durability benchmark: tailrace durable runs against the raw commit floor and LangGraph.

Run as::

    python bench/durability.py [--sizes 1000,10000] [--postgres DSN] [--quick]
    python bench/durability.py --profile      # cProfile of the SQLite-normal 1k chain

Workloads (no-op async handlers, total node count = size):

- ``chain``:  n0 -> n1 -> ... -> n{size-1}
- ``fanout``: src -> size-2 workers -> join (an aggregate waiting for all of them)

Stores: ``SQLiteStore(synchronous="normal")``, ``SQLiteStore(synchronous="full")``
and ``PostgresStore`` (DSN from ``--postgres`` or ``TAILRACE_TEST_POSTGRES_DSN``;
its rows are skipped with a note when there is none). Each measurement gets a
fresh database file (SQLite) or schema (Postgres) and a fresh event loop; the
graph is compiled and the store opened before the clock starts, and the clock
stops when ``Engine.run`` returns (every commit durable). An in-memory row (no
store) is printed for reference.

The floor is measured in the same run, on the same filesystem or server:
:func:`tailrace.stores._floor.sqlite_raw_commit_rate` and
:func:`~tailrace.stores._floor.postgres_raw_commit_rate` (one single-row
insert-and-commit per transaction). ``ratio`` is tailrace nodes/s divided by
raw commits/s.

LangGraph (when installed) runs the same shapes as ``StateGraph`` s with sync
no-op nodes (its fastest path) and ``SqliteSaver`` with ``durability="sync"``;
its connection gets the same ``synchronous`` setting as the tailrace store it is
compared with. LangGraph is slow, so it runs only at sizes <= 1000.

Nothing here asserts; the ``targets`` section reports PASS/MISS.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import gc
import io
import itertools
import operator
import os
import platform
import pstats
import shutil
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Annotated, Any, Literal, TypedDict

import tailrace as tr
from tailrace.stores import RunStore, SQLiteStore
from tailrace.stores._floor import postgres_raw_commit_rate, sqlite_raw_commit_rate

Sync = Literal["normal", "full"]
WORKLOADS = ("chain", "fanout")
#: LangGraph runs only at sizes up to this (each run must stay well under 60 s).
LANGGRAPH_MAX_NODES = 1000
#: Targets from DESIGN.md (Performance budget) and the durability brief.
FLOOR_TARGET = 0.5
LANGGRAPH_TARGET = 20.0


# --- graphs ----------------------------------------------------------------------


async def _noop(_payload: Any) -> None:
    return None


def _add_edges(graph: tr.Graph, pairs: list[tuple[str, str]]) -> None:
    for source, target in pairs:
        graph.add_edge(source, target)


def tailrace_graph(workload: str, size: int) -> tr.Graph:
    """The ``workload`` graph with ``size`` nodes in all, compiled."""
    graph = tr.Graph(f"bench-{workload}-{size}")
    if workload == "chain":
        names = [f"n{i}" for i in range(size)]
        for name in names:
            graph.add_node(name, _noop)
        _add_edges(graph, list(itertools.pairwise(names)))
    else:
        workers = [f"w{i}" for i in range(size - 2)]
        graph.add_node("src", _noop)
        for name in workers:
            graph.add_node(name, _noop)
        graph.add_node("join", _noop, tr.NodeKind.AGGREGATE)
        _add_edges(graph, [("src", w) for w in workers] + [(w, "join") for w in workers])
    graph.compile()
    return graph


# --- measurements ----------------------------------------------------------------


@dataclass
class Row:
    """One measured (workload, size, store) cell; ``rates`` holds nodes/s per repeat."""

    workload: str
    size: int
    store: str
    rates: list[float] = field(default_factory=list)
    db_after_run: int | None = None
    db_after_checkpoint: int | None = None
    note: str = ""

    @property
    def rate(self) -> float | None:
        return statistics.median(self.rates) if self.rates else None


def _db_and_wal(db: Path) -> int:
    """Bytes of the database file plus its write-ahead log (the -shm index excluded)."""
    return sum(p.stat().st_size for p in (db, Path(f"{db}-wal")) if p.exists())


def _checkpoint(db: Path) -> None:
    conn = sqlite3.connect(db, timeout=10.0)
    try:
        busy, _log, _done = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        if busy:
            raise RuntimeError(f"{db}: wal_checkpoint(TRUNCATE) was blocked")
    finally:
        conn.close()


def _check(result: tr.RunResult, size: int) -> None:
    if result.status != "completed" or len(result.results) != size:
        raise RuntimeError(
            f"run ended {result.status!r} with {len(result.results)} of {size} results"
        )


async def _timed_run(store: RunStore | None, graph: tr.Graph, size: int) -> float:
    engine = tr.Engine(store=store)
    start = time.perf_counter()
    result = await engine.run(graph, 0)
    elapsed = time.perf_counter() - start
    _check(result, size)
    return size / elapsed


def measure_memory(graph: tr.Graph, size: int) -> float:
    gc.collect()
    return asyncio.run(_timed_run(None, graph, size))


def measure_sqlite(graph: tr.Graph, size: int, sync: Sync, workdir: Path) -> tuple[float, int, int]:
    """nodes/s, then bytes of .db + -wal right after the run and after a checkpoint."""
    db = Path(tempfile.mkdtemp(prefix=f"tr-{sync}-", dir=workdir)) / "runs.db"

    async def go() -> tuple[float, int, int]:
        store = SQLiteStore(db, synchronous=sync)
        await store.open()
        try:
            rate = await _timed_run(store, graph, size)
            after_run = _db_and_wal(db)
            await asyncio.to_thread(_checkpoint, db)
            return rate, after_run, _db_and_wal(db)
        finally:
            await store.close()

    gc.collect()
    try:
        return asyncio.run(go())
    finally:
        shutil.rmtree(db.parent, ignore_errors=True)


def measure_postgres(graph: tr.Graph, size: int, dsn: str) -> float:
    from tailrace.stores import PostgresStore

    schema = f"tailrace_bench_{uuid.uuid4().hex[:12]}"

    async def go() -> float:
        store = PostgresStore(dsn, schema=schema)
        await store.open()
        try:
            return await _timed_run(store, graph, size)
        finally:
            await store.close()

    gc.collect()
    try:
        return asyncio.run(go())
    finally:
        import psycopg

        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def floor_sqlite(sync: Sync, n: int, workdir: Path) -> float:
    scratch = Path(tempfile.mkdtemp(prefix=f"floor-{sync}-", dir=workdir))
    try:
        return sqlite_raw_commit_rate(scratch / "floor.db", n, sync)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


# --- LangGraph -------------------------------------------------------------------


class _LGState(TypedDict, total=False):
    x: int
    items: Annotated[list[Any], operator.add]


def _lg_noop(_state: _LGState) -> None:
    return None


def _lg_append(_state: _LGState) -> dict[str, Any]:
    return {"items": [None]}


def langgraph_version() -> str | None:
    try:
        from importlib.metadata import version

        import langgraph.checkpoint.sqlite  # noqa: F401

        return version("langgraph")
    except ImportError:
        return None


def langgraph_graph(workload: str, size: int) -> Any:
    from langgraph.graph import END, START, StateGraph

    graph: Any = StateGraph(_LGState)
    if workload == "chain":
        names = [f"n{i}" for i in range(size)]
        for name in names:
            graph.add_node(name, _lg_noop)
        graph.add_edge(START, names[0])
        for a, b in itertools.pairwise(names):
            graph.add_edge(a, b)
        graph.add_edge(names[-1], END)
    else:
        graph.add_node("src", _lg_noop)
        graph.add_node("join", _lg_noop)
        graph.add_edge(START, "src")
        for i in range(size - 2):
            graph.add_node(f"w{i}", _lg_append)
            graph.add_edge("src", f"w{i}")
            graph.add_edge(f"w{i}", "join")
        graph.add_edge("join", END)
    return graph


def measure_langgraph(workload: str, size: int, sync: Sync, workdir: Path) -> tuple[float, int]:
    """nodes/s and bytes of .db + -wal after the run, with SqliteSaver, durability="sync"."""
    from langgraph.checkpoint.sqlite import SqliteSaver

    db = Path(tempfile.mkdtemp(prefix=f"lg-{sync}-", dir=workdir)) / "lg.db"
    conn = sqlite3.connect(db, check_same_thread=False)
    try:
        saver = SqliteSaver(conn)
        saver.setup()  # WAL
        conn.execute(f"PRAGMA synchronous = {sync.upper()}")
        app = langgraph_graph(workload, size).compile(checkpointer=saver)
        config = {"configurable": {"thread_id": "bench"}, "recursion_limit": size + 10}
        gc.collect()
        start = time.perf_counter()
        out = app.invoke({"x": 0}, config, durability="sync")
        elapsed = time.perf_counter() - start
        if workload == "fanout" and len(out.get("items", [])) != size - 2:
            raise RuntimeError(f"LangGraph fan-out gathered {len(out.get('items', []))} items")
        return size / elapsed, _db_and_wal(db)
    finally:
        conn.close()
        shutil.rmtree(db.parent, ignore_errors=True)


# --- the run ---------------------------------------------------------------------


@dataclass
class Config:
    sizes: list[int]
    dsn: str | None
    repeat: int
    workdir: Path
    langgraph: bool
    floor_n: dict[str, int]
    lg_syncs: tuple[Sync, ...]


def _fmt_rate(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _fmt_ratio(value: float | None, suffix: str = "") -> str:
    return "-" if value is None else f"{value:.2f}{suffix}"


def _fmt_bytes(value: int | None) -> str:
    return "-" if value is None else f"{value / 1e6:.2f} MB"


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.ljust(w) if i < 3 else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    out = [line(headers), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in rows]
    return "\n".join(out)


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def _postgres_facts(dsn: str) -> str:
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        version = conn.execute("SHOW server_version").fetchone()
        fsync = conn.execute("SHOW fsync").fetchone()
        commit = conn.execute("SHOW synchronous_commit").fetchone()
    return (
        f"PostgreSQL {version[0] if version else '?'} "
        f"(fsync={fsync[0] if fsync else '?'}, synchronous_commit={commit[0] if commit else '?'})"
    )


def run(cfg: Config) -> None:
    started = time.perf_counter()
    lg_version = langgraph_version() if cfg.langgraph else None
    print("tailrace durability benchmark")
    print(
        f"python {platform.python_version()}, tailrace {tr.__version__}, "
        f"sqlite {sqlite3.sqlite_version}, langgraph {lg_version or 'not installed'}, "
        f"{os.cpu_count()} cores"
    )
    print(f"scratch dir {cfg.workdir} (SQLite files and floor on the same filesystem)")
    print(f"load average at start: {_load()} (other processes skew every column)")
    pg_note = "no DSN (--postgres or TAILRACE_TEST_POSTGRES_DSN): Postgres rows skipped"
    if cfg.dsn is not None:
        try:
            pg_note = _postgres_facts(cfg.dsn)
        except Exception as exc:
            pg_note = f"cannot connect ({exc.__class__.__name__}: {exc}): Postgres rows skipped"
            cfg.dsn = None
    print(f"postgres: {pg_note}")
    print(
        f"sizes {cfg.sizes}; tailrace: median of {cfg.repeat} run(s) per cell, fresh DB each; "
        f"floors: median of {cfg.repeat}"
    )
    print()

    # Floors first, so the table can print ratios; measured again at the end to show drift.
    floors: dict[str, list[float]] = {"sqlite-normal": [], "sqlite-full": [], "postgres": []}

    def measure_floors() -> None:
        for _ in range(cfg.repeat):
            floors["sqlite-normal"].append(
                floor_sqlite("normal", cfg.floor_n["normal"], cfg.workdir)
            )
            floors["sqlite-full"].append(floor_sqlite("full", cfg.floor_n["full"], cfg.workdir))
            if cfg.dsn is not None:
                floors["postgres"].append(
                    postgres_raw_commit_rate(cfg.dsn, cfg.floor_n["postgres"])
                )

    measure_floors()

    rows: list[Row] = []
    lg_rows: dict[tuple[str, int, str], Row] = {}
    for size in cfg.sizes:
        for workload in WORKLOADS:
            graph = tailrace_graph(workload, size)
            mem = Row(workload, size, "memory (no store)")
            normal = Row(workload, size, "sqlite-normal")
            full = Row(workload, size, "sqlite-full")
            pg = Row(workload, size, "postgres")
            for _ in range(cfg.repeat):
                mem.rates.append(measure_memory(graph, size))
                sqlite_rows: list[tuple[Row, Sync]] = [(normal, "normal"), (full, "full")]
                for row, sync in sqlite_rows:
                    nps, after_run, after_ckpt = measure_sqlite(graph, size, sync, cfg.workdir)
                    row.rates.append(nps)
                    row.db_after_run, row.db_after_checkpoint = after_run, after_ckpt
                if cfg.dsn is not None:
                    pg.rates.append(measure_postgres(graph, size, cfg.dsn))
                if lg_version is not None and size <= LANGGRAPH_MAX_NODES:
                    for sync in cfg.lg_syncs:
                        lg_rate, lg_bytes = measure_langgraph(workload, size, sync, cfg.workdir)
                        lg_cell = lg_rows.setdefault(
                            (workload, size, f"sqlite-{sync}"),
                            Row(workload, size, f"LangGraph sqlite-{sync}"),
                        )
                        lg_cell.rates.append(lg_rate)
                        lg_cell.db_after_run = lg_bytes
            if cfg.dsn is None:
                pg.note = "skipped"
            rows += [mem, normal, full, pg]
            print(f"  measured {workload} {size} ({time.perf_counter() - started:.0f} s)")
            sys.stdout.flush()

    first_floors = {k: list(v) for k, v in floors.items()}
    measure_floors()
    floor = {k: statistics.median(v) if v else None for k, v in floors.items()}

    print()
    print("== raw commit floor (single-row insert + commit per transaction) ==")
    floor_rows = []
    for key, n_key in (
        ("sqlite-normal", "normal"),
        ("sqlite-full", "full"),
        ("postgres", "postgres"),
    ):
        if not floors[key]:
            floor_rows.append([key, "-", "skipped: no Postgres", "", ""])
            continue
        before, after = first_floors[key], floors[key][len(first_floors[key]) :]
        floor_rows.append(
            [
                key,
                str(cfg.floor_n[n_key]),
                _fmt_rate(floor[key]),
                _fmt_rate(statistics.median(before)),
                _fmt_rate(statistics.median(after)),
            ]
        )
    print(_table(["store", "commits", "median commits/s", "before runs", "after runs"], floor_rows))

    print()
    print("== tailrace nodes/s (Engine(store=...), graph compiled before timing) ==")
    table_rows = []
    for r in rows:
        base = floor.get(r.store)
        lg_row = lg_rows.get((r.workload, r.size, r.store))
        lg = lg_row.rate if lg_row else None
        rate = r.rate
        table_rows.append(
            [
                r.workload,
                str(r.size),
                r.store,
                _fmt_rate(rate) if rate is not None else r.note,
                _fmt_rate(base),
                _fmt_ratio(rate / base if rate and base else None),
                _fmt_rate(lg),
                _fmt_ratio(rate / lg if rate and lg else None, "x"),
                f"{min(r.rates):,.0f}-{max(r.rates):,.0f}" if r.rates else "-",
            ]
        )
    print(
        _table(
            [
                "workload",
                "nodes",
                "store",
                "nodes/s",
                "raw commits/s",
                "ratio",
                "LangGraph n/s",
                "tr/LG",
                "range",
            ],
            table_rows,
        )
    )
    print(
        "ratio = tailrace nodes/s / raw commits/s on the same kind of database; "
        "range = min-max over repeats."
    )
    if cfg.dsn is None:
        print("postgres rows skipped: no DSN (--postgres or TAILRACE_TEST_POSTGRES_DSN).")
    if lg_version is None:
        print("LangGraph columns empty: langgraph / langgraph-checkpoint-sqlite not installed.")
    else:
        print(
            f"LangGraph {lg_version}: SqliteSaver, durability='sync', sync no-op nodes, "
            f"median of {cfg.repeat} run(s) per cell, sizes <= {LANGGRAPH_MAX_NODES} only (slow; each run < 60 s); "
            f"its connection uses the synchronous setting of the row: "
            f"{', '.join(cfg.lg_syncs)}."
        )

    print()
    print("== SQLite database size (.db + -wal, -shm excluded) ==")
    size_rows = []
    for r in rows:
        if r.store.startswith("sqlite") and r.db_after_run is not None:
            size_rows.append(
                [
                    r.workload,
                    str(r.size),
                    r.store,
                    _fmt_bytes(r.db_after_run),
                    _fmt_bytes(r.db_after_checkpoint),
                    f"{(r.db_after_checkpoint or 0) / r.size:,.0f}",
                ]
            )
    for lg_row in lg_rows.values():
        nbytes = lg_row.db_after_run or 0
        size_rows.append(
            [
                lg_row.workload,
                str(lg_row.size),
                lg_row.store,
                _fmt_bytes(nbytes),
                "-",
                f"{nbytes / lg_row.size:,.0f}",
            ]
        )
    print(
        _table(
            ["workload", "nodes", "store", "after run", "after checkpoint", "bytes/node"],
            size_rows,
        )
    )

    print()
    print("== targets ==")
    for r in rows:
        base = floor.get(r.store)
        if r.store == "sqlite-normal" and r.rate and base:
            ratio = r.rate / base
            verdict = "PASS" if ratio >= FLOOR_TARGET else "MISS"
            print(
                f"{verdict}  sqlite-normal {r.workload} {r.size}: {ratio:.2f} of raw commit rate "
                f"(target >= {FLOOR_TARGET})"
            )
    for r in rows:
        lg_row = lg_rows.get((r.workload, r.size, r.store))
        lg = lg_row.rate if lg_row else None
        if r.store == "sqlite-normal" and r.rate and lg:
            speedup = r.rate / lg
            verdict = "PASS" if speedup >= LANGGRAPH_TARGET else "MISS"
            print(
                f"{verdict}  sqlite-normal {r.workload} {r.size}: {speedup:.1f}x LangGraph "
                f"SqliteSaver (target >= {LANGGRAPH_TARGET:.0f}x)"
            )
    if lg_version is None:
        print("n/a   tailrace / LangGraph: LangGraph not installed")
    elif not any(s <= LANGGRAPH_MAX_NODES for s in cfg.sizes):
        print(f"n/a   tailrace / LangGraph: no size <= {LANGGRAPH_MAX_NODES} requested")
    small, large = min(cfg.sizes), max(cfg.sizes)
    if small != large:
        for workload in WORKLOADS:
            by = {(r.size, r.store): r.rate for r in rows if r.workload == workload}
            a, b = by.get((small, "sqlite-normal")), by.get((large, "sqlite-normal"))
            if a and b:
                print(
                    f"info  sqlite-normal {workload}: nodes/s at {large} = {b / a:.2f} x nodes/s "
                    f"at {small} (flat cost per node = 1.00)"
                )
    print()
    print(f"total {time.perf_counter() - started:.0f} s; load average at end: {_load()}")


# --- profile ---------------------------------------------------------------------


@contextlib.contextmanager
def _profile_new_threads(profiles: list[cProfile.Profile]) -> Iterator[None]:
    """Give every thread started inside the block its own cProfile profiler."""

    def hook(_frame: FrameType, _event: str, _arg: Any) -> None:
        sys.setprofile(None)
        prof = cProfile.Profile()
        profiles.append(prof)
        prof.enable()

    threading.setprofile(hook)
    try:
        yield
    finally:
        threading.setprofile(None)


def _top(stats: pstats.Stats, n: int) -> str:
    buf = io.StringIO()
    stats.stream = buf  # type: ignore[attr-defined]
    stats.sort_stats("tottime").print_stats(n)
    text = buf.getvalue()
    return text[text.find("   ncalls") :].rstrip()


def profile(size: int, workdir: Path, top: int) -> None:
    """cProfile of one SQLite-normal chain run: the event-loop thread and the store threads."""
    graph = tailrace_graph("chain", size)
    measure_sqlite(graph, size, "normal", workdir)  # warm up imports and caches
    db = Path(tempfile.mkdtemp(prefix="tr-profile-", dir=workdir)) / "runs.db"
    main = cProfile.Profile()
    threads: list[cProfile.Profile] = []

    async def go() -> float:
        store = SQLiteStore(db, synchronous="normal")
        with _profile_new_threads(threads):
            await store.open()
        try:
            engine = tr.Engine(store=store)
            start = time.perf_counter()
            main.enable()
            result = await engine.run(graph, 0)
            main.disable()
            elapsed = time.perf_counter() - start
            _check(result, size)
            return elapsed
        finally:
            await store.close()

    try:
        elapsed = asyncio.run(go())
    finally:
        shutil.rmtree(db.parent, ignore_errors=True)
    print(f"cProfile: SQLite normal, chain of {size} no-op nodes, {elapsed:.3f} s wall (profiled)")
    print()
    print(f"-- event-loop thread: top {top} by tottime --")
    print(_top(pstats.Stats(main), top))
    if threads:
        merged = pstats.Stats(threads[0])
        for prof in threads[1:]:
            merged.add(prof)
        print()
        print(
            f"-- store threads (writer + readers, {len(threads)} threads): top {top} by tottime --"
        )
        print(_top(merged, top))


# --- entry point -----------------------------------------------------------------


def _parse_sizes(text: str) -> list[int]:
    sizes = [int(part) for part in text.split(",") if part.strip()]
    if not sizes or min(sizes) < 3:
        raise argparse.ArgumentTypeError("sizes must be integers >= 3, comma separated")
    return sizes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--sizes", type=_parse_sizes, default=None, help="default 1000,10000")
    parser.add_argument(
        "--postgres",
        default=os.environ.get("TAILRACE_TEST_POSTGRES_DSN"),
        help="Postgres DSN (default $TAILRACE_TEST_POSTGRES_DSN; rows skipped without one)",
    )
    parser.add_argument("--quick", action="store_true", help="1k only, one run per cell")
    parser.add_argument("--repeat", type=int, default=None, help="runs per cell (default 3)")
    parser.add_argument("--no-langgraph", action="store_true", help="skip LangGraph")
    parser.add_argument("--dir", type=Path, default=None, help="scratch parent directory")
    parser.add_argument(
        "--profile", action="store_true", help="print a cProfile of the SQLite-normal chain"
    )
    parser.add_argument("--profile-size", type=int, default=1000)
    parser.add_argument("--profile-top", type=int, default=15)
    args = parser.parse_args(argv)

    workdir = Path(tempfile.mkdtemp(prefix="tailrace-durability-", dir=args.dir))
    try:
        if args.profile:
            profile(args.profile_size, workdir, args.profile_top)
            return
        quick: bool = args.quick
        cfg = Config(
            sizes=args.sizes or ([1000] if quick else [1000, 10000]),
            dsn=args.postgres or None,
            repeat=max(1, args.repeat or (1 if quick else 3)),
            workdir=workdir,
            langgraph=not args.no_langgraph,
            floor_n=(
                {"normal": 5000, "full": 200, "postgres": 2000}
                if quick
                else {"normal": 10000, "full": 500, "postgres": 5000}
            ),
            lg_syncs=("normal",) if quick else ("normal", "full"),
        )
        run(cfg)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
