"""Listing and counting only the runs that are no run's child (R1), on every backend.

The dashboard's runs list hides child runs on request: a page of top-level runs
and the counts its filters show come from the store, not from reading every run.
"""

from __future__ import annotations

import dataclasses

import pytest

from tailrace.stores import NewRun, RunStatus, RunStore, Submission


def new_run(run_id: str, created_at: float, parent: str | None = None) -> NewRun:
    return NewRun(
        run_id=run_id, graph_name="kid" if parent else "top", graph_ref=None, fingerprint="fp",
        input_json="0", created_at=created_at, parent_run_id=parent,
    )  # fmt: skip


async def test_top_level_runs_are_listed_and_counted_without_any_child(store: RunStore) -> None:
    for n, (run_id, parent) in enumerate(
        (("a", None), ("a/x/1", "a"), ("b", None), ("a/x/1/y/1", "a/x/1"), ("b/m/1/0", "b"))
    ):
        await store.create_run(new_run(run_id, float(n), parent))
    queued = dataclasses.replace(new_run("c", 9.0), graph_name="kid")
    await store.submit_run(queued, Submission(queue="q"))
    assert [r.run_id for r in await store.list_runs(top_level=True)] == ["c", "b", "a"]
    assert [r.run_id for r in await store.list_runs(top_level=True, offset=1, limit=1)] == ["b"]
    assert [r.run_id for r in await store.list_runs(top_level=True, graph="kid")] == ["c"]
    assert [r.run_id for r in await store.list_runs(top_level=True, queue="q")] == ["c"]
    assert await store.list_runs(top_level=True, status=RunStatus.COMPLETED) == []
    assert len(await store.list_runs()) == 6  # the children are still there
    counts = [
        (c.graph_name, c.queue_name, c.status, c.count)
        for c in await store.run_counts(top_level=True)
    ]
    assert counts == [("kid", "q", RunStatus.QUEUED, 1), ("top", None, RunStatus.RUNNING, 2)]
    every = {(c.graph_name, c.status): c.count for c in await store.run_counts()}
    assert every[("kid", RunStatus.RUNNING)] == 3  # all runs, as before
    with pytest.raises(ValueError, match="top_level"):
        await store.list_runs(top_level=True, parent="a")
