"""evolve (sync rounds) and async_evolve (workers + one merger) on the demo domain and small fakes."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest

import tailrace as tr
from tailrace.evolve import (
    Artifact,
    DemoDomain,
    Edit,
    EvolutionResult,
    Task,
    async_evolve,
    current_rollout,
    evolve,
)
from tailrace.evolve._demo import route
from tailrace.stores import MemoryStore

LOOPS = [evolve, async_evolve]


def _demo(**kwargs):
    return DemoDomain(n_tasks=30, seed=2, latency=0.0, **kwargs)


def _fields(result: EvolutionResult) -> dict:
    """The result without its timing figures (which vary run to run)."""
    data = result.to_dict()
    for key in ("wall", "worker_busy", "worker_used", "utilisation", "rollouts_per_second"):
        data.pop(key)
    for sweep in data["history"]:
        sweep.pop("elapsed")
    return data


@pytest.mark.parametrize("loop", LOOPS)
async def test_the_demo_improves_and_the_ledger_records_every_commit(loop):
    demo = _demo()
    store = MemoryStore()
    result = await loop(
        demo.tasks,
        demo.reward,
        run=demo.run,
        propose=demo.propose,
        artifact=demo.initial,
        store=store,
        max_rollouts=60,
    )
    assert result.initial_held_out == 0.0
    assert result.held_out > 0.5
    assert result.commits >= 3 and result.version == 1 + result.commits
    assert result.rollouts == 60 and result.stop_reason == "budget"
    history = await store.artifact_history("artifact")
    assert [v.version for v in history] == list(range(1, result.version + 1))
    assert json.loads(history[-1].entries_json) == result.entries
    assert result.rendered == demo.initial.with_entries(result.entries).render()
    assert sum(s.version - s.base_version for s in result.history) == result.commits
    assert sum(s.accepted for s in result.history) <= result.commits  # audits commit too
    curve = result.learning_curve()
    moved = [s for s in result.history if s.version != s.base_version]
    assert curve[0] == (0, 0.0) and len(curve) == len(moved) + 1


async def test_sync_rounds_are_deterministic():
    results = []
    for _ in range(2):
        demo = _demo()
        result = await evolve(
            demo.tasks,
            demo.reward,
            run=demo.run,
            propose=demo.propose,
            artifact=demo.initial,
            max_rollouts=40,
        )
        results.append(_fields(result))
    assert results[0] == results[1]


@pytest.mark.parametrize("loop", LOOPS)
async def test_stops_at_target(loop):
    demo = _demo(noise=0.0)
    result = await loop(
        demo.tasks,
        demo.reward,
        run=demo.run,
        propose=demo.propose,
        artifact=demo.initial,
        max_rollouts=500,
        target=0.5,
    )
    assert result.stop_reason == "target"
    assert result.held_out >= 0.5
    assert result.rollouts < 500


@pytest.mark.parametrize("loop", LOOPS)
async def test_a_reward_out_of_range_fails_with_the_task_named(loop):
    tasks = [Task(id=f"task{i}", prompt="") for i in range(5)]

    def run(rendered, task):  # a sync callable: runs off the event loop
        return task.id

    def reward(task, output):
        return 2.0 if task.id == "task0" else 0.0

    with pytest.raises(ValueError, match=r"reward for task 'task0' must be in \[0, 1\]"):
        await loop(tasks, reward, run=run, propose=lambda *a: None, max_rollouts=4)


@pytest.mark.parametrize("loop", LOOPS)
async def test_run_may_be_a_tailrace_graph(loop):
    demo = _demo(noise=0.0)
    g = tr.Graph("route-rollout")
    seen = []

    @g.task()
    async def answer(payload):
        seen.append(sorted(payload))
        return route(payload["rendered"], payload["task"]["prompt"])

    result = await loop(
        demo.tasks,
        demo.reward,
        run=g,
        propose=demo.propose,
        artifact=demo.initial,
        max_rollouts=20,
    )
    assert seen and all(keys == ["rendered", "task"] for keys in seen)
    assert result.commits >= 1 and result.held_out > result.initial_held_out


@pytest.mark.parametrize("loop", LOOPS)
async def test_passing_the_store_again_resumes_the_evolution(loop):
    store = MemoryStore()
    demo = _demo()
    common = dict(run=demo.run, propose=demo.propose, artifact=demo.initial, store=store)
    first = await loop(demo.tasks, demo.reward, max_rollouts=30, **common)
    second = await loop(demo.tasks, demo.reward, max_rollouts=30, **common)
    assert second.initial_held_out == first.held_out
    assert second.version >= first.version
    assert second.version == first.version + second.commits
    history = await store.artifact_history("artifact")
    assert len(history) == second.version


async def test_sync_round_timeout_cuts_the_round_and_counts_stragglers():
    tasks = [Task(id=f"t{i}", prompt="") for i in range(8)]

    async def run(rendered, task):
        ctx = current_rollout()
        if ctx is not None and ctx.phase == "train" and task.id == "t0":
            await asyncio.Event().wait()  # never finishes on its own
        return "ok"

    result = await evolve(
        tasks,
        lambda t, o: 1.0,
        run=run,
        propose=lambda *a: None,
        workers=2,
        max_rollouts=6,
        round_timeout=0.05,
        held_out_frac=0.5,
    )
    # rounds: (t0, t1) (t2, t3) (t0, t1): t0 straggles twice and is cut by the barrier timeout
    assert result.stragglers == 2
    assert result.rollouts == 4


async def test_async_drops_proposals_lagging_more_than_async_ratio():
    tasks = [Task(id=f"t{i}", prompt="") for i in range(8)]
    counter = iter(range(1000))

    async def run(rendered, task):
        ctx = current_rollout()
        if ctx is not None and ctx.phase == "eval":
            await asyncio.sleep(0.02)  # a slow merger: workers finish while it sweeps
        return rendered

    def reward(task, output):
        return 1.0 if "k:" in output else 0.0

    def propose(rendered, task, output, value):
        return Edit(set={"k": str(next(counter))})

    stale = {}
    for ratio in (0, 10):
        result = await async_evolve(
            tasks,
            reward,
            run=run,
            propose=propose,
            workers=2,
            max_rollouts=12,
            async_ratio=ratio,
            max_candidates=1,
        )
        stale[ratio] = result.stale_dropped
        assert result.commits == 1 and result.proposals == 12
    assert stale[0] > 0
    assert stale[10] == 0


async def test_async_commits_come_from_one_merger_task_only():
    class Recording(MemoryStore):
        writers: list[asyncio.Task | None]

        async def commit_artifact(self, artifact_id, expected, entries_json, meta_json="{}"):
            self.writers.append(asyncio.current_task())
            return await super().commit_artifact(artifact_id, expected, entries_json, meta_json)

    store = Recording()
    store.writers = []
    demo = _demo()
    result = await async_evolve(
        demo.tasks,
        demo.reward,
        run=demo.run,
        propose=demo.propose,
        artifact=demo.initial,
        store=store,
        max_rollouts=60,
        workers=4,
    )
    commits = store.writers[1:]  # the first is version 1, written when the ledger opens
    assert len(commits) == result.commits >= 2
    assert len(set(map(id, commits))) == 1


@pytest.mark.parametrize("loop", LOOPS)
async def test_progress_is_reported(loop):
    demo = _demo()
    seen = []
    await loop(
        demo.tasks,
        demo.reward,
        run=demo.run,
        propose=demo.propose,
        artifact=demo.initial,
        max_rollouts=12,
        progress=seen.append,
    )
    assert seen and seen[-1].max_rollouts == 12
    assert max(p.rollouts for p in seen) == 12


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"workers": 0}, "workers"),
        ({"max_rollouts": -1}, "max_rollouts"),
        ({"target": 2.0}, "target"),
        ({"max_candidates": 0}, "max_candidates"),
    ],
)
@pytest.mark.parametrize("loop", LOOPS)
async def test_options_are_validated(loop, kwargs, message):
    demo = _demo()
    with pytest.raises(ValueError, match=message):
        await loop(demo.tasks, demo.reward, run=demo.run, propose=demo.propose, **kwargs)


async def test_async_specific_options_are_validated():
    demo = _demo()
    for kwargs in ({"async_ratio": -1}, {"straggler_factor": 1.0}, {"hedge_factor": 0.5}):
        with pytest.raises(ValueError):
            await async_evolve(
                demo.tasks, demo.reward, run=demo.run, propose=demo.propose, **kwargs
            )


def test_result_save_load_round_trip(tmp_path):
    demo = _demo()
    result = asyncio.run(
        evolve(demo.tasks, demo.reward, run=demo.run, propose=demo.propose, max_rollouts=20)
    )
    path = tmp_path / "result.json"
    result.save(path)
    assert EvolutionResult.load(path) == result


def test_result_load_fills_missing_newer_fields_with_defaults(tmp_path):
    old = {
        "format": 1,
        "mode": "async",
        "artifact_id": "a",
        "version": 3,
        "entries": {"x": "y"},
        "rendered": "x: y",
        "held_out": 0.5,
        "history": [],
        "some_future_field": 1,
    }
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    loaded = EvolutionResult.load(path)
    assert loaded.version == 3 and loaded.resumed == 0 and loaded.partial == ()
    defaults = {f.name for f in dataclasses.fields(EvolutionResult)} - set(old)
    assert "stragglers" in defaults
    with pytest.raises(ValueError, match="missing required"):
        EvolutionResult.from_dict({"format": 1, "mode": "sync"})
    with pytest.raises(ValueError, match="format"):
        EvolutionResult.from_dict({**old, "format": 99})


def test_artifact_from_entries_mapping():
    tasks = [Task(id=f"t{i}", prompt="") for i in range(4)]
    result = asyncio.run(
        evolve(
            tasks,
            lambda t, o: 0.0,
            run=lambda r, t: r,
            propose=lambda *a: None,
            artifact={"seed": "text"},
            max_rollouts=2,
        )
    )
    assert result.entries == {"seed": "text"} and result.rendered == "seed: text"
    assert isinstance(Artifact(entries=result.entries), Artifact)
