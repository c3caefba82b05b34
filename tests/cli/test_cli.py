"""The ``tailrace`` command: run, runs, show, resume, and their errors.

Most tests drive the typer app in process with ``CliRunner``; the crash test
runs the installed console script in real subprocesses, one of which kills
itself with SIGKILL in the middle of a node.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from tailrace.cli._app import app
from tailrace.cli._timeline import attempt_bars
from tailrace.stores import EventRow, SQLiteStore

ROOT = Path(__file__).resolve().parents[2]
RESEARCH = ROOT / "examples" / "research.py"
SCRIPT = Path(sys.executable).parent / "tailrace"
NODES = ("plan", "search", "papers", "issues", "merge", "write", "review", "publish")
ATTEMPTS = (
    "plan#1",
    "search#1",
    "papers#1",
    "issues#1",
    "merge#1",
    "write#1",
    "review#1",
    "write#2",
    "review#2",
    "publish#1",
)
# A wide terminal keeps rich from wrapping cells and error panels; the
# variables the CLI reads are unset unless a test sets them.
BASE_ENV: dict[str, str | None] = {
    "COLUMNS": "200",
    "TAILRACE_DB": None,
    "TAILRACE_LEASE_TTL": None,
}


def invoke(*args: object, env: Mapping[str, str | None] | None = None) -> Result:
    """Run the app in process with ``args`` (stringified) and a controlled environment."""
    return CliRunner().invoke(app, [str(a) for a in args], env={**BASE_ENV, **(env or {})})


def flat(text: str) -> str:
    """``text`` without rich's box drawing and without any whitespace (wrapping-proof)."""
    for ch in "│╭╮╰╯─┃┏┓┗┛━┡┩╇┳┻╋┣┫┠┨":
        text = text.replace(ch, "")
    return "".join(text.split())


def assert_says(result: Result, message: str) -> None:
    """Whether ``message`` appears in the output, however rich wrapped it."""
    assert flat(message) in flat(result.output), result.output


def table_rows(text: str) -> dict[str, list[str]]:
    """Rows of the rich tables in ``text`` (header included), keyed by their first cell."""
    rows: dict[str, list[str]] = {}
    for line in text.splitlines():
        for bar in "│┃":
            if line.startswith(bar):
                cells = [c.strip() for c in line.strip().strip(bar).split(bar)]
                rows[cells[0]] = cells
    return rows


