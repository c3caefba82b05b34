"""A fleet of worker processes on one store: torture and benchmark (issue 10).

Run as::

    python bench/fleet.py torture [--store sqlite|postgres|both] [--runs 400] [--kills 60]
    python bench/fleet.py bench [--store sqlite|postgres|both] [--workers 1,2,4,8] [--dbos]
    python bench/fleet.py adoption [--adopt-kills 5]     # a SIGKILLed worker's runs adopted
    python bench/fleet.py idle [--fleet 10,100] [--simulate 1000]  # idle commits/s, rows read/s
    python bench/fleet.py fairness                       # a lone partition behind a busy one
    python bench/fleet.py claims [--backlogs 1000,10000,100000] [--partitions 0,100]
    python bench/fleet.py per-run                        # a 5-node run's commits, statements, CPU

(Postgres from ``--dsn`` or ``TAILRACE_TEST_POSTGRES_DSN``; each session gets a
schema of its own.) ``tests/workers/test_fleet.py`` imports this file by path
and runs :func:`torture` with 30+ kills per store.

**Torture.** Worker processes (``tailrace worker``) claim runs of a 20-node
graph (a chain, a fan-out of 6 into a join, a switch into an ``any_of``, a
self-loop of 3 visits, a tail chain; each handler sleeps 5-50 ms, seeded by
run and node) from one queue with a global ``concurrency``, a per-worker
limit, a rate limit, ``priority`` order, partition keys and dedup keys. The
parent SIGKILLs two workers at seeded moments and restarts them, until the
kill count is reached, then lets the fleet finish. Every handler appends
``run node visit`` to a side file when it starts. Checks:

- every run completed, with the results of an uninterrupted in-process run;
- ``committed re-executions``: right after each kill (and every half second)
  the parent reads the committed result rows, *then* the side file's length;
  a start line past that length for a visit already committed is a committed
  visit run again (D1). Must be 0;
- the queue's running count, sampled from the database every few
  milliseconds, never exceeds its ``concurrency``;
- no window of ``period`` seconds holds more than ``limit`` claims;
- runs of one partition started one at a time, in submit order;
- a duplicate submit of a live dedup key returned the live run and stored nothing.

**Benchmark.** Runs/s of 1, 2, 4 and 8 worker processes on I/O-bound runs (a
chain of nodes sleeping 20 ms, so the two cores are not the limit), on
SQLite and Postgres; submit -> first node start and answer -> resumed node
start latencies (p50/p99) with idle workers; and, with ``--dbos`` (``pip
install dbos``, in this interpreter or the one ``--dbos-python`` names), the
same workload through a DBOS ``Queue`` with the same number of workers.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import collections
import contextlib
import dataclasses
import itertools
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Environment variable naming the side file the graph's handlers append to.
SIDE_ENV = "TAILRACE_FLEET_SIDE"
QUEUE = "fleet"
#: Seconds before a worker that does not print its banner counts as hung.
START_GUARD = 60.0

GRAPH_SOURCE = '''
"""The fleet graphs. Handlers log every start to the side file named by $@SIDE_ENV@."""

import asyncio
import hashlib
import os

import tailrace as tr

graph = tr.Graph("fleet")


def _delay(run_id, node_id, visit, low=0.005, high=0.050):
    digest = hashlib.sha256(f"{run_id}/{node_id}/{visit}".encode()).digest()
    return low + (high - low) * int.from_bytes(digest[:4], "big") / 2**32


def _log(ctx):
    path = os.environ.get("@SIDE_ENV@")
    if not path:
        return
    line = f"{ctx.run_id} {ctx.node_id} {ctx.visit}\\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def node(name, fn, kind="task", **options):
    async def handler(payload):
        ctx = tr.current_node()
        _log(ctx)
        await asyncio.sleep(_delay(ctx.run_id, ctx.node_id, ctx.visit))
        return fn(payload)

    graph.add_node(name, handler, kind, **options)


node("s0", lambda x: x + 1)
node("s1", lambda x: x * 2)
graph.add_edge("s0", "s1")
for i in range(6):
    node(f"f{i}", lambda x, i=i: x + i)
    graph.add_edge("s1", f"f{i}")
node("join", lambda xs: sum(xs), "aggregate")
for i in range(6):
    graph.add_edge(f"f{i}", "join")
node("g0", lambda x: x % 97)
node("g1", lambda x: x + 3)
graph.chain("join", "g0", "g1")
node("route", lambda x: "even" if x % 2 == 0 else "odd", "switch")
node("even", lambda x: x // 2)
node("odd", lambda x: 3 * x + 1)
node("merge", lambda x: x, any_of=True)
graph.add_edge("g1", "route")
graph.add_edge("route", "even", route="even")
graph.add_edge("route", "odd", route="odd")
graph.add_edge("even", "merge")
graph.add_edge("odd", "merge")
node("spin", lambda x: x + 1, max_visits=3)
graph.add_edge("merge", "spin")
graph.add_edge("spin", "spin")
node("t0", lambda x: [x, x + 1])
node("t1", lambda xs: {"sum": sum(xs)})
node("t2", lambda d: d["sum"] * 10)
node("t3", lambda x: f"done:{x}")
graph.chain("spin", "t0", "t1", "t2", "t3")

# The benchmark's run: a chain of nodes that each wait 20 ms (I/O-bound).
io = tr.Graph("fleet_io")


def _io_node(name):
    async def handler(x):
        await asyncio.sleep(0.020)
        return x + 1

    io.add_node(name, handler)


for _n in range(5):
    _io_node(f"io{_n}")
io.chain(*[f"io{_n}" for _n in range(5)])

# The latency probe: a gate whose answer resumes a task.
probe = tr.Graph("fleet_probe")


@probe.task()
async def ask(x):
    return x


@probe.gate()
async def wait_here(x):
    return {"question": x}


@probe.task()
async def after(answer):
    return answer


probe.chain("ask", "wait_here", "after")

# The adoption measure's run: a quick step, then one that holds its worker until cancelled.
adopt = tr.Graph("fleet_adopt")


@adopt.task()
async def warm(x):
    _log(tr.current_node())
    return x


@adopt.task()
async def hold(x):
    _log(tr.current_node())
    await asyncio.sleep(3600)
    return x


adopt.chain("warm", "hold")
'''.replace("@SIDE_ENV@", SIDE_ENV)


# --- stores -----------------------------------------------------------------------------------


@dataclass
class Target:
    """Where a session's store lives: a SQLite file, or a fresh schema of a Postgres database."""

    kind: str
    workdir: Path
    dsn: str | None = None
    schema: str = field(default_factory=lambda: f"fleet_{uuid.uuid4().hex[:10]}")

    @property
    def url(self) -> str:
        """What ``--db`` and ``open_store`` take."""
        if self.kind == "sqlite":
            return str(self.workdir / "fleet.db")
        assert self.dsn is not None
        sep = "&" if "?" in self.dsn else "?"
        return f"{self.dsn}{sep}schema={self.schema}"

    @contextlib.contextmanager
    def sql(self) -> Iterator[Any]:
        """A plain synchronous connection for the harness's own reads (autocommit)."""
        if self.kind == "sqlite":
            conn = sqlite3.connect(f"file:{self.url}?mode=ro", uri=True, timeout=30)
            try:
                yield conn
            finally:
                conn.close()
            return
        import psycopg

        with psycopg.connect(self.dsn or "", autocommit=True) as conn:
            conn.execute(f'SET search_path TO "{self.schema}"')
            yield conn

    def drop(self) -> None:
        """Remove the session's schema (Postgres; the SQLite file goes with the workdir)."""
        if self.kind != "postgres":
            return
        import psycopg

        with psycopg.connect(self.dsn or "", autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{self.schema}" CASCADE')

    def rows(self, query: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        """Every row of ``query`` (``?`` placeholders)."""
        with self.sql() as conn:
            if self.kind == "postgres":
                query = query.replace("?", "%s")
            return [tuple(r) for r in conn.execute(query, params).fetchall()]


def open_target(target: Target) -> Any:
    from tailrace.stores import open_store

    return open_store(target.url)


# --- worker processes ---------------------------------------------------------------------------


def tailrace_command() -> list[str]:
    """The ``tailrace`` console script of this interpreter (or the module, run by path)."""
    script = Path(sys.executable).parent / "tailrace"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "from tailrace.cli import main; main()"]


class WorkerProcess:
    """One ``tailrace worker`` process; its output goes to a log file.

    ``env`` adds to the environment it inherits (less any ``TAILRACE_*``
    variable of this process); ``prefix`` is a command it runs under, which
    must exec it in place (``ip netns exec NAME``), so ``proc.pid`` stays the
    worker's own pid.
    """

    def __init__(
        self,
        target: Target,
        graph_file: Path | None,
        name: str,
        queues: Sequence[str] = (QUEUE,),
        *,
        env: Mapping[str, str] | None = None,
        prefix: Sequence[str] = (),
        **options: Any,
    ) -> None:
        self.name = name
        self.log = target.workdir / f"{name}.log"
        args = [*prefix, *tailrace_command(), "worker", "--db", target.url]
        if graph_file is not None:
            args += ["--graphs", str(graph_file)]
        for queue in queues:
            args += ["--queue", queue]
        for key, value in options.items():
            flag = key.replace("_", "-")
            if isinstance(value, bool):  # a switch: --flag / --no-flag
                args.append(f"--{flag}" if value else f"--no-{flag}")
            else:
                args += [f"--{flag}", str(value)]
        environ = {k: v for k, v in os.environ.items() if not k.startswith("TAILRACE_")}
        environ[SIDE_ENV] = str(target.workdir / "side.log")
        environ["COLUMNS"] = "300"
        environ.update(env or {})
        with self.log.open("a") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=environ)

    def ready(self) -> bool:
        """Whether it printed its banner (its store is open and it is serving)."""
        return "serving " in self.log.read_text(errors="replace")

    def cpu(self) -> float:
        """CPU seconds (user + system) the process used so far; 0 once it exited."""
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return 0.0
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def kill(self) -> None:
        """SIGKILL, then reap: a zombie's pid still exists, and would look alive to the fleet."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM and wait (the worker drains)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def wait_ready(workers: Sequence[WorkerProcess], guard: float = START_GUARD) -> None:
    deadline = time.monotonic() + guard
    while not all(w.ready() for w in workers):
        for w in workers:
            if w.proc.poll() is not None:
                raise RuntimeError(f"worker {w.name} exited: {w.log.read_text()[-2000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError("workers did not start in time")
        time.sleep(0.02)


# --- sampling the store ---------------------------------------------------------------------------


class RunningSampler:
    """A thread that reads the queue's running count every ``interval`` seconds; keeps the maximum."""

    def __init__(self, target: Target, interval: float = 0.005) -> None:
        self.target = target
        self.interval = interval
        self.most = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True)

    def __enter__(self) -> RunningSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _main(self) -> None:
        query = "SELECT COUNT(*) FROM runs WHERE queue_name = ? AND status = 'running'"
        with self.target.sql() as conn:
            if self.target.kind == "postgres":
                query = query.replace("?", "%s")
            while not self._stop.wait(self.interval):
                with contextlib.suppress(Exception):  # a locked moment: sample again
                    (count,) = conn.execute(query, (QUEUE,)).fetchone()
                    self.most = max(self.most, int(count))
                    self.samples += 1


