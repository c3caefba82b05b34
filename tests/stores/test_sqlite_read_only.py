"""Reading a SQLite store never writes (D4; issue 9, finding 7).

A read-only store opens with a ``mode=ro`` URI and never migrates, never
switches the journal mode, never creates a file. So it reads next to a writer
in another process that holds a write transaction, on read-only media, and a
mistyped path is an error naming it, with no empty database left behind. A
read-write open of an up-to-date database reads the schema version first and
takes no write lock either.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

import tailrace.stores as stores
from tailrace._errors import StoreError, UnsupportedFormat
from tailrace.stores import (
    Harvest,
    NewRun,
    QuestionRow,
    RunStore,
    SQLiteStore,
    open_store,
)
from tailrace.stores._sql._statements import (
    CREATE_MIGRATIONS_TABLE,
    MIGRATIONS,
)
from tests.fixtures import migration_1_run

TTL = 30.0
SRC_DIR = Path(stores.__file__).resolve().parents[2]
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC_DIR), os.environ.get("PYTHONPATH")])),
}


def new_run(run_id: str) -> NewRun:
    return NewRun(
        run_id=run_id, graph_name="g", graph_ref=None, fingerprint="fp", input_json="null",
        created_at=float(len(run_id)),
    )  # fmt: skip


def question(question_id: str, run_id: str) -> QuestionRow:
    return QuestionRow(
        question_id=question_id, run_id=run_id, node_id="gate", visit=1, turn=1,
        prompt_json="{}", created_at=1.0,
    )  # fmt: skip


async def filled_database(path: Path) -> None:
    """A current database with run r1 (one question, answered) and r2."""
    async with SQLiteStore(path) as store:
        for run_id in ("r1", "r2"):
            await store.create_run(new_run(run_id))
        token = await store.acquire_lease("r1", "A", TTL)
        await store.commit("r1", token, Harvest(state_json='{"n":1}', questions=(question("q1", "r1"),)))  # fmt: skip
        await store.answer("q1", '"yes"')
        await store.release_lease("r1", "A", token)


def files_of(directory: Path) -> dict[str, str]:
    """Every file in ``directory`` with the digest of its content."""
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.iterdir())
        if p.is_file()
    }


EMPTY = hashlib.sha256(b"").hexdigest()


def assert_unchanged(before: dict[str, str], after: dict[str, str]) -> None:
    """Every file is as it was; new ones are only SQLite's reader machinery.

    A WAL reader needs the shared-memory index (``-shm``) and opens the
    ``-wal``; in a writable directory SQLite creates them, with no data of
    the database in the ``-wal``.
    """
    assert {name: after.get(name) for name in before} == before
    for name in after.keys() - before.keys():
        assert name.endswith("-shm") or (name.endswith("-wal") and after[name] == EMPTY), name


async def read_everything(store: RunStore) -> tuple[object, ...]:
    return (
        [r.run_id for r in await store.list_runs()],
        (await store.load_run("r1")).run.state_json,
        [q.question_id for q in await store.unapplied_answers()],
        await store.events("r1"),
    )


async def test_a_read_only_store_reads_and_leaves_the_file_as_it_was(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    await filled_database(path)
    before = files_of(tmp_path)
    store = open_store(path, read_only=True)
    assert isinstance(store, SQLiteStore) and store.read_only
    async with store:
        assert await read_everything(store) == (["r2", "r1"], '{"n":1}', ["q1"], [])
    assert_unchanged(before, files_of(tmp_path))
    assert not SQLiteStore(path).read_only


WRITES: list[tuple[str, Callable[[RunStore], Awaitable[object]]]] = [
    ("create_run", lambda s: s.create_run(new_run("r3"))),
    ("commit", lambda s: s.commit("r1", 1, Harvest(state_json="{}"))),
    ("acquire_lease", lambda s: s.acquire_lease("r1", "B", TTL)),
    ("heartbeat", lambda s: s.heartbeat("r1", "A", 1, TTL)),
    ("release_lease", lambda s: s.release_lease("r1", "A", 1)),
    ("answer", lambda s: s.answer("q1", "1")),
    ("mark_applied", lambda s: s.mark_applied("q1")),
    ("supersede", lambda s: s.supersede("q1")),
    ("defer_answer", lambda s: s.defer_answer("q1", error="x", retry_at=1.0)),
    ("commit_artifact", lambda s: s.commit_artifact("prompt", 0, "{}")),
]


@pytest.mark.parametrize("write", [w for _, w in WRITES], ids=[n for n, _ in WRITES])
async def test_a_read_only_store_refuses_every_write(
    tmp_path: Path, write: Callable[[RunStore], Awaitable[object]]
) -> None:
    path = tmp_path / "runs.db"
    await filled_database(path)
    before = files_of(tmp_path)
    async with SQLiteStore(path, read_only=True) as store:
        with pytest.raises(StoreError, match=r"opened read-only; nothing was written"):
            await write(store)
        assert await read_everything(store) == (["r2", "r1"], '{"n":1}', ["q1"], [])
    assert_unchanged(before, files_of(tmp_path))


async def test_a_missing_file_is_an_error_naming_it_and_nothing_is_created(
    tmp_path: Path,
) -> None:
    path = tmp_path / "rnus.db"  # a typo
    with pytest.raises(StoreError, match=r"rnus\.db.*no such database file") as info:
        await open_store(path, read_only=True).open()
    assert str(path) in str(info.value)
    assert not path.exists() and not path.with_name("rnus.db-wal").exists()


async def test_a_file_that_is_not_a_tailrace_database_is_refused(tmp_path: Path) -> None:
    other = tmp_path / "other.db"
    with sqlite3.connect(other) as conn:
        conn.execute("CREATE TABLE things (x)")
    conn.close()
    with pytest.raises(StoreError, match="not a tailrace database"):
        await SQLiteStore(other, read_only=True).open()
    garbage = tmp_path / "notes.txt"
    garbage.write_text("these are not the pages you are looking for " * 100)
    with pytest.raises(StoreError, match=r"notes\.txt.*cannot open read-only"):
        await SQLiteStore(garbage, read_only=True).open()
    assert garbage.read_text().startswith("these are not")


def version_3_database(path: Path) -> None:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute(CREATE_MIGRATIONS_TABLE)
    for version, statements in MIGRATIONS[:3]:
        for statement in statements:
            conn.execute(statement.replace("/*WITHOUT ROWID*/", "WITHOUT ROWID"))
        conn.execute("INSERT INTO schema_migrations VALUES (?, 0)", (version,))
    conn.execute(*migration_1_run(new_run("old")))
    conn.close()


async def test_an_older_schema_is_a_clear_error_and_is_not_migrated(tmp_path: Path) -> None:
    path = tmp_path / "v3.db"
    version_3_database(path)
    before = files_of(tmp_path)
    with pytest.raises(StoreError, match=r"schema version 3 is older.*read-write") as info:
        await SQLiteStore(path, read_only=True).open()
    assert not isinstance(info.value, UnsupportedFormat)
    assert_unchanged(before, files_of(tmp_path))
    async with SQLiteStore(path):  # a read-write open migrates it...
        pass
    async with SQLiteStore(path, read_only=True) as store:  # ...and then it reads
        assert [r.run_id for r in await store.list_runs()] == ["old"]


async def test_a_newer_schema_is_unsupported_and_untouched(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    await filled_database(path)
    with sqlite3.connect(path, isolation_level=None) as conn:
        conn.execute("INSERT INTO schema_migrations (version, applied_at) VALUES (999, 0)")
    conn.close()
    before = files_of(tmp_path)
    with pytest.raises(UnsupportedFormat, match=r"schema version 999.*upgrade"):
        await SQLiteStore(path, read_only=True).open()
    assert_unchanged(before, files_of(tmp_path))


# --- next to a writer in another process ------------------------------------------------------

_HOLD_THE_WRITE_LOCK = """
import sqlite3, sys
from tailrace.stores._sql._statements import RUN_FIELDS, new_run_params
from tailrace.stores import NewRun

conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("BEGIN IMMEDIATE")
run = NewRun(run_id="uncommitted", graph_name="g", graph_ref=None, fingerprint="fp",
             input_json="null", created_at=9.0)
fields = RUN_FIELDS[: RUN_FIELDS.index("format_version") + 1]  # as old a database as any
conn.execute(f"INSERT INTO runs ({', '.join(fields)}) VALUES ({', '.join('?' * len(fields))})",
             new_run_params(run)[: len(fields)])
print("locked", flush=True)
sys.stdin.readline()  # hold the write transaction until told
conn.execute("COMMIT")
print("committed", flush=True)
"""


@contextlib.asynccontextmanager
async def writer_holding_the_lock(path: Path) -> AsyncIterator[asyncio.subprocess.Process]:
    """Another process inside ``BEGIN IMMEDIATE`` on ``path``, with one run written, not committed."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _HOLD_THE_WRITE_LOCK, str(path), env=ENV,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    try:
        assert await proc.stdout.readline() == b"locked\n"
        yield proc
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_reading_works_while_another_process_holds_the_write_lock(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    await filled_database(path)
    async with writer_holding_the_lock(path) as writer:
        # Before the fix both opens ran migrations in BEGIN IMMEDIATE and gave
        # up with "database is locked" once busy_timeout had passed.
        async with SQLiteStore(path, read_only=True, busy_timeout=2.0) as reader:
            assert await read_everything(reader) == (["r2", "r1"], '{"n":1}', ["q1"], [])
        async with SQLiteStore(path, busy_timeout=2.0) as current:
            assert [r.run_id for r in await current.list_runs()] == ["r2", "r1"]
        assert writer.stdin is not None and writer.stdout is not None
        writer.stdin.write(b"go\n")
        await writer.stdin.drain()
        assert await writer.stdout.readline() == b"committed\n"
        assert await writer.wait() == 0
    async with SQLiteStore(path, read_only=True) as reader:
        assert [r.run_id for r in await reader.list_runs()] == ["uncommitted", "r2", "r1"]


async def test_a_read_write_open_migrates_under_the_lock_only_when_needed(tmp_path: Path) -> None:
    path = tmp_path / "v3.db"
    version_3_database(path)
    async with writer_holding_the_lock(path) as writer:
        with pytest.raises(StoreError, match="locked"):  # migrating needs the lock
            await SQLiteStore(path, busy_timeout=0.05).open()
        writer.kill()
        await writer.wait()
    async with SQLiteStore(path) as store:
        assert [r.run_id for r in await store.list_runs()] == ["old"]


# --- on read-only media -------------------------------------------------------------------------

_READ_ON_READ_ONLY_MEDIA = """
import asyncio, json, os, sys
from tailrace.stores import open_store

async def main(path):
    directory = os.path.dirname(path)
    try:
        open(os.path.join(directory, "probe"), "w").close()
        writable = True
    except OSError as exc:
        writable = exc.strerror
    async with open_store(path, read_only=True) as store:
        runs = [r.run_id for r in await store.list_runs()]
        answers = [q.question_id for q in await store.unapplied_answers()]
    print(json.dumps({"writable": writable, "runs": runs, "answers": answers,
                      "files": sorted(os.listdir(directory))}))

asyncio.run(main(sys.argv[1]))
"""


def read_on_read_only_media(directory: Path, database: Path) -> dict[str, object]:
    """Run the reader above with ``directory`` made read-only for it; return what it saw.

    As root, permissions do not stop writes, so the directory is bind-mounted
    read-only over itself in a private mount namespace (``unshare``): the
    file system itself refuses writes (EROFS) and the mount ends with the
    process. Otherwise the directory and its files are made read-only with
    ``chmod``, which binds an ordinary user just the same.
    """
    script = directory.parent / "reader.py"
    script.write_text(_READ_ON_READ_ONLY_MEDIA)
    if os.geteuid() == 0:
        mount = 'mount --bind "$1" "$1" && mount -o remount,ro,bind "$1" && exec "$2" "$3" "$4"'
        command = ["unshare", "--mount", "--propagation", "private", "sh", "-c", mount, "sh"]
        command += [str(directory), sys.executable, str(script), str(database)]
        done = subprocess.run(command, capture_output=True, text=True, env=ENV, timeout=120)
    else:
        modes = {p: p.stat().st_mode for p in [directory, *directory.iterdir()]}
        for p in modes:
            p.chmod(0o555 if p.is_dir() else 0o444)
        try:
            done = subprocess.run(
                [sys.executable, str(script), str(database)],
                capture_output=True, text=True, env=ENV, timeout=120,
            )  # fmt: skip
        finally:
            for p, mode in modes.items():
                p.chmod(mode)
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))


