"""``tailrace schedules``: each schedule with its last tick and the next one, by the store's clock.

In process with typer's ``CliRunner``; the schedules are declared through the
store's API on a real SQLite file.
"""

from __future__ import annotations

import asyncio
import datetime
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from tailrace.cli._app import app
from tailrace.stores import ScheduleRow, SQLiteStore
from tailrace.tail import Cron

UTC = datetime.UTC


@pytest.fixture(autouse=True)
def _in_tmp(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TAILRACE_DB", raising=False)


def invoke(*args: object) -> Result:
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "250"})


def row(name: str, cron: str, declared_at: float) -> ScheduleRow:
    return ScheduleRow(
        name=name, cron=cron, graph_name="report", graph_ref="pkg.mod:report",
        fingerprint="fp", input_json="null", queue="reports", declared_at=declared_at,
    )  # fmt: skip


def declare(db: Path, *rows: ScheduleRow) -> None:
    async def write() -> None:
        async with SQLiteStore(db) as store:
            for r in rows:
                await store.declare_schedule(r)

    asyncio.run(write())


def utc(at: float) -> str:
    return datetime.datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%d %H:%M")


def test_schedules_lists_the_last_and_next_tick_and_says_when_one_is_due(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    now = time.time()
    nightly, every = Cron("0 3 * * *"), Cron("* * * * *")
    # Declared ten minutes ago and never submitted since: its latest tick is due.
    declare(db, row("[red]nightly", "0 3 * * *", now), row("minutely", "* * * * *", now - 600))
    result = invoke("schedules", "--db", db)
    after = time.time()
    assert result.exit_code == 0, result.output
    lines = {line.split()[1]: line for line in result.output.splitlines() if "reports" in line}
    assert set(lines) == {"[red]nightly", "minutely"}  # a name is data, never markup
    minutely = lines["minutely"]
    last = every.latest_at(now - 600)
    assert last is not None
    assert utc(last) in minutely and "due now" in minutely
    assert any(utc(every.latest_at(at) or 0) in minutely for at in (now, after))  # the next
    upcoming = {utc(nightly.next_after(at)) for at in (now, after)}
    assert any(u in lines["[red]nightly"] for u in upcoming)
    assert "due now" not in lines["[red]nightly"]


def test_schedules_of_a_store_without_any_says_how_to_declare_one(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    declare(db)
    result = invoke("schedules", "--db", db)
    assert result.exit_code == 0, result.output
    assert "no schedules" in result.output and "--schedule" in result.output