# --- the torture -------------------------------------------------------------------------------------


@dataclass
class TortureConfig:
    """One torture session's sizes and queue limits."""

    runs: int = 400
    kills: int = 30
    workers: int = 4
    worker_concurrency: int = 6
    concurrency: int = 14
    limit: int = 60
    period: float = 1.0
    partitions: int = 8
    partitioned_every: int = 4
    duplicates: int = 40
    lease_ttl: float = 5.0
    kill_gap: tuple[float, float] = (0.15, 0.6)
    deadline: float = 240.0


@dataclass
class Stats:
    """What a torture session saw; the checks are the counts that must be zero (and the limits)."""

    store: str
    seed: int
    runs: int = 0
    completed: int = 0
    kills: int = 0
    restarts: int = 0
    snapshots: int = 0
    executions: int = 0
    reexec_committed: int = 0
    reexec_uncommitted: int = 0
    mismatches: int = 0
    max_running: int = 0
    running_samples: int = 0
    concurrency: int = 0
    rate_violations: int = 0
    partition_violations: int = 0
    dedup_violations: int = 0
    mid_run_kills: int = 0
    adopted_runs: int = 0
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)

    def problem(self, text: str) -> None:
        if len(self.problems) < 30:
            self.problems.append(text)

    def __str__(self) -> str:
        fields = dataclasses.asdict(self)
        fields.pop("problems")
        return ", ".join(f"{k}={v}" for k, v in fields.items())


def write_graph(workdir: Path) -> Path:
    path = workdir / "fleet_graph.py"
    path.write_text(GRAPH_SOURCE)
    return path


def load_graphs(graph_file: Path) -> Any:
    from tailrace.graph import load_file_module

    return load_file_module(str(graph_file))


async def expected_results(module: Any, inputs: dict[str, int]) -> dict[str, dict[str, Any]]:
    """Each run's results as an uninterrupted in-process run computes them (JSON-normalised)."""
    import tailrace as tr

    engine = tr.Engine()
    old = os.environ.pop(SIDE_ENV, None)
    try:
        results = await asyncio.gather(
            *(engine.run(module.graph, x, run_id=run_id) for run_id, x in inputs.items())
        )
    finally:
        if old is not None:
            os.environ[SIDE_ENV] = old
    return {r.run_id: json.loads(json.dumps(r.results)) for r in results}


async def submit_all(
    target: Target,
    module: Any,
    graph_ref: str,
    cfg: TortureConfig,
    rng: random.Random,
    stats: Stats,
) -> tuple[dict[str, int], dict[str, str]]:
    """Submit the runs and the duplicate submits; returns inputs by run and partitions by run."""
    import tailrace as tr
    from tailrace.stores import Queue

    inputs: dict[str, int] = {}
    partitions: dict[str, str] = {}
    async with open_target(target) as store:
        await store.declare_queue(
            Queue(
                QUEUE, concurrency=cfg.concurrency, worker_concurrency=cfg.worker_concurrency,
                limit=cfg.limit, period=cfg.period, order="priority",
            )
        )  # fmt: skip
        engine = tr.Engine(store=store)
        for n in range(cfg.runs):
            run_id = f"run-{n:04d}"
            partition = f"p{n % cfg.partitions}" if n % cfg.partitioned_every == 0 else None
            got = await engine.submit(
                module.graph, n, queue=QUEUE, run_id=run_id, priority=rng.randrange(4),
                partition=partition, dedup_key=f"key-{n}", graph_ref=graph_ref,
            )  # fmt: skip
            inputs[got] = n
            if partition is not None:
                partitions[got] = partition
        for k in range(cfg.duplicates):  # while every key is live (nothing was claimed yet)
            n = rng.randrange(cfg.runs)
            got = await engine.submit(
                module.graph, -1, queue=QUEUE, run_id=f"dup-{k}", dedup_key=f"key-{n}",
                graph_ref=graph_ref,
            )  # fmt: skip
            if got != f"run-{n:04d}":
                stats.dedup_violations += 1
                stats.problem(f"duplicate of key-{n} returned {got!r}, not run-{n:04d}")
    return inputs, partitions


class SideFile:
    """The handlers' start log and the committed-visit snapshots taken against it."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.path = target.workdir / "side.log"
        self.snapshots: list[tuple[frozenset[tuple[str, str, int]], int]] = []

    def snapshot(self) -> None:
        """Committed visits first, then the log's length: a later start of one is a re-run."""
        committed = frozenset(
            (r, n, int(v))
            for r, n, v in self.target.rows("SELECT run_id, node_id, visit FROM results")
        )
        size = self.path.stat().st_size if self.path.exists() else 0
        self.snapshots.append((committed, size))

    def check(self, stats: Stats) -> None:
        data = self.path.read_bytes() if self.path.exists() else b""
        starts: list[tuple[int, tuple[str, str, int]]] = []
        offset = 0
        for line in data.splitlines(keepends=True):
            parts = line.decode().split()
            if len(parts) == 3:
                starts.append((offset, (parts[0], parts[1], int(parts[2]))))
            offset += len(line)
        stats.executions = len(starts)
        seen: dict[tuple[str, str, int], int] = {}
        for _, visit in starts:
            seen[visit] = seen.get(visit, 0) + 1
        stats.reexec_uncommitted = sum(n - 1 for n in seen.values())
        offsets = [o for o, _ in starts]
        flagged: set[tuple[str, str, int]] = set()
        for committed, size in self.snapshots:
            for _, visit in starts[bisect.bisect_left(offsets, size) :]:
                if visit in committed and visit not in flagged:
                    flagged.add(visit)
                    stats.problem(f"committed visit {visit} started again after a snapshot")
        stats.reexec_committed = len(flagged)
        stats.reexec_uncommitted -= len(flagged)
        stats.snapshots = len(self.snapshots)


def torture(
    store: str,
    *,
    workdir: Path,
    seed: int,
    dsn: str | None = None,
    config: TortureConfig | None = None,
) -> Stats:
    """One torture session on ``store`` (``sqlite`` or ``postgres``); returns its :class:`Stats`."""
    cfg = config or TortureConfig()
    rng = random.Random(seed)
    stats = Stats(store=store, seed=seed, concurrency=cfg.concurrency)
    target = Target(store, workdir, dsn)
    graph_file = write_graph(workdir)
    module = load_graphs(graph_file)
    started = time.monotonic()
    try:
        inputs, partitions = asyncio.run(
            submit_all(target, module, f"{graph_file}:graph", cfg, rng, stats)
        )
        stats.runs = len(inputs)
        expected = asyncio.run(expected_results(module, inputs))
        side = SideFile(target)
        with RunningSampler(target) as sampler:
            _run_fleet(target, graph_file, cfg, rng, stats, side, len(inputs))
        stats.max_running, stats.running_samples = sampler.most, sampler.samples
        side.snapshot()
        side.check(stats)
        _check_runs(target, expected, stats)
        _check_rate(target, cfg, stats)
        _check_partitions(target, partitions, stats)
        if stats.max_running > cfg.concurrency:
            stats.problem(f"{stats.max_running} runs running at once, above {cfg.concurrency}")
    finally:
        stats.seconds = time.monotonic() - started
        if not os.environ.get("TAILRACE_FLEET_KEEP"):  # kept to look into a failure
            with contextlib.suppress(Exception):
                target.drop()
    return stats


