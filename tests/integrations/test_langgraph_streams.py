"""A LangGraph graph's custom stream writes as tailrace stream chunks (S1-S4 for driven graphs).

Real LangGraph graphs and checkpointers: each ``get_stream_writer()`` write
of a node is a chunk of that node's task, tagged with the visit and attempt
the thread's events give it; each task's stream ends ``accepted`` (LangGraph
has its writes) or ``discarded`` (it failed, or stopped on an interrupt and
re-runs as the next attempt). Readers read them with ``Engine.stream`` from
another store handle, or ``tailrace tail``; numbering continues after a
resume, and a driver SIGKILLed mid-stream leaves a stream that ends
``discarded`` once another driver takes the thread over.
"""

from __future__ import annotations

import asyncio
import operator
import os
import signal
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Annotated, Any, TypedDict

import pytest

from tests import fixtures

pytest.importorskip("langgraph")
pytest.importorskip("langgraph.checkpoint.sqlite")

from langgraph.config import get_stream_writer
from langgraph.graph import END, START, StateGraph
from langgraph.types import interrupt

import tailrace
import tailrace as tr
from tailrace import Chunk, ChunkKind, EncodeError
from tailrace.integrations.langgraph import LangGraphDriver
from tailrace.stores import RunStatus, SQLiteStore

lg = fixtures.load_module(
    "tailrace_tests_integrations_lg_graphs", Path(__file__).with_name("lg_graphs.py")
)
GUARD = fixtures.HANG_GUARD
ENV = {**os.environ, "PYTHONPATH": str(Path(tailrace.__file__).parents[1])}


class State(TypedDict, total=False):
    n: Annotated[int, operator.add]
    refused: str


def fan_graph(checkpointer: Any, *, fail: bool = False) -> Any:
    """START -> {left, right} -> END, both streaming; ``right`` interrupts between its writes.

    With ``fail``, ``left`` raises after its writes instead of returning.
    """

    def left(state: State) -> State:
        write = get_stream_writer()
        write({"left": 0})
        write({"left": 1})
        if fail:
            raise RuntimeError("left broke")
        return {"n": 1}

    def right(state: State) -> State:
        write = get_stream_writer()
        write({"right": "before"})
        answer = interrupt("go on?")
        write({"right": "after", "answer": answer})
        return {"n": 10}

    builder = StateGraph(State)
    builder.add_node("left", left)
    builder.add_node("right", right)
    builder.add_edge(START, "left")
    builder.add_edge(START, "right")
    builder.add_edge("left", END)
    builder.add_edge("right", END)
    return builder.compile(checkpointer=checkpointer, name="fan")


def by_stream(chunks: list[Chunk]) -> dict[int, list[Chunk]]:
    streams: dict[int, list[Chunk]] = defaultdict(list)
    for c in chunks:
        streams[c.stream].append(c)
    return dict(streams)


def check_well_formed(chunks: list[Chunk]) -> None:
    """Cursors run 1, 2, ... with no gap or repeat; each stream ends with exactly one mark."""
    assert [c.seq for c in chunks] == list(range(1, len(chunks) + 1))
    for rows in by_stream(chunks).values():
        marks = [c for c in rows if c.terminal]
        assert len(marks) == 1 and rows[-1] is marks[0], rows
        tags = {(c.node_id, c.visit, c.attempt) for c in rows}
        assert len(tags) == 1, rows


def streams_of(chunks: list[Chunk]) -> list[tuple[str, int, int, list[Any], ChunkKind]]:
    """Each stream as (node, visit, attempt, values, its mark), in order of first seq."""
    return [
        (rows[0].node_id, rows[0].visit, rows[0].attempt,
         [c.value for c in rows if not c.terminal], rows[-1].kind)
        for rows in by_stream(chunks).values()
    ]  # fmt: skip


async def read_all(store: SQLiteStore, run_id: str, after: int = 0) -> list[Chunk]:
    async with asyncio.timeout(GUARD):
        return [c async for c in tr.Engine(store=store).stream(run_id, after=after)]


@pytest.mark.parametrize("kind", ["async", "sync"])
async def test_custom_writes_are_chunks_of_their_task_with_marks(tmp_path: Path, kind: str) -> None:
    """Parallel tasks stream apart, tagged like the thread's events; an interrupted task's
    stream is discarded and its re-run after the answer streams as the next attempt, numbered
    after the stored rows; another store handle reads it all in order."""
    db = tmp_path / "runs.db"
    async with (
        lg.saver(kind, tmp_path / "cp.db") as saver,
        SQLiteStore(db) as store,
        SQLiteStore(db) as reader,
    ):
        driver = LangGraphDriver(fan_graph(saver), store, use_async=kind == "async")
        [question] = await driver.start("t1", {"n": 0})
        before = await reader.chunks("t1")
        assert [r.seq for r in before] == list(range(1, len(before) + 1))
        await driver.answer(question.question_id, "yes")
        assert (await store.get_run("t1")).status is RunStatus.COMPLETED
        chunks = await read_all(reader, "t1")
        events = await store.events("t1")
    check_well_formed(chunks)
    assert [c.seq for c in chunks[: len(before)]] == [r.seq for r in before]  # no renumbering
    got = sorted(streams_of(chunks), key=lambda s: (s[0], s[2]))
    assert got == [
        ("left", 1, 1, [{"left": 0}, {"left": 1}], ChunkKind.ACCEPTED),
        ("right", 1, 1, [{"right": "before"}], ChunkKind.DISCARDED),
        ("right", 1, 2, [{"right": "before"}, {"right": "after", "answer": "yes"}],
         ChunkKind.ACCEPTED),
    ]  # fmt: skip
    started = {(e.node_id, e.visit, e.attempt) for e in events if e.type == "node_started"}
    assert {(n, v, a) for n, v, a, _, _ in got} <= started  # the events' own tags
    right = [s for s in streams_of(chunks) if s[0] == "right"]
    assert [s[4] for s in right] == [ChunkKind.DISCARDED, ChunkKind.ACCEPTED]  # in seq order


