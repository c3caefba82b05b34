"""Durability benchmark: tailrace durable runs against the raw commit floor and LangGraph.

Run as::

    python bench/durability.py [--sizes 1000,10000] [--postgres DSN] [--quick]
    python bench/durability.py --profile      # cProfile of the SQLite-normal 1k chain

Workloads (no-op async handlers, total node count = size):

- ``chain``:  n0 -> n1 -> ... -> n{size-1}
- ``fanout``: src -> size-2 workers -> join (an aggregate waiting for all of them)

Stores: ``SQLiteStore(synchronous="normal")`` with durability ``"async"`` and
``"sync"``, ``SQLiteStore(synchronous="full")`` (async) and ``PostgresStore``
(both modes; DSN from ``--postgres`` or ``TAILRACE_TEST_POSTGRES_DSN``, its rows
are skipped with a note when there is none). Each measurement gets a fresh
database file (SQLite) or schema (Postgres) and a fresh event loop; the graph
is compiled and the store opened before the clock starts, and the clock stops
when ``Engine.run`` returns (every commit durable). The same graph in memory
(no store) is measured alongside, in the same rounds: ``/ memory`` is the
durable rate over it. One untimed run of every kind comes first.

The floor is measured in the same run, on the same filesystem or server:
:func:`tailrace.stores._floor.sqlite_raw_commit_rate` and
:func:`~tailrace.stores._floor.postgres_raw_commit_rate` (one single-row
insert-and-commit per transaction). ``ratio`` is tailrace nodes/s divided by
raw commits/s.

Peers, like with like: LangGraph (installed with the dev extra) runs the same
shapes as ``StateGraph`` s with sync no-op nodes (its fastest path) on
``SqliteSaver`` (``synchronous=NORMAL``, as sqlite-normal), once with
``durability="async"`` and once with ``"sync"``, each compared with tailrace in
the same mode. DBOS (``pip install dbos``; bench only, not in any extra) runs
one step per node on a SQLite system database; it checkpoints every step
before returning it, so it is compared with tailrace ``"sync"``. Both are
slow, so they run only at sizes <= 1000.

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
import subprocess
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
from tailrace.stores import Harvest, NewRun, RunStore, SQLiteStore
from tailrace.stores._floor import postgres_raw_commit_rate, sqlite_raw_commit_rate

Sync = Literal["normal", "full"]
WORKLOADS = ("chain", "fanout")
#: LangGraph runs only at sizes up to this (each run must stay well under 60 s).
LANGGRAPH_MAX_NODES = 1000
#: DBOS runs only at sizes up to this (a few hundred steps per second).
DBOS_MAX_NODES = 1000
#: Targets from DESIGN.md (Performance budget) and issue 13.
FLOOR_TARGET = 0.5
#: The floors' key of the writer round trip (see :func:`floor_round_trip`).
ROUND_TRIP = "sqlite-normal writer round trip"
LANGGRAPH_TARGET = 30.0
DBOS_TARGET = 50.0


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
    """One measured cell; ``rates`` holds nodes/s per repeat."""

    workload: str
    size: int
    store: str
    mode: str = "-"
    rates: list[float] = field(default_factory=list)
    db_after_run: int | None = None
    db_after_checkpoint: int | None = None
    note: str = ""

    @property
    def rate(self) -> float | None:
        return statistics.median(self.rates) if self.rates else None

    @property
    def label(self) -> str:
        return self.store if self.mode == "-" else f"{self.store} {self.mode}"


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


async def _timed_run(
    store: RunStore | None, graph: tr.Graph, size: int, durability: str = "async"
) -> float:
    engine = tr.Engine(store=store, durability=durability)
    start = time.perf_counter()
    result = await engine.run(graph, 0)
    elapsed = time.perf_counter() - start
    _check(result, size)
    return size / elapsed


def measure_memory(graph: tr.Graph, size: int) -> float:
    gc.collect()
    return asyncio.run(_timed_run(None, graph, size))


def measure_sqlite(
    graph: tr.Graph, size: int, sync: Sync, workdir: Path, durability: str = "async"
) -> tuple[float, int, int]:
    """nodes/s, then bytes of .db + -wal right after the run and after a checkpoint."""
    db = Path(tempfile.mkdtemp(prefix=f"tr-{sync}-", dir=workdir)) / "runs.db"

    async def go() -> tuple[float, int, int]:
        store = SQLiteStore(db, synchronous=sync)
        await store.open()
        try:
            rate = await _timed_run(store, graph, size, durability)
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


def measure_postgres(graph: tr.Graph, size: int, dsn: str, durability: str = "async") -> float:
    from tailrace.stores import PostgresStore

    schema = f"tailrace_bench_{uuid.uuid4().hex[:12]}"

    async def go() -> float:
        store = PostgresStore(dsn, schema=schema)
        await store.open()
        try:
            return await _timed_run(store, graph, size, durability)
        finally:
            await store.close()

    gc.collect()
    try:
        return asyncio.run(go())
    finally:
        import psycopg

        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def floor_round_trip(n: int, workdir: Path) -> float:
    """Round trips/s of the smallest durable write through :class:`SQLiteStore`'s writer thread.

    An empty harvest committed to a leased run and awaited, ``n`` times, on
    sqlite-normal: the loop hands the write to the writer thread and is woken
    when it is committed. A durability ``"sync"`` chain step waits for at
    least one such write before its successor starts, so this rate bounds a
    ``"sync"`` chain whatever tailrace does per node (DESIGN.md: the writer
    thread keeps SQLite off the event loop).
    """
    db = Path(tempfile.mkdtemp(prefix="floor-rt-", dir=workdir)) / "runs.db"

    async def go() -> float:
        async with SQLiteStore(db) as store:
            new = NewRun(
                run_id="rt", graph_name="rt", graph_ref=None, fingerprint="rt",
                input_json="null", created_at=time.time(),
            )  # fmt: skip
            await store.create_run(new)
            token = await store.acquire_lease("rt", "bench", 60.0)
            harvest = Harvest(state_json="{}")
            start = time.perf_counter()
            for _ in range(n):
                await store.commit("rt", token, harvest)
            return n / (time.perf_counter() - start)

    try:
        return asyncio.run(go())
    finally:
        shutil.rmtree(db.parent, ignore_errors=True)


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
    """LangGraph's version if it and its SQLite saver import, else None."""
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


