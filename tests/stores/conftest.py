"""One fixture, ``backend``, parametrised over every store (huey-style contract suite).

Postgres runs whenever ``TAILRACE_TEST_POSTGRES_DSN`` is set (``.ci/postgres.sh``
starts a server and sets it); each test gets a schema of its own.
"""

from __future__ import annotations

import os
import sqlite3
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from tailrace.stores import MemoryStore, RunStore, SQLiteStore

POSTGRES_DSN = os.environ.get("TAILRACE_TEST_POSTGRES_DSN")


class FakeClock:
    """A wall clock that moves only when told to."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class Backend:
    """A store under test plus the back doors the contract tests need."""

    name: str
    store: RunStore
    clock: FakeClock
    #: Another, unopened store on the same database (``None`` for memory).
    sibling: Callable[[], RunStore] | None
    #: Rewrite a run row's format_version behind the store's back.
    set_format_version: Callable[[str, int], Awaitable[None]]


async def _memory_backend() -> AsyncIterator[Backend]:
    clock = FakeClock()
    store = MemoryStore(clock=clock)

    async def set_format_version(run_id: str, version: int) -> None:
        runs = store._runs  # test back door
        runs[run_id] = replace(runs[run_id], format_version=version)

    async with store:
        yield Backend("memory", store, clock, None, set_format_version)


async def _sqlite_backend(path: Path) -> AsyncIterator[Backend]:
    clock = FakeClock()

    async def set_format_version(run_id: str, version: int) -> None:
        with sqlite3.connect(path, isolation_level=None) as conn:
            conn.execute("UPDATE runs SET format_version = ? WHERE run_id = ?", (version, run_id))
        conn.close()

    async with SQLiteStore(path, clock=clock) as store:
        yield Backend(
            "sqlite", store, clock, lambda: SQLiteStore(path, clock=clock), set_format_version
        )


async def _postgres_backend(dsn: str) -> AsyncIterator[Backend]:
    import psycopg
    from psycopg import sql

    from tailrace.stores import PostgresStore

    schema = f"tailrace_test_{uuid.uuid4().hex[:12]}"
    clock = FakeClock()

    async def execute(query: sql.Composable, *params: object) -> None:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            await conn.execute(query, params or None)

    async def set_format_version(run_id: str, version: int) -> None:
        await execute(
            sql.SQL("UPDATE {}.runs SET format_version = %s WHERE run_id = %s").format(
                sql.Identifier(schema)
            ),
            version,
            run_id,
        )

    def sibling() -> RunStore:
        return PostgresStore(dsn, schema=schema, clock=clock)

    try:
        async with sibling() as store:
            yield Backend("postgres", store, clock, sibling, set_format_version)
    finally:
        await execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


@pytest.fixture(
    params=[
        "memory",
        "sqlite",
        pytest.param(
            "postgres",
            marks=[
                pytest.mark.postgres,
                pytest.mark.skipif(
                    POSTGRES_DSN is None, reason="TAILRACE_TEST_POSTGRES_DSN is not set"
                ),
            ],
        ),
    ]
)
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    """Each store in turn, opened on a fresh database, closed afterwards."""
    if request.param == "memory":
        factory = _memory_backend()
    elif request.param == "sqlite":
        factory = _sqlite_backend(tmp_path / "runs.db")
    else:
        assert POSTGRES_DSN is not None
        factory = _postgres_backend(POSTGRES_DSN)
    async for value in factory:
        yield value


@pytest.fixture
async def pg_backend() -> AsyncIterator[Backend]:
    """The Postgres store alone, for tests of what only Postgres has."""
    if POSTGRES_DSN is None:
        pytest.skip("TAILRACE_TEST_POSTGRES_DSN is not set")
    async for value in _postgres_backend(POSTGRES_DSN):
        yield value


@pytest.fixture
async def store(backend: Backend) -> RunStore:
    """The store of ``backend``."""
    return backend.store