async def test_a_failed_task_is_discarded_and_an_unencodable_write_is_refused_in_the_node(
    tmp_path: Path,
) -> None:
    def odd(state: State) -> State:
        write = get_stream_writer()
        write({"fine": 1})
        try:
            write({"bad": object()})
        except EncodeError as exc:  # refused at the call, naming the node (S4)
            return {"refused": str(exc)}
        return {"refused": ""}

    builder = StateGraph(State)
    builder.add_node("odd", odd)
    builder.add_edge(START, "odd")
    builder.add_edge("odd", END)
    async with lg.saver("async", tmp_path / "cp.db") as saver, SQLiteStore(tmp_path / "r.db") as s:
        driver = LangGraphDriver(builder.compile(checkpointer=saver, name="odd"), s)
        assert await driver.start("t1", {"n": 0}) == []
        snapshot = await driver.graph.aget_state({"configurable": {"thread_id": "t1"}})
        failing = LangGraphDriver(fan_graph(saver, fail=True), s, name="fan")
        with pytest.raises(RuntimeError, match="left broke"):
            await failing.start("t2", {"n": 0})
        odd_rows = await read_all(s, "t1")
        assert "left broke" in str((await s.get_run("t2")).error)  # the step failed
        failed_rows = await tr.Engine(store=s).stored_chunks("t2")
    assert (
        "'odd'" in snapshot.values["refused"] and "cannot be encoded" in snapshot.values["refused"]
    )
    assert streams_of(odd_rows) == [("odd", 1, 1, [{"fine": 1}], ChunkKind.ACCEPTED)]
    check_well_formed(failed_rows)
    left = [s for s in streams_of(failed_rows) if s[0] == "left"]
    assert left == [("left", 1, 1, [{"left": 0}, {"left": 1}], ChunkKind.DISCARDED)]


async def test_tail_prints_a_threads_chunks_and_marks(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    async with lg.saver("async", tmp_path / "cp.db") as saver, SQLiteStore(db) as store:
        driver = LangGraphDriver(lg.streaming_graph(saver), store)
        await driver.start("t1", {"topic": "tides"})
    tail = [str(Path(sys.executable).parent / "tailrace"), "tail", "t1", "--db", str(db),
            "--no-follow"]  # fmt: skip
    out = await asyncio.to_thread(
        subprocess.run, tail, capture_output=True, text=True, env=ENV, timeout=GUARD, check=True
    )
    lines = out.stdout.splitlines()
    assert len([line for line in lines if '"turn"' in line]) == 5
    assert "accepted" in lines[-1] and "talk" in lines[-1]


async def test_a_driver_killed_mid_stream_leaves_a_discarded_stream_then_the_re_run(
    tmp_path: Path,
) -> None:
    """The driver process is SIGKILLed after ``talk`` streamed five chunks; the next driver
    takes the thread over: the cut stream ends ``discarded``, then the re-run streams as the
    next attempt. A reader that followed it all, and one resumed by cursor, see each row once."""
    db, checkpoints, hold = tmp_path / "runs.db", tmp_path / "cp.db", tmp_path / "hold"
    hold.touch()
    script = Path(__file__).with_name("langgraph_streamer.py")
    child = subprocess.Popen(  # noqa: ASYNC220 (killed and waited on below)
        [sys.executable, str(script), str(db), str(checkpoints), str(hold)], env=ENV
    )
    try:
        async with SQLiteStore(db) as reader_store:
            await fixtures.until(lambda: _exists(reader_store, "t1"), "the thread stored")
            follower = asyncio.ensure_future(read_all(reader_store, "t1"))
            engine = tr.Engine(store=reader_store)
            first: list[Chunk] = []
            async with asyncio.timeout(GUARD):
                async for chunk in engine.stream("t1"):
                    first.append(chunk)
                    if len(first) == 5:
                        break  # a reader that stops with the five chunks of the cut attempt
            child.send_signal(signal.SIGKILL)
            assert await asyncio.to_thread(child.wait, GUARD) == -signal.SIGKILL
            assert (await reader_store.get_run("t1")).status is RunStatus.RUNNING
            hold.unlink()
            async with lg.saver("async", checkpoints) as saver, SQLiteStore(db) as store:
                driver = LangGraphDriver(lg.streaming_graph(saver), store, lease_ttl=1.0)

                async def adopted() -> bool:
                    try:
                        await driver.adopt("t1")
                    except tr.LeaseHeld:  # the dead driver's lease has not expired yet
                        return False
                    return True

                await fixtures.until(adopted, "the thread taken over", every=0.2)
                assert (await store.get_run("t1")).status is RunStatus.COMPLETED
                events = await store.events("t1")
            rest = await read_all(reader_store, "t1", after=first[-1].seq)
            followed = await asyncio.wait_for(follower, GUARD)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert first + rest == followed  # no gap and no repeat for a cursor reader
    check_well_formed(followed)
    turns = [{"turn": i} for i in range(5)]
    assert streams_of(followed) == [
        ("talk", 1, 1, turns, ChunkKind.DISCARDED),
        ("talk", 1, 2, turns, ChunkKind.ACCEPTED),
    ]
    assert ("talk", 1, 2) in {(e.node_id, e.visit, e.attempt) for e in events
                              if e.type == "node_started"}  # fmt: skip


async def _exists(store: SQLiteStore, run_id: str) -> bool:
    try:
        await store.get_run(run_id)
    except tr.RunNotFound:
        return False
    return True
