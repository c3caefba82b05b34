"""``tailrace rollouts`` prints the tail's account of a map of generations over its rounds (X4)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

pytest.importorskip("httpx")

import tailrace as tr
from tailrace.integrations.openai import BatchingServer, ModelClient
from tailrace.stores import SQLiteStore
from tests.cli.test_cli import flat, invoke


async def two_rounds(db: Path) -> list[str]:
    """Six prompts, four kept, two parked; then the two parked continued under version v2."""
    runs = []
    async with BatchingServer(median_tokens=40) as server, SQLiteStore(db) as store:
        engine = tr.Engine(store=store)
        for version, prompts, options in (
            ("v1", 6, {"required": 4, "late": "park"}),
            ("v2", 0, {}),
        ):
            async with ModelClient(server.url, "m", version=version) as client:
                g = tr.Graph("cli_rollouts")

                async def sample(prompt: str, client: ModelClient = client) -> str:
                    return (await client.complete(prompt, max_tokens=4000)).text

                g.add_node("sample", sample, "map", resume_parked=True, **options)
                result = await engine.run(g, [f"problem {i}" for i in range(prompts)])
                runs.append(result.run_id)
    return runs


def test_rollouts_prints_the_account_of_the_rounds(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    runs = asyncio.run(two_rounds(db))
    result = invoke("rollouts", *runs, "--node", "sample", "--db", db)
    assert result.exit_code == 0, result.output
    out = flat(result.output)
    assert "itemslaunched/accepted/parked/cancelled6/6/0/0" in out  # flat: no spaces
    assert "acceptedunderanothermodelversion2" in out
    assert "starvingparkeditemsnone" in out
    first = invoke("rollouts", runs[0], "--node", "sample", "--db", db, "--bound", "1")
    assert first.exit_code == 0, first.output
    assert "6/4/2/0" in flat(first.output)
    assert f"starvingparkeditems{runs[0]}/sample/1/" in flat(first.output)
