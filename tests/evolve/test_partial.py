"""Partial rollouts: a straggling loop-graph rollout is preempted and resumed on a newer head.

Two workers on shards ``[t0, t2]`` and ``[t1, t3]``. ``t0``'s first rollout is
the straggler: a scripted estimator gives it a short timer (and everything
else an hour, so nothing else straggles), and its second turn waits, on
``asyncio.Event``s, until the timer has preempted the run and (in the main
scenario) worker 1's proposals have been committed. The run then stops at
that turn's boundary; worker 0 resumes it against the newer head. The
``HANG_GUARD`` timeout only turns a deadlock into a failure.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import tailrace as tr
from tailrace.evolve import (
    Artifact,
    Edit,
    EvolutionResult,
    Ledger,
    Progress,
    Task,
    async_evolve,
    current_rollout,
)
from tailrace.stores import MemoryStore, RunStatus, RunStore, SQLiteStore
from tailrace.tail import DurationEstimator, ResumeItem, ResumeQueue

HANG_GUARD = 30.0
TURNS = 4
SLOW_COST = 7.0  # t0's cost: the only one the estimator expects to be quick


@dataclass(frozen=True)
class TurnCall:
    run_id: str
    task_id: str
    turn: int
    rendered: str
    version: int
    resumed: bool


@dataclass
class Scenario:
    """What the rollout graph and the loop's hooks saw."""

    wait_for_commit: bool
    calls: list[TurnCall] = field(default_factory=list)
    outputs: dict[str, list[Any]] = field(default_factory=dict)
    pushed: list[ResumeItem] = field(default_factory=list)
    preempts: list[tuple[str, bool]] = field(default_factory=list)
    preempted: asyncio.Event = field(default_factory=asyncio.Event)
    committed: asyncio.Event = field(default_factory=asyncio.Event)


class ScriptedEstimator(DurationEstimator):
    """Expects the first rollout of cost ``SLOW_COST`` to take 20 ms; everything else an hour."""

    def __init__(self) -> None:
        super().__init__(prior=3600.0)
        self.quick = 1

    def estimate(self, cost: float) -> float:
        if cost == SLOW_COST and self.quick:
            self.quick -= 1
            return 0.02
        return 3600.0


class RecordingQueue(ResumeQueue):
    def __init__(self, scenario: Scenario, max_attempts: int = 1) -> None:
        super().__init__(max_attempts)
        self.scenario = scenario

    def push(self, item: ResumeItem) -> bool:
        self.scenario.pushed.append(item)
        return super().push(item)


@pytest.fixture
def spy_preempt(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Scenario]]:
    """Route every ``Engine.preempt`` through the scenario the test registers."""
    registered: list[Scenario] = []
    original = tr.Engine.preempt

    def preempt(self: tr.Engine, run_id: str) -> bool:
        ok = original(self, run_id)
        for scenario in registered:
            scenario.preempts.append((run_id, ok))
            if ok:
                scenario.preempted.set()
        return ok

    monkeypatch.setattr(tr.Engine, "preempt", preempt)
    yield registered


def rollout_graph(scenario: Scenario) -> tr.Graph:
    """``begin -> turn -> more -> turn | finish``: each turn reads ``rendered`` from the loop payload."""
    g = tr.Graph("rollout")

    @g.task()
    async def begin(given: dict[str, Any]) -> dict[str, Any]:
        task = given["task"]
        return {"rendered": given["rendered"], "task": task["id"], "turn": 0, "conversation": []}

    @g.task(max_visits=20)
    async def turn(state: dict[str, Any]) -> dict[str, Any]:
        ctx, node = current_rollout(), tr.current_node()
        assert ctx is not None and node is not None
        n = state["turn"]
        if ctx.phase == "train":
            scenario.calls.append(
                TurnCall(node.run_id, state["task"], n, state["rendered"], ctx.version, ctx.resumed)
            )
            if state["task"] == "t0" and n == 1 and not ctx.resumed:
                await scenario.preempted.wait()  # the straggler timer fired
                if scenario.wait_for_commit:
                    await scenario.committed.wait()  # and the head moved on meanwhile
        said = {"turn": n, "rendered": state["rendered"]}
        return {**state, "turn": n + 1, "conversation": [*state["conversation"], said]}

    @g.switch()
    async def more(state: dict[str, Any]) -> str:
        return "again" if state["turn"] < TURNS else "done"

    @g.task()
    async def finish(state: dict[str, Any]) -> dict[str, Any]:
        node = tr.current_node()
        assert node is not None
        return {
            "run_id": node.run_id,
            "conversation": state["conversation"],
            "rendered": state["rendered"],
        }

    g.add_edge("begin", "turn")
    g.add_edge("turn", "more")
    g.add_edge("more", "turn", route="again")
    g.add_edge("more", "finish", route="done")
    return g