def output_json(text: str) -> object:
    """The run's output: the JSON document printed after the summary line."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("run ")) + 1
    return json.loads("\n".join(lines[start:]))


@pytest.fixture(scope="module")
def research_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Result]:
    """One durable run of the research example, shared by the read-only tests."""
    db = tmp_path_factory.mktemp("cli") / "t.db"
    result = invoke("run", f"{RESEARCH}:graph", "--input", '"x"', "--db", db, "--run-id", "r1")
    return db, result


@pytest.fixture(autouse=True)
def _no_stray_db(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Tests run in their own directory, so a default ./tailrace.db lands there."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TAILRACE_DB", raising=False)
    monkeypatch.delenv("TAILRACE_LEASE_TTL", raising=False)


# -- run ------------------------------------------------------------------------


def test_run_prints_the_node_table_and_the_output(research_run: tuple[Path, Result]) -> None:
    db, result = research_run
    assert result.exit_code == 0, result.output
    assert db.is_file()
    rows = table_rows(result.stdout)
    assert rows["node"] == ["node", "status", "visits", "attempts", "duration"]
    for node in NODES:
        assert rows[node][1] == "completed"
        assert rows[node][4].endswith(" ms")
    assert rows["write"][2] == "2"  # the review loop sends the draft back once
    assert rows["review"][2] == "2"
    assert rows["merge"][2] == "1"
    assert "run r1 completed in " in result.stdout
    assert "1 late input" in result.stdout  # the third tool, after merge fired
    output = output_json(result.stdout)
    assert isinstance(output, str)
    # search is always first; the second note is whichever tool answered next.
    assert output.startswith("draft 2: search notes on x; ")
    assert output.count("notes on x") == 2


def test_runs_lists_the_run_as_completed(research_run: tuple[Path, Result]) -> None:
    db, _ = research_run
    result = invoke("runs", "--db", db)
    assert result.exit_code == 0, result.output
    rows = table_rows(result.stdout)
    assert rows["run"] == ["run", "graph", "status", "started", "duration", "nodes done"]
    _, graph, status, started, duration, done = rows["r1"]
    assert (graph, status) == ("research", "completed")
    assert started[:2] == "20" and duration.endswith("s")
    assert done == "10"  # completed node visits: write and review ran twice


def test_runs_filters_by_status(research_run: tuple[Path, Result]) -> None:
    db, _ = research_run
    assert "r1" in table_rows(invoke("runs", "--db", db, "--status", "completed").stdout)
    assert "r1" not in table_rows(invoke("runs", "--db", db, "--status", "failed").stdout)


def test_show_prints_nodes_and_a_timeline_with_bars(research_run: tuple[Path, Result]) -> None:
    db, _ = research_run
    result = invoke("show", "r1", "--db", db)
    assert result.exit_code == 0, result.output
    assert "run r1 graph research status completed" in result.stdout
    assert "backups:" not in result.stdout  # it raced none
    rows = table_rows(result.stdout)
    assert rows["node"] == ["node", "status", "visits"]
    assert {node: rows[node][1:] for node in NODES} == {
        node: ["completed", "2" if node in ("write", "review") else "1"] for node in NODES
    }
    bars = {
        line.split()[0]: line for line in result.stdout.splitlines() if "█" in line
    }  # one line per attempt, labelled node#visit
    assert sorted(bars) == sorted(ATTEMPTS)
    for line in bars.values():
        assert line.rstrip().endswith(" ms")
    # The axis under the bars ends with the run's span in seconds.
    assert result.stdout.rstrip().splitlines()[-1].rstrip().endswith("s")


def test_resume_of_a_completed_run_is_a_clear_error(research_run: tuple[Path, Result]) -> None:
    db, _ = research_run
    result = invoke("resume", "r1", "--db", db)
    assert result.exit_code == 1
    assert_says(result, "error: run 'r1' is completed; nothing to resume")


def empty_store(path: Path) -> Path:
    """A store with no runs at ``path`` (read-only commands refuse a missing file)."""

    async def create() -> None:
        async with SQLiteStore(path):
            pass

    asyncio.run(create())
    return path


@pytest.mark.parametrize("command", ["show", "resume"])
def test_an_unknown_run_is_a_clear_error(command: str, tmp_path: Path) -> None:
    result = invoke(command, "nope", "--db", empty_store(tmp_path / "t.db"))
    assert result.exit_code == 1
    assert_says(result, "error: no run 'nope' in the store")


def test_reusing_a_run_id_is_a_clear_error(research_run: tuple[Path, Result]) -> None:
    db, _ = research_run
    result = invoke("run", f"{RESEARCH}:graph", "--db", db, "--run-id", "r1")
    assert result.exit_code == 1
    assert_says(result, "error: run 'r1' already exists")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nocolon", "'nocolon' is not MODULE_OR_FILE:GRAPH"),
        ("missing.py:graph", "cannot load 'missing.py:graph': no such file"),
        ("tailrace_no_such_module:graph", "No module named 'tailrace_no_such_module'"),
        (f"{RESEARCH}:nope", "has no attribute 'nope'"),
        (f"{RESEARCH}:plan", f"'{RESEARCH}:plan' is a function, not a tailrace Graph"),
    ],
    ids=["missing-colon", "missing-file", "missing-module", "missing-attribute", "not-a-graph"],
)
def test_a_bad_graph_spec_names_the_culprit(spec: str, message: str, tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    result = invoke("run", spec, "--db", db)
    assert result.exit_code == 2  # typer.BadParameter: a usage error
    assert_says(result, message)
    assert not db.exists()  # nothing was stored for a run that never started


def test_input_that_is_not_json_is_a_usage_error_naming_input(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    result = invoke("run", f"{RESEARCH}:graph", "--input", "tail latency", "--db", db)
    assert result.exit_code == 2
    assert_says(result, "Invalid value for '--input': not JSON: Expecting value: line 1 column 1")
    assert "run failed" not in result.output  # nothing ran
    assert not db.exists()


def test_show_counts_the_backups_a_run_raced_and_those_its_budget_refused(
    tmp_path: Path,
) -> None:
    # One token in the engine's hedge budget and nothing to refill it: of two stalled
    # nodes, one is backed up (its backup wins), the other's backup is refused (T5).
    import tailrace as tr
    from tailrace.tail import HedgePolicy, TailHooks

    db = tmp_path / "t.db"
    policy = HedgePolicy(budget=0.0, burst=1.0, backup_after=1.0, slack=0.0, tolerance=100.0)
    hooks = TailHooks(hedging=policy)
    for _ in range(3):
        hooks.estimator("stall").observe(1.0, 0.01)

    async def run() -> None:
        hedged = asyncio.Event()

        async def stall(x: str) -> str:
            if not tr.current_node(required=True).backup:
                await hedged.wait()  # the first backup lets every primary go on
            return x

        g = tr.Graph("budgeted")
        g.add_node("src", lambda x: x)
        for name in ("a", "b"):
            g.add_node(name, stall, hedge=True, estimate_key="stall")
            g.add_edge("src", name)
        async with SQLiteStore(db) as store:
            engine = tr.Engine(store=store, tail=hooks)
            engine.bus.subscribe(lambda e: hedged.set(), tr.EventType.NODE_HEDGED)
            await asyncio.wait_for(engine.run(g, "x", run_id="budgeted"), 30)

    asyncio.run(run())
    shown = invoke("show", "budgeted", "--db", db)
    assert shown.exit_code == 0, shown.output
    assert_says(
        shown, "backups: 1 started (1 won), 1 refused by the budget of 0% of attempts started"
    )


def test_a_failing_handler_fails_the_run_and_show_says_why(tmp_path: Path) -> None:
    module = tmp_path / "failing.py"
    module.write_text(
        textwrap.dedent(
            """
            from tailrace import Graph

            graph = Graph("failing")

            @graph.task()
            def boom(x):
                raise RuntimeError(f"kaboom {x}")
            """
        )
    )
    db = tmp_path / "t.db"
    result = invoke("run", f"{module}:graph", "--input", "7", "--db", db, "--run-id", "f1")
    assert result.exit_code == 1
    shown = invoke("show", "f1", "--db", db)
    assert "run f1 graph failing status failed error: RuntimeError: kaboom 7" in shown.stdout
    assert table_rows(shown.stdout)["boom"] == ["boom", "failed", "1"]
    assert "f1" in table_rows(invoke("runs", "--db", db, "--status", "failed").stdout)


# -- where the store is -----------------------------------------------------------


def test_the_default_store_is_tailrace_db_in_the_working_directory(tmp_path: Path) -> None:
    result = invoke("run", f"{RESEARCH}:graph", "--run-id", "d1")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "tailrace.db").is_file()
    assert "d1" in table_rows(invoke("runs").stdout)


def test_tailrace_db_environment_variable_is_honoured(tmp_path: Path) -> None:
    env_db = tmp_path / "env.db"
    env = {"TAILRACE_DB": str(env_db)}
    result = invoke("run", f"{RESEARCH}:graph", "--run-id", "e1", env=env)
    assert result.exit_code == 0, result.output
    assert env_db.is_file()
    assert not (tmp_path / "tailrace.db").exists()
    assert "e1" in table_rows(invoke("runs", env=env).stdout)
    assert "run e1 graph research" in invoke("show", "e1", env=env).stdout
    # --db wins over the environment.
    flag_db = tmp_path / "flag.db"
    result = invoke("run", f"{RESEARCH}:graph", "--run-id", "e2", "--db", flag_db, env=env)
    assert result.exit_code == 0, result.output
    assert "e2" in table_rows(invoke("runs", "--db", flag_db).stdout)
    assert "e2" not in table_rows(invoke("runs", env=env).stdout)


def test_memory_runs_without_creating_a_database(tmp_path: Path) -> None:
    env = {"TAILRACE_DB": str(tmp_path / "env.db")}
    result = invoke("run", f"{RESEARCH}:graph", "--memory", "--input", '"x"', env=env)
    assert result.exit_code == 0, result.output
    assert table_rows(result.stdout)["publish"][1] == "completed"
    assert str(output_json(result.stdout)).startswith("draft 2: search notes on x; ")
    assert list(tmp_path.iterdir()) == []


# -- the lease ttl --------------------------------------------------------------------

LEASE_PROBE = """
import contextlib
import sqlite3
import time

