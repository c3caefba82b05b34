"""Gates through the public API: questions, first answer wins, exactly-once resume (Q1-Q6, E10).

Clauses (DESIGN.md): Q1 a gate waits while other branches run; Q2 first answer
wins; Q3 single-flight, turn-guarded resume that never double-applies; Q4 the
restart sweep; Q5 machine gates (pollers, deadlines, ``GateTimeout``); Q6 a
handler failure during a resume fails that run, never the daemon; E10 an open
gate is a suspension, never a stall. Each test runs against memory, SQLite and
Postgres where the store matters (Postgres whenever
``TAILRACE_TEST_POSTGRES_DSN`` is set; each test gets a schema of its own).

Graphs other engines must import live in ``gate_graphs.py`` (referenced by
file path); nodes that must run once count their executions in a side file.

Tests named ``test_bug_...`` pin defects found while writing this suite; they
fail until the engine is fixed (see their docstrings for the repro and patch).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner, Result

import tailrace as tr
from tailrace.cli._app import app
from tailrace.gates import (
    EngineTarget,
    Outcome,
    Resumable,
    ResumeWorker,
    Server,
    ServeStats,
    WaitState,
    serve,
)
from tailrace.stores import MemoryStore, QuestionRow, QuestionStatus, RunStore, SQLiteStore
from tests.gates import backends

HERE = Path(__file__).resolve().parent


graphs = backends.graphs
Backend = backends.Backend
backend = backends.backend  # the fixture: each store in turn
side = backends.side
eventually = backends.eventually
run_status = backends.run_status
_is = backends.is_status
GRAPH_FILE = backends.GRAPH_FILE
TIMEOUT = backends.TIMEOUT
APPROVAL_REF = f"{GRAPH_FILE}:approval"
FRAGILE_REF = f"{GRAPH_FILE}:fragile"


# -- helpers ----------------------------------------------------------------------------


async def event_types(store: RunStore, run_id: str) -> list[str]:
    return [e.type for e in await store.events(run_id)]


async def suspended_approval(
    engine: tr.Engine, run_id: str | None = None
) -> tuple[str, QuestionRow]:
    """Run ``approval`` to its gate; return the run id and its one open question."""
    result = await engine.run(graphs.approval, "v1", run_id=run_id, graph_ref=APPROVAL_REF)
    assert result.status == "suspended"
    [question] = result.questions
    return result.run_id, question


def side_value(side: Path, **extra: Any) -> dict[str, Any]:
    """An answer that tells ``ship`` where to count its executions."""
    return {"side": str(side), **extra}


# -- Q1: a gate waits, other branches keep running --------------------------------------


def _branching_graph(hold: asyncio.Event | None = None) -> tr.Graph:
    """start -> review (gate) -> after; start -> a -> b (b optionally held by ``hold``)."""
    g = tr.Graph("branching")

    @g.task()
    async def start(x: Any) -> Any:
        return x

    @g.gate()
    async def review(x: Any) -> Any:
        return {"ask": "go?", "x": x}

    @g.task()
    async def after(answer: Any) -> Any:
        return ["after", answer]

    @g.task()
    async def a(x: Any) -> Any:
        await asyncio.sleep(0.05)
        return "a"

    @g.task()
    async def b(x: Any) -> Any:
        if hold is not None:
            await hold.wait()
        await asyncio.sleep(0.05)
        return "b"

    g.add_edge("start", "review")
    g.add_edge("start", "a")
    g.chain("review", "after")
    g.chain("a", "b")
    return g


async def test_q1_other_branches_keep_running_while_a_gate_waits_then_suspend(
    backend: Backend,
) -> None:
    engine = await backend.engine()
    store = engine.store
    assert store is not None
    result = await engine.run(_branching_graph(), 7)

    assert result.status == "suspended"
    assert result.results == {"start": 7, "a": "a", "b": "b"}  # the branch ran to its end
    [question] = result.questions
    assert question.status is QuestionStatus.OPEN
    assert (question.node_id, question.turn, question.run_id) == ("review", 0, result.run_id)
    assert json.loads(question.prompt_json) == {"ask": "go?", "x": 7}
    assert result.nodes["review"].status == "waiting"
    assert "after" not in result.results

    events = await store.events(result.run_id)
    seq = {(e.type, e.node_id): e.seq for e in events}
    # The question opened before the other branch finished: it did not block it.
    assert seq[("question_opened", "review")] < seq[("node_completed", "b")]
    assert events[-1].type == "run_suspended"
    assert (await store.load_run(result.run_id)).nodes["review"].status == "waiting"
    assert await run_status(store, result.run_id) == "suspended"


async def test_q1_an_engine_without_a_store_keeps_a_ledger_in_memory() -> None:
    engine = tr.Engine()
    result = await engine.run(_branching_graph(), 1)
    assert result.status == "suspended"
    assert isinstance(engine.store, MemoryStore)
    done = await engine.answer(result.questions[0].question_id, "yes", by="alice")
    assert done is not None and done.status == "completed"
    assert done.results["after"] == ["after", "yes"]


async def test_q1_an_answer_while_other_branches_run_is_absorbed_without_suspending(
    backend: Backend,
) -> None:
    hold = asyncio.Event()
    engine = await backend.engine()
    store = engine.store
    assert store is not None
    run_id = "absorb-" + uuid.uuid4().hex[:8]
    running = asyncio.create_task(engine.run(_branching_graph(hold), 1, run_id=run_id))

    async def opened() -> bool:
        return bool(await store.list_questions(run_id=run_id, status=QuestionStatus.OPEN))

    await eventually(opened, "the question to open")
    [question] = await store.list_questions(run_id=run_id)
    # The engine drives the run: the answer is recorded, the live run applies it (Q1).
    assert await engine.answer(question.question_id, "go", by="alice") is None
    hold.set()
    result = await asyncio.wait_for(running, TIMEOUT)

    assert result.status == "completed"
    assert result.results["after"] == ["after", "go"]
    types = await event_types(store, run_id)
    assert "run_suspended" not in types
    assert types.count("question_answered") == 1
    assert (await store.get_question(question.question_id)).status is QuestionStatus.APPLIED


# -- Q2: first answer wins ----------------------------------------------------------------


async def test_q2_32_concurrent_answers_one_wins_the_rest_already_answered(
    backend: Backend, side: Path
) -> None:
    owner = await backend.engine()
    run_id, question = await suspended_approval(owner)
    qid = question.question_id
    stores = [await backend.store() for _ in range(4)]
    engines = [graphs.engine(stores[i % len(stores)]) for i in range(32)]

    async def answer(i: int) -> tr.RunResult | None:
        return await engines[i].answer(qid, side_value(side, actor=i), by=f"actor-{i}", resume=True)

    outcomes = await asyncio.gather(*(answer(i) for i in range(32)), return_exceptions=True)

    winners = [i for i, o in enumerate(outcomes) if not isinstance(o, BaseException)]
    losers = [o for o in outcomes if isinstance(o, BaseException)]
    assert len(winners) == 1, outcomes
    assert all(isinstance(o, tr.AlreadyAnswered) for o in losers), losers
    assert len(losers) == 31
    [winner] = winners
    store = owner.store
    assert store is not None
    row = await store.get_question(qid)
    assert row.answered_by == f"actor-{winner}"
    assert json.loads(row.answer_json or "null") == side_value(side, actor=winner)
    assert row.status is QuestionStatus.APPLIED
    assert await run_status(store, run_id) == "completed"
    assert graphs.executions(side, run_id, "ship") == 1
    [ship] = await store.results(run_id, "ship")
    assert json.loads(ship.value_json) == {"shipped": side_value(side, actor=winner)}

    # A later answer changes nothing: not the row, not the event log.
    events_before = await store.events(run_id)
    with pytest.raises(tr.AlreadyAnswered, match="already"):
        await engines[0].answer(qid, "late", by="late", resume=True)
    assert await store.get_question(qid) == row
    assert await store.events(run_id) == events_before
    assert graphs.executions(side, run_id, "ship") == 1


async def test_q2_a_second_answer_before_the_resume_changes_nothing(backend: Backend) -> None:
    engine = await backend.engine()
    run_id, question = await suspended_approval(engine)
    await engine.answer(question.question_id, "first", by="alice", resume=False)
    store = engine.store
    assert store is not None
    row = await store.get_question(question.question_id)
    other = await backend.engine()
    with pytest.raises(tr.AlreadyAnswered):
        await other.answer(question.question_id, "second", by="bob")
    assert await store.get_question(question.question_id) == row
    assert row.status is QuestionStatus.ANSWERED and row.answered_by == "alice"
    result = await engine.resume(run_id)
    assert result.status == "completed"
    assert result.results["ship"] == {"shipped": "first"}


def _two_gates() -> tuple[tr.Graph, list[str]]:
    """first (gate) -> middle -> second (gate) -> end; returns the graph and its call log."""
    g = tr.Graph("two-gates")
    calls: list[str] = []

    @g.gate()
    async def first(x: Any) -> Any:
        return "first?"

    @g.task()
    async def middle(answer: Any) -> Any:
        calls.append("middle")
        return {"first": answer}

    @g.gate()
    async def second(x: Any) -> Any:
        return {"second?": x}

    @g.task()
    async def end(answer: Any) -> Any:
        calls.append("end")
        return {"second": answer}

    g.chain("first", "middle", "second", "end")
    return g, calls


async def test_q2_turns_advance_across_two_sequential_gates(backend: Backend) -> None:
    engine = await backend.engine()
    store = engine.store
    assert store is not None
    graph, calls = _two_gates()
    result = await engine.run(graph)
    [q1] = result.questions
    assert (q1.node_id, q1.turn) == ("first", 0)

    second = await engine.answer(q1.question_id, "yes", by="alice")
    assert second is not None and second.status == "suspended"
    [q2] = second.questions
    assert (q2.node_id, q2.turn) == ("second", 1)
    assert q2.question_id != q1.question_id
    with pytest.raises(tr.AlreadyAnswered):
        await engine.answer(q1.question_id, "again")  # the old turn's question stays closed

    done = await engine.answer(q2.question_id, "ok", by="bob")
    assert done is not None and done.status == "completed"
    assert done.results["end"] == {"second": "ok"}
    assert calls == ["middle", "end"]
    turns = [
        json.loads(e.data_json)["turn"]
        for e in await store.events(result.run_id)
        if e.type == "run_suspended"
    ]
    assert turns == [1, 2]
    for qid in (q1.question_id, q2.question_id):
        assert (await store.get_question(qid)).status is QuestionStatus.APPLIED


# -- Q3: resume applies once, turn-guarded, single flight ----------------------------


async def test_q3_resume_applies_once_and_a_second_resume_is_a_noop(
    backend: Backend, side: Path
) -> None:
    engine = await backend.engine()
    store = engine.store
    assert store is not None
    run_id, question = await suspended_approval(engine)
    await engine.answer(question.question_id, side_value(side), by="alice", resume=False)
    assert (await store.get_question(question.question_id)).status is QuestionStatus.ANSWERED

    result = await engine.resume(run_id)
    assert result.status == "completed"
    row = await store.get_question(question.question_id)
    assert row.status is QuestionStatus.APPLIED and row.applied_at is not None
    events = await store.events(run_id)

    with pytest.raises(tr.NotResumable):
        await engine.resume(run_id)
    other = await backend.engine()
    assert await ResumeWorker(engine=other).resume(question.question_id) is Outcome.NOOP
    assert await ResumeWorker(engine=other).sweep() == {}
    assert await store.events(run_id) == events
    assert await store.get_question(question.question_id) == row
    assert graphs.executions(side, run_id, "ship") == 1
    assert [e.type for e in events].count("question_answered") == 1


async def test_q3_resuming_a_suspended_run_whose_answer_was_applied_writes_nothing(
    backend: Backend,
) -> None:
    engine = await backend.engine()
    store = engine.store
    assert store is not None
    graph, calls = _two_gates()
    first = await engine.run(graph)
    [q1] = first.questions
    at_second = await engine.answer(q1.question_id, "yes")
    assert at_second is not None and at_second.status == "suspended"
    events = await store.events(first.run_id)

    again = await engine.resume(first.run_id)
    assert again.status == "suspended"
    assert [q.node_id for q in again.questions] == ["second"]
    assert await store.events(first.run_id) == events
    assert calls == ["middle"]
    assert (await store.get_question(q1.question_id)).status is QuestionStatus.APPLIED


class MovedOn:
    """A :class:`~tailrace.gates.Resumable` whose run went past the question (a newer turn)."""

    def __init__(self) -> None:
        self.invoked: list[str] = []

    async def get_state(self, key: str) -> WaitState:
        return WaitState(questions=frozenset({"a-newer-question"}), turn=2)

    async def invoke(self, key: str, question: QuestionRow, value: Any) -> bool:
        self.invoked.append(question.question_id)
        return False


async def test_q3_a_stale_answer_is_superseded_not_applied(backend: Backend) -> None:
    engine = await backend.engine()
    store = engine.store
    assert store is not None
    run_id, question = await suspended_approval(engine)
    await engine.answer(question.question_id, "late", by="alice", resume=False)
    target = MovedOn()
    worker = ResumeWorker(store=store, target=target, owner="external")

    assert isinstance(target, Resumable)
    assert await worker.resume(question.question_id) is Outcome.SUPERSEDED
    assert target.invoked == []
    row = await store.get_question(question.question_id)
    assert row.status is QuestionStatus.SUPERSEDED and row.applied_at is None
    assert await worker.resume(question.question_id) is Outcome.NOOP
    assert await worker.sweep() == {}
    with pytest.raises(tr.AlreadyAnswered):
        await engine.answer(question.question_id, "later")
    assert (await store.get_run(run_id)).lease_owner is None  # the worker let go


async def test_q3_resume_worker_is_single_flight_across_workers_and_stores(
    backend: Backend, side: Path
) -> None:
    owner = await backend.engine()
    store = owner.store
    assert store is not None
    run_id, question = await suspended_approval(owner)
    await owner.answer(question.question_id, side_value(side), by="alice", resume=False)
    stores = [await backend.store() for _ in range(4)]
    workers = [ResumeWorker(engine=graphs.engine(stores[i % 4])) for i in range(8)]
    # Each worker twice: a second call on one worker hits its in-process single flight.
    calls = [w.resume(question.question_id) for w in workers for _ in range(2)]

    outcomes = await asyncio.gather(*calls)

    assert outcomes.count(Outcome.APPLIED) == 1, outcomes
    assert set(outcomes) <= {Outcome.APPLIED, Outcome.BUSY, Outcome.NOOP}, outcomes
    await eventually(lambda: _is(store, run_id, "completed"), "the run to complete")
    assert graphs.executions(side, run_id, "ship") == 1
    assert (await event_types(store, run_id)).count("question_answered") == 1
    assert (await store.get_question(question.question_id)).status is QuestionStatus.APPLIED


async def test_q3_concurrent_engine_resumes_apply_once(backend: Backend, side: Path) -> None:
    owner = await backend.engine()
    store = owner.store
    assert store is not None
    run_id, question = await suspended_approval(owner)
    await owner.answer(question.question_id, side_value(side), resume=False)
    engines = [await backend.engine() for _ in range(6)]

    outcomes = await asyncio.gather(*(e.resume(run_id) for e in engines), return_exceptions=True)

    completed = [o for o in outcomes if isinstance(o, tr.RunResult)]
    assert all(isinstance(o, tr.RunResult | tr.LeaseHeld | tr.NotResumable) for o in outcomes)
    assert [o.status for o in completed].count("completed") >= 1
    assert await run_status(store, run_id) == "completed"
    assert graphs.executions(side, run_id, "ship") == 1
    assert (await event_types(store, run_id)).count("question_answered") == 1


# -- Q4: the restart sweep -----------------------------------------------------------


async def test_q4_sweep_redrives_answered_unapplied_and_is_idempotent(
    backend: Backend, side: Path
) -> None:
    owner = await backend.engine()
    store = owner.store
    assert store is not None
    runs = [await suspended_approval(owner) for _ in range(3)]
    answerer = await backend.engine()  # another process, say, that only records answers
    for i, (_, q) in enumerate(runs):
        assert await answerer.answer(q.question_id, side_value(side, n=i), resume=False) is None
    assert len(await store.unapplied_answers()) == 3

    restarted = ResumeWorker(engine=await backend.engine())  # a fresh process after a restart
    assert await restarted.sweep() == {Outcome.APPLIED: 3}
    assert await restarted.sweep() == {}
    assert await ResumeWorker(engine=await backend.engine()).sweep() == {}

    assert await store.unapplied_answers() == []
    for i, (run_id, q) in enumerate(runs):
        assert await run_status(store, run_id) == "completed"
        assert graphs.executions(side, run_id, "ship") == 1
        assert (await store.results(run_id, "ship"))[0].value_json == json.dumps(
            {"shipped": side_value(side, n=i)}, separators=(",", ":")
        )
        assert (await store.get_question(q.question_id)).status is QuestionStatus.APPLIED


# -- Q5: machine gates ----------------------------------------------------------------


def _ci_graph(deadline: float | None) -> tr.Graph:
    g = tr.Graph("ci")

    @g.task()
    async def build(x: Any) -> Any:
        return {"sha": x}

    async def ci(x: Any) -> Any:
        return {"sha": x["sha"]}

    g.add_node("ci", ci, kind="gate", poller="ci_status", deadline=deadline)

    @g.switch()
    def route(result: Any) -> str:
        return "timeout" if isinstance(result, tr.GateTimeout) else "ok"

    @g.task()
    async def merge(result: Any) -> Any:
        return {"merged": result}

    @g.task()
    async def escalate(result: Any) -> Any:
        assert isinstance(result, tr.GateTimeout)
        return {"escalated": result.question_id}

    g.chain("build", "ci", "route")
    g.add_edge("route", "merge", route="ok")
    g.add_edge("route", "escalate", route="timeout")
    return g


async def _serve_until(
    server: Server, check: Callable[[], Awaitable[bool]], what: str
) -> ServeStats:
    stop = asyncio.Event()
    task = asyncio.create_task(server.run(stop))
    try:
        await eventually(check, what)
        assert not task.done(), "the serve loop ended on its own"
    finally:
        stop.set()
    return await asyncio.wait_for(task, TIMEOUT)


async def test_q5_a_poller_answers_a_machine_gate(
    backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    engine = await backend.engine()
    store = engine.store
    assert store is not None
    seen: list[Any] = []

    def ci_status(prompt: Any) -> Any:
        seen.append(prompt)
        if len(seen) == 1:
            raise ConnectionError("CI API down")  # logged, survived; polled again
        return None if len(seen) < 4 else {"state": "green", "sha": prompt["sha"]}

    result = await engine.run(_ci_graph(deadline=None), "abc123")
    [question] = result.questions
    assert question.poller == "ci_status" and question.deadline is None
    server = Server(engine, pollers={"ci_status": ci_status}, interval=0.01, max_interval=0.02)
    with caplog.at_level(logging.CRITICAL, logger="tailrace.serve"):
        stats = await _serve_until(
            server, lambda: _is(store, result.run_id, "completed"), "the poller's answer"
        )

    assert seen[0] == {"sha": "abc123"}
    assert stats.polled >= 4 and stats.errors >= 1 and stats.applied == 1
    row = await store.get_question(question.question_id)
    assert row.status is QuestionStatus.APPLIED and row.answered_by == "poller:ci_status"
    [merge] = await store.results(result.run_id, "merge")
    assert json.loads(merge.value_json) == {"merged": {"state": "green", "sha": "abc123"}}
    assert await store.results(result.run_id, "escalate") == []


async def test_q5_a_passed_deadline_answers_with_gate_timeout_routed_by_a_switch(
    backend: Backend,
) -> None:
    engine = await backend.engine()
    store = engine.store
    assert store is not None
    result = await engine.run(_ci_graph(deadline=0.2), "abc123")
    [question] = result.questions
    assert question.deadline is not None and question.deadline > time.time()
    stop = asyncio.Event()
    task = asyncio.create_task(
        serve(
            engine,
            stop,
            pollers={"ci_status": lambda prompt: None},
            interval=0.02,
            max_interval=0.05,
        )
    )
    try:
        await eventually(lambda: _is(store, result.run_id, "completed"), "the deadline to pass")
    finally:
        stop.set()
    stats = await asyncio.wait_for(task, TIMEOUT)

    assert stats.expired == 1
    row = await store.get_question(question.question_id)
    assert row.status is QuestionStatus.EXPIRED
    assert row.answered_by == "deadline" and row.applied_at is not None
    assert row.answered_at is not None and row.answered_at >= question.deadline
    [escalate] = await store.results(result.run_id, "escalate")
    assert json.loads(escalate.value_json) == {"escalated": question.question_id}
    assert await store.results(result.run_id, "merge") == []
    [route] = await store.results(result.run_id, "route")
    assert json.loads(route.value_json) == "timeout"
    with pytest.raises(tr.AlreadyAnswered):
        await engine.answer(question.question_id, {"state": "green"})  # too late: expired
    assert await ResumeWorker(engine=engine).sweep() == {}


# -- Q6: a failing handler fails its run, never the daemon -------------------------------


async def test_q6_a_handler_failing_after_the_answer_fails_that_run_and_serve_goes_on(
    backend: Backend, side: Path, caplog: pytest.LogCaptureFixture
) -> None:
    owner = await backend.engine()
    store = owner.store
    assert store is not None
    bad = await owner.run(graphs.fragile, "bad", graph_ref=FRAGILE_REF)
    good = await owner.run(graphs.fragile, "good", graph_ref=FRAGILE_REF)
    later = await owner.run(graphs.fragile, "later", graph_ref=FRAGILE_REF)
    answerer = await backend.engine()
    await answerer.answer(
        bad.questions[0].question_id, side_value(side, explode=True), resume=False
    )
    await answerer.answer(good.questions[0].question_id, side_value(side), resume=False)

    server = Server(await backend.engine(), interval=0.01, max_interval=0.02)
    stop = asyncio.Event()
    with caplog.at_level(logging.CRITICAL):
        task = asyncio.create_task(server.run(stop))
        try:
            await eventually(lambda: _is(store, good.run_id, "completed"), "the good run")
            await eventually(lambda: _is(store, bad.run_id, "failed"), "the bad run to fail")
            # Still serving: an answer recorded after the failure is applied too.
            await answerer.answer(later.questions[0].question_id, side_value(side), resume=False)
            await eventually(lambda: _is(store, later.run_id, "completed"), "the later run")
            assert not task.done()
        finally:
            stop.set()
        stats = await asyncio.wait_for(task, TIMEOUT)

    assert stats.outcomes.get("failed") == 1 and stats.applied == 2
    record = await store.get_run(bad.run_id)
    assert record.error is not None and "deploy exploded" in record.error
    # The failed run consumed its answer once: it is applied, and never retried.
    assert (await store.get_question(bad.questions[0].question_id)).status is QuestionStatus.APPLIED
    assert graphs.executions(side, bad.run_id, "deploy") == 1
    assert graphs.executions(side, good.run_id, "deploy") == 1
    assert await store.unapplied_answers() == []


# -- E10: an open gate is a suspension, not a stall ------------------------------------------


async def test_e10_an_open_gate_with_a_partial_aggregate_suspends_instead_of_stalling(
    backend: Backend,
) -> None:
    g = tr.Graph("partial")

    @g.task()
    async def start(x: Any) -> Any:
        return x

    @g.task()
    async def fast(x: Any) -> Any:
        return "fast"

    @g.gate()
    async def approve(x: Any) -> Any:
        return "approve?"

    @g.aggregate(required=2)
    async def join(inputs: Any) -> Any:
        return inputs

    g.add_edge("start", "fast")
    g.add_edge("start", "approve")
    g.add_edge("fast", "join")
    g.add_edge("approve", "join")
    engine = await backend.engine()
    store = engine.store
    assert store is not None

    result = await engine.run(g, 0)  # not StallError: join waits on an open gate

    assert result.status == "suspended"
    assert "join" not in result.results
    assert result.results["fast"] == "fast"
    [question] = result.questions
    done = await engine.answer(question.question_id, "approved")
    assert done is not None and done.status == "completed"
    assert done.results["join"] == ["fast", "approved"]
    assert "run_completed" in await event_types(store, result.run_id)


# -- CLI -----------------------------------------------------------------------------------

CLI_ENV = {"COLUMNS": "250", "TAILRACE_DB": None, "TAILRACE_LEASE_TTL": None}


def cli(*args: object) -> Result:
    return CliRunner().invoke(app, [str(a) for a in args], env=CLI_ENV)


def _questions(db: Path) -> list[QuestionRow]:
    async def read() -> list[QuestionRow]:
        async with SQLiteStore(db) as store:
            return await store.list_questions()

    return asyncio.run(read())


def test_cli_run_questions_answer_resume_to_completion(tmp_path: Path) -> None:
    db = tmp_path / "cli.db"
    ran = cli("run", f"{GRAPH_FILE}:approval", "--db", db, "--input", '"v1"', "--run-id", "cli-run")
    assert ran.exit_code == 0, ran.output
    [question] = _questions(db)
    assert "open questions" in ran.output
    assert question.question_id in ran.output
    assert "tailrace answer QUESTION_ID VALUE" in ran.output
    assert "run cli-run suspended" in ran.output

    listed = cli("questions", "--open", "--db", db)
    assert listed.exit_code == 0, listed.output
    assert question.question_id in listed.output and "open" in listed.output

    answered = cli(
        "answer", question.question_id, '{"ok": true}', "--by", "alice", "--db", db,
        "--graphs", GRAPH_FILE,
    )  # fmt: skip
    assert answered.exit_code == 0, answered.output
    assert "run cli-run completed" in answered.output
    assert '"shipped"' in answered.output
    [row] = _questions(db)
    assert row.status is QuestionStatus.APPLIED and row.answered_by == "alice"
    assert json.loads(row.answer_json or "null") == {"ok": True}

    assert question.question_id not in cli("questions", "--open", "--db", db).output
    everything = cli("questions", "--db", db)
    assert question.question_id in everything.output and "applied" in everything.output

    again = cli("answer", question.question_id, '"no"', "--db", db, "--graphs", GRAPH_FILE)
    assert again.exit_code == 1
    assert "already" in again.output


def test_cli_answer_no_resume_then_resume_command(tmp_path: Path) -> None:
    db = tmp_path / "cli.db"
    assert cli("run", f"{GRAPH_FILE}:approval", "--db", db, "--run-id", "r2").exit_code == 0
    [question] = _questions(db)
    recorded = cli("answer", question.question_id, '"yes"', "--no-resume", "--db", db)
    assert recorded.exit_code == 0, recorded.output
    assert "recorded: a tailrace serve or tailrace worker" in recorded.output
    assert _questions(db)[0].status is QuestionStatus.ANSWERED
    resumed = cli("resume", "r2", "--db", db, "--graphs", GRAPH_FILE)
    assert resumed.exit_code == 0, resumed.output
    assert "run r2 completed" in resumed.output
    assert _questions(db)[0].status is QuestionStatus.APPLIED


# -- defects found by this suite (fail until fixed) -------------------------------------------


async def test_bug_a_failed_runs_open_question_is_superseded_not_left_answerable(
    backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    """Q3/Q4: when a run fails while a gate waits, its question must not stay ``open``.

    Today the waiting gate keeps status ``waiting`` and its question ``open``:
    ``answer()`` records the answer and then raises ``NotResumable``; the sweep
    returns ``noop`` for it forever and never supersedes it, and since
    ``unapplied_answers`` is oldest-first with a limit, enough such answers
    starve the sweep of real ones (shown with ``limit=1``).
    """
    g = tr.Graph("fails-while-waiting")

    @g.task()
    async def start(x: Any) -> Any:
        return x

    @g.gate()
    async def approve(x: Any) -> Any:
        return "ok?"

    @g.task()
    async def boom(x: Any) -> Any:
        await asyncio.sleep(0.05)
        raise RuntimeError("boom")

    g.add_edge("start", "approve")
    g.add_edge("start", "boom")
    engine = await backend.engine()
    store = engine.store
    assert store is not None
    with pytest.raises(RuntimeError, match="boom"):
        await engine.run(g, 1, run_id="failed-run")
    [stale] = await store.list_questions(run_id="failed-run")
    # A live run answered after the stale one: the sweep must still reach it.
    run_id, live = await suspended_approval(engine)

    with caplog.at_level(logging.CRITICAL):
        stale_outcome: Any = None
        try:
            stale_outcome = await engine.answer(stale.question_id, "yes", resume=True)
        except tr.TailraceError as exc:
            stale_outcome = exc
        await engine.answer(live.question_id, "yes", resume=False)
        swept = await ResumeWorker(engine=engine).sweep(limit=1)

    assert not isinstance(stale_outcome, tr.NotResumable), "answer() raised after recording"
    assert (await store.get_question(stale.question_id)).status is QuestionStatus.SUPERSEDED
    assert swept == {Outcome.APPLIED: 1}
    assert await run_status(store, run_id) == "completed"


class PausingStore(MemoryStore):
    """A MemoryStore that can pause once inside ``list_questions(run_id=...)`` (the resume's read)."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False
        self.reached = asyncio.Event()
        self.release = asyncio.Event()

    async def list_questions(
        self,
        *,
        status: QuestionStatus | None = None,
        run_id: str | None = None,
        limit: int | None = None,
    ) -> list[QuestionRow]:
        rows = await super().list_questions(status=status, run_id=run_id, limit=limit)
        if self.armed and status is None and run_id is not None:
            self.armed = False
            self.reached.set()
            await self.release.wait()
        return rows


async def test_bug_an_answer_recorded_while_a_resume_holds_the_lease_is_not_lost(
    side: Path,
) -> None:
    """Q3: ``answer()`` returns None when "another engine holds the run (it ... applies the answer)".

    The holder read the ledger before the answer landed, found nothing to
    apply, and returns "suspended" (with no open question) without looking
    again: the answer stays ``answered`` and the run ``suspended`` until a
    serve sweep happens to run. With no serve, nobody ever applies it.
    """
    store = PausingStore()
    async with store:
        holder, answerer = graphs.engine(store), graphs.engine(store)
        run_id, question = await suspended_approval(holder)
        store.armed = True
        resuming = asyncio.create_task(holder.resume(run_id))
        await asyncio.wait_for(store.reached.wait(), TIMEOUT)

        # Today answer() returns None at once (LeaseHeld); a fix may also wait for the lease.
        answering = asyncio.create_task(answerer.answer(question.question_id, side_value(side)))

        async def recorded() -> bool:
            row = await store.get_question(question.question_id)
            return row.status is not QuestionStatus.OPEN

        await eventually(recorded, "the answer to be recorded")
        store.release.set()
        result, _ = await asyncio.wait_for(asyncio.gather(resuming, answering), TIMEOUT)

        assert (await store.get_question(question.question_id)).status is QuestionStatus.APPLIED
        assert await run_status(store, run_id) == "completed", result
        assert graphs.executions(side, run_id, "ship") == 1


async def test_bug_serve_sharing_the_engine_does_not_break_a_run_it_drives(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Q1/Q3/D6: a Server on the engine that is driving a run must not drop that run's lease.

    The poller answers while another branch still runs. ``ResumeWorker``
    acquires the run's lease with the engine's own owner (so it gets the live
    token back), ``engine.resume`` refuses (this engine drives the run:
    ``LeaseHeld``, logged as a failed resume), and the worker's ``finally``
    then *releases the driving run's lease*. The run's next heartbeat raises
    ``LeaseLost`` and the run is abandoned in status ``running`` (or another
    process adopts it while it still runs).
    """
    g = tr.Graph("ci-with-sibling")

    @g.task()
    async def start(x: Any) -> Any:
        return x

    async def ci(x: Any) -> Any:
        return "build-1"

    g.add_node("ci", ci, kind="gate", poller="ci_status")

    @g.task()
    async def slow(x: Any) -> Any:
        await asyncio.sleep(0.6)
        return "slow"

    @g.task()
    async def after(x: Any) -> Any:
        return x

    g.add_edge("start", "ci")
    g.add_edge("start", "slow")
    g.add_edge("ci", "after")
    async with MemoryStore() as store:
        engine = tr.Engine(store=store, lease_ttl=0.3)
        server = Server(engine, pollers={"ci_status": lambda p: "green"}, interval=0.01)
        stop = asyncio.Event()
        serving = asyncio.create_task(server.run(stop))
        try:
            with caplog.at_level(logging.CRITICAL):
                result = await asyncio.wait_for(engine.run(g, 1, run_id="shared"), TIMEOUT)
        finally:
            stop.set()
            stats = await asyncio.wait_for(serving, TIMEOUT)
        assert result.status == "completed"
        assert result.results["after"] == "green"
        assert stats.outcomes.get("failed", 0) == 0, stats


async def test_bug_a_resume_worker_given_an_engine_target_can_resume() -> None:
    """Q3: ``ResumeWorker(store=..., target=EngineTarget(engine))`` never applies anything.

    Without ``engine=``, the worker leases the run as ``worker:<id>``; the
    engine then asks for the same lease as its own owner and gets
    ``LeaseHeld``, which the worker logs as a failed resume: every call
    returns ``failed`` and the run stays suspended.
    """
    async with MemoryStore() as store:
        engine = tr.Engine(store=store)
        run_id, question = await suspended_approval(engine)
        await engine.answer(question.question_id, "yes", resume=False)
        worker = ResumeWorker(store=store, target=EngineTarget(engine))
        assert await worker.resume(question.question_id) is Outcome.APPLIED
        assert await run_status(store, run_id) == "completed"


class SlowAnswerStore(MemoryStore):
    """A MemoryStore whose ``answer`` can pause after its compare-and-set succeeded."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False
        self.reached = asyncio.Event()
        self.release = asyncio.Event()

    async def answer(self, question_id: str, answer_json: str, **kw: Any) -> QuestionRow:
        row = await super().answer(question_id, answer_json, **kw)
        if self.armed:
            self.armed = False
            self.reached.set()
            await self.release.wait()
        return row


async def test_bug_the_winning_answer_does_not_raise_when_another_engine_applied_it() -> None:
    """Q2/Q3: the first answer won and was applied (by another engine's resume), yet
    ``answer()`` raises ``NotResumable`` ("run ... is completed"), so the CLI
    reports an error and exits 1 for an answer that took effect."""
    store = SlowAnswerStore()
    async with store:
        winner, other = graphs.engine(store), graphs.engine(store)
        run_id, question = await suspended_approval(winner)
        store.armed = True
        answering = asyncio.create_task(winner.answer(question.question_id, "yes", by="alice"))
        await asyncio.wait_for(store.reached.wait(), TIMEOUT)
        done = await other.resume(run_id)  # a serve, say, applied the answer first
        assert done.status == "completed"
        store.release.set()
        outcome = await asyncio.wait_for(answering, TIMEOUT)  # raises NotResumable today
        assert outcome is None or outcome.status == "completed"
