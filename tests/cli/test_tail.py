"""``tailrace tail``: a run's streams per attempt, winners marked, chunks shown literally (S1-S4).

The command runs in process (``CliRunner``) on a real SQLite file; the live
case follows a run that another process drives.
"""

from __future__ import annotations

import asyncio
import os
import re
import sys
import textwrap
from pathlib import Path

from typer.testing import CliRunner, Result

import tailrace as tr
from tailrace import current_node
from tailrace.cli._app import app
from tailrace.graph import RetryPolicy
from tailrace.stores import SQLiteStore
from tests import fixtures

ENV: dict[str, str | None] = {"COLUMNS": "400", "TAILRACE_DB": None}
#: What a terminal would act on; none of it may reach the output.
RAW_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
HOSTILE = "[red]x[/red] [/INST] <script>alert(1)</script> '; DROP TABLE runs; -- \x1b[31m"


def invoke(*args: object) -> Result:
    return CliRunner().invoke(app, [str(a) for a in args], env=ENV)


async def _streamed_run(db: Path) -> None:
    tries = 0

    async def talk(x: int) -> str:
        nonlocal tries
        tries += 1
        ctx = current_node()
        assert ctx is not None
        ctx.stream(HOSTILE)
        ctx.stream({"try": tries, "text": HOSTILE})
        if tries == 1:
            raise RuntimeError("first try fails")
        return "ok"

    g = tr.Graph("tailed")
    g.add_node("talk", talk, retry=RetryPolicy(attempts=2))
    async with SQLiteStore(db) as store:
        await tr.Engine(store=store).run(g, 0, run_id="tailed")


def test_tail_prints_each_attempt_with_its_mark_and_chunks_literally(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    asyncio.run(_streamed_run(db))
    result = invoke("tail", "tailed", "--db", db)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert len(lines) == 6
    assert not RAW_CONTROL.search(result.stdout)
    shown = "[red]x[/red] [/INST] <script>alert(1)</script> '; DROP TABLE runs; -- \\x1b[31m"
    assert lines[0].split(None, 1) == ["1", f"talk v1 try 1 {shown}"]
    assert '"try": 1' in lines[1] and "\\u001b[31m" in lines[1] and "[red]x[/red]" in lines[1]
    assert lines[2].split(None, 1) == ["3", "talk v1 try 1 discarded"]
    assert lines[3].split(None, 1) == ["4", f"talk v1 try 2 {shown}"]
    assert lines[5].split(None, 1) == ["6", "talk v1 try 2 accepted (winner)"]
    after = invoke("tail", "tailed", "--db", db, "--after", "4", "--no-follow")
    assert [line.split()[0] for line in after.stdout.splitlines()] == ["5", "6"]


def test_tail_of_a_run_with_no_rows_says_so_and_an_unknown_run_fails(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    asyncio.run(_streamed_run(db))
    quiet = invoke("tail", "tailed", "--db", db, "--after", "6")
    assert quiet.exit_code == 0 and "no stream rows past 6" in quiet.stdout
    missing = invoke("tail", "nope", "--db", db)
    assert missing.exit_code == 1 and "nope" in missing.output


DRIVER = """
    import asyncio, sys
    import tailrace as tr
    from tailrace import current_node
    from tailrace.stores import SQLiteStore

    async def talk(n):
        ctx = current_node()
        for t in range(n):
            ctx.stream(t)
            await asyncio.sleep(0.01)
        return n

    async def main():
        g = tr.Graph("live")
        g.add_node("talk", talk)
        async with SQLiteStore(sys.argv[1]) as store:
            await tr.Engine(store=store).run(g, 30, run_id="live")

    asyncio.run(main())
"""


async def test_tail_follows_a_run_another_process_drives(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    (tmp_path / "driver.py").write_text(textwrap.dedent(DRIVER))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    driver = await asyncio.create_subprocess_exec(
        sys.executable, str(tmp_path / "driver.py"), str(db), env=env
    )
    try:
        async with SQLiteStore(db) as store:
            await fixtures.until(lambda: _has_rows(store), "the first chunk stored")
        result = await asyncio.to_thread(invoke, "tail", "live", "--db", db)
    finally:
        await driver.wait()
    assert driver.returncode == 0
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert [line.split()[-1] for line in lines[:-1]] == [str(t) for t in range(30)]
    assert lines[-1].endswith("accepted (winner)")


async def _has_rows(store: SQLiteStore) -> bool:
    try:
        return bool(await store.chunks("live"))
    except tr.RunNotFound:
        return False