from tailrace import Graph, current_node

graph = Graph("lease_probe")

@graph.task()
def probe(db):
    # Seconds left on this run's lease, read straight from the database.
    ctx = current_node()
    with contextlib.closing(sqlite3.connect(db)) as conn:
        (expires,) = conn.execute(
            "SELECT lease_expires FROM runs WHERE run_id = ?", (ctx.run_id,)
        ).fetchone()
    return expires - time.time()
"""


@pytest.mark.parametrize("how", ["option", "environment"])
def test_lease_ttl_reaches_the_engine(how: str, tmp_path: Path) -> None:
    module = tmp_path / "lease_probe.py"
    module.write_text(LEASE_PROBE)
    db = tmp_path / "t.db"
    args: list[object] = ["run", f"{module}:graph", "--db", db, "--input", json.dumps(str(db))]
    env: dict[str, str | None] = {}
    if how == "option":
        args += ["--lease-ttl", "4"]
    else:
        env["TAILRACE_LEASE_TTL"] = "4"
    result = invoke(*args, env=env)
    assert result.exit_code == 0, result.output
    left = output_json(result.stdout)
    assert isinstance(left, float)
    assert 0 < left <= 4  # the default, 30 s, would leave far more


def test_a_lease_ttl_that_is_not_a_number_is_a_usage_error(tmp_path: Path) -> None:
    result = invoke(
        "run", f"{RESEARCH}:graph", "--db", tmp_path / "t.db", env={"TAILRACE_LEASE_TTL": "soon"}
    )
    assert result.exit_code == 2
    assert_says(result, "TAILRACE_LEASE_TTL")


# -- crash and resume, in real processes ------------------------------------------------

CRASHY = """
import asyncio
import contextlib
import os
import signal
import sqlite3
import time
from pathlib import Path

