"""The rollouts example does what its docstring says: launch 12, keep the first 8, cancel 4.

Each rollout's length is seeded by its prompt, so which rollouts are the
quickest is fixed; the map keeps ``KEEP`` of them in prompt order (M3) and
cancels the others as late (M5), in memory and durably.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

import tailrace as tr
from tailrace.stores import SQLiteStore
from tests import fixtures

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "rollouts.py"
STEP = {"step": 1, "prompts": 12}


def turns(prompt: int) -> int:
    rng = random.Random(f"{STEP['step']}:{prompt}")
    return max(1, int(rng.lognormvariate(1.5, 0.9)))


@pytest.fixture(scope="module")
def example() -> object:
    return fixtures.load_module("example_rollouts", EXAMPLE)


def check(result: tr.RunResult, keep: int) -> None:
    assert result.status == "completed"
    kept = result.output["kept"]
    assert len(kept) == keep and kept == sorted(kept)  # the first k, in prompt order (M3)
    cancelled = [x.item for x in result.late_inputs]
    assert all(x.reason == "cancelled" for x in result.late_inputs)
    assert sorted(kept + cancelled) == list(range(STEP["prompts"]))
    # The quickest rollouts won: none kept is longer than one cancelled.
    assert max(turns(p) for p in kept) <= min(turns(p) for p in cancelled)


async def test_the_example_keeps_the_quickest_rollouts_in_memory(example: object) -> None:
    graph = example.graph  # type: ignore[attr-defined]
    check(await tr.Engine().run(graph, STEP), example.KEEP)  # type: ignore[attr-defined]


async def test_the_example_runs_durably_and_stores_each_rollout(
    example: object, tmp_path: Path
) -> None:
    graph = example.graph  # type: ignore[attr-defined]
    async with SQLiteStore(tmp_path / "runs.db") as store:
        result = await tr.Engine(store=store).run(graph, STEP)
        stored = await store.load_run(result.run_id)
    check(result, example.KEEP)  # type: ignore[attr-defined]
    statuses = sorted(r.status for r in stored.items)
    assert statuses.count("completed") == 8 and statuses.count("cancelled") == 4


def test_the_example_graph_round_trips_through_json(example: object) -> None:
    graph = example.graph  # type: ignore[attr-defined]
    doc = graph.to_dict()
    assert doc["nodes"][1]["required"] == {"ref": "example_rollouts:keep"}
    assert tr.Graph.from_dict(doc).fingerprint() == graph.fingerprint()
