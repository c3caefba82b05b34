"""The evolve ledger, run against every backend (memory, SQLite, Postgres).

An artifact's versions count from 1; ``commit_artifact`` is a compare-and-set
on the head version: exactly one of several writers expecting the same head
wins, across tasks and processes, and a loser gets ``StaleVersion`` with
nothing written. Migration 3 (D4) adds the ledger to a version-2 database in
place.
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import sys
import tempfile
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tailrace.stores as stores
from tailrace._errors import StaleVersion, StoreError
from tailrace.stores import (
    ArtifactVersion,
    MemoryStore,
    NewRun,
    QuestionRow,
    QuestionStatus,
    RunStore,
    SQLiteStore,
)
from tailrace.stores._sql._statements import (
    CREATE_MIGRATIONS_TABLE,
    MIGRATIONS,
    QUESTION_FIELDS,
    question_params,
)

if TYPE_CHECKING:
    from tests.fixtures import Backend

from tests.fixtures import POSTGRES_DSN, migration_1_run

SRC_DIR = Path(stores.__file__).resolve().parents[2]
ENTRIES = json.dumps({"system": "Sé breve ✓", "style": "terse"}, ensure_ascii=False)


def entries(n: int) -> str:
    return json.dumps({"system": f"prompt {n}"})


async def commit_versions(store: RunStore, artifact_id: str, count: int) -> list[ArtifactVersion]:
    """Commit versions 1..``count`` of ``artifact_id`` one after another."""
    return [await store.commit_artifact(artifact_id, n, entries(n + 1)) for n in range(count)]


# --- the contract --------------------------------------------------------------------------


def test_the_ledger_is_part_of_the_contract() -> None:
    assert "ArtifactVersion" in stores.__all__
    assert issubclass(StaleVersion, StoreError)
    ledger = {"artifact_head", "commit_artifact", "artifact_history"}
    assert all(callable(getattr(RunStore, name)) for name in ledger)
    # every backend implements each of them (the contract checks arguments, then calls these)
    assert {f"_{name}" for name in ledger} <= RunStore.__abstractmethods__


async def test_an_artifact_starts_empty(store: RunStore) -> None:
    assert await store.artifact_head("prompt") is None
    assert await store.artifact_history("prompt") == []


async def test_the_first_commit_expects_0_and_makes_version_1(backend: Backend) -> None:
    stored = await backend.store.commit_artifact("prompt", 0, ENTRIES)
    assert stored == ArtifactVersion(
        artifact_id="prompt", version=1, entries_json=ENTRIES, meta_json="{}",
        created_at=backend.clock.now,
    )  # fmt: skip
    assert await backend.store.artifact_head("prompt") == stored
    assert await backend.store.artifact_history("prompt") == [stored]


async def test_head_is_the_newest_and_history_is_oldest_first(backend: Backend) -> None:
    store = backend.store
    v1 = await store.commit_artifact("prompt", 0, entries(1))
    backend.clock.advance(5)
    meta = json.dumps({"edit": "shorter", "score": 0.75, "merged_by": "alice"})
    v2 = await store.commit_artifact("prompt", 1, entries(2), meta)
    assert (v2.version, v2.meta_json, v2.created_at) == (2, meta, v1.created_at + 5)
    other = await store.commit_artifact("rules", 0, entries(9))  # artifacts are independent
    assert await store.artifact_head("prompt") == v2
    assert await store.artifact_history("prompt") == [v1, v2]
    assert await store.artifact_history("rules") == [other]
    assert other.version == 1


@pytest.mark.parametrize("expected", [0, 2, 7])
async def test_a_stale_commit_is_refused_and_writes_nothing(store: RunStore, expected: int) -> None:
    before = await commit_versions(store, "prompt", 1)
    with pytest.raises(StaleVersion) as info:
        await store.commit_artifact("prompt", expected, entries(99))
    message = str(info.value)
    assert "'prompt'" in message
    assert f"expected head version {expected}" in message
    assert "head is version 1" in message
    assert await store.artifact_history("prompt") == before
    assert await store.artifact_head("prompt") == before[-1]


async def test_a_commit_expecting_a_version_of_a_new_artifact_is_stale(store: RunStore) -> None:
    with pytest.raises(StaleVersion, match=r"'fresh'.*expected head version 1.*head is version 0"):
        await store.commit_artifact("fresh", 1, entries(1))
    assert await store.artifact_head("fresh") is None
    assert (await store.commit_artifact("fresh", 0, entries(1))).version == 1


@pytest.mark.parametrize("expected", [-1, True, 1.0])
async def test_expected_must_be_an_int_of_at_least_0(store: RunStore, expected: Any) -> None:
    with pytest.raises(ValueError, match=r"'prompt'.*int >= 0"):
        await store.commit_artifact("prompt", expected, entries(1))
    assert await store.artifact_history("prompt") == []


async def test_versions_survive_a_reopen(backend: Backend) -> None:
    written = await commit_versions(backend.store, "prompt", 3)
    await backend.store.close()
    await backend.store.open()
    assert await backend.store.artifact_history("prompt") == written
    if backend.sibling is not None:  # another store on the same database sees them too
        async with backend.sibling() as sibling:
            assert await sibling.artifact_head("prompt") == written[-1]
            assert (await sibling.commit_artifact("prompt", 3, entries(4))).version == 4
        head = await backend.store.artifact_head("prompt")
        assert head is not None
        assert head.version == 4


# --- exactly one winner --------------------------------------------------------------------


@pytest.mark.parametrize("head", [0, 2])
async def test_16_concurrent_commits_have_exactly_one_winner(store: RunStore, head: int) -> None:
    before = await commit_versions(store, "prompt", head)
    outcomes = await asyncio.gather(
        *(store.commit_artifact("prompt", head, entries(100 + i)) for i in range(16)),
        return_exceptions=True,
    )
    winners = [o for o in outcomes if isinstance(o, ArtifactVersion)]
    losers = [o for o in outcomes if isinstance(o, StaleVersion)]
    assert len(winners) == 1
    assert len(losers) == 15
    assert all(f"head is version {head + 1}" in str(e) for e in losers)
    assert winners[0].version == head + 1
    assert await store.artifact_history("prompt") == [*before, winners[0]]


_COMMITTER = """
import asyncio, json, sys
from tailrace._errors import StaleVersion
from tailrace.stores import ArtifactVersion, SQLiteStore

