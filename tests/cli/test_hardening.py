"""The command line under hostile text, bad input, dead owners and Ctrl-C (issue 9).

Findings covered here: 1 (stored text printed as markup), 5 (stuck answers in
``questions``), 6 (``--graphs``; stored graph files are never executed), 8
(``answer`` takes JSON), 10 (orphaned runs, Ctrl-C), 11 (messages).
In-process tests use typer's ``CliRunner``; Ctrl-C, serve and the trust
checks run the installed console script in real subprocesses.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shlex
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from tailrace.cli._app import app
from tailrace.core._lease import make_owner
from tailrace.stores import NewRun, QuestionRow, QuestionStatus, SQLiteStore
from tests import fixtures

ROOT = Path(__file__).resolve().parents[2]
RESEARCH = ROOT / "examples" / "research.py"
SCRIPT = Path(sys.executable).parent / "tailrace"
WAIT = 30.0
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
    return f"[INST] approve {x}? [/INST]"

@graph.task()
def act(answer):
    return {"answer": answer}

graph.chain("plan", "approve", "act")
"""

FAILING = """
from tailrace import Graph

graph = Graph("failing")

@graph.task()
def boom(x):
    raise RuntimeError("cannot read [/etc/app.conf]: [red]denied[/red]")
"""


@pytest.fixture(autouse=True)
def _in_tmp(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TAILRACE_DB", raising=False)
    monkeypatch.delenv("TAILRACE_LEASE_TTL", raising=False)


def invoke(*args: object, env: Mapping[str, str | None] | None = None) -> Result:
    """Run the app in process with ``args`` (stringified) and a controlled environment."""
    return CliRunner().invoke(app, [str(a) for a in args], env={**BASE_ENV, **(env or {})})


def flat(text: str) -> str:
    """``text`` without rich's box drawing and without any whitespace (wrapping-proof)."""
    for ch in "│╭╮╰╯─┃┏┓┗┛━┡┩╇┳┻╋┣┫┠┨":
        text = text.replace(ch, "")
    return "".join(text.split())


def says(result: Result, message: str) -> bool:
    return flat(message) in flat(result.output)


def clean(result: Result) -> None:
    """No traceback, no exception other than the exit typer raises."""
    assert "Traceback" not in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception


def module(tmp_path: Path, name: str, source: str) -> Path:
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    return path


def read_questions(db: Path) -> list[QuestionRow]:
    async def read() -> list[QuestionRow]:
        async with SQLiteStore(db) as store:
            return await store.list_questions()

    return asyncio.run(read())


def suspended_run(tmp_path: Path, run_id: str = "g1") -> tuple[Path, QuestionRow]:
    """A run of GATED waiting at its gate; returns the database and the question."""
    db = tmp_path / "t.db"
    gated = module(tmp_path, "gated", GATED)
    ran = invoke("run", f"{gated}:graph", "--db", db, "--run-id", run_id, "-i", '"v2"')
    assert ran.exit_code == 0, ran.output
    [question] = read_questions(db)
    return db, question


# -- finding 1: stored text is shown literally, in every command --------------------------


def test_a_gate_prompt_with_inst_tags_is_shown_by_run_questions_and_answer(
    tmp_path: Path,
) -> None:
    db = tmp_path / "t.db"
    gated = module(tmp_path, "gated", GATED)
    ran = invoke("run", f"{gated}:graph", "--db", db, "--run-id", "g1", "-i", '"[red]v2"')
    clean(ran)
    assert ran.exit_code == 0, ran.output
    prompt = '"[INST] approve [red]v2? [/INST]"'  # the prompt is shown as its JSON
    assert says(ran, prompt)
    listed = invoke("questions", "--db", db)
    clean(listed)
    assert says(listed, prompt)
    [question] = read_questions(db)
    value = '"[bold]yes[/bold] [/INST]"'
    answered = invoke("answer", question.question_id, value, "--db", db, "--graphs", gated)
    clean(answered)
    assert answered.exit_code == 0, answered.output
    assert '"answer": "[bold]yes[/bold] [/INST]"' in answered.stdout  # the run's output
    assert says(invoke("questions", "--db", db), '"[bold]yes[/bold] [/INST]"')


def test_a_run_id_like_a_closing_tag_is_shown_by_run_runs_show_and_resume(
    tmp_path: Path,
) -> None:
    db = tmp_path / "t.db"
    ran = invoke("run", f"{RESEARCH}:graph", "--db", db, "--run-id", "[/x]")
    clean(ran)
    assert ran.exit_code == 0, ran.output
    assert "run [/x] completed in " in ran.stdout
    listed = invoke("runs", "--db", db)
    clean(listed)
    assert "│ [/x] " in listed.stdout
    shown = invoke("show", "[/x]", "--db", db)
    clean(shown)
    assert "run [/x] graph research status completed" in shown.stdout
    resumed = invoke("resume", "[/x]", "--db", db)
    clean(resumed)
    assert resumed.exit_code == 1
    assert says(resumed, "error: run '[/x]' is completed; nothing to resume")


def test_a_handler_error_with_brackets_is_shown_by_run_and_show(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    failing = module(tmp_path, "failing", FAILING)
    ran = invoke("run", f"{failing}:graph", "--db", db, "--run-id", "f1")
    clean(ran)
    assert ran.exit_code == 1
    error = "RuntimeError: cannot read [/etc/app.conf]: [red]denied[/red]"
    assert says(ran, f"error: run 'f1' failed: node 'boom' raised {error}")
    shown = invoke("show", "f1", "--db", db)
    clean(shown)
    assert f"run f1 graph failing status failed error: {error}" in shown.stdout


def test_the_missing_driver_hint_keeps_its_postgres_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # As if psycopg were not installed: importing the Postgres store fails.
    monkeypatch.setitem(sys.modules, "tailrace.stores.postgres", None)
    result = invoke("runs", "--db", "postgresql://alice:s3cret@localhost/x")
    clean(result)
    assert result.exit_code == 1
    assert says(result, "error: cannot open store postgresql://alice:***@localhost/x:")
    assert says(result, "pip install 'tailrace[postgres]'")
    assert "s3cret" not in result.output  # a password is never echoed


def test_terminal_escapes_in_stored_text_are_spelled_out(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    run_id = "r\x1b[31mred\u202etxt"
    ran = invoke("run", f"{RESEARCH}:graph", "--db", db, "--run-id", run_id)
    assert ran.exit_code == 0, ran.output
    for result in (ran, invoke("runs", "--db", db), invoke("show", run_id, "--db", db)):
        clean(result)
        assert "\x1b" not in result.output and "\u202e" not in result.output
        assert "r\\x1b[31mred\\u202etxt" in result.output


# -- finding 8: answers are JSON ---------------------------------------------------------


@pytest.mark.parametrize("value", ['{"a":', "yes", "'single'", ""])
def test_answer_refuses_malformed_json_and_records_nothing(value: str, tmp_path: Path) -> None:
    db, question = suspended_run(tmp_path)
    result = invoke("answer", question.question_id, value, "--db", db)
    clean(result)
    assert result.exit_code == 2
    assert says(result, "Invalid value for VALUE: not JSON:")
    [row] = read_questions(db)
    assert row.status is QuestionStatus.OPEN and row.answer_json is None


def test_answer_raw_takes_the_value_as_a_plain_string(tmp_path: Path) -> None:
    db, question = suspended_run(tmp_path)
    graphs = ("--graphs", tmp_path / "gated.py")
    result = invoke("answer", question.question_id, '{"a":', "--raw", "--db", db, *graphs)
    assert result.exit_code == 0, result.output
    [row] = read_questions(db)
    assert row.status is QuestionStatus.APPLIED
    assert json.loads(row.answer_json or "null") == '{"a":'
    assert '"answer": "{\\"a\\":"' in result.stdout


def test_answer_json_keeps_its_type(tmp_path: Path) -> None:
    db, question = suspended_run(tmp_path)
    value, graphs = '{"ok": true, "n": 2}', ("--graphs", tmp_path / "gated.py")
    result = invoke("answer", question.question_id, value, "--db", db, *graphs)
    assert result.exit_code == 0, result.output
    [row] = read_questions(db)
    assert json.loads(row.answer_json or "null") == {"ok": True, "n": 2}


# -- finding 5: stuck answers --------------------------------------------------------------


def test_questions_shows_an_answer_serve_could_not_apply_as_stuck(tmp_path: Path) -> None:
    db, question = suspended_run(tmp_path)
    recorded = invoke("answer", question.question_id, '"yes"', "--no-resume", "--db", db)
    assert recorded.exit_code == 0, recorded.output
    reason = "GraphError: run 'g1': cannot import its graph [/srv/graphs.py]"

    async def defer() -> None:
        async with SQLiteStore(db) as store:
            await store.defer_answer(question.question_id, error=reason, retry_at=time.time() + 60)

    asyncio.run(defer())
    listed = invoke("questions", "--db", db)
    clean(listed)
    assert says(listed, f"stuck (answered, 1 attempt): {reason}")
    assert not says(invoke("questions", "--open", "--db", db), question.question_id)


# -- finding 10: orphaned runs, Ctrl-C ------------------------------------------------------


def dead_owner() -> str:
    """The owner name of a process that has exited: provably dead."""
    return subprocess.run(
        [sys.executable, "-c", "from tailrace.core._lease import make_owner; print(make_owner())"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


async def _lease_states(db: Path, dead: str) -> None:
    """Four running runs: held by a live owner, expired, released, owned by a dead process."""
    past = SQLiteStore(db, clock=lambda: 1000.0)  # leases taken "long ago" expired long ago
    async with SQLiteStore(db) as store, past:
        for run_id in ("live", "expired", "released", "dead"):
            await store.create_run(
                NewRun(
                    run_id=run_id,
                    graph_name="g",
                    graph_ref=None,
                    fingerprint="f",
                    input_json="null",
                    created_at=time.time(),
                )
            )
        await store.acquire_lease("live", make_owner(), 600)
        await past.acquire_lease("expired", "elsewhere:1:0:abcd", 30)
        token = await store.acquire_lease("released", "elsewhere:1:0:abcd", 600)
        await store.release_lease("released", "elsewhere:1:0:abcd", token)
        await store.acquire_lease("dead", dead, 600)


def test_runs_shows_runs_no_live_engine_holds_as_orphaned(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    asyncio.run(_lease_states(db, dead_owner()))
    listed = invoke("runs", "--db", db)
    assert listed.exit_code == 0, listed.output
    statuses = {
        cells[0]: cells[2]
        for line in listed.stdout.splitlines()
        if line.startswith("│")
        for cells in [[c.strip() for c in line.strip("│").split("│")]]
    }
    assert statuses == {
        "live": "running",
        "expired": "running (orphaned)",
        "released": "running (orphaned)",
        "dead": "running (orphaned)",
    }
    assert "status running (orphaned)" in invoke("show", "dead", "--db", db).stdout


BLOCKING = """
import asyncio
from pathlib import Path

from tailrace import Graph

HERE = Path(__file__).parent
graph = Graph("blocking")

@graph.task()
def first(x):
    return x

@graph.task()
async def block(x):
    marker = HERE / "blocked.marker"
    if not marker.exists():
        marker.write_text("")
        await asyncio.Event().wait()  # until Ctrl-C
    return f"done {x}"

graph.add_edge("first", "block")
"""


def _console(*args: object) -> list[str]:
    """The installed console script with ``args``."""
    assert SCRIPT.is_file(), f"the console script is not installed at {SCRIPT}"
    return [str(SCRIPT), *map(str, args)]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TAILRACE_DB", "TAILRACE_LEASE_TTL")}
    return {**env, "COLUMNS": "250"}


def _committed(db: Path, run_id: str, node_id: str) -> bool:
    if not db.exists():
        return False
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
        try:
            row = conn.execute(
                "SELECT 1 FROM results WHERE run_id = ? AND node_id = ?", (run_id, node_id)
            ).fetchone()
        except sqlite3.OperationalError:  # the schema is not there yet
            return False
    return row is not None


def interrupted_run(tmp_path: Path, run_id: str) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """``tailrace run`` of BLOCKING, sent SIGINT once ``first`` is committed."""
    db = tmp_path / "t.db"
    module(tmp_path, "blocking", BLOCKING)
    args = ["run", "blocking.py:graph", "--db", db, "--run-id", run_id, "-i", '"x"']
    with subprocess.Popen(
        _console(*args),
        cwd=tmp_path,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # Ctrl-C as a terminal sends it, even when this suite runs where SIGINT is ignored
        # (a script started with ``&`` or ``nohup``): a child would inherit the ignoring.
        preexec_fn=fixtures.hear_sigint,
    ) as proc:
        try:
            deadline = time.monotonic() + WAIT
            while not _committed(db, run_id, "first"):
                assert proc.poll() is None, proc.communicate()
                assert time.monotonic() < deadline, "the run never committed its first node"
                time.sleep(0.01)  # polling the database, not waiting for a guess
            proc.send_signal(signal.SIGINT)
            stdout, stderr = proc.communicate(timeout=WAIT)
        finally:
            if proc.poll() is None:  # a failure above: not a hang on the way out
                proc.kill()
    return db, subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


@pytest.mark.slow
def test_ctrl_c_on_run_prints_the_run_id_and_the_command_that_resumes_it(
    tmp_path: Path,
) -> None:
    db, done = interrupted_run(tmp_path, "int-1")
    assert done.returncode == 130, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    assert "interrupted: run int-1 stopped" in done.stderr
    [line] = [line for line in done.stderr.splitlines() if line.startswith("resume it with: ")]
    command = line.removeprefix("resume it with: ")
    graph_file = tmp_path / "blocking.py"
    assert command == (
        f"tailrace resume int-1 --db {shlex.quote(str(db))} "
        f"--graphs {shlex.quote(f'{graph_file}:graph')}"
    )
    listed = subprocess.run(
        _console("runs", "--db", db), cwd=tmp_path, env=_env(),
        capture_output=True, text=True, timeout=WAIT,
    )  # fmt: skip
    assert "running (orphaned)" in listed.stdout  # its lease was released on the way out
    words = shlex.split(command)
    resumed = subprocess.run(
        _console(*words[1:]),
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=WAIT,
    )  # fmt: skip  (from another directory: the command is self-contained)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "run int-1 completed" in resumed.stdout
    assert '"done x"' in resumed.stdout


@contextlib.contextmanager
def serving(db: Path, *extra: object, cwd: Path) -> Iterator[subprocess.Popen[str]]:
    """``tailrace serve`` in a subprocess, stopped with SIGTERM on exit."""
    args = ["serve", "--db", db, "--lease-ttl", "1", "--max-interval", "0.1", *extra]
    proc = subprocess.Popen(
        _console(*args), cwd=cwd, env=_env(),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=WAIT)


def _status(db: Path, run_id: str) -> str:
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
        (status,) = conn.execute("SELECT status FROM runs WHERE run_id = ?", (run_id,)).fetchone()
    return str(status)


def test_serve_with_graphs_adopts_an_interrupted_run_of_a_graph_file(tmp_path: Path) -> None:
    db, done = interrupted_run(tmp_path, "int-2")
    assert done.returncode == 130, done.stdout + done.stderr
    with serving(db, "--graphs", tmp_path / "blocking.py", cwd=tmp_path) as proc:
        deadline = time.monotonic() + WAIT
        while _status(db, "int-2") != "completed":
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "serve never adopted the run"
            time.sleep(0.02)


# -- finding 6: stored graph files are never executed --------------------------------------

SIDE_EFFECT = """
from pathlib import Path

from tailrace import Graph

(Path(__file__).parent / "imported.log").open("a").write("imported\\n")
graph = Graph("side_effect")
graph.add_node("only", lambda x: x)
"""


async def _orphan_of(db: Path, graph_ref: str, fingerprint: str) -> None:
    async with SQLiteStore(db) as store:
        await store.create_run(
            NewRun(
                run_id="planted",
                graph_name="side_effect",
                graph_ref=graph_ref,
                fingerprint=fingerprint,
                input_json="1",
                created_at=time.time(),
            )
        )


def test_resume_never_executes_a_graph_file_named_in_the_store(tmp_path: Path) -> None:
    planted = module(tmp_path, "planted", SIDE_EFFECT)
    db = tmp_path / "t.db"
    asyncio.run(_orphan_of(db, f"{planted}:graph", "f" * 16))
    done = subprocess.run(
        _console("resume", "planted", "--db", db), cwd=tmp_path, env=_env(),
        capture_output=True, text=True, timeout=WAIT,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    assert f"tailrace resume planted --graphs {planted}" in done.stderr
    assert not (tmp_path / "imported.log").exists()


def test_graphs_that_do_not_match_the_run_are_named(tmp_path: Path) -> None:
    planted = module(tmp_path, "planted", SIDE_EFFECT)
    other = module(tmp_path, "other", GATED)
    db = tmp_path / "t.db"
    asyncio.run(_orphan_of(db, f"{planted}:graph", "f" * 16))
    result = invoke("resume", "planted", "--db", db, "--graphs", other)
    clean(result)
    assert result.exit_code == 1
    assert says(result, "run 'planted' ran graph 'side_effect'")
    assert says(result, "--graphs named none with that shape or name: 'gated'")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nofile.py", "cannot load 'nofile.py': no such file nofile.py"),
        ("tailrace_no_such_module", "No module named 'tailrace_no_such_module'"),
        ("json", "json defines no tailrace Graph at module level"),
        ("json:dumps", "'json:dumps' is a function, not a tailrace Graph"),
    ],
)
def test_a_bad_graphs_option_is_a_usage_error(spec: str, message: str) -> None:
    result = invoke("resume", "r1", "--graphs", spec)
    clean(result)
    assert result.exit_code == 2
    assert says(result, "Invalid value for --graphs: ") and says(result, message)


# -- finding 11: messages --------------------------------------------------------------------


@pytest.mark.parametrize("command", ["runs", "show", "questions", "resume", "run"])
def test_a_store_that_cannot_be_opened_is_not_a_failed_run(command: str, tmp_path: Path) -> None:
    args = {
        "runs": ["runs"],
        "show": ["show", "r1"],
        "questions": ["questions"],
        "resume": ["resume", "r1"],
        "run": ["run", f"{RESEARCH}:graph"],
    }[command]
    (tmp_path / "a-directory").mkdir()
    result = invoke(*args, "--db", tmp_path / "a-directory")
    clean(result)
    assert result.exit_code == 1
    assert says(result, f"error: cannot open store {tmp_path / 'a-directory'}: ")
    assert "run failed" not in result.output and " failed: " not in result.output


def test_runs_on_a_sqlite_uri_is_a_store_error(tmp_path: Path) -> None:
    result = invoke("runs", "--db", "file:x.db")
    clean(result)
    assert result.exit_code == 1
    assert says(result, "error: cannot open store file:x.db: ")
    assert "run failed" not in result.output


@pytest.mark.parametrize("command", ["runs", "show", "questions"])
def test_reading_a_missing_database_names_it_and_creates_nothing(
    command: str, tmp_path: Path
) -> None:
    db = tmp_path / "typo.db"
    result = invoke(*([command, "r1"] if command == "show" else [command]), "--db", db)
    clean(result)
    assert result.exit_code == 1
    assert says(result, f"error: cannot open store {db}:")
    assert says(result, str(db))
    assert list(tmp_path.iterdir()) == []


def test_serve_with_a_missing_poller_file_is_one_clean_error(tmp_path: Path) -> None:
    result = invoke("serve", "--db", tmp_path / "t.db", "--poller", "ci=missing.py:fn")
    clean(result)
    assert result.exit_code == 2
    assert says(result, "Invalid value for --poller: cannot load 'missing.py:fn': no such file")
    assert not (tmp_path / "t.db").exists()


def test_a_memory_run_whose_handler_fails_prints_one_line(tmp_path: Path) -> None:
    failing = module(tmp_path, "failing", FAILING)
    result = invoke("run", f"{failing}:graph", "--memory", "--run-id", "m1")
    clean(result)
    assert result.exit_code == 1
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        "error: run 'm1' failed: node 'boom' raised RuntimeError: "
        "cannot read [/etc/app.conf]: [red]denied[/red]"
    ]


INVALID_AT_IMPORT = """
from tailrace import Graph

graph = Graph("bad")
graph.add_node("a", lambda x: x)
graph.add_edge("a", "nowhere")
"""

INVALID_WHEN_VALIDATED = """
from tailrace import Graph

graph = Graph("circle")
graph.add_node("a", lambda x: x)
graph.add_node("b", lambda x: x)
graph.add_edge("a", "b")
graph.add_edge("b", "a")
"""


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (INVALID_AT_IMPORT, "raised GraphError: edge 'a' -> 'nowhere': unknown target node"),
        (INVALID_WHEN_VALIDATED, "is not a valid graph:"),
        ("raise RuntimeError('[red]broken[/red]')", "raised RuntimeError: [red]broken[/red]"),
    ],
    ids=["at-import", "when-validated", "module-raises"],
)
def test_an_invalid_graph_is_one_clean_error(source: str, message: str, tmp_path: Path) -> None:
    graph_file = module(tmp_path, "invalid", source)
    for memory in ([], ["--memory"]):
        result = invoke("run", f"{graph_file}:graph", *memory)
        clean(result)
        assert result.exit_code == 2
        assert says(result, message)
    assert not (tmp_path / "tailrace.db").exists()


def test_a_missing_attribute_names_the_file_as_typed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)
    result = invoke("run", "examples/research.py:nope", "--db", tmp_path / "t.db")
    clean(result)
    assert result.exit_code == 2
    assert says(result, "cannot load 'examples/research.py:nope': ")
    assert says(result, "examples/research.py has no attribute 'nope'")
    assert "tailrace_file_" not in result.output


COMMANDS = ("run", "resume", "runs", "show", "questions", "answer", "serve", "evolve-demo")


@pytest.mark.parametrize("command", COMMANDS)
def test_help_cites_only_files_that_exist(command: str) -> None:
    result = invoke(command, "--help")
    assert result.exit_code == 0, result.output
    cited = set(re.findall(r"[\w./-]+\.py\b", result.output))
    for path in cited:
        assert (ROOT / path).exists(), f"tailrace {command} --help cites missing {path}"
    if command == "run":
        assert "examples/research.py" in cited


def test_a_suspended_file_graph_says_how_to_answer_it(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    gated = module(tmp_path, "gated", GATED)
    ran = invoke("run", f"{gated}:graph", "--db", db, "--run-id", "g1", "-i", '"v2"')
    assert ran.exit_code == 0, ran.output
    assert says(
        ran,
        f"answer with: tailrace answer QUESTION_ID VALUE --db {db} --graphs {gated}:graph",
    )


def test_answer_without_graphs_records_the_answer_and_says_how_to_apply_it(
    tmp_path: Path,
) -> None:
    db, question = suspended_run(tmp_path)
    result = invoke("answer", question.question_id, '"yes"', "--db", db)
    clean(result)
    assert result.exit_code == 0, result.output  # recorded: a worker with the graph applies it
    assert says(result, f"answered {question.question_id}; recorded, not applied here")
    assert says(result, f"--graphs {tmp_path / 'gated.py'}")
    [row] = read_questions(db)
    assert row.status is QuestionStatus.ANSWERED  # serve --graphs, or resume --graphs, applies it
    resumed = invoke("resume", "g1", "--db", db, "--graphs", tmp_path / "gated.py")
    assert resumed.exit_code == 0, resumed.output
    assert '"answer": "yes"' in resumed.stdout


# -- finding 7: reading commands never write -------------------------------------------------


def test_reading_commands_work_while_another_process_holds_the_write_lock(
    tmp_path: Path,
) -> None:
    db, _ = suspended_run(tmp_path)
    with contextlib.closing(sqlite3.connect(db, isolation_level=None)) as writer:
        writer.execute("BEGIN IMMEDIATE")  # as a writer mid-transaction would
        try:
            for args in (["runs"], ["show", "g1"], ["questions"]):
                result = invoke(*args, "--db", db)
                clean(result)
                assert result.exit_code == 0, result.output
                assert "g1" in result.stdout
        finally:
            writer.execute("ROLLBACK")
