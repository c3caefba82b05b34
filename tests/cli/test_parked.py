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
    assert again.exit_code == 1 and "was dropped already; nothing changed" in again.output
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


async def claim_one(path: Path) -> str:
    async with SQLiteStore(path) as store:
        (row,) = await store.claim_parked("parked_rollouts", "roll", "next-run/roll/1", limit=1)
        return row.park_id


def test_parked_drop_says_who_claimed_an_item_or_that_there_is_none(tmp_path: Path) -> None:
    """Each reason an item cannot be dropped is said apart: claimed (by whom), unknown."""
    db = tmp_path / "runs.db"
    asyncio.run(park_some(db))
    claimed = asyncio.run(claim_one(db))
    refused = invoke("parked", "drop", claimed, "--db", db)
    assert refused.exit_code == 1
    said = flat(refused.output)
    assert flat(f"parked item '{claimed}' was claimed by next-run/roll/1 at ") in said, said
    assert flat("nothing was dropped") in said
    unknown = invoke("parked", "drop", "no-such-item", "--db", db)
    assert unknown.exit_code == 1
    assert flat("no parked item 'no-such-item' in the store") in flat(unknown.output)