def _run_fleet(
    target: Target,
    graph_file: Path,
    cfg: TortureConfig,
    rng: random.Random,
    stats: Stats,
    side: SideFile,
    total: int,
) -> None:
    options = {
        "concurrency": cfg.worker_concurrency, "lease_ttl": cfg.lease_ttl, "grace": 1.0,
        "max_interval": 0.5,
        # A torture heartbeat: dead workers are found and their runs adopted within
        # a second or two, so kills keep landing on workers in the middle of runs.
        "heartbeat": 1.0,
    }  # fmt: skip
    count = 0

    def spawn() -> WorkerProcess:
        nonlocal count
        count += 1
        return WorkerProcess(target, graph_file, f"worker-{count}", **options)

    workers = [spawn() for _ in range(cfg.workers)]
    deadline = time.monotonic() + cfg.deadline
    next_kill = time.monotonic() + rng.uniform(*cfg.kill_gap)
    next_snapshot = time.monotonic() + 0.5
    try:
        while True:
            done = _finished(target)
            if done >= total:
                break
            if time.monotonic() > deadline:
                stats.problem(f"only {done} of {total} runs finished within {cfg.deadline:g}s")
                break
            now = time.monotonic()
            ready = [i for i, w in enumerate(workers) if w.ready()]
            if stats.kills < cfg.kills and now >= next_kill and len(ready) >= 2:
                # Workers in the middle of runs are the victims when there are two, so
                # kills cut runs however loaded the machine is (not only start-ups).
                holding = {i: _holding(target, workers[i]) for i in ready}
                busy = [i for i in ready if holding[i] > 0]
                if busy:
                    # Busy workers first (in random order), then others to make two.
                    idle = [i for i in ready if i not in busy]
                    rng.shuffle(busy)
                    rng.shuffle(idle)
                    for victim in (busy + idle)[:2]:
                        workers[victim].kill()
                        stats.kills += 1
                        stats.mid_run_kills += holding[victim] > 0
                    side.snapshot()  # right after the kills: nothing committed may start again
                    for victim in sorted(
                        {v for v in range(len(workers)) if workers[v].proc.poll() is not None}
                    ):
                        workers[victim] = spawn()
                        stats.restarts += 1
                    next_kill = now + rng.uniform(*cfg.kill_gap)
                else:  # nobody holds a run this instant: try again in a moment
                    next_kill = now + 0.05
            elif now >= next_snapshot:
                side.snapshot()
                next_snapshot = now + 0.5
            time.sleep(0.01)
    finally:
        for worker in workers:
            worker.stop()
    stats.adopted_runs = _adopted(target)


def _holding(target: Target, worker: WorkerProcess) -> int:
    """How many running runs ``worker`` holds leases on (its owner name starts ``host:pid:``)."""
    import socket

    prefix = f"{socket.gethostname()}:{worker.proc.pid}:%"
    (n,) = target.rows(
        "SELECT COUNT(*) FROM runs WHERE status = 'running' AND lease_owner LIKE ?", (prefix,)
    )[0]
    return int(n)


def _finished(target: Target) -> int:
    (n,) = target.rows(
        "SELECT COUNT(*) FROM runs WHERE queue_name = ? AND status IN ('completed', 'failed', 'cancelled')",
        (QUEUE,),
    )[0]
    return int(n)


def _adopted(target: Target) -> int:
    (n,) = target.rows("SELECT COUNT(DISTINCT run_id) FROM events WHERE type = 'run_resumed'")[0]
    return int(n)


def _check_runs(target: Target, expected: dict[str, dict[str, Any]], stats: Stats) -> None:
    statuses = dict(target.rows("SELECT run_id, status FROM runs WHERE queue_name = ?", (QUEUE,)))
    if set(statuses) != set(expected):
        extra = sorted(set(statuses) - set(expected))[:5]
        stats.dedup_violations += len(set(statuses) ^ set(expected))
        stats.problem(f"runs stored {len(statuses)}, submitted {len(expected)}; extra {extra}")
    stats.completed = sum(s == "completed" for s in statuses.values())
    rows = target.rows("SELECT run_id, node_id, visit, value_json FROM results")
    latest: dict[str, dict[str, tuple[int, Any]]] = {}
    for run_id, node_id, visit, value_json in rows:
        mine = latest.setdefault(run_id, {})
        if node_id not in mine or mine[node_id][0] < visit:
            mine[node_id] = (int(visit), json.loads(value_json))
    for run_id, want in expected.items():
        got = {n: v for n, (_, v) in latest.get(run_id, {}).items()}
        if statuses.get(run_id) != "completed" or got != want:
            stats.mismatches += 1
            stats.problem(f"{run_id}: {statuses.get(run_id)}, results differ: {got} != {want}")


def _check_rate(target: Target, cfg: TortureConfig, stats: Stats) -> None:
    starts = sorted(
        float(t)
        for (t,) in target.rows(
            "SELECT started_at FROM runs WHERE queue_name = ? AND started_at IS NOT NULL", (QUEUE,)
        )
    )
    for j, t in enumerate(starts):
        first = bisect.bisect_right(starts, t - cfg.period)
        if j + 1 - first > cfg.limit:
            stats.rate_violations += 1
            stats.problem(f"{j + 1 - first} claims within {cfg.period}s before {t:.3f}")


def _check_partitions(target: Target, partitions: dict[str, str], stats: Stats) -> None:
    rows = target.rows(
        "SELECT run_id, queued_at, started_at, finished_at FROM runs WHERE partition_key IS NOT NULL"
    )
    by_key: dict[str, list[tuple[float, str, float, float]]] = {}
    for run_id, queued, started, finished in rows:
        by_key.setdefault(partitions.get(run_id, "?"), []).append(
            (float(queued), run_id, float(started or 0), float(finished or 0))
        )
    for key, runs in by_key.items():
        runs.sort()
        for before, after in itertools.pairwise(runs):
            if after[2] < before[3]:
                stats.partition_violations += 1
                stats.problem(f"partition {key}: {after[1]} started before {before[1]} finished")


# --- the benchmark --------------------------------------------------------------------------------


@dataclass
class BenchConfig:
    """Sizes of the benchmark."""

    workers: tuple[int, ...] = (1, 2, 4, 8)
    runs_per_worker: int = 40
    worker_concurrency: int = 1
    latency_samples: int = 60


def bench_rate(
    target: Target, graph_file: Path, module: Any, n_workers: int, cfg: BenchConfig
) -> float:
    """Runs/s of ``n_workers`` worker processes on ``runs_per_worker * n_workers`` I/O-bound runs."""
    import tailrace as tr

    workers = [
        WorkerProcess(
            target, graph_file, f"bench-{n_workers}-{i}", concurrency=cfg.worker_concurrency
        )
        for i in range(n_workers)
    ]
    try:
        wait_ready(workers)
        total = cfg.runs_per_worker * n_workers
        tag = uuid.uuid4().hex[:6]

        async def submit() -> None:
            async with open_target(target) as store:
                engine = tr.Engine(store=store)
                for n in range(total):
                    await engine.submit(
                        module.io,
                        n,
                        queue=QUEUE,
                        run_id=f"io-{tag}-{n}",
                        graph_ref=f"{graph_file}:io",
                    )

        asyncio.run(submit())
        deadline = time.monotonic() + 600
        while True:
            (done,) = target.rows(
                "SELECT COUNT(*) FROM runs WHERE run_id LIKE ? AND status = 'completed'",
                (f"io-{tag}-%",),
            )[0]
            if done >= total or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        (first, last) = target.rows(
            "SELECT MIN(started_at), MAX(finished_at) FROM runs WHERE run_id LIKE ?",
            (f"io-{tag}-%",),
        )[0]
        return total / (float(last) - float(first))
    finally:
        for worker in workers:
            worker.stop()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def bench_latency(
    target: Target, graph_file: Path, module: Any, samples: int, workers: int = 1
) -> tuple[list[float], list[float]]:
    """Submit -> first node start and answer -> resumed node start, seconds, with ``workers``
    idle workers (all of them woken by each submit; one claims it)."""
    import tailrace as tr
    from tailrace.stores import QuestionStatus

    fleet = [
        WorkerProcess(target, graph_file, f"latency{i}", concurrency=4) for i in range(workers)
    ]
    submit_lat: list[float] = []
    answer_lat: list[float] = []
    try:
        wait_ready(fleet)

        async def probe() -> None:
            async with open_target(target) as store:
                engine = tr.Engine(store=store)
                for n in range(samples):
                    await asyncio.sleep(0.05)  # the worker is idle again
                    t0 = time.time()
                    run_id = await engine.submit(
                        module.probe, n, queue=QUEUE, graph_ref=f"{graph_file}:probe"
                    )
                    result = await engine.wait(run_id, timeout=60)
                    submit_lat.append(await _first_start(store, run_id, "ask") - t0)
                    (question,) = result.questions
                    await asyncio.sleep(0.05)
                    t1 = time.time()
                    await engine.answer(question.question_id, n, resume=False)
                    await engine.wait(run_id, timeout=60)
                    answer_lat.append(await _first_start(store, run_id, "after") - t1)
                    assert (
                        await store.get_question(question.question_id)
                    ).status is QuestionStatus.APPLIED

        asyncio.run(probe())
    finally:
        for worker in fleet:
            worker.stop()
    return submit_lat, answer_lat


