"""docs/concepts.md says what the code does: the priority example and the command line.

The priority example is run as the doc prints it and its output compared
with the comment beside ``print`` (issue 9, finding 14: the doc said ``work0``
took the free slot; E3 gives it by priority). Every ``tailrace`` command and
option the doc names exists.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tailrace.cli._app import app

ROOT = Path(__file__).resolve().parents[2]
CONCEPTS = ROOT / "docs" / "concepts.md"


def _blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", CONCEPTS.read_text(), re.M | re.S)


def test_the_priority_example_prints_what_the_doc_says(tmp_path: Path) -> None:
    [code] = [block for block in _blocks("python") if 'admission="priority"' in block]
    [said] = re.findall(r"^print\(started\)  # (\[.*?\])", code, re.M)
    assert said == "['split', 'work3', 'work2', 'work1', 'work0']"  # E3: by priority
    script = tmp_path / "priority.py"
    script.write_text(code)
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == said


def _documented_commands() -> list[tuple[str, list[str]]]:
    """(subcommand, options) of every ``tailrace`` command line the doc shows or names."""
    lines = [line for block in _blocks("bash") for line in block.splitlines()]
    spans = re.findall(r"`(tailrace [^`]+)`", CONCEPTS.read_text())
    snippets = [" ".join(s.split()) for s in lines + spans if s.startswith("tailrace ")]
    return [
        (snippet.split()[1], re.findall(r"--[a-z][a-z-]*", snippet)) for snippet in snippets
    ]  # options in a bash line's comment count: they are named as options of that command


@pytest.mark.parametrize(("command", "options"), _documented_commands())
def test_every_command_and_option_the_doc_names_exists(command: str, options: list[str]) -> None:
    result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "250"})
    assert result.exit_code == 0, f"tailrace {command}: {result.output}"
    for option in options:
        assert option in result.output, f"tailrace {command} has no {option}"
