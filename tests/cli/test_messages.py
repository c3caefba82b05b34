"""What the commands say when nothing happens, or something other than asked: paused and
unknown queues, runs that wait, references of file graphs, deadlines, forks, help texts.

In process with typer's ``CliRunner`` where a command ends by itself; a worker, and a
``tailrace tail`` that follows a run, are real subprocesses.
"""

from __future__ import annotations

import asyncio
import datetime
import os
import re
import selectors
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

import tailrace as tr
from tailrace.cli._app import app
from tailrace.stores import RunRecord, SQLiteStore
from tests import fixtures
from tests.cli.test_first_day import GATED, flat, invoke, read_questions, says
from tests.workers.test_cli import fleet, start_worker

FLEET_GRAPHS = Path(__file__).resolve().parents[1] / "workers" / "fleet_graphs.py"

KIDS = """
import tailrace as tr

kid = tr.Graph("kid")

@kid.task()
async def k(x):
    return x + 1

parent = tr.Graph("parent")
parent.add_node("child", kid, queue="kids")
"""


@pytest.fixture(autouse=True)
def _in_tmp(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TAILRACE_DB", raising=False)
    monkeypatch.delenv("TAILRACE_LEASE_TTL", raising=False)


def record(db: Path, run_id: str) -> RunRecord:
    async def read() -> RunRecord:
        async with SQLiteStore(db) as store:
            return await store.get_run(run_id)

    return asyncio.run(read())


# -- queues: paused, unknown -----------------------------------------------------------------


def test_a_submit_to_a_paused_queue_says_no_worker_starts_it(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    first = invoke("submit", f"{FLEET_GRAPHS}:chain", "-i", 1, "-q", "q", "--db", db)
    assert first.exit_code == 0, first.output
    assert "paused" not in first.output
    assert invoke("queues", "pause", "q", "--db", db).exit_code == 0
    held = invoke(
        "submit", f"{FLEET_GRAPHS}:chain", "-i", 2, "-q", "q", "--db", db, "--run-id", "h"
    )
    assert held.exit_code == 0, held.output
    assert says(held, "queue q is paused: no worker starts run h until it is resumed")
    assert says(held, "(tailrace queues resume q)")
    assert held.stdout.strip().splitlines()[-1] == "h"  # the id stays the last line of stdout


@pytest.mark.parametrize("verb", ["pause", "resume", "delete"])
def test_an_unknown_queue_is_refused_listing_the_known_ones(verb: str, tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    assert invoke("submit", f"{FLEET_GRAPHS}:chain", "-q", "emails", "--db", db).exit_code == 0
    refused = invoke("queues", verb, "emials", "--db", db)
    assert refused.exit_code == 1, refused.output
    assert says(refused, "no queue named 'emials'")
    assert says(refused, "the queues are: default, emails. Nothing was changed.")
    listed = invoke("queues", "--db", db)
    assert "emials" not in listed.output  # no row was written for it
    assert invoke("queues", "pause", "default", "--db", db).exit_code == 0  # always known


# -- tail: a run that waits ------------------------------------------------------------------


def suspended(tmp_path: Path, run_id: str = "g1") -> Path:
    db, gated = tmp_path / "t.db", tmp_path / "gated.py"
    gated.write_text(GATED)
    ran = invoke("run", f"{gated}:graph", "--db", db, "--run-id", run_id, "-i", '"v2"')
    assert ran.exit_code == 0, ran.output
    return db


def test_tail_no_follow_of_a_suspended_run_says_what_it_waits_for(tmp_path: Path) -> None:
    db = suspended(tmp_path)
    [question] = read_questions(db)
    result = invoke("tail", "g1", "--no-follow", "--db", db)
    assert result.exit_code == 0, result.output
    assert says(result, "run g1 is suspended: it waits for an answer at gate approve")
    assert says(result, f"answer with: tailrace answer {question.question_id} VALUE --db {db}")


def test_tail_of_a_queued_run_says_where_it_waits(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    out = invoke("submit", f"{FLEET_GRAPHS}:chain", "-q", "q", "--db", db, "--run-id", "w")
    assert out.exit_code == 0, out.output
    assert invoke("queues", "pause", "q", "--db", db).exit_code == 0
    result = invoke("tail", "w", "--no-follow", "--db", db)
    assert says(result, "run w is queued in queue q: it starts when a worker serving it claims it")
    assert says(result, "the queue is paused (tailrace queues resume q)")


def test_tail_following_a_suspended_run_says_it_waits_then_ends_with_the_run(
    tmp_path: Path,
) -> None:
    """The follower says why the run waits (on stderr), and ends once the answer ends the run."""
    db = suspended(tmp_path)
    [question] = read_questions(db)
    follower = subprocess.Popen(
        [*fleet.tailrace_command(), "tail", "g1", "--db", str(db)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=fixtures_env(),
    )  # fmt: skip
    try:
        said = line_of(follower, guard=fixtures.HANG_GUARD)
        assert "run g1 is suspended: it waits for an answer at gate approve" in said, said
        answered = invoke("answer", question.question_id, '"yes"', "--db", db, "--graphs",
                          f"{tmp_path / 'gated.py'}:graph")  # fmt: skip
        assert answered.exit_code == 0, answered.output
        _, err = follower.communicate(timeout=fixtures.HANG_GUARD)
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.communicate()
    assert follower.returncode == 0, err


def line_of(proc: subprocess.Popen[str], *, guard: float) -> str:
    """The first line ``proc`` writes on stderr; '' if it writes none within ``guard`` seconds."""
    assert proc.stderr is not None
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stderr, selectors.EVENT_READ)
        if not selector.select(timeout=guard):
            return ""
    return proc.stderr.readline()


def fixtures_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TAILRACE_")}
    return {**env, "COLUMNS": "300"}


# -- references of graphs loaded from files ------------------------------------------------


@pytest.fixture
def worker_process(tmp_path: Path) -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.terminate()
        proc.communicate(timeout=fixtures.HANG_GUARD)


def test_runs_of_file_graphs_record_the_file_not_a_module_hash(
    tmp_path: Path, worker_process: list[subprocess.Popen[str]]
) -> None:
    """Runs submitted by name, their worker-driven children and forks name the graph by its
    file and attribute, as ``tailrace run FILE:GRAPH`` does."""
    db, kids = tmp_path / "t.db", tmp_path / "kids.py"
    kids.write_text(KIDS)
    start_worker(worker_process, db, "-q", "default", "-q", "kids", "--graphs", kids)

    async def registered() -> object:
        async with SQLiteStore(db) as store:
            return await fixtures.until(lambda: store.graphs_named("parent"), "registered")

    asyncio.run(registered())
    for name, run_id in (("parent", "p1"), ("kid", "k1")):
        done = invoke("submit", name, "-i", 1, "--run-id", run_id, "--db", db, "--wait")
        assert done.exit_code == 0, done.output
    forked = invoke("fork", "k1", "--at", "k", "--graphs", kids, "--fork-id", "f1", "--db", db)
    assert forked.exit_code == 0, forked.output
    expected = {"p1": "parent", "p1/child/1": "kid", "k1": "kid", "f1": "kid"}
    for run_id, attr in expected.items():
        assert record(db, run_id).graph_ref == f"{kids}:{attr}", run_id
        shown = invoke("show", run_id, "--db", db)
        assert f"graph reference: {kids}:{attr}" in shown.output, shown.output
        assert "tailrace_file_" not in shown.output


def test_a_fork_of_a_file_graph_run_without_its_graph_says_how_to_fork_it(tmp_path: Path) -> None:
    db = suspended(tmp_path)
    refused = invoke("fork", "g1", "--at", "act", "--db", db)
    assert refused.exit_code == 1
    assert says(refused, f"tailrace fork g1 --at act --graphs {tmp_path / 'gated.py'}")
    assert says(refused, "engine.fork(run_id, at='act', graph=graph)")
    assert "tailrace resume" not in refused.output


# -- deadlines ---------------------------------------------------------------------------------


def test_a_run_cancelled_by_its_deadline_shows_the_deadline_as_a_time(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    slow = tr.Graph("slow")

    @slow.task()
    async def wait(x: Any) -> Any:
        await asyncio.sleep(60)
        return x

    async def run() -> float | None:
        async with SQLiteStore(db) as store:
            late = datetime.timedelta(seconds=0.2)
            await tr.Engine(store=store).run(slow, 1, run_id="late", deadline=late)
            return (await store.get_run("late")).deadline

    deadline = asyncio.run(asyncio.wait_for(run(), fixtures.HANG_GUARD))
    assert deadline is not None
    shown = invoke("show", "late", "--db", db)
    at = datetime.datetime.fromtimestamp(deadline, datetime.UTC)
    assert says(shown, f"deadline passed ({at:%Y-%m-%d %H:%M:%S}.{at.microsecond // 1000:03d} UTC)")
    assert f"{deadline:.3f}" not in shown.output


# -- help texts --------------------------------------------------------------------------------


def _commands(command: Any, path: list[str]) -> Iterator[tuple[list[str], Any]]:
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from _commands(sub, [*path, name])


COMMANDS = list(_commands(typer.main.get_command(app), []))


@pytest.mark.parametrize(
    ("path", "command"), COMMANDS, ids=[" ".join(p) or "tailrace" for p, _ in COMMANDS]
)
def test_every_help_text_is_shown_whole(path: list[str], command: Any) -> None:
    """No bracketed word lost to markup, no reStructuredText backticks, no ``--no-no-``."""
    result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    assert "`" not in result.output
    assert "--no-no-" not in result.output
    sources = [command.help or "", *(getattr(p, "help", None) or "" for p in command.params)]
    for bracketed in {b for s in sources for b in re.findall(r"\[[^\]\s]*\]", s)}:
        assert flat(bracketed) in flat(result.output), f"{bracketed} is lost from the help"
