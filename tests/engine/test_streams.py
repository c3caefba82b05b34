"""Streams through the public API: ``current_node().stream`` and ``Engine.stream`` (S1-S4).

Clauses: S1 (chunks tagged with run, node, visit, item, attempt and hedge, in
order per attempt), S2 (one terminal mark per attempt: ``accepted`` when its
result is committed, ``discarded`` otherwise), S3 (readable from any store
handle, live, resumable by cursor), S4 (chunks are data; an unencodable one is
refused at the call).
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

import tailrace as tr
from tailrace import Chunk, ChunkKind, current_node
from tailrace.graph import RetryPolicy
from tailrace.stores import MemoryStore, RunStatus, RunStore, SQLiteStore
from tailrace.tail._hooks import TailHooks
from tests import fixtures

store = fixtures.each_store  # the fixture: each backend in turn, on a fresh database
GUARD = fixtures.HANG_GUARD


def stream() -> tr.NodeContext:
    ctx = current_node()
    assert ctx is not None
    return ctx


async def read_all(engine: tr.Engine, run_id: str, after: int = 0) -> list[Chunk]:
    async with asyncio.timeout(GUARD):
        return [c async for c in engine.stream(run_id, after=after)]


def by_stream(chunks: list[Chunk]) -> dict[int, list[Chunk]]:
    streams: dict[int, list[Chunk]] = defaultdict(list)
    for c in chunks:
        streams[c.stream].append(c)
    return dict(streams)


def check_well_formed(chunks: list[Chunk]) -> None:
    """Cursors run 1, 2, ... with no gap or repeat; each stream ends with exactly one mark (S2, S3)."""
    assert [c.seq for c in chunks] == list(range(1, len(chunks) + 1))
    for rows in by_stream(chunks).values():
        marks = [c for c in rows if c.terminal]
        assert len(marks) == 1 and rows[-1] is marks[0], rows
        first = rows[0]
        tags = {(c.node_id, c.visit, c.item, c.attempt, c.hedge) for c in rows}
        assert tags == {(first.node_id, first.visit, first.item, first.attempt, first.hedge)}


def values(rows: list[Chunk]) -> list[Any]:
    return [c.value for c in rows if c.kind is ChunkKind.CHUNK]


def mark(rows: list[Chunk]) -> ChunkKind:
    return rows[-1].kind


# --- S1: tags and order ------------------------------------------------------------------


async def test_s1_chunks_carry_their_attempt_and_keep_its_order(store: RunStore) -> None:
    g = tr.Graph("s1")

    @g.task()
    async def plan(n: int) -> list[int]:
        for t in range(3):
            stream().stream({"plan": t})
            await asyncio.sleep(0)
        return list(range(n))

    async def each(x: int) -> int:
        for t in range(4):
            stream().stream(f"item {x} turn {t}")
            await asyncio.sleep(0)
        return x

    g.add_node("each", each, "map")
    g.chain("plan", "each")
    engine = tr.Engine(store=store)
    result = await engine.run(g, 3, run_id="s1-run")
    assert result.output == [0, 1, 2]
    chunks = await read_all(engine, "s1-run")
    check_well_formed(chunks)
    assert {c.run_id for c in chunks} == {"s1-run"}
    streams = list(by_stream(chunks).values())
    assert len(streams) == 4
    plan_rows = [s for s in streams if s[0].node_id == "plan"]
    assert values(plan_rows[0]) == [{"plan": 0}, {"plan": 1}, {"plan": 2}]
    assert (plan_rows[0][0].visit, plan_rows[0][0].item, plan_rows[0][0].attempt) == (1, None, 1)
    items = {s[0].item: s for s in streams if s[0].node_id == "each"}
    assert sorted(items) == [0, 1, 2]
    for x, rows in items.items():
        assert values(rows) == [f"item {x} turn {t}" for t in range(4)]
        assert not rows[0].hedge and rows[0].attempt == 1
    assert {mark(s) for s in streams} == {ChunkKind.ACCEPTED}


async def test_s1_a_loop_streams_per_visit() -> None:
    g = tr.Graph("loop")
    g.add_node("start", lambda x: x)

    @g.task(max_visits=3)
    async def turn(x: int) -> int:
        stream().stream(x)
        return x + 1

    @g.switch()
    def again(x: int) -> str:
        return "more" if x < 3 else "done"

    g.add_edge("start", "turn")
    g.add_edge("turn", "again")
    g.add_edge("again", "turn", route="more")
    g.add_node("end", lambda x: x)
    g.add_edge("again", "end", route="done")
    engine = tr.Engine(store=MemoryStore())
    await engine.run(g, 0, run_id="loop")
    chunks = await read_all(engine, "loop")
    check_well_formed(chunks)
    assert [(c.visit, c.value) for c in chunks if not c.terminal] == [(1, 0), (2, 1), (3, 2)]


def _trained(**seconds: float) -> TailHooks:
    hooks = TailHooks(factor=3.0)
    for key, value in seconds.items():
        for _ in range(3):
            hooks.estimator(key).observe(1.0, value)
    return hooks


async def test_s1_s2_a_hedge_is_tagged_and_the_loser_discarded(tmp_path: Path) -> None:
    calls = 0

    async def h(x: int) -> str:
        nonlocal calls
        calls += 1
        me = calls
        stream().stream(f"attempt {me} starts")
        if me == 1:
            await asyncio.Event().wait()  # stalls until the backup wins and cancels it
        stream().stream(f"attempt {me} ends")
        return f"attempt {me}"

    g = tr.Graph("hedge")
    g.add_node("h", h, hedge=True)
    async with SQLiteStore(tmp_path / "runs.db") as db:
        engine = tr.Engine(store=db, tail=_trained(h=0.01))
        result = await engine.run(g, 0, run_id="hedged")
        assert (result.output, result.hedges) == ("attempt 2", 1)
        chunks = await read_all(engine, "hedged")
    check_well_formed(chunks)
    primary, backup = by_stream(chunks).values()
    assert (primary[0].hedge, values(primary), mark(primary)) == (
        False,
        ["attempt 1 starts"],
        ChunkKind.DISCARDED,
    )
    assert (backup[0].hedge, values(backup), mark(backup)) == (
        True,
        ["attempt 2 starts", "attempt 2 ends"],
        ChunkKind.ACCEPTED,
    )


# --- S2: terminal marks ------------------------------------------------------------------


async def test_s2_each_retried_try_is_discarded_and_the_last_accepted(store: RunStore) -> None:
    tries = 0

    async def flaky(x: int) -> int:
        nonlocal tries
        tries += 1
        stream().stream({"try": tries})
        if tries < 3:
            raise RuntimeError(f"try {tries} broke")
        return tries

    g = tr.Graph("retry")
    g.add_node("flaky", flaky, retry=RetryPolicy(attempts=3))
    engine = tr.Engine(store=store)
    assert (await engine.run(g, 0, run_id="retried")).output == 3
    chunks = await read_all(engine, "retried")
    check_well_formed(chunks)
    streams = list(by_stream(chunks).values())
    assert [(s[0].attempt, values(s), mark(s)) for s in streams] == [
        (1, [{"try": 1}], ChunkKind.DISCARDED),
        (2, [{"try": 2}], ChunkKind.DISCARDED),
        (3, [{"try": 3}], ChunkKind.ACCEPTED),
    ]


async def test_s2_a_failing_run_discards_the_failed_and_the_cancelled(store: RunStore) -> None:
    started = asyncio.Event()

    g = tr.Graph("fails")

    @g.task()
    async def slow(x: int) -> int:
        stream().stream("slow begins")
        started.set()
        await asyncio.Event().wait()
        return x

    @g.task()
    async def broken(x: int) -> int:
        await started.wait()
        stream().stream("about to break")
        raise ValueError("broken on purpose")

    engine = tr.Engine(store=store)
    with pytest.raises(ValueError, match="broken on purpose"):
        await engine.run(g, 0, run_id="failed")
    chunks = await read_all(engine, "failed")
    check_well_formed(chunks)
    ends = {s[0].node_id: mark(s) for s in by_stream(chunks).values()}
    assert ends == {"slow": ChunkKind.DISCARDED, "broken": ChunkKind.DISCARDED}


async def test_s2_items_cancelled_as_late_are_discarded(store: RunStore) -> None:
    async def each(x: int) -> int:
        stream().stream(f"item {x}")
        if x > 0:
            await asyncio.Event().wait()  # stragglers: cancelled at the decision
        return x

    g = tr.Graph("late")
    g.add_node("each", each, "map", required=1, late="cancel")
    engine = tr.Engine(store=store)
    assert (await engine.run(g, [0, 1, 2], run_id="late")).output == [0]
    chunks = await read_all(engine, "late")
    check_well_formed(chunks)
    ends = {s[0].item: mark(s) for s in by_stream(chunks).values()}
    assert ends == {0: ChunkKind.ACCEPTED, 1: ChunkKind.DISCARDED, 2: ChunkKind.DISCARDED}


async def test_s2_a_cancelled_run_discards_what_was_streaming(store: RunStore) -> None:
    streaming = asyncio.Event()

    async def talk(x: int) -> int:
        stream().stream("hello")
        streaming.set()
        await asyncio.Event().wait()
        return x

    g = tr.Graph("cancelled")
    g.add_node("talk", talk)
    engine = tr.Engine(store=store)
    task = asyncio.ensure_future(engine.run(g, 0, run_id="cancelled"))
    async with asyncio.timeout(GUARD):
        await streaming.wait()
        await engine.cancel("cancelled")
        result = await task
    assert result.status is RunStatus.CANCELLED
    chunks = await read_all(engine, "cancelled")
    check_well_formed(chunks)
    assert [(values(s), mark(s)) for s in by_stream(chunks).values()] == [
        (["hello"], ChunkKind.DISCARDED)
    ]


async def test_s2_a_node_that_never_streams_leaves_no_rows(store: RunStore) -> None:
    g = tr.Graph("quiet")
    g.add_node("quiet", lambda x: x + 1)
    engine = tr.Engine(store=store)
    assert (await engine.run(g, 1, run_id="quiet")).output == 2
    assert await read_all(engine, "quiet") == []
    assert await store.chunks("quiet") == []


# --- S3: readers ---------------------------------------------------------------------------


async def test_s3_an_in_process_listener_sees_a_chunk_while_the_node_runs(
    store: RunStore,
) -> None:
    seen = asyncio.Event()

    async def talk(x: int) -> str:
        stream().stream("first")
        await seen.wait()  # only a reader that got "first" live lets the node end
        stream().stream("second")
        return "done"

    g = tr.Graph("live")
    g.add_node("talk", talk)
    engine = tr.Engine(store=store)
    task = asyncio.ensure_future(engine.run(g, 0, run_id="live"))
    await fixtures.until(lambda: engine.is_driving("live"), "the run driven")
    got: list[Chunk] = []
    async with asyncio.timeout(GUARD):
        async for chunk in engine.stream("live"):
            got.append(chunk)
            if chunk.value == "first":
                seen.set()
        await task
    check_well_formed(got)
    assert values(got) == ["first", "second"] and mark(got) is ChunkKind.ACCEPTED


async def test_s3_an_engine_without_a_store_streams_to_its_listeners() -> None:
    seen = asyncio.Event()

    async def talk(x: int) -> str:
        stream().stream({"n": 1})
        await seen.wait()
        return "done"

    g = tr.Graph("memory_only")
    g.add_node("talk", talk)
    engine = tr.Engine()
    task = asyncio.ensure_future(engine.run(g, 0, run_id="memory-only"))
    await fixtures.until(lambda: engine.is_driving("memory-only"), "the run driven")
    got: list[Chunk] = []
    async with asyncio.timeout(GUARD):
        async for chunk in engine.stream("memory-only"):
            got.append(chunk)
            seen.set()
        await task
    assert [(c.kind, c.value) for c in got] == [
        (ChunkKind.CHUNK, {"n": 1}),
        (ChunkKind.ACCEPTED, None),
    ]


async def test_s3_another_store_handle_reads_live_and_resumes_by_cursor(tmp_path: Path) -> None:
    """A second store on the same file (as another process would open it) reads chunks as they
    are committed, before the node ends; a reader that stops resumes from its cursor."""
    db = tmp_path / "runs.db"
    halfway = asyncio.Event()

    async def talk(x: int) -> str:
        for t in range(5):
            stream().stream(t)
        await halfway.wait()
        for t in range(5, 10):
            stream().stream(t)
        return "done"

    g = tr.Graph("remote")
    g.add_node("talk", talk)
    async with SQLiteStore(db) as writer_store, SQLiteStore(db) as reader_store:
        driver = tr.Engine(store=writer_store)
        reader = tr.Engine(store=reader_store)
        task = asyncio.ensure_future(driver.run(g, 0, run_id="remote"))
        await fixtures.until(lambda: _exists(reader_store, "remote"), "the run stored")
        first: list[Chunk] = []
        async with asyncio.timeout(GUARD):
            async for chunk in reader.stream("remote"):
                first.append(chunk)
                if chunk.value == 2:
                    break  # the reader stops mid-stream, before the node ends
        assert not task.done()
        halfway.set()
        rest = await read_all(reader, "remote", after=first[-1].seq)
        await task
        whole = await read_all(reader, "remote")
    assert [c.value for c in first] == [0, 1, 2]
    assert first + rest == whole  # no gap and no repeat
    check_well_formed(whole)
    assert values(whole) == list(range(10))


async def _exists(store: RunStore, run_id: str) -> bool:
    try:
        await store.get_run(run_id)
    except tr.RunNotFound:
        return False
    return True


async def test_s3_a_sync_handler_on_a_thread_streams_in_order(store: RunStore) -> None:
    def count(n: int) -> int:
        ctx = current_node()
        assert ctx is not None
        for t in range(n):
            ctx.stream(t)
        return n

    g = tr.Graph("threaded")
    g.add_node("count", count)
    engine = tr.Engine(store=store)
    assert (await engine.run(g, 50, run_id="threaded")).output == 50
    chunks = await read_all(engine, "threaded")
    check_well_formed(chunks)
    assert values(chunks) == list(range(50)) and mark(chunks) is ChunkKind.ACCEPTED


@pytest.mark.parametrize("second", ["returns", "streams on"])
async def test_s2_a_thread_streaming_after_its_try_timed_out_adds_nothing(
    store: RunStore, second: str
) -> None:
    import threading

    late_sent = threading.Event()

    def slow(x: int) -> str:
        ctx = current_node()
        assert ctx is not None
        ctx.stream(f"try {ctx.attempt} begins")
        if ctx.attempt == 1:
            time.sleep(1.2)  # the try times out meanwhile; the thread runs on
            ctx.stream("too late")
            late_sent.set()
        elif second == "streams on":  # try 2 is still streaming when try 1 sends
            late_sent.wait(GUARD)  # well within try 2's own timeout
            time.sleep(0.02)
            ctx.stream("try 2 ends")
        return f"try {ctx.attempt}"

    g = tr.Graph("timed_out")
    g.add_node("slow", slow, timeout=1.0, retry=RetryPolicy(attempts=2))

    @g.task()
    async def sibling(x: int) -> str:  # keeps the run going until the late chunk was sent
        await asyncio.to_thread(late_sent.wait, GUARD)
        await asyncio.sleep(0.05)  # the late chunk's hand-over to the loop has run
        return "sibling"

    engine = tr.Engine(store=store)
    assert (await engine.run(g, 0, run_id="timed-out")).results["slow"] == "try 2"
    chunks = await read_all(engine, "timed-out")
    check_well_formed(chunks)
    tail = ["try 2 ends"] if second == "streams on" else []
    assert [(s[0].attempt, values(s), mark(s)) for s in by_stream(chunks).values()] == [
        (1, ["try 1 begins"], ChunkKind.DISCARDED),
        (2, ["try 2 begins", *tail], ChunkKind.ACCEPTED),
    ]


# --- S4: chunks are data --------------------------------------------------------------------


async def test_s4_an_unencodable_chunk_is_refused_at_the_call(store: RunStore) -> None:
    refused: list[BaseException] = []

    async def talk(x: int) -> str:
        ctx = stream()
        ctx.stream("fine")
        try:
            ctx.stream({"handle": object()})
        except tr.EncodeError as exc:
            refused.append(exc)
        return "went on"

    g = tr.Graph("unencodable")
    g.add_node("talk", talk)
    engine = tr.Engine(store=store)
    assert (await engine.run(g, 0, run_id="enc")).output == "went on"
    (error,) = refused
    assert "'talk'" in str(error) and "attempt 1" in str(error)
    chunks = await read_all(engine, "enc")
    assert values(chunks) == ["fine"] and mark(chunks) is ChunkKind.ACCEPTED


async def test_s4_an_unencodable_chunk_not_caught_fails_the_node(store: RunStore) -> None:
    async def talk(x: int) -> str:
        stream().stream({1, 2})
        return "never"

    g = tr.Graph("unencodable_fails")
    g.add_node("talk", talk)
    with pytest.raises(tr.EncodeError, match="'talk'"):
        await tr.Engine(store=store).run(g, 0, run_id="enc-fails")
    assert await store.chunks("enc-fails") == []


HOSTILE = "[bold red]x[/] <script>alert(1)</script> '); DROP TABLE runs;-- \x1b[2J \u202e"


async def test_s4_hostile_chunk_text_stays_literal(store: RunStore) -> None:
    async def talk(x: int) -> str:
        stream().stream(HOSTILE)
        stream().stream({HOSTILE: [HOSTILE]})
        return "ok"

    g = tr.Graph("hostile")
    g.add_node("talk", talk)
    engine = tr.Engine(store=store)
    await engine.run(g, 0, run_id="hostile")
    chunks = await read_all(engine, "hostile")
    assert values(chunks) == [HOSTILE, {HOSTILE: [HOSTILE]}]
    assert (await store.get_run("hostile")).status is RunStatus.COMPLETED  # runs is there


# --- the bound and bad arguments --------------------------------------------------------------


async def test_a_run_past_its_chunk_bound_is_refused_naming_it(store: RunStore) -> None:
    refused: list[BaseException] = []

    async def chatty(x: int) -> int:
        ctx = stream()
        for t in range(5):
            try:
                ctx.stream(t)
            except tr.StreamLimit as exc:
                refused.append(exc)
        return x

    g = tr.Graph("bounded")
    g.add_node("chatty", chatty)
    engine = tr.Engine(store=store, max_stream_chunks=3)
    await engine.run(g, 0, run_id="bounded")
    assert len(refused) == 2
    message = str(refused[0])
    assert "'bounded'" in message and "'chatty'" in message and "3" in message
    chunks = await read_all(engine, "bounded")
    assert values(chunks) == [0, 1, 2] and mark(chunks) is ChunkKind.ACCEPTED


async def test_bad_stream_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="max_stream_chunks"):
        tr.Engine(max_stream_chunks=0)
    with pytest.raises(ValueError, match="after"):
        tr.Engine().stream("r", after=-1)


def test_streaming_outside_the_engine_is_a_clear_error() -> None:
    ctx = tr.NodeContext(run_id="r", node_id="n", visit=1, attempt=1)
    with pytest.raises(RuntimeError, match="'n'"):
        ctx.stream("x")


async def test_s3_stream_rows_are_committed_at_once_not_at_the_group_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks reach another store handle while the node runs and nothing else is harvested,
    even with a group window far longer than the test: rows waiting for a stage go as soon as
    the store is free (at once, or when the write in flight ends)."""
    from tailrace.core import _writer

    monkeypatch.setattr(_writer, "GROUP_WINDOW", 3600.0)
    db = tmp_path / "runs.db"
    seen_all = asyncio.Event()

    async def talk(x: int) -> str:
        for t in range(50):
            stream().stream(t)
            await asyncio.sleep(0.001)
        await seen_all.wait()
        return "done"

    g = tr.Graph("hurry")
    g.add_node("talk", talk)
    async with SQLiteStore(db) as writer_store, SQLiteStore(db) as reader_store:
        task = asyncio.ensure_future(tr.Engine(store=writer_store).run(g, 0, run_id="hurry"))
        await fixtures.until(lambda: _exists(reader_store, "hurry"), "the run stored")

        async def fifty_stored() -> bool:
            return len(await reader_store.chunks("hurry", after=0, limit=100)) == 50

        await fixtures.until(fifty_stored, "every chunk committed while the node waits")
        assert not task.done()
        seen_all.set()
        await task
        whole = await read_all(tr.Engine(store=reader_store), "hurry")
    check_well_formed(whole)
    assert values(whole) == list(range(50))