def tasks() -> list[Task]:
    return [
        Task(id=f"t{i}", prompt=f"task {i}", meta={"cost": SLOW_COST if i == 0 else 1.0})
        for i in range(8)
    ]


async def run_scenario(
    scenario: Scenario,
    store: RunStore,
    *,
    proposals: bool,
    queue: ResumeQueue | None,
    estimator: DurationEstimator | None = None,
) -> tuple[Any, dict[str, int]]:
    """Run the evolution; returns the result and a map rendered text -> ledger version."""
    counter = itertools.count(1)

    async def reward(task: Task, output: dict[str, Any]) -> float:
        ctx = current_rollout()
        assert ctx is not None and ctx.task_id == task.id
        if ctx.phase == "train":
            scenario.outputs.setdefault(task.id, []).append(output)
        return 0.0 if "rev: 0" in output["rendered"] else 1.0  # any edit beats version 1

    def propose(rendered: str, task: Task, output: Any, value: float) -> Edit | None:
        return Edit(set={"rev": str(next(counter))}) if proposals else None

    def progress(report: Progress) -> None:
        if report.version > 1:
            scenario.committed.set()

    async with asyncio.timeout(HANG_GUARD):
        result = await async_evolve(
            tasks(),
            reward,
            run=rollout_graph(scenario),
            propose=propose,
            artifact={"rev": "0"},
            store=store,
            workers=2,  # shards: [t0, t2] and [t1, t3]
            held_out_frac=0.5,
            max_rollouts=8,
            duration_estimator=estimator or ScriptedEstimator(),
            resume_queue=queue,
            progress=progress,
        )
    history = await Ledger(store, "artifact", Artifact()).history()
    return result, {v.rendered: v.version for v in history}


def straggler_calls(scenario: Scenario) -> list[TurnCall]:
    """The turns of t0's first rollout (the straggler), across its preemption: one run id."""
    first = next(c for c in scenario.calls if c.task_id == "t0")
    return [c for c in scenario.calls if c.run_id == first.run_id]


def assert_conversation_intact(scenario: Scenario, result: Any) -> dict[str, Any]:
    """t0 took every turn once, in order, across the preemption; returns its partial pair."""
    calls = straggler_calls(scenario)
    assert [c.turn for c in calls] == list(range(TURNS))
    # The resumed run's output is the rollout's output (reward saw it once).
    [output] = [o for o in scenario.outputs["t0"] if o["run_id"] == calls[0].run_id]
    assert output["conversation"] == [{"turn": c.turn, "rendered": c.rendered} for c in calls]
    [pair] = [p for p in result.partial if p["task_id"] == "t0"]
    assert pair["run_id"] == calls[0].run_id
    assert pair["turns_before"] == 2 and pair["turns_after"] == TURNS
    assert pair["status"] == "completed"
    assert [c.resumed for c in calls] == [False, False, True, True]
    [item] = [i for i in scenario.pushed if i.external_handle == pair["run_id"]]
    assert item.task_id == "t0" and item.turn == 2 and item.external_handle == pair["run_id"]
    assert item.version_at_checkpoint == pair["from_version"]
    assert list(item.conversation) == output["conversation"][:2]  # from the parked payload
    return dict(pair)


def assert_later_turns_rendered_a_newer_head(
    scenario: Scenario, versions: dict[str, int], pair: dict[str, Any]
) -> None:
    """Turns before the preemption kept the old head; the turns after it rendered a newer one."""
    calls = straggler_calls(scenario)
    before = pair["turns_before"]
    old = {c.rendered for c in calls[:before]}
    new = {c.rendered for c in calls[before:]}
    assert len(old) == 1 and len(new) == 1
    (old_text,), (new_text,) = old, new
    assert versions[old_text] == pair["from_version"]
    assert versions[new_text] == pair["to_version"]
    assert all(c.version == pair["to_version"] for c in calls[before:])
    assert pair["to_version"] > pair["from_version"]


@pytest.mark.parametrize("backend", ["memory", "sqlite"])
async def test_a_straggler_is_preempted_and_resumed_against_the_newer_head(
    backend: str, tmp_path: Path, spy_preempt: list[Scenario]
) -> None:
    scenario = Scenario(wait_for_commit=True)
    spy_preempt.append(scenario)
    store: RunStore = MemoryStore() if backend == "memory" else SQLiteStore(tmp_path / "evo.db")
    async with store:
        result, versions = await run_scenario(
            scenario, store, proposals=True, queue=RecordingQueue(scenario)
        )
        pair = assert_conversation_intact(scenario, result)
        assert_later_turns_rendered_a_newer_head(scenario, versions, pair)
        run = await store.get_run(pair["run_id"])
        assert run.status == RunStatus.COMPLETED
    assert [ok for _, ok in scenario.preempts] == [True]
    assert result.stragglers == 1 and result.resumed == 1
    assert result.commits >= 1
    assert pair["from_version"] == 1
    assert len(result.partial) == 1
    assert result.rollouts == 8  # the preempted attempt gave its budget slot back


