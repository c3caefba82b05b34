"""``tailrace ui``: the real console script in a subprocess, on 127.0.0.1 and a free port."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from tailrace.cli._app import app
from tests import fixtures
from tests.ui.support import scenarios

SCRIPT = Path(sys.executable).parent / "tailrace"
DEADLINE = 30.0


def start(*args: str) -> tuple[subprocess.Popen[str], list[str]]:
    """Start ``tailrace ui ARGS``; returns it and the lines it printed up to the address."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "300"}
    env.pop("TAILRACE_UI_TOKEN", None)
    proc = subprocess.Popen(
        [str(SCRIPT), "ui", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        preexec_fn=fixtures.hear_sigint,  # Ctrl-C reaches it wherever the suite runs
    )
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + DEADLINE
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line.rstrip("\n"))
        if line.startswith("open "):
            return proc, lines
    proc.kill()
    proc.wait()
    proc.stdout.close()
    raise AssertionError(f"tailrace ui printed no address: {lines}")


@pytest.fixture
def stopped() -> Iterator[list[subprocess.Popen[str]]]:
    """Processes to stop at the end (SIGKILL if they are still there)."""
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def gated_db(path: Path) -> str:
    async def make() -> str:
        async with scenarios.opened(scenarios.sqlite_factory(path)) as store:
            import tailrace as tr

            result = await tr.Engine(store=store).run(scenarios.approval, "cli", run_id="cli-run")
            return str(result.questions[0].question_id)

    return asyncio.run(make())


@pytest.mark.slow
def test_it_prints_an_address_with_a_token_serves_pages_and_accepts_a_token_change(
    tmp_path: Path, stopped: list[subprocess.Popen[str]]
) -> None:
    db = tmp_path / "runs.db"
    qid = gated_db(db)
    proc, lines = start("--db", str(db), "--port", "0")
    stopped.append(proc)
    address = lines[-1].removeprefix("open ")
    match = re.fullmatch(r"http://127\.0\.0\.1:(\d+)/runs", address)
    assert match, lines  # no token in the address: addresses end up in histories and logs
    said = re.fullmatch(r"token for changes: ([\w-]+) \(log in at (\S+)/login\)", lines[1])
    assert said and said.group(2) == address.removesuffix("/runs"), lines
    token = said.group(1)
    assert lines[0] == f"tailrace ui: {db}"
    with httpx.Client(base_url=f"http://127.0.0.1:{match.group(1)}") as client:
        home = client.get(address)  # on loopback reading needs nothing
        assert home.status_code == 200 and "cli-run" in home.text
        refused = client.post(f"/answer/{qid}", data={"answer": '"no"', "token": "guess"})
        answered = client.post(f"/answer/{qid}", data={"answer": '"yes"', "token": token})
    assert (refused.status_code, answered.status_code) == (403, 303)
    proc.send_signal(signal.SIGINT)  # Ctrl-C: a graceful stop, then the usual exit code
    assert proc.wait(DEADLINE) == 130
    assert proc.stdout is not None and "stopped" in proc.stdout.read()


@pytest.mark.slow
def test_read_only_prints_no_token_and_refuses_changes(
    tmp_path: Path, stopped: list[subprocess.Popen[str]]
) -> None:
    db = tmp_path / "runs.db"
    qid = gated_db(db)
    proc, lines = start("--db", str(db), "--port", "0", "--read-only", "--token", "fixed-token")
    stopped.append(proc)
    assert "(read-only)" in lines[0]
    url = lines[-1].removeprefix("open ")
    assert "token" not in url
    with httpx.Client() as client:
        page = client.get(url.replace("/runs", "/questions"))
        refused = client.post(
            url.replace("/runs", f"/answer/{qid}"), data={"answer": '"x"', "token": "fixed-token"}
        )
    assert 'class="answer-form"' not in page.text and refused.status_code == 403
    proc.send_signal(signal.SIGTERM)  # uvicorn stops gracefully, then dies of the signal
    assert proc.wait(DEADLINE) == -signal.SIGTERM


def test_beyond_loopback_reading_needs_the_printed_token(
    tmp_path: Path, stopped: list[subprocess.Popen[str]]
) -> None:
    db = tmp_path / "runs.db"
    gated_db(db)
    proc, lines = start("--db", str(db), "--host", "0.0.0.0", "--port", "0")
    stopped.append(proc)
    said = next(line for line in lines if line.startswith("token for reading and changes: "))
    token = said.split(": ", 1)[1].split()[0]
    port = re.search(r":(\d+)/runs$", lines[-1])
    assert port and "token" not in lines[-1], lines
    with httpx.Client(base_url=f"http://127.0.0.1:{port.group(1)}") as client:
        # A claimed loopback Host changes nothing.
        locked = client.get("/runs", headers={"host": "127.0.0.1"})
        client.post("/login", data={"token": token, "next": "/runs"})
        page = client.get("/runs")
    assert locked.status_code == 401 and "cli-run" not in locked.text
    assert page.status_code == 200 and "cli-run" in page.text
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(DEADLINE) == -signal.SIGTERM


def test_a_missing_store_a_memory_store_and_a_busy_port_are_one_line_errors(tmp_path: Path) -> None:
    runner = CliRunner()
    missing = runner.invoke(app, ["ui", "--db", str(tmp_path / "nope.db"), "--read-only"])
    memory = runner.invoke(app, ["ui", "--db", ":memory:"])
    assert (
        missing.exit_code == 1
        and "cannot open store" in missing.output
        and "nope.db" in missing.output
    )
    assert memory.exit_code == 1 and "memory store lives inside one process" in memory.output
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        taken = runner.invoke(app, ["ui", "--db", str(tmp_path / "t.db"), "--port", str(port)])
    assert taken.exit_code == 1 and f"cannot listen on 127.0.0.1:{port}" in taken.output