async def main(kind, target, schema, tag):
    if kind == "sqlite":
        store = SQLiteStore(target, busy_timeout=30)
    else:
        from tailrace.stores import PostgresStore
        store = PostgresStore(target, schema=schema, max_size=4)
    async with store:
        print("ready", flush=True)
        await asyncio.to_thread(sys.stdin.readline)  # the start signal: all race at once
        outcomes = await asyncio.gather(
            *(store.commit_artifact("prompt", 1, json.dumps(f"{tag}-{i}")) for i in range(4)),
            return_exceptions=True,
        )
    print(json.dumps({
        "wins": [[o.version, o.entries_json] for o in outcomes if isinstance(o, ArtifactVersion)],
        "lost": sum(isinstance(o, StaleVersion) for o in outcomes),
        "other": [repr(o) for o in outcomes if not isinstance(o, (ArtifactVersion, StaleVersion))],
    }))

asyncio.run(main(*sys.argv[1:]))
"""


async def _race_in_processes(args: list[str], count: int) -> list[dict[str, Any]]:
    """Start ``count`` committer processes, let them race at once, return their reports."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC_DIR), os.environ.get("PYTHONPATH")])),
    }
    pipe = asyncio.subprocess.PIPE
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            _COMMITTER,
            *args,
            f"p{n}",
            env=env,
            stdin=pipe,
            stdout=pipe,
            stderr=pipe,
        )
        for n in range(count)
    ]
    try:
        for p in procs:
            assert p.stdout is not None
            assert await p.stdout.readline() == b"ready\n", (await p.communicate())[1].decode()
        for p in procs:
            assert p.stdin is not None
            p.stdin.write(b"go\n")
            await p.stdin.drain()
            p.stdin.close()
        reports: list[dict[str, Any]] = []
        for p in procs:
            out, err = await p.communicate()
            assert p.returncode == 0, err.decode()
            reports.append(json.loads(out))
        return reports
    finally:  # a failed test must not leave its racers waiting on stdin
        for p in procs:
            if p.returncode is None:
                p.kill()
                await p.wait()


