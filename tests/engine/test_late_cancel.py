"""``aggregate(late="cancel")``: inputs nobody will read are cancelled (issue 13).

Once every consumer of a running (or queued) node has fired without it, the
node is cancelled and recorded as a late, cancelled input, so the run returns
when its output is decided. ``late="record"`` (the default) keeps E5: the
straggler runs to its end and is recorded as late.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

import tailrace as tr
from tailrace.stores import SQLiteStore

GUARD = 10.0  # seconds; only there so that a bug fails the test instead of hanging it


def triage(late: str, never: asyncio.Event, seen: list[str]) -> tr.Graph:
    """The README's example: a first-1 merge over a quick and a straggling branch."""
    g = tr.Graph("triage")

    @g.task()
    async def fetch(ticket: str) -> str:
        return f"logs for {ticket}"

    @g.task()
    async def search(logs: str) -> str:
        return f"similar issues to {logs}"

    @g.task()
    async def blame(logs: str) -> str:
        try:
            await never.wait()  # the straggler: nobody will read its result
        except asyncio.CancelledError:
            seen.append("blame cancelled")
            raise
        return f"commit behind {logs}"

    @g.aggregate(required=1, late=late)
    def answer(findings: list[str]) -> str:
        return findings[0]

    g.add_edge("fetch", "search")
    g.add_edge("fetch", "blame")
    g.add_edge("search", "answer")
    g.add_edge("blame", "answer")
    return g


async def test_a_dead_straggler_is_cancelled_and_the_run_returns_with_its_output() -> None:
    seen: list[str] = []
    g = triage("cancel", asyncio.Event(), seen)
    async with asyncio.timeout(GUARD):  # with "record" this run would never return
        result = await tr.Engine().run(g, "TICKET-7")
    assert result.output == "similar issues to logs for TICKET-7"
    assert seen == ["blame cancelled"]
    assert result.nodes["blame"].status == "cancelled"
    assert [(x.node_id, x.source_id, x.activation, x.reason) for x in result.late_inputs] == [
        ("answer", "blame", 1, "cancelled")
    ]


async def test_record_is_the_default_and_lets_the_straggler_finish() -> None:
    release = asyncio.Event()
    seen: list[str] = []
    g = triage("record", release, seen)
    engine = tr.Engine()
    task = asyncio.create_task(engine.run(g, "T"))
    await asyncio.sleep(0.05)
    assert not task.done()  # E5: the run waits for its straggler
    release.set()
    async with asyncio.timeout(GUARD):
        result = await task
    assert seen == [] and result.nodes["blame"].status == "completed"
    assert [x.reason for x in result.late_inputs] == ["fired"]


async def test_an_input_another_consumer_still_reads_is_not_cancelled() -> None:
    release = asyncio.Event()
    g = tr.Graph("shared")

    @g.task()
    async def quick(x: int) -> int:
        return x

    @g.task()
    async def slow(x: int) -> int:
        await release.wait()
        return x + 1

    @g.aggregate(required=1, late="cancel")
    def first(xs: list[int]) -> int:
        release.set()  # slow may finish now: "report" still needs it
        return xs[0]

    @g.task()
    async def report(x: int) -> int:
        return x * 10

    g.add_edge("quick", "first")
    g.add_edge("slow", "first")
    g.add_edge("slow", "report")
    async with asyncio.timeout(GUARD):
        result = await tr.Engine().run(g, 1)
    assert result.results["report"] == 20
    assert result.nodes["slow"].status == "completed"


async def test_a_queued_dead_input_never_starts() -> None:
    started: list[str] = []
    g = tr.Graph("queued")

    async def branch(x: int) -> int:
        started.append(f"b{x}")
        return x

    for i in range(3):
        g.add_node(f"b{i}", lambda x, i=i: branch(i), priority=3 - i)

    @g.aggregate(required=1, late="cancel")
    def first(xs: list[int]) -> int:
        return xs[0]

    for i in range(3):
        g.add_edge(f"b{i}", "first")
    async with asyncio.timeout(GUARD):
        result = await tr.Engine(capacity=1, admission="priority").run(g, None)
    assert result.output == 0
    assert started == ["b0"]  # b1 and b2 were queued behind it, then cancelled
    assert {x.source_id: x.reason for x in result.late_inputs} == {
        "b1": "cancelled",
        "b2": "cancelled",
    }


async def test_cancelled_inputs_are_durable_and_never_rerun(tmp_path: Path) -> None:
    seen: list[str] = []
    g = triage("cancel", asyncio.Event(), seen)
    async with SQLiteStore(tmp_path / "runs.db") as store:
        result = await tr.Engine(store=store).run(g, "T", run_id="dead")
        assert result.status == "completed"
        stored = await store.load_run("dead")
        assert stored.nodes["blame"].status == "cancelled"
        late = [e for e in await store.events("dead") if e.type == "node_late_input"]
        assert [e.node_id for e in late] == ["answer"]
        with pytest.raises(tr.NotResumable):
            await tr.Engine(store=store).resume("dead", g)
    assert seen == ["blame cancelled"]


def test_late_is_an_aggregate_option_checked_at_build_time() -> None:
    g = tr.Graph("bad")
    with pytest.raises(tr.GraphError, match="late"):
        g.add_node("t", lambda x: x, late="cancel")
    with pytest.raises(tr.GraphError, match="late"):
        g.add_node("a", lambda xs: xs, "aggregate", late="drop")


def test_late_round_trips_through_json() -> None:
    g = triage("cancel", asyncio.Event(), [])
    data: dict[str, Any] = g.to_dict()
    assert [n.get("late") for n in data["nodes"] if n["id"] == "answer"] == ["cancel"]
    handlers = {node.id: node.handler for node in g.nodes.values()}
    again = tr.Graph.from_dict(data, handlers=handlers)
    assert again.nodes["answer"].late == "cancel"
    assert again.to_dict() == data
