"""Hostile text in every CLI command (issue 9, finding 1; CONVENTIONS 15).

Each hostile string goes everywhere a user or a store can put text: the run
id, the graph's name, node ids, a gate's prompt, an answer, a handler's error,
the database path, a poller spec. Every command must show it literally:
no Rich markup read from it, no escape sequence reaching the terminal, no
traceback. Expected forms are written out by hand: as text, control
characters are spelled (``\\x1b``); inside JSON (prompts, answers, outputs)
they are JSON escapes (``\\u001b``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tailrace.cli._app import app

pytestmark = pytest.mark.slow  # a CLI process per command and case

SCRIPT = Path(sys.executable).parent / "tailrace"
ENV: dict[str, str | None] = {"COLUMNS": "400", "TAILRACE_DB": None, "TAILRACE_LEASE_TTL": None}
# What a terminal would act on (C0 controls but newline, DEL, C1, bidi overrides),
# and lone surrogates, which no terminal can even be sent.
RAW_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


@dataclass(frozen=True)
class Hostile:
    """A hostile string, how it reads as text, and how it reads inside a JSON string."""

    value: str
    text: str
    json: str


CASES = [
    Hostile("[/INST]", "[/INST]", "[/INST]"),
    Hostile("[red]x[/red]", "[red]x[/red]", "[red]x[/red]"),
    Hostile("<script>alert(1)</script>", "<script>alert(1)</script>", "<script>alert(1)</script>"),
    Hostile("'; DROP TABLE runs; --", "'; DROP TABLE runs; --", "'; DROP TABLE runs; --"),
    Hostile("{{x}}", "{{x}}", "{{x}}"),
    Hostile("\x1b[31m", "\\x1b[31m", "\\u001b[31m"),
    Hostile("[", "[", "["),
    Hostile("ünïcødé 日本語 🎉 :smile:", "ünïcødé 日本語 🎉 :smile:", "ünïcødé 日本語 🎉 :smile:"),
]
IDS = ["inst", "markup", "html", "sql", "template", "ansi", "bracket", "unicode"]

GRAPHS = """
from tailrace import Graph

H = {value!r}

graph = Graph(f"graph {{H}}")


@graph.task(name=f"plan{{H}}")
def plan(x):
    return x


@graph.gate(name=f"ask{{H}}")
def ask(x):
    return f"prompt {{H}}"


@graph.task(name=f"act{{H}}")
def act(answer):
    return {{"answer": answer}}


graph.chain(f"plan{{H}}", f"ask{{H}}", f"act{{H}}")

failing = Graph(f"failing {{H}}")


@failing.task(name=f"boom{{H}}")
def boom(x):
    raise RuntimeError(f"error {{H}}")
"""


def flat(text: str) -> str:
    """``text`` without rich's box drawing and without any whitespace (wrapping-proof)."""
    for ch in "│╭╮╰╯─┃┏┓┗┛━┡┩╇┳┻╋┣┫┠┨":
        text = text.replace(ch, "")
    return "".join(text.split())


def raw_controls(output: str) -> list[str]:
    """Control characters in ``output`` that came from data, not from our own styling.

    Where colour is forced (``FORCE_COLOR``, CI), Rich styles with SGR sequences
    closed by a reset; those are ours. Elsewhere output has no escape at all.
    """
    if "\x1b[0m" in output:
        output = re.sub("\x1b\\[[0-9;]*m", "", output)
    return RAW_CONTROL.findall(output)


@dataclass(frozen=True)
class Printed:
    """What one command printed (stdout and stderr together), and how it ended."""

    output: str
    stdout: str
    exit_code: int
    exception: BaseException | None = None


def _invoke(*args: object) -> Printed:
    result = CliRunner().invoke(app, [str(a) for a in args], env=ENV)
    return Printed(result.output, result.stdout, result.exit_code, result.exception)


