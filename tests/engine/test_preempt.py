"""Preemption at turn boundaries: ``Engine.preempt`` and ``Engine.resume(patch=...)``.

A *turn boundary* is an edge inside a loop. ``preempt`` parks every in-loop
delivery instead of re-activating its target; attempts in flight finish; once
nothing else can run the run is stored ``suspended`` and ``Engine.run`` returns
``RunResult(status="suspended", preempted=True)``. ``resume`` replays the parked
deliveries through ``patch`` (partial rollouts).

The loop under test is ``start -> turn -> more (switch) -> turn | finish``; its
payload carries a ``conversation`` list and the ``rendered`` text each turn
reads. Orderings are forced with ``asyncio.Event``s the test controls; the
``HANG_GUARD`` timeout only turns a deadlock into a failure, it never times
anything.
"""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import tailrace as tr
from tailrace._errors import LeaseHeld, NotResumable
from tailrace.stores import MemoryStore, RunStore, SQLiteStore
from tests import fixtures
from tests.fixtures import POSTGRES_DSN

HANG_GUARD = 15.0


# --- the scripted loop ------------------------------------------------------------------


class Script:
    """Records every handler call and holds the ones the test names until released.

    A call is labelled ``"turn0"``, ``"turn1"``, ... (by the turn index in the
    payload, 0-based: ``turn<k-1>`` is visit ``k``), ``"finish"``, ``"review"``.
    """

    def __init__(self, *hold: str) -> None:
        self.hold = set(hold)
        self.entered: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)
        self.release: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)
        self.calls: list[tuple[int, str]] = []

    async def enter(self, label: str) -> None:
        self.entered[label].set()
        if label in self.hold:
            await self.release[label].wait()

    async def reached(self, label: str) -> None:
        async with asyncio.timeout(HANG_GUARD):
            await self.entered[label].wait()


def chat_graph(script: Script, *, turns: int = 5, gate: bool = False) -> tr.Graph:
    """``start -> turn -> more -> turn | finish``; with ``gate``, also ``start -> review -> ship``."""
    g = tr.Graph("chat")

    @g.task()
    async def start(state: dict[str, Any]) -> dict[str, Any]:
        return state

    @g.task(max_visits=50)
    async def turn(state: dict[str, Any]) -> dict[str, Any]:
        n, rendered = state["turn"], state["rendered"]
        script.calls.append((n, rendered))
        await script.enter(f"turn{n}")
        return {
            **state,
            "turn": n + 1,
            "conversation": [*state["conversation"], f"t{n}@{rendered}"],
        }

    @g.switch()
    async def more(state: dict[str, Any]) -> str:
        return "again" if state["turn"] < turns else "done"

    @g.task()
    async def finish(state: dict[str, Any]) -> list[str]:
        await script.enter("finish")
        return list(state["conversation"])

    g.add_edge("start", "turn")
    g.add_edge("turn", "more")
    g.add_edge("more", "turn", route="again")
    g.add_edge("more", "finish", route="done")
    if gate:

        @g.gate()
        async def review(state: dict[str, Any]) -> str:
            await script.enter("review")
            return "approve?"

        @g.task()
        async def ship(answer: Any) -> Any:
            return {"shipped": answer}

        g.chain("start", "review", "ship")
    return g


def first_input(rendered: str = "v1") -> dict[str, Any]:
    return {"turn": 0, "rendered": rendered, "conversation": []}


def conversation(*turns: tuple[int, str]) -> list[str]:
    return [f"t{n}@{rendered}" for n, rendered in turns]


async def preempt_during(
    engine: tr.Engine, graph: tr.Graph, script: Script, label: str, run_id: str
) -> tr.RunResult:
    """Run ``graph``, preempt it while the call ``label`` is held, then let that call finish."""
    script.hold.add(label)
    running = asyncio.create_task(engine.run(graph, first_input(), run_id=run_id))
    await script.reached(label)
    assert engine.preempt(run_id) is True
    script.release[label].set()
    async with asyncio.timeout(HANG_GUARD):
        return await running


# --- stores ------------------------------------------------------------------------------


@dataclass
class Backend:
    """A store and a way to open another store object on the same database."""

    name: str
    store: RunStore
    #: A fresh, unopened store on the same data (the same object for memory).
    reopen: Callable[[], RunStore]


async def _postgres(dsn: str) -> AsyncIterator[Backend]:
    from tailrace.stores import PostgresStore

    async with fixtures.postgres_schema("tailrace_preempt") as schema:

        def reopen() -> RunStore:
            return PostgresStore(dsn, schema=schema)

        async with reopen() as store:
            yield Backend("postgres", store, reopen)


