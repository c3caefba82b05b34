"""Streams under faults (S2, S3, D1, D3): a reader SIGKILLed and restarted with its cursor, a
writer SIGKILLed mid-stream then resumed, a run cancelled mid-stream, a store failing mid-stream.

After each fault every row is read once (cursors 1, 2, ... with no gap or
repeat) and every attempt that streamed ends with exactly one terminal mark;
the attempt the fault cut ends ``discarded``, its re-run ``accepted``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

import tailrace as tr
from tailrace import Chunk, ChunkKind, current_node
from tailrace.stores import RunStore, SQLiteStore
from tests import fixtures
from tests.faults import _faulty as faulty

store = fixtures.each_store  # the fixture: each backend in turn, on a fresh database


def check_well_formed(chunks: list[Chunk]) -> dict[int, list[Chunk]]:
    """No gap and no repeat; one terminal mark per stream, last in it (S2, S3)."""
    assert [c.seq for c in chunks] == list(range(1, len(chunks) + 1))
    streams: dict[int, list[Chunk]] = {}
    for c in chunks:
        streams.setdefault(c.stream, []).append(c)
    for rows in streams.values():
        assert [c.terminal for c in rows].count(True) == 1 and rows[-1].terminal, rows
    return streams


async def read_all(engine: tr.Engine, run_id: str) -> list[Chunk]:
    async with asyncio.timeout(faulty.HANG_GUARD):
        return [c async for c in engine.stream(run_id)]


# --- a reader in another process, SIGKILLed and restarted with its cursor -----------------

READER = """
    import asyncio, os, sys
    import tailrace as tr
    from tailrace.stores import SQLiteStore

    db, run_id, log = sys.argv[1], sys.argv[2], sys.argv[3]

    def cursor():
        if not os.path.exists(log):
            return 0
        lines = open(log).read().split()
        return int(lines[-1].split(":")[0]) if lines else 0

    async def main():
        async with SQLiteStore(db) as store:
            engine = tr.Engine(store=store)
            with open(log, "a") as out:
                async for chunk in engine.stream(run_id, after=cursor()):
                    out.write(f"{chunk.seq}:{chunk.kind.value}:{chunk.value}\\n")
                    out.flush()  # the cursor is what the log holds: SIGKILL loses no line

    asyncio.run(main())
"""

TURNS = 300


@pytest.mark.slow  # real subprocesses, one killed
async def test_a_reader_killed_and_restarted_with_its_cursor_sees_every_chunk_once(
    tmp_path: Path,
) -> None:
    db, log = tmp_path / "runs.db", tmp_path / "seen.log"
    (tmp_path / "reader.py").write_text(textwrap.dedent(READER))
    go_on = asyncio.Event()

    async def talk(n: int) -> int:
        ctx = current_node()
        assert ctx is not None
        for t in range(n):
            ctx.stream(t)
            if t == n // 3:
                await go_on.wait()  # the first reader is killed meanwhile
            await asyncio.sleep(0.001)
        return n

    g = tr.Graph("talker")
    g.add_node("talk", talk)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}

    def reader() -> Any:
        return asyncio.create_subprocess_exec(
            sys.executable, str(tmp_path / "reader.py"), str(db), "talked", str(log), env=env
        )

    async with SQLiteStore(db) as db_store:
        engine = tr.Engine(store=db_store)
        run = asyncio.ensure_future(engine.run(g, TURNS, run_id="talked"))
        await fixtures.until(lambda: _rows(db_store, "talked", 1), "the first chunks stored")
        first = await reader()
        try:
            await fixtures.until(
                lambda: log.exists() and len(log.read_text().split()) >= 20, "the reader reading"
            )
            os.kill(first.pid, signal.SIGKILL)
        finally:
            await first.wait()
        assert first.returncode == -signal.SIGKILL
        go_on.set()
        second = await reader()
        try:
            async with asyncio.timeout(faulty.HANG_GUARD):
                assert (await run).output == TURNS
                assert await second.wait() == 0  # it ends when the run does
        finally:
            if second.returncode is None:
                second.kill()
                await second.wait()
    lines = log.read_text().split()
    assert [int(line.split(":")[0]) for line in lines] == list(range(1, TURNS + 2))
    assert [line.split(":", 2)[2] for line in lines[:-1]] == [str(t) for t in range(TURNS)]
    assert lines[-1].split(":")[1] == "accepted"


# --- a writer SIGKILLed mid-stream, the run then resumed ------------------------------------

WRITER_GRAPH = """
    import asyncio, os
    import tailrace as tr
    from tailrace import current_node

    async def talk(n):
        ctx = current_node()
        for t in range(n):
            ctx.stream({"attempt": ctx.attempt, "turn": t, "phase": os.environ["PHASE"]})
        if os.environ["PHASE"] == "first":
            await asyncio.Event().wait()  # SIGKILLed here, its chunks committed
        return n

    graph = tr.Graph("cut")
    graph.add_node("talk", talk)
"""

WRITER = """
    import asyncio, sys
    sys.path.insert(0, sys.argv[1])
    import tailrace as tr
    from tailrace.stores import SQLiteStore
    import cut_graph

    async def main():
        async with SQLiteStore(sys.argv[2]) as store:
            await tr.Engine(store=store).run(cut_graph.graph, 3, run_id="cut")

    asyncio.run(main())