async def test_s3_an_on_chunk_listener_sees_each_row_inside_the_stream_call() -> None:
    """``Engine.on_chunk``: the listener is called as the row is published, before the
    handler's ``stream`` call returns; one that raises is removed and the run goes on."""
    seen: list[tuple[str, object]] = []
    inside: list[int] = []
    g = tr.Graph("listened")

    @g.task()
    async def talk(n: int) -> int:
        node = tr.current_node()
        assert node is not None
        for i in range(n):
            node.stream(i)
            inside.append(len(seen))  # the listener already ran
        return n

    def broken(chunk: tr.Chunk) -> None:
        raise RuntimeError("a listener bug")

    engine = tr.Engine()
    with (
        engine.on_chunk("l1", lambda c: seen.append((c.kind.value, c.value))),
        engine.on_chunk("l1", broken),
    ):
        result = await engine.run(g, 3, run_id="l1")
    assert result.output == 3
    assert seen == [("chunk", 0), ("chunk", 1), ("chunk", 2), ("accepted", None)]
    assert inside == [1, 2, 3]
    with engine.on_chunk("l2", lambda c: seen.append(("late", c.value))):
        pass
    await engine.run(g, 1, run_id="l2")
    assert ("late", 0) not in seen  # a listener that left hears nothing more


# --- S3: cursors out of range and unknown runs, alike on every store ----------------------


async def test_s3_a_cursor_out_of_range_is_refused_alike_on_every_store(store: RunStore) -> None:
    g = tr.Graph("cursor")
    g.add_node("a", lambda x: stream().stream(x))
    engine = tr.Engine(store=store)
    await engine.run(g, 1, run_id="cursor")
    refused = "after must be a stream cursor .*9223372036854775808"
    with pytest.raises(ValueError, match=refused):
        engine.stream("cursor", after=2**63)
    with pytest.raises(ValueError, match=refused):
        await engine.stored_chunks("cursor", after=2**63)
    with pytest.raises(ValueError, match=refused):
        await store.chunks("cursor", after=2**63)
    assert [c async for c in engine.stream("cursor", after=2**63 - 1)] == []


async def test_s3_an_unknown_run_raises_run_not_found_with_a_store_or_without(
    store: RunStore,
) -> None:
    with pytest.raises(tr.RunNotFound):
        [c async for c in tr.Engine(store=store).stream("no-such-run")]
    with pytest.raises(tr.RunNotFound, match="no-such-run"):
        [c async for c in tr.Engine().stream("no-such-run")]
