"""The fleet commands: submit, worker (serve), cancel, queues, and runs --queue/--status (issue 10).

In process with typer's ``CliRunner`` where nothing has to keep running; a
worker that must serve meanwhile is a real ``tailrace worker`` subprocess.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import textwrap
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from tailrace.cli._app import app
from tailrace.stores import Queue, ScheduleRow, SQLiteStore
from tests import fixtures

GRAPHS = Path(__file__).with_name("fleet_graphs.py")
fleet = fixtures.load_module(
    "tailrace_bench_fleet", Path(__file__).resolve().parents[2] / "bench" / "fleet.py"
)
BASE_ENV: dict[str, str | None] = {
    "COLUMNS": "250",
    "TAILRACE_DB": None,
    "TAILRACE_LEASE_TTL": None,
}


def invoke(*args: object, env: Mapping[str, str | None] | None = None) -> Result:
    return CliRunner().invoke(app, [str(a) for a in args], env={**BASE_ENV, **(env or {})})


def flat(text: str) -> str:
    """``text`` without table borders and whitespace (so wrapping does not matter)."""
    for ch in "│╭╮╰╯─┃┏┓┗┛━┡┩╇┳┻╋┣┫┠┨":
        text = text.replace(ch, "")
    return "".join(text.split())


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "fleet.db"


def test_submit_runs_queues_and_cancel(db: Path) -> None:
    first = invoke("submit", f"{GRAPHS}:chain", "--input", "4", "--queue", "q", "--db", db)
    assert first.exit_code == 0, first.output
    run_id = first.stdout.strip().splitlines()[-1]
    again = invoke(
        "submit", f"{GRAPHS}:chain", "-i", "5", "-q", "q", "--db", db, "--dedup-key", "k",
        "--run-id", "keyed",
    )  # fmt: skip
    twin = invoke(
        "submit", f"{GRAPHS}:chain", "-i", "6", "-q", "q", "--db", db, "--dedup-key", "k",
        "--run-id", "twin",
    )  # fmt: skip
    assert "held by live run" in twin.stdout and twin.stdout.strip().endswith("keyed"), twin.output
    listed = invoke("runs", "--db", db, "--queue", "q", "--status", "queued")
    assert listed.exit_code == 0, listed.output
    assert run_id in listed.stdout and "keyed" in listed.stdout and "twin" not in listed.stdout
    assert "queued" in listed.stdout
    assert invoke("runs", "--db", db, "--queue", "other").stdout.count("fleet_chain") == 0
    queues = invoke("queues", "--db", db)
    assert queues.exit_code == 0, queues.output
    assert "q" in queues.stdout and flat(queues.stdout).count("notdeclared") == 1
    cancelled = invoke("cancel", run_id, "--db", db)
    assert cancelled.exit_code == 0 and cancelled.stdout.strip() == f"run {run_id}: cancelled"
    after = invoke("runs", "--db", db, "--status", "cancelled")
    assert run_id in after.stdout and "keyed" not in after.stdout
    assert again.exit_code == 0


def test_submit_refuses_bad_json_and_unknown_graphs(db: Path) -> None:
    bad = invoke("submit", f"{GRAPHS}:chain", "--input", "{nope", "--db", db)
    assert bad.exit_code == 2 and "not JSON" in bad.output
    missing = invoke("submit", f"{GRAPHS}:nothing", "--db", db)
    assert missing.exit_code == 2 and "no attribute 'nothing'" in missing.output


@pytest.fixture
def worker_process(db: Path, tmp_path: Path) -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=fixtures.HANG_GUARD)


def start_worker(
    started: list[subprocess.Popen[str]], db: Path, *extra: object
) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TAILRACE_")}
    proc = subprocess.Popen(
        [*fleet.tailrace_command(), "worker", "--db", str(db), *map(str, extra)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**env, "COLUMNS": "300"},
    )  # fmt: skip
    started.append(proc)
    assert proc.stdout is not None
    banner = proc.stdout.readline()  # printed once the store is open and the queues declared
    assert "serving " in banner, banner + proc.communicate(timeout=fixtures.HANG_GUARD)[1]
    return proc


def test_submit_wait_prints_what_a_worker_computed(
    db: Path, worker_process: list[subprocess.Popen[str]]
) -> None:
    start_worker(worker_process, db, "--queue", "q", "--graphs", GRAPHS)
    result = invoke("submit", f"{GRAPHS}:chain", "-i", "20", "-q", "q", "--db", db, "--wait")
    assert result.exit_code == 0, result.output
    assert "completed" in result.stdout and result.stdout.strip().endswith("42")


def test_a_queue_object_named_on_the_command_line_is_declared(
    db: Path, tmp_path: Path, worker_process: list[subprocess.Popen[str]]
) -> None:
    spec = tmp_path / "queues.py"
    spec.write_text(
        "from tailrace.workers import Queue\n"
        "emails = Queue('emails', concurrency=3, limit=10, period=60.0, order='priority')\n"
    )
    proc = start_worker(worker_process, db, "--queue", f"{spec}:emails", "--queue", "plain")
    assert proc.poll() is None

    async def declared() -> list[Queue]:
        # The banner comes as the worker starts; it declares its queues as it
        # begins serving: poll for the declaration (a hang guard, not a timing).
        async with SQLiteStore(db) as store:
            queues: list[Queue] = await fixtures.until(store.queues, "the worker's queues declared")
            return queues

    assert asyncio.run(declared()) == [
        Queue("emails", concurrency=3, limit=10, period=60.0, order="priority")
    ]
    shown = flat(invoke("queues", "--db", db).stdout)
    assert "concurrency3,10per60s" in shown and "priority" in shown


def test_a_queue_spec_that_is_not_a_queue_is_a_usage_error(db: Path, tmp_path: Path) -> None:
    spec = tmp_path / "notqueue.py"
    spec.write_text("thing = 3\n")
    result = invoke("worker", "--db", db, "--queue", f"{spec}:thing")
    assert result.exit_code == 2 and "is a int, not a tailrace.Queue" in result.output


LANGGRAPH = """
from typing import TypedDict

