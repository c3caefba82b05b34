"""One actor of the resume storm (``test_storm.py``): races answers and resumes on one question.

Threads of the test process call :func:`act` on their own event loop, engine
and store; as a script (``python storm_actor.py NAME sqlite PATH`` or
``... NAME postgres DSN SCHEMA``) it does the same in its own process for
every trial read from stdin (one JSON object a line, ``{"quit": true}`` to
stop), writing one JSON result a line to stdout. Keeping the processes alive
across trials keeps their start-up cost out of the trials.

Each actor plays one role per trial (by its index and the trial number):
``answer`` (``engine.answer(..., resume=True)``: first answer wins),
``resume`` (``engine.resume(run_id)``) or ``worker``
(``ResumeWorker.resume(question_id)``); then, like a serve loop, it re-drives
the question until the run completed. None of this may apply the answer twice.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import random
import sys
import time
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any

import tailrace as tr
from tailrace.gates import Outcome, ResumeWorker
from tailrace.stores import QuestionStatus, RunStore, SQLiteStore

ROLES = ("answer", "resume", "worker")
#: Threads of the test process take actor indexes 0..THREADS-1; process pN takes THREADS+N.
THREADS = 16
#: How long an actor keeps re-driving a trial before it reports it stuck.
CONVERGE_SECONDS = 30.0


def make_store(kind: str, target: str, schema: str | None = None) -> RunStore:
    """An unopened store: SQLite at path ``target`` or Postgres at DSN ``target`` in ``schema``."""
    if kind == "sqlite":
        return SQLiteStore(target)
    from tailrace.stores import PostgresStore

    return PostgresStore(target, schema=schema or "public", min_size=1, max_size=2)


async def act(
    engine: tr.Engine, worker: ResumeWorker, trial: dict[str, Any], actor: str, index: int
) -> dict[str, Any]:
    """Play this actor's role in ``trial``; return what happened (never raises)."""
    out: dict[str, Any] = {"actor": actor, "trial": trial["n"], "won": False, "notes": []}
    try:
        await _act(engine, worker, trial, actor, index, out)
    except Exception:
        out["error"] = traceback.format_exc()
    return out


async def _act(
    engine: tr.Engine,
    worker: ResumeWorker,
    trial: dict[str, Any],
    actor: str,
    index: int,
    out: dict[str, Any],
) -> None:
    store = engine.store
    assert store is not None
    rng = random.Random(f"{trial['seed']}:{actor}")
    role = ROLES[(index + trial["n"]) % len(ROLES)]
    out["role"] = role
    qid, run_id = trial["qid"], trial["run_id"]
    wait = trial["start_at"] - time.time()
    if wait > 0:
        await asyncio.sleep(wait)
    await asyncio.sleep(rng.random() * trial.get("jitter", 0.004))
    if role == "answer":
        value = {"side": trial["side"], "actor": actor}
        try:
            result = await engine.answer(qid, value, by=actor, resume=True)
            out["won"] = True
            out["first"] = "none" if result is None else result.status
        except tr.AlreadyAnswered:
            out["first"] = "already-answered"
        except tr.NotResumable:
            # Our answer won, but another engine applied it and completed the run
            # before our own resume (see test_gates' test_bug_the_winning_answer_...).
            out["won"] = True
            out["first"] = "won-not-resumable"
    elif role == "resume":
        try:
            out["first"] = (await engine.resume(run_id)).status
        except (tr.LeaseHeld, tr.NotResumable) as exc:
            out["first"] = type(exc).__name__
    else:
        out["first"] = (await worker.resume(qid)).value
    await _converge(engine, worker, store, qid, run_id, rng, out)


async def _converge(
    engine: tr.Engine,
    worker: ResumeWorker,
    store: RunStore,
    qid: str,
    run_id: str,
    rng: random.Random,
    out: dict[str, Any],
) -> None:
    """Re-drive the question like a serve sweep would, until the run completed."""
    deadline = time.monotonic() + CONVERGE_SECONDS
    redriven = 0
    while True:
        record = await store.get_run(run_id)
        if record.status.value == "completed":
            break
        if record.status.value in ("failed", "cancelled"):
            out["error"] = f"run {run_id} is {record.status.value}: {record.error}"
            return
        if time.monotonic() > deadline:
            question = await store.get_question(qid)
            out["error"] = f"run {run_id} still {record.status.value}, question {question.status}"
            return
        question = await store.get_question(qid)
        if question.status is QuestionStatus.ANSWERED and record.status.value == "suspended":
            outcome = await worker.resume(qid)
            if outcome is Outcome.APPLIED:
                redriven += 1
        await asyncio.sleep(0.002 + rng.random() * 0.004)
    out["redriven"] = redriven


async def serve_stdin(actor: str, kind: str, target: str, schema: str | None) -> None:
    """Script mode: one engine and store for the process, one trial per stdin line."""
    store = make_store(kind, target, schema)
    async with store:
        engine = _gate_graphs().engine(store)  # told the graphs: stored file refs never run
        worker = ResumeWorker(engine=engine)
        index = THREADS + int(actor.lstrip("p"))  # threads are 0..THREADS-1
        _emit({"ready": actor})
        loop = asyncio.get_running_loop()
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line:
                break
            trial = json.loads(line)
            if trial.get("quit"):
                break
            _emit(await act(engine, worker, trial, actor, index))


def _gate_graphs() -> ModuleType:
    """``gate_graphs.py``, loaded by path under the name the tests use for it."""
    name = "tailrace_tests_gate_graphs"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, Path(__file__).with_name("gate_graphs.py")
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _emit(data: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(data) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    name, store_kind, where = sys.argv[1:4]
    asyncio.run(serve_stdin(name, store_kind, where, sys.argv[4] if len(sys.argv) > 4 else None))