async def _first_start(store: Any, run_id: str, node_id: str) -> float:
    return min(
        e.ts
        for e in await store.events(run_id)
        if e.type == "node_started" and e.node_id == node_id
    )


DBOS_WORKER = """
import asyncio, os, sys, time
from dbos import DBOS

DBOS(config={"name": "fleet-bench", "system_database_url": sys.argv[1],
             "executor_id": f"w{os.getpid()}"})


@DBOS.step()
async def io_step(x):
    await asyncio.sleep(0.020)
    return x + 1


@DBOS.workflow()
async def io_run(x):
    for _ in range(5):
        x = await io_step(x)
    return x


@DBOS.step()
async def now_step():
    return time.time()


@DBOS.workflow()
async def probe_run(x):
    return await now_step()  # when its first step started, as tailrace's first node start


DBOS.launch()
DBOS.register_queue("bench", worker_concurrency=int(sys.argv[2]))  # default polling: 1 s
print("serving", flush=True)
while True:
    time.sleep(1)
"""


def bench_dbos(
    python: str, sysdb: str, workdir: Path, n_workers: int, cfg: BenchConfig
) -> tuple[float, list[float]]:
    """Runs/s and submit -> start latencies of the same workload through a DBOS Queue."""
    script = workdir / "dbos_worker.py"
    script.write_text(DBOS_WORKER)
    client_script = workdir / "dbos_client.py"
    client_script.write_text(_DBOS_CLIENT)
    procs = []
    logs = []
    try:
        for i in range(n_workers):
            log = workdir / f"dbos-{n_workers}-{i}.log"
            logs.append(log)
            with log.open("w") as out:
                procs.append(
                    subprocess.Popen(
                        [python, str(script), sysdb, str(cfg.worker_concurrency)],
                        stdout=out, stderr=subprocess.STDOUT, cwd=workdir,
                    )
                )  # fmt: skip
        deadline = time.monotonic() + START_GUARD
        while not all("serving" in log.read_text(errors="replace") for log in logs):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError("DBOS workers did not start: " + logs[0].read_text()[-2000:])
            time.sleep(0.05)
        out = subprocess.run(
            [python, str(client_script), sysdb, str(cfg.runs_per_worker * n_workers),
             str(min(cfg.latency_samples, 20))],
            capture_output=True, text=True, check=True, cwd=workdir,
        )  # fmt: skip
        report = json.loads(out.stdout.strip().splitlines()[-1])
        return float(report["rate"]), [float(x) for x in report["latencies"]]
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGKILL)
            proc.wait()


_DBOS_CLIENT = """
import json, sys, time
from dbos import DBOSClient

client = DBOSClient(system_database_url=sys.argv[1])
total, samples = int(sys.argv[2]), int(sys.argv[3])
options = {"queue_name": "bench", "workflow_name": "io_run"}
handles = [client.enqueue(options, n) for n in range(total)]
for h in handles:
    h.get_result()
statuses = [client.retrieve_workflow(h.workflow_id).get_status() for h in handles]
first = min(s.dequeued_at for s in statuses if s.dequeued_at) / 1000.0
last = max(s.completed_at or s.updated_at for s in statuses) / 1000.0
latencies = []
for n in range(samples):
    time.sleep(0.05)  # the workers are idle again
    start = time.time()
    h = client.enqueue({"queue_name": "bench", "workflow_name": "probe_run"}, n)
    latencies.append(h.get_result() - start)
print(json.dumps({"rate": total / (last - first), "latencies": latencies}))
"""


