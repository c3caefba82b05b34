"""``tailrace rollouts`` prints the tail's account of a map of generations over its rounds (X4)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

pytest.importorskip("httpx")

import tailrace as tr
from tailrace.graph import MAX_PARKS
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


GRAPH_FILE = """
import tailrace as tr

async def sample(prompt: str) -> str:
    return prompt

graph = tr.Graph("cli_rollouts")
graph.add_node("sample", sample, "map", required=4, late="park", resume_parked=True, max_parks=1)
other = tr.Graph("cli_rollouts")
other.add_node("sample", sample, "map", required=5, late="park", resume_parked=True)
"""


def test_rollouts_bounds_starvation_by_the_maps_own_max_parks(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    first = asyncio.run(two_rounds(db))[0]
    (tmp_path / "rollout_graphs.py").write_text(GRAPH_FILE)
    spec = f"{tmp_path / 'rollout_graphs.py'}:graph"
    # the graph's map parks an item at most once (P5): both parked items starve at once
    named = invoke("rollouts", first, "--node", "sample", "--db", db, "--graphs", spec)
    assert named.exit_code == 0, named.output
    out = flat(named.output)
    assert "mostroundswaited1(bound1)" in out and f"starvingparkeditems{first}/sample/" in out
    # without the graph: the default bound of every map
    plain = flat(invoke("rollouts", first, "--node", "sample", "--db", db).output)
    assert f"(bound{MAX_PARKS})" in plain and "starvingparkeditemsnone" in plain
    # --bound still wins over the graph's
    forced = invoke(
        "rollouts", first, "--node", "sample", "--db", db, "--graphs", spec, "--bound", "5"
    )
    assert "(bound5)" in flat(forced.output)
    # a graph of the run's name but another shape is not the run's: said, naming the run
    wrong = f"{tmp_path / 'rollout_graphs.py'}:other"
    refused = invoke("rollouts", first, "--node", "sample", "--db", db, "--graphs", wrong)
    assert refused.exit_code != 0
    assert f"run {first!r} ran graph 'cli_rollouts'" in " ".join(refused.output.split())


def test_show_prints_the_tail_account_of_each_map_of_generations(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    first = asyncio.run(two_rounds(db))[0]
    shown = invoke("show", first, "--db", db)
    assert shown.exit_code == 0, shown.output
    out = flat(shown.output)
    assert out.count("tailaccountofnode") == 1  # one map of generations: sample
    assert "tailaccountofnodesample" in out
    assert "itemslaunched/accepted/parked/cancelled6/4/2/0" in out
    # the same account as ``tailrace rollouts`` prints for that run (one round)
    alone = flat(invoke("rollouts", first, "--node", "sample", "--db", db).output)
    measures = ("tokensdecoded/salvaged/wasted", "KS(accepted,launchedlengths)", "mostroundswaited")
    for measure in measures:
        value = alone.split(measure, 1)[1][:30]
        assert measure + value in out


def test_show_bounds_starvation_by_the_maps_own_max_parks_given_the_graph(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    first = asyncio.run(two_rounds(db))[0]
    (tmp_path / "rollout_graphs.py").write_text(GRAPH_FILE)
    spec = f"{tmp_path / 'rollout_graphs.py'}:graph"
    named = invoke("show", first, "--db", db, "--graphs", spec)
    assert named.exit_code == 0, named.output
    assert "mostroundswaited1(bound1)" in flat(named.output)
    assert f"(bound{MAX_PARKS})" in flat(invoke("show", first, "--db", db).output)
    wrong = f"{tmp_path / 'rollout_graphs.py'}:other"
    refused = invoke("show", first, "--db", db, "--graphs", wrong)
    assert refused.exit_code != 0
    assert f"run {first!r} ran graph 'cli_rollouts'" in " ".join(refused.output.split())


async def no_generations(db: Path) -> str:
    """A map that streams text, and a task (not a map) whose chunk looks like usage."""
    async with SQLiteStore(db) as store:
        g = tr.Graph("no_generations")

        async def echo(x: int) -> int:
            tr.current_node(required=True).stream({"tokens": 1, "text": str(x)})
            return x

        async def total(xs: list[int]) -> int:
            tr.current_node(required=True).stream({"usage": {"decoded": sum(xs)}})
            return sum(xs)

        g.add_node("echo", echo, "map")
        g.add_node("total", total)
        g.add_edge("echo", "total")
        return (await tr.Engine(store=store).run(g, [1, 2])).run_id


def test_show_prints_no_tail_account_for_a_run_without_generations(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    run_id = asyncio.run(no_generations(db))
    shown = invoke("show", run_id, "--db", db)
    assert shown.exit_code == 0, shown.output
    assert "tailaccount" not in flat(shown.output) and "tokensdecoded" not in flat(shown.output)
