"""The test suite's fixtures, fakes and store-backend plumbing, in one place.

Test modules import it normally (``from tests import fixtures`` or
``from tests.fixtures import ...``); a ``conftest.py`` only registers the
fixtures its folder uses (``from tests.fixtures import backend as backend``), and
a test module may bind one at module level (``store = fixtures.each_store``), so
pytest finds it under that name.

- :data:`POSTGRES_DSN` is ``TAILRACE_TEST_POSTGRES_DSN`` (``.ci/postgres.sh``
  starts a server and sets it); :data:`POSTGRES` is the fixture parameter that
  needs it, marked ``postgres`` and skipped without a server.
- :data:`ALL_STORES` / :data:`SHARED_STORES`: fixture parameters, one per
  backend (the second list only those another process can open).
- :func:`open_store` opens one backend on a fresh database: a new
  :class:`~tailrace.stores.MemoryStore`, a real SQLite file under ``tmp_path``,
  or Postgres in a schema of its own (:func:`postgres_schema`), dropped afterwards.
- :func:`database` hands out a :class:`Database`: many store instances on one
  fresh database, all closed afterwards; :func:`shared_database` gives the URL
  of a fresh database other processes open (a SQLite file, a Postgres schema).
- :class:`Backend` and the fixtures ``backend``, ``pg_backend`` and ``store``:
  the store contract suite's backends, each on a :class:`FakeClock`, with the
  back doors the contract tests need.
- :class:`FakeClock` is a wall clock that moves only when told to; :func:`until`
  polls observed state under a hang guard that is never a timing assertion.
- :func:`load_module` loads a file by path under a fixed top-level name: for
  graph modules whose import name is recorded in stored runs and read back by
  a child process (or shown on a page), so every process names them alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import signal
import sqlite3
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import pytest

from tailrace.stores import (
    Harvest,
    MemoryStore,
    NewRun,
    NodeRow,
    ParkedRow,
    RunStore,
    SQLiteStore,
)
from tailrace.stores._sql._statements import RUN_FIELDS, new_run_params

POSTGRES_DSN = os.environ.get("TAILRACE_TEST_POSTGRES_DSN")

#: The Postgres fixture parameter: marked ``postgres``, skipped without a server.
POSTGRES = pytest.param(
    "postgres",
    marks=[
        pytest.mark.postgres,
        pytest.mark.skipif(POSTGRES_DSN is None, reason="TAILRACE_TEST_POSTGRES_DSN is not set"),
    ],
)
#: Every backend, one fixture parameter each.
ALL_STORES = ["memory", "sqlite", POSTGRES]
#: The backends another process can open too (a crashed child, a daemon, a racer).
SHARED_STORES = ["sqlite", POSTGRES]

#: Seconds after which a wait is a hang; generous, so a loaded machine never trips it.
HANG_GUARD = 30.0

D = TypeVar("D", bound="Database")


def migration_1_run(run: NewRun) -> tuple[str, tuple[object, ...]]:
    """The insert of ``run``'s row into a ``runs`` table of migration 1 (an old database):
    its first columns only, which :data:`INSERT_RUN`'s values begin with."""
    fields = RUN_FIELDS[: RUN_FIELDS.index("format_version") + 1]
    text = f"INSERT INTO runs ({', '.join(fields)}) VALUES ({', '.join('?' * len(fields))})"
    return text, new_run_params(run)[: len(fields)]


def load_module(name: str, path: Path) -> ModuleType:
    """The file at ``path`` as module ``name``, loaded once per process.

    Only for modules that must keep one top-level name in every process (a
    child process loads the same file by path under the same name); helpers
    are imported normally.
    """
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


# --- Postgres schemas ------------------------------------------------------------------


def new_schema(prefix: str) -> str:
    """A schema name no other test uses: ``prefix`` and 12 random hex digits."""
    return f"{prefix}_{uuid.uuid4().hex[:12]}"


def _dsn() -> str:
    assert POSTGRES_DSN is not None, "a Postgres test ran without TAILRACE_TEST_POSTGRES_DSN"
    return POSTGRES_DSN