def measure_langgraph(
    workload: str, size: int, sync: Sync, workdir: Path, durability: str
) -> tuple[float, int]:
    """nodes/s and bytes of .db + -wal after the run, with SqliteSaver and ``durability``."""
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
        out = app.invoke({"x": 0}, config, durability=durability)
        elapsed = time.perf_counter() - start
        if workload == "fanout" and len(out.get("items", [])) != size - 2:
            raise RuntimeError(f"LangGraph fan-out gathered {len(out.get('items', []))} items")
        return size / elapsed, _db_and_wal(db)
    finally:
        conn.close()
        shutil.rmtree(db.parent, ignore_errors=True)


# --- DBOS ------------------------------------------------------------------------


def dbos_version() -> str | None:
    """DBOS's version if it is installed (``pip install dbos``; bench only), else None."""
    try:
        from importlib.metadata import version

        import dbos  # noqa: F401

        return version("dbos")
    except ImportError:
        return None


def measure_dbos(workload: str, size: int, repeat: int, workdir: Path) -> list[float]:
    """Steps/s of DBOS workflows on a SQLite system database, one per repeat.

    DBOS is a process-wide singleton, so each measurement runs in a child
    process (this script with ``--dbos-child``): a warm-up workflow, then
    ``repeat`` timed ones. Chain: one workflow of ``size`` sequential steps.
    Fan-out: an async workflow of one step, ``size - 2`` steps gathered with
    ``asyncio.gather``, and one more step. DBOS checkpoints each step's
    output before returning it, so it is compared with durability "sync".
    """
    scratch = Path(tempfile.mkdtemp(prefix="dbos-", dir=workdir))
    try:
        child = subprocess.run(
            [
                sys.executable,
                __file__,
                "--dbos-child",
                workload,
                str(size),
                str(repeat),
                str(scratch),
            ],
            capture_output=True,
            text=True,
            timeout=900,
            check=False,
        )
        if child.returncode != 0:
            raise RuntimeError(f"DBOS child failed: {child.stderr.strip()[-2000:]}")
        return [float(x) for x in child.stdout.split()[-repeat:]]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def dbos_child(workload: str, size: int, repeat: int, scratch: Path) -> None:
    """The child side of :func:`measure_dbos`: prints one rate per timed workflow."""
    import logging

    from dbos import DBOS

    @DBOS.step()
    def noop(x: int) -> int:
        return x

    @DBOS.workflow()
    def chain(n: int) -> int:
        x = 0
        for _ in range(n):
            x = noop(x)
        return x

    @DBOS.step()
    async def anoop(x: int) -> int:
        return x

    @DBOS.workflow()
    async def fanout(n: int) -> int:
        await anoop(0)
        done = await asyncio.gather(*(anoop(i) for i in range(n - 2)))
        return await anoop(len(done))

    logging.getLogger("dbos").setLevel(logging.ERROR)
    DBOS(
        config={
            "name": "tailrace-bench",
            "system_database_url": f"sqlite:///{scratch / 'dbos.sqlite'}",
            "log_level": "ERROR",
        }
    )
    DBOS.launch()
    try:

        def once(n: int) -> float:
            start = time.perf_counter()
            if workload == "chain":
                chain(n)
            else:
                asyncio.run(fanout(n))
            return n / (time.perf_counter() - start)

        once(min(size, 50))  # warm-up
        rates = [once(size) for _ in range(repeat)]
    finally:
        DBOS.destroy()
    print(" ".join(f"{r:.3f}" for r in rates))


