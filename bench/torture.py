"""Crash torture: SIGKILL durable runs at random points, resume them, check D1-D3.

Run as::

    python bench/torture.py --kills 300 [--store sqlite|postgres|both] [--seed N]

(Postgres from ``--dsn`` or ``TAILRACE_TEST_POSTGRES_DSN``; ``both`` skips it
with a note when there is none.) ``tests/torture/test_crash.py`` imports this
file by path and runs :func:`torture` with 30+ kills per store.

The graph (~30 nodes, written as a module file so ``graph_ref`` resolves in
every process): a chain with a ``None`` result, a fan-out of 8 with random
1-20 ms sleeps, a first-5 aggregate and a full join, two equal branches into an
``any_of``, a switch with a branch into another ``any_of``, a self-loop with
``max_visits=3``, a join and a tail chain. Every handler appends
``[node, visit, payload]`` to a side file (open-append-fsync-close) when it
*starts*, so the side file lists every execution, including ones killed
midway.

Each run is driven by child processes (``torture_child.py``): the first one
runs the graph with a fixed ``run_id``, later ones resume it (starting afresh
when the run was never created, and waiting out the dead process's lease,
``lease_ttl`` 0.5 s). The parent SIGKILLs the child after a seeded random
delay (most after the child says READY, some during start-up), records the
kill point (side-file length, committed result rows, first-k decisions and
running node rows, read from the database right after the kill), and starts
the next child, until one finishes. Then it checks:

- ``committed re-executions``: a node visit whose result was committed at a
  kill started again after it (D1). Must be 0.
- ``mismatches``: final results or visits differ from an uninterrupted
  in-process run; a first-k decision committed at a kill and later changed or
  ignored; a running node re-run with another payload than the stored one
  (D3); a committed result whose inputs were not committed (D2). Must be 0.
- ``re-executions (uncommitted)``: visits started again whose result was not
  committed yet. Allowed (D3: running nodes re-run).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Environment variable naming the side file the graph's handlers append to.
SIDE_ENV = "TAILRACE_TORTURE_SIDE"
LEASE_TTL = 0.5
#: Seconds before a child that neither says READY nor exits counts as hung.
CHILD_GUARD = 60.0

GRAPH_SOURCE = '''
"""The torture graph. Handlers log every start to the side file named by $@SIDE_ENV@."""

import asyncio
import json
import os
import random

import tailrace as tr

graph = tr.Graph("torture")


def _log(payload):
    path = os.environ.get("@SIDE_ENV@")
    if not path:
        return
    ctx = tr.current_node()
    line = json.dumps([ctx.node_id, ctx.visit, payload], separators=(",", ":")) + "\\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def node(name, fn, kind="task", **options):
    async def handler(payload):
        _log(payload)
        await asyncio.sleep(random.uniform(0.001, 0.020))
        return fn(payload)

    graph.add_node(name, handler, kind, **options)


FAN = 8
node("c0", lambda x: x + 1)
node("c1", lambda x: None)
node("c2", lambda x: 2 if x is None else -1)
node("c3", lambda x: x * 3)
graph.chain("c0", "c1", "c2", "c3")
for i in range(FAN):
    node(f"f{i}", lambda x, i=i: x * 10 + i)
    graph.add_edge("c3", f"f{i}")
node("pick5", lambda xs: {"n": len(xs), "picked": xs}, "aggregate", required=5)
node("all8", lambda xs: sum(xs), "aggregate")
for i in range(FAN):
    graph.add_edge(f"f{i}", "pick5")
    graph.add_edge(f"f{i}", "all8")
node("p1", lambda d: d["n"] * 2)
node("p2", lambda d: d["n"] * 2)
node("either", lambda x: x + 1, any_of=True)
graph.chain("pick5", "p1", "either")
graph.chain("pick5", "p2", "either")
node("route", lambda x: "big" if x > 5 else "small", "switch")
node("big", lambda x: f"big:{x}")
node("small", lambda x: f"small:{x}")
node("merge", lambda x: x, any_of=True)
graph.add_edge("either", "route")
graph.add_edge("route", "big", route="big")
graph.add_edge("route", "small", route="small")
graph.add_edge("big", "merge")
graph.add_edge("small", "merge")
node("g0", lambda x: x % 7)
node("spin", lambda x: x + 1, max_visits=3)
node("spin_out", lambda x: {"spun": x})
graph.chain("all8", "g0", "spin", "spin_out")
graph.add_edge("spin", "spin")
node("done", lambda xs: xs, "aggregate")
graph.add_edge("merge", "done")
graph.add_edge("spin_out", "done")
node("t0", lambda xs: len(xs))
node("t1", lambda x: x * 2)
node("t2", lambda x: None)
node("t3", lambda x: "end")
graph.chain("done", "t0", "t1", "t2", "t3")
'''.replace("@SIDE_ENV@", SIDE_ENV)

#: Nodes whose result legitimately depends on which inputs won a first-k race.
DECISION_DEPENDENT = {"pick5"}
FIRST_K = "pick5"

CHILD_SOURCE = '''
"""One incarnation of a torture run: run it, or resume it, until it completes."""

import argparse
import asyncio
import faulthandler
import signal
import sys
import time

import tailrace as tr
from tailrace._errors import LeaseHeld, NotResumable, RunExists, RunNotFound
from tailrace.graph import resolve_reference


def make_store(args):
    if args.store == "sqlite":
        from tailrace.stores import SQLiteStore

        return SQLiteStore(args.db)
    from tailrace.stores import PostgresStore

    return PostgresStore(args.dsn, schema=args.schema, max_size=4)


def say(word):
    print(word, flush=True)


def dump_tasks():
    """SIGUSR1 from the parent: print every asyncio task's stack (a hang report)."""
    for task in asyncio.all_tasks():
        print(f"--- {task!r}", file=sys.stderr)
        task.print_stack(limit=30, file=sys.stderr)
    sys.stderr.flush()


