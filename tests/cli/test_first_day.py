"""What a first day with the command line runs into: answers, LangGraph threads, help, messages.

In process with typer's ``CliRunner``; the stores are written through their API.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Mapping
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from tailrace.cli._app import app
from tailrace.graph import load_file_module
from tailrace.stores import (
    EventRow,
    Harvest,
    NewRun,
    QuestionRow,
    QuestionStatus,
    RunStatus,
    SQLiteStore,
)

ROOT = Path(__file__).resolve().parents[2]
BASE_ENV: dict[str, str | None] = {
    "COLUMNS": "250",
    "TAILRACE_DB": None,
    "TAILRACE_LEASE_TTL": None,
}

GATED = """
from tailrace import Graph

graph = Graph("gated")

@graph.task()
def plan(x):
    return x

@graph.gate()
def approve(x):
    return f"approve {x}?"

@graph.task()
def act(answer):
    return {"answer": answer}

graph.chain("plan", "approve", "act")
"""

LANGGRAPH = """
from typing import TypedDict

from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.types import interrupt


class State(TypedDict, total=False):
    topic: str
    approved: str


def review(state: State) -> State:
    return {"approved": interrupt(f"publish {state['topic']}?")}


builder = StateGraph(State)
builder.add_node("review", review)
builder.add_edge(START, "review")
builder.add_edge("review", END)
graph = builder.compile(checkpointer=InMemorySaver())
"""


@pytest.fixture(autouse=True)
def _in_tmp(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TAILRACE_DB", raising=False)
    monkeypatch.delenv("TAILRACE_LEASE_TTL", raising=False)


def invoke(*args: object, env: Mapping[str, str | None] | None = None) -> Result:
    return CliRunner().invoke(app, [str(a) for a in args], env={**BASE_ENV, **(env or {})})


def flat(text: str) -> str:
    for ch in "│╭╮╰╯─┃┏┓┗┛━┡┩╇┳┻╋┣┫┠┨":
        text = text.replace(ch, "")
    return "".join(text.split())


def says(result: Result, message: str) -> bool:
    return flat(message) in flat(result.output)


def clean(result: Result) -> None:
    assert "Traceback" not in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception


def read_questions(db: Path) -> list[QuestionRow]:
    async def read() -> list[QuestionRow]:
        async with SQLiteStore(db) as store:
            return await store.list_questions()

    return asyncio.run(read())


def run_status(db: Path, run_id: str) -> RunStatus:
    async def read() -> RunStatus:
        async with SQLiteStore(db) as store:
            return (await store.get_run(run_id)).status

    return asyncio.run(read())


def suspended_run(tmp_path: Path) -> tuple[Path, Path, QuestionRow]:
    db, gated = tmp_path / "t.db", tmp_path / "gated.py"
    gated.write_text(GATED)
    ran = invoke("run", f"{gated}:graph", "--db", db, "--run-id", "g1", "-i", '"v2"')
    assert ran.exit_code == 0, ran.output
    [question] = read_questions(db)
    return db, gated, question


# -- answer: recording is a success -------------------------------------------------------


def test_answer_without_its_graph_records_it_exits_0_and_names_who_applies_it(
    tmp_path: Path,
) -> None:
    db, gated, question = suspended_run(tmp_path)
    result = invoke("answer", question.question_id, '"yes"', "--db", db)
    clean(result)
    assert result.exit_code == 0, result.output
    assert says(result, f"answered {question.question_id}; recorded")
    assert says(result, f"a tailrace serve or tailrace worker with --graphs {gated} applies it")
    assert says(result, f"tailrace resume g1 --graphs {gated}")
    [row] = read_questions(db)
    assert row.status is QuestionStatus.ANSWERED
    resumed = invoke("resume", "g1", "--db", db, "--graphs", gated)
    assert resumed.exit_code == 0, resumed.output
    assert '"answer": "yes"' in resumed.stdout


def test_answer_with_its_graph_applies_it_here(tmp_path: Path) -> None:
    db, gated, question = suspended_run(tmp_path)
    result = invoke("answer", question.question_id, '"yes"', "--db", db, "--graphs", gated)
    clean(result)
    assert result.exit_code == 0, result.output
    assert '"answer": "yes"' in result.stdout
    [row] = read_questions(db)
    assert row.status is QuestionStatus.APPLIED
    assert run_status(db, "g1") is RunStatus.COMPLETED


def test_answer_no_resume_records_it_and_says_how_it_is_applied(tmp_path: Path) -> None:
    db, gated, question = suspended_run(tmp_path)
    result = invoke("answer", question.question_id, '"yes"', "--no-resume", "--db", db)
    clean(result)
    assert result.exit_code == 0, result.output
    assert says(result, f"--graphs {gated} applies it")
    [row] = read_questions(db)
    assert row.status is QuestionStatus.ANSWERED


# -- answer: LangGraph threads -------------------------------------------------------------


def langgraph_thread(tmp_path: Path) -> tuple[Path, Path, QuestionRow]:
    """A LangGraph thread ``thread-1`` of driver ``review``, waiting on its interrupt."""
    pytest.importorskip("langgraph")
    from tailrace.integrations.langgraph import LangGraphDriver  # needs the langgraph extra

    db, source = tmp_path / "t.db", tmp_path / "review.py"
    source.write_text(LANGGRAPH)
    graph = load_file_module(str(source)).graph  # the module the command line loads too

    async def start() -> QuestionRow:
        async with SQLiteStore(db) as store:
            [question] = await LangGraphDriver(graph, store, name="review").start(
                "thread-1", {"topic": "tides"}
            )
            return question

    return db, source, asyncio.run(start())


def test_answer_of_a_langgraph_thread_without_langgraph_names_langgraph(
    tmp_path: Path,
) -> None:
    db, _, question = langgraph_thread(tmp_path)
    result = invoke("answer", question.question_id, '"yes"', "--db", db)
    clean(result)
    assert result.exit_code == 0, result.output
    assert says(result, "run thread-1 is a LangGraph thread")
    assert says(result, "--langgraph review=MODULE_OR_FILE:ATTR")
    assert "--graphs" not in result.output
    [row] = read_questions(db)
    assert row.status is QuestionStatus.ANSWERED


def test_answer_with_langgraph_applies_the_answer_to_the_thread(tmp_path: Path) -> None:
    db, source, question = langgraph_thread(tmp_path)
    spec = f"review={source}:graph"
    result = invoke("answer", question.question_id, '"yes"', "--db", db, "--langgraph", spec)
    clean(result)
    assert result.exit_code == 0, result.output
    assert says(result, f"answered {question.question_id}; thread thread-1: applied, completed")
    [row] = read_questions(db)
    assert row.status is QuestionStatus.APPLIED
    assert run_status(db, "thread-1") is RunStatus.COMPLETED


# -- help ---------------------------------------------------------------------------------

OURS = ("run", "resume", "runs", "show", "questions", "answer", "submit", "worker", "serve")
OURS += ("cancel", "queues")


@pytest.mark.parametrize("command", OURS)
def test_help_is_plain_text_with_flags_as_pairs_and_the_schema_hint(command: str) -> None:
    result = invoke(command, "--help")
    assert result.exit_code == 0, result.output
    assert "`" not in result.output
    options = [line for line in result.output.splitlines() if "--help" not in line]
    assert not [line for line in options if "<bool>" in line]
    assert says(result, "postgresql:// URL (add ?schema=NAME for a schema other than public)")


def test_boolean_flags_read_as_pairs() -> None:
    assert re.search(r"--force\s+--no-force", invoke("resume", "--help").output)
    assert re.search(r"--resume\s+--no-resume", invoke("answer", "--help").output)


# -- cancel and submit say what happened ---------------------------------------------------


def test_cancel_of_a_finished_run_says_nothing_was_cancelled(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    ran = invoke("run", f"{ROOT / 'examples' / 'research.py'}:graph", "--db", db, "--run-id", "r1")
    assert ran.exit_code == 0, ran.output
    result = invoke("cancel", "r1", "--db", db)
    clean(result)
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == "run r1 already completed; nothing to cancel"
    assert run_status(db, "r1") is RunStatus.COMPLETED


def test_a_submit_dedup_hit_says_it_was_not_submitted_again(tmp_path: Path) -> None:
    db, graph = tmp_path / "t.db", tmp_path / "gated.py"
    graph.write_text(GATED)
    first = invoke("submit", f"{graph}:graph", "--db", db, "--dedup-key", "k")
    assert first.exit_code == 0, first.output
    held = first.stdout.strip().splitlines()[-1]
    again = invoke("submit", f"{graph}:graph", "--db", db, "--dedup-key", "k")
    clean(again)
    assert again.exit_code == 0, again.output
    assert says(again, f"dedup key k is held by live run {held}; not submitted again")
    assert again.stdout.strip().splitlines()[-1] == held
    assert "dedup" not in first.output


def test_queues_says_its_units_in_the_header(tmp_path: Path) -> None:
    db, graph = tmp_path / "t.db", tmp_path / "gated.py"
    graph.write_text(GATED)
    assert invoke("submit", f"{graph}:graph", "--db", db).exit_code == 0
    result = invoke("queues", "--db", db, "--window", "30")
    assert result.exit_code == 0, result.output
    assert says(result, "started (runs/s, last 30s)") and says(result, "oldest wait (s)")


# -- show: a failed node's stored traceback ------------------------------------------------

HOSTILE = "[bold red]x[/] \x1b[31mred"


def traceback_text(frames: int) -> str:
    lines = ["Traceback (most recent call last):"]
    for n in range(frames):
        lines += [f'  File "/srv/flow.py", line {n + 1}, in step_{n}', f"    call_{n}()"]
    lines.append(f"KeyError: 'missing' {HOSTILE}")
    return "\n".join(lines)


def failed_run(db: Path, data: dict[str, object]) -> None:
    """A failed run whose ``boom`` node raised, with ``data`` in its ``node_failed`` event."""

    async def write() -> None:
        async with SQLiteStore(db) as store:
            now = time.time()
            await store.create_run(
                NewRun(
                    run_id="f1", graph_name="failing", graph_ref=None, fingerprint="f",
                    input_json="null", created_at=now,
                )
            )  # fmt: skip
            token = await store.acquire_lease("f1", "test:1:0:abcd", 60)
            events = [
                EventRow(1, "run_started", None, None, None, now, "{}"),
                EventRow(2, "node_started", "boom", 1, 1, now, "{}"),
                EventRow(3, "node_failed", "boom", 1, 1, now + 0.01, json.dumps(data)),
                EventRow(4, "run_failed", None, None, None, now + 0.01, "{}"),
            ]
            harvest = Harvest(
                state_json="{}", status=RunStatus.FAILED, error="KeyError: 'missing'",
                events=events, finished_at=now + 0.01,
            )  # fmt: skip
            await store.commit("f1", token, harvest)

    asyncio.run(write())


def test_show_prints_the_last_frames_of_a_stored_traceback_as_text(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    failed_run(db, {"error": "KeyError: 'missing'", "traceback": traceback_text(20)})
    shown = invoke("show", "f1", "--db", db)
    clean(shown)
    assert shown.exit_code == 0, shown.output
    out = shown.stdout
    assert "traceback of node boom attempt 1:" in out
    assert "KeyError: 'missing' [bold red]x[/] \\x1b[31mred" in out  # literal, spelled out
    assert "\x1b" not in out
    assert "line 20, in step_19" in out and "line 1, in step_0" not in out
    assert "lines above (--traceback shows all)" in out
    whole = invoke("show", "f1", "--db", db, "--traceback")
    assert whole.exit_code == 0, whole.output
    assert "line 1, in step_0" in whole.stdout and "Traceback (most recent" in whole.stdout
    assert "lines above" not in whole.stdout


def test_show_without_a_stored_traceback_is_unchanged(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    failed_run(db, {"error": "KeyError: 'missing'"})
    shown = invoke("show", "f1", "--db", db)
    assert shown.exit_code == 0, shown.output
    assert "traceback" not in shown.stdout.lower()
    assert invoke("show", "f1", "--db", db, "--traceback").stdout == shown.stdout
