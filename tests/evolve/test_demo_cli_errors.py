"""``tailrace evolve-demo``: user paths are printed literally; a bad --db or --save is one error line.

CONVENTIONS 15 (escape at the edge) and the CLI's failure contract
(``tailrace.cli._session``): no markup read from user text, no traceback,
exit code 1 with ``error: ...`` on stderr.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from tailrace.cli._app import app

QUICK = ["evolve-demo", "--rollouts", "4", "--tasks", "8", "--latency", "0"]
ENV = {"COLUMNS": "250", "TAILRACE_DB": None}


@pytest.fixture(autouse=True)
def _in_tmp(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)


def invoke(*args: object) -> Result:
    return CliRunner().invoke(app, [*QUICK, *(str(a) for a in args)], env=ENV)


def flat(text: str) -> str:
    """``text`` without rich's box drawing and whitespace (wrapping-proof)."""
    for ch in "│╭╮╰╯─┃┏┓┗┛━┡┩╇┳┻╋┣┫┠┨":
        text = text.replace(ch, "")
    return "".join(text.split())


def one_error_line(result: Result, message: str) -> None:
    """Exit code 1, no traceback, ``message`` printed as an error, and no run reported."""
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert flat(f"error: {message}") in flat(result.output), result.output
    assert "learning curve" not in result.output


def test_a_save_path_that_looks_like_markup_is_printed_as_it_is(tmp_path: Path) -> None:
    (tmp_path / "[red]x" / "[").mkdir(parents=True)
    save = "[red]x/[/z]y.json"

    result = invoke("--save", save)

    assert result.exit_code == 0, result.output
    assert flat(f"result saved to {save}") in flat(result.output)
    assert json.loads((tmp_path / save).read_text())["mode"] == "async"


def test_a_db_that_is_not_a_store_location_is_one_error_line(tmp_path: Path) -> None:
    result = invoke("--db", "file:x.db")

    one_error_line(result, "cannot open store file:x.db: SQLiteStore needs a file path")
    assert list(tmp_path.iterdir()) == []


def test_saving_into_a_missing_directory_is_refused_before_the_run(tmp_path: Path) -> None:
    result = invoke("--save", tmp_path / "missing" / "result.json")

    one_error_line(
        result,
        f"cannot save the result to {tmp_path / 'missing' / 'result.json'}: "
        f"there is no directory {tmp_path / 'missing'}",
    )
    assert list(tmp_path.iterdir()) == []


def test_a_save_that_fails_after_the_run_is_one_error_line(tmp_path: Path) -> None:
    (tmp_path / "taken").mkdir()  # a directory where the file should go

    result = invoke("--save", tmp_path / "taken")

    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    assert flat(f"error: cannot save the result to {tmp_path / 'taken'}: Is a directory") in flat(
        result.output
    )