@pytest.fixture(params=fixtures.ALL_STORES)
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    """Each store in turn, on a fresh database."""
    if request.param == "memory":
        memory = MemoryStore()
        async with memory:
            yield Backend("memory", memory, lambda: memory)
    elif request.param == "sqlite":
        path = tmp_path / "runs.db"
        async with SQLiteStore(path) as store:
            yield Backend("sqlite", store, lambda: SQLiteStore(path))
    else:
        assert POSTGRES_DSN is not None
        async for value in _postgres(POSTGRES_DSN):
            yield value


async def opened(store: RunStore, action: Callable[[RunStore], Awaitable[Any]]) -> Any:
    """Run ``action`` on ``store``, opening and closing it unless it is already open."""
    if isinstance(store, MemoryStore):
        return await action(store)  # the one shared object: its owner closes it
    async with store:
        return await action(store)


# --- preempt stops at the next turn boundary ---------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 4])
async def test_preempt_while_visit_k_runs_stops_after_exactly_k_visits(
    backend: Backend, k: int
) -> None:
    script = Script()
    graph = chat_graph(script)
    engine = tr.Engine(store=backend.store)
    result = await preempt_during(engine, graph, script, f"turn{k - 1}", "r-stop")
    assert result.status == "suspended"
    assert result.preempted is True
    assert result.visits["turn"] == k
    assert result.visits["more"] == k - 1  # the boundary turn -> more was parked
    assert result.visits["finish"] == 0
    assert result.output is None
    assert result.questions == ()
    assert script.calls == [(n, "v1") for n in range(k)]
    stored = await backend.store.load_run("r-stop")
    assert stored.run.status == "suspended"
    suspended = [
        json.loads(e.data_json)
        for e in await backend.store.events("r-stop")
        if e.type == "run_suspended"
    ]
    assert suspended and suspended[-1]["reason"] == "preempted"


async def test_a_run_that_is_not_preempted_reports_preempted_false(backend: Backend) -> None:
    script = Script()
    result = await tr.Engine(store=backend.store).run(chat_graph(script, turns=2), first_input())
    assert result.status == "completed" and result.preempted is False
    assert result.output == conversation((0, "v1"), (1, "v1"))


# --- resume with a patch -----------------------------------------------------------------


async def test_resume_with_a_dict_patch_continues_the_conversation(backend: Backend) -> None:
    script = Script()
    graph = chat_graph(script)
    engine = tr.Engine(store=backend.store)
    await preempt_during(engine, graph, script, "turn1", "r-dict")
    result = await engine.resume("r-dict", graph, patch={"rendered": "v2"})
    assert result.status == "completed" and result.preempted is False
    assert result.output == conversation((0, "v1"), (1, "v1"), (2, "v2"), (3, "v2"), (4, "v2"))
    assert script.calls == [(0, "v1"), (1, "v1"), (2, "v2"), (3, "v2"), (4, "v2")]
    assert result.visits["turn"] == 5 and result.visits["finish"] == 1


async def test_resume_with_a_function_patch_applies_it_once_to_the_parked_value(
    backend: Backend,
) -> None:
    script = Script()
    graph = chat_graph(script)
    engine = tr.Engine(store=backend.store)
    await preempt_during(engine, graph, script, "turn2", "r-fn")
    seen: list[dict[str, Any]] = []

    def patch(value: dict[str, Any]) -> dict[str, Any]:
        seen.append(value)
        return {**value, "rendered": value["rendered"] + "+"}

    result = await engine.resume("r-fn", graph, patch=patch)
    assert result.status == "completed"
    # The parked value is the boundary turn's output, conversation and all.
    assert seen == [
        {"turn": 3, "rendered": "v1", "conversation": conversation((0, "v1"), (1, "v1"), (2, "v1"))}
    ]
    assert script.calls == [(0, "v1"), (1, "v1"), (2, "v1"), (3, "v1+"), (4, "v1+")]
    assert result.output == conversation((0, "v1"), (1, "v1"), (2, "v1"), (3, "v1+"), (4, "v1+"))


async def test_resume_without_a_patch_replays_the_parked_values_as_they_were(
    backend: Backend,
) -> None:
    script = Script()
    graph = chat_graph(script, turns=3)
    engine = tr.Engine(store=backend.store)
    await preempt_during(engine, graph, script, "turn0", "r-plain")
    result = await engine.resume("r-plain", graph)
    assert result.status == "completed"
    assert result.output == conversation((0, "v1"), (1, "v1"), (2, "v1"))
    assert script.calls == [(0, "v1"), (1, "v1"), (2, "v1")]


# --- durability --------------------------------------------------------------------------