@pytest.fixture
def media(tmp_path: Path) -> Path:
    """A directory that ``read_on_read_only_media`` can make read-only."""
    if os.geteuid() == 0:
        probe = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "true"], capture_output=True
        )
        if shutil.which("unshare") is None or probe.returncode != 0:
            pytest.skip("root cannot be stopped by chmod and cannot make a read-only mount here")
    directory = tmp_path / "media"
    directory.mkdir()
    return directory


async def test_reading_works_on_read_only_media(media: Path) -> None:
    path = media / "runs.db"
    await filled_database(path)  # closed cleanly: no -wal or -shm left, all in the main file
    before = files_of(media)
    seen = await asyncio.to_thread(read_on_read_only_media, media, path)
    assert seen["writable"] is not True  # the media really refused a write
    assert (seen["runs"], seen["answers"]) == (["r2", "r1"], ["q1"])
    assert seen["files"] == ["runs.db"] and files_of(media) == before


_CRASH_AFTER_A_COMMIT = """
import os, signal, sqlite3, sys
from tailrace.stores._sql._statements import INSERT_RUN, new_run_params
from tailrace.stores import NewRun

conn = sqlite3.connect(sys.argv[1], isolation_level=None)
run = NewRun(run_id="in-the-wal", graph_name="g", graph_ref=None, fingerprint="fp",
             input_json="null", created_at=9.0)
conn.execute(INSERT_RUN, new_run_params(run))
os.kill(os.getpid(), signal.SIGKILL)  # committed to the WAL, never checkpointed
"""


async def test_reading_on_read_only_media_sees_what_a_crashed_writer_left_in_its_wal(
    media: Path,
) -> None:
    path = media / "runs.db"
    await filled_database(path)
    crash = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _CRASH_AFTER_A_COMMIT, str(path), env=ENV
    )
    assert await crash.wait() == -signal.SIGKILL
    assert (media / "runs.db-wal").stat().st_size > 0
    seen = await asyncio.to_thread(read_on_read_only_media, media, path)
    assert seen["writable"] is not True
    assert seen["runs"] == ["in-the-wal", "r2", "r1"]
