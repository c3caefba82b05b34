"""The starvation bound on parked items (P5), through the public API.

A map with ``late="park"`` and ``resume_parked=True`` parks its stragglers and
takes them first next round; an item parked ``max_parks`` times runs to
completion the next time a map takes it: the decision waits for it, it is among
the winners, and a SIGKILL while it runs does not change that.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest

import tailrace as tr
from tailrace.stores import RunStatus, RunStore, open_store
from tests import fixtures
from tests.durable import park_bound_graphs as graphs
from tests.durable.test_checkpoints import shared_target

each_store = fixtures.each_store
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def item_log(tmp_path: Path) -> Path:
    path = tmp_path / "items.log"
    graphs.LOG[:] = [path]
    yield path
    graphs.LOG.clear()


async def two_rounds(engine: tr.Engine, g: tr.Graph) -> None:
    """Round 1 parks the slow item; round 2 takes it first and parks it again."""
    first = await engine.run(g, ["slow", "f1a", "f1b"], run_id="round-1")
    assert [r["item"] for r in first.output] == ["f1a", "f1b"]
    second = await engine.run(g, ["f2a", "f2b"], run_id="round-2")
    assert [r["item"] for r in second.output] == ["f2a", "f2b"]
    assert [(x.item, x.reason) for x in second.late_inputs] == [(0, "parked")]


async def test_an_item_parked_max_parks_times_runs_to_completion_on_its_next_round(
    each_store: RunStore, item_log: Path
) -> None:
    engine = tr.Engine(store=each_store)
    g = graphs.rounds_graph(max_parks=2)
    await two_rounds(engine, g)
    every = {p.run_id: p for p in await engine.parked(g, "roll", every=True)}
    assert (every["round-1"].parks, every["round-2"].parks) == (1, 2)
    # Parked again, it keeps its place in claim order: when it was first parked.
    assert every["round-2"].parked_at == every["round-1"].parked_at
    third = await engine.run(g, ["f3a", "f3b"], run_id="round-3")
    items = [r["item"] for r in third.output]
    assert items[0] == "slow" and len(items) == 2 and items[1] in ("f3a", "f3b")
    assert third.output[0]["from"] >= 0
    assert not [x for x in third.late_inputs if x.reason == "parked"]
    assert [p.status for p in await engine.parked(g, "roll")] == []  # nothing left parked
    assert "done slow" in graphs.log_lines(item_log)


async def test_below_the_bound_the_straggler_is_parked_again(each_store: RunStore) -> None:
    engine = tr.Engine(store=each_store)
    g = graphs.rounds_graph(max_parks=3)
    await two_rounds(engine, g)
    third = await engine.run(g, ["f3a", "f3b"], run_id="round-3")
    assert [r["item"] for r in third.output] == ["f3a", "f3b"]
    (left,) = await engine.parked(g, "roll")
    assert (left.run_id, left.parks) == ("round-3", 3)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_parks": 0, "resume_parked": True, "late": "park"}, "max_parks must be an integer"),
        ({"max_parks": True, "resume_parked": True, "late": "park"}, "max_parks must be"),
        ({"max_parks": 2, "late": "park"}, "needs resume_parked=True"),
    ],
)
def test_a_bad_max_parks_is_refused_naming_the_map(
    options: dict[str, object], message: str
) -> None:
    g = tr.Graph("bad")
    with pytest.raises(tr.GraphError, match=message) as caught:
        g.add_node("roll", lambda x: x, "map", required=1, **options)
    assert "roll" in str(caught.value)


def test_max_parks_on_a_task_is_refused() -> None:
    with pytest.raises(tr.GraphError, match="'t': max_parks= applies to maps only"):
        tr.Graph("bad").add_node("t", lambda x: x, max_parks=2)


def test_max_parks_is_part_of_the_graphs_json_form() -> None:
    bounded = graphs.rounds_graph(max_parks=5).to_dict()
    default = graphs.rounds_graph(max_parks=tr.graph.MAX_PARKS).to_dict()
    roll = {n["id"]: n for n in bounded["nodes"]}["roll"]
    assert roll["max_parks"] == 5
    assert "max_parks" not in {n["id"]: n for n in default["nodes"]}["roll"]


# -- a SIGKILL while the pinned item runs -----------------------------------------------------


@pytest.mark.slow  # a child process per store, SIGKILLed while the pinned item runs
@pytest.mark.parametrize("kind", fixtures.SHARED_STORES)
async def test_a_sigkill_while_the_pinned_item_runs_still_waits_for_it(
    kind: str, tmp_path: Path, item_log: Path
) -> None:
    async with shared_target(kind, tmp_path) as target:
        async with open_store(target) as store:
            await two_rounds(tr.Engine(store=store), graphs.rounds_graph())
        item_log = item_log.with_name("round-3.log")  # round 3 only: the child's, the resume's
        graphs.LOG[:] = [item_log]
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.durable.park_bound_graphs", target, "round-3",
            str(item_log), "f3a", "f3b", cwd=ROOT,
        )  # fmt: skip
        try:
            async with open_store(target) as store:

                async def fast_committed_and_slow_midway() -> bool:
                    try:
                        stored = await store.load_run("round-3")
                    except tr.RunNotFound:
                        return False
                    done = sum(r.status == "completed" for r in stored.items)
                    turns = [int(c.value_json) for c in stored.checkpoints if c.item == 0]
                    return done >= 2 and bool(turns) and turns[0] >= 5

                await fixtures.until(fast_committed_and_slow_midway, "fast items committed")
                os.kill(child.pid, signal.SIGKILL)
                assert await child.wait() == -signal.SIGKILL
                assert (await store.load_run("round-3")).run.status == RunStatus.RUNNING
                result = await tr.Engine(store=store).resume("round-3", graphs.rounds_graph())
        finally:
            if child.returncode is None:
                child.kill()
                await child.wait()
    assert result.output[0]["item"] == "slow"
    assert result.output[0]["from"] >= 5  # continued from its checkpoint, not from the start
    lines = graphs.log_lines(item_log)
    # Each fast item ran once: the decision, made after the kill, kept what was committed.
    assert sum(line.startswith("start f3a") for line in lines) == 1
    assert sum(line.startswith("start f3b") for line in lines) == 1
    assert lines[-1] == "done slow"


def test_tailrace_parked_shows_how_often_each_item_was_parked(tmp_path: Path) -> None:
    from tailrace.stores import ParkedRow, SQLiteStore
    from tests.cli.test_cli import flat, invoke

    db = tmp_path / "runs.db"

    async def rounds() -> list[ParkedRow]:
        async with SQLiteStore(db) as store:
            engine = tr.Engine(store=store)
            g = graphs.rounds_graph(max_parks=3)
            await two_rounds(engine, g)
            return await engine.parked(g, "roll")

    (row,) = asyncio.run(rounds())
    listed = invoke("parked", "--db", db)
    assert listed.exit_code == 0, listed.output
    text = flat(listed.output)
    assert "parks" in text and row.park_id[:6] in text
    assert "2parked" in text.split(row.park_id[:6], 1)[1]  # parks, then status