async def test_a_fresh_engine_on_a_fresh_store_object_resumes_the_preempted_run(
    backend: Backend,
) -> None:
    script = Script()
    graph = chat_graph(script)
    first = await preempt_during(
        tr.Engine(store=backend.store), graph, script, "turn1", "r-durable"
    )
    assert first.preempted

    async def resume(store: RunStore) -> tr.RunResult:
        again = chat_graph(script)  # a new Graph object with the same structure
        return await tr.Engine(store=store).resume("r-durable", again, patch={"rendered": "v2"})

    result = await opened(backend.reopen(), resume)
    assert result.status == "completed"
    assert result.output == conversation((0, "v1"), (1, "v1"), (2, "v2"), (3, "v2"), (4, "v2"))
    assert script.calls == [(0, "v1"), (1, "v1"), (2, "v2"), (3, "v2"), (4, "v2")]
    assert (await backend.store.load_run("r-durable")).run.status == "completed"


async def test_sqlite_file_survives_closing_every_store_before_the_resume(tmp_path: Path) -> None:
    path = tmp_path / "preempt.db"
    script = Script()
    async with SQLiteStore(path) as store:
        await preempt_during(
            tr.Engine(store=store), chat_graph(script, turns=4), script, "turn0", "r-file"
        )
    async with SQLiteStore(path) as store:
        result = await tr.Engine(store=store).resume(
            "r-file", chat_graph(script, turns=4), patch={"rendered": "v9"}
        )
    assert result.output == conversation((0, "v1"), (1, "v9"), (2, "v9"), (3, "v9"))
    assert script.calls == [(0, "v1"), (1, "v9"), (2, "v9"), (3, "v9")]


# --- what preempt refuses or cannot stop -------------------------------------------------


async def test_preempt_returns_false_for_a_run_this_engine_does_not_drive(
    backend: Backend,
) -> None:
    script = Script("turn0")
    graph = chat_graph(script, turns=2)
    driver, bystander = tr.Engine(store=backend.store), tr.Engine(store=backend.store)
    assert driver.preempt("no-such-run") is False
    running = asyncio.create_task(driver.run(graph, first_input(), run_id="r-other"))
    await script.reached("turn0")
    assert bystander.preempt("r-other") is False  # another engine drives it
    script.release["turn0"].set()
    async with asyncio.timeout(HANG_GUARD):
        result = await running
    assert result.status == "completed" and result.preempted is False
    assert driver.preempt("r-other") is False  # finished: nobody drives it any more


async def test_preempting_a_run_whose_loop_has_no_further_turns_completes_it(
    backend: Backend,
) -> None:
    script = Script()
    graph = chat_graph(script, turns=2)
    engine = tr.Engine(store=backend.store)
    result = await preempt_during(engine, graph, script, "finish", "r-done")
    assert result.status == "completed" and result.preempted is False
    assert result.output == conversation((0, "v1"), (1, "v1"))
    assert (await backend.store.load_run("r-done")).run.status == "completed"


async def test_preempting_a_run_without_loops_completes_it(backend: Backend) -> None:
    entered, release = asyncio.Event(), asyncio.Event()
    g = tr.Graph("straight")

    @g.task()
    async def first(x: int) -> int:
        entered.set()
        await release.wait()
        return x + 1

    @g.task()
    async def second(x: int) -> int:
        return x * 10

    g.chain("first", "second")
    engine = tr.Engine(store=backend.store)
    running = asyncio.create_task(engine.run(g, 1, run_id="r-straight"))
    async with asyncio.timeout(HANG_GUARD):
        await entered.wait()
    assert engine.preempt("r-straight") is True
    release.set()
    async with asyncio.timeout(HANG_GUARD):
        result = await running
    assert result.status == "completed" and result.preempted is False
    assert result.output == 20


async def test_preempt_on_an_engine_without_a_store_raises_not_resumable() -> None:
    script = Script("turn0")
    engine = tr.Engine()
    running = asyncio.create_task(
        engine.run(chat_graph(script, turns=2), first_input(), run_id="r-mem")
    )
    await script.reached("turn0")
    with pytest.raises(NotResumable):
        engine.preempt("r-mem")
    script.release["turn0"].set()
    async with asyncio.timeout(HANG_GUARD):
        result = await running
    assert result.status == "completed" and result.preempted is False  # nothing was parked
    assert result.output == conversation((0, "v1"), (1, "v1"))


# --- a gate open at the same time --------------------------------------------------------


