"""Machine gates for LangGraph threads, served by the daemon (issue 9, finding 15; Q5, D6).

A team runner's VERIFY step interrupts with ``machine_gate(..., poller="ci")``.
A :class:`~tailrace.gates.Server` given the driver as a target polls CI and
answers, or answers with a ``GateTimeout`` once the deadline passed, and the
driver applies the answer through the worker, exactly as for a tailrace gate.
A daemon killed while the thread waits on CI is restarted and completes it;
a driver that died between LangGraph's checkpoint and the ledger, or in the
middle of a step, is taken over from the checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

from tests import fixtures

pytest.importorskip("langgraph")
pytest.importorskip("langgraph.checkpoint.sqlite")

import tailrace as tr
from tailrace import NotResumable
from tailrace._codec import DEFAULT_CODEC
from tailrace.gates import GateTimeout, Server
from tailrace.integrations.langgraph import (
    LangGraphDriver,
    as_gate_timeout,
    machine_gate,
    open_driver,
)
from tailrace.stores import Harvest, NewRun, QuestionStatus, RunStatus, SQLiteStore

HERE = Path(__file__).resolve().parent
WAIT = 60.0


lg = fixtures.load_module("tailrace_tests_integrations_lg_graphs", HERE / "lg_graphs.py")


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SQLiteStore]:
    async with SQLiteStore(tmp_path / "tailrace.db") as s:
        yield s


async def eventually(what: str, check: Callable[[], Awaitable[bool]]) -> None:
    """Poll the observed state until ``check`` holds; fail naming ``what`` after a generous wait."""
    await fixtures.until(check, what, guard=WAIT, every=0.02)


async def completed(store: SQLiteStore, thread_id: str) -> bool:
    return (await store.get_run(thread_id)).status is RunStatus.COMPLETED


@contextlib.asynccontextmanager
async def serving(
    store: SQLiteStore, driver: LangGraphDriver, pollers: Mapping[str, Any]
) -> AsyncIterator[Server]:
    """A serve loop over ``store`` with ``driver`` as a target, stopped (and awaited) on exit."""
    server = Server(
        tr.Engine(store=store),
        targets=[driver],
        pollers=pollers,
        interval=0.01,
        max_interval=0.05,
    )
    stop = asyncio.Event()
    task = asyncio.create_task(server.run(stop))
    try:
        yield server
    finally:
        stop.set()
        await task


class CI:
    """A CI system a poller asks: pending until a verdict is set; counts the polls."""

    def __init__(self) -> None:
        self.verdict: Any = None
        self.prompts: list[Any] = []
        self.polled = threading.Event()

    def poll(self, prompt: Any) -> Any:
        self.prompts.append(prompt)
        self.polled.set()
        return self.verdict


# --- the convention --------------------------------------------------------------------


def test_machine_gate_builds_the_interrupt_value_and_refuses_bad_fields() -> None:
    assert machine_gate("ok?", poller="ci") == {"prompt": "ok?", "poller": "ci"}
    assert machine_gate("ok?", deadline=1.5) == {"prompt": "ok?", "deadline": 1.5}
    with pytest.raises(ValueError, match="poller=, a deadline="):
        machine_gate("ok?")
    with pytest.raises(ValueError, match="poller must be a non-empty string"):
        machine_gate("ok?", poller="")
    for bad in (0, -1, float("inf"), float("nan"), True, "600"):
        with pytest.raises(ValueError, match="deadline must be a finite number"):
            machine_gate("ok?", poller="ci", deadline=bad)  # type: ignore[arg-type]


def test_as_gate_timeout_recognises_a_timeout_in_either_form() -> None:
    timeout = GateTimeout(question_id="t/1", deadline=5.0)
    assert as_gate_timeout(timeout) is timeout
    stored = as_gate_timeout(json.loads(json.dumps(timeout)))  # as LangGraph stores it
    assert isinstance(stored, GateTimeout) and stored.question_id == "t/1"
    assert as_gate_timeout({"status": "green"}) is None
    assert as_gate_timeout(None) is None


async def test_a_machine_gate_interrupt_is_recorded_with_its_poller_and_deadline(
    tmp_path: Path, store: SQLiteStore
) -> None:
    log = tmp_path / "log.txt"
    with lg.sync_saver(tmp_path / "langgraph.db") as cp:
        driver = LangGraphDriver(lg.team_graph(cp, log), store)
        before = time.time()
        [q] = await driver.start("team", {"task": "fix #12", "ci_deadline": 600})
        stored = await store.get_question(q.question_id)
        assert (stored.node_id, stored.poller, stored.status) == (
            "verify",
            "ci",
            QuestionStatus.OPEN,
        )
        assert stored.deadline is not None and before + 600 <= stored.deadline <= time.time() + 600
        assert DEFAULT_CODEC.decode(stored.prompt_json) == {
            "prompt": {"check": "ci", "task": "fix #12"},
            "poller": "ci",
            "deadline": 600,
        }


async def test_bad_gate_fields_open_a_question_for_a_person_and_say_why(
    tmp_path: Path, store: SQLiteStore, caplog: pytest.LogCaptureFixture
) -> None:
    from langgraph.graph import END, START, StateGraph
    from langgraph.types import interrupt

    def ask(state: dict[str, Any]) -> dict[str, Any]:
        return {"answer": interrupt({"prompt": "ship?", "poller": 7, "deadline": "Friday"})}

    builder = StateGraph(dict)
    builder.add_node("ask", ask)
    builder.add_edge(START, "ask")
    builder.add_edge("ask", END)
    with lg.sync_saver(tmp_path / "langgraph.db") as cp:
        driver = LangGraphDriver(builder.compile(checkpointer=cp), store, name="bad")
        with caplog.at_level(logging.WARNING, logger="tailrace.integrations.langgraph"):
            [q] = await driver.start("bad-fields", {})
        assert (q.poller, q.deadline) == (None, None)
        messages = [r.getMessage() for r in caplog.records]
        assert any("'bad-fields'" in m and "poller 7" in m for m in messages), messages
        assert any("deadline 'Friday'" in m for m in messages), messages


# --- the daemon polls CI and applies its verdict ---------------------------------------


async def test_serve_polls_a_langgraph_machine_gate_and_completes_the_thread(
    tmp_path: Path, store: SQLiteStore
) -> None:
    log = tmp_path / "log.txt"
    ci = CI()
    with lg.sync_saver(tmp_path / "langgraph.db") as cp:
        driver = LangGraphDriver(lg.team_graph(cp, log), store)
        [q] = await driver.start("team", {"task": "fix #12"})
        async with serving(store, driver, {"ci": ci.poll}) as server:
            assert await asyncio.to_thread(ci.polled.wait, WAIT)
            assert (await store.get_question(q.question_id)).status is QuestionStatus.OPEN
            ci.verdict = {"status": "green"}
            await eventually("the thread to complete", lambda: completed(store, "team"))
        assert ci.prompts[0]["prompt"] == {"check": "ci", "task": "fix #12"}
        assert lg.lines(log) == ["implement", "verify-after:dict", "merge:green"]
        question = await store.get_question(q.question_id)
        assert (question.status, question.answered_by) == (QuestionStatus.APPLIED, "poller:ci")
        assert server.stats.applied == 1 and server.stats.errors == 0


async def test_a_passed_deadline_answers_with_a_gate_timeout_the_graph_routes_on(
    tmp_path: Path, store: SQLiteStore
) -> None:
    log = tmp_path / "log.txt"
    ci = CI()  # never answers
    async with lg.saver("async", tmp_path / "langgraph.db") as cp:
        driver = LangGraphDriver(lg.team_graph(cp, log), store)
        [q] = await driver.start("slow-ci", {"task": "fix #13", "ci_deadline": 0.2})
        async with serving(store, driver, {"ci": ci.poll}) as server:
            await eventually("the thread to complete", lambda: completed(store, "slow-ci"))
        assert lg.lines(log) == ["implement", "verify-after:GateTimeout", "escalate"]
        question = await store.get_question(q.question_id)
        assert question.status is QuestionStatus.EXPIRED and question.applied_at is not None
        timeout = DEFAULT_CODEC.decode(question.answer_json or "null")
        assert isinstance(timeout, GateTimeout) and timeout.question_id == q.question_id
        snapshot = await driver.graph.aget_state({"configurable": {"thread_id": "slow-ci"}})
        assert snapshot.values["outcome"] == "escalated"
        assert server.stats.expired == 1


# --- a daemon killed while the thread waits on CI --------------------------------------


def _spawn_daemon(tmp_path: Path) -> subprocess.Popen[bytes]:
    files = ["tailrace.db", "langgraph.db", "log.txt", "ci.json", "polls.txt"]
    return subprocess.Popen(
        [sys.executable, str(HERE / "langgraph_daemon.py"), *(str(tmp_path / f) for f in files)]
    )


async def _wait_for_polls(path: Path, count: int, daemon: subprocess.Popen[bytes]) -> None:
    async def enough() -> bool:
        assert daemon.poll() is None, f"the daemon exited with {daemon.returncode}"
        return len(lg.lines(path)) >= count

    await eventually(f"{count} polls", enough)


@pytest.mark.slow
async def test_a_restarted_daemon_completes_a_thread_that_waits_on_ci(
    tmp_path: Path, store: SQLiteStore
) -> None:
    log, polls, verdict = tmp_path / "log.txt", tmp_path / "polls.txt", tmp_path / "ci.json"
    with lg.sync_saver(tmp_path / "langgraph.db") as cp:
        driver = LangGraphDriver(lg.team_graph(cp, log), store)
        [q] = await driver.start("verify", {"task": "fix #14"})

        first = _spawn_daemon(tmp_path)
        try:
            await _wait_for_polls(polls, 2, first)  # it serves the thread: CI still runs
        finally:
            first.send_signal(signal.SIGKILL)
            assert await asyncio.to_thread(first.wait, WAIT) == -signal.SIGKILL
        assert (await store.get_question(q.question_id)).status is QuestionStatus.OPEN
        assert (await store.get_run("verify")).status is RunStatus.SUSPENDED

        verdict.write_text(json.dumps({"status": "green"}))  # CI finished while nobody served
        second = _spawn_daemon(tmp_path)
        try:
            await eventually("the thread to complete", lambda: completed(store, "verify"))
        finally:
            second.send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(second.wait, WAIT) == 0
        assert lg.lines(log) == ["implement", "verify-after:dict", "merge:green"]
        question = await store.get_question(q.question_id)
        assert (question.status, question.answered_by) == (QuestionStatus.APPLIED, "poller:ci")


# --- a driver that died: taken over from LangGraph's checkpoint ------------------------


class Crash(BaseException):
    """The process dies here."""


class DiesOnce:
    """A store through which a driver process dies: from then on it writes and releases nothing."""

    def __init__(self, store: SQLiteStore, when: Callable[[Harvest], bool]) -> None:
        self._store = store
        self._when = when
        self.dead = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    async def commit(self, run_id: str, token: int, harvest: Harvest) -> Any:
        if self.dead or self._when(harvest):
            self.dead = True
            raise Crash
        return await self._store.commit(run_id, token, harvest)

    async def release_lease(self, run_id: str, owner: str, token: int) -> None:
        if not self.dead:
            await self._store.release_lease(run_id, owner, token)

    async def heartbeat(self, run_id: str, owner: str, token: int, ttl: float) -> None:
        if self.dead:
            raise Crash
        await self._store.heartbeat(run_id, owner, token, ttl)


def _opens_the_ci_question(harvest: Harvest) -> bool:
    return any(q.poller == "ci" for q in harvest.questions)


async def test_serve_takes_over_an_interrupt_the_dead_driver_never_recorded(
    tmp_path: Path, store: SQLiteStore
) -> None:
    log = tmp_path / "log.txt"
    ci = CI()
    ci.verdict = {"status": "green"}
    with lg.sync_saver(tmp_path / "langgraph.db") as cp:
        dying = DiesOnce(store, _opens_the_ci_question)
        dead = LangGraphDriver(lg.team_graph(cp, log), dying, lease_ttl=0.2)  # type: ignore[arg-type]
        with pytest.raises(Crash):
            await dead.start("verify", {"task": "fix #15"})
        # LangGraph saved the VERIFY interrupt; the ledger never heard of it.
        assert await store.list_questions(run_id="verify") == []
        assert (await store.get_run("verify")).status is RunStatus.RUNNING

        driver = LangGraphDriver(lg.team_graph(cp, log), store)
        async with serving(store, driver, {"ci": ci.poll}) as server:
            await eventually("the thread to complete", lambda: completed(store, "verify"))
        assert lg.lines(log) == ["implement", "verify-after:dict", "merge:green"]
        [question] = await store.list_questions(run_id="verify")
        assert (question.poller, question.status) == ("ci", QuestionStatus.APPLIED)
        assert server.stats.adopted == 1


async def test_serve_continues_a_step_the_crash_cut_off(tmp_path: Path, store: SQLiteStore) -> None:
    from langgraph.graph import END, START, StateGraph
    from langgraph.types import interrupt

    log = tmp_path / "log.txt"
    dying = DiesOnce(store, lambda harvest: False)

    def implement(state: dict[str, Any]) -> dict[str, Any]:
        if not dying.dead:
            dying.dead = True
            raise Crash  # the process dies in the middle of the step
        lg.log(log, "implement")
        return {}

    def verify(state: dict[str, Any]) -> dict[str, Any]:
        result = interrupt(machine_gate("CI?", poller="ci"))
        lg.log(log, f"verify-after:{result['status']}")
        return {}

    def build(checkpointer: Any) -> Any:
        builder = StateGraph(dict)
        builder.add_node("implement", implement)
        builder.add_node("verify", verify)
        builder.add_edge(START, "implement")
        builder.add_edge("implement", "verify")
        builder.add_edge("verify", END)
        return builder.compile(checkpointer=checkpointer, name="cut")

    ci = CI()
    ci.verdict = {"status": "green"}
    async with lg.saver("async", tmp_path / "langgraph.db") as cp:
        dead = LangGraphDriver(build(cp), dying, lease_ttl=0.2)  # type: ignore[arg-type]
        with pytest.raises(Crash):
            await dead.start("cut", {})
        assert (await store.get_run("cut")).status is RunStatus.RUNNING

        driver = LangGraphDriver(build(cp), store)
        async with serving(store, driver, {"ci": ci.poll}):
            await eventually("the thread to complete", lambda: completed(store, "cut"))
        assert lg.lines(log) == ["implement", "verify-after:green"]


# --- adopt's refusals -----------------------------------------------------------------


async def test_adopt_refuses_what_it_cannot_take_over_and_fails_a_thread_with_no_checkpoint(
    tmp_path: Path, store: SQLiteStore
) -> None:
    log = tmp_path / "log.txt"
    with lg.sync_saver(tmp_path / "langgraph.db") as cp:
        driver = LangGraphDriver(lg.team_graph(cp, log), store, lease_ttl=0.5)
        [q] = await driver.start("waiting", {"task": "t"})
        with pytest.raises(NotResumable, match="'waiting' is suspended"):
            await driver.adopt("waiting")
        other = LangGraphDriver(lg.team_graph(cp, log), store, name="other")
        with pytest.raises(NotResumable, match="not a thread of 'langgraph:other'"):
            await other.adopt("waiting")

        # A driver that died after creating the row, before LangGraph saved anything.
        await store.create_run(
            NewRun(
                run_id="stillborn",
                graph_name=f"langgraph:{driver.name}",
                graph_ref=None,
                fingerprint="langgraph",
                input_json="{}",
                created_at=time.time() - 60,
            )
        )
        await driver.adopt("stillborn")
        record = await store.get_run("stillborn")
        assert record.status is RunStatus.FAILED
        assert record.error is not None and "before LangGraph saved a checkpoint" in record.error
        assert (await store.get_question(q.question_id)).status is QuestionStatus.OPEN


# --- what a daemon is told to serve --------------------------------------------------------


async def test_open_driver_takes_a_graph_a_factory_or_a_context_manager(
    tmp_path: Path, store: SQLiteStore
) -> None:
    log = tmp_path / "log.txt"
    with lg.sync_saver(tmp_path / "langgraph.db") as cp:
        graph = lg.team_graph(cp, log)
        async with open_driver(graph, store) as driver:
            assert driver.graph is graph and driver.name == "team"
        async with open_driver(lambda: graph, store, name="named", lease_ttl=5.0) as driver:
            assert (driver.graph, driver.name, driver.lease_ttl) == (graph, "named", 5.0)

    closed: list[str] = []

    @contextlib.asynccontextmanager
    async def with_async_saver() -> AsyncIterator[Any]:
        async with lg.saver("async", tmp_path / "langgraph-aio.db") as aio:
            yield lg.team_graph(aio, log)
        closed.append("saver")

    async with open_driver(with_async_saver, store) as driver:
        assert driver.use_async
        [q] = await driver.start("aio", {"task": "t"})
        assert q.poller == "ci"
    assert closed == ["saver"]

    with pytest.raises(TypeError, match="expected a compiled LangGraph graph"):
        async with open_driver(lambda: 42, store):
            pass