"""


@pytest.mark.slow  # a real subprocess, killed, and the run resumed
async def test_a_writer_killed_mid_stream_leaves_the_cut_stream_discarded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "cut_graph.py").write_text(textwrap.dedent(WRITER_GRAPH))
    (tmp_path / "writer.py").write_text(textwrap.dedent(WRITER))
    db = tmp_path / "runs.db"
    env = {**os.environ, "PHASE": "first", "PYTHONPATH": os.pathsep.join(sys.path)}
    child = await asyncio.create_subprocess_exec(
        sys.executable, str(tmp_path / "writer.py"), str(tmp_path), str(db), env=env
    )
    try:
        async with SQLiteStore(db) as watcher:
            await fixtures.until(
                lambda: _rows(watcher, "cut", 3), "the cut attempt's chunks committed"
            )
        os.kill(child.pid, signal.SIGKILL)
    finally:
        await child.wait()
    assert child.returncode == -signal.SIGKILL

    monkeypatch.setenv("PHASE", "resumed")
    module = fixtures.load_module("cut_graph", tmp_path / "cut_graph.py")
    async with SQLiteStore(db) as db_store:
        # The killed writer's lease is taken over at once: it provably died on this host (W3).
        engine = tr.Engine(store=db_store)
        result = await faulty.guarded(engine.resume("cut", module.graph), "resume")
        assert result.output == 3
        chunks = await read_all(engine, "cut")
    cut, rerun = check_well_formed(chunks).values()
    assert [c.value["phase"] for c in cut if not c.terminal] == ["first"] * 3
    assert cut[-1].kind is ChunkKind.DISCARDED
    assert [c.value["phase"] for c in rerun if not c.terminal] == ["resumed"] * 3
    assert rerun[-1].kind is ChunkKind.ACCEPTED


async def _rows(store: RunStore, run_id: str, n: int) -> bool:
    try:
        return len(await store.chunks(run_id)) >= n
    except tr.RunNotFound:
        return False


# --- cancellation and a failing store, on every backend ----------------------------------


class Talker:
    """A node that streams three chunks; in phase one it then waits for ``go``, streams two more
    and waits for ever; in any later phase it returns."""

    def __init__(self) -> None:
        self.phase = "first"
        self.streamed = asyncio.Event()
        self.go = asyncio.Event()

    def graph(self) -> tr.Graph:
        g = tr.Graph("talker")

        @g.task()
        async def talk(n: int) -> int:
            ctx = current_node()
            assert ctx is not None
            for t in range(n):
                ctx.stream({"phase": self.phase, "turn": t})
                await asyncio.sleep(0)
            self.streamed.set()
            if self.phase == "first":
                await self.go.wait()
                for t in range(n, n + 2):
                    ctx.stream({"phase": self.phase, "turn": t})
                await asyncio.Event().wait()
            return n

        return g


async def test_a_run_cancelled_mid_stream_discards_it_and_resumes_streaming(
    store: RunStore,
) -> None:
    talker = Talker()
    graph = talker.graph()
    task = asyncio.ensure_future(tr.Engine(store=store).run(graph, 3, run_id="cancelled"))
    await faulty.guarded(talker.streamed.wait(), "streaming")
    task.cancel()
    (outcome,) = await asyncio.gather(task, return_exceptions=True)
    assert isinstance(outcome, asyncio.CancelledError)  # never swallowed
    assert not faulty.lease_tasks()
    talker.phase = "resumed"
    engine = tr.Engine(store=store)
    assert (await faulty.guarded(engine.resume("cancelled", graph), "resume")).output == 3
    cut, rerun = check_well_formed(await read_all(engine, "cancelled")).values()
    assert [c.value["phase"] for c in cut if not c.terminal] == ["first"] * 3
    assert (cut[-1].kind, rerun[-1].kind) == (ChunkKind.DISCARDED, ChunkKind.ACCEPTED)
    assert len(rerun) == 4


async def test_a_store_failing_mid_stream_keeps_what_was_committed(store: RunStore) -> None:
    talker = Talker()
    graph = talker.graph()
    failing = faulty.FailingStore(store, fail_at=1_000_000)
    engine = tr.Engine(store=failing)
    task = asyncio.ensure_future(engine.run(graph, 3, run_id="failing"))
    await faulty.guarded(talker.streamed.wait(), "streaming")
    failing.fail_at = failing.calls + 1  # the commit that carries the next chunks fails
    talker.go.set()
    with pytest.raises(tr.StoreError, match="injected"):
        await faulty.guarded(task, "the run failing")
    assert not faulty.lease_tasks()
    committed = await store.chunks("failing")
    assert all(r.kind == "chunk" for r in committed)  # the failed write's rows never landed
    talker.phase = "resumed"
    again = tr.Engine(store=store)
    assert (await faulty.guarded(again.resume("failing", graph), "resume")).output == 3
    chunks = await read_all(again, "failing")
    streams = check_well_formed(chunks)
    assert [(c.seq, c.value) for c in chunks[: len(committed)]] == [
        (r.seq, {"phase": "first", "turn": r.seq - 1}) for r in committed
    ]
    *cut, rerun = streams.values()
    assert len(cut) == (1 if committed else 0)
    assert all(s[-1].kind is ChunkKind.DISCARDED for s in cut)
    assert rerun[-1].kind is ChunkKind.ACCEPTED
    assert [c.value["phase"] for c in rerun if not c.terminal] == ["resumed"] * 3
