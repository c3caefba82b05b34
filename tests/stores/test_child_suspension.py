"""A parent suspending on its child runs, and its children's stored outputs (R1, R4).

Run against every backend. The commit that suspends a parent on its children
lets go of its lease and counts the children that ended before it, so no
crash between that commit and anything its process does next can leave the
parent asleep with every child ended. A completed child's output is stored by
its final commit, and read back for many children in one call.
"""

from __future__ import annotations

import asyncio

import pytest

from tailrace.stores import Harvest, NewRun, RunStatus, RunStore, Submission
from tailrace.stores._sql import _transactions
from tests.fixtures import Backend

TTL = 30.0
KIDS = ["p/each/1/0", "p/each/1/1", "p/each/1/2"]


def run(run_id: str, parent: str | None = None) -> tuple[NewRun, Submission]:
    new = NewRun(
        run_id=run_id, graph_name="kid" if parent else "parent", graph_ref=None,
        fingerprint="fp", input_json="0", created_at=1.0, parent_run_id=parent,
    )  # fmt: skip
    return new, Submission(queue="kids" if parent else "parents")


async def family(store: RunStore) -> int:
    """Parent ``p`` claimed by ``w0`` and its three children submitted; the parent's token."""
    await store.submit_runs([run("p")])
    assert await store.claim_runs("parents", "w0", TTL, limit=1) == ["p"]
    await store.submit_runs([run(kid, "p") for kid in KIDS])
    return (await store.get_run("p")).lease_token


async def end(store: RunStore, run_id: str, status: RunStatus = RunStatus.COMPLETED) -> None:
    """Claim child ``run_id`` and end it with ``status``, as its worker would."""
    if (await store.get_run(run_id)).status is RunStatus.QUEUED:
        assert run_id in await store.claim_runs("kids", "w1", TTL, limit=10)
    token = (await store.get_run(run_id)).lease_token
    output = f'"out of {run_id}"' if status is RunStatus.COMPLETED else None
    harvest = Harvest(state_json="{}", status=status, finished_at=5.0, output_json=output)
    await store.commit(run_id, token, harvest)
    await store.release_lease(run_id, "w1", token)


async def suspend(store: RunStore, token: int, wake_after: int, waiting_on: list[str]) -> None:
    """Parent ``p`` suspends on ``waiting_on``; its process dies before it lets go of anything."""
    harvest = Harvest(
        state_json="{}", status=RunStatus.SUSPENDED, wake_after=wake_after, waiting_on=waiting_on
    )
    await store.commit("p", token, harvest)


async def test_a_suspension_on_children_lets_go_of_its_lease_in_the_same_commit(
    store: RunStore,
) -> None:
    """The suspending process is SIGKILLed before its release: the last child still wakes
    the parent (its lease went with the suspension's commit, and said so)."""
    token = await family(store)
    async with store.changes() as feed:
        await suspend(store, token, 3, KIDS)
        kinds = await feed.wait(5.0)
    parent = await store.get_run("p")
    assert (parent.status, parent.lease_owner, parent.lease_expires) == (
        RunStatus.SUSPENDED, None, None,
    )  # fmt: skip
    assert "release" in kinds  # workers look at the queue's slots again
    for kid in KIDS[:2]:
        await end(store, kid)
        assert (await store.get_run("p")).status is RunStatus.SUSPENDED
    await end(store, KIDS[2])
    assert (await store.get_run("p")).status is RunStatus.QUEUED
    assert await store.claim_runs("parents", "w2", TTL, limit=1) == ["p"]


@pytest.mark.parametrize(
    ("ended_before", "wake_after", "queued_at_once"),
    [(1, 3, False), (1, 1, True), (2, 2, True), (0, 3, False)],
)
async def test_children_that_ended_before_the_suspension_are_counted_in_its_commit(
    store: RunStore, ended_before: int, wake_after: int, queued_at_once: bool
) -> None:
    """Children that completed while the parent still ran woke nothing: the suspension's
    commit counts them, and queues the parent at once when they are enough."""
    token = await family(store)
    for kid in KIDS[:ended_before]:
        await end(store, kid)
    await suspend(store, token, wake_after, KIDS)
    status = (await store.get_run("p")).status
    assert status is (RunStatus.QUEUED if queued_at_once else RunStatus.SUSPENDED)
    if queued_at_once:
        return
    needed = wake_after - ended_before  # completions still to come before it wakes
    for n, kid in enumerate(KIDS[ended_before:], start=1):
        await end(store, kid)
        expected = RunStatus.QUEUED if n >= needed else RunStatus.SUSPENDED
        assert (await store.get_run("p")).status is expected, (kid, n)


