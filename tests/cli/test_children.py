"""Child runs at the command line: ``tailrace runs --parent``, the parent column, ``show`` (R1).

Runs are made by the real engine on real SQLite files: a parent with an
inline child and a map of a graph (one child per item) through ``tailrace
run``; a parent on a queue whose child waits on another queue through
``Engine.submit`` and a :class:`~tailrace.Worker` that serves the parent's
queue only, so the parent suspends and its child stays queued.
"""

from __future__ import annotations

import asyncio
import textwrap
from collections.abc import Mapping
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

import tailrace as tr
from tailrace.cli._app import app
from tailrace.stores import RunStatus, SQLiteStore
from tests import fixtures

BASE_ENV: dict[str, str | None] = {
    "COLUMNS": "250",
    "TAILRACE_DB": None,
    "TAILRACE_LEASE_TTL": None,
}

PARENT = """
import tailrace as tr

inner = tr.Graph("inner")

@inner.task()
async def step(x):
    return f"did {x}"

graph = tr.Graph("outer")

@graph.task()
async def plan(x):
    return [10, 20, 30]

graph.add_node("sub", inner)
graph.add_node("each", inner, kind="map")
graph.add_edge("plan", "sub")
graph.add_edge("plan", "each")
"""


def invoke(*args: object, env: Mapping[str, str | None] | None = None) -> Result:
    return CliRunner().invoke(app, [str(a) for a in args], env={**BASE_ENV, **(env or {})})


def table_rows(text: str) -> dict[str, list[str]]:
    """Rows of the rich tables in ``text`` keyed by their first cell."""
    rows: dict[str, list[str]] = {}
    for line in text.splitlines():
        for bar in "│┃":
            if line.startswith(bar):
                cells = [c.strip() for c in line.strip().strip(bar).split(bar)]
                rows[cells[0]] = cells
    return rows


def clean(result: Result) -> None:
    """Nothing went wrong in rich: no markup error, no traceback."""
    assert "MarkupError" not in result.output and "Traceback" not in result.output, result.output


@pytest.fixture(autouse=True)
def _in_tmp(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)


def run_parent(tmp_path: Path, run_id: str) -> Path:
    """``tailrace run`` of the outer graph (an inline child, a map of 3 children) as ``run_id``."""
    source = tmp_path / "parent_graphs.py"
    source.write_text(textwrap.dedent(PARENT))
    db = tmp_path / "t.db"
    ran = invoke("run", f"{source}:graph", "--db", db, "--run-id", run_id, "--input", '"go"')
    assert ran.exit_code == 0, ran.output
    return db


def test_runs_names_each_childs_parent_and_parent_lists_only_its_children(tmp_path: Path) -> None:
    db = run_parent(tmp_path, "p1")
    other = invoke("run", f"{tmp_path / 'parent_graphs.py'}:graph", "--db", db, "--run-id", "p2")
    assert other.exit_code == 0, other.output
    listed = invoke("runs", "--db", db)
    rows = table_rows(listed.stdout)
    assert rows["run"][-1] == "parent"
    assert rows["p1/sub/1"][-1] == "p1" and rows["p2/each/1/2"][-1] == "p2"
    assert rows["p1"][-1] == ""  # a top-level run has no parent
    assert len([r for r in rows if r != "run"]) == 10

    children = table_rows(invoke("runs", "--db", db, "--parent", "p1").stdout)
    assert sorted(r for r in children if r != "run") == [
        "p1/each/1/0", "p1/each/1/1", "p1/each/1/2", "p1/sub/1",
    ]  # fmt: skip
    assert all(children[r][2] == "completed" for r in children if r != "run")
    assert list(table_rows(invoke("runs", "--db", db, "--parent", "p1/sub/1").stdout)) == ["run"]


def test_runs_without_children_has_no_parent_column(tmp_path: Path) -> None:
    source = tmp_path / "plain.py"
    source.write_text(
        "import tailrace as tr\ngraph = tr.Graph('plain')\ngraph.add_node('a', str)\n"
    )
    db = tmp_path / "t.db"
    assert invoke("run", f"{source}:graph", "--db", db, "--run-id", "solo").exit_code == 0
    assert "parent" not in table_rows(invoke("runs", "--db", db).stdout)["run"]


def test_show_lists_children_with_node_item_and_status_and_a_child_names_its_parent(
    tmp_path: Path,
) -> None:
    db = run_parent(tmp_path, "p1")
    shown = invoke("show", "p1", "--db", db)
    assert shown.exit_code == 0, shown.output
    assert "child runs (4)" in shown.stdout
    rows = table_rows(shown.stdout)
    assert rows["child run"] == ["child run", "node", "visit", "item", "graph", "queue", "status"]
    assert rows["p1/sub/1"] == ["p1/sub/1", "sub", "1", "", "inner", "", "completed"]
    for item in range(3):
        assert rows[f"p1/each/1/{item}"] == [
            f"p1/each/1/{item}", "each", "1", str(item), "inner", "", "completed",
        ]  # fmt: skip

    child = invoke("show", "p1/each/1/2", "--db", db)
    assert child.exit_code == 0, child.output
    assert "child run of run p1 at node each visit 1 item 2" in child.stdout
    assert "child runs (" not in child.stdout  # it has none of its own
    assert "child run of" not in shown.stdout  # the parent is no child


