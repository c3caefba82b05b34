"""The cyclic gc pause around bulk dispatch and harvest (issue 13): the collector is off
only while a big batch is started or harvested, and always back on afterwards."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest

import tailrace as tr
from tailrace.core._inflight import BULK, paused_gc
from tailrace.stores import SQLiteStore


def fan_out(workers: int, result: Any = 1) -> tr.Graph:
    g = tr.Graph("bulk")
    g.add_node("src", lambda x: x)

    async def work(x: Any) -> Any:
        return result

    g.add_node("join", lambda xs: len(xs), tr.NodeKind.AGGREGATE)
    for k in range(workers):
        g.add_node(f"w{k}", work)
        g.add_edge("src", f"w{k}")
        g.add_edge(f"w{k}", "join")
    return g


def test_paused_gc_restores_the_collector_even_when_the_block_raises() -> None:
    assert gc.isenabled()
    with pytest.raises(RuntimeError), paused_gc():
        assert not gc.isenabled()
        raise RuntimeError("boom")
    assert gc.isenabled()


def test_paused_gc_leaves_a_disabled_collector_disabled() -> None:
    gc.disable()
    try:
        with paused_gc():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


async def test_a_bulk_fan_out_runs_with_the_collector_on_in_handlers_and_after() -> None:
    seen: list[bool] = []
    g = tr.Graph("bulk")
    g.add_node("src", lambda x: x)

    async def work(x: Any) -> int:
        seen.append(gc.isenabled())  # handlers run between dispatch and harvest
        return 1

    g.add_node("join", lambda xs: sum(xs), tr.NodeKind.AGGREGATE)
    for k in range(BULK + 10):
        g.add_node(f"w{k}", work)
        g.add_edge("src", f"w{k}")
        g.add_edge(f"w{k}", "join")
    result = await tr.Engine().run(g, 0)
    assert result.output == BULK + 10
    assert seen == [True] * (BULK + 10)
    assert gc.isenabled()


async def test_a_bulk_harvest_that_fails_to_encode_leaves_the_collector_on(
    tmp_path: Path,
) -> None:
    # Every worker returns a value JSON cannot hold: the harvest of the whole
    # batch fails inside the paused stretch (D5), and the run fails with it.
    async with SQLiteStore(tmp_path / "runs.db") as store:
        with pytest.raises(tr.EncodeError):
            await tr.Engine(store=store).run(fan_out(BULK + 10, result={1, 2}), 0)
    assert gc.isenabled()


async def test_a_bulk_dispatch_whose_admission_key_raises_leaves_the_collector_on() -> None:
    class Broken:
        name = "broken"

        def key(self, node: tr.Node, payload: Any, estimate: float | None) -> tuple[float, ...]:
            raise RuntimeError("bad policy")

    with pytest.raises(RuntimeError, match="bad policy"):
        await tr.Engine(capacity=4, admission=Broken()).run(fan_out(BULK + 10), 0)
    assert gc.isenabled()
