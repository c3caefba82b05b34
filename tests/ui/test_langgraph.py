"""LangGraph threads on the dashboard: answered and applied here, their steps shown, their status true.

A real LangGraph graph (``review -> publish``, ``review`` interrupting) with a
real checkpointer, driven by :class:`~tailrace.integrations.langgraph.LangGraphDriver`
over a real store; the dashboard under Starlette's ``TestClient``, given the
driver as ``tailrace ui --langgraph`` gives it (``UiConfig.drivers``).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypedDict

import pytest

pytest.importorskip("langgraph")

from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.types import interrupt

from tailrace.integrations.langgraph import LangGraphDriver, open_driver
from tailrace.stores import QuestionRow, QuestionStatus, RunStatus, RunStore
from tests import fixtures
from tests.ui.support import TOKEN, Factory, dashboard, resumer_of, scenarios

lg = fixtures.load_module(
    "tailrace_tests_integrations_lg_graphs",
    Path(__file__).parents[1] / "integrations" / "lg_graphs.py",
)


class State(TypedDict, total=False):
    topic: str
    approved: Any
    done: bool


def review_graph(checkpointer: Any, log: Path) -> Any:
    """``review`` asks to publish (an interrupt); ``publish`` runs once it is answered.

    Code after the interrupt returns logs one line, so "applied once" is
    checked on what LangGraph ran, not on the ledger.
    """

    def review(state: State) -> State:
        answer = interrupt(f"publish {state['topic']}?")
        with log.open("a") as f:
            f.write(f"review-after:{answer}\n")
        return {"approved": answer}

    def publish(state: State) -> State:
        return {"done": True}

    builder = StateGraph(State)
    builder.add_node("review", review)
    builder.add_node("publish", publish)
    builder.add_edge(START, "review")
    builder.add_edge("review", "publish")
    builder.add_edge("publish", END)
    return builder.compile(checkpointer=checkpointer, name="review")


def driver_of(graph: Any) -> Callable[[RunStore], contextlib.AbstractAsyncContextManager[Any]]:
    """What ``tailrace ui --langgraph review=...`` hands the dashboard for ``graph``."""
    return lambda store: open_driver(graph, store, name="review", lease_ttl=5.0)


def start_thread(factory: Factory, graph: Any, thread_id: str = "thread-1") -> QuestionRow:
    async def start() -> QuestionRow:
        async with scenarios.opened(factory) as store:
            driver = LangGraphDriver(graph, store, name="review")
            [question] = await driver.start(thread_id, {"topic": "tides"})
            return question

    return asyncio.run(start())


def read(factory: Factory, thread_id: str = "thread-1") -> tuple[RunStatus, list[QuestionRow]]:
    async def go() -> tuple[RunStatus, list[QuestionRow]]:
        async with scenarios.opened(factory) as store:
            return (await store.get_run(thread_id)).status, await store.list_questions()

    return asyncio.run(go())


def answer_in(client: Any, question_id: str, value: str = '"yes"') -> None:
    response = client.post(f"/answer/{question_id}", data={"token": TOKEN, "answer": value})
    assert response.status_code == 303, response.text
    client.portal.call(resumer_of(client).wait, "thread-1")


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


@pytest.fixture
def checkpoints(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "checkpoints.db"


def test_an_answer_on_the_dashboard_is_applied_to_the_thread_once_and_shown_applied(
    any_db: Factory, tmp_path: Path, checkpoints: Path
) -> None:
    log = tmp_path / "ran.log"
    with lg.sync_saver(checkpoints) as saver:
        graph = review_graph(saver, log)
        question = start_thread(any_db, graph)
        with dashboard(any_db, drivers=[driver_of(graph)]) as client:
            answer_in(client, question.question_id)
            page = client.get("/runs/thread-1").text
            inbox = client.get("/questions?tab=all").text
    status, [row] = read(any_db)
    assert status is RunStatus.COMPLETED
    assert row.status is QuestionStatus.APPLIED  # Q3: applied, not superseded
    assert lines(log) == ["review-after:yes"]  # LangGraph ran the resumed step once
    assert "resumed here by the LangGraph driver &#39;review&#39;: the thread is completed" in page
    for shown in (page, inbox):
        assert 'class="pill q-pill-applied">applied</span>' in shown
        assert "q-pill-superseded" not in shown


def test_a_thread_page_shows_its_steps_waits_and_graph(
    sqlite_db: Factory, tmp_path: Path, checkpoints: Path
) -> None:
    with lg.sync_saver(checkpoints) as saver:
        graph = review_graph(saver, tmp_path / "ran.log")
        question = start_thread(sqlite_db, graph)
        with dashboard(sqlite_db, drivers=[driver_of(graph)]) as client:
            waiting = client.get("/runs/thread-1").text
            answer_in(client, question.question_id)
            done = client.get("/runs/thread-1").text
    # While it waits: review asked, and waits for an answer now; the graph is drawn whole.
    assert "review#1 try 1: asked a question" in waiting
    assert "review#1: waiting for an answer" in waiting
    assert "drawn whole: from the structure the run stored when it started" in waiting
    assert "<title>review → publish</title>" in waiting
    # Once applied: review ran again (try 2) and completed, then publish; every step is an event.
    assert "review#1 try 2: completed" in done
    assert "publish#1 try 1: completed" in done
    types = re.findall(r'<span class="ev-type">(\w+)</span>', done)
    assert types == [
        "run_started", "node_started", "question_opened", "run_suspended",
        "run_resumed", "question_answered", "node_started", "node_completed",
        "node_started", "node_completed", "run_completed",
    ], types  # fmt: skip


def test_a_driver_whose_checkpointer_lacks_the_thread_defers_the_answer_never_supersedes_it(
    sqlite_db: Factory, tmp_path: Path
) -> None:
    """The checkpointer that ran the thread is not the dashboard's (two InMemorySavers, as two
    processes each loading a module with one would have): the answer must stay to be applied."""
    log = tmp_path / "ran.log"
    started_by = review_graph(InMemorySaver(), log)
    question = start_thread(sqlite_db, started_by)
    with dashboard(sqlite_db, drivers=[driver_of(review_graph(InMemorySaver(), log))]) as client:
        answer_in(client, question.question_id)
        page = client.get("/runs/thread-1").text
    status, [row] = read(sqlite_db)
    assert status is RunStatus.SUSPENDED
    assert row.status is QuestionStatus.ANSWERED  # not superseded: nothing consumed it
    assert row.apply_error is not None and row.apply_error.startswith("CheckpointMissing: ")
    assert "has no checkpoint of it" in page and "q-pill-stuck" in page
    assert lines(log) == []

    async def apply_with_the_right_checkpointer() -> RunStatus:
        async with scenarios.opened(sqlite_db) as store:
            return await LangGraphDriver(started_by, store, name="review").resume("thread-1")

    assert asyncio.run(apply_with_the_right_checkpointer()) is RunStatus.COMPLETED
    assert read(sqlite_db)[1][0].status is QuestionStatus.APPLIED
    assert lines(log) == ["review-after:yes"]


def test_without_a_driver_the_dashboard_records_the_answer_and_names_langgraph(
    sqlite_db: Factory, tmp_path: Path
) -> None:
    question = start_thread(sqlite_db, review_graph(InMemorySaver(), tmp_path / "ran.log"))
    with dashboard(sqlite_db) as client:
        answer_in(client, question.question_id)
        page = client.get("/runs/thread-1").text
    status, [row] = read(sqlite_db)
    assert (status, row.status) == (RunStatus.SUSPENDED, QuestionStatus.ANSWERED)
    assert "tailrace ui --langgraph review=MODULE_OR_FILE:ATTR" in page
    assert "--graphs" not in page.split("Questions")[0]


def test_drivers_of_one_name_are_refused_when_the_dashboard_starts(
    sqlite_db: Factory, tmp_path: Path
) -> None:
    graph = review_graph(InMemorySaver(), tmp_path / "ran.log")
    twice = dashboard(sqlite_db, drivers=[driver_of(graph), driver_of(graph)])
    with pytest.raises(ValueError, match="LangGraph drivers named twice: review"), twice:
        pass
