"""``aggregate_fired`` names the k inputs that fired the aggregate (E4), not every edge into it."""

from __future__ import annotations

import asyncio

import tailrace as tr


async def test_aggregate_fired_lists_only_the_inputs_that_fired_it() -> None:
    release = asyncio.Event()
    g = tr.Graph("first-of-three")

    @g.task()
    async def src(x: int) -> int:
        return x

    @g.task()
    async def slow(x: int) -> str:
        await release.wait()
        return "slow"

    @g.task()
    async def fast(x: int) -> str:
        return "fast"

    @g.task()
    async def quick(x: int) -> str:
        return "quick"

    @g.aggregate(required=2, late="cancel")
    def merge(inputs: list[str]) -> list[str]:
        release.set()
        return inputs

    for branch in ("slow", "fast", "quick"):
        g.add_edge("src", branch)
        g.add_edge(branch, "merge")
    bus = tr.EventBus()
    fired: list[tr.Event] = []
    bus.subscribe(fired.append, tr.EventType.AGGREGATE_FIRED)
    result = await asyncio.wait_for(tr.Engine(bus=bus).run(g, 1), 10)
    assert result.output == ["fast", "quick"]
    [event] = fired
    assert event.node_id == "merge" and event.data["sources"] == ["fast", "quick"]