from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph


class State(TypedDict):
    x: int


def step(state):
    return {"x": state["x"] + 1}


def build():
    builder = StateGraph(State)
    builder.add_node("step", step)
    builder.add_edge(START, "step")
    builder.add_edge("step", END)
    return builder.compile(checkpointer=InMemorySaver())


first = build()
second = build()
"""


def test_langgraph_graphs_with_one_name_are_refused_naming_it(db: Path, tmp_path: Path) -> None:
    source = tmp_path / "lg.py"
    source.write_text(textwrap.dedent(LANGGRAPH))
    result = invoke(
        "worker", "--db", db, "--langgraph", f"{source}:first", "--langgraph", f"{source}:second"
    )
    assert result.exit_code == 2, result.output
    assert "graphsnamedtwice:LangGraph;giveeachitsownNAME=" in flat(result.output)


def test_langgraph_graphs_given_names_are_served(
    db: Path, tmp_path: Path, worker_process: list[subprocess.Popen[str]]
) -> None:
    source = tmp_path / "lg.py"
    source.write_text(textwrap.dedent(LANGGRAPH))
    proc = start_worker(
        worker_process, db, "--langgraph", f"one={source}:first", "--langgraph",
        f"two={source}:second",
    )  # fmt: skip
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=fixtures.HANG_GUARD)
    assert proc.returncode == 0, err
    assert "stopped: WorkerStats(" in out


def test_serve_is_the_worker(db: Path, worker_process: list[subprocess.Popen[str]]) -> None:
    help_text = invoke("serve", "--help").stdout
    assert "--queue" in help_text and "--langgraph" in help_text and "--concurrency" in help_text


def test_queues_pause_resume_and_delete(db: Path) -> None:
    submitted = invoke("submit", f"{GRAPHS}:chain", "-i", "1", "-q", "q", "--db", db)
    assert submitted.exit_code == 0, submitted.output
    run_id = submitted.stdout.strip().splitlines()[-1]
    paused = invoke("queues", "pause", "q", "--db", db)
    assert paused.exit_code == 0 and "queue q paused" in paused.stdout, paused.output
    assert "paused;none" in flat(invoke("queues", "--db", db).stdout)
    refused = invoke("queues", "delete", "q", "--db", db)
    assert refused.exit_code != 0
    assert "'q' still holds 1 live run" in refused.output
    assert "queue q resumed" in invoke("queues", "resume", "q", "--db", db).stdout
    assert "was not paused" in invoke("queues", "resume", "q", "--db", db).stdout
    assert invoke("cancel", run_id, "--db", db).exit_code == 0
    assert "queue q deleted" in invoke("queues", "delete", "q", "--db", db).stdout
    assert "nothing to delete" in invoke("queues", "delete", "q", "--db", db).stdout


def test_a_schedule_named_on_the_command_line_is_declared(
    db: Path, tmp_path: Path, worker_process: list[subprocess.Popen[str]]
) -> None:
    spec = tmp_path / "schedules.py"
    spec.write_text(
        "import tailrace as tr\n"
        "report = tr.Graph('report')\n"
        "@report.task()\n"
        "async def count(x: int) -> int:\n"
        "    return x\n"
        "nightly = tr.Schedule(report, '0 3 * * *', 7, name='nightly', queue='q')\n"
    )
    proc = start_worker(worker_process, db, "--schedule", f"{spec}:nightly")
    assert proc.poll() is None

    async def declared() -> list[ScheduleRow]:
        async with SQLiteStore(db) as store:
            rows: list[ScheduleRow] = await fixtures.until(store.schedules, "the schedule")
            return rows

    (row,) = asyncio.run(declared())
    assert (row.name, row.cron, row.queue, row.input_json) == ("nightly", "0 3 * * *", "q", "7")
    bad = invoke("worker", "--db", db, "--schedule", f"{GRAPHS}:chain")
    assert bad.exit_code == 2 and "is a Graph, not a tailrace.Schedule" in bad.output


def test_resume_continues_a_cancelled_run_only_with_cancelled(db: Path) -> None:
    submitted = invoke("submit", f"{GRAPHS}:chain", "-i", "1", "-q", "q", "--db", db)
    run_id = submitted.stdout.strip().splitlines()[-1]
    assert invoke("cancel", run_id, "--db", db).exit_code == 0
    plain = invoke("resume", run_id, "--db", db, "--graphs", GRAPHS)
    assert plain.exit_code != 0 and "is cancelled; nothing to resume" in plain.output
    asked = invoke("resume", run_id, "--db", db, "--graphs", GRAPHS, "--cancelled")
    assert asked.exit_code != 0 and "cancelled before it started" in asked.output


def test_submit_by_a_registered_graph_name(
    db: Path, worker_process: list[subprocess.Popen[str]]
) -> None:
    unknown = invoke("submit", "fleet_chain", "--db", db)
    assert unknown.exit_code != 0 and "no worker registered a graph named" in unknown.output
    start_worker(worker_process, db, "--queue", "q", "--graphs", GRAPHS)

    async def registered() -> object:
        async with SQLiteStore(db) as store:
            return await fixtures.until(lambda: store.graphs_named("fleet_chain"), "registered")

    asyncio.run(registered())
    result = invoke("submit", "fleet_chain", "-i", "20", "-q", "q", "--db", db, "--wait")
    assert result.exit_code == 0, result.output
    assert "completed" in result.stdout
    # The output, or, with no graph that says which node it is, every node's result.
    assert result.stdout.strip().endswith("42") or '"doubled": 42' in result.stdout


def test_submit_stores_a_deadline_from_now(db: Path) -> None:
    before = time.time()
    out = invoke("submit", f"{GRAPHS}:chain", "-i", "1", "--db", db, "--deadline", 600)
    assert out.exit_code == 0, out.output
    run_id = out.stdout.strip().splitlines()[-1]

    async def read() -> float | None:
        async with SQLiteStore(str(db)) as store:
            return (await store.get_run(run_id)).deadline

    deadline = asyncio.run(read())
    assert deadline is not None and before + 600 <= deadline <= before + 660
    refused = invoke("submit", f"{GRAPHS}:chain", "--db", db, "--deadline", -1)
    assert refused.exit_code != 0