async def test_a_child_that_failed_before_the_suspension_queues_its_parent_at_once(
    store: RunStore,
) -> None:
    token = await family(store)
    await end(store, KIDS[1], RunStatus.FAILED)
    await suspend(store, token, 3, KIDS)
    assert (await store.get_run("p")).status is RunStatus.QUEUED


async def test_a_child_ending_while_its_parent_suspends_is_counted(
    pg_backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Postgres runs at READ COMMITTED: the last child's final commit lands while the
    parent's suspension has read it as running but not committed yet. The child's end
    waits for that commit (it locks the parent's row first) and counts, so the parent
    is queued; without the lock its UPDATE statements saw the parent running and the end
    was counted by nobody."""
    store = pg_backend.store
    token = await family(store)
    for kid in KIDS[:2]:
        await end(store, kid)
    paused, go = asyncio.Event(), asyncio.Event()
    counted = _transactions.suspend_on_children

    async def held_open(tx: _transactions.Tx, run_id: str, harvest: Harvest, now: float) -> None:
        await counted(tx, run_id, harvest, now)  # the children read: KIDS[2] still running
        paused.set()
        await go.wait()  # the suspension's transaction stays open

    monkeypatch.setattr(_transactions, "suspend_on_children", held_open)
    suspension = asyncio.create_task(suspend(store, token, 3, KIDS))
    await asyncio.wait_for(paused.wait(), 10.0)
    async with pg_backend.sibling() as other:  # another process's connection
        ending = asyncio.create_task(end(other, KIDS[2]))
        await asyncio.sleep(0.5)
        waited = not ending.done()  # for the parent's row
        go.set()
        await asyncio.wait_for(asyncio.gather(suspension, ending), 10.0)
    assert waited
    parent = await store.get_run("p")
    assert (parent.status, parent.lease_owner) == (RunStatus.QUEUED, None)


async def test_a_run_created_on_a_queue_is_queued_again_when_its_children_end(
    store: RunStore,
) -> None:
    """R4 at depth: an inline child of a run on a queue is created ``running`` on its
    parent's queue (no claim); suspended on a child of its own, it is queued again by that
    child's end, and any worker of the queue claims it."""
    inline = NewRun(
        run_id="p/inline/1", graph_name="inline", graph_ref=None, fingerprint="fp",
        input_json="0", created_at=1.0, parent_run_id="p", queue_name="parents",
    )  # fmt: skip
    await store.create_run(inline)
    record = await store.get_run("p/inline/1")
    assert (record.status, record.queue_name, record.started_at) == (
        RunStatus.RUNNING, "parents", None,
    )  # fmt: skip
    assert await store.claim_runs("parents", "w0", TTL, limit=1) == []  # running: not claimable
    token = await store.acquire_lease("p/inline/1", "w0", TTL)
    await store.submit_runs([run("p/inline/1/kid/1", "p/inline/1")])
    waiting = Harvest(
        state_json="{}", status=RunStatus.SUSPENDED, wake_after=1, waiting_on=["p/inline/1/kid/1"]
    )
    await store.commit("p/inline/1", token, waiting)
    await end(store, "p/inline/1/kid/1")
    assert (await store.get_run("p/inline/1")).status is RunStatus.QUEUED
    assert await store.claim_runs("parents", "w2", TTL, limit=1) == ["p/inline/1"]


async def test_completed_childrens_outputs_are_read_in_one_call(store: RunStore) -> None:
    """``outputs``: what each completed child's final commit stored; a child still running,
    a failed one, an unknown id and a run that stored none are left out."""
    await family(store)
    await end(store, KIDS[0])
    await end(store, KIDS[2], RunStatus.FAILED)
    asked = [*KIDS, "p", "nobody", KIDS[0]]
    assert await store.outputs(asked) == {KIDS[0]: f'"out of {KIDS[0]}"'}
    assert await store.outputs([]) == {}
    many = [f"p/each/2/{n}" for n in range(300)]  # more ids than one query takes
    await store.submit_runs([run(kid, "p") for kid in many])
    assert len(await store.claim_runs("kids", "w1", TTL, limit=len(many))) == len(many)
    for kid in many[::7]:
        await end(store, kid)
    found = await store.outputs(many)
    assert found == {kid: f'"out of {kid}"' for kid in many[::7]}
    with pytest.raises(ValueError, match="run_id"):
        await store.outputs(["ok", "bad\x00id"])