def _serve_banner(db: Path) -> Printed:
    """``tailrace serve`` on a database whose path holds the hostile string, stopped at once."""
    db.parent.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TAILRACE_")}
    with subprocess.Popen(
        [str(SCRIPT), "serve", "--db", str(db), "--max-interval", "0.1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**env, "COLUMNS": "400"},
    ) as proc:  # fmt: skip
        assert proc.stdout is not None
        first = proc.stdout.readline()  # the banner, printed once the store is open
        proc.send_signal(signal.SIGTERM)
        rest, err = proc.communicate(timeout=30)
    return Printed(first + rest + err, first + rest, proc.returncode)


@dataclass
class Scenario:
    """One hostile string put through every command, with what each printed."""

    case: Hostile
    outputs: dict[str, Printed]


@pytest.fixture(scope="module", params=CASES, ids=IDS)
def scenario(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Scenario:
    case: Hostile = request.param
    where = tmp_path_factory.mktemp("hostile")
    graphs = where / "hostile_graphs.py"
    graphs.write_text(GRAPHS.format(value=case.value))
    db = where / "t.db"
    run_id, failed_id = case.value, f"fail{case.value}"
    out: dict[str, Printed] = {}
    out["run"] = _invoke("run", f"{graphs}:graph", "--db", db, "--run-id", run_id, "-i", '"in"')
    out["runs"] = _invoke("runs", "--db", db)
    out["show"] = _invoke("show", run_id, "--db", db)
    out["questions"] = _invoke("questions", "--db", db)
    question_id = next(
        line.split("│")[1].strip()
        for line in out["questions"].stdout.splitlines()
        if line.startswith("│")
    )
    answer = json.dumps(case.value)
    out["answer"] = _invoke("answer", question_id, answer, "--db", db, "--graphs", graphs)
    out["resume"] = _invoke("resume", run_id, "--db", db, "--graphs", graphs)
    out["run-failing"] = _invoke("run", f"{graphs}:failing", "--db", db, "--run-id", failed_id)
    out["show-failing"] = _invoke("show", failed_id, "--db", db)
    out["serve-poller"] = _invoke("serve", "--db", db, "--poller", f"ci=nofile{case.value}.py:fn")
    out["serve"] = _serve_banner(where / f"db{case.value}" / "t.db")
    return Scenario(case, out)


def _expected(case: Hostile) -> dict[str, list[str]]:
    """What each command must print, literally, for ``case``."""
    t, j = case.text, case.json
    return {
        "run": [f"run {t} suspended", f"plan{t}", f"ask{t}", f"act{t}", f'"prompt {j}"'],
        "runs": [f"│ {t}", f"graph {t}", "suspended"],
        "show": [f"run {t} graph graph {t} status suspended", f"plan{t}", f"ask{t}"],
        "questions": [f"│ {t}", f"ask{t}", f'"prompt {j}"'],
        "answer": [f"run {t} completed", f'"answer": "{j}"', f"act{t}"],
        "resume": [f"{t}", "is completed; nothing to resume"],
        "run-failing": [f"fail{t}", f"boom{t}", f"raised RuntimeError: error {t}"],
        "show-failing": [
            f"run fail{t} graph failing {t} status failed error: RuntimeError: error {t}"
        ],
        "serve-poller": [f"nofile{t}.py:fn", f"no such file nofile{t}.py"],
        "serve": [f"db{t}/t.db as "],
    }


EXIT_CODES = {"resume": 1, "run-failing": 1, "serve-poller": 2}
COMMANDS = list(_expected(CASES[0]))


@pytest.mark.parametrize("command", COMMANDS)
def test_hostile_text_is_shown_literally_by_every_command(scenario: Scenario, command: str) -> None:
    result = scenario.outputs[command]
    output = result.output
    assert "Traceback" not in output, output
    assert result.exception is None or isinstance(result.exception, SystemExit), output
    assert result.exit_code == EXIT_CODES.get(command, 0), output
    assert not raw_controls(output), f"a raw control character reached the terminal: {output!r}"
    for expected in _expected(scenario.case)[command]:
        assert flat(expected) in flat(output), f"{expected!r} not in:\n{output}"


@pytest.mark.parametrize(
    ("args", "shown"),
    [
        (["run", "{graphs}:graph", "--run-id", "a\x00b"], "run id 'a\\x00b'"),
        (["run", "{graphs}:graph", "--memory", "--run-id", "a\ud800b"], "run id 'a\\ud800b'"),
        (["show", "a\x00b"], "run_id 'a\\x00b'"),
        (["resume", "a\ud800b"], "run_id 'a\\ud800b'"),
        (["questions", "--run", "\ud800"], "run_id '\\ud800'"),
        (["answer", "q\x00", "1"], "question_id 'q\\x00'"),
    ],
    ids=["run-nul", "memory-surrogate", "show-nul", "resume-surrogate", "questions", "answer"],
)
def test_ids_no_store_can_keep_are_refused_with_the_error_shown_literally(
    args: list[str], shown: str, tmp_path: Path
) -> None:
    graphs = tmp_path / "hostile_graphs.py"
    graphs.write_text(GRAPHS.format(value="x"))
    db = tmp_path / "t.db"
    assert _invoke("run", f"{graphs}:graph", "--db", db, "--run-id", "seed").exit_code == 0
    result = _invoke(*(a.format(graphs=graphs) for a in args), "--db", db)
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    assert isinstance(result.exception, SystemExit)
    assert not raw_controls(result.output)
    assert result.output.startswith("error: ") and shown in result.output