def run_bench(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import Column, Table, environment

    cfg = BenchConfig(
        workers=tuple(int(x) for x in args.workers.split(",")),
        runs_per_worker=args.runs_per_worker,
        worker_concurrency=args.per_worker,
        latency_samples=args.samples,
    )
    rates = Table(
        f"fleet: runs/s of I/O-bound runs (5 nodes x 20 ms, {cfg.worker_concurrency} at once per worker)",
        [Column("store"), Column("workers", right=True), Column("runs/s", right=True),
         Column("x 1 worker", right=True), Column("of linear", right=True)],
    )  # fmt: skip
    lat = Table(
        "fleet: latencies with idle workers (ms)",
        [Column("store"), Column("what"), Column("p50", right=True), Column("p99", right=True)],
    )
    for kind in stores_of(args):
        with tempfile.TemporaryDirectory(prefix="tailrace-fleet-") as tmp:
            workdir = Path(tmp)
            graph_file = write_graph(workdir)
            module = load_graphs(graph_file)
            base = None
            for n in cfg.workers:
                target = Target(kind, workdir / f"w{n}", args.dsn)
                target.workdir.mkdir()
                _declare(target, cfg)
                try:
                    rate = bench_rate(target, graph_file, module, n, cfg)
                finally:
                    target.drop()
                base = base or rate / n
                rates.add_row(
                    kind, n, f"{rate:.1f}", f"{rate / (base):.2f}", f"{rate / (base * n):.2f}"
                )
            for count in sorted({1, max(cfg.workers)}):
                target = Target(kind, workdir / f"lat{count}", args.dsn)
                target.workdir.mkdir()
                _declare(target, cfg)
                try:
                    submit_lat, answer_lat = bench_latency(
                        target, graph_file, module, cfg.latency_samples, workers=count
                    )
                finally:
                    target.drop()
                where = "" if count == 1 else f" ({count} workers)"
                for what, values in (
                    (f"submit -> start{where}", submit_lat),
                    (f"answer -> resume{where}", answer_lat),
                ):
                    lat.add_row(
                        kind,
                        what,
                        f"{1000 * percentile(values, 0.5):.1f}",
                        f"{1000 * percentile(values, 0.99):.1f}",
                    )
            if args.dbos:
                _bench_dbos(args, kind, workdir, cfg, rates, lat)
    print(environment(no_gc=False), end="\n\n")
    rates.print()
    lat.print()


def _bench_dbos(
    args: argparse.Namespace, kind: str, workdir: Path, cfg: BenchConfig, rates: Any, lat: Any
) -> None:
    base = None
    for n in cfg.workers:
        schema = f"dbos_{uuid.uuid4().hex[:8]}"
        if kind == "sqlite":
            sysdb = f"sqlite:///{workdir}/dbos-{n}.sqlite"
        else:
            sysdb = _dbos_pg_url(args.dsn, schema)
        try:
            rate, latencies = bench_dbos(args.dbos_python, sysdb, workdir, n, cfg)
        except Exception as exc:  # report why, keep the tailrace numbers
            rates.add_note(f"DBOS {kind} with {n} workers failed: {str(exc)[-300:]}")
            continue
        finally:
            if kind == "postgres":
                _drop_database(args.dsn, schema)
        base = base or rate / n
        rates.add_row(
            f"dbos {kind}", n, f"{rate:.1f}", f"{rate / base:.2f}", f"{rate / (base * n):.2f}"
        )
        if n == cfg.workers[0]:
            lat.add_row(
                f"dbos {kind}",
                "submit -> start",
                f"{1000 * percentile(latencies, 0.5):.1f}",
                f"{1000 * percentile(latencies, 0.99):.1f}",
            )


def _dbos_pg_url(dsn: str, name: str) -> str:
    """A database of its own for DBOS (it creates it), on the server ``dsn`` names."""
    import psycopg.conninfo

    info = psycopg.conninfo.conninfo_to_dict(dsn)
    host = info.get("host", "localhost")
    user = info.get("user", "postgres")
    if host.startswith("/"):
        return f"postgresql://{user}@/{name}?host={host}"
    port = info.get("port", "5432")
    return f"postgresql://{user}@{host}:{port}/{name}"


def _drop_database(dsn: str, name: str) -> None:
    import psycopg

    with contextlib.suppress(Exception), psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _declare(target: Target, cfg: BenchConfig) -> None:
    from tailrace.stores import Queue

    async def declare() -> None:
        async with open_target(target) as store:
            await store.declare_queue(Queue(QUEUE, worker_concurrency=cfg.worker_concurrency))

    asyncio.run(declare())


def stores_of(args: argparse.Namespace) -> list[str]:
    if args.store == "both":
        return ["sqlite", "postgres"] if args.dsn else ["sqlite"]
    if args.store == "postgres" and not args.dsn:
        raise SystemExit("postgres needs --dsn or TAILRACE_TEST_POSTGRES_DSN")
    return [args.store]


def run_torture(args: argparse.Namespace) -> int:
    failures = 0
    for kind in stores_of(args):
        cfg = TortureConfig(runs=args.runs, kills=args.kills)
        with tempfile.TemporaryDirectory(prefix="tailrace-fleet-") as tmp:
            stats = torture(kind, workdir=Path(tmp), seed=args.seed, dsn=args.dsn, config=cfg)
        print(stats)
        for problem in stats.problems:
            print("  ", problem)
        failures += bool(stats.problems)
    return 1 if failures else 0


# --- adoption after SIGKILL -----------------------------------------------------------------------


@dataclass
class Kill:
    """One SIGKILL of the adoption measure: the runs it orphaned, and when each had a new owner."""

    orphans: int
    seconds: float


def machine_load() -> str:
    """The 1, 5 and 15 minute load averages, as ``/proc/loadavg`` has them."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def _owners(conn: Any, kind: str, ids: Sequence[str]) -> dict[str, str | None]:
    mark = "?" if kind == "sqlite" else "%s"
    query = f"SELECT run_id, lease_owner FROM runs WHERE run_id IN ({', '.join([mark] * len(ids))})"
    return {str(r[0]): r[1] for r in conn.execute(query, tuple(ids)).fetchall()}


def _pid_of(owner: str | None) -> int | None:
    """The process id in a lease owner's name (``host:pid:start:nonce``)."""
    parts = (owner or "").rsplit(":", 3)
    return int(parts[1]) if len(parts) == 4 and parts[1].isdigit() else None


async def adoption(
    kind: str, *, workdir: Path, dsn: str | None, kills: int, workers: int = 3, per_worker: int = 2
) -> list[Kill]:
    """``kills`` times: ``workers`` workers hold ``per_worker`` runs each (with as many slots
    free: the survivors have room); the one holding most is SIGKILLed; how long until a
    live worker leases every run it held (polled every 2 ms), then a fresh worker takes its
    place and the round's runs are cancelled."""
    import tailrace as tr

    target = Target(kind, workdir, dsn)
    graph_file = write_graph(workdir)
    module = load_graphs(graph_file)
    slots = 2 * per_worker
    fleet = [WorkerProcess(target, graph_file, f"w{n}", concurrency=slots) for n in range(workers)]
    measured: list[Kill] = []
    try:
        wait_ready(fleet)
        async with open_target(target) as store:
            engine = tr.Engine(store=store)
            for k in range(kills):
                ids = [
                    await engine.submit(module.adopt, n, queue=QUEUE, run_id=f"a{k}-{n}")
                    for n in range(workers * per_worker)
                ]
                with target.sql() as conn:
                    owners = await _until_owned(conn, kind, ids)
                pids = {p.proc.pid: p for p in fleet}
                held: dict[int, list[str]] = {}
                for run_id, owner in owners.items():
                    held.setdefault(_pid_of(owner) or -1, []).append(run_id)
                victim_pid = max((p for p in held if p in pids), key=lambda p: len(held[p]))
                victim = pids[victim_pid]
                orphans = held[victim_pid]
                seconds = await asyncio.to_thread(_kill_and_watch, target, victim, orphans)
                measured.append(Kill(orphans=len(orphans), seconds=seconds))
                fleet[fleet.index(victim)] = WorkerProcess(
                    target, graph_file, f"{victim.name}-{k}", concurrency=slots
                )
                for run_id in ids:
                    await engine.cancel(run_id)
                await _until_ended(store, ids)
                wait_ready(fleet)
    finally:
        for proc in fleet:
            proc.stop(timeout=30)
        target.drop()
    return measured


def _kill_and_watch(target: Target, victim: WorkerProcess, orphans: Sequence[str]) -> float:
    """SIGKILL ``victim``; seconds until a live worker leases each of ``orphans`` (2 ms polls)."""
    with target.sql() as conn:
        killed = time.monotonic()
        victim.kill()
        while True:
            now = _owners(conn, target.kind, orphans)
            if all(o is not None and _pid_of(o) != victim.proc.pid for o in now.values()):
                return time.monotonic() - killed
            if time.monotonic() - killed > 120:
                raise RuntimeError(f"the runs of worker {victim.name} were never adopted")
            time.sleep(0.002)


async def _until_owned(conn: Any, kind: str, ids: Sequence[str]) -> dict[str, str | None]:
    deadline = time.monotonic() + START_GUARD
    while time.monotonic() < deadline:
        owners = _owners(conn, kind, ids)
        if all(o is not None for o in owners.values()) and len(owners) == len(ids):
            return owners
        await asyncio.sleep(0.02)
    raise RuntimeError("the workers did not claim the round's runs")


async def _until_ended(store: Any, ids: Sequence[str]) -> None:
    from tailrace.stores import TERMINAL_STATUSES

    deadline = time.monotonic() + START_GUARD
    while time.monotonic() < deadline:
        statuses = [(await store.get_run(r)).status for r in ids]
        if all(status in TERMINAL_STATUSES for status in statuses):
            return
        await asyncio.sleep(0.05)
    raise RuntimeError("the round's runs were not cancelled")


def run_adoption(args: argparse.Namespace) -> None:
    import tailrace

    print(f"adoption after SIGKILL ({tailrace.__file__}); machine load {machine_load()}")
    print(f"{'store':>9} {'kills':>6} {'orphans':>8} {'p50 s':>8} {'max s':>8} {'<= 1 s':>7}")
    for kind in stores_of(args):
        with tempfile.TemporaryDirectory(prefix="tailrace-adopt-") as tmp:
            kills = asyncio.run(
                adoption(kind, workdir=Path(tmp), dsn=args.dsn, kills=args.adopt_kills)
            )
        times = sorted(k.seconds for k in kills)
        print(f"{kind:>9} {len(kills):>6} {sum(k.orphans for k in kills):>8} "
              f"{percentile(times, 0.5):>8.3f} {times[-1]:>8.3f} "
              f"{sum(t <= 1.0 for t in times):>4}/{len(times)}")  # fmt: skip
        print("          each:", ", ".join(f"{k.seconds:.3f} s ({k.orphans} runs)" for k in kills))
    print(f"machine load after: {machine_load()}")


# --- idle cost, fairness, claim scaling, statements per run (one Postgres) ---------------------

IDLE_DB = "tailrace_fleet_bench"
#: Seconds to wait before reading ``pg_stat_database``: a backend publishes its counters
#: at most every second while busy, and within 10 s of going idle (PGSTAT_IDLE_INTERVAL).
STATS_LAG = 11.0
#: Seconds of warm-up before an idle window. A backend publishes its counters only between
#: statements, so a worker's ring watcher, which goes from its start-up straight into a lock
#: wait, publishes what its connection did at start-up only when that wait is first remade
#: (60 s): a window that holds that moment counts start-up work as idle cost (a one-off
#: burst of about 14 commits a worker). Past it, the counters grow by the pulses alone.
IDLE_WARMUP = 60.0 + STATS_LAG + 9.0


def _db_dsn(dsn: str, dbname: str) -> str:
    """``dsn`` pointing at database ``dbname`` (its counters are the measurement's alone)."""
    import urllib.parse

    parts = urllib.parse.urlsplit(dsn)
    return urllib.parse.urlunsplit(parts._replace(path="/" + dbname))


def _counters(dsn: str) -> tuple[int, int]:
    """``(xact_commit, tup_returned + tup_fetched)`` of the DSN's database, fresh."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        row = conn.execute(
            "SELECT xact_commit, tup_returned + tup_fetched FROM pg_stat_database "
            "WHERE datname = current_database()"
        ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def _drop_schema(dsn: str, schema: str) -> None:
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def _ensure_database(dsn: str, dbname: str) -> str:
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        if (
            conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (dbname,)).fetchone()
            is None
        ):
            conn.execute(f'CREATE DATABASE "{dbname}"')
    return _db_dsn(dsn, dbname)


def _next_xid(dsn: str) -> int:
    """The server's next transaction id: how many transactions that wrote anything began,
    counted as they begin (not published late like ``pg_stat_database``); server-wide."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT pg_snapshot_xmax(pg_current_snapshot())::text").fetchone()
    assert row is not None
    return int(row[0])


def _background(dsn: str, window: float) -> tuple[float, float, float]:
    """The database's own commits/s, rows/s and writing transactions/s with no worker
    (autovacuum, the measuring)."""
    c0, r0 = _counters(dsn)
    x0 = _next_xid(dsn)
    time.sleep(window)
    c1, r1 = _counters(dsn)
    x1 = _next_xid(dsn)
    return (c1 - c0) / window, (r1 - r0) / window, (x1 - x0) / window


