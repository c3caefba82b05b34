"""Resume storm and restart recovery: an answer is applied exactly once, whoever races (Q2-Q4, D6).

*Storm.* 16 threads of this process (each with its own event loop, engine and
store instance on one SQLite file, or one Postgres schema) and 4 processes
(``storm_actor.py``, kept alive across trials) race first answers, engine
resumes and resume-worker calls on the same question, trial after trial. The
post-gate node counts its executions in a side file (append + fsync); every
trial must end with exactly one winning answer, one execution of the post-gate
node, one ``question_answered`` event, the question ``applied`` and the run
``completed``.

*Restart recovery.* ``tailrace serve --lease-ttl 0.5`` runs in a subprocess;
an answer is recorded without resuming; serve is SIGKILLed at a seeded moment
between answer and apply (the first trial freezes serve with SIGSTOP before
the answer, so that at least one kill is certainly before the apply); a new
serve then applies the answer (after the dead owner's lease expires, adopting
the run if it was mid-flight) exactly once.

``TAILRACE_STORM_TRIALS`` (default 50), ``TAILRACE_STORM_RESTARTS`` (default 6)
and ``TAILRACE_STORM_SEED`` override the trial counts and the seed.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
import traceback
import urllib.parse
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import pytest

import tailrace as tr
from tailrace.gates import ResumeWorker
from tailrace.stores import QuestionStatus, RunStore
from tests import fixtures

pytestmark = pytest.mark.slow  # storms of threads and processes racing answers

HERE = Path(__file__).resolve().parent
GRAPH_FILE = HERE / "gate_graphs.py"
ACTOR_FILE = HERE / "storm_actor.py"
POSTGRES_DSN = fixtures.POSTGRES_DSN
TRIALS = int(os.environ.get("TAILRACE_STORM_TRIALS", "50"))
RESTARTS = int(os.environ.get("TAILRACE_STORM_RESTARTS", "6"))
SEED = int(os.environ.get("TAILRACE_STORM_SEED", "20261201"))
THREADS = 16
PROCESSES = 4
WAIT = 60.0
SCRIPT = Path(sys.executable).parent / "tailrace"


graphs = fixtures.load_module("tailrace_tests_gate_graphs", GRAPH_FILE)
actor = fixtures.load_module("tailrace_tests_storm_actor", ACTOR_FILE)
APPROVAL_REF = f"{GRAPH_FILE}:approval"
PADDED_REF = f"{GRAPH_FILE}:padded"

STORES = fixtures.SHARED_STORES


@dataclass(frozen=True)
class Database:
    """Where the racers meet: a SQLite file, or a Postgres DSN (and schema for the storm)."""

    kind: str
    target: str
    schema: str | None = None

    def store(self) -> RunStore:
        return actor.make_store(self.kind, self.target, self.schema)

    def argv(self) -> list[str]:
        return [self.kind, self.target, *([self.schema] if self.schema else [])]


@pytest.fixture(params=STORES)
def database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    if request.param == "sqlite":
        yield Database("sqlite", str(tmp_path / "storm.db"))
        return
    assert POSTGRES_DSN is not None
    schema = fixtures.new_schema("tailrace_storm")
    try:
        yield Database("postgres", POSTGRES_DSN, schema)
    finally:
        fixtures.drop_schema_sync(schema)


# -- the racers -------------------------------------------------------------------------


class ThreadActors:
    """``n`` threads, each with its own event loop, engine and store, playing trials."""

    def __init__(self, db: Database, n: int, outbox: queue.Queue[dict[str, Any]]) -> None:
        self.db = db
        self.outbox = outbox
        self.inboxes: list[queue.Queue[dict[str, Any] | None]] = [queue.Queue() for _ in range(n)]
        self.threads = [
            threading.Thread(target=self._main, args=(i,), name=f"storm-t{i}", daemon=True)
            for i in range(n)
        ]

    def __enter__(self) -> ThreadActors:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for inbox in self.inboxes:
            inbox.put(None)
        for thread in self.threads:
            thread.join(WAIT)

    def send(self, trial: dict[str, Any]) -> None:
        for inbox in self.inboxes:
            inbox.put(trial)

    def _main(self, i: int) -> None:
        try:
            asyncio.run(self._loop(i))
        except BaseException:
            self.outbox.put({"actor": f"t{i}", "fatal": traceback.format_exc()})

    async def _loop(self, i: int) -> None:
        async with self.db.store() as store:
            engine = graphs.engine(store)
            worker = ResumeWorker(engine=engine)
            self.outbox.put({"ready": f"t{i}"})
            while True:
                trial = await asyncio.to_thread(self.inboxes[i].get)
                if trial is None:
                    return
                self.outbox.put(await actor.act(engine, worker, trial, f"t{i}", i))


class ProcessActors:
    """``n`` ``storm_actor.py`` processes, fed one trial a line on stdin."""

    def __init__(
        self, db: Database, n: int, outbox: queue.Queue[dict[str, Any]], logs: Path
    ) -> None:
        self.outbox = outbox
        self.procs: list[subprocess.Popen[str]] = []
        self.readers: list[threading.Thread] = []
        self.logs = [logs / f"actor-p{i}.err" for i in range(n)]
        self._cmds = [[sys.executable, str(ACTOR_FILE), f"p{i}", *db.argv()] for i in range(n)]

    def __enter__(self) -> ProcessActors:
        for cmd, log in zip(self._cmds, self.logs, strict=True):
            with log.open("w") as err:
                proc = subprocess.Popen(
                    cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True
                )
            self.procs.append(proc)
            assert proc.stdout is not None
            reader = threading.Thread(target=self._read, args=(proc.stdout,), daemon=True)
            reader.start()
            self.readers.append(reader)
        return self

    def _read(self, stream: TextIO) -> None:
        for line in stream:
            self.outbox.put(json.loads(line))

    def send(self, trial: dict[str, Any]) -> None:
        line = json.dumps(trial) + "\n"
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.write(line)
            proc.stdin.flush()

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            try:
                assert proc.stdin is not None
                proc.stdin.write(json.dumps({"quit": True}) + "\n")
                proc.stdin.close()
            except (BrokenPipeError, OSError):
                pass
        for proc in self.procs:
            try:
                proc.wait(WAIT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for reader in self.readers:
            reader.join(WAIT)
        for proc in self.procs:
            assert proc.stdout is not None
            proc.stdout.close()

    def stderr(self) -> str:
        return "\n".join(f"--- {log.name}\n{log.read_text()[-3000:]}" for log in self.logs)


def collect(outbox: queue.Queue[dict[str, Any]], n: int, key: str) -> list[dict[str, Any]]:
    """``n`` messages carrying ``key`` (a fatal actor error fails at once)."""
    got: list[dict[str, Any]] = []
    deadline = time.monotonic() + WAIT
    while len(got) < n:
        try:
            message = outbox.get(timeout=max(deadline - time.monotonic(), 0.01))
        except queue.Empty:
            pytest.fail(f"only {len(got)} of {n} actors reported {key!r} within {WAIT}s: {got}")
        if "fatal" in message:
            pytest.fail(f"actor {message['actor']} died: {message['fatal']}")
        if key in message:
            got.append(message)
    return got


# -- the storm ----------------------------------------------------------------------------


@dataclass
class StormStats:
    trials: int = 0
    actors: int = 0
    first: collections.Counter[str] = field(default_factory=collections.Counter)
    redriven: int = 0
    seconds: float = 0.0


async def _check_trial(
    store: RunStore, side: Path, trial: dict[str, Any], results: list[dict[str, Any]]
) -> list[str]:
    """What went wrong in one trial (empty when the answer was applied exactly once)."""
    n, run_id, qid = trial["n"], trial["run_id"], trial["qid"]
    problems = [f"trial {n}: {r['actor']}: {r['error']}" for r in results if "error" in r]
    winners = [r["actor"] for r in results if r["won"]]
    if len(winners) != 1:
        problems.append(f"trial {n}: {len(winners)} winning answers: {winners}")
    question = await store.get_question(qid)
    record = await store.get_run(run_id)
    events = await store.events(run_id)
    ships = await store.results(run_id, "ship")
    ran = graphs.executions(side, run_id, "ship")
    answered = [e for e in events if e.type == "question_answered"]
    started = [e for e in events if e.type == "node_started" and e.node_id == "ship"]
    facts = {
        "ship executions (side file)": (ran, 1),
        "question status": (question.status, QuestionStatus.APPLIED),
        "run status": (record.status.value, "completed"),
        "question_answered events": (len(answered), 1),
        "ship node_started events": (len(started), 1),
        "ship result rows": (len(ships), 1),
    }
    problems += [
        f"trial {n}: {what} is {got!r}, expected {want!r}"
        for what, (got, want) in facts.items()
        if got != want
    ]
    if len(winners) == 1 and ships:
        expected = {"shipped": {"side": str(side), "actor": winners[0]}}
        if json.loads(ships[0].value_json) != expected or question.answered_by != winners[0]:
            problems.append(f"trial {n}: applied {ships[0].value_json}, winner {winners[0]}")
    return problems


async def _suspend(engine: tr.Engine, n: int) -> tuple[str, str]:
    result = await engine.run(graphs.approval, n, graph_ref=APPROVAL_REF)
    assert result.status == "suspended", result
    return result.run_id, result.questions[0].question_id


async def _warm_up(db: Database, engine: tr.Engine) -> None:
    """One answer and resume on this thread alone, by another engine told the graphs,
    so a broken set-up fails here rather than in 20 racing actors."""
    run_id, qid = await _suspend(engine, -1)
    async with db.store() as store:
        fresh = graphs.engine(store)
        await fresh.answer(qid, "warm-up", resume=False)
        assert (await fresh.resume(run_id)).status == "completed"


@pytest.mark.slow
def test_resume_storm_16_threads_4_processes_apply_exactly_once(
    database: Database, tmp_path: Path
) -> None:
    side = tmp_path / "side.log"
    rng = random.Random(SEED + (1 if database.kind == "postgres" else 0))
    stats = StormStats()
    problems: list[str] = []
    outbox: queue.Queue[dict[str, Any]] = queue.Queue()
    started = time.monotonic()
    with asyncio.Runner() as runner:
        store = database.store()
        runner.run(store.open())  # creates the schema before any racer opens it
        try:
            engine = tr.Engine(store=store)
            runner.run(_warm_up(database, engine))
            procs = ProcessActors(database, PROCESSES, outbox, tmp_path)
            with procs, ThreadActors(database, THREADS, outbox) as threads:
                collect(outbox, THREADS + PROCESSES, "ready")
                for n in range(TRIALS):
                    run_id, qid = runner.run(_suspend(engine, n))
                    trial = {
                        "n": n, "run_id": run_id, "qid": qid, "side": str(side),
                        "seed": rng.randrange(2**32), "jitter": rng.choice([0.0, 0.002, 0.01]),
                        "start_at": time.time() + 0.05,
                    }  # fmt: skip
                    procs.send(trial)
                    threads.send(trial)
                    results = collect(outbox, THREADS + PROCESSES, "trial")
                    problems += runner.run(_check_trial(store, side, trial, results))
                    stats.trials += 1
                    stats.actors += len(results)
                    stats.first.update(f"{r.get('role')}:{r.get('first')}" for r in results)
                    stats.redriven += sum(r.get("redriven", 0) for r in results)
                    if len(problems) > 20:
                        break
            errors = procs.stderr() if problems else ""
        finally:
            runner.run(store.close())
    stats.seconds = time.monotonic() - started
    print(f"\nstorm on {database.kind}: {stats}")
    assert not problems, "\n".join(problems[:20]) + "\n" + errors
    assert stats.trials == TRIALS
    assert stats.actors == TRIALS * (THREADS + PROCESSES)


# -- restart recovery -----------------------------------------------------------------------


@pytest.fixture(params=STORES)
def serve_db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    """A database ``tailrace serve --db`` can name: a SQLite file or a fresh Postgres database."""
    if request.param == "sqlite":
        yield Database("sqlite", str(tmp_path / "serve.db"))
        return
    import psycopg
    from psycopg import sql

    assert POSTGRES_DSN is not None
    name = f"tailrace_serve_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(POSTGRES_DSN, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    url = urllib.parse.urlsplit(POSTGRES_DSN)._replace(path=f"/{name}").geturl()
    try:
        yield Database("postgres", url)
    finally:
        with psycopg.connect(POSTGRES_DSN, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


class ServeProcess:
    """``tailrace serve`` in a subprocess; ``started()`` waits for its banner."""

    def __init__(self, db: Database, log: Path) -> None:
        command = (
            [str(SCRIPT)]
            if SCRIPT.exists()
            else [sys.executable, "-c", "from tailrace.cli import main; main()"]
        )
        env = {**os.environ, "COLUMNS": "300"}
        env.pop("TAILRACE_DB", None)
        env.pop("TAILRACE_LEASE_TTL", None)
        self.log = log
        with log.open("a") as err:
            self.proc = subprocess.Popen(
                [*command, "serve", "--db", db.target, "--graphs", str(GRAPH_FILE),
                 "--lease-ttl", "0.5", "--max-interval", "0.1"],
                stdout=subprocess.PIPE, stderr=err, text=True, env=env,
            )  # fmt: skip
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.proc.stdout.close()

    def started(self) -> None:
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline:
            try:
                if "serving" in self.lines.get(timeout=0.1):
                    return
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
        pytest.fail(f"serve did not start: {self.log.read_text()[-3000:]}")

    def freeze(self, db: Database) -> None:
        """SIGSTOP it at a moment it holds no write lock on a SQLite file.

        A process stopped inside a write transaction holds SQLite's write lock
        until it dies (every writer of the file then times out, as SQLite
        promises); serve writes its heartbeat often, so a stop can land there.
        """
        deadline = time.monotonic() + WAIT
        while True:
            os.kill(self.proc.pid, signal.SIGSTOP)
            while _state(self.proc.pid) != "T":  # stopped: nothing of it runs from here
                time.sleep(0.001)
            if db.kind != "sqlite" or _can_write(db.target):
                return
            os.kill(self.proc.pid, signal.SIGCONT)
            if time.monotonic() > deadline:
                pytest.fail("serve held the SQLite write lock at every stop")
            time.sleep(0.003)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(WAIT)

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(WAIT)


def _state(pid: int) -> str:
    """A process's state letter from ``/proc`` (``T`` once a SIGSTOP took hold)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2]


