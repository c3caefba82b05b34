"""A worker holding several versions of one graph drives each run on its own (V3).

On every store, with the fleet suite's database fixture and helpers.
"""

from __future__ import annotations

import tailrace as tr
from tailrace.stores import RunStatus
from tests import fixtures
from tests.workers.test_worker import db, engine_on, worker_on, working

__all__ = ["db"]


def version(tag: str, *, extra: bool) -> tr.Graph:
    g = tr.Graph("versioned")
    g.add_node("step", lambda x: f"{tag}:{x}")
    g.add_node("review", lambda x: {"ask": x}, "gate")
    g.chain("step", "review")
    if extra:
        g.add_node("after", lambda answer: f"{tag} after {answer}")
        g.add_edge("review", "after")
    return g


async def test_v3_a_worker_with_two_versions_drives_each_run_on_its_own(
    db: fixtures.Database,
) -> None:
    v1, v2 = version("v1", extra=False), version("v2", extra=True)
    assert v1.fingerprint() != v2.fingerprint()
    engine = await engine_on(db)
    one = await engine.submit(v1, "a")
    two = await engine.submit(v2, "b")
    async with working(await worker_on(db, graphs=[v1, v2])):
        waiting = {r: await engine.wait(r, timeout=fixtures.HANG_GUARD) for r in (one, two)}
        assert waiting[one].results["step"] == "v1:a" and waiting[two].results["step"] == "v2:b"
        for result in waiting.values():
            (question,) = result.questions
            await (await engine_on(db)).answer(question.question_id, "ok", resume=False)
        done = {}
        for run_id in (one, two):
            await fixtures.until(
                lambda run_id=run_id: _completed(db, run_id), f"run {run_id} to complete"
            )
            done[run_id] = await engine.wait(run_id, graph=v1 if run_id == one else v2)
    assert "after" not in done[one].results
    assert done[two].results["after"] == "v2 after ok"
    store = await db.store()
    assert (await store.get_run(one)).fingerprint == v1.fingerprint()
    assert (await store.get_run(two)).fingerprint == v2.fingerprint()


async def _completed(db: fixtures.Database, run_id: str) -> bool:
    return (await (await db.store()).get_run(run_id)).status is RunStatus.COMPLETED


async def test_a_stale_worker_restarting_never_rolls_back_a_submit_by_name(
    db: fixtures.Database,
) -> None:
    """Submit by name takes the version deployed last: a worker of an earlier version that
    starts again re-registers it without making it the newest (it keeps its first time)."""
    v1, v2 = version("v1", extra=False), version("v2", extra=True)
    store = await db.store()
    # The v1 deploy, the v2 deploy, then one v1 worker restarting.
    for deployed in (v1, v2, v1):
        fingerprint = deployed.fingerprint()
        async with working(await worker_on(db, graphs=[deployed])):
            await fixtures.until(
                lambda fp=fingerprint: _registered(db, fp), "the worker's registration"
            )
    assert [r.fingerprint for r in await store.graphs_named("versioned")] == [
        v2.fingerprint(),
        v1.fingerprint(),
    ]
    engine = await engine_on(db)
    run_id = await engine.submit("versioned", "c")
    assert (await store.get_run(run_id)).fingerprint == v2.fingerprint()
    async with working(await worker_on(db, graphs=[v2])):
        waiting = await engine.wait(run_id, timeout=fixtures.HANG_GUARD)
    assert waiting.results["step"] == "v2:c"


async def _registered(db: fixtures.Database, fingerprint: str) -> bool:
    rows = await (await db.store()).graphs_named("versioned")
    return any(r.fingerprint == fingerprint for r in rows)