# -- --langgraph: a LangGraph thread's answers applied by the dashboard's own process ------------

REVIEW_MODULE = """
import sqlite3
import time
from pathlib import Path
from typing import Any, TypedDict

from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.graph import END, START, StateGraph
from langgraph.types import interrupt

HERE = Path(__file__).parent


class State(TypedDict, total=False):
    topic: str
    approved: Any


def log(line: str) -> None:
    with (HERE / "ran.log").open("a") as f:
        f.write(line + "\\n")


def review(state: State) -> State:
    answer = interrupt(f"publish {state['topic']}?")
    log(f"review-after:{answer}")
    for _ in range(1200):  # held until the test releases it (a step a SIGKILL can cut)
        if not (HERE / "hold").exists():
            break
        time.sleep(0.05)
    return {"approved": answer}


def publish(state: State) -> State:
    log("publish")
    return {}


builder = StateGraph(State)
builder.add_node("review", review)
builder.add_node("publish", publish)
builder.add_edge(START, "review")
builder.add_edge("review", "publish")
builder.add_edge("publish", END)
graph = builder.compile(
    checkpointer=SqliteSaver(sqlite3.connect(HERE / "checkpoints.db", check_same_thread=False)),
    name="review",
)
"""


def langgraph_thread_db(tmp_path: Path) -> tuple[Path, Path, str]:
    """A thread of ``review`` (the module above, on a checkpoint file) waiting on its interrupt."""
    pytest.importorskip("langgraph")
    from tailrace.graph import load_file_module
    from tailrace.integrations.langgraph import LangGraphDriver  # the langgraph extra

    module = tmp_path / "review.py"
    module.write_text(REVIEW_MODULE)
    graph = load_file_module(str(module)).graph
    db = tmp_path / "runs.db"

    async def start() -> str:
        async with scenarios.opened(scenarios.sqlite_factory(db)) as store:
            [question] = await LangGraphDriver(graph, store, name="review").start(
                "thread-1", {"topic": "tides"}
            )
            return question.question_id

    return db, module, asyncio.run(start())


def thread_state(db: Path) -> tuple[Any, Any, float | None]:
    async def read() -> tuple[Any, Any, float | None]:
        async with scenarios.opened(scenarios.sqlite_factory(db)) as store:
            run = await store.get_run("thread-1")
            [question] = await store.list_questions(run_id="thread-1")
            return run.status.value, question.status.value, run.lease_expires

    return asyncio.run(read())


def until(check: Any, what: str) -> None:
    """Poll the observed state until ``check()`` holds (a hang guard, not a timing assertion)."""
    deadline = time.monotonic() + DEADLINE
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_ui_langgraph_names_twice_are_refused_in_one_line(tmp_path: Path) -> None:
    db, module, _ = langgraph_thread_db(tmp_path)
    spec = f"review={module}:graph"
    result = CliRunner().invoke(
        app, ["ui", "--db", str(db), "--port", "0", "--langgraph", spec, "--langgraph", spec]
    )
    assert result.exit_code == 2 and "graphs named twice: review" in result.output, result.output


@pytest.mark.slow
def test_ui_langgraph_applies_answers_and_a_sigkilled_dashboard_s_thread_is_taken_over_once(
    tmp_path: Path, stopped: list[subprocess.Popen[str]]
) -> None:
    """The dashboard's process is SIGKILLed inside the resumed step; a second dashboard takes
    the thread over: the answer is applied (never superseded), the step after it runs once."""
    db, module, qid = langgraph_thread_db(tmp_path)
    (tmp_path / "hold").touch()
    args = ("--db", str(db), "--port", "0", "--token", "t0ken", "--lease-ttl", "1")
    args += ("--langgraph", f"review={module}:graph")
    first, lines = start(*args)
    stopped.append(first)
    with httpx.Client(base_url=lines[-1].removeprefix("open ").removesuffix("/runs")) as client:
        answered = client.post(f"/answer/{qid}", data={"answer": '"yes"', "token": "t0ken"})
    assert answered.status_code == 303
    ran = tmp_path / "ran.log"
    until(lambda: ran.exists() and "review-after:yes" in ran.read_text(), "the step never ran")
    first.kill()  # inside the resumed step: LangGraph committed nothing of it
    first.wait(DEADLINE)
    assert thread_state(db)[:2] == ("running", "answered")
    (tmp_path / "hold").unlink()
    until(lambda: (thread_state(db)[2] or 0) < time.time(), "the dead dashboard's lease")
    second, lines = start(*args)
    stopped.append(second)
    with httpx.Client(base_url=lines[-1].removeprefix("open ").removesuffix("/runs")) as client:
        orphan = client.get("/runs/thread-1").text
        resumed = client.post("/resume/runs/thread-1", data={"token": "t0ken"})
        assert resumed.status_code == 303
        until(lambda: thread_state(db)[:2] == ("completed", "applied"), "the takeover")
        page = client.get("/runs/thread-1").text
    assert "Resume here" in orphan
    assert ran.read_text().splitlines().count("publish") == 1  # a committed step never re-runs
    assert 'class="pill q-pill-applied">applied</span>' in page
    second.send_signal(signal.SIGTERM)
    assert second.wait(DEADLINE) == -signal.SIGTERM