def _can_write(path: str) -> bool:
    """Whether a write transaction on the SQLite file can begin within 50 ms."""
    import sqlite3

    conn = sqlite3.connect(path, timeout=0.05, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("ROLLBACK")
        return True
    except sqlite3.OperationalError:
        return False
    finally:
        conn.close()


async def _wait_completed(store: RunStore, run_id: str, serve: ServeProcess) -> None:
    deadline = time.monotonic() + WAIT
    while (await store.get_run(run_id)).status.value != "completed":
        if time.monotonic() > deadline or serve.proc.poll() is not None:
            question = (await store.list_questions(run_id=run_id))[0]
            pytest.fail(
                f"run {run_id} is {(await store.get_run(run_id)).status}, question "
                f"{question.status}; serve log:\n{serve.log.read_text()[-3000:]}"
            )
        await asyncio.sleep(0.02)


@pytest.mark.slow
def test_restart_recovery_serve_killed_between_answer_and_apply(
    serve_db: Database, tmp_path: Path
) -> None:
    side = tmp_path / "side.log"
    log = tmp_path / "serve.log"
    rng = random.Random(SEED * 7 + (1 if serve_db.kind == "postgres" else 0))
    phases: collections.Counter[str] = collections.Counter()
    with asyncio.Runner() as runner:
        store = serve_db.store()
        runner.run(store.open())
        try:
            engine = tr.Engine(store=store)
            for trial in range(RESTARTS):
                result = runner.run(engine.run(graphs.padded, trial, graph_ref=PADDED_REF))
                [question] = result.questions
                answer = {"side": str(side), "pad": 0.4}
                serve = ServeProcess(serve_db, log)
                serve.started()
                if trial == 0:  # frozen first: the kill certainly comes before the apply
                    serve.freeze(serve_db)
                    moment = 0.0
                else:
                    # Half the kills early (most land before serve's pickup), half later.
                    moment = rng.uniform(0.0, 0.05) if trial % 2 else rng.uniform(0.05, 0.3)
                runner.run(engine.answer(question.question_id, answer, by="alice", resume=False))
                time.sleep(moment)  # the pad keeps `ship` out of this window
                serve.kill()

                row = runner.run(store.get_question(question.question_id))
                settled = graphs.executions(side, result.run_id, "settle")
                phase = (
                    "before apply" if row.status is QuestionStatus.ANSWERED
                    else "mid-run after apply" if settled else "applied, nothing run yet"
                )  # fmt: skip
                phases[phase] += 1
                assert graphs.executions(side, result.run_id, "ship") == 0, moment

                restarted = ServeProcess(serve_db, log)
                restarted.started()
                runner.run(_wait_completed(store, result.run_id, restarted))
                assert restarted.stop() == 0

                events = runner.run(store.events(result.run_id))
                final = runner.run(store.get_question(question.question_id))
                context = f"trial {trial}, moment {moment:.3f}s, killed {phase}"
                assert graphs.executions(side, result.run_id, "ship") == 1, context
                assert final.status is QuestionStatus.APPLIED, context
                assert final.answered_by == "alice", context
                assert [e.type for e in events].count("question_answered") == 1, context
                assert len(runner.run(store.results(result.run_id, "ship"))) == 1, context
                assert runner.run(store.unapplied_answers()) == [], context
        finally:
            runner.run(store.close())
    print(f"\nrestart recovery on {serve_db.kind}: kill phases {dict(phases)}")
    assert phases["before apply"] >= 1


# -- defects found by this suite (fail until fixed) -------------------------------------------

SLOW_IMPORT = """
import time

import tailrace as tr

time.sleep(0.2)  # a heavy module: the window in which other threads look it up

graph = tr.Graph("slow-import")


@graph.gate()
async def review(x):
    return "ok?"


@graph.task()
async def done(answer):
    return answer


graph.chain("review", "done")
"""


def test_threads_resuming_by_module_reference_all_find_the_graph(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """D6/Q3: engines in 8 threads resume runs whose stored graph is ``module:graph``
    at once, while that (slow) module is imported for the first time: each finds
    the whole graph, none a half-built module.

    Stored file references are never executed (trust model), so a daemon
    resumes by module reference (or by graphs it was told); this was first
    found with file references, whose loader published the module before
    running it.
    """
    name = f"tailrace_tests_slow_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(SLOW_IMPORT)
    monkeypatch.syspath_prepend(str(tmp_path))
    slow = fixtures.load_module(
        f"{name}_owner", tmp_path / f"{name}.py"
    )  # the owner's copy, not the module
    db = tmp_path / "import.db"
    n = 8

    async def suspend_and_answer() -> list[str]:
        async with actor.make_store("sqlite", str(db)) as store:
            engine = tr.Engine(store=store)
            run_ids = []
            for i in range(n):
                result = await engine.run(slow.graph, i, graph_ref=f"{name}:graph")
                await engine.answer(result.questions[0].question_id, i, resume=False)
                run_ids.append(result.run_id)
            return run_ids

    run_ids = asyncio.run(suspend_and_answer())
    assert name not in sys.modules
    barrier = threading.Barrier(n)
    errors: list[str] = []
    statuses: list[str] = []

    def resume(run_id: str) -> None:
        async def go() -> None:
            async with actor.make_store("sqlite", str(db)) as store:
                await asyncio.to_thread(barrier.wait)
                statuses.append((await tr.Engine(store=store).resume(run_id)).status)

        try:
            asyncio.run(go())
        except Exception as exc:
            errors.append(repr(exc))

    threads = [threading.Thread(target=resume, args=(r,)) for r in run_ids]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT)
    assert errors == []
    assert statuses == ["completed"] * n