from tailrace import Graph, current_node

HERE = Path(__file__).parent
graph = Graph("crashy")


def _log(name):
    with open(HERE / f"{name}.log", "a") as f:
        f.write("ran\\n")


def _committed(db, run_id, node_id):
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
        row = conn.execute(
            "SELECT 1 FROM results WHERE run_id = ? AND node_id = ?", (run_id, node_id)
        ).fetchone()
    return row is not None


@graph.task()
def first(x):
    _log("first")
    return x


@graph.task()
async def second(x):
    _log("second")
    marker = HERE / "crashed.marker"
    if not marker.exists():
        marker.write_text("")
        # Wait until first's completion is committed (commits are pipelined),
        # then die the hard way: no finally blocks, no lease release.
        deadline = time.monotonic() + 30
        while not _committed(x["db"], current_node().run_id, "first"):
            assert time.monotonic() < deadline, "first was never committed"
            await asyncio.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)
    return f"second({x['name']})"


graph.add_edge("first", "second")
"""


def tailrace(args: Sequence[object], cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run the installed console script."""
    env = {k: v for k, v in os.environ.items() if k not in ("TAILRACE_DB", "TAILRACE_LEASE_TTL")}
    return subprocess.run(
        [str(SCRIPT), *map(str, args)],
        cwd=cwd,
        env={**env, "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.slow
def test_resume_after_the_process_was_killed(tmp_path: Path) -> None:
    assert SCRIPT.is_file(), f"the console script is not installed at {SCRIPT}"
    module = tmp_path / "crashy.py"
    module.write_text(CRASHY)
    db = tmp_path / "t.db"

    payload = json.dumps({"db": str(db), "name": "x"})
    crashed = tailrace(
        ["run", "crashy.py:graph", "--db", db, "--run-id", "r1", "-i", payload], tmp_path
    )
    assert crashed.returncode == -signal.SIGKILL, crashed.stdout + crashed.stderr
    listed = tailrace(["runs", "--db", db], tmp_path)
    # Its owner is provably gone: orphaned at once, not after the 30 s lease.
    assert table_rows(listed.stdout)["r1"][2] == "running (orphaned)", listed.stdout

    # The store names a graph file: resume does not execute it on the store's word.
    refused = tailrace(["resume", "r1", "--db", db], tmp_path)
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert f"tailrace resume r1 --graphs {module}" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert (tmp_path / "second.log").read_text().count("ran") == 1  # nothing ran

    resumed = tailrace(["resume", "r1", "--db", db, "--graphs", "crashy.py"], tmp_path)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "run r1 completed" in resumed.stdout
    assert output_json(resumed.stdout) == "second(x)"
    # D3: the committed node is reused, the interrupted one runs again.
    assert (tmp_path / "first.log").read_text().count("ran") == 1
    assert (tmp_path / "second.log").read_text().count("ran") == 2

    listed = tailrace(["runs", "--db", db], tmp_path)
    assert table_rows(listed.stdout)["r1"][1:3] == ["crashy", "completed"]
    shown = tailrace(["show", "r1", "--db", db], tmp_path)
    assert "status completed" in shown.stdout
    assert "second#1" in shown.stdout
    again = tailrace(["resume", "r1", "--db", db, "--graphs", "crashy.py"], tmp_path)
    assert again.returncode == 1
    assert "is completed; nothing to resume" in again.stderr


# -- regressions of bugs found while writing these tests ---------------------------


def _event(seq: int, type: str, node: str | None, ts: float) -> EventRow:
    return EventRow(
        seq=seq,
        type=type,
        node_id=node,
        visit=1 if node else None,
        attempt=1 if node else None,
        ts=ts,
        data_json="{}",
    )


def test_timeline_keeps_the_attempt_a_crash_interrupted() -> None:
    events = [
        _event(1, "run_started", None, 0.0),
        _event(2, "node_started", "a", 1.0),  # the process died during this attempt
        _event(3, "run_resumed", None, 5.0),
        _event(4, "node_started", "a", 6.0),
        _event(5, "node_completed", "a", 7.0),
    ]
    bars = attempt_bars(events)
    # Stored before re-runs were numbered on: the re-run still shows as the next try.
    assert [(b.label, b.start) for b in bars] == [("a#1", 1.0), ("a#1 try 2", 6.0)]


def test_runs_with_an_unknown_status_is_a_usage_error(tmp_path: Path) -> None:
    result = invoke("runs", "--db", tmp_path / "t.db", "--status", "bogus")
    assert result.exit_code == 2
    assert_says(result, "bogus")


def test_a_non_positive_lease_ttl_is_a_usage_error(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    result = invoke("run", f"{RESEARCH}:graph", "--db", db, "--lease-ttl", "0")
    assert result.exit_code == 2
    assert_says(result, "--lease-ttl")
    assert not db.exists()


def test_runs_shows_whole_run_ids_in_a_narrow_terminal(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    run_id = "0123456789abcdef0123456789abcdef"  # as long as a generated id
    assert invoke("run", f"{RESEARCH}:graph", "--db", db, "--run-id", run_id).exit_code == 0
    result = invoke("runs", "--db", db, env={"COLUMNS": "80"})
    assert run_id in result.stdout
