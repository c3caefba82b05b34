"""SQLite's WAL checkpoints run off the commit path, on the store's own thread.

A commit never runs a checkpoint (syncing the database file can stall a busy
disk for hundreds of milliseconds, and every commit and reader behind it would
wait): the store's checkpointer copies the WAL into the database file while
writes go on. What is committed stays committed whether or not it was copied
yet: a writer SIGKILLed with rows only in its WAL loses none of them.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import sys
import textwrap
from pathlib import Path

import tailrace
from tailrace.stores import ChunkRow, Harvest, NewRun, RunStatus, SQLiteStore
from tests import fixtures

TTL = 30.0
#: About 1.6 MB of stream rows: past SQLite's own 1000-page autocheckpoint.
ROWS, TEXT = 400, '"' + "x" * 4000 + '"'
ENV = {**os.environ, "PYTHONPATH": str(Path(tailrace.__file__).parents[1])}


def chunk(seq: int) -> ChunkRow:
    return ChunkRow(
        seq=seq, stream=1, node_id="a", visit=1, item=None, attempt=1, hedge=0, kind="chunk",
        data_json=TEXT, ts=float(seq),
    )  # fmt: skip


async def leased(store: SQLiteStore, run_id: str = "r1") -> int:
    await store.create_run(
        NewRun(run_id=run_id, graph_name="g", graph_ref=None, fingerprint="fp",
               input_json="1", created_at=1.0)
    )  # fmt: skip
    return await store.acquire_lease(run_id, "A", TTL)


async def write_rows(store: SQLiteStore, token: int, first: int = 1, count: int = ROWS) -> None:
    for seq in range(first, first + count, 20):
        rows = tuple(chunk(s) for s in range(seq, min(seq + 20, first + count)))
        await store.commit("r1", token, Harvest(state_json="{}", status=RunStatus.RUNNING,
                                                chunks=rows))  # fmt: skip


def main_file_size(path: Path) -> int:
    return path.stat().st_size


async def test_the_wal_is_copied_into_the_database_file_while_the_store_is_open(
    tmp_path: Path,
) -> None:
    path = tmp_path / "runs.db"
    async with SQLiteStore(path) as store:
        token = await leased(store)
        before = main_file_size(path)
        await write_rows(store, token)
        await fixtures.until(
            lambda: main_file_size(path) > before + ROWS * 4000,
            "the committed rows copied into the database file",
        )
        assert len(await store.chunks("r1", limit=ROWS + 1)) == ROWS


async def test_a_reader_pinning_the_wal_blocks_no_commit_and_checkpoints_resume_after_it(
    tmp_path: Path,
) -> None:
    """A read transaction held open elsewhere keeps a checkpoint from copying what it may
    still need; commits go on regardless, and once it ends everything is copied."""
    path = tmp_path / "runs.db"
    async with SQLiteStore(path) as store:
        token = await leased(store)
        pin = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        try:
            pin.execute("BEGIN")
            assert pin.execute("SELECT COUNT(*) FROM stream_chunks").fetchone() == (0,)
            before = main_file_size(path)
            async with asyncio.timeout(fixtures.HANG_GUARD):
                await write_rows(store, token)
            assert len(await store.chunks("r1", limit=ROWS + 1)) == ROWS
            assert pin.execute("SELECT COUNT(*) FROM stream_chunks").fetchone() == (0,)
            pin.execute("COMMIT")
        finally:
            pin.close()
        await write_rows(store, token, first=ROWS + 1, count=20)  # a commit nudges the checkpointer
        await fixtures.until(
            lambda: main_file_size(path) > before + ROWS * 4000,
            "the rows copied once the reader let go",
        )


_WRITE_THEN_DIE = textwrap.dedent(
    """
    import asyncio, os, signal, sys
    from tests.stores.test_sqlite_checkpoints import leased, write_rows
    from tailrace.stores import SQLiteStore

    async def main():
        store = SQLiteStore(sys.argv[1])
        await store.open()
        token = await leased(store)
        await write_rows(store, token)
        os.kill(os.getpid(), signal.SIGKILL)  # committed; maybe not copied into the file yet

    asyncio.run(main())
    """
)


async def test_rows_committed_by_a_writer_sigkilled_before_its_checkpoint_survive(
    tmp_path: Path,
) -> None:
    path = tmp_path / "runs.db"
    env = {**ENV, "PYTHONPATH": os.pathsep.join([ENV["PYTHONPATH"], str(Path.cwd())])}
    crash = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _WRITE_THEN_DIE, str(path), env=env, cwd=Path(__file__).parents[2]
    )
    async with asyncio.timeout(fixtures.HANG_GUARD):
        assert await crash.wait() == -signal.SIGKILL
    async with SQLiteStore(path) as store:
        rows = await store.chunks("r1", limit=ROWS + 1)
    assert [r.seq for r in rows] == list(range(1, ROWS + 1))
    assert all(r.data_json == TEXT for r in rows)