def test_hostile_parent_and_child_ids_are_shown_literally(tmp_path: Path) -> None:
    hostile = "[/x][red]p\x1b[31m"
    db = run_parent(tmp_path, hostile)
    spelled = "[/x][red]p\\x1b[31m"
    for result in (
        invoke("runs", "--db", db),
        invoke("runs", "--db", db, "--parent", hostile),
        invoke("show", hostile, "--db", db),
        invoke("show", f"{hostile}/each/1/0", "--db", db),
    ):
        clean(result)
        assert result.exit_code == 0, result.output
        assert "\x1b" not in result.output
        assert spelled in result.output
    rows = table_rows(invoke("show", hostile, "--db", db).stdout)
    assert rows[f"{spelled}/each/1/1"][1:4] == ["each", "1", "1"]
    child = invoke("show", f"{hostile}/sub/1", "--db", db)
    assert f"child run of run {spelled} at node sub visit 1" in child.stdout


# -- a suspended parent whose child waits in a queue ------------------------------------------

inner = tr.Graph("fleet_inner")


@inner.task()
async def work(x: object) -> str:
    return f"worked {x}"


fleet_parent = tr.Graph("fleet_outer")
fleet_parent.add_node("delegate", inner, queue="kids")


async def suspend_on_a_queued_child(db: Path, run_id: str) -> None:
    """Submit the parent to ``parents``; a worker serving only ``parents`` runs it to suspension."""
    async with SQLiteStore(db) as store:
        await tr.Engine(store=store).submit(fleet_parent, "job", run_id=run_id, queue="parents")
        worker = tr.Worker(store, queues=["parents"], graphs=[fleet_parent], poll_interval=0.05)
        stop = asyncio.Event()
        task = asyncio.create_task(worker.run(stop))
        try:

            async def suspended() -> bool:
                return (await store.get_run(run_id)).status is RunStatus.SUSPENDED

            await fixtures.until(suspended, "the parent suspends on its queued child")
        finally:
            stop.set()
            await task


def test_show_lists_a_queued_child_of_a_suspended_parent_with_its_queue(tmp_path: Path) -> None:
    db = tmp_path / "fleet.db"
    asyncio.run(suspend_on_a_queued_child(db, "boss"))
    shown = invoke("show", "boss", "--db", db)
    assert shown.exit_code == 0, shown.output
    assert "status suspended" in shown.stdout
    rows = table_rows(shown.stdout)
    assert rows["boss/delegate/1"] == [
        "boss/delegate/1", "delegate", "1", "", "fleet_inner", "kids", "queued",
    ]  # fmt: skip
    listed = table_rows(invoke("runs", "--db", db, "--parent", "boss").stdout)
    assert listed["boss/delegate/1"][2] == "queued"
    assert listed["boss/delegate/1"][-1] == "boss"


def test_show_lists_the_first_children_and_says_how_to_list_them_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("tailrace.cli._children.SHOWN_CHILDREN", 2)
    db = run_parent(tmp_path, "p1")
    shown = invoke("show", "p1", "--db", db)
    rows = table_rows(shown.stdout)
    assert "p1/each/1/0" in rows and "p1/each/1/1" in rows and "p1/sub/1" not in rows
    assert f"... and 2 more child runs: tailrace runs --parent p1 --limit 4 --db {db}" in (
        " ".join(shown.stdout.split())
    )


def test_questions_of_a_run_include_its_childrens(tmp_path: Path) -> None:
    """R5: ``tailrace questions --run PARENT`` lists the questions its child runs ask."""
    asks = tr.Graph("asks_cli")

    @asks.gate()
    async def approve(x: int) -> str:
        return f"approve {x}?"

    parent = tr.Graph("parent_cli")
    parent.add_node("sub", asks)
    db = tmp_path / "q.db"

    async def make() -> None:
        async with SQLiteStore(str(db)) as store:
            result = await tr.Engine(store=store).run(parent, 5, run_id="par")
            assert result.status is RunStatus.SUSPENDED

    asyncio.run(make())
    listed = invoke("questions", "--db", db, "--run", "par", "--open")
    clean(listed)
    assert listed.exit_code == 0, listed.output
    assert "par/sub/1" in listed.stdout and "approve" in listed.stdout
    assert invoke("questions", "--db", db, "--run", "par/sub/1").stdout.count("approve") >= 1


def test_questions_of_a_run_include_those_of_a_child_still_running(tmp_path: Path) -> None:
    """R5: a child that asks while another of its nodes still runs is running, not
    suspended; its open question is listed for its parent all the same."""
    release = asyncio.Event()
    asks = tr.Graph("asks_running_cli")

    @asks.gate()
    async def approve(x: int) -> str:
        return f"approve {x}?"

    @asks.task()
    async def slow(x: int) -> int:
        await release.wait()
        return x

    parent = tr.Graph("parent_running_cli")
    parent.add_node("sub", asks)
    db = tmp_path / "q.db"

    async def scenario() -> tuple[Result, RunStatus]:
        async with SQLiteStore(str(db)) as store:
            engine = tr.Engine(store=store)
            run = asyncio.create_task(engine.run(parent, 5, run_id="par"))

            async def asked() -> bool:
                return bool(await store.list_questions(run_id="par/sub/1"))

            await fixtures.until(asked, "the child to ask")
            child = (await store.get_run("par/sub/1")).status
            listed = await asyncio.to_thread(
                invoke, "questions", "--db", db, "--run", "par", "--open"
            )
            release.set()
            result = await asyncio.wait_for(run, fixtures.HANG_GUARD)
            assert result.status is RunStatus.SUSPENDED  # now the gate alone is left
            return listed, child

    listed, child = asyncio.run(scenario())
    assert child is RunStatus.RUNNING
    clean(listed)
    assert listed.exit_code == 0, listed.output
    assert "par/sub/1" in listed.stdout and "approve 5?" in listed.stdout
