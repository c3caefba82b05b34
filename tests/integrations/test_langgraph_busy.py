"""Finding 15: an answer that finds its LangGraph thread busy is applied by whoever holds the thread.

Two parallel branches each ``interrupt()``. Answered at once, one resume
takes the thread and the other answer returns ``busy``; the holder must
apply both before it lets the thread go, so the graph completes with no
sweep, and every post-interrupt node runs exactly once (Q3). Real LangGraph
graphs, the real ``SqliteSaver``/``AsyncSqliteSaver`` and SQLite files.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from tests import fixtures

pytest.importorskip("langgraph")
pytest.importorskip("langgraph.checkpoint.sqlite")

from tailrace import AlreadyAnswered
from tailrace._codec import DEFAULT_CODEC
from tailrace.gates import Outcome
from tailrace.integrations.langgraph import LangGraphDriver
from tailrace.stores import QuestionRow, QuestionStatus, RunStatus, RunStore, SQLiteStore

HERE = Path(__file__).resolve().parent
TRIALS = 20


lg = fixtures.load_module("tailrace_tests_integrations_lg_graphs", HERE / "lg_graphs.py")


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SQLiteStore]:
    async with SQLiteStore(tmp_path / "tailrace.db") as s:
        yield s


@pytest.fixture(params=fixtures.SHARED_STORES)
async def any_store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[RunStore]:
    """The tailrace store on SQLite, or on Postgres in a schema of its own."""
    async with fixtures.open_store(
        request.param, tmp_path, filename="tailrace.db", prefix="lg_busy", max_size=4
    ) as opened:
        yield opened


async def _start(driver: LangGraphDriver, thread_id: str) -> dict[str, QuestionRow]:
    questions = await driver.start(thread_id, {"trial": thread_id})
    by_side = {DEFAULT_CODEC.decode(q.prompt_json)["side"]: q for q in questions}
    assert sorted(by_side) == ["left?", "right?"]
    return by_side


async def _assert_completed_once(
    driver: LangGraphDriver, store: RunStore, log: Path, thread_id: str, left: Any, right: Any
) -> None:
    """The graph finished with both answers, each post-interrupt node ran once, the ledger agrees."""
    config = {"configurable": {"thread_id": thread_id}}
    if driver.use_async:
        snapshot = await driver.graph.aget_state(config)
    else:
        snapshot = await asyncio.to_thread(driver.graph.get_state, config)
    assert not snapshot.next, f"{thread_id}: the graph is still suspended on {snapshot.next}"
    assert snapshot.values == {"trial": thread_id, "left": left, "right": right, "done": True}
    ran = Counter(line for line in lg.lines(log) if line.startswith(f"{thread_id}:"))
    assert ran == {
        f"{thread_id}:left-after": 1,
        f"{thread_id}:right-after": 1,
        f"{thread_id}:join": 1,
    }
    statuses = {q.status for q in await store.list_questions(run_id=thread_id)}
    assert statuses == {QuestionStatus.APPLIED}
    assert (await store.get_run(thread_id)).status is RunStatus.COMPLETED


# --- both answered at once, in one event loop ---------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_both_answers_at_once_complete_the_graph_without_a_sweep(
    tmp_path: Path, any_store: RunStore, kind: str
) -> None:
    store = any_store
    log = tmp_path / "log.txt"
    async with lg.saver(kind, tmp_path / "langgraph.db") as cp:
        driver = LangGraphDriver(lg.parallel_graph(cp, log), store)
        seen: Counter[Outcome] = Counter()
        for n in range(TRIALS):
            thread_id = f"{kind}-{n}"
            q = await _start(driver, thread_id)
            outcomes = await asyncio.gather(
                driver.answer(q["left?"].question_id, "L"),
                driver.answer(q["right?"].question_id, "R"),
            )
            assert set(outcomes) <= {Outcome.APPLIED, Outcome.BUSY}, outcomes
            assert Outcome.APPLIED in outcomes
            seen.update(outcomes)
            await _assert_completed_once(driver, store, log, thread_id, "L", "R")
        assert seen[Outcome.BUSY] > 0, "the race never made an answer find the thread busy"


# --- both answered at once, from two threads with their own drivers -----------------


def _answer_in_own_loop(
    tmp_path: Path, question_id: str, value: str, barrier: threading.Barrier, out: list[Any]
) -> None:
    """One thread: its own event loop, store instance, LangGraph connection and driver."""

    async def main() -> Any:
        async with SQLiteStore(tmp_path / "tailrace.db") as store:
            with lg.sync_saver(tmp_path / "langgraph.db") as cp:
                driver = LangGraphDriver(lg.parallel_graph(cp, tmp_path / "log.txt"), store)
                await asyncio.to_thread(barrier.wait)
                return await driver.answer(question_id, value)

    try:
        out.append(asyncio.run(main()))
    except BaseException as exc:  # reported by the test, not lost in the thread
        out.append(exc)


async def test_both_answers_at_once_from_two_threads_complete_the_graph(
    tmp_path: Path, store: SQLiteStore
) -> None:
    log = tmp_path / "log.txt"
    with lg.sync_saver(tmp_path / "langgraph.db") as cp:
        driver = LangGraphDriver(lg.parallel_graph(cp, log), store)
        for n in range(TRIALS):
            thread_id = f"threads-{n}"
            q = await _start(driver, thread_id)
            barrier = threading.Barrier(2)
            out: list[Any] = []
            threads = [
                threading.Thread(
                    target=_answer_in_own_loop,
                    args=(tmp_path, q[side].question_id, value, barrier, out),
                )
                for side, value in (("left?", "L"), ("right?", "R"))
            ]

            def run_both(threads: list[threading.Thread] = threads) -> None:
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()

            await asyncio.to_thread(run_both)
            assert len(out) == 2 and set(out) <= {Outcome.APPLIED, Outcome.BUSY}, out
            await _assert_completed_once(driver, store, log, thread_id, "L", "R")


# --- deterministic: the answer arrives while the holder runs a step ----------------


@pytest.mark.parametrize("answerer", ["same-driver", "other-driver"])
async def test_an_answer_arriving_during_the_step_is_applied_by_the_holder(
    tmp_path: Path, store: SQLiteStore, answerer: str
) -> None:
    log = tmp_path / "log.txt"
    entered, release = threading.Event(), threading.Event()
    with lg.sync_saver(tmp_path / "langgraph.db") as cp:
        driver = LangGraphDriver(lg.parallel_graph(cp, log, hold_left=(entered, release)), store)
        other = LangGraphDriver(lg.parallel_graph(cp, log), store)
        q = await _start(driver, "held")
        holder = asyncio.create_task(driver.answer(q["left?"].question_id, "L"))
        try:
            assert await asyncio.to_thread(entered.wait, 30)
            late = driver if answerer == "same-driver" else other
            assert await late.answer(q["right?"].question_id, "R") is Outcome.BUSY
            assert (await store.get_question(q["right?"].question_id)).status is (
                QuestionStatus.ANSWERED
            )
        finally:
            release.set()
            outcome = await holder
        assert outcome is Outcome.APPLIED
        await _assert_completed_once(driver, store, log, "held", "L", "R")


# --- deterministic: the answer arrives while the holder lets go ----------------------


class AnswersWhileReleasing:
    """A store through which the holder lets go of the thread only after another answer arrived."""

    def __init__(self, store: SQLiteStore) -> None:
        self._store = store
        self._arrive: Callable[[], Awaitable[Outcome]] | None = None
        self.outcomes: list[Outcome] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def arm(self, arrive: Callable[[], Awaitable[Outcome]]) -> None:
        self._arrive = arrive

    async def release_lease(self, run_id: str, owner: str, token: int) -> None:
        if self._arrive is not None:
            arrive, self._arrive = self._arrive, None
            self.outcomes.append(await arrive())  # still held: this answer finds it busy
        await self._store.release_lease(run_id, owner, token)


async def test_an_answer_arriving_while_the_holder_lets_go_is_applied(
    tmp_path: Path, store: SQLiteStore
) -> None:
    log = tmp_path / "log.txt"
    with lg.sync_saver(tmp_path / "langgraph.db") as cp:
        releasing = AnswersWhileReleasing(store)
        holder = LangGraphDriver(lg.parallel_graph(cp, log), releasing)  # type: ignore[arg-type]
        other = LangGraphDriver(lg.parallel_graph(cp, log), store)
        q = await _start(holder, "window")
        releasing.arm(lambda: other.answer(q["right?"].question_id, "R"))

        assert await holder.answer(q["left?"].question_id, "L") is Outcome.APPLIED
        assert releasing.outcomes == [Outcome.BUSY]
        await _assert_completed_once(holder, store, log, "window", "L", "R")


# --- four processes race both answers and both resumes -------------------------------


@pytest.mark.slow
async def test_four_processes_racing_parallel_answers_apply_each_once(
    tmp_path: Path, store: SQLiteStore
) -> None:
    log = tmp_path / "log.txt"
    racers = [_spawn_racer(tmp_path, log, f"p{i}") for i in range(4)]
    try:
        with lg.sync_saver(tmp_path / "langgraph.db") as cp:
            driver = LangGraphDriver(lg.parallel_graph(cp, log), store)
            for racer in racers:
                assert await asyncio.to_thread(_read_line, racer) == "ready"
            for n in range(5):
                thread_id = f"procs-{n}"
                q = await _start(driver, thread_id)
                trial = {"left": q["left?"].question_id, "right": q["right?"].question_id}
                for racer in racers:
                    _write_line(racer, json.dumps(trial))
                results = [json.loads(await asyncio.to_thread(_read_line, r)) for r in racers]
                answers = [r for per_racer in results for r in per_racer[:2]]
                assert answers.count(AlreadyAnswered.__name__) == 6, results
                allowed = {o.value for o in (Outcome.APPLIED, Outcome.BUSY, Outcome.NOOP)}
                assert set(answers) - {AlreadyAnswered.__name__} <= allowed, results
                assert {r for per_racer in results for r in per_racer[2:]} <= allowed, results
                left = await store.get_question(trial["left"])
                right = await store.get_question(trial["right"])
                winners = (
                    DEFAULT_CODEC.decode(left.answer_json or "null"),
                    DEFAULT_CODEC.decode(right.answer_json or "null"),
                )
                await _assert_completed_once(driver, store, log, thread_id, *winners)
    finally:
        for racer in racers:
            if racer.poll() is None:
                _write_line(racer, json.dumps({"quit": True}))
        for racer in racers:
            assert await asyncio.to_thread(racer.wait, 60) == 0
            for pipe in (racer.stdin, racer.stdout):
                if pipe is not None:
                    pipe.close()


def _spawn_racer(tmp_path: Path, log: Path, name: str) -> subprocess.Popen[str]:
    script = HERE / "langgraph_racer.py"
    files = [tmp_path / "tailrace.db", tmp_path / "langgraph.db", log]
    return subprocess.Popen(
        [sys.executable, str(script), *map(str, files), name],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def _read_line(process: subprocess.Popen[str]) -> str:
    assert process.stdout is not None
    return process.stdout.readline().strip()


def _write_line(process: subprocess.Popen[str], line: str) -> None:
    assert process.stdin is not None
    process.stdin.write(line + "\n")
    process.stdin.flush()
