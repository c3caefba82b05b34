"""README.md says what works: its example runs, its two commands are what CI and users run.

Its concept table is checked with the docs site (``tests/test_docs.py``).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SCRIPT = Path(sys.executable).parent / "tailrace"


def _section(text: str, heading: str) -> str:
    """The body of the ``## heading`` section of a markdown document."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"README.md has no '## {heading}' section"
    return match.group(1)


def _code_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, re.M | re.S)


def test_example_runs_and_prints_what_it_should(tmp_path: Path) -> None:
    (code,) = _code_blocks(_section(README.read_text(), "Example"), "python")
    script = tmp_path / "example.py"
    script.write_text(code)
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    # search wins the first-1 answer; blame, the straggler nobody reads any more, is
    # cancelled (late="cancel") and recorded as a late, cancelled input.
    assert done.stdout.splitlines() == [
        "similar issues to logs for TICKET-7 "
        "(LateInput(node_id='answer', source_id='blame', activation=1, reason='cancelled'),)"
    ]
    assert list(tmp_path.iterdir()) == [script]  # tr.run keeps nothing on disk


def test_test_command_follows_its_marker() -> None:
    # .ci/run reads the second line after the marker: the fence, then the command.
    lines = README.read_text().splitlines()
    at = lines.index("<!-- test-command -->")
    assert lines[at + 1] == "```bash"
    command = lines[at + 2]
    assert "pytest" in shlex.split(command)
    assert lines[at + 3] == "```"


def test_the_test_commands_paragraph_names_each_system_package_tests_skip_without() -> None:
    """A test skipped for want of a system package says which (``apt-get install -y NAME``);
    the paragraph before the test command names every such package."""
    lines = README.read_text().splitlines()
    at = lines.index("<!-- test-command -->")
    start = max(i for i in range(at) if not lines[i].strip() and i < at - 1)
    paragraph = " ".join(lines[start:at])
    needed = {
        name
        for path in (ROOT / "tests").rglob("*.py")
        for name in re.findall(r"apt-get install -y ([a-z0-9][a-z0-9.+-]*)", path.read_text())
    }
    assert {"chromium", "libfaketime"} <= needed, needed
    for name in sorted(needed):
        assert f"`{name}`" in paragraph, f"README's test paragraph does not name {name}"


def test_main_job_command_runs_the_research_example() -> None:
    commands = _code_blocks(_section(README.read_text(), "Two commands"), "bash")
    main_job = commands[0].strip()
    assert "<!-- test-command -->" not in main_job
    assert "tailrace run examples/research.py:graph" in main_job
    assert "pip install -e '.[cli]'" in main_job


def test_main_job_command_works(tmp_path: Path) -> None:
    # The README's command after its install steps, run from the repository root
    # as a newcomer would, with the store redirected out of the work tree.
    main_job = _code_blocks(_section(README.read_text(), "Two commands"), "bash")[0]
    args = shlex.split(main_job.split("&&")[-1])
    assert args[0] == "tailrace"
    db = tmp_path / "readme.db"
    env = {k: v for k, v in os.environ.items() if k != "TAILRACE_LEASE_TTL"}
    done = subprocess.run(
        [str(SCRIPT), *args[1:]],
        cwd=ROOT,
        env={**env, "TAILRACE_DB": str(db), "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert db.is_file()
    assert " completed in " in done.stdout
    assert "1 late input" in done.stdout
    assert '"draft 2: search notes on tail latency; papers notes on tail latency"' in done.stdout