@pytest.mark.slow
async def test_commits_racing_across_processes_have_exactly_one_winner(backend: Backend) -> None:
    if backend.sibling is None:
        pytest.skip("a memory store is one process's own")
    store = backend.store
    (v1,) = await commit_versions(store, "prompt", 1)
    if isinstance(store, SQLiteStore):
        args = ["sqlite", store.path, "-"]
    else:
        assert POSTGRES_DSN is not None
        args = ["postgres", POSTGRES_DSN, store.schema]  # type: ignore[attr-defined]
    reports = await _race_in_processes(args, 4)
    wins = [w for r in reports for w in r["wins"]]
    assert len(wins) == 1
    assert sum(r["lost"] for r in reports) == 15
    assert [o for r in reports for o in r["other"]] == []
    history = await store.artifact_history("prompt")
    assert [(v.version, v.entries_json) for v in history] == [(1, v1.entries_json), tuple(wins[0])]


# --- the commit rule as a model (Hypothesis) ---------------------------------------------


async def _replay(store: RunStore, commits: list[tuple[str, int]]) -> None:
    """Replay ``commits`` (artifact, expected) and check each against the model: head = count."""
    model: dict[str, int] = {}
    for n, (artifact_id, expected) in enumerate(commits):
        head = model.get(artifact_id, 0)
        if expected == head:
            stored = await store.commit_artifact(artifact_id, expected, entries(n))
            assert stored.version == head + 1
            model[artifact_id] = head + 1
        else:
            with pytest.raises(StaleVersion):
                await store.commit_artifact(artifact_id, expected, entries(n))
    for artifact_id, head in model.items():
        history = await store.artifact_history(artifact_id)
        assert [v.version for v in history] == list(range(1, head + 1))
        assert await store.artifact_head(artifact_id) == history[-1]


_COMMITS = st.lists(st.tuples(st.sampled_from(["a", "b"]), st.integers(0, 4)), max_size=25)


@settings(max_examples=200, deadline=None)
@given(commits=_COMMITS)
def test_memory_store_follows_the_commit_rule(commits: list[tuple[str, int]]) -> None:
    async def replay() -> None:
        async with MemoryStore() as store:
            await _replay(store, commits)

    asyncio.run(replay())


@settings(max_examples=30, deadline=None)
@given(commits=_COMMITS)
def test_sqlite_store_follows_the_commit_rule(commits: list[tuple[str, int]]) -> None:
    async def replay(path: Path) -> None:
        async with SQLiteStore(path) as store:
            await _replay(store, commits)

    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(replay(Path(tmp) / "runs.db"))


# --- driver errors are mapped at the seam ------------------------------------------------


async def _drop_ledger_behind_the_stores_back(backend: Backend) -> type[Exception]:
    """Drop ``artifact_versions`` by a side door; return the driver's base exception type."""
    store = backend.store
    if isinstance(store, SQLiteStore):
        with sqlite3.connect(store.path, isolation_level=None) as conn:
            conn.execute("DROP TABLE artifact_versions")
        conn.close()
        return sqlite3.Error
    import psycopg
    from psycopg import sql

    assert POSTGRES_DSN is not None
    async with await psycopg.AsyncConnection.connect(POSTGRES_DSN, autocommit=True) as conn:
        await conn.execute(
            sql.SQL("DROP TABLE {}.artifact_versions").format(
                sql.Identifier(store.schema)  # type: ignore[attr-defined]
            )
        )
    return psycopg.Error


async def test_driver_errors_become_store_errors(backend: Backend) -> None:
    if backend.sibling is None:
        pytest.skip("a memory store has no driver")
    driver_error = await _drop_ledger_behind_the_stores_back(backend)
    calls = [
        backend.store.artifact_head("prompt"),
        backend.store.commit_artifact("prompt", 0, entries(1)),
        backend.store.artifact_history("prompt"),
    ]
    for call in calls:
        with pytest.raises(StoreError, match="'prompt'") as info:
            await call
        assert not isinstance(info.value, StaleVersion)
        assert isinstance(info.value.__cause__, driver_error)


# --- D4: migration 3 adds the ledger to a version-2 database in place -----------------------


def _version_2_migrations() -> list[str]:
    assert [v for v, _ in MIGRATIONS[:2]] == [1, 2]
    statements = [s for _, group in MIGRATIONS[:2] for s in group]
    assert not any("artifact_versions" in s for s in statements)
    return statements


def _old_run() -> NewRun:
    return NewRun(
        run_id="old", graph_name="g", graph_ref=None, fingerprint="fp", input_json="null",
        created_at=1.0,
    )  # fmt: skip