async def test_negative_control_a_resume_on_the_same_head_fails_the_version_check(
    spy_preempt: list[Scenario],
) -> None:
    scenario = Scenario(wait_for_commit=False)
    spy_preempt.append(scenario)
    store = MemoryStore()
    result, versions = await run_scenario(
        scenario, store, proposals=False, queue=RecordingQueue(scenario)
    )  # head never moves
    pair = assert_conversation_intact(scenario, result)  # still resumed, conversation intact
    assert result.commits == 0 and pair["from_version"] == pair["to_version"] == 1
    with pytest.raises(AssertionError):
        assert_later_turns_rendered_a_newer_head(scenario, versions, pair)


async def test_without_a_queue_the_straggler_is_not_preempted_and_keeps_its_head(
    spy_preempt: list[Scenario],
) -> None:
    scenario = Scenario(wait_for_commit=True)
    scenario.preempted.set()  # nothing will preempt: let the held turn wait for the commit only
    spy_preempt.append(scenario)
    store = MemoryStore()
    result, versions = await run_scenario(scenario, store, proposals=True, queue=None)
    calls = straggler_calls(scenario)
    assert [c.turn for c in calls] == list(range(TURNS))
    assert {versions[c.rendered] for c in calls} == {1}
    assert not any(c.resumed for c in calls)
    assert scenario.preempts == [] and result.partial == () and result.resumed == 0
    assert result.commits >= 1


async def test_a_straggler_the_queue_refuses_is_finished_in_place_on_its_own_head(
    spy_preempt: list[Scenario],
) -> None:
    scenario = Scenario(wait_for_commit=True)
    spy_preempt.append(scenario)
    queue = RecordingQueue(scenario)
    queue.push(ResumeItem(task_id="t0", turn=0, version_at_checkpoint=1))
    queue.pop()  # t0 has used its only attempt
    scenario.pushed.clear()
    store = MemoryStore()
    result, versions = await run_scenario(scenario, store, proposals=True, queue=queue)
    calls = straggler_calls(scenario)
    assert [c.turn for c in calls] == list(range(TURNS))  # preempted, then resumed at once
    assert {versions[c.rendered] for c in calls} == {1}  # on the head it started with
    assert not any(c.resumed for c in calls)
    assert [ok for _, ok in scenario.preempts] == [True]
    assert [i.external_handle for i in scenario.pushed] == [calls[0].run_id]  # refused
    assert queue.dropped == 1 and len(queue) == 0
    assert result.stragglers == 1 and result.resumed == 0 and result.partial == ()
    assert (await store.get_run(calls[0].run_id)).status == RunStatus.COMPLETED


class QuietEstimator(DurationEstimator):
    """Expects every rollout to take an hour: nothing straggles."""

    def estimate(self, cost: float) -> float:
        return 3600.0


async def test_a_queued_item_whose_run_is_gone_is_rerun_from_the_start(
    spy_preempt: list[Scenario],
) -> None:
    scenario = Scenario(wait_for_commit=False)
    scenario.preempted.set()
    spy_preempt.append(scenario)
    queue = ResumeQueue(max_attempts=1)
    queue.push(ResumeItem(task_id="t1", turn=3, version_at_checkpoint=1, external_handle="gone"))
    result, _ = await run_scenario(
        scenario, MemoryStore(), proposals=False, queue=queue, estimator=QuietEstimator()
    )
    resumed = [c for c in scenario.calls if c.resumed]
    assert [(c.task_id, c.turn) for c in resumed] == [("t1", n) for n in range(TURNS)]
    assert result.resumed == 1 and result.partial == () and result.stragglers == 0


def test_partial_pairs_survive_save_and_load(tmp_path: Path) -> None:
    pair = {
        "task_id": "t0",
        "run_id": "rollout-t0-abc",
        "from_version": 1,
        "to_version": 3,
        "turns_before": 2,
        "turns_after": 4,
        "status": "completed",
    }
    result = EvolutionResult(
        mode="async",
        artifact_id="a",
        version=3,
        entries={},
        rendered="",
        held_out=1.0,
        partial=(pair,),
    )
    saved = tmp_path / "result.json"
    result.save(saved)
    assert EvolutionResult.load(saved).partial == (pair,)
