"""``tailrace parked`` lists and drops parked items; ``tailrace show`` names a run's (P3, P4)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import tailrace as tr
from tailrace.stores import SQLiteStore
from tests.cli.test_cli import flat, invoke
from tests.durable.test_checkpoints import rollouts


async def park_some(path: Path) -> list[str]:
    async with SQLiteStore(path) as store:
        engine = tr.Engine(store=store)
        await engine.run(rollouts([]), 1, run_id="cli-park")
        return [p.park_id for p in await engine.parked("parked_rollouts")]


def test_parked_lists_drops_and_show_names_the_runs_parked_items(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    ids = asyncio.run(park_some(db))
    assert len(ids) == 2
    listed = invoke("parked", "--db", db)
    assert listed.exit_code == 0, listed.output
    assert all(i[:6] in flat(listed.output) for i in ids)
    dropped = invoke("parked", "drop", ids[0], "--db", db)
    assert dropped.exit_code == 0 and f"dropped parked item {ids[0]}" in dropped.output
    again = invoke("parked", "drop", ids[0], "--db", db)
    assert again.exit_code == 1 and "is not parked" in again.output
    left = invoke("parked", "--db", db, "--graph", "parked_rollouts", "--node", "roll")
    assert ids[0][:6] not in flat(left.output) and ids[1][:6] in flat(left.output)
    every = invoke("parked", "--all", "--db", db)
    assert "dropped" in every.output
    shown = invoke("show", "cli-park", "--db", db)
    assert shown.exit_code == 0, shown.output
    assert "parked items" in shown.output and "dropped" in shown.output


def test_parked_with_nothing_parked_says_so(tmp_path: Path) -> None:
    db = tmp_path / "empty.db"
    asyncio.run(_open(db))
    result = invoke("parked", "--db", db)
    assert result.exit_code == 0 and "no parked items" in result.output


async def _open(path: Path) -> None:
    async with SQLiteStore(path):
        pass