def _old_question() -> QuestionRow:
    return QuestionRow(
        question_id="q-old", run_id="old", node_id="gate", visit=1, turn=1, prompt_json="{}",
        created_at=1.0,
    )  # fmt: skip


def _old_question_insert() -> tuple[str, tuple[object, ...]]:
    """Insert ``_old_question()`` into a version-2 table (before migration 4 added columns)."""
    fields = QUESTION_FIELDS[: QUESTION_FIELDS.index("applied_at") + 1]
    text = f"INSERT INTO questions ({', '.join(fields)}) VALUES ({', '.join('?' * len(fields))})"
    return text, question_params(_old_question())[: len(fields)]


async def _old_rows_remain_and_the_ledger_works(store: RunStore) -> None:
    assert (await store.get_run("old")).input_json == "null"
    assert (await store.get_question("q-old")).status is QuestionStatus.OPEN
    assert await store.artifact_head("prompt") is None
    assert (await store.commit_artifact("prompt", 0, ENTRIES)).version == 1


async def test_sqlite_upgrades_a_version_2_database(tmp_path: Path) -> None:
    path = tmp_path / "v2.db"
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute(CREATE_MIGRATIONS_TABLE)
    for statement in _version_2_migrations():
        conn.execute(statement.replace("/*WITHOUT ROWID*/", "WITHOUT ROWID"))
    conn.execute("INSERT INTO schema_migrations (version, applied_at) VALUES (1, 0), (2, 0)")
    conn.execute(*migration_1_run(_old_run()))
    conn.execute(*_old_question_insert())
    conn.close()
    async with SQLiteStore(path) as store:
        await _old_rows_remain_and_the_ledger_works(store)
    async with SQLiteStore(path) as store:  # nothing left to apply; the version is still there
        assert (await store.artifact_head("prompt")) is not None
    with sqlite3.connect(path) as conn:
        versions = conn.execute("SELECT version FROM schema_migrations ORDER BY version").fetchall()
    conn.close()
    assert versions == [(v,) for v, _ in MIGRATIONS]


@pytest.mark.postgres
@pytest.mark.skipif(POSTGRES_DSN is None, reason="TAILRACE_TEST_POSTGRES_DSN is not set")
async def test_postgres_upgrades_a_version_2_database() -> None:
    import psycopg
    from psycopg import sql

    from tailrace.stores import PostgresStore

    assert POSTGRES_DSN is not None
    schema = f"tailrace_v2_{uuid.uuid4().hex[:12]}"
    ident = sql.Identifier(schema)
    async with await psycopg.AsyncConnection.connect(POSTGRES_DSN, autocommit=True) as conn:
        await conn.execute(sql.SQL("CREATE SCHEMA {}").format(ident))
    try:
        async with await psycopg.AsyncConnection.connect(POSTGRES_DSN) as conn:
            await conn.execute(sql.SQL("SET search_path TO {}").format(ident))
            await conn.execute(CREATE_MIGRATIONS_TABLE)
            for statement in _version_2_migrations():
                await conn.execute(statement)
            await conn.execute("INSERT INTO schema_migrations VALUES (1, 0), (2, 0)")
            run_text, run_values = migration_1_run(_old_run())
            await conn.execute(run_text.replace("?", "%s"), run_values)
            sql_text, values = _old_question_insert()
            await conn.execute(sql_text.replace("?", "%s"), values)
            await conn.commit()
        racers = [PostgresStore(POSTGRES_DSN, schema=schema) for _ in range(3)]
        try:
            await asyncio.gather(*(s.open() for s in racers))  # upgrade once, under the lock
            await _old_rows_remain_and_the_ledger_works(racers[0])
            assert (await racers[2].artifact_head("prompt")) is not None
        finally:
            await asyncio.gather(*(s.close() for s in racers))
        async with await psycopg.AsyncConnection.connect(POSTGRES_DSN) as conn:
            cur = await conn.execute(
                sql.SQL("SELECT version FROM {}.schema_migrations ORDER BY version").format(ident)
            )
            assert await cur.fetchall() == [(v,) for v, _ in MIGRATIONS]
    finally:
        async with await psycopg.AsyncConnection.connect(POSTGRES_DSN, autocommit=True) as conn:
            await conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(ident))