async def drop_schema(schema: str) -> None:
    """Drop ``schema`` and everything in it (a no-op if it was never created)."""
    import psycopg
    from psycopg import sql

    async with await psycopg.AsyncConnection.connect(_dsn(), autocommit=True) as conn:
        await conn.execute(
            sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema))
        )


def drop_schema_sync(schema: str) -> None:
    """:func:`drop_schema` for fixtures that are not async."""
    import psycopg
    from psycopg import sql

    with psycopg.connect(_dsn(), autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


@contextlib.contextmanager
def shared_database(kind: str, tmp_path: Path, name: str) -> Iterator[str]:
    """The URL of a store other processes can open (``kind``: ``"sqlite"`` or Postgres): a
    SQLite file under ``tmp_path``, or a fresh schema prefixed ``name``, dropped on the way out."""
    if kind == "sqlite":
        yield str(tmp_path / f"{name}.db")
        return
    schema = new_schema(name)
    dsn = _dsn()
    try:
        yield f"{dsn}{'&' if '?' in dsn else '?'}schema={schema}"
    finally:
        drop_schema_sync(schema)


@contextlib.asynccontextmanager
async def postgres_schema(prefix: str = "tailrace_test") -> AsyncIterator[str]:
    """A fresh schema name (see :func:`new_schema`), dropped on the way out."""
    schema = new_schema(prefix)
    try:
        yield schema
    finally:
        await drop_schema(schema)


@contextlib.asynccontextmanager
async def shared_url(kind: str, tmp_path: Path, prefix: str) -> AsyncIterator[str]:
    """The URL of a fresh SQLite file under ``tmp_path`` (``kind`` ``"sqlite"``) or Postgres
    schema (named after ``prefix``) that several processes can open."""
    if kind == "sqlite":
        yield str(tmp_path / f"{prefix}.db")
        return
    async with postgres_schema(prefix) as schema:
        dsn = POSTGRES_DSN or ""
        yield f"{dsn}{'&' if '?' in dsn else '?'}schema={schema}"


# --- opened stores ---------------------------------------------------------------------


@contextlib.asynccontextmanager
async def open_store(
    kind: str,
    tmp_path: Path,
    *,
    filename: str = "runs.db",
    prefix: str = "tailrace_test",
    **postgres: Any,
) -> AsyncIterator[RunStore]:
    """The ``kind`` backend (a parameter of :data:`ALL_STORES`) on a fresh database.

    SQLite opens ``tmp_path / filename``; Postgres a schema named after
    ``prefix``, with the ``postgres`` options (``max_size=1``...).
    """
    if kind == "memory":
        async with MemoryStore() as memory:
            yield memory
    elif kind == "sqlite":
        async with SQLiteStore(tmp_path / filename) as sqlite:
            yield sqlite
    else:
        assert kind == "postgres", f"no backend named {kind!r}"
        async with postgres_store(prefix=prefix, **postgres) as pg:
            yield pg


@contextlib.asynccontextmanager
async def postgres_store(
    *, prefix: str = "tailrace_test", **options: Any
) -> AsyncIterator[RunStore]:
    """A :class:`~tailrace.stores.PostgresStore` with ``options`` in a schema of its own.

    The schema is named after ``prefix`` and dropped once the store is closed.
    """
    from tailrace.stores import PostgresStore

    async with (
        postgres_schema(prefix) as schema,
        PostgresStore(_dsn(), schema=schema, **options) as pg,
    ):
        yield pg


@pytest.fixture(params=ALL_STORES)
async def each_store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[RunStore]:
    """Each backend in turn, on a fresh database."""
    async with open_store(request.param, tmp_path) as opened:
        yield opened


@dataclass
class Database:
    """A fresh database under test: ``store()`` opens another store instance on it.

    Memory has no database beyond its one store, so there every call returns
    that store (opened once).
    """

    name: str
    factory: Callable[[], RunStore]
    opened: list[RunStore] = field(default_factory=list)

    async def store(self) -> RunStore:
        """A store instance on this database, opened (closed by :func:`database`)."""
        store = self.factory()
        if store not in self.opened:
            await store.open()
            self.opened.append(store)
        return store


@contextlib.asynccontextmanager
async def database(
    kind: str, tmp_path: Path, *, cls: type[D], filename: str, max_size: int
) -> AsyncIterator[D]:
    """A ``cls`` on a fresh ``kind`` database; every store it opened is closed afterwards.

    ``filename`` names the SQLite file under ``tmp_path``; ``max_size`` bounds
    each Postgres store's pool.
    """
    async with contextlib.AsyncExitStack() as stack:
        if kind == "memory":
            shared = MemoryStore()
            db = cls("memory", lambda: shared)
        elif kind == "sqlite":
            path = tmp_path / filename
            db = cls("sqlite", lambda: SQLiteStore(path))
        else:
            from tailrace.stores import PostgresStore

            assert kind == "postgres", f"no backend named {kind!r}"
            schema = await stack.enter_async_context(postgres_schema())
            db = cls("postgres", lambda: PostgresStore(_dsn(), schema=schema, max_size=max_size))
        try:
            yield db
        finally:
            for store in db.opened:
                await store.close()


# --- the store contract suite's backends ----------------------------------------------


@dataclass
class Backend:
    """A store under test, its fake clock, and back doors to its raw rows."""

    name: str
    store: RunStore
    clock: FakeClock
    #: Another, unopened store on the same database (``None`` for memory).
    sibling: Callable[[], RunStore] | None
    #: Rewrite a run row's format_version behind the store's back.
    set_format_version: Callable[[str, int], Awaitable[None]]
    #: Rewrite a node row's ``data_json`` behind the store's back.
    set_node_data: Callable[[str, str, str], Awaitable[None]]
    #: Node rows as stored, without any format check.
    raw_nodes: Callable[[str], Awaitable[dict[str, NodeRow]]]
    #: Run one SQL statement behind the store's back (None for memory), and its
    #: placeholder (``?`` or ``%s``).
    execute: Callable[[str, tuple[object, ...]], Awaitable[list[tuple[Any, ...]]]] | None = None
    mark: str = "?"

    def reopen(self) -> RunStore:
        """A store on the same database: a :attr:`sibling`, or for memory the one store."""
        return self.store if self.sibling is None else self.sibling()


async def _memory_backend() -> AsyncIterator[Backend]:
    clock = FakeClock()
    store = MemoryStore(clock=clock)

    # test back doors: the memory store's own dictionaries
    async def set_format_version(run_id: str, version: int) -> None:
        store._runs[run_id] = replace(store._runs[run_id], format_version=version)

    async def set_node_data(run_id: str, node_id: str, data_json: str) -> None:
        rows = store._nodes[run_id]
        rows[node_id] = rows[node_id]._replace(data_json=data_json)

    async def raw_nodes(run_id: str) -> dict[str, NodeRow]:
        return dict(store._nodes.get(run_id, {}))

    async with store:
        yield Backend("memory", store, clock, None, set_format_version, set_node_data, raw_nodes)


async def _sqlite_backend(path: Path) -> AsyncIterator[Backend]:
    clock = FakeClock()

    async def execute(statement: str, params: tuple[object, ...]) -> list[tuple[Any, ...]]:
        conn = sqlite3.connect(path, isolation_level=None, timeout=10)
        try:
            return conn.execute(statement, params).fetchall()
        finally:
            conn.close()

    def sibling() -> RunStore:
        return SQLiteStore(path, clock=clock)

    async with sibling() as store:
        yield Backend(
            "sqlite", store, clock, sibling, *_back_doors(execute, "?"), execute=execute, mark="?"
        )


async def _postgres_backend() -> AsyncIterator[Backend]:
    import psycopg
    from psycopg import sql

    from tailrace.stores import PostgresStore

    clock = FakeClock()

    async with postgres_schema() as schema:

        async def execute(statement: str, params: tuple[object, ...]) -> list[tuple[Any, ...]]:
            async with await psycopg.AsyncConnection.connect(_dsn(), autocommit=True) as conn:
                await conn.execute(
                    sql.SQL("SET search_path TO {}").format(sql.Identifier(schema)), None
                )
                cur = await conn.execute(statement, params)
                return list(await cur.fetchall()) if cur.description else []

        def sibling() -> RunStore:
            return PostgresStore(_dsn(), schema=schema, clock=clock)

        async with sibling() as store:
            yield Backend(
                "postgres", store, clock, sibling, *_back_doors(execute, "%s"),
                execute=execute, mark="%s",
            )  # fmt: skip


def _back_doors(
    execute: Callable[[str, tuple[object, ...]], Awaitable[list[tuple[Any, ...]]]], mark: str
) -> tuple[
    Callable[[str, int], Awaitable[None]],
    Callable[[str, str, str], Awaitable[None]],
    Callable[[str], Awaitable[dict[str, NodeRow]]],
]:
    """:class:`Backend`'s back doors over an SQL database, ``mark`` its placeholder."""

    async def set_format_version(run_id: str, version: int) -> None:
        await execute(
            f"UPDATE runs SET format_version = {mark} WHERE run_id = {mark}", (version, run_id)
        )

    async def set_node_data(run_id: str, node_id: str, data_json: str) -> None:
        await execute(
            f"UPDATE node_states SET data_json = {mark} WHERE run_id = {mark} AND node_id = {mark}",
            (data_json, run_id, node_id),
        )

    async def raw_nodes(run_id: str) -> dict[str, NodeRow]:
        rows = await execute(
            f"SELECT node_id, status, visits, data_json FROM node_states WHERE run_id = {mark}",
            (run_id,),
        )
        return {r[0]: NodeRow(node_id=r[0], status=r[1], visits=r[2], data_json=r[3]) for r in rows}

    return set_format_version, set_node_data, raw_nodes


@pytest.fixture(params=ALL_STORES)
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    """Each store in turn, opened on a fresh database, closed afterwards."""
    if request.param == "memory":
        factory = _memory_backend()
    elif request.param == "sqlite":
        factory = _sqlite_backend(tmp_path / "runs.db")
    else:
        factory = _postgres_backend()
    async for value in factory:
        yield value


@pytest.fixture
async def pg_backend() -> AsyncIterator[Backend]:
    """The Postgres store alone, for tests of what only Postgres has."""
    if POSTGRES_DSN is None:
        pytest.skip("TAILRACE_TEST_POSTGRES_DSN is not set")
    async for value in _postgres_backend():
        yield value


@pytest.fixture
async def store(backend: Backend) -> RunStore:
    """The store of ``backend``."""
    return backend.store


# --- a proxy in front of the server -------------------------------------------------------


#: A connection's reading and writing ends.
Ends = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class SocketProxy:
    """A unix-socket proxy in ``directory`` in front of the Postgres socket ``target``.

    Entering listens; each connection gets one to the server, and a subclass
    passes the bytes (:meth:`link`). Leaving stops listening and ends every
    link. :meth:`dsn` is a DSN through it.
    """

    def __init__(self, target: str, directory: Path) -> None:
        self.target = target
        self.directory = directory
        self._server: asyncio.Server | None = None
        self._links: set[asyncio.Task[None]] = set()

    @classmethod
    def before(cls, dsn: str, directory: Path) -> Any:
        """A proxy in ``directory`` in front of the server ``dsn`` reaches by its socket."""
        from psycopg.conninfo import conninfo_to_dict

        params = conninfo_to_dict(dsn)
        host = str(params.get("host", "/tmp"))
        return cls(f"{host}/.s.PGSQL.{params.get('port', '5432')}", directory)

    def dsn(self, dsn: str) -> str:
        """``dsn`` through this proxy."""
        from psycopg.conninfo import make_conninfo

        return make_conninfo(dsn, host=str(self.directory), port="5432")

    async def __aenter__(self) -> Any:
        path = self.directory / ".s.PGSQL.5432"
        self._server = await asyncio.start_unix_server(self._serve, path=str(path))
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._links):
            task.cancel()
        await asyncio.gather(*self._links, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._links.add(task)
        up_writer: asyncio.StreamWriter | None = None
        try:
            up_reader, up_writer = await asyncio.open_unix_connection(self.target)
            await self.link((reader, writer), (up_reader, up_writer))
        except* (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            for w in (writer, up_writer):
                if w is not None:
                    w.close()
            self._links.discard(task)

    async def link(self, client: Ends, server: Ends) -> None:
        """Pass one connection's bytes between the client's ends and the server's."""
        raise NotImplementedError


# --- time and waiting ------------------------------------------------------------------


class FakeClock:
    """A wall clock that moves only when told to (a store's ``clock=``)."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Move the clock ``seconds`` forward."""
        self.now += seconds


async def until(
    condition: Callable[[], Any],
    what: str = "condition",
    *,
    guard: float = HANG_GUARD,
    every: float = 0.005,
) -> Any:
    """Poll ``condition()`` (or the value it awaits) until it is truthy, and return it.

    Checks every ``every`` seconds; after ``guard`` seconds the test fails,
    naming ``what``. The guard only turns a hang into a failure: no test
    asserts on how long anything took.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + guard
    while True:
        value = condition()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if loop.time() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        await asyncio.sleep(every)


# --- processes ----------------------------------------------------------------------------

#: The repository's root: where test processes run, so ``tests`` imports in them.
ROOT = Path(__file__).resolve().parents[1]


class Procs:
    """Processes a test started, each one's output in ``tmp_path``; stopped by their own pid
    at the end (SIGKILLed if still running), never by name."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        """Start ``args`` in the repository's root with ``env``."""
        with (self.tmp_path / f"proc-{len(self.procs)}.log").open("wb") as log:
            proc = subprocess.Popen(args, stdout=log, stderr=log, env=env, cwd=ROOT)
        self.procs.append(proc)
        return proc

    def worker(
        self, url: str, graphs: str, *queues: str, env: dict[str, str], concurrency: int = 8
    ) -> subprocess.Popen[bytes]:
        """A ``tailrace worker`` process on store ``url`` with ``--graphs graphs``, serving ``queues``."""
        cli = [sys.executable, "-c", "from tailrace.cli import main; main()"]
        args = [*cli, "worker", "--db", url, "--graphs", graphs]
        for queue in queues:
            args += ["--queue", queue]
        return self.start([*args, "--concurrency", str(concurrency)], env)

    def stop(self) -> None:
        """Kill what still runs and reap every process."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    """A :class:`Procs` for the test, stopped when it ends."""
    running = Procs(tmp_path)
    try:
        yield running
    finally:
        running.stop()


async def seed_parked(
    store: RunStore, graph_name: str, node_id: str, values: list[int]
) -> list[str]:
    """Park one item per value for ``graph_name``'s ``node_id`` (P3), oldest first, as a run
    ``late="park"`` leaves them; their park ids, in parked order."""
    run_id = f"seed-{uuid.uuid4().hex[:8]}"
    await store.create_run(
        NewRun(run_id=run_id, graph_name=graph_name, graph_ref="tests:seed", fingerprint="fp",
               input_json="null", created_at=1.0)
    )  # fmt: skip
    token = await store.acquire_lease(run_id, "seeder", 30.0)
    rows = [
        ParkedRow(f"{run_id}-{n}", graph_name, node_id, run_id, 1, n, str(value), None, 1.0 + n)
        for n, value in enumerate(values)
    ]
    await store.commit(run_id, token, Harvest(state_json="{}", parked=rows))
    return [row.park_id for row in rows]


def hear_sigint() -> None:
    """A child's ``preexec_fn``: Ctrl-C (SIGINT) stops it as at a terminal, even when this
    suite runs where SIGINT is ignored (a script started with ``&`` or ``nohup``), which a
    child would otherwise inherit."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