def run_idle(args: argparse.Namespace) -> None:
    """Idle workers' cost: ``--fleet`` real worker processes, then ``--simulate`` workers as
    tasks of this process, on a Postgres of the measure's own (or ``--shared-server``)."""
    import tailrace

    server = contextlib.nullcontext(args.dsn) if args.shared_server else PrivateServer()
    with server as dsn:
        dsn = _ensure_database(dsn, args.database)
        base_c, base_r, base_x = _background(dsn, args.window)
        print(
            f"idle workers ({tailrace.__file__}) on one Postgres, "
            f"{'shared' if args.shared_server else 'of their own'}; {args.window:g} s windows "
            f"after {args.warmup:g} s; the database's background ({base_c:.2f} commits/s, "
            f"{base_r:.0f} rows/s) subtracted; machine load {machine_load()}"
        )
        print(f"{'workers':>8} {'as':>9} {'commits/s':>10} {'per worker':>11} "
              f"{'writes/s':>9} {'per worker':>11} "
              f"{'rows read/s':>12} {'per worker':>11} {'own rows/s':>11} {'per worker':>11} "
              f"{'per commit':>11} {'HOT':>5} {'conns/worker':>13}")  # fmt: skip
        sizes = [("processes", int(x)) for x in args.fleet.split(",") if x]
        sizes += [("tasks", int(x)) for x in args.simulate.split(",") if x]
        for mode, n in sizes:
            measure = _idle_processes if mode == "processes" else _idle_tasks
            idle = measure(dsn, n, args.window, args.warmup)
            commits, rows = max(idle.commits - base_c, 0.0), max(idle.rows - base_r, 0.0)
            writes = max(idle.writes - base_x, 0.0)
            per_commit = idle.own_rows / commits if commits else 0.0
            print(f"{n:>8} {mode:>9} {commits:>10.2f} {commits / n:>11.4f} "
                  f"{writes:>9.2f} {writes / n:>11.4f} {rows:>12.1f} "
                  f"{rows / n:>11.3f} {idle.own_rows:>11.2f} {idle.own_rows / n:>11.4f} "
                  f"{per_commit:>11.2f} {idle.hot:>5.0%} {idle.connections / n:>13.2f}")  # fmt: skip
        print(f"machine load after: {machine_load()}")


def _connections(dsn: str) -> int:
    """Sessions on the DSN's database, besides the one asking."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        ).fetchone()
    return int(row[0]) if row is not None else 0


def _schema_reads(dsn: str, schema: str) -> tuple[int, int, int]:
    """Rows and index entries read from ``schema``'s tables so far (sequential scans' rows,
    index scans' entries): the workers' own reads, without the catalogs' (autovacuum's
    table picks, the measure's own queries); and the ``workers`` table's updates, and how
    many of them were HOT (in place: no index entry written)."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        row = conn.execute(
            "SELECT COALESCE((SELECT SUM(seq_tup_read) FROM pg_stat_user_tables "
            "WHERE schemaname = %s), 0) + COALESCE((SELECT SUM(idx_tup_read) "
            "FROM pg_stat_user_indexes WHERE schemaname = %s), 0), "
            "(SELECT n_tup_upd FROM pg_stat_user_tables WHERE schemaname = %s "
            "AND relname = 'workers'), (SELECT n_tup_hot_upd FROM pg_stat_user_tables "
            "WHERE schemaname = %s AND relname = 'workers')",
            (schema, schema, schema, schema),
        ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1] or 0), int(row[2] or 0)


@dataclass
class Idle:
    """What idle workers cost, per second: commits, rows read (the database's, and their own
    tables' alone), and the connections they hold."""

    commits: float
    rows: float
    own_rows: float
    connections: int
    hot: float
    #: Transactions that wrote, begun per second (server-wide: the fleet's alone on a
    #: private server).
    writes: float


def _window(dsn: str, schema: str, window: float) -> Idle:
    """What the DSN's database did over ``window`` seconds (see :class:`Idle`)."""
    connections = _connections(dsn)
    c0, r0 = _counters(dsn)
    o0, u0, h0 = _schema_reads(dsn, schema)
    x0 = _next_xid(dsn)
    t0 = time.monotonic()
    time.sleep(window)
    c1, r1 = _counters(dsn)
    o1, u1, h1 = _schema_reads(dsn, schema)
    x1 = _next_xid(dsn)
    elapsed = time.monotonic() - t0
    hot = (h1 - h0) / (u1 - u0) if u1 > u0 else 0.0
    return Idle(
        (c1 - c0 - 2) / elapsed, (r1 - r0) / elapsed, (o1 - o0) / elapsed, connections, hot,
        (x1 - x0) / elapsed,
    )  # fmt: skip


def _idle_processes(
    dsn: str, workers: int, window: float, warmup: float
) -> tuple[float, float, int]:
    """Commits/s, rows read/s and connections of ``workers`` idle ``tailrace worker`` processes."""
    with tempfile.TemporaryDirectory(prefix="tailrace-idle-") as tmp:
        target = Target("postgres", Path(tmp), dsn, schema=f"idle_{uuid.uuid4().hex[:8]}")
        fleet: list[WorkerProcess] = []
        try:
            fleet.append(WorkerProcess(target, None, "idle0", queues=("idle",), concurrency=1))
            wait_ready(fleet)  # the first one makes the schema
            fleet += [
                WorkerProcess(target, None, f"idle{n}", queues=("idle",), concurrency=1)
                for n in range(1, workers)
            ]
            wait_ready(fleet, guard=START_GUARD + 3 * workers)
            time.sleep(warmup)
            idle = _window(dsn, target.schema, window)
        finally:
            for proc in fleet:
                proc.proc.send_signal(signal.SIGTERM)
            for proc in fleet:
                proc.stop()
            target.drop()
    return idle


def _idle_tasks(dsn: str, workers: int, window: float, warmup: float) -> Idle:
    """Commits/s, rows read/s and connections of ``workers`` idle ``Worker`` objects, tasks of
    this process sharing one store (a pool of 16)."""
    return asyncio.run(_idle_fleet(dsn, workers, window, warmup))


async def _idle_fleet(dsn: str, workers: int, window: float, warmup: float) -> Idle:
    from tailrace.stores import PostgresStore
    from tailrace.workers import Worker

    schema = f"idle_{uuid.uuid4().hex[:8]}"
    store = PostgresStore(dsn, schema=schema, max_size=16)
    await store.open()
    stop = asyncio.Event()
    fleet = [Worker(store, queues=["idle"], concurrency=1) for _ in range(workers)]
    tasks = [asyncio.create_task(w.run(stop)) for w in fleet]
    try:
        await asyncio.sleep(warmup)
        idle = await asyncio.to_thread(_window, dsn, schema, window)
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        await store.close()
        _drop_schema(dsn, schema)
    return idle


class PrivateServer:
    """A throwaway PostgreSQL of the measure's own: ``initdb`` into a temporary directory,
    a unix socket there only, room for a thousand connections, fsync off; run as the
    ``postgres`` user when we are root. Entering starts it and gives its DSN."""

    def __init__(self, max_connections: int = 1200) -> None:
        self.bindir = Path(os.environ.get("TAILRACE_PG_BINDIR", "/usr/lib/postgresql/15/bin"))
        self.max_connections = max_connections
        self.directory = Path(tempfile.mkdtemp(prefix="tailrace-pgidle-"))

    def _as_owner(self, *argv: str) -> list[str]:
        return ["runuser", "-u", "postgres", "--", *argv] if os.geteuid() == 0 else list(argv)

    def __enter__(self) -> str:
        import shutil

        if os.geteuid() == 0:
            shutil.chown(self.directory, "postgres", "postgres")
        data = self.directory / "data"
        subprocess.run(
            self._as_owner(str(self.bindir / "initdb"), "-D", str(data), "-U", "postgres",
                           "-A", "trust", "-E", "UTF8", "--no-sync"),
            check=True, capture_output=True,
        )  # fmt: skip
        options = (
            f"-k {self.directory} -c listen_addresses='' -c fsync=off "
            f"-c max_connections={self.max_connections} -c shared_buffers=128MB"
        )
        subprocess.run(
            self._as_owner(str(self.bindir / "pg_ctl"), "-D", str(data), "-o", options,
                           "-l", str(self.directory / "server.log"), "-w", "start"),
            check=True, capture_output=True,
        )  # fmt: skip
        return f"postgresql://postgres@/postgres?host={self.directory}"

    def __exit__(self, *exc: object) -> None:
        import shutil

        subprocess.run(
            self._as_owner(str(self.bindir / "pg_ctl"), "-D", str(self.directory / "data"),
                           "-m", "fast", "-w", "stop"),
            capture_output=True,
        )  # fmt: skip
        shutil.rmtree(self.directory, ignore_errors=True)


async def _fairness(dsn: str, slots: int) -> int:
    """How many busy runs started before the lone partition's run (120 busy, 1 lone)."""
    from tailrace.stores import Harvest, NewRun, PostgresStore, Queue, RunStatus, Submission

    schema = f"fair_{uuid.uuid4().hex[:8]}"
    store = PostgresStore(dsn, schema=schema)
    await store.open()
    try:
        try:
            await store.declare_queue(Queue("q", concurrency=slots, partition_concurrency=slots))
        except TypeError:  # a tailrace without partition limits: one slot per partition
            await store.declare_queue(Queue("q", concurrency=slots))
        for n in range(121):
            run = NewRun(run_id=f"r{n:03}", graph_name="g", graph_ref=None, fingerprint="fp",
                         input_json="null", created_at=float(n))  # fmt: skip
            await store.submit_run(
                run, Submission(queue="q", partition="lone" if n == 120 else "busy")
            )
        started: list[str] = []
        while "r120" not in started:
            claimed = await store.claim_runs("q", "w", 30.0, limit=slots)
            if not claimed:
                break
            started.extend(claimed)
            token = (await store.get_run(claimed[0])).lease_token
            done = Harvest(state_json="{}", status=RunStatus.COMPLETED, finished_at=time.time())
            await store.commit(claimed[0], token, done)
            await store.release_lease(claimed[0], "w", token)
        return started.index("r120") if "r120" in started else -1
    finally:
        await store.close()
        _drop_schema(dsn, schema)


