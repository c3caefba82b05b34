"""The store contract for stream rows, against every backend (S2, S3, D1).

Stream rows go in with a harvest and are read back by cursor in order; a row
whose ``seq`` is already stored refuses the whole harvest; ``stream_head``
tells an engine where a run's streams stand; ``prune_streams`` is the
retention rule; each commit that carries rows wakes the change feed.
"""

from __future__ import annotations

import asyncio

import pytest

import tailrace as tr
from tailrace.stores import (
    ChunkRow,
    Harvest,
    NewRun,
    RunStatus,
    RunStore,
    StreamHead,
    StreamTail,
)
from tests.fixtures import Backend

TTL = 30.0


def row(
    seq: int, stream: int, kind: str = "chunk", *, data: str | None = '"t"', item: int | None = None
) -> ChunkRow:
    return ChunkRow(
        seq=seq, stream=stream, node_id="a", visit=1, item=item,
        attempt=1, hedge=0, kind=kind, data_json=None if kind != "chunk" else data,
        ts=float(seq),
    )  # fmt: skip


async def leased(store: RunStore, run_id: str) -> int:
    new = NewRun(
        run_id=run_id, graph_name="g", graph_ref=None, fingerprint="fp", input_json="1",
        created_at=1.0,
    )  # fmt: skip
    await store.create_run(new)
    return await store.acquire_lease(run_id, "A", TTL)


def harvest(*chunks: ChunkRow, status: RunStatus = RunStatus.RUNNING) -> Harvest:
    finished = None if status is RunStatus.RUNNING else 5.0
    return Harvest(state_json="{}", status=status, chunks=chunks, finished_at=finished)


async def test_rows_read_back_by_cursor_in_order(store: RunStore) -> None:
    token = await leased(store, "r1")
    await store.commit("r1", token, harvest(row(1, 1), row(2, 1), row(3, 3, item=3)))
    await store.commit("r1", token, harvest(row(4, 1, "accepted"), row(5, 3, "discarded", item=3)))
    rows = await store.chunks("r1")
    assert rows == [
        row(1, 1), row(2, 1), row(3, 3, item=3), row(4, 1, "accepted"),
        row(5, 3, "discarded", item=3),
    ]  # fmt: skip
    assert await store.chunks("r1", after=2) == rows[2:]
    assert await store.chunks("r1", after=1, limit=2) == rows[1:3]
    assert await store.chunks("r1", after=5) == []
    assert rows[2].item == 3 and rows[0].item is None  # an item index, or None


async def test_a_stored_seq_refuses_the_whole_harvest(store: RunStore) -> None:
    token = await leased(store, "r1")
    await store.commit("r1", token, harvest(row(1, 1)))
    with pytest.raises(tr.StoreError, match="seq"):
        await store.commit("r1", token, harvest(row(2, 1), row(1, 1, data='"again"')))
    assert await store.chunks("r1") == [row(1, 1)]  # nothing of it was written (D1)


async def test_stream_tails_hold_each_streams_last_rows_its_mark_and_its_count(
    store: RunStore,
) -> None:
    token = await leased(store, "r1")
    assert await store.stream_tails("r1", chars=10) == []
    # Stream 1: chunks of 5 stored characters each ('"abc"'), then its mark; stream 3 interleaved.
    first = [row(s, 1, data='"abc"') for s in (1, 2, 4, 6)]
    await store.commit("r1", token, harvest(*first[:2], row(3, 3, item=3), *first[2:]))
    await store.commit("r1", token, harvest(row(7, 1, "accepted"), row(8, 3, item=3)))
    one, three = await store.stream_tails("r1", chars=9)
    # The fewest last rows holding more than 9 characters: two chunks of 5, and the mark.
    assert one == StreamTail(rows=(first[2], first[3], row(7, 1, "accepted")), chunks=4)
    assert not one.whole
    assert three == StreamTail(rows=(row(3, 3, item=3), row(8, 3, item=3)), chunks=2)
    assert three.whole
    assert (await store.stream_tails("r1", chars=10))[0].rows[0] == first[1]  # 10 is not more
    whole = await store.stream_tails("r1", chars=1_000)
    assert [t.rows for t in whole] == [(*first, row(7, 1, "accepted")), three.rows]
    assert [t.rows for t in await store.stream_tails("r1", chars=0)] == [
        (first[3], row(7, 1, "accepted")), (row(8, 3, item=3),)
    ]  # fmt: skip
    assert await store.stream_tails("r1", chars=1_000, limit=1) == whole[:1]
    with pytest.raises(tr.RunNotFound):
        await store.stream_tails("nope", chars=10)
    with pytest.raises(ValueError, match="chars"):
        await store.stream_tails("r1", chars=-1)


async def test_stream_head_lists_streams_with_no_mark(store: RunStore) -> None:
    token = await leased(store, "r1")
    assert await store.stream_head("r1") == StreamHead()
    await store.commit("r1", token, harvest(row(1, 1), row(2, 2), row(3, 1), row(4, 4)))
    await store.commit("r1", token, harvest(row(5, 2, "accepted")))
    head = await store.stream_head("r1")
    assert head.last_seq == 5
    assert head.open == (row(1, 1), row(4, 4))


async def test_prune_streams_deletes_only_rows_of_runs_that_ended_before(
    backend: Backend,
) -> None:
    store = backend.store
    for run_id in ("done", "live"):
        token = await leased(store, run_id)
        await store.commit(run_id, token, harvest(row(1, 1), row(2, 1, "accepted")))
    done = await store.acquire_lease("done", "A", TTL, steal_from="A")
    await store.commit("done", done, harvest(status=RunStatus.COMPLETED))
    assert await store.prune_streams(finished_before=5.0) == 0  # ended at 5.0, not before
    assert await store.prune_streams(finished_before=6.0) == 2
    assert await store.chunks("done") == []
    assert len(await store.chunks("live")) == 2  # a live run keeps its rows
    assert await store.prune_streams(finished_before=6.0) == 0


async def test_a_commit_with_rows_wakes_the_change_feed(store: RunStore) -> None:
    token = await leased(store, "r1")
    async with store.changes() as feed:
        await store.commit("r1", token, harvest(row(1, 1)))
        seen: set[str] = set()
        async with asyncio.timeout(30):
            while "stream" not in seen:
                seen |= await feed.wait(1.0)


async def test_bad_cursors_and_unknown_runs_are_refused(store: RunStore) -> None:
    await leased(store, "r1")
    with pytest.raises(ValueError, match="after"):
        await store.chunks("r1", after=-1)
    with pytest.raises(ValueError, match="limit"):
        await store.chunks("r1", limit=0)
    with pytest.raises(ValueError, match="finished_before"):
        await store.prune_streams(finished_before="yesterday")  # type: ignore[arg-type]
    with pytest.raises(tr.RunNotFound, match="nope"):
        await store.chunks("nope")
    with pytest.raises(tr.RunNotFound, match="nope"):
        await store.stream_head("nope")


async def test_hostile_row_text_is_stored_as_it_came(store: RunStore) -> None:
    token = await leased(store, "r1")
    text = '"\'); DELETE FROM stream_chunks;-- [red]x[/] <b>\\u0000"'
    await store.commit("r1", token, harvest(row(1, 1, data=text)))
    assert (await store.chunks("r1"))[0].data_json == text
