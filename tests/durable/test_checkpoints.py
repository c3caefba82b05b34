"""Checkpoints inside a node (P1, P2) and parked stragglers (P3, P4), through the public API.

A long node saves ``current_node().checkpoint(turn)``; a run stopped mid-node,
or a real process SIGKILLed between two checkpoints, resumes the node from its
last committed checkpoint (``current_node().resumed_from``). ``late="park"``
keeps a map's stragglers as parked items; a later map with
``resume_parked=True`` claims them, each exactly once, and continues them from
their checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

import tailrace as tr
from tailrace import current_node
from tailrace.stores import RunStore, open_store
from tests import fixtures

each_store = fixtures.each_store
ROOT = Path(__file__).resolve().parents[2]
GUARD = 30.0


def turns_graph(log: list[tuple[int, int | None]], *, turns: int = 10, hold: Any = None,
                retry: tr.RetryPolicy | None = None, fail_at: int | None = None) -> tr.Graph:  # fmt: skip
    """One long node of ``turns`` turns, a checkpoint after each; it logs (attempt, start)."""
    g = tr.Graph("turns")

    async def long(n: int) -> int:
        ctx = current_node()
        assert ctx is not None
        start = ctx.resumed_from.value["turn"] if ctx.resumed_from else 0
        log.append((ctx.attempt, start))
        for t in range(start, turns):
            if fail_at is not None and t == fail_at and ctx.attempt == 1:
                raise ConnectionError(f"cut at turn {t}")
            if hold is not None and t == turns // 2:
                await hold.wait()
            ctx.checkpoint({"turn": t + 1, "n": n})
            await asyncio.sleep(0)
        return turns

    g.add_node("long", long, retry=retry)
    return g


# -- P1: one row per commit, the latest wins ---------------------------------------------------


async def test_a_checkpoint_replaces_the_previous_one_and_costs_one_row(
    each_store: RunStore,
) -> None:
    log: list[tuple[int, int | None]] = []
    result = await tr.Engine(store=each_store).run(turns_graph(log, turns=50), 3, run_id="p1")
    assert result.output == 50
    stored = await each_store.load_run("p1")
    assert [(c.node_id, c.visit, c.item, c.value_json) for c in stored.checkpoints] == [
        ("long", 1, -1, '{"turn":50,"n":3}')
    ]
    events = await each_store.events("p1")
    assert not any('"turn"' in e.data_json for e in events)  # never repeated in events


async def test_a_checkpoint_the_codec_cannot_encode_is_refused_at_the_call(
    each_store: RunStore,
) -> None:
    g = tr.Graph("bad_checkpoint")
    seen: list[str] = []

    async def node(x: Any) -> str:
        ctx = current_node()
        assert ctx is not None
        try:
            ctx.checkpoint({"socket": object()})
        except tr.EncodeError as exc:
            seen.append(str(exc))
        ctx.checkpoint({"ok": True})
        return "went on"

    g.add_node("node", node)
    result = await tr.Engine(store=each_store).run(g, None, run_id="p1-bad")
    assert result.output == "went on"
    (message,) = seen
    assert "checkpoint of node 'node' (visit 1, attempt 1) cannot be encoded" in message
    stored = await each_store.load_run("p1-bad")
    assert [c.value_json for c in stored.checkpoints] == ['{"ok":true}']


async def test_a_huge_checkpoint_is_stored_once(each_store: RunStore) -> None:
    g = tr.Graph("huge")
    blob = "x" * 1_000_000

    async def node(x: Any) -> str:
        ctx = current_node()
        assert ctx is not None
        for turn in range(20):
            ctx.checkpoint({"turn": turn, "blob": blob})
            await asyncio.sleep(0)
        return "ok"

    g.add_node("node", node)
    await tr.Engine(store=each_store).run(g, None, run_id="huge")
    stored = await each_store.load_run("huge")
    assert len(stored.checkpoints) == 1 and '"turn":19' in stored.checkpoints[0].value_json
    total = sum(len(e.data_json) for e in await each_store.events("huge"))
    assert total < 10_000  # the blob is in no event
    assert all(len(row.data_json) < 10_000 for row in stored.nodes.values())


async def test_map_items_checkpoint_each_on_their_own(each_store: RunStore) -> None:
    g = tr.Graph("item_checkpoints")
    g.add_node("items", lambda n: list(range(n)))

    async def each(x: int) -> int:
        ctx = current_node()
        assert ctx is not None
        ctx.checkpoint({"item": ctx.item, "x": x})
        return x

    g.add_node("each", each, "map")
    g.chain("items", "each")
    await tr.Engine(store=each_store).run(g, 3, run_id="p1-items")
    stored = await each_store.load_run("p1-items")
    assert [(c.node_id, c.item) for c in stored.checkpoints] == [
        ("each", 0),
        ("each", 1),
        ("each", 2),
    ]


# -- P2: what a new attempt resumes from ----------------------------------------------------


async def test_a_retry_with_resume_continues_from_the_latest_checkpoint(
    each_store: RunStore,
) -> None:
    log: list[tuple[int, int | None]] = []
    g = turns_graph(log, retry=tr.RetryPolicy(attempts=2, resume=True), fail_at=6)
    assert (await tr.Engine(store=each_store).run(g, 1)).output == 10
    assert log == [(1, 0), (2, 6)]


async def test_each_retry_resumes_from_the_checkpoint_as_saved_not_as_a_try_changed_it(
    each_store: RunStore,
) -> None:
    """A try that changes the value it resumed from (and fails before saving) leaves the
    checkpoint as saved: the next try reads what a resume after a crash would read (P2)."""
    seen: list[Any] = []
    g = tr.Graph("mutates")

    async def steps(_: int) -> int:
        ctx = current_node()
        assert ctx is not None
        if ctx.resumed_from is None:
            ctx.checkpoint({"done": [1]})
            raise ConnectionError("cut after the first step")
        seen.append(list(ctx.resumed_from.value["done"]))
        ctx.resumed_from.value["done"].append(ctx.attempt)  # its own working copy
        if ctx.attempt < 3:
            raise ConnectionError(f"cut in try {ctx.attempt}")
        return len(seen)

    g.add_node("steps", steps, retry=tr.RetryPolicy(attempts=3, resume=True))
    assert (await tr.Engine(store=each_store).run(g, 0)).output == 2
    assert seen == [[1], [1]]


async def test_a_retry_without_resume_starts_over(each_store: RunStore) -> None:
    log: list[tuple[int, int | None]] = []
    g = turns_graph(log, retry=tr.RetryPolicy(attempts=2), fail_at=6)
    assert (await tr.Engine(store=each_store).run(g, 1)).output == 10
    assert log == [(1, 0), (2, 0)]


def test_resume_is_part_of_the_retry_policys_json_form() -> None:
    g = tr.Graph("json_resume")
    g.add_node("n", print, retry=tr.RetryPolicy(attempts=2, resume=True))
    doc = g.to_dict()
    assert doc["nodes"][0]["retry"]["resume"] is True
    assert tr.Graph.from_dict(doc).nodes["n"].retry == tr.RetryPolicy(attempts=2, resume=True)
    with pytest.raises(tr.GraphError, match="resume must be True or False"):
        tr.RetryPolicy(resume="yes")  # type: ignore[arg-type]


async def test_a_stopped_node_resumes_from_its_last_committed_checkpoint(
    each_store: RunStore,
) -> None:
    log: list[tuple[int, int | None]] = []
    hold = asyncio.Event()
    g = turns_graph(log, hold=hold)
    engine = tr.Engine(store=each_store, durability="sync")
    run = asyncio.ensure_future(engine.run(g, 7, run_id="p2-stop"))
    await fixtures.until(lambda: log, "the node started")

    async def five_committed() -> bool:
        stored = await each_store.load_run("p2-stop")
        return any('"turn":5' in c.value_json for c in stored.checkpoints)

    await fixtures.until(five_committed, "turn 5 committed")
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    hold.set()
    seen: list[tr.Checkpoint | None] = []
    original = g.nodes["long"].handler

    async def spy(n: int) -> int:
        ctx = current_node()
        assert ctx is not None
        seen.append(ctx.resumed_from)
        return int(await original(n))

    g2 = tr.Graph("turns")
    g2.add_node("long", spy)
    result = await tr.Engine(store=each_store).resume("p2-stop", g2, force=True)
    assert result.output == 10
    (checkpoint,) = seen
    assert checkpoint is not None
    assert checkpoint.value == {"turn": 5, "n": 7}
    assert (checkpoint.run_id, checkpoint.node_id, checkpoint.visit, checkpoint.item) == (
        "p2-stop",
        "long",
        1,
        None,
    )
    assert checkpoint.saved_at > 0
    assert log[-1] == (2, 5)  # the cut attempt runs again as the next try, from turn 5


# -- P2 across a SIGKILL ---------------------------------------------------------------------


@contextlib.asynccontextmanager
async def shared_target(kind: str, tmp_path: Path) -> AsyncIterator[str]:
    if kind == "sqlite":
        yield str(tmp_path / "runs.db")
        return
    assert fixtures.POSTGRES_DSN is not None
    async with fixtures.postgres_schema("tailrace_cp_kill") as schema:
        separator = "&" if "?" in fixtures.POSTGRES_DSN else "?"
        yield f"{fixtures.POSTGRES_DSN}{separator}schema={schema}"


@pytest.mark.slow  # a child process per store, killed between two checkpoints
@pytest.mark.parametrize("kind", fixtures.SHARED_STORES)
async def test_sigkill_between_checkpoints_resumes_from_the_last_committed_one(
    kind: str, tmp_path: Path
) -> None:
    from tests.durable import checkpoint_graphs as graphs

    log_path = tmp_path / "turns.log"
    async with shared_target(kind, tmp_path) as target:
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.durable.checkpoint_graphs", target, "cp-kill",
            str(log_path), cwd=ROOT,
        )  # fmt: skip
        try:
            async with open_store(target) as store:

                async def at_turn_90() -> bool:
                    try:
                        stored = await store.load_run("cp-kill")
                    except tr.RunNotFound:
                        return False
                    return any(int(c.value_json) >= 90 for c in stored.checkpoints)

                await fixtures.until(at_turn_90, "turn 90 committed", guard=GUARD)
                os.kill(child.pid, signal.SIGKILL)
                await child.wait()
                stored = await store.load_run("cp-kill")
                committed = int(stored.checkpoints[0].value_json)
                done_at_kill = graphs.turns_done(log_path)
                graphs.LOG[:] = [log_path]
                result = await tr.Engine(store=store, durability="sync").resume(
                    "cp-kill", graphs.graph
                )
        finally:
            if child.returncode is None:
                child.kill()
                await child.wait()
    assert result.output == graphs.TURNS
    assert committed < graphs.TURNS
    after = graphs.turns_done(log_path)[len(done_at_kill) :]
    assert after[0] == committed + 1  # resumed from the last committed checkpoint
    repeated = set(after) & set(done_at_kill)
    assert len(repeated) <= 1, f"more than one turn ran twice: {sorted(repeated)}"


# -- P3, P4: parking ---------------------------------------------------------------------------


def rollouts(
    log: list[tuple[str, int, Any]], late: str = "park", max_parks: int = tr.graph.MAX_PARKS
) -> tr.Graph:
    """Six rollouts per round, four kept; rollouts 4 and 5 are slow, park and continue later
    (each at most ``max_parks`` times: then it runs to completion, P5)."""
    g = tr.Graph("parked_rollouts")

    @g.task()
    def prompts(round: int) -> list[dict[str, int]]:
        return [{"round": round, "x": x} for x in range(6)]

    async def roll(prompt: dict[str, int]) -> dict[str, Any]:
        ctx = current_node()
        assert ctx is not None
        resumed = ctx.resumed_from
        start = resumed.value if resumed is not None else 0
        log.append(("start", prompt["x"], resumed and (resumed.run_id, resumed.item, start)))
        slow = prompt["x"] >= 4 and resumed is None
        for turn in range(start, 3):
            ctx.checkpoint(turn + 1)
            await asyncio.sleep(0.2 if slow else 0.001)
        return {"prompt": prompt, "from": start}

    g.add_node("roll", roll, "map", required=4, late=late, resume_parked=True, max_parks=max_parks)
    g.chain("prompts", "roll")
    return g


async def test_parked_stragglers_are_kept_then_claimed_first_and_continued(
    each_store: RunStore,
) -> None:
    log: list[tuple[str, int, Any]] = []
    engine = tr.Engine(store=each_store)
    g = rollouts(log)
    first = await engine.run(g, 1, run_id="round-1")
    assert [r["prompt"]["x"] for r in first.output] == [0, 1, 2, 3]
    assert [(x.item, x.reason) for x in first.late_inputs] == [(4, "parked"), (5, "parked")]
    parked = await engine.parked(g, "roll")
    assert [(p.run_id, p.item, p.value_json, p.status) for p in parked] == [
        ("round-1", 4, '{"round":1,"x":4}', "parked"),
        ("round-1", 5, '{"round":1,"x":5}', "parked"),
    ]
    assert all(p.checkpoint_json is not None and int(p.checkpoint_json) >= 1 for p in parked)
    log.clear()
    second = await engine.run(g, 2, run_id="round-2")
    # The parked items are the map's first items, in parked order, run from their checkpoint.
    starts = [entry for entry in log if entry[1] in (4, 5) and entry[2] is not None]
    assert sorted((x, resumed[0], resumed[1]) for _, x, resumed in starts) == [
        (4, "round-1", 4),
        (5, "round-1", 5),
    ]
    kept = [(r["prompt"]["round"], r["prompt"]["x"]) for r in second.output]
    assert kept[:2] == [(1, 4), (1, 5)]  # round 1's stragglers completed, and listed first
    assert all(r["from"] >= 1 for r in second.output[:2])
    claimed = await engine.parked(g, "roll", every=True)
    assert [p.status for p in claimed if p.run_id == "round-1"] == ["claimed", "claimed"]
    assert {p.claimed_by for p in claimed if p.run_id == "round-1"} == {"round-2/roll/1"}


async def test_parked_items_can_be_dropped_and_never_expire_silently(each_store: RunStore) -> None:
    log: list[tuple[str, int, Any]] = []
    engine = tr.Engine(store=each_store)
    g = rollouts(log)
    await engine.run(g, 1, run_id="drop-1")
    first, second = await engine.parked(g)
    assert await engine.drop_parked(first.park_id) is True
    assert await engine.drop_parked(first.park_id) is False  # dropped once
    assert [p.park_id for p in await engine.parked(g)] == [second.park_id]
    statuses = {p.park_id: p.status for p in await engine.parked(g, every=True)}
    assert statuses == {first.park_id: "dropped", second.park_id: "parked"}
    with pytest.raises(ValueError, match="park_id must be a non-empty string"):
        await engine.drop_parked("")


async def test_an_aggregate_with_late_park_parks_its_straggling_input(
    each_store: RunStore,
) -> None:
    g = tr.Graph("agg_park")
    g.add_node("start", lambda x: x)

    async def quick(x: str) -> str:
        return f"quick {x}"

    async def slow(x: str) -> str:
        ctx = current_node()
        assert ctx is not None
        ctx.checkpoint({"half": x})
        await asyncio.sleep(GUARD)
        return f"slow {x}"

    g.add_node("quick", quick)
    g.add_node("slow", slow)
    g.add_node("first", lambda xs: xs, "aggregate", required=1, late="park")
    for name in ("quick", "slow"):
        g.add_edge("start", name)
        g.add_edge(name, "first")
    engine = tr.Engine(store=each_store)
    result = await asyncio.wait_for(engine.run(g, "job", run_id="agg-park"), GUARD)
    assert result.output == ["quick job"]
    assert [(x.source_id, x.reason) for x in result.late_inputs] == [("slow", "parked")]
    (row,) = await engine.parked(g, "slow")
    assert (row.item, row.value_json, row.checkpoint_json) == (-1, '"job"', '{"half":"job"}')


async def test_racing_claimers_each_get_distinct_parked_items(tmp_path: Path) -> None:
    for kind in fixtures.SHARED_STORES:
        name = kind if isinstance(kind, str) else kind.values[0]
        if name == "postgres" and fixtures.POSTGRES_DSN is None:
            continue
        async with shared_target(name, tmp_path) as target:
            log: list[tuple[str, int, Any]] = []
            async with open_store(target) as store:
                engine = tr.Engine(store=store)
                g = rollouts(log, max_parks=100)  # every straggler stays parked (no P5)
                for r in range(10):
                    await engine.run(g, r, run_id=f"seed-{r}")
                before = {r.park_id for r in await engine.parked(g)}
                assert len(before) == 20
            stores = [open_store(target) for _ in range(4)]
            for s in stores:
                await s.open()
            try:
                claims = await asyncio.gather(
                    *(
                        s.claim_parked("parked_rollouts", "roll", f"claimer-{n}", limit=3)
                        for n, s in enumerate(stores)
                        for _ in range(3)
                    )
                )
            finally:
                for s in stores:
                    await s.close()
            held: dict[int, set[str]] = {n: set() for n in range(4)}
            for call, rows in enumerate(claims):
                held[call // 3] |= {row.park_id for row in rows}
                assert all(row.claimed_by == f"claimer-{call // 3}" for row in rows)
            # Each claimer got its own items; no item went to two claimers; none was lost.
            for a in range(4):
                for b in range(a + 1, 4):
                    assert not held[a] & held[b]
            async with open_store(target) as store:
                rest = {
                    r.park_id for r in await store.claim_parked("parked_rollouts", "roll", "sweep")
                }
            claimed = set().union(*held.values())
            assert not rest & claimed
            assert claimed | rest == before
