"""What the gate test modules share: the store backends, polling helpers, the side file.

Test modules load this file by path (``tests/`` is not a package) and bind
its fixtures at module level (``backend = backends.backend``), so pytest
finds them there.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import tailrace as tr
from tailrace.stores import MemoryStore, RunStore, SQLiteStore

POSTGRES_DSN = os.environ.get("TAILRACE_TEST_POSTGRES_DSN")
HERE = Path(__file__).resolve().parent
GRAPH_FILE = HERE / "gate_graphs.py"
#: Generous bound on any wait in these tests: they poll observed state, never time it.
TIMEOUT = 20.0


def load(name: str, path: Path) -> ModuleType:
    """The file at ``path`` as module ``name`` (loaded once per process)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


graphs = load("tailrace_tests_gate_graphs", GRAPH_FILE)


@dataclass
class Backend:
    """A database under test: ``store()`` opens another store instance on it."""

    name: str
    factory: Callable[[], RunStore]
    opened: list[RunStore] = field(default_factory=list)
    shared: RunStore | None = None

    async def store(self) -> RunStore:
        """A new opened store on the same database (memory: the one shared store)."""
        if self.shared is not None:
            return self.shared
        store = self.factory()
        await store.open()
        self.opened.append(store)
        return store

    async def engine(self, **options: Any) -> tr.Engine:
        """An engine (its own owner) on a new store instance, told about the gate graphs."""
        return graphs.engine(await self.store(), **options)


async def _drop_schema(dsn: str, schema: str) -> None:
    import psycopg
    from psycopg import sql

    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(
            sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema))
        )


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
    """Each store in turn on a fresh database; every store it opened is closed afterwards."""
    schema = None
    if request.param == "memory":
        shared = MemoryStore()
        await shared.open()
        b = Backend("memory", lambda: shared, shared=shared)
    elif request.param == "sqlite":
        path = tmp_path / "gates.db"
        b = Backend("sqlite", lambda: SQLiteStore(path))
    else:
        from tailrace.stores import PostgresStore

        assert POSTGRES_DSN is not None
        dsn = POSTGRES_DSN
        schema = f"tailrace_gates_{uuid.uuid4().hex[:12]}"
        b = Backend("postgres", lambda: PostgresStore(dsn, schema=schema, max_size=4))
    try:
        yield b
    finally:
        for store in [*b.opened, *([b.shared] if b.shared else [])]:
            await store.close()
        if schema is not None:
            assert POSTGRES_DSN is not None
            await _drop_schema(POSTGRES_DSN, schema)


@pytest.fixture
def side(tmp_path: Path) -> Path:
    """The side file nodes that must run once count their executions in."""
    return tmp_path / "side.log"


async def eventually(
    check: Callable[[], Awaitable[bool]], what: str, within: float = TIMEOUT
) -> None:
    """Poll ``check`` until it is true; fail naming ``what`` after ``within`` seconds."""
    deadline = time.monotonic() + within
    while not await check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def run_status(store: RunStore, run_id: str) -> str:
    """The stored status of ``run_id``."""
    return (await store.get_run(run_id)).status.value


async def is_status(store: RunStore, run_id: str, status: str) -> bool:
    """Whether ``run_id`` is stored with ``status``."""
    return await run_status(store, run_id) == status
