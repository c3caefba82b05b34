"""The ledger over the store's artifact versions: head, history, compare-and-set, resume."""

from __future__ import annotations

import json

import pytest

from tailrace import StaleVersion
from tailrace.evolve import Artifact, Edit, Ledger
from tailrace.stores import MemoryStore, SQLiteStore


@pytest.fixture(params=["memory", "sqlite"])
async def store(request, tmp_path):
    s = MemoryStore() if request.param == "memory" else SQLiteStore(str(tmp_path / "ledger.db"))
    await s.open()
    try:
        yield s
    finally:
        await s.close()


async def test_open_commits_version_one_then_resumes(store):
    ledger = Ledger(store, "prompt", Artifact(entries={"a": "1"}))
    first = await ledger.open()
    assert (first.version, dict(first.artifact.entries)) == (1, {"a": "1"})
    again = await Ledger(store, "prompt", Artifact(entries={"ignored": "x"})).open()
    assert again.version == 1 and dict(again.artifact.entries) == {"a": "1"}


async def test_commit_appends_history_with_meta(store):
    ledger = Ledger(store, "prompt", Artifact(entries={"a": "1"}))
    v1 = await ledger.open()
    v2 = await ledger.commit(v1, Edit(set={"b": "2"}, note="n"), {"probability": 0.9})
    assert v2.version == 2 and dict(v2.artifact.entries) == {"a": "1", "b": "2"}
    assert v2.meta["base_version"] == 1 and v2.meta["probability"] == 0.9
    assert v2.meta["edit"] == {"set": {"b": "2"}, "remove": [], "note": "n"}
    assert [v.version for v in await ledger.history()] == [1, 2]
    head = await ledger.head()
    assert head is not None and head.version == 2


async def test_stale_commit_is_refused_by_the_store(store):
    await Ledger(store, "p", Artifact(entries={})).open()
    with pytest.raises(StaleVersion):
        await store.commit_artifact("p", 0, json.dumps({"x": "y"}))


async def test_stale_commit_is_rebased_onto_the_newer_head_and_retried(store):
    ledger = Ledger(store, "p", Artifact(entries={"a": "1"}))
    v1 = await ledger.open()
    await store.commit_artifact("p", 1, json.dumps({"a": "1", "other": "writer"}))
    v3 = await ledger.commit(v1, Edit(set={"mine": "yes"}), {})
    assert v3.version == 3
    assert dict(v3.artifact.entries) == {"a": "1", "other": "writer", "mine": "yes"}
    assert v3.meta["rebased_onto"] == 2
    assert ledger.stale_retries == 1


async def test_retries_exhausted_raise_stale_version():
    class AlwaysStale(MemoryStore):
        async def commit_artifact(self, artifact_id, expected, entries_json, meta_json="{}"):
            if expected > 0:
                raise StaleVersion("someone else won")
            return await super().commit_artifact(artifact_id, expected, entries_json, meta_json)

    async with AlwaysStale() as store:
        ledger = Ledger(store, "p", Artifact(entries={}), retries=2)
        v1 = await ledger.open()
        with pytest.raises(StaleVersion):
            await ledger.commit(v1, Edit(set={"a": "b"}), {})
        assert ledger.stale_retries == 3


def test_ledger_refuses_bad_arguments():
    with pytest.raises(ValueError):
        Ledger(MemoryStore(), "", Artifact())
    with pytest.raises(ValueError):
        Ledger(MemoryStore(), "p", Artifact(), retries=-1)