# --- the run ---------------------------------------------------------------------


@dataclass
class Config:
    sizes: list[int]
    dsn: str | None
    repeat: int
    workdir: Path
    langgraph: bool
    dbos: bool
    floor_n: dict[str, int]


def _fmt_rate(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _fmt_ratio(value: float | None, suffix: str = "") -> str:
    return "-" if value is None else f"{value:.2f}{suffix}"


def _fmt_bytes(value: int | None) -> str:
    return "-" if value is None else f"{value / 1e6:.2f} MB"


def _table(headers: list[str], rows: list[list[str]], left: int = 3) -> str:
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.ljust(w) if i < left else c.rjust(w)
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


#: (store, durability mode) of the tailrace rows, in table order.
TAILRACE_CELLS: tuple[tuple[str, str], ...] = (
    ("sqlite-normal", "async"),
    ("sqlite-normal", "sync"),
    ("sqlite-full", "async"),
    ("postgres", "async"),
    ("postgres", "sync"),
)


def _measure_cell(cfg: Config, graph: tr.Graph, row: Row) -> None:
    """One more repeat of ``row`` (a tailrace store and mode)."""
    size = row.size
    if row.store.startswith("sqlite"):
        sync: Sync = "normal" if row.store == "sqlite-normal" else "full"
        nps, row.db_after_run, row.db_after_checkpoint = measure_sqlite(
            graph, size, sync, cfg.workdir, row.mode
        )
        row.rates.append(nps)
    elif cfg.dsn is not None:
        row.rates.append(measure_postgres(graph, size, cfg.dsn, row.mode))


def _warm_up(cfg: Config) -> None:
    """One untimed run of every kind at the smallest size: imports, caches, code paths."""
    size = min(cfg.sizes)
    for workload in WORKLOADS:
        graph = tailrace_graph(workload, size)
        measure_memory(graph, size)
        for store, mode in TAILRACE_CELLS:
            _measure_cell(cfg, graph, Row(workload, size, store, mode))


def _measure_peers(
    cfg: Config, size: int, workload: str, peers: dict[tuple[str, int, str], Row]
) -> None:
    if cfg.langgraph and size <= LANGGRAPH_MAX_NODES:
        for mode in ("async", "sync"):
            cell = peers.setdefault(
                (workload, size, f"langgraph {mode}"),
                Row(workload, size, "LangGraph sqlite-normal", mode),
            )
            rate, cell.db_after_run = measure_langgraph(workload, size, "normal", cfg.workdir, mode)
            cell.rates.append(rate)
    if cfg.dbos and size <= DBOS_MAX_NODES and (workload, size, "dbos") not in peers:
        cell = Row(workload, size, "DBOS sqlite", "sync")
        try:
            cell.rates = measure_dbos(workload, size, cfg.repeat, cfg.workdir)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            cell.note = f"failed: {exc}"
        peers[(workload, size, "dbos")] = cell


def run(cfg: Config) -> None:
    started = time.perf_counter()
    lg_version = langgraph_version() if cfg.langgraph else None
    cfg.langgraph = lg_version is not None
    db_version = dbos_version() if cfg.dbos else None
    cfg.dbos = db_version is not None
    print("tailrace durability benchmark")
    print(
        f"python {platform.python_version()}, tailrace {tr.__version__}, "
        f"sqlite {sqlite3.sqlite_version}, langgraph {lg_version or 'not installed'}, "
        f"dbos {db_version or 'not installed (pip install dbos)'}, {os.cpu_count()} cores"
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
        f"sizes {cfg.sizes}; every cell: median of {cfg.repeat} run(s), fresh DB each, after "
        "one untimed warm-up run of every kind; floors: median of the runs before and after"
    )
    print()

    floors: dict[str, list[float]] = {
        "sqlite-normal": [],
        "sqlite-full": [],
        "postgres": [],
        ROUND_TRIP: [],
    }

    def measure_floors() -> None:
        for _ in range(cfg.repeat):
            floors["sqlite-normal"].append(
                floor_sqlite("normal", cfg.floor_n["normal"], cfg.workdir)
            )
            floors[ROUND_TRIP].append(floor_round_trip(cfg.floor_n["round-trip"], cfg.workdir))
            floors["sqlite-full"].append(floor_sqlite("full", cfg.floor_n["full"], cfg.workdir))
            if cfg.dsn is not None:
                floors["postgres"].append(
                    postgres_raw_commit_rate(cfg.dsn, cfg.floor_n["postgres"])
                )

    _warm_up(cfg)
    measure_floors()
    rows: list[Row] = []
    peers: dict[tuple[str, int, str], Row] = {}
    for size in cfg.sizes:
        for workload in WORKLOADS:
            graph = tailrace_graph(workload, size)
            mem = Row(workload, size, "memory (no store)")
            cells = [Row(workload, size, store, mode) for store, mode in TAILRACE_CELLS]
            for _ in range(cfg.repeat):  # interleaved, so load drifts hit every column alike
                mem.rates.append(measure_memory(graph, size))
                for cell in cells:
                    _measure_cell(cfg, graph, cell)
            _measure_peers(cfg, size, workload, peers)
            for cell in cells:
                if cell.store == "postgres" and cfg.dsn is None:
                    cell.note = "skipped"
            rows += [mem, *cells]
            print(f"  measured {workload} {size} ({time.perf_counter() - started:.0f} s)")
            sys.stdout.flush()
    first_floors = {k: list(v) for k, v in floors.items()}
    measure_floors()
    floor = {k: statistics.median(v) if v else None for k, v in floors.items()}
    _print_floors(cfg, floors, first_floors, floor)
    _print_tailrace(cfg, rows, floor)
    _print_peers(rows, peers, lg_version, db_version)
    _print_sizes(rows, peers)
    _print_targets(cfg, rows, peers, floor)
    print()
    print(f"total {time.perf_counter() - started:.0f} s; load average at end: {_load()}")


def _print_floors(
    cfg: Config,
    floors: dict[str, list[float]],
    first: dict[str, list[float]],
    floor: dict[str, float | None],
) -> None:
    print()
    print(
        "== floors: raw commits (single-row insert + commit per transaction), writer round trips =="
    )
    out = []
    for key, n_key in (
        ("sqlite-normal", "normal"),
        ("sqlite-full", "full"),
        ("postgres", "postgres"),
        (ROUND_TRIP, "round-trip"),
    ):
        if not floors[key]:
            out.append([key, "-", "skipped: no Postgres", "", ""])
            continue
        before, after = first[key], floors[key][len(first[key]) :]
        out.append(
            [
                key,
                str(cfg.floor_n[n_key]),
                _fmt_rate(floor[key]),
                _fmt_rate(statistics.median(before)),
                _fmt_rate(statistics.median(after)),
            ]
        )
    print(_table(["store", "commits", "median commits/s", "before runs", "after runs"], out, 1))
    print(
        f"{ROUND_TRIP}: an empty harvest committed through SQLiteStore's writer thread and "
        'awaited; a durability "sync" chain step waits for at least one, so it bounds that chain.'
    )
    print(f"load average {_load()}")


def _memory_rate(rows: list[Row], row: Row) -> float | None:
    return next(
        (
            r.rate
            for r in rows
            if r.store.startswith("memory") and (r.workload, r.size) == (row.workload, row.size)
        ),
        None,
    )


def _print_tailrace(cfg: Config, rows: list[Row], floor: dict[str, float | None]) -> None:
    print()
    print(
        "== tailrace nodes/s (Engine(store=..., durability=...), graph compiled before timing) =="
    )
    out = []
    for r in rows:
        base = floor.get(r.store)
        mem = _memory_rate(rows, r)
        rate = r.rate
        out.append(
            [
                r.workload,
                str(r.size),
                r.store,
                r.mode,
                _fmt_rate(rate) if rate is not None else r.note,
                _fmt_ratio(
                    rate / mem if rate and mem and not r.store.startswith("memory") else None
                ),
                _fmt_rate(base),
                _fmt_ratio(rate / base if rate and base else None),
                f"{min(r.rates):,.0f}-{max(r.rates):,.0f}" if r.rates else "-",
            ]
        )
    headers = [
        "workload",
        "nodes",
        "store",
        "durability",
        "nodes/s",
        "/ memory",
        "raw commits/s",
        "/ raw",
        "range",
    ]
    print(_table(headers, out, 4))
    print(
        "/ memory: of the same graph in memory, same run; / raw: of raw commits/s on the same "
        "kind of database; range: min-max over repeats."
    )
    print(
        'durability "async": commits pipelined (a successor may start before its upstream is '
        'durable); "sync": successors start only once the completion is committed.'
    )
    if cfg.dsn is None:
        print("postgres rows skipped: no DSN (--postgres or TAILRACE_TEST_POSTGRES_DSN).")
    print(f"load average {_load()}")


def _ours(rows: list[Row], workload: str, size: int, mode: str) -> Row | None:
    return next(
        (
            r
            for r in rows
            if (r.workload, r.size, r.store, r.mode) == (workload, size, "sqlite-normal", mode)
        ),
        None,
    )


def _print_peers(
    rows: list[Row], peers: dict[tuple[str, int, str], Row], lg: str | None, db: str | None
) -> None:
    print()
    print("== peers on SQLite: LangGraph SqliteSaver and DBOS, like with like ==")
    out = []
    for (workload, size, _), peer in sorted(peers.items()):
        ours = _ours(rows, workload, size, peer.mode)
        rate = ours.rate if ours else None
        out.append(
            [
                workload,
                str(size),
                peer.store,
                peer.mode,
                _fmt_rate(peer.rate) if peer.rate else peer.note or "-",
                _fmt_rate(rate),
                _fmt_ratio(rate / peer.rate if rate and peer.rate else None, "x"),
            ]
        )
    if out:
        headers = [
            "workload",
            "nodes",
            "peer",
            "durability",
            "peer nodes/s",
            "tailrace nodes/s",
            "tailrace/peer",
        ]
        print(_table(headers, out, 4))
    print(
        f"LangGraph {lg or 'not installed'}: SqliteSaver (synchronous=NORMAL, like sqlite-normal), "
        f"sync no-op nodes, invoke(durability=...), sizes <= {LANGGRAPH_MAX_NODES}; "
        "compared with tailrace sqlite-normal in the same durability mode."
    )
    print(
        f"DBOS {db or 'not installed (pip install dbos; bench only)'}: SQLite system database, "
        f"one step per node (chain: sequential; fan-out: asyncio.gather), sizes <= {DBOS_MAX_NODES}, "
        "one child process per cell; DBOS checkpoints every step before returning it, so it is "
        'compared with tailrace durability "sync".'
    )
    print(f"load average {_load()}")


def _print_sizes(rows: list[Row], peers: dict[tuple[str, int, str], Row]) -> None:
    print()
    print("== SQLite database size (.db + -wal, -shm excluded) ==")
    out = []
    for r in rows:
        if r.store.startswith("sqlite") and r.db_after_run is not None:
            out.append(
                [
                    r.workload,
                    str(r.size),
                    r.label,
                    _fmt_bytes(r.db_after_run),
                    _fmt_bytes(r.db_after_checkpoint),
                    f"{(r.db_after_checkpoint or 0) / r.size:,.0f}",
                ]
            )
    for p in peers.values():
        if p.db_after_run is not None:
            out.append(
                [
                    p.workload,
                    str(p.size),
                    p.label,
                    _fmt_bytes(p.db_after_run),
                    "-",
                    f"{p.db_after_run / p.size:,.0f}",
                ]
            )
    if out:
        print(
            _table(
                ["workload", "nodes", "store", "after run", "after checkpoint", "bytes/node"], out
            )
        )


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def _print_targets(
    cfg: Config,
    rows: list[Row],
    peers: dict[tuple[str, int, str], Row],
    floor: dict[str, float | None],
) -> None:
    print()
    print("== targets ==")
    base = floor.get("sqlite-normal")
    for r in rows:
        if (r.store, r.mode) != ("sqlite-normal", "async") or not r.rate:
            continue
        mem = _memory_rate(rows, r)
        if mem:
            ratio = r.rate / mem
            print(
                f"{_verdict(ratio >= FLOOR_TARGET)}  sqlite-normal async {r.workload} {r.size}: "
                f"{ratio:.2f} of the same graph in memory (target >= {FLOOR_TARGET})"
            )
        if base:
            ratio = r.rate / base
            print(
                f"{_verdict(ratio >= FLOOR_TARGET)}  sqlite-normal async {r.workload} {r.size}: "
                f"{ratio:.2f} of the raw commit rate (target >= {FLOOR_TARGET})"
            )
    for (workload, size, kind), peer in sorted(peers.items()):
        ours = _ours(rows, workload, size, peer.mode)
        if not (ours and ours.rate and peer.rate):
            print(f"n/a   {peer.label} {workload} {size}: {peer.note or 'not measured'}")
            continue
        goal = DBOS_TARGET if kind == "dbos" else LANGGRAPH_TARGET
        speedup = ours.rate / peer.rate
        bound = ""
        trips = floor.get(ROUND_TRIP)
        if peer.mode == "sync" and workload == "chain" and trips:
            bound = f"; bound by the writer round trip: {trips / peer.rate:.1f}x"
        print(
            f"{_verdict(speedup >= goal)}  tailrace {peer.mode} vs {peer.label} {workload} {size}: "
            f"{speedup:.1f}x (target >= {goal:.0f}x{bound})"
        )
    trips = floor.get(ROUND_TRIP)
    for r in rows:
        if (r.store, r.mode, r.workload) == ("sqlite-normal", "sync", "chain") and r.rate and trips:
            print(
                f"info  sqlite-normal sync chain {r.size}: {r.rate / trips:.2f} of the writer "
                "round-trip rate (1.00 = nothing but the one write each step must wait for)"
            )
    if not cfg.langgraph:
        print("n/a   LangGraph: not installed (pip install -e '.[dev]')")
    if not cfg.dbos:
        print("n/a   DBOS: not installed (pip install dbos)")
    small, large = min(cfg.sizes), max(cfg.sizes)
    if small != large:
        for workload in WORKLOADS:
            by = {(r.size, r.store, r.mode): r.rate for r in rows if r.workload == workload}
            a, b = (
                by.get((small, "sqlite-normal", "async")),
                by.get((large, "sqlite-normal", "async")),
            )
            if a and b:
                print(
                    f"info  sqlite-normal async {workload}: nodes/s at {large} = {b / a:.2f} x "
                    f"nodes/s at {small} (flat cost per node = 1.00)"
                )
    print(f"load average {_load()}")


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
    parser.add_argument("--no-dbos", action="store_true", help="skip DBOS")
    parser.add_argument("--dbos-child", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--dir", type=Path, default=None, help="scratch parent directory")
    parser.add_argument(
        "--profile", action="store_true", help="print a cProfile of the SQLite-normal chain"
    )
    parser.add_argument("--profile-size", type=int, default=1000)
    parser.add_argument("--profile-top", type=int, default=15)
    args = parser.parse_args(argv)
    if args.dbos_child:
        workload, size, repeat, scratch = args.dbos_child
        dbos_child(workload, int(size), int(repeat), Path(scratch))
        return

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
            dbos=not args.no_dbos,
            floor_n=(
                {"normal": 5000, "full": 200, "postgres": 2000, "round-trip": 1000}
                if quick
                else {"normal": 10000, "full": 500, "postgres": 5000, "round-trip": 3000}
            ),
        )
        run(cfg)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
