"""LangGraphDriver against real LangGraph and its SQLite checkpointer (Q2-Q4 for external graphs).

Every graph logs the code that runs *after* an ``interrupt(...)`` returned to
a file, so "applied exactly once" is checked on what LangGraph really ran,
not on tailrace's bookkeeping.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, TypedDict

import pytest

from tests import fixtures

pytest.importorskip("langgraph")
pytest.importorskip("langgraph.checkpoint.sqlite")

from langgraph.graph import END, START, StateGraph
from langgraph.types import interrupt

from tailrace import AlreadyAnswered, LeaseHeld, NotResumable
from tailrace._codec import DEFAULT_CODEC
from tailrace.gates import Outcome, ResumeWorker, WaitState
from tailrace.integrations.langgraph import LangGraphDriver
from tailrace.stores import (
    Harvest,
    NewRun,
    QuestionRow,
    QuestionStatus,
    RunStatus,
    RunStore,
    SQLiteStore,
)

lg = fixtures.load_module(
    "tailrace_tests_integrations_lg_graphs", Path(__file__).with_name("lg_graphs.py")
)


class State(TypedDict, total=False):
    a1: Any
    a2: Any
    done: bool


def two_questions_graph(checkpointer: Any, log: Path) -> Any:
    """ask1 -> interrupt("q1"); ask2 -> interrupt("q2"); done."""

    def ask1(state: State) -> State:
        answer = interrupt("q1")
        lg.log(log, "ask1-after")
        return {"a1": answer}

    def ask2(state: State) -> State:
        answer = interrupt("q2")
        lg.log(log, "ask2-after")
        return {"a2": answer}

    def done(state: State) -> State:
        lg.log(log, "done")
        return {"done": True}

    builder = StateGraph(State)
    builder.add_node("ask1", ask1)
    builder.add_node("ask2", ask2)
    builder.add_node("done", done)
    builder.add_edge(START, "ask1")
    builder.add_edge("ask1", "ask2")
    builder.add_edge("ask2", "done")
    builder.add_edge("done", END)
    return builder.compile(checkpointer=checkpointer)


def one_question_graph(checkpointer: Any, log: Path) -> Any:
    """ask -> interrupt("go?"); after."""

    def ask(state: State) -> State:
        answer = interrupt({"question": "go?"})
        lg.log(log, "ask-after")
        return {"a1": answer}

    def after(state: State) -> State:
        lg.log(log, "after")
        return {"done": True}

    builder = StateGraph(State)
    builder.add_node("ask", ask)
    builder.add_node("after", after)
    builder.add_edge(START, "ask")
    builder.add_edge("ask", "after")
    builder.add_edge("after", END)
    return builder.compile(checkpointer=checkpointer)


def parallel_questions_graph(checkpointer: Any, log: Path) -> Any:
    """left and right interrupt in the same superstep; join runs once both are answered."""

    def left(state: State) -> State:
        answer = interrupt("left?")
        lg.log(log, "left-after")
        return {"a1": answer}

    def right(state: State) -> State:
        answer = interrupt("right?")
        lg.log(log, "right-after")
        return {"a2": answer}

    def join(state: State) -> State:
        lg.log(log, "join")
        return {"done": True}

    builder = StateGraph(State)
    builder.add_node("left", left)
    builder.add_node("right", right)
    builder.add_node("join", join)
    builder.add_edge(START, "left")
    builder.add_edge(START, "right")
    builder.add_edge(["left", "right"], "join")
    builder.add_edge("join", END)
    return builder.compile(checkpointer=checkpointer)


async def final_values(driver: LangGraphDriver, thread_id: str) -> dict[str, Any]:
    config = {"configurable": {"thread_id": thread_id}}
    if driver.use_async:
        snapshot = await driver.graph.aget_state(config)
    else:
        snapshot = await asyncio.to_thread(driver.graph.get_state, config)
    assert not snapshot.next, "the graph has not finished"
    return dict(snapshot.values)


each_store = fixtures.each_store


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SQLiteStore]:
    async with SQLiteStore(tmp_path / "tailrace.db") as s:
        yield s


# --- (1) two interrupts in sequence ---------------------------------------------


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_two_interrupts_in_sequence(tmp_path: Path, store: SQLiteStore, kind: str) -> None:
    log = tmp_path / "log.txt"
    async with lg.saver(kind, tmp_path / "langgraph.db") as cp:
        driver = LangGraphDriver(two_questions_graph(cp, log), store, name="seq")
        assert driver.use_async is (kind == "async")

        [q1] = await driver.start("t1", {})
        assert (q1.status, q1.node_id, q1.turn) == (QuestionStatus.OPEN, "ask1", 1)
        assert DEFAULT_CODEC.decode(q1.prompt_json) == "q1"
        assert await driver.get_state("t1") == WaitState(
            questions=frozenset({q1.question_id}), turn=1
        )
        run = await store.get_run("t1")
        assert (run.status, run.graph_name, run.graph_ref) == (
            RunStatus.SUSPENDED,
            "langgraph:seq",
            None,
        )
        assert lg.lines(log) == []

        assert await driver.answer(q1.question_id, "yes", by="alice") is Outcome.APPLIED
        applied = await store.get_question(q1.question_id)
        assert (applied.status, applied.answered_by) == (QuestionStatus.APPLIED, "alice")
        [q2] = await store.list_questions(run_id="t1", status=QuestionStatus.OPEN)
        assert (q2.node_id, q2.turn, DEFAULT_CODEC.decode(q2.prompt_json)) == ("ask2", 2, "q2")
        assert await driver.get_state("t1") == WaitState(
            questions=frozenset({q2.question_id}), turn=2
        )
        assert (await store.get_run("t1")).status is RunStatus.SUSPENDED
        assert lg.lines(log) == ["ask1-after"]

        assert await driver.answer(q2.question_id, {"k": 2}) is Outcome.APPLIED
        assert await final_values(driver, "t1") == {"a1": "yes", "a2": {"k": 2}, "done": True}
        assert lg.lines(log) == ["ask1-after", "ask2-after", "done"]
        run = await store.get_run("t1")
        assert run.status is RunStatus.COMPLETED and run.finished_at is not None
        assert await driver.get_state("t1") == WaitState(questions=frozenset(), turn=2)
        statuses = [q.status for q in await store.list_questions(run_id="t1")]
        assert statuses == [QuestionStatus.APPLIED, QuestionStatus.APPLIED]

        # start and sync are idempotent: nothing runs again, no duplicate questions
        assert await driver.start("t1", {}) == []
        assert await driver.sync("t1") == []
        assert len(await store.list_questions(run_id="t1")) == 2
        assert lg.lines(log) == ["ask1-after", "ask2-after", "done"]


async def test_start_twice_while_suspended_opens_no_duplicate(
    tmp_path: Path, store: SQLiteStore
) -> None:
    log = tmp_path / "log.txt"
    with lg.sync_saver(tmp_path / "langgraph.db") as cp:
        driver = LangGraphDriver(one_question_graph(cp, log), store)
        [q] = await driver.start("t", {})
        assert DEFAULT_CODEC.decode(q.prompt_json) == {"question": "go?"}
        again = await LangGraphDriver(one_question_graph(cp, log), store).start("t", {})
        assert [r.question_id for r in again] == [q.question_id]
        assert len(await store.list_questions(run_id="t")) == 1
        assert (await store.get_run("t")).status is RunStatus.SUSPENDED


async def test_parallel_interrupts_are_answered_independently(
    tmp_path: Path, store: SQLiteStore
) -> None:
    log = tmp_path / "log.txt"
    with lg.sync_saver(tmp_path / "langgraph.db") as cp:
        driver = LangGraphDriver(parallel_questions_graph(cp, log), store)
        questions = await driver.start("p", {})
        by_node = {q.node_id: q for q in questions}
        assert sorted(by_node) == ["left", "right"]
        assert {q.turn for q in questions} == {1}

        assert await driver.answer(by_node["right"].question_id, "R") is Outcome.APPLIED
        still = await store.list_questions(run_id="p", status=QuestionStatus.OPEN)
        assert [q.question_id for q in still] == [by_node["left"].question_id]
        assert (await driver.get_state("p")).questions == {by_node["left"].question_id}

        assert await driver.answer(by_node["left"].question_id, "L") is Outcome.APPLIED
        assert await final_values(driver, "p") == {"a1": "L", "a2": "R", "done": True}
        assert sorted(lg.lines(log)) == ["join", "left-after", "right-after"]


# --- (2) races: exactly one answer applies, once --------------------------------


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_concurrent_answers_and_resumes_apply_once(
    tmp_path: Path, store: SQLiteStore, kind: str
) -> None:
    log = tmp_path / "log.txt"
    async with lg.saver(kind, tmp_path / "langgraph.db") as cp:
        driver = LangGraphDriver(one_question_graph(cp, log), store)
        [q] = await driver.start("race", {})
        workers = [ResumeWorker(store=store, target=driver) for _ in range(8)]

        async def resume_repeatedly(worker: ResumeWorker) -> list[Outcome]:
            outcomes = []
            for _ in range(4):
                outcomes.append(await worker.resume(q.question_id))
                await asyncio.sleep(0)
            return outcomes

        results = await asyncio.gather(
            *(driver.answer(q.question_id, f"v{i}", by=f"user{i}") for i in range(32)),
            *(resume_repeatedly(w) for w in workers),
            return_exceptions=True,
        )
        answers, resumes = results[:32], results[32:]
        assert all(isinstance(r, (Outcome, AlreadyAnswered)) for r in answers), answers
        assert sum(isinstance(r, AlreadyAnswered) for r in answers) == 31
        assert all(isinstance(r, list) for r in resumes), resumes
        outcomes = [r for r in answers if isinstance(r, Outcome)]
        outcomes += [o for r in resumes if isinstance(r, list) for o in r]
        swept = await driver.worker.sweep()  # whoever was busy, the answer ends applied
        outcomes += [o for o, n in swept.items() for _ in range(n)]

        assert outcomes.count(Outcome.APPLIED) == 1
        assert Outcome.SUPERSEDED not in outcomes and Outcome.FAILED not in outcomes
        question = await store.get_question(q.question_id)
        assert question.status is QuestionStatus.APPLIED
        winner = DEFAULT_CODEC.decode(question.answer_json or "null")
        assert question.answered_by == "user" + winner.removeprefix("v")
        assert await final_values(driver, "race") == {"a1": winner, "done": True}
        assert lg.lines(log) == ["ask-after", "after"]


def _thread_main(
    tmp_path: Path,
    question_id: str,
    index: int,
    barrier: threading.Barrier,
    results: list[Any],
) -> None:
    """One thread: its own event loop, store instance, LangGraph connection and driver."""

    async def main() -> list[Any]:
        async with SQLiteStore(tmp_path / "tailrace.db") as store:
            with lg.sync_saver(tmp_path / "langgraph.db") as cp:
                driver = LangGraphDriver(one_question_graph(cp, tmp_path / "log.txt"), store)
                worker = ResumeWorker(store=store, target=driver)
                await asyncio.to_thread(barrier.wait)
                return await asyncio.gather(
                    *(driver.answer(question_id, f"t{index}a{i}") for i in range(4)),
                    worker.resume(question_id),
                    driver.worker.resume(question_id),
                    return_exceptions=True,
                )

    results[index] = asyncio.run(main())


async def test_threads_with_own_loops_and_drivers_apply_once(
    tmp_path: Path, store: SQLiteStore
) -> None:
    log = tmp_path / "log.txt"
    n = 16
    with lg.sync_saver(tmp_path / "langgraph.db") as cp:
        driver = LangGraphDriver(one_question_graph(cp, log), store)
        [q] = await driver.start("threads", {})
        barrier = threading.Barrier(n)
        results: list[Any] = [None] * n
        threads = [
            threading.Thread(
                target=_thread_main, args=(tmp_path, q.question_id, i, barrier, results)
            )
            for i in range(n)
        ]

        def run_all() -> None:
            for t in threads:
                t.start()
            for t in threads:
                t.join()

        await asyncio.to_thread(run_all)
        flat = [r for per_thread in results for r in per_thread]
        answers = [r for per_thread in results for r in per_thread[:4]]
        assert len(answers) == 4 * n
        assert all(isinstance(r, (Outcome, AlreadyAnswered)) for r in flat), flat
        assert sum(isinstance(r, AlreadyAnswered) for r in answers) == 4 * n - 1
        outcomes = [r for r in flat if isinstance(r, Outcome)]
        swept = await driver.worker.sweep()
        outcomes += [o for o, n in swept.items() for _ in range(n)]
        assert outcomes.count(Outcome.APPLIED) == 1
        assert Outcome.SUPERSEDED not in outcomes and Outcome.FAILED not in outcomes

        question = await store.get_question(q.question_id)
        assert question.status is QuestionStatus.APPLIED
        winner = DEFAULT_CODEC.decode(question.answer_json or "null")
        assert await final_values(driver, "threads") == {"a1": winner, "done": True}
        assert lg.lines(log) == ["ask-after", "after"]


# --- (3) the turn guard after a crash between LangGraph's step and the ledger's commit ---


class Crash(BaseException):
    """The process dies here."""


class Store:
    """A pass-through to a real store, for the classes below to intercept one call."""

    def __init__(self, store: SQLiteStore) -> None:
        self._store = store

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


class CrashOnLedgerCommit(Store):
    """A store that dies once LangGraph committed a resumed step, before the ledger says so."""

    async def commit(self, run_id: str, token: int, harvest: Harvest) -> bool:
        if harvest.applied:
            raise Crash
        return bool(await self._store.commit(run_id, token, harvest))


async def test_a_step_whose_ledger_commit_was_lost_is_superseded_not_reapplied(
    tmp_path: Path, store: SQLiteStore
) -> None:
    log = tmp_path / "log.txt"
    with lg.sync_saver(tmp_path / "langgraph.db") as cp:
        driver = LangGraphDriver(one_question_graph(cp, log), store)
        [q] = await driver.start("crash", {})
        await store.answer(q.question_id, DEFAULT_CODEC.encode("late"))
        question = await store.get_question(q.question_id)

        dying = LangGraphDriver(one_question_graph(cp, log), CrashOnLedgerCommit(store))  # type: ignore[arg-type]
        with pytest.raises(Crash):
            await dying.invoke("crash", question, "late")
        assert lg.lines(log) == ["ask-after", "after"]
        assert (await store.get_question(q.question_id)).status is QuestionStatus.ANSWERED

        # after a restart: a new driver instance and worker re-drive the answer
        restarted = LangGraphDriver(one_question_graph(cp, log), store)
        worker = ResumeWorker(store=store, target=restarted)
        assert await worker.sweep() == {Outcome.SUPERSEDED: 1}
        assert await worker.sweep() == {}
        assert (await store.get_question(q.question_id)).status is QuestionStatus.SUPERSEDED
        assert await final_values(restarted, "crash") == {"a1": "late", "done": True}
        assert lg.lines(log) == ["ask-after", "after"]
        with pytest.raises(Exception, match="no longer waits"):
            await restarted.invoke("crash", question, "again")
        assert lg.lines(log) == ["ask-after", "after"]


def asks_twice_graph(checkpointer: Any, log: Path) -> Any:
    """One node that interrupts twice: ask -> interrupt("first?"), interrupt("second?")."""

    def ask(state: State) -> State:
        first = interrupt("first?")
        second = interrupt("second?")
        lg.log(log, "ask-after")
        return {"a1": first, "a2": second}

    builder = StateGraph(State)
    builder.add_node("ask", ask)
    builder.add_edge(START, "ask")
    builder.add_edge("ask", END)
    return builder.compile(checkpointer=checkpointer)


async def test_a_second_interrupt_whose_ledger_commit_was_lost_is_asked_after_the_sweep(
    tmp_path: Path, each_store: RunStore
) -> None:
    store = each_store
    log = tmp_path / "log.txt"
    with lg.sync_saver(tmp_path / "langgraph.db") as cp:
        driver = LangGraphDriver(asks_twice_graph(cp, log), store)
        [q1] = await driver.start("twice", {})
        await store.answer(q1.question_id, DEFAULT_CODEC.encode("one"))
        dying = LangGraphDriver(asks_twice_graph(cp, log), CrashOnLedgerCommit(store))  # type: ignore[arg-type]
        with pytest.raises(Crash):  # LangGraph holds the thread at "second?"; the ledger not
            await ResumeWorker(store=store, target=dying).resume(q1.question_id)
        assert [q.question_id for q in await store.list_questions(run_id="twice")] == [
            q1.question_id
        ]

        # after a restart, the sweep re-derives the open question from the thread's state
        restarted = LangGraphDriver(asks_twice_graph(cp, log), store)
        assert await ResumeWorker(store=store, target=restarted).sweep() == {Outcome.SUPERSEDED: 1}
        questions = await store.list_questions(run_id="twice")
        assert [q.status for q in questions] == [QuestionStatus.SUPERSEDED, QuestionStatus.OPEN]
        q2 = questions[1]
        assert DEFAULT_CODEC.decode(q2.prompt_json) == "second?" and q2.node_id == "ask"
        assert (await store.get_run("twice")).status is RunStatus.SUSPENDED
        assert await restarted.get_state("twice") == WaitState(
            questions=frozenset({q2.question_id}), turn=q2.turn
        )
        assert await restarted.answer(q2.question_id, "two") is Outcome.APPLIED
        assert await final_values(restarted, "twice") == {"a1": "one", "a2": "two"}
        assert (await store.get_run("twice")).status is RunStatus.COMPLETED
        assert lg.lines(log) == ["ask-after"]


async def test_a_worker_dying_before_the_ledger_commit_leaves_it_to_the_sweep(
    tmp_path: Path, store: SQLiteStore
) -> None:
    log = tmp_path / "log.txt"
    with lg.sync_saver(tmp_path / "langgraph.db") as cp:
        driver = LangGraphDriver(one_question_graph(cp, log), store)
        [q] = await driver.start("crash2", {})
        await store.answer(q.question_id, DEFAULT_CODEC.encode("once"))
        doomed = LangGraphDriver(one_question_graph(cp, log), CrashOnLedgerCommit(store))  # type: ignore[arg-type]
        with pytest.raises(Crash):
            await ResumeWorker(store=store, target=doomed).resume(q.question_id)
        assert lg.lines(log) == ["ask-after", "after"]

        counts = await ResumeWorker(store=store, target=driver).sweep()
        assert counts == {Outcome.SUPERSEDED: 1}
        assert (await store.get_question(q.question_id)).status is QuestionStatus.SUPERSEDED
        assert await final_values(driver, "crash2") == {"a1": "once", "done": True}
        assert lg.lines(log) == ["ask-after", "after"]


async def test_a_resume_racing_the_end_of_the_thread_finds_its_answer_applied(
    tmp_path: Path, store: SQLiteStore
) -> None:
    """The step that ends a thread lets go of its lease in its commit: the answer is marked there too.

    A rival worker takes the lease the moment that commit lands; it must find
    the answer applied (``noop``), never unapplied with its interrupt gone
    (which it would mark ``superseded``).
    """
    log = tmp_path / "log.txt"
    raced: list[Outcome] = []
    with lg.sync_saver(tmp_path / "langgraph.db") as cp:
        driver = LangGraphDriver(one_question_graph(cp, log), store)
        [q] = await driver.start("ends", {})
        rival = ResumeWorker(store=store, target=driver)

        class RivalAfterTheEnd(Store):
            async def commit(self, run_id: str, token: int, harvest: Harvest) -> bool:
                cancel = bool(await self._store.commit(run_id, token, harvest))
                if harvest.status is RunStatus.COMPLETED:
                    assert (await store.get_run(run_id)).lease_owner is None  # let go
                    raced.append(await rival.resume(q.question_id))
                return cancel

        ending = LangGraphDriver(one_question_graph(cp, log), RivalAfterTheEnd(store))  # type: ignore[arg-type]
        await store.answer(q.question_id, DEFAULT_CODEC.encode("go"))
        assert await ResumeWorker(store=store, target=ending).resume(q.question_id) is (
            Outcome.APPLIED
        )
        assert raced == [Outcome.NOOP]
        assert (await store.get_question(q.question_id)).status is QuestionStatus.APPLIED
        assert await final_values(driver, "ends") == {"a1": "go", "done": True}
        assert lg.lines(log) == ["ask-after", "after"]


async def test_a_failed_step_is_retried_by_the_sweep_with_the_first_answer(
    tmp_path: Path, store: SQLiteStore
) -> None:
    log = tmp_path / "log.txt"
    failing = {"on": True}

    def ask(state: State) -> State:
        answer = interrupt("q")
        if failing["on"]:
            raise RuntimeError("flaky tool")
        lg.log(log, "ask-after")
        return {"a1": answer}

    builder = StateGraph(State)
    builder.add_node("ask", ask)
    builder.add_edge(START, "ask")
    builder.add_edge("ask", END)
    with lg.sync_saver(tmp_path / "langgraph.db") as cp:
        driver = LangGraphDriver(builder.compile(checkpointer=cp), store)
        [q] = await driver.start("flaky", {})
        # Q6: logged; the answer stays, deferred with backoff (not retried at once)
        assert await driver.answer(q.question_id, "first") is Outcome.DEFERRED
        question = await store.get_question(q.question_id)
        assert (question.status, question.apply_attempts) == (QuestionStatus.ANSWERED, 1)
        assert question.apply_error is not None and "flaky tool" in question.apply_error
        run = await store.get_run("flaky")
        assert run.error is not None and "flaky tool" in run.error
        with pytest.raises(NotResumable, match="suspended"):
            await driver.adopt("flaky")  # a daemon leaves it to the answer's retry

        failing["on"] = False
        assert await driver.worker.resume(q.question_id) is Outcome.APPLIED
        assert await driver.worker.sweep() == {}
        assert (await store.get_question(q.question_id)).status is QuestionStatus.APPLIED
        assert await final_values(driver, "flaky") == {"a1": "first"}
        assert lg.lines(log) == ["ask-after"]
        run = await store.get_run("flaky")
        assert (run.status, run.error) == (RunStatus.COMPLETED, None)


# --- the lease is kept alive while a graph step runs ------------------------------


async def test_lease_is_renewed_while_a_slow_step_runs(tmp_path: Path, store: SQLiteStore) -> None:
    """A step longer than the lease ttl keeps the thread fenced, so no worker takes it over."""
    entered, release = threading.Event(), threading.Event()
    log = tmp_path / "log.txt"

    def ask(state: State) -> State:
        answer = interrupt("slow?")
        entered.set()
        release.wait(timeout=30)
        lg.log(log, "ask-after")
        return {"a1": answer}

    builder = StateGraph(State)
    builder.add_node("ask", ask)
    builder.add_edge(START, "ask")
    builder.add_edge("ask", END)
    ttl = 0.3
    with lg.sync_saver(tmp_path / "langgraph.db") as cp:
        driver = LangGraphDriver(builder.compile(checkpointer=cp), store, lease_ttl=ttl)
        [q] = await driver.start("slow", {})
        resume = asyncio.create_task(driver.answer(q.question_id, "ok"))
        try:
            assert await asyncio.to_thread(entered.wait, 30)
            await asyncio.sleep(ttl * 4)  # well past the first expiry: only renewals keep it
            with pytest.raises(LeaseHeld):
                await store.acquire_lease("slow", "intruder", ttl)
            other = LangGraphDriver(builder.compile(checkpointer=cp), store)
            assert await other.worker.resume(q.question_id) is Outcome.BUSY
        finally:
            release.set()
            outcome = await resume
        assert outcome is Outcome.APPLIED
        assert lg.lines(log) == ["ask-after"]
        assert (await store.get_run("slow")).status is RunStatus.COMPLETED


# --- a driver's worker leaves other runs' questions alone --------------------------


async def test_sweeping_through_a_driver_never_supersedes_other_runs(
    tmp_path: Path, store: SQLiteStore
) -> None:
    await store.create_run(
        NewRun(
            run_id="engine-run",
            graph_name="some-tailrace-graph",
            graph_ref="pkg.mod:graph",
            fingerprint="f",
            input_json="null",
            created_at=1.0,
        )
    )
    token = await store.acquire_lease("engine-run", "engine", 30.0)
    question = QuestionRow(
        question_id="engine-q",
        run_id="engine-run",
        node_id="gate",
        visit=1,
        turn=0,
        prompt_json='"approve?"',
    )
    await store.commit(
        "engine-run",
        token,
        Harvest(state_json="{}", status=RunStatus.SUSPENDED, questions=[question]),
    )
    await store.release_lease("engine-run", "engine", token)
    await store.answer("engine-q", '"yes"')

    with lg.sync_saver(tmp_path / "langgraph.db") as cp:
        driver = LangGraphDriver(one_question_graph(cp, tmp_path / "log.txt"), store)
        assert await driver.worker.sweep() == {}  # not its run: skipped
        assert (await store.get_question("engine-q")).status is QuestionStatus.ANSWERED
        [q] = await driver.start("mine", {})
        with pytest.raises(ValueError, match="not a thread"):
            await driver.answer("engine-q", "no")
        other = LangGraphDriver(one_question_graph(cp, tmp_path / "log.txt"), store, name="other")
        with pytest.raises(ValueError, match="not a thread"):
            await other.answer(q.question_id, "no")
        assert (await store.get_question(q.question_id)).status is QuestionStatus.OPEN


# --- misuse and the optional import -----------------------------------------------


def test_a_graph_without_checkpointer_is_refused(tmp_path: Path) -> None:
    graph = one_question_graph(None, tmp_path / "log.txt")
    with pytest.raises(ValueError, match="checkpointer"):
        LangGraphDriver(graph, SQLiteStore(tmp_path / "t.db"))


@pytest.mark.parametrize(
    "module", ["tailrace", "tailrace.integrations", "tailrace.integrations.langgraph"]
)
def test_importing_tailrace_does_not_import_langgraph(module: str) -> None:
    code = f"import sys, {module}; assert 'langgraph' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)