def run_fairness(args: argparse.Namespace) -> None:
    dsn = _ensure_database(args.dsn, args.database)
    print("partition fairness: busy runs started before a lone partition's one run (120 busy)")
    for slots in (1, 10):
        print(f"  {slots:>2} slot(s): {asyncio.run(_fairness(dsn, slots))}")


class Statements:
    """Statements this process sends to Postgres, counted at psycopg's cursors while entered.

    ``executemany`` counts one statement per parameter set (what the server
    executes; pipelined, they share round trips, not executions).
    """

    def __init__(self) -> None:
        self.count = 0
        #: Statements by the start of their text (whitespace folded).
        self.texts: collections.Counter[str] = collections.Counter()
        self._saved: list[tuple[Any, str, Any]] = []

    def starting(self, prefix: str) -> int:
        """How many statements sent began with ``prefix``."""
        return sum(n for text, n in self.texts.items() if text.startswith(prefix))

    def __enter__(self) -> Statements:
        import psycopg

        counter = self

        def counted(cls: Any, name: str, many: bool) -> None:
            original = getattr(cls, name)

            async def wrapper(cursor: Any, query: Any, params: Any = None, **kw: Any) -> Any:
                n = 1
                if many:
                    params = list(params or ())
                    n = len(params)
                counter.count += n
                counter.texts[" ".join(str(query).split())[:80]] += n
                return await original(cursor, query, params, **kw)

            self._saved.append((cls, name, original))
            setattr(cls, name, wrapper)

        counted(psycopg.AsyncCursor, "execute", False)
        counted(psycopg.AsyncCursor, "executemany", True)
        return self

    def __exit__(self, *exc: object) -> None:
        for cls, name, original in reversed(self._saved):
            setattr(cls, name, original)
        self._saved.clear()


def _backend_ticks(dsn: str) -> dict[int, int] | None:
    """CPU clock ticks (user + system, ``/proc/PID/stat``) of each server process connected
    to the DSN's database; None when ``/proc`` does not show them (another host)."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        pids = [
            int(r[0])
            for r in conn.execute(
                "SELECT pid FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            ).fetchall()
        ]
    ticks: dict[int, int] = {}
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks[pid] = int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    return ticks or None


def _server_seconds(before: dict[int, int] | None, after: dict[int, int] | None) -> float | None:
    """Server CPU seconds between two readings (a backend new since ``before`` counts whole)."""
    if before is None or after is None:
        return None
    ticks = sum(t - before.get(pid, 0) for pid, t in after.items())
    return ticks / os.sysconf("SC_CLK_TCK")


def _bench_store(kind: str, dsn: str | None, workdir: Path, name: str, **options: Any) -> Any:
    """A fresh store for one measurement: a schema of its own, or a SQLite file of its own."""
    from tailrace.stores import PostgresStore, SQLiteStore

    if kind == "sqlite":
        return SQLiteStore(workdir / f"{name}.db")
    assert dsn is not None, "Postgres needs --dsn or TAILRACE_TEST_POSTGRES_DSN"
    return PostgresStore(dsn, schema=f"{name}_{uuid.uuid4().hex[:8]}", **options)


async def _dispose(store: Any, dsn: str | None) -> None:
    await store.close()
    schema = getattr(store, "schema", None)
    if dsn is not None and schema is not None:
        _drop_schema(dsn, schema)


CLAIMS_DB = "tailrace_claims_bench"


@dataclass
class ClaimCell:
    """One measurement of ``claims``: a queue holding ``backlog`` queued runs throughout."""

    claims_per_s: float
    p50_ms: float
    p99_ms: float
    load: float  # the 1-minute load average as the claims began
    rows_per_claim: float | None = None  # Postgres: tup_returned + tup_fetched per cycle
    commits_per_claim: float | None = None  # Postgres: xact_commit per cycle
    server_ms_per_claim: float | None = None  # Postgres: CPU of its backends per cycle


def _queued(n: int, partitions: int, tag: str = "r") -> tuple[Any, Any]:
    from tailrace.stores import NewRun, Submission

    run = NewRun(run_id=f"{tag}{n:07}", graph_name="g", graph_ref=None, fingerprint="fp",
                 input_json="null", created_at=float(n))  # fmt: skip
    return run, Submission(queue="q", partition=f"p{n % partitions:03}" if partitions else None)


async def _fill(
    kind: str, dsn: str | None, workdir: Path, backlog: int, partitions: int, name: str = "fill"
) -> Any:
    """A store ``name`` whose queue ``q`` holds ``backlog`` queued runs (``partitions`` keys,
    or none)."""
    store = _bench_store(kind, dsn, workdir, name, max_size=8)
    await store.open()
    batch = 500
    for start in range(0, backlog, batch):
        runs = [_queued(n, partitions) for n in range(start, min(start + batch, backlog))]
        if hasattr(store, "submit_runs"):
            await store.submit_runs(runs)
        else:  # an older tailrace, measured against: one submit at a time, 8 at once
            for at in range(0, len(runs), 8):
                await asyncio.gather(*(store.submit_run(*r) for r in runs[at : at + 8]))
    return store


async def _claim_cycles(
    kind: str,
    dsn: str | None,
    workdir: Path,
    backlog: int,
    partitions: int,
    claimers: int,
    cycles: int,
    seconds: float,
) -> ClaimCell:
    """``claimers`` concurrent claimers, each in turn claiming one run, finishing it and
    submitting one more (so the backlog stays at ``backlog``), ``cycles`` times in all
    (or for ``seconds``, whichever ends first)."""
    import tailrace.stores as stores

    name = f"claims{backlog}p{partitions}_{uuid.uuid4().hex[:6]}"  # a fresh file each time
    store = await _fill(kind, dsn, workdir, backlog, partitions, name)
    schema = getattr(store, "schema", None)
    pg = kind == "postgres"
    try:
        if pg:  # a closed backend publishes its counters at once: the fill is out of the reading
            await store.close()
            store = stores.PostgresStore(dsn, schema=schema, max_size=claimers + 1)
            await store.open()
        c0, r0 = await asyncio.to_thread(_counters, dsn) if pg else (0, 0)
        latencies: list[float] = []
        left = itertools.count()
        fresh = itertools.count(backlog)
        done = stores.Harvest
        status = stores.RunStatus.COMPLETED

        stop = time.monotonic() + seconds

        async def claimer(k: int) -> None:
            while next(left) < cycles and time.monotonic() < stop:
                t = time.perf_counter()
                got = await store.claim_runs("q", f"w{k}", 30.0, limit=1)
                latencies.append(time.perf_counter() - t)
                for run_id in got:
                    token = (await store.get_run(run_id)).lease_token
                    await store.commit(run_id, token, done(state_json="{}", status=status))
                    await store.submit_run(*_queued(next(fresh), partitions, "s"))

        load = os.getloadavg()[0]
        ticks0 = await asyncio.to_thread(_backend_ticks, dsn) if pg else None
        t0 = time.monotonic()
        await asyncio.gather(*(claimer(k) for k in range(claimers)))
        elapsed = time.monotonic() - t0
        ticks1 = await asyncio.to_thread(_backend_ticks, dsn) if pg else None
        cell = ClaimCell(
            claims_per_s=len(latencies) / elapsed,
            p50_ms=1000 * percentile(latencies, 0.5),
            p99_ms=1000 * percentile(latencies, 0.99),
            load=load,
        )
        if pg:
            await store.close()
            c1, r1 = await asyncio.to_thread(_counters, dsn)
            cell.commits_per_claim = (c1 - c0) / len(latencies)
            cell.rows_per_claim = (r1 - r0) / len(latencies)
            server = _server_seconds(ticks0, ticks1)
            cell.server_ms_per_claim = None if server is None else 1000 * server / len(latencies)
        return cell
    finally:
        await _dispose(store, dsn)
        await asyncio.to_thread(_remove_files, workdir, name)


def _remove_files(workdir: Path, name: str) -> None:
    """Remove store ``name``'s SQLite file and its WAL, if any."""
    for path in workdir.glob(f"{name}.db*"):
        path.unlink()