async def test_preempt_with_a_gate_open_suspends_with_both(backend: Backend) -> None:
    script = Script()
    graph = chat_graph(script, turns=4, gate=True)
    engine = tr.Engine(store=backend.store)
    script.hold.add("turn1")
    running = asyncio.create_task(engine.run(graph, first_input(), run_id="r-gate"))
    await script.reached("turn1")
    await script.reached("review")
    assert engine.preempt("r-gate") is True
    script.release["turn1"].set()
    async with asyncio.timeout(HANG_GUARD):
        result = await running
    assert result.status == "suspended" and result.preempted is True
    assert result.visits["turn"] == 2 and result.visits["ship"] == 0
    [question] = result.questions
    assert question.node_id == "review"

    # The loop goes on first; the gate still waits, so the run suspends on it alone.
    resumed = await engine.resume("r-gate", graph, patch={"rendered": "v2"})
    assert resumed.status == "suspended" and resumed.preempted is False
    assert [q.question_id for q in resumed.questions] == [question.question_id]
    assert resumed.results["finish"] == conversation((0, "v1"), (1, "v1"), (2, "v2"), (3, "v2"))

    done = await engine.answer(question.question_id, "yes", by="alice")
    assert done is not None and done.status == "completed"
    assert done.output == {
        "finish": conversation((0, "v1"), (1, "v1"), (2, "v2"), (3, "v2")),
        "ship": {"shipped": "yes"},
    }
    assert script.calls == [(0, "v1"), (1, "v1"), (2, "v2"), (3, "v2")]


async def test_an_answer_and_a_patch_are_applied_by_one_resume(backend: Backend) -> None:
    script = Script()
    graph = chat_graph(script, turns=3, gate=True)
    engine = tr.Engine(store=backend.store)
    script.hold.add("turn0")
    running = asyncio.create_task(engine.run(graph, first_input(), run_id="r-both"))
    await script.reached("turn0")
    await script.reached("review")
    engine.preempt("r-both")
    script.release["turn0"].set()
    async with asyncio.timeout(HANG_GUARD):
        result = await running
    [question] = result.questions
    assert await engine.answer(question.question_id, "ok", resume=False) is None
    done = await engine.resume("r-both", graph, patch={"rendered": "v2"})
    assert done.status == "completed"
    assert done.output == {
        "finish": conversation((0, "v1"), (1, "v2"), (2, "v2")),
        "ship": {"shipped": "ok"},
    }


# --- two resumes of one preempted run ----------------------------------------------------


async def test_a_second_resume_while_the_first_drives_gets_lease_held(backend: Backend) -> None:
    script = Script()
    graph = chat_graph(script, turns=4)
    await preempt_during(tr.Engine(store=backend.store), graph, script, "turn1", "r-twice")
    first, second = tr.Engine(store=backend.store), tr.Engine(store=backend.store)
    script.hold.add("turn2")
    driving = asyncio.create_task(first.resume("r-twice", graph, patch={"rendered": "v2"}))
    await script.reached("turn2")
    with pytest.raises(LeaseHeld):
        await second.resume("r-twice", graph, patch={"rendered": "v3"})
    with pytest.raises(LeaseHeld):  # the same engine refuses a second driver too (D6)
        await first.resume("r-twice", graph, patch={"rendered": "v3"})
    script.release["turn2"].set()
    async with asyncio.timeout(HANG_GUARD):
        result = await driving
    assert result.status == "completed"
    with pytest.raises(NotResumable):
        await second.resume("r-twice", graph, patch={"rendered": "v3"})
    assert script.calls == [(0, "v1"), (1, "v1"), (2, "v2"), (3, "v2")]
    assert result.output == conversation((0, "v1"), (1, "v1"), (2, "v2"), (3, "v2"))


async def test_concurrent_resumes_run_each_turn_once(backend: Backend) -> None:
    script = Script()
    graph = chat_graph(script, turns=5)
    await preempt_during(tr.Engine(store=backend.store), graph, script, "turn0", "r-race")
    a, b = tr.Engine(store=backend.store), tr.Engine(store=backend.store)
    outcomes = await asyncio.gather(
        a.resume("r-race", graph, patch={"rendered": "va"}),
        b.resume("r-race", graph, patch={"rendered": "vb"}),
        return_exceptions=True,
    )
    results = [o for o in outcomes if isinstance(o, tr.RunResult)]
    refused = [o for o in outcomes if not isinstance(o, tr.RunResult)]
    assert len(results) == 1 and results[0].status == "completed"
    assert len(refused) == 1 and isinstance(refused[0], LeaseHeld | NotResumable), refused
    turns = [n for n, _ in script.calls]
    assert turns == [0, 1, 2, 3, 4]  # every turn exactly once, in order
    winner = {rendered for n, rendered in script.calls if n > 0}
    assert len(winner) == 1  # the later turns all saw one resume's patch
    assert results[0].output == ["t0@v1", *(f"t{n}@{next(iter(winner))}" for n in range(1, 5))]
