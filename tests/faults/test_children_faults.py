"""Child runs when the store fails (R2, R4): a failed submit of a map's children.

The children of a map go to the store in one write (``submit_runs``). When it
fails, every item waiting on it fails with the store's error, the run fails,
and nothing of the batch is stored; resumed on a working store, each child
is submitted once and the run completes.
"""

from __future__ import annotations

import asyncio

import pytest

import tailrace as tr
from tailrace.stores import RunStatus, RunStore
from tests import fixtures
from tests.faults import _faulty as faulty

store = fixtures.each_store


class FailingSubmits(faulty.DelegatingStore):
    """Forwards everything; ``submit_runs`` raises :class:`~tailrace.StoreError` while ``failing``."""

    def __init__(self, inner: RunStore) -> None:
        super().__init__(inner)
        self.failing = True
        self.batches: list[int] = []

    async def submit_runs(self, runs):  # type: ignore[no-untyped-def]
        """Record the batch's size; raise while failing, else forward it."""
        self.batches.append(len(runs))
        if self.failing:
            raise tr.StoreError(f"injected failure of a batch of {len(runs)} child runs")
        return await self.inner.submit_runs(runs)


def family() -> tr.Graph:
    kid = tr.Graph("fault_kid")
    kid.add_node("work", lambda n: n * 10)
    g = tr.Graph("fault_family")
    g.add_node("each", kid, "map", queue="kids")
    return g


async def test_a_failed_submit_of_children_fails_the_run_and_stores_none_of_them(
    store: RunStore,
) -> None:
    failing = FailingSubmits(store)
    g = family()
    with pytest.raises(tr.StoreError, match="injected failure of a batch of 4"):
        await faulty.guarded(
            tr.Engine(store=failing).run(g, [1, 2, 3, 4], run_id="fs"), "the failing run"
        )
    assert failing.batches == [4]  # the four children went in one write
    assert await store.list_runs(parent="fs") == []  # nothing of the batch is stored
    assert (await store.get_run("fs")).status is RunStatus.FAILED


async def test_children_submitted_once_across_a_stop_are_not_submitted_again(
    store: RunStore,
) -> None:
    """R2: a parent stopped after its children were stored re-attaches to them."""
    g = family()
    engine = tr.Engine(store=store)
    run = asyncio.create_task(engine.run(g, [1, 2, 3], run_id="once"))
    await fixtures.until(
        lambda: _count(store, "once", 3), "the children to be stored (nobody serves kids)"
    )
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    counting = FailingSubmits(store)
    counting.failing = False
    worker = tr.Worker(store, queues=["kids"], graphs=[g], heartbeat=0.2, grace=1.0)
    stop = asyncio.Event()
    serving = asyncio.create_task(worker.run(stop))
    try:
        result = await faulty.guarded(
            tr.Engine(store=counting).resume("once", g), "the resumed parent"
        )
    finally:
        stop.set()
        await serving
    assert result.output == [10, 20, 30]
    assert counting.batches == []  # every child was found stored: none submitted again
    assert len(await store.list_runs(parent="once")) == 3


async def _count(store: RunStore, parent: str, n: int) -> bool:
    return len(await store.list_runs(parent=parent)) == n