async def drive(args):
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, dump_tasks)
    ref = f"{args.graph}:graph"
    graph = resolve_reference(ref, allow_files=True)  # the file we were told to run
    async with make_store(args) as store:
        engine = tr.Engine(store=store, lease_ttl=args.ttl)
        while True:
            try:
                record = await store.get_run(args.run_id)
            except RunNotFound:
                say("READY run")
                try:
                    await engine.run(graph, args.input, run_id=args.run_id, graph_ref=ref)
                except RunExists:
                    continue
                say("DONE")
                return
            if record.status != "running":
                say(f"FINISHED {record.status}")
                return
            say("READY resume")
            try:
                # The killed process's lease is taken over at once: its owner is provably
                # gone (same host, process gone). A stored file reference is never executed,
                # so the graph is passed.
                await engine.resume(args.run_id, graph)
            except (LeaseHeld, NotResumable):
                await asyncio.sleep(0.01)
                continue
            say("DONE")
            return


def main():
    faulthandler.register(signal.SIGUSR2, all_threads=True)  # thread stacks, on request
    parser = argparse.ArgumentParser()
    for name in ("--graph", "--store", "--db", "--dsn", "--schema", "--run-id"):
        parser.add_argument(name)
    parser.add_argument("--input", type=int, default=1)
    parser.add_argument("--ttl", type=float, default=0.5)
    asyncio.run(drive(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
'''


# --- bookkeeping ------------------------------------------------------------------------


@dataclass
class Stats:
    """Counts of one torture session on one store."""

    store: str
    kills: int = 0
    early_kills: int = 0
    mid_run_kills: int = 0
    incarnations: int = 0
    resumes: int = 0
    runs_started: int = 0
    runs_completed: int = 0
    executions: int = 0
    reexec_uncommitted: int = 0
    reexec_committed: int = 0
    mismatches: int = 0
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)

    def problem(self, text: str, *, committed: bool = False) -> None:
        if committed:
            self.reexec_committed += 1
        else:
            self.mismatches += 1
        if len(self.problems) < 50:
            self.problems.append(text)

    @property
    def ok(self) -> bool:
        return self.reexec_committed == 0 and self.mismatches == 0


@dataclass
class KillPoint:
    """What the database held right after one SIGKILL."""

    side_lines: int
    results: dict[tuple[str, int], Any]
    frozen: dict[tuple[str, int], Any]
    running: dict[tuple[str, int], Any]


class HarnessError(RuntimeError):
    """The harness itself failed (a child hung, a run never completed, ...)."""


class ChildFailed(Exception):
    """A child exited with an error of its own (not our SIGKILL): the engine failed."""


@dataclass(frozen=True)
class StoreSpec:
    """Where the children and the checker find the database."""

    kind: str
    db: Path | None = None
    dsn: str | None = None
    schema: str | None = None

    def child_args(self) -> list[str]:
        if self.kind == "sqlite":
            return ["--store", "sqlite", "--db", str(self.db)]
        return ["--store", "postgres", "--dsn", str(self.dsn), "--schema", str(self.schema)]

    def open(self) -> Any:
        if self.kind == "sqlite":
            from tailrace.stores import SQLiteStore

            return SQLiteStore(str(self.db))
        from tailrace.stores import PostgresStore

        return PostgresStore(str(self.dsn), schema=str(self.schema), max_size=2)


# --- the harness ------------------------------------------------------------------------


class Harness:
    """Runs torture runs on one store and checks each one."""

    def __init__(
        self,
        spec: StoreSpec,
        workdir: Path,
        *,
        seed: int,
        max_kills_per_run: int = 3,
        early_kill_rate: float = 0.1,
        log: Callable[[str], None] | None = None,
    ) -> None:
        self.spec = spec
        self.workdir = workdir
        self.rng = random.Random(seed)
        self.seed = seed
        self.max_kills_per_run = max_kills_per_run
        self.early_kill_rate = early_kill_rate
        self.log = log or (lambda _: None)
        self.stats = Stats(spec.kind)
        self.graph_path = workdir / "torture_graph.py"
        self.child_path = workdir / "torture_child.py"
        self.graph_path.write_text(GRAPH_SOURCE)
        self.child_path.write_text(CHILD_SOURCE)
        self.graph: Any = None
        self.reference: tuple[dict[str, Any], dict[str, int]] | None = None
        self.total_visits = 1
        self.max_delay = 0.3
        self._runner = asyncio.Runner()
        self._store: Any = None

    # -- lifecycle -------------------------------------------------------------------

    def __enter__(self) -> Harness:
        from tailrace.graph import load_file_module

        self.graph = load_file_module(str(self.graph_path)).graph
        self.reference = self._runner.run(self._reference_run())
        self.total_visits = sum(self.reference[1].values())
        self._store = self.spec.open()
        self._runner.run(self._store.open())  # creates the schema before any child
        return self

    def __exit__(self, *exc_info: object) -> None:
        try:
            if self._store is not None:
                self._runner.run(self._store.close())
        finally:
            self._runner.close()

    async def _reference_run(self) -> tuple[dict[str, Any], dict[str, int]]:
        import tailrace as tr

        result = await tr.Engine().run(self.graph, 1)
        return dict(result.results), {n: v for n, v in result.visits.items() if v}

    def calibrate(self) -> None:
        """One uninterrupted child run: checks the set-up, sizes the kill window."""
        run_id = f"calibrate-{uuid.uuid4().hex[:8]}"
        side = self.workdir / f"{run_id}.side"
        started = time.monotonic()
        proc = self._spawn(run_id, side)
        with contextlib.closing(proc.stdout):
            ready_at = self._await_ready(proc, run_id)
            self._finish(proc, run_id)
        elapsed = time.monotonic() - (ready_at or started)
        self.max_delay = max(0.1, 1.2 * elapsed)
        self.stats.runs_started += 1
        self.stats.incarnations += 1
        self._check_run(run_id, side, [])

    # -- one run -----------------------------------------------------------------------

    def torture_run(self, index: int, kills: int) -> None:
        """Drive one run to completion, SIGKILLing its first ``kills`` incarnations."""
        run_id = f"torture-{self.seed}-{index}-{uuid.uuid4().hex[:6]}"
        side = self.workdir / f"{run_id}.side"
        points: list[KillPoint] = []
        self.stats.runs_started += 1
        attempt = 0
        try:
            while True:
                attempt += 1
                if attempt > kills + 20:
                    raise HarnessError(f"run {run_id}: no completion after {attempt} children")
                proc = self._spawn(run_id, side)
                self.stats.incarnations += 1
                with contextlib.closing(proc.stdout):
                    if len(points) >= kills:
                        self._await_ready(proc, run_id)
                        self._finish(proc, run_id)
                        break
                    point = self._kill_at_random(proc, run_id, side)
                if point is None:  # it finished before the kill landed
                    break
                points.append(point)
                self._check_closure(run_id, point.results, f"kill {len(points)}")
        except ChildFailed as exc:
            self.stats.problem(f"{run_id}: {exc}")  # then check what it did before failing
        self._check_run(run_id, side, points)

    def _spawn(self, run_id: str, side: Path) -> subprocess.Popen[bytes]:
        env = dict(os.environ)
        env[SIDE_ENV] = str(side)
        err = (self.workdir / f"{run_id}.err").open("ab")
        with err:
            return subprocess.Popen(
                [
                    sys.executable,
                    str(self.child_path),
                    "--graph",
                    str(self.graph_path),
                    "--run-id",
                    run_id,
                    "--ttl",
                    str(LEASE_TTL),
                    *self.spec.child_args(),
                ],
                stdout=subprocess.PIPE,
                stderr=err,
                env=env,
            )

    def _await_ready(self, proc: subprocess.Popen[bytes], run_id: str) -> float | None:
        """Wait for the child's READY line; None if it exited first."""
        assert proc.stdout is not None
        deadline = time.monotonic() + CHILD_GUARD
        while time.monotonic() < deadline:
            readable, _, _ = select.select([proc.stdout], [], [], 0.5)
            if not readable:
                continue
            line = proc.stdout.readline()
            if not line:
                return None
            if line.startswith(b"READY"):
                if b"resume" in line:
                    self.stats.resumes += 1
                return time.monotonic()
        raise self._hung(proc, run_id, "child neither got READY nor exited")

    def _finish(self, proc: subprocess.Popen[bytes], run_id: str) -> None:
        try:
            rc = proc.wait(timeout=CHILD_GUARD)
        except subprocess.TimeoutExpired:
            raise self._hung(proc, run_id, "child hung") from None
        if rc != 0:
            tail = self._stderr_tail(run_id).strip().splitlines()
            raise ChildFailed(f"child exited {rc}: {tail[-1] if tail else '(no stderr)'}")

    def _kill_at_random(
        self, proc: subprocess.Popen[bytes], run_id: str, side: Path
    ) -> KillPoint | None:
        early = self.rng.random() < self.early_kill_rate
        if early:
            time.sleep(self.rng.uniform(0.0, 0.2))
        else:
            # A resumed run has only its uncommitted part left to do: aim inside it.
            left = 1.0 - len(self._committed(run_id)) / self.total_visits
            delay = self.rng.uniform(0.0, self.max_delay * max(left, 0.15))
            if self._await_ready(proc, run_id) is None:
                self._finish(proc, run_id)
                return None
            time.sleep(delay)
        if proc.poll() is not None:
            self._finish(proc, run_id)
            return None
        self._kill(proc)
        self.stats.kills += 1
        self.stats.early_kills += early
        point = self._kill_point(run_id, side)
        if 0 < len(point.results) < self.total_visits:
            self.stats.mid_run_kills += 1
        return point

    def _committed(self, run_id: str) -> dict[tuple[str, int], Any]:
        return self._runner.run(self._read_db(run_id))["results"]

    def _hung(self, proc: subprocess.Popen[bytes], run_id: str, what: str) -> HarnessError:
        """Dump the child's stacks to its stderr (SIGUSR1), kill it, describe it."""
        for sig in (signal.SIGUSR1, signal.SIGUSR2):  # asyncio tasks, then threads
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, sig)
            time.sleep(0.5)
        self._kill(proc)
        db = self._runner.run(self._describe_run(run_id))
        return HarnessError(
            f"run {run_id}: {what}; workdir {self.workdir}\n{db}\n"
            f"child stderr:\n{self._stderr_tail(run_id)}"
        )

    async def _describe_run(self, run_id: str) -> str:
        from tailrace._errors import RunNotFound

        try:
            stored = await self._store.load_run(run_id)
        except RunNotFound:
            return "the run is not in the store"
        run = stored.run
        lines = [f"run status {run.status}, lease {run.lease_owner} token {run.lease_token}"]
        lines += [f"  {n.node_id}: {n.status} visits {n.visits}" for n in stored.nodes.values()]
        return "\n".join(lines)

    @staticmethod
    def _kill(proc: subprocess.Popen[bytes]) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()

    def _stderr_tail(self, run_id: str) -> str:
        path = self.workdir / f"{run_id}.err"
        return path.read_text(errors="replace")[-20000:] if path.exists() else ""

    # -- reading the database --------------------------------------------------------------

    def _kill_point(self, run_id: str, side: Path) -> KillPoint:
        return KillPoint(side_lines=len(read_side(side)), **self._runner.run(self._read_db(run_id)))

    async def _read_db(self, run_id: str) -> dict[str, dict[tuple[str, int], Any]]:
        from tailrace._errors import RunNotFound

        store = self._store
        try:
            rows = await store.results(run_id)
            frozen = await store.frozen_inputs(run_id)
            stored = await store.load_run(run_id)
        except RunNotFound:
            return {"results": {}, "frozen": {}, "running": {}}
        running = {}
        for row in stored.nodes.values():
            if row.status in ("running", "queued"):
                running[(row.node_id, row.visits)] = json.loads(row.data_json)["payload"]
        return {
            "results": {(r.node_id, r.visit): json.loads(r.value_json) for r in rows},
            "frozen": {(f.node_id, f.activation): json.loads(f.payload_json) for f in frozen},
            "running": running,
        }

    # -- checks ------------------------------------------------------------------------------

    def _check_run(self, run_id: str, side: Path, points: list[KillPoint]) -> None:
        record = self._runner.run(self._store.get_run(run_id))
        final = self._runner.run(self._read_db(run_id))
        stats = self.stats
        executions = read_side(side)
        stats.executions += len(executions)
        if record.status != "completed":
            stats.problem(f"{run_id}: ended {record.status}")
        else:
            stats.runs_completed += 1
            self._check_results(run_id, final["results"], final["frozen"])
        self._check_closure(run_id, final["results"], "end")
        refired: set[int] = set()  # side-file lines that re-ran a committed visit
        for k, point in enumerate(points, 1):
            later = executions[point.side_lines :]
            for offset, (node, visit, _payload) in enumerate(later):
                if (node, visit) in point.results and point.side_lines + offset not in refired:
                    refired.add(point.side_lines + offset)
                    stats.problem(
                        f"{run_id}: {node} visit {visit} was committed at kill {k} "
                        "and executed again after it",
                        committed=True,
                    )
            self._check_payloads(run_id, k, point, later)
        seen = Counter((node, visit) for node, visit, _ in executions)
        stats.reexec_uncommitted += sum(n - 1 for n in seen.values()) - len(refired)
        missing = set(final["results"]) - set(seen)
        for node, visit in sorted(missing):
            stats.problem(f"{run_id}: {node} visit {visit} committed but never executed")

    def _check_results(
        self,
        run_id: str,
        results: dict[tuple[str, int], Any],
        frozen: dict[tuple[str, int], Any],
    ) -> None:
        assert self.reference is not None
        want_results, want_visits = self.reference
        last: dict[str, Any] = {}
        visits: dict[str, int] = {}
        for (node, visit), value in sorted(results.items()):
            last[node] = value
            visits[node] = max(visits.get(node, 0), visit)
        got = {n: v for n, v in last.items() if n not in DECISION_DEPENDENT}
        want = {n: v for n, v in want_results.items() if n not in DECISION_DEPENDENT}
        if got != want:
            self.stats.problem(f"{run_id}: results differ from an uninterrupted run: {got}")
        if visits != want_visits:
            self.stats.problem(f"{run_id}: visits {visits} != uninterrupted {want_visits}")
        decision = frozen.get((FIRST_K, 1))
        picked = last.get(FIRST_K, {})
        fan = [want_results[f"f{i}"] for i in range(8)]
        if (
            decision is None
            or picked != {"n": 5, "picked": decision}
            or len(decision) != 5
            or decision != [v for v in fan if v in decision]
        ):
            self.stats.problem(f"{run_id}: first-k decision {decision} vs result {picked}")

    def _check_payloads(
        self, run_id: str, k: int, point: KillPoint, later: list[tuple[str, int, Any]]
    ) -> None:
        """D3: after kill k, a committed first-k decision and a running node's payload stand."""
        first: dict[tuple[str, int], Any] = {}
        for node, visit, payload in later:
            first.setdefault((node, visit), payload)
        for (node, activation), decision in point.frozen.items():
            for n, v, payload in later:
                if (n, v) == (node, activation) and payload != decision:
                    self.stats.problem(
                        f"{run_id}: {node} activation {activation} ran with {payload} after "
                        f"kill {k}, but its committed first-k decision was {decision}"
                    )
        for key, payload in point.running.items():
            if key in first and first[key] != payload:
                self.stats.problem(
                    f"{run_id}: {key} was running at kill {k} with payload {payload}, "
                    f"re-ran with {first[key]}"
                )

    def _check_closure(self, run_id: str, results: dict[tuple[str, int], Any], when: str) -> None:
        """D2: every committed completion has its inputs' completions committed."""
        done_nodes = {node for node, _ in results}
        for node, visit in results:
            spec = self.graph.nodes[node]
            sources = [e.source for e in self.graph.edges if e.target == node and e.source != node]
            if visit > 1 and any(e.source == e.target == node for e in self.graph.edges):
                ok = (node, visit - 1) in results
            elif not sources:
                ok = True
            else:
                have = sum(s in done_nodes for s in sources)
                need = (spec.required or len(sources)) if spec.kind.value == "aggregate" else 1
                ok = have >= need
            if not ok:
                self.stats.problem(
                    f"{run_id} ({when}): {node} visit {visit} committed before its inputs"
                )


def read_side(path: Path) -> list[tuple[str, int, Any]]:
    """Executions logged in a side file, in order; a torn last line is ignored."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            node, visit, payload = json.loads(line)
            out.append((node, int(visit), payload))
    return out


@contextlib.contextmanager
def postgres_schema(dsn: str) -> Iterator[str]:
    """A fresh schema name, dropped afterwards."""
    import psycopg
    from psycopg import sql

    schema = f"tailrace_torture_{uuid.uuid4().hex[:10]}"
    try:
        yield schema
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def torture(
    store: str,
    kills: int,
    *,
    workdir: Path,
    seed: int = 0,
    dsn: str | None = None,
    max_kills_per_run: int = 3,
    log: Callable[[str], None] | None = None,
) -> Stats:
    """Kill and resume runs on ``store`` ("sqlite" or "postgres") until ``kills`` kills landed.

    ``workdir`` receives the graph module, the child script, the SQLite file
    and the side files; ``seed`` fixes the kill schedule; ``dsn`` is the
    Postgres server (a fresh schema is used and dropped); each run gets 1 to
    ``max_kills_per_run`` kills; ``log`` receives progress lines.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        if store == "sqlite":
            spec = StoreSpec("sqlite", db=workdir / "torture.db")
        elif store == "postgres":
            if not dsn:
                raise ValueError("the postgres store needs a DSN")
            spec = StoreSpec("postgres", dsn=dsn, schema=stack.enter_context(postgres_schema(dsn)))
        else:
            raise ValueError(f"unknown store {store!r}")
        harness = stack.enter_context(
            Harness(spec, workdir, seed=seed, max_kills_per_run=max_kills_per_run, log=log)
        )
        harness.calibrate()
        index = 0
        while harness.stats.kills < kills:
            index += 1
            want = min(harness.rng.randint(1, max_kills_per_run), kills - harness.stats.kills)
            harness.torture_run(index, want)
            if log is not None:
                s = harness.stats
                log(f"{store}: run {index}: {s.kills}/{kills} kills, {s.mismatches} mismatches")
    stats = harness.stats
    stats.seconds = time.monotonic() - started
    return stats


# --- command line -----------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=300, help="kill points per store")
    parser.add_argument("--store", choices=["sqlite", "postgres", "both"], default="both")
    parser.add_argument("--seed", type=int, default=None, help="kill schedule seed")
    parser.add_argument("--dsn", default=os.environ.get("TAILRACE_TEST_POSTGRES_DSN"))
    parser.add_argument("--max-kills-per-run", type=int, default=3)
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    stores = ["sqlite", "postgres"] if args.store == "both" else [args.store]
    notes = [f"seed {seed}; lease_ttl {LEASE_TTL}s; python {sys.version.split()[0]}"]
    if "postgres" in stores and not args.dsn:
        if args.store == "postgres":
            parser.error("--store postgres needs --dsn or TAILRACE_TEST_POSTGRES_DSN")
        stores.remove("postgres")
        notes.append("postgres skipped: no --dsn and no TAILRACE_TEST_POSTGRES_DSN")
    results = []
    log = (lambda line: print(line, file=sys.stderr, flush=True)) if args.verbose else None
    for store in stores:
        workdir = Path(tempfile.mkdtemp(prefix=f"tailrace-torture-{store}-"))
        stats = torture(
            store,
            args.kills,
            workdir=workdir,
            seed=seed,
            dsn=args.dsn,
            max_kills_per_run=args.max_kills_per_run,
            log=log,
        )  # on an exception the workdir stays, for a post-mortem
        results.append(stats)
        if stats.ok:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            notes.append(f"{store}: files kept in {workdir}")
    print_table(results, notes)
    for stats in results:
        for problem in stats.problems:
            print(f"{stats.store}: {problem}")
    return 0 if all(s.ok for s in results) else 1


def print_table(results: list[Stats], notes: list[str]) -> None:
    rows = [
        ("kills (SIGKILL landed)", "kills"),
        ("  of them before READY", "early_kills"),
        ("  of them with some, not all, results committed", "mid_run_kills"),
        ("child processes", "incarnations"),
        ("resumes", "resumes"),
        ("runs completed", "runs_completed"),
        ("node executions", "executions"),
        ("re-executions, uncommitted (allowed)", "reexec_uncommitted"),
        ("re-executions, committed (must be 0)", "reexec_committed"),
        ("mismatches (must be 0)", "mismatches"),
    ]
    header = ["crash torture"] + [s.store for s in results]
    table = [header, ["-" * len(c) for c in header]]
    for label, name in rows:
        table.append([label] + [str(getattr(s, name)) for s in results])
    table.append(["seconds"] + [f"{s.seconds:.1f}" for s in results])
    table.append(["verdict"] + ["PASS" if s.ok else "FAIL" for s in results])
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    for row in table:
        cells = [row[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)
        ]
        print("  ".join(cells).rstrip())
    for note in notes:
        print(f"  {note}")


if __name__ == "__main__":
    sys.exit(main())