def _median_cell(cells: list[ClaimCell]) -> ClaimCell:
    """Each field's median over repeated measurements of one cell."""

    def median(values: list[float | None]) -> float | None:
        known = sorted(v for v in values if v is not None)
        return known[len(known) // 2] if known else None

    fields = {
        f.name: median([getattr(c, f.name) for c in cells]) for f in dataclasses.fields(ClaimCell)
    }
    return ClaimCell(**fields)  # type: ignore[arg-type]


def run_claims(args: argparse.Namespace) -> None:
    kinds = stores_of(args)
    dsn = _ensure_database(args.dsn, CLAIMS_DB) if "postgres" in kinds else None
    backlogs = [int(x) for x in args.backlogs.split(",")]
    partitions = [int(x) for x in args.partitions.split(",")]
    print(f"claims of one queue by {args.claimers} claimers ({args.claim_cycles} claims a cell "
          f"or {args.claim_seconds:.0f} s, "
          "one run each; each claimed run then ends and one more is submitted, so the "
          f"backlog holds), the median of {args.claim_reps} measurements, the backlogs "
          "taken in turn, forwards then backwards; load: the 1-minute load average as a "
          "cell began:")  # fmt: skip
    print(f"{'store':>9} {'backlog':>8} {'partitions':>11} {'claims/s':>9} {'p50 ms':>7} "
          f"{'p99 ms':>7} {'rows/claim':>11} {'commits/claim':>14} {'server ms':>10} "
          f"{'load':>5}")  # fmt: skip
    cells: dict[tuple[str, int, int], ClaimCell] = {}
    with tempfile.TemporaryDirectory(prefix="tailrace-claims-") as tmp:
        for kind in kinds:
            for parts in partitions:
                seen: dict[int, list[ClaimCell]] = {b: [] for b in backlogs}
                for rep in range(args.claim_reps):
                    for backlog in backlogs if rep % 2 == 0 else backlogs[::-1]:
                        seen[backlog].append(
                            asyncio.run(_claim_cycles(kind, dsn, Path(tmp), backlog, parts,
                                                      args.claimers, args.claim_cycles,
                                                      args.claim_seconds))
                        )  # fmt: skip
                for backlog in backlogs:
                    c = cells[kind, parts, backlog] = _median_cell(seen[backlog])
                    rows = "-" if c.rows_per_claim is None else f"{c.rows_per_claim:.0f}"
                    commits = "-" if c.commits_per_claim is None else f"{c.commits_per_claim:.2f}"
                    cpu = "-" if c.server_ms_per_claim is None else f"{c.server_ms_per_claim:.2f}"
                    print(f"{kind:>9} {backlog:>8} {parts:>11} {c.claims_per_s:>9.0f} "
                          f"{c.p50_ms:>7.1f} {c.p99_ms:>7.1f} {rows:>11} {commits:>14} "
                          f"{cpu:>10} {c.load:>5.1f}",
                          flush=True)  # fmt: skip
    print(
        f"ratios, {max(backlogs)} queued against {min(backlogs)} "
        "(targets: claims/s >= 0.8, p99 <= 2):"
    )
    for kind in kinds:
        for parts in partitions:
            low, high = cells[kind, parts, min(backlogs)], cells[kind, parts, max(backlogs)]
            print(f"{kind:>9} {parts:>3} partitions: claims/s x{high.claims_per_s / low.claims_per_s:.2f}"
                  f", p99 x{high.p99_ms / low.p99_ms:.2f}")  # fmt: skip


@dataclass
class PerRun:
    """What one run of a 5-node chain costs, submit to completion (per run, averaged)."""

    runs_per_s: float
    process_cpu_ms: float  # this process: submitter, worker, engine (and SQLite itself)
    commits: float | None = None  # Postgres: xact_commit of the database
    rows_read: float | None = None  # Postgres: tup_returned + tup_fetched
    statements: float | None = None  # Postgres: statements this process sent
    server_cpu_ms: float | None = None  # Postgres: CPU of the backends serving the database


async def _per_run(kind: str, dsn: str | None, workdir: Path, runs: int) -> PerRun:
    """The cost of a run of a 5-node chain, submit to completion, on 1 worker (x8)."""
    import tailrace as tr
    from tailrace.workers import Worker

    graph = tr.Graph("five")
    for name in ("a", "b", "c", "d", "e"):

        async def step(x: int) -> int:
            return x + 1

        graph.add_node(name, step)
    graph.chain("a", "b", "c", "d", "e")
    store = _bench_store(kind, dsn, workdir, "run5")
    await store.open()
    engine = tr.Engine(store=store)
    stop = asyncio.Event()
    worker = Worker(store, queues=["q"], graphs=[graph], concurrency=8)
    task = asyncio.create_task(worker.run(stop))
    pg = kind == "postgres"
    try:
        # The worker's start-up (declarations, registration) is published before the
        # first reading; its idle heartbeats in the windows cost a commit per 6 s.
        await asyncio.sleep(STATS_LAG if pg else 1.0)
        c0, r0 = await asyncio.to_thread(_counters, dsn) if pg else (0, 0)
        ticks0 = await asyncio.to_thread(_backend_ticks, dsn) if pg else None
        cpu0, t0 = time.process_time(), time.monotonic()
        with Statements() as statements:
            ids = [await engine.submit(graph, 0, queue="q") for _ in range(runs)]
            for run_id in ids:
                await engine.wait(run_id, timeout=120)
        cpu1, t1 = time.process_time(), time.monotonic()
        out = PerRun(runs_per_s=runs / (t1 - t0), process_cpu_ms=1000 * (cpu1 - cpu0) / runs)
        if pg:
            ticks1 = await asyncio.to_thread(_backend_ticks, dsn)
            await asyncio.sleep(STATS_LAG)
            c1, r1 = await asyncio.to_thread(_counters, dsn)
            server = _server_seconds(ticks0, ticks1)
            out.commits, out.rows_read = (c1 - c0) / runs, (r1 - r0) / runs
            out.statements = statements.count / runs
            out.server_cpu_ms = None if server is None else 1000 * server / runs
        return out
    finally:
        stop.set()
        await task
        await _dispose(store, dsn)


def run_per_run(args: argparse.Namespace) -> None:
    dsn = _ensure_database(args.dsn, args.database) if "postgres" in stores_of(args) else None
    print(f"a 5-node chain, submit -> wait, {args.chain_runs} runs on 1 worker (x8), per run "
          "(waits included; server CPU: the backends serving the database, not its "
          "background processes):")  # fmt: skip

    def cell(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    print(f"{'store':>9} {'runs/s':>7} {'commits':>8} {'statements':>11} {'rows read':>10} "
          f"{'server CPU ms':>14} {'process CPU ms':>15}")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="tailrace-per-run-") as tmp:
        for kind in stores_of(args):
            r = asyncio.run(_per_run(kind, dsn, Path(tmp), args.chain_runs))
            print(f"{kind:>9} {r.runs_per_s:>7.0f} {cell(r.commits, '.1f'):>8} "
                  f"{cell(r.statements, '.1f'):>11} {cell(r.rows_read, '.0f'):>10} "
                  f"{cell(r.server_cpu_ms, '.2f'):>14} {r.process_cpu_ms:>15.2f}")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "what",
        choices=["torture", "bench", "adoption", "idle", "fairness", "claims", "per-run"],
    )
    parser.add_argument("--fleet", default="10,100", help="idle: worker processes")
    parser.add_argument("--simulate", default="1000", help="idle: workers as tasks")
    parser.add_argument("--window", type=float, default=120.0, help="idle: seconds measured")
    parser.add_argument(
        "--warmup", type=float, default=IDLE_WARMUP, help="idle: seconds before a window"
    )
    parser.add_argument(
        "--shared-server", action="store_true", help="idle: --dsn's server, not one of its own"
    )
    parser.add_argument("--database", default=IDLE_DB, help="idle: a database of its own")
    parser.add_argument("--claimers", type=int, default=4, help="claims: concurrent claimers")
    parser.add_argument("--backlogs", default="1000,10000,100000", help="claims: queued runs")
    parser.add_argument("--partitions", default="0,100", help="claims: partition keys")
    parser.add_argument("--claim-cycles", type=int, default=1000, help="claims: claims a cell")
    parser.add_argument("--claim-seconds", type=float, default=20.0, help="claims: at most")
    parser.add_argument("--claim-reps", type=int, default=3, help="claims: measurements a cell")
    parser.add_argument("--chain-runs", type=int, default=200)
    parser.add_argument("--store", default="both", choices=["sqlite", "postgres", "both"])
    parser.add_argument("--dsn", default=os.environ.get("TAILRACE_TEST_POSTGRES_DSN"))
    parser.add_argument("--seed", type=int, default=20261201)
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--kills", type=int, default=100)
    parser.add_argument("--adopt-kills", type=int, default=5, help="adoption: SIGKILLs per store")
    parser.add_argument("--workers", default="1,2,4,8")
    parser.add_argument("--runs-per-worker", type=int, default=40)
    parser.add_argument("--per-worker", type=int, default=1, help="runs one worker drives at once")
    parser.add_argument("--samples", type=int, default=60)
    parser.add_argument("--dbos", action="store_true", help="also run DBOS side by side")
    parser.add_argument("--dbos-python", default=sys.executable, help="an interpreter with dbos")
    args = parser.parse_args()
    if args.what == "torture":
        return run_torture(args)
    measures = {"idle": run_idle, "fairness": run_fairness, "claims": run_claims}
    measures["adoption"] = run_adoption
    measures["per-run"] = run_per_run
    measures.get(args.what, run_bench)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
