"""SQLite run store: WAL, one writer thread with group commit, reader threads.

Writes never run on the event loop. Each write is a request on a queue; the
single writer thread drains every request waiting, applies them in one
``BEGIN IMMEDIATE ... COMMIT`` with each request inside its own SAVEPOINT (so
a fenced-out or failing request is rolled back alone), and only after COMMIT
resolves each caller's future on its own loop. Reads run on a small pool of
threads with their own read-only connections; WAL lets them proceed while the
writer commits. Several processes may share one file: ``BEGIN IMMEDIATE`` and
the busy timeout serialise their writers.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, cast

from .._errors import RunExists, RunNotFound, StoreError, UnsupportedFormat
from ._base import (
    EventRow,
    FrozenInput,
    Harvest,
    NewRun,
    NodeRow,
    ResultRow,
    RunRecord,
    RunStatus,
    RunStore,
    StoredRun,
)
from ._memory import (
    EMPTY_STATE_JSON,
    check_commit,
    check_holder,
    check_new_format,
    check_readable,
    check_ttl,
    grant_lease,
    parse_status,
)

T = TypeVar("T")

# --- schema and SQL, shared with the Postgres store ----------------------------
# Written once in the common dialect: "?" placeholders (Postgres swaps in "%s"),
# and a /*WITHOUT ROWID*/ comment that SQLite turns into the clause.

RUN_FIELDS = (
    "run_id", "graph_name", "graph_ref", "fingerprint", "status", "input_json", "state_json",
    "error", "created_at", "updated_at", "finished_at", "nodes_done", "lease_owner",
    "lease_expires", "lease_token", "format_version",
)  # fmt: skip
RUN_COLUMNS = ", ".join(RUN_FIELDS)
EVENT_FIELDS = ("seq", "type", "node_id", "visit", "attempt", "ts", "data_json")
EVENT_COLUMNS = ", ".join(EVENT_FIELDS)

INSERT_RUN = f"INSERT INTO runs ({RUN_COLUMNS}) VALUES ({', '.join('?' * len(RUN_FIELDS))})"
UPSERT_NODE = (
    "INSERT INTO node_states (run_id, node_id, status, visits, data_json) VALUES (?, ?, ?, ?, ?) "
    "ON CONFLICT (run_id, node_id) DO UPDATE SET status = excluded.status, "
    "visits = excluded.visits, data_json = excluded.data_json"
)
INSERT_RESULT = "INSERT INTO results (run_id, node_id, visit, value_json) VALUES (?, ?, ?, ?)"
INSERT_FROZEN = (
    "INSERT INTO frozen_inputs (run_id, node_id, activation, payload_json) VALUES (?, ?, ?, ?)"
)
INSERT_EVENT = f"INSERT INTO events (run_id, {EVENT_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
UPDATE_RUN = (
    "UPDATE runs SET state_json = ?, status = ?, error = ?, updated_at = ?, "
    "finished_at = COALESCE(?, finished_at), nodes_done = nodes_done + ? WHERE run_id = ?"
)
EXPIRED_LEASES = (
    "SELECT run_id FROM runs WHERE status = 'running' AND (lease_owner IS NULL "
    "OR lease_expires IS NULL OR lease_expires < ?) "
    "ORDER BY COALESCE(lease_expires, 0), run_id LIMIT ?"
)

#: Numbered migrations; a later one will add the ``questions`` table (issue 4).
MIGRATIONS: tuple[tuple[int, tuple[str, ...]], ...] = (
    (
        1,
        (
            """CREATE TABLE runs (
                run_id TEXT PRIMARY KEY, graph_name TEXT NOT NULL, graph_ref TEXT,
                fingerprint TEXT NOT NULL, status TEXT NOT NULL, input_json TEXT NOT NULL,
                state_json TEXT NOT NULL, error TEXT, created_at DOUBLE PRECISION NOT NULL,
                updated_at DOUBLE PRECISION NOT NULL, finished_at DOUBLE PRECISION,
                nodes_done BIGINT NOT NULL DEFAULT 0, lease_owner TEXT,
                lease_expires DOUBLE PRECISION, lease_token BIGINT NOT NULL DEFAULT 0,
                format_version INTEGER NOT NULL)""",
            "CREATE INDEX runs_by_created ON runs (created_at, run_id)",
            "CREATE INDEX runs_by_status ON runs (status, lease_expires)",
            """CREATE TABLE node_states (
                run_id TEXT NOT NULL, node_id TEXT NOT NULL, status TEXT NOT NULL,
                visits INTEGER NOT NULL, data_json TEXT NOT NULL,
                PRIMARY KEY (run_id, node_id)) /*WITHOUT ROWID*/""",
            """CREATE TABLE results (
                run_id TEXT NOT NULL, node_id TEXT NOT NULL, visit INTEGER NOT NULL,
                value_json TEXT NOT NULL, PRIMARY KEY (run_id, node_id, visit)) /*WITHOUT ROWID*/""",
            """CREATE TABLE frozen_inputs (
                run_id TEXT NOT NULL, node_id TEXT NOT NULL, activation INTEGER NOT NULL,
                payload_json TEXT NOT NULL,
                PRIMARY KEY (run_id, node_id, activation)) /*WITHOUT ROWID*/""",
            """CREATE TABLE events (
                run_id TEXT NOT NULL, seq BIGINT NOT NULL, type TEXT NOT NULL, node_id TEXT,
                visit INTEGER, attempt INTEGER, ts DOUBLE PRECISION NOT NULL,
                data_json TEXT NOT NULL, PRIMARY KEY (run_id, seq)) /*WITHOUT ROWID*/""",
        ),
    ),
)
SCHEMA_VERSION = MIGRATIONS[-1][0]
CREATE_MIGRATIONS_TABLE = (
    "CREATE TABLE schema_migrations (version INTEGER PRIMARY KEY, "
    "applied_at DOUBLE PRECISION NOT NULL)"
)


def record_from_row(row: Sequence[Any]) -> RunRecord:
    """Decode ``row``, a ``runs`` row selected with :data:`RUN_COLUMNS`."""
    fields = dict(zip(RUN_FIELDS, row, strict=True))
    fields["status"] = parse_status(row[0], row[4])
    return RunRecord(**fields)


def event_from_row(row: Sequence[Any]) -> EventRow:
    """Decode ``row``, an ``events`` row selected with :data:`EVENT_COLUMNS`."""
    return EventRow(**dict(zip(EVENT_FIELDS, row, strict=True)))


def new_run_params(run: NewRun) -> tuple[object, ...]:
    """Values of the fresh ``runs`` row for ``run``, in :data:`RUN_COLUMNS` order."""
    status, state, at = RunStatus.RUNNING.value, EMPTY_STATE_JSON, run.created_at
    return (
        run.run_id, run.graph_name, run.graph_ref, run.fingerprint, status, run.input_json,
        state, None, at, at, None, 0, None, None, 0, run.format_version,
    )  # fmt: skip


def harvest_rows(run_id: str, harvest: Harvest) -> Iterator[tuple[str, tuple[object, ...], str]]:
    """Append-only rows of ``harvest`` for run ``run_id``: ``(insert, values, what it is)``."""
    for r in harvest.results:
        what = f"run {run_id!r}: result of node {r.node_id!r} visit {r.visit}"
        yield INSERT_RESULT, (run_id, r.node_id, r.visit, r.value_json), what
    for f in harvest.frozen:
        what = f"run {run_id!r}: frozen input of node {f.node_id!r} activation {f.activation}"
        yield INSERT_FROZEN, (run_id, f.node_id, f.activation, f.payload_json), what
    for e in harvest.events:
        values = (run_id, e.seq, e.type, e.node_id, e.visit, e.attempt, e.ts, e.data_json)
        yield INSERT_EVENT, values, f"run {run_id!r}: event seq {e.seq}"


def append_only_rows(run_id: str, harvest: Harvest) -> list[tuple[str, list[tuple[object, ...]]]]:
    """Append-only rows of ``harvest`` grouped by statement, for ``executemany``."""
    groups: list[tuple[str, list[tuple[object, ...]]]] = []
    if harvest.results:
        groups.append(
            (INSERT_RESULT, [(run_id, r.node_id, r.visit, r.value_json) for r in harvest.results])
        )
    if harvest.frozen:
        groups.append(
            (
                INSERT_FROZEN,
                [(run_id, f.node_id, f.activation, f.payload_json) for f in harvest.frozen],
            )
        )
    if harvest.events:
        groups.append(
            (
                INSERT_EVENT,
                [
                    (run_id, e.seq, e.type, e.node_id, e.visit, e.attempt, e.ts, e.data_json)
                    for e in harvest.events
                ],
            )
        )
    return groups


def first_duplicate(conn: sqlite3.Connection, run_id: str, harvest: Harvest) -> str:
    """Describe the first row of ``harvest`` that is already stored (the slow path of an error)."""
    conn.execute("ROLLBACK TO tailrace_write")  # forget this harvest's partial inserts
    for sql, values, what in harvest_rows(run_id, harvest):
        try:
            conn.execute(sql, values)
        except sqlite3.IntegrityError:
            return what
    return f"run {run_id!r}: a row of this harvest"


def node_params(run_id: str, harvest: Harvest) -> list[tuple[object, ...]]:
    """Values for :data:`UPSERT_NODE`, one tuple per node row of ``harvest`` in run ``run_id``."""
    return [(run_id, n.node_id, n.status, n.visits, n.data_json) for n in harvest.nodes]


def run_update_params(run_id: str, harvest: Harvest, now: float) -> tuple[object, ...]:
    """Values for :data:`UPDATE_RUN` applying ``harvest`` to run ``run_id`` at time ``now``."""
    return (
        harvest.state_json, harvest.status.value, harvest.error, now, harvest.finished_at,
        harvest.nodes_done_delta, run_id,
    )  # fmt: skip


def _newer_schema(where: str, version: int) -> UnsupportedFormat:
    return UnsupportedFormat(
        f"{where}: database schema version {version} is newer than this tailrace "
        f"supports ({SCHEMA_VERSION}); upgrade tailrace. Nothing was written."
    )


def _recorded_version(conn: sqlite3.Connection) -> int | None:
    """The highest applied migration, or ``None`` when the database has never been migrated."""
    exists = conn.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'schema_migrations'"
    ).fetchone()
    if exists is None:
        return None
    row = conn.execute("SELECT MAX(version) FROM schema_migrations").fetchone()
    return int(row[0]) if row[0] is not None else 0


def _migrate(conn: sqlite3.Connection, where: str) -> None:
    """Apply pending migrations in one write transaction, recording each (D4)."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        current = _recorded_version(conn)
        if current is None:
            conn.execute(CREATE_MIGRATIONS_TABLE)
            current = 0
        if current > SCHEMA_VERSION:
            raise _newer_schema(where, current)
        for version, statements in MIGRATIONS:
            if version > current:
                for statement in statements:
                    conn.execute(statement.replace("/*WITHOUT ROWID*/", "WITHOUT ROWID"))
                conn.execute(
                    "INSERT INTO schema_migrations (version, applied_at) VALUES (?, ?)",
                    (version, time.time()),
                )
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


# --- the writer thread ---------------------------------------------------------


@dataclass(slots=True)
class _Write:
    apply: Callable[[sqlite3.Connection], object]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]
    context: str


_Outcome = tuple[_Write, bool, object]


def _settle(future: asyncio.Future[Any], ok: bool, value: Any) -> None:
    if future.done():  # the caller was cancelled meanwhile
        return
    if ok:
        future.set_result(value)
    else:
        future.set_exception(value)


def _deliver(write: _Write, ok: bool, value: object) -> None:
    with contextlib.suppress(RuntimeError):  # a closed loop: nobody is waiting any more
        write.loop.call_soon_threadsafe(_settle, write.future, ok, value)


def _store_error(message: str, cause: BaseException) -> StoreError:
    error = StoreError(message)
    error.__cause__ = cause
    return error


def _map_error(exc: Exception, context: str) -> Exception:
    if isinstance(exc, sqlite3.Error):
        return _store_error(f"{context}: {exc}", exc)
    return exc  # ours (LeaseLost, RunExists, ...) pass through, and so do bugs


class _Writer:
    """Owns the write connection on one thread and commits queued writes in groups."""

    def __init__(self, conn: sqlite3.Connection, *, max_batch: int, name: str) -> None:
        self._conn = conn
        self._max_batch = max_batch
        self._queue: queue.SimpleQueue[_Write | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._stopping = False
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    async def submit(self, context: str, apply: Callable[[sqlite3.Connection], T]) -> T:
        """Queue ``apply`` and wait until the group it joined has committed."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        with self._lock:
            if self._stopping:
                raise StoreError(f"{context}: the SQLite store is closed")
            self._queue.put(_Write(apply, loop, future, context))
        return await future

    def stop(self) -> None:
        """Apply every write queued so far, then end the thread (blocking)."""
        with self._lock:
            if not self._stopping:
                self._stopping = True
                self._queue.put(None)
        self._thread.join()

    def _main(self) -> None:
        try:
            done = False
            while not done:
                batch, done = self._next_batch()
                try:
                    self._commit_batch(batch)
                except Exception as exc:  # a bug must not kill the writer; callers hear of it
                    self._rollback_quietly()
                    for write in batch:
                        _deliver(write, False, _store_error(f"{write.context}: {exc!r}", exc))
        finally:
            self._conn.close()

    def _next_batch(self) -> tuple[list[_Write], bool]:
        """Block for one request, then take every one already waiting (the group)."""
        batch: list[_Write] = []
        item = self._queue.get()
        while item is not None:
            batch.append(item)
            if len(batch) >= self._max_batch:
                return batch, False
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return batch, False
        return batch, True

    def _commit_batch(self, batch: list[_Write]) -> None:
        live = [w for w in batch if not w.future.cancelled()]  # cancelled before it began
        if not live:
            return
        try:
            self._conn.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            for w in live:
                _deliver(w, False, _store_error(f"{w.context}: cannot begin a write: {exc}", exc))
            return
        outcomes: list[_Outcome] = []
        for w in live:
            ok, value, lost = self._apply_one(w)
            outcomes.append((w, ok, value))
            if lost:  # SQLite rolled back the whole group: none of it is durable
                self._rollback_quietly()
                outcomes = _all_failed(outcomes, live, f"a grouped write failed: {value}")
                break
        else:
            try:
                self._conn.execute("COMMIT")
            except sqlite3.Error as exc:
                self._rollback_quietly()
                outcomes = _all_failed(outcomes, live, f"commit failed: {exc}")
        for w, ok, value in outcomes:
            _deliver(w, ok, value)

    def _apply_one(self, write: _Write) -> tuple[bool, object, bool]:
        """Run one request in its own savepoint: ``(ok, value or error, transaction lost)``."""
        conn = self._conn
        try:
            conn.execute("SAVEPOINT tailrace_write")
        except sqlite3.Error as exc:
            return False, _map_error(exc, write.context), True
        try:
            value = write.apply(conn)
        except Exception as exc:
            error = _map_error(exc, write.context)
            try:
                conn.execute("ROLLBACK TO tailrace_write")
                conn.execute("RELEASE tailrace_write")
            except sqlite3.Error:
                return False, error, True
            return False, error, not conn.in_transaction
        try:
            conn.execute("RELEASE tailrace_write")
        except sqlite3.Error as exc:
            return False, _map_error(exc, write.context), True
        return True, value, False

    def _rollback_quietly(self) -> None:
        if self._conn.in_transaction:  # if ROLLBACK fails too, the next BEGIN reports it
            with contextlib.suppress(sqlite3.Error):
                self._conn.execute("ROLLBACK")


def _all_failed(outcomes: list[_Outcome], live: list[_Write], reason: str) -> list[_Outcome]:
    """Outcomes once the group's transaction is gone: own errors stay, the rest fail."""
    failed: list[_Outcome] = [
        (w, False, v if not ok else StoreError(f"{w.context}: {reason}")) for w, ok, v in outcomes
    ]
    failed += [(w, False, StoreError(f"{w.context}: {reason}")) for w in live[len(outcomes) :]]
    return failed


# --- the reader threads --------------------------------------------------------


class _Readers:
    """A few threads, each with its own read-only connection, for reads off the loop."""

    def __init__(self, connect: Callable[[], sqlite3.Connection], count: int) -> None:
        self._connect = connect
        self._executor = ThreadPoolExecutor(count, thread_name_prefix="tailrace-sqlite-read")
        self._local = threading.local()
        self._conns: list[sqlite3.Connection] = []
        self._lock = threading.Lock()

    async def run(self, context: str, read: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``read`` in one read transaction on a reader thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._run, context, read)

    def _run(self, context: str, read: Callable[[sqlite3.Connection], T]) -> T:
        try:
            conn = self._connection()
            conn.execute("BEGIN")
            try:
                return read(conn)
            finally:
                conn.execute("ROLLBACK")
        except sqlite3.Error as exc:
            raise StoreError(f"{context}: {exc}") from exc

    def _connection(self) -> sqlite3.Connection:
        conn = cast("sqlite3.Connection | None", getattr(self._local, "conn", None))
        if conn is None:
            conn = self._connect()
            conn.execute("PRAGMA query_only = ON")
            self._local.conn = conn
            with self._lock:
                self._conns.append(conn)
        return conn

    def close(self) -> None:
        """Finish running reads and close every connection (blocking)."""
        self._executor.shutdown(wait=True)
        with self._lock:
            conns, self._conns = self._conns, []
        for conn in conns:
            conn.close()


# --- the store -----------------------------------------------------------------


class SQLiteStore(RunStore):
    """The embedded default store: one SQLite file in WAL mode.

    Args:
        path: the database file; created, with its schema, on ``open``.
        synchronous: ``"normal"`` (default; a commit survives a process crash,
            the last ones may be lost on power failure) or ``"full"`` (survives
            power failure, several times slower).
        busy_timeout: seconds to wait for another process's write lock.
        readers: number of reader threads (each has its own connection).
        max_batch: most write requests grouped into one transaction.
        clock: wall clock for lease expiry, seconds since the epoch.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        synchronous: Literal["normal", "full"] = "normal",
        busy_timeout: float = 5.0,
        readers: int = 2,
        max_batch: int = 512,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._path = os.fspath(path)
        if self._path in ("", ":memory:") or self._path.startswith("file:"):
            raise ValueError(
                f"SQLiteStore needs a file path, got {self._path!r}; use MemoryStore for memory"
            )
        if synchronous not in ("normal", "full"):
            raise ValueError(f"synchronous must be 'normal' or 'full', got {synchronous!r}")
        if readers < 1 or max_batch < 1:
            raise ValueError("readers and max_batch must be at least 1")
        self._synchronous = synchronous
        self._busy_timeout = busy_timeout
        self._reader_count = readers
        self._max_batch = max_batch
        self._clock = clock
        self._writer: _Writer | None = None
        self._readers: _Readers | None = None

    @property
    def path(self) -> str:
        """The database file."""
        return self._path

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(
            self._path, timeout=self._busy_timeout, isolation_level=None, check_same_thread=False
        )
        conn.execute(f"PRAGMA synchronous = {self._synchronous.upper()}")
        return conn

    def _open_writer_connection(self) -> sqlite3.Connection:
        where = f"SQLite store {self._path!r}"
        try:
            conn = self._connect()
        except sqlite3.Error as exc:
            raise StoreError(f"{where}: cannot open: {exc}") from exc
        try:
            version = _recorded_version(conn)  # before anything writes, WAL switch included
            if version is not None and version > SCHEMA_VERSION:
                raise _newer_schema(where, version)
            mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise StoreError(f"{where}: cannot switch to WAL mode (got {mode!r})")
            _migrate(conn, where)
        except sqlite3.Error as exc:
            conn.close()
            raise StoreError(f"{where}: cannot open: {exc}") from exc
        except BaseException:
            conn.close()
            raise
        return conn

    async def open(self) -> None:
        """Create or migrate the database, start the writer and readers. Idempotent."""
        if self._writer is not None:
            return
        conn = await asyncio.to_thread(self._open_writer_connection)
        self._writer = _Writer(conn, max_batch=self._max_batch, name="tailrace-sqlite-writer")
        self._readers = _Readers(self._connect, self._reader_count)

    async def close(self) -> None:
        """Commit every write already submitted, then stop the threads. Idempotent."""
        writer, readers = self._writer, self._readers
        self._writer = self._readers = None
        if writer is not None:
            await asyncio.to_thread(writer.stop)
        if readers is not None:
            await asyncio.to_thread(readers.close)

    async def _write(self, context: str, apply: Callable[[sqlite3.Connection], T]) -> T:
        if self._writer is None:
            raise StoreError(f"{context}: the SQLite store is not open")
        return await self._writer.submit(context, apply)

    async def _read(self, context: str, read: Callable[[sqlite3.Connection], T]) -> T:
        if self._readers is None:
            raise StoreError(f"{context}: the SQLite store is not open")
        return await self._readers.run(context, read)

    async def create_run(self, run: NewRun) -> None:
        """Store ``run`` with status ``running``; ``RunExists`` if its id is taken."""
        check_new_format(run)

        def apply(conn: sqlite3.Connection) -> None:
            if conn.execute("SELECT 1 FROM runs WHERE run_id = ?", (run.run_id,)).fetchone():
                raise RunExists(f"run {run.run_id!r} already exists")
            conn.execute(INSERT_RUN, new_run_params(run))

        await self._write(f"run {run.run_id!r}", apply)

    async def commit(self, run_id: str, token: int, harvest: Harvest) -> None:
        """Apply ``harvest`` to ``run_id`` in one transaction if ``token`` is current (D1, D6)."""
        await self._write(
            f"run {run_id!r}", lambda conn: self._apply_harvest(conn, run_id, token, harvest)
        )

    def _apply_harvest(
        self, conn: sqlite3.Connection, run_id: str, token: int, harvest: Harvest
    ) -> None:
        status, format_version, lease_token = _one(
            conn, "SELECT status, format_version, lease_token FROM runs WHERE run_id = ?", run_id
        )
        check_commit(
            run_id, current=parse_status(run_id, status), format_version=format_version,
            lease_token=lease_token, token=token, new=harvest.status,
        )  # fmt: skip
        conn.executemany(UPSERT_NODE, node_params(run_id, harvest))
        try:
            for sql, rows in append_only_rows(run_id, harvest):
                conn.executemany(sql, rows)
        except sqlite3.IntegrityError as exc:  # nothing committed is rewritten (D1)
            what = first_duplicate(conn, run_id, harvest)
            raise StoreError(f"{what} already committed; nothing of it was written") from exc
        conn.execute(UPDATE_RUN, run_update_params(run_id, harvest, self._clock()))

    async def load_run(self, run_id: str) -> StoredRun:
        """Return run ``run_id`` with its node rows; ``UnsupportedFormat`` if written by a newer tailrace."""

        def read(conn: sqlite3.Connection) -> StoredRun:
            record = _select_run(conn, run_id)
            check_readable(run_id, record.format_version)
            rows = conn.execute(
                "SELECT node_id, status, visits, data_json FROM node_states WHERE run_id = ?",
                (run_id,),
            )
            nodes = {
                r[0]: NodeRow(node_id=r[0], status=r[1], visits=r[2], data_json=r[3]) for r in rows
            }
            return StoredRun(run=record, nodes=nodes)

        return await self._read(f"run {run_id!r}", read)

    async def get_run(self, run_id: str) -> RunRecord:
        """Return the record of run ``run_id``; ``RunNotFound`` if absent."""
        return await self._read(f"run {run_id!r}", lambda conn: _select_run(conn, run_id))

    async def list_runs(
        self, *, status: RunStatus | None = None, limit: int | None = None
    ) -> list[RunRecord]:
        """Runs newest first (``created_at``, then ``run_id``), only ``status`` ones if given, at most ``limit``."""
        where = "" if status is None else "WHERE status = ?"
        params: tuple[object, ...] = () if status is None else (status.value,)
        sql = (
            f"SELECT {RUN_COLUMNS} FROM runs {where} ORDER BY created_at DESC, run_id DESC LIMIT ?"
        )
        params += (-1 if limit is None else max(limit, 0),)
        return await self._read(
            "listing runs", lambda conn: [record_from_row(r) for r in conn.execute(sql, params)]
        )

    async def results(self, run_id: str, node_id: str | None = None) -> list[ResultRow]:
        """Result rows of ``run_id`` (only ``node_id``'s if given), by node then visit."""

        def read(conn: sqlite3.Connection) -> list[ResultRow]:
            _require_run(conn, run_id)
            rows = conn.execute(
                "SELECT node_id, visit, value_json FROM results WHERE run_id = ? "
                "AND (? IS NULL OR node_id = ?) ORDER BY node_id, visit",
                (run_id, node_id, node_id),
            )
            return [ResultRow(node_id=r[0], visit=r[1], value_json=r[2]) for r in rows]

        return await self._read(f"run {run_id!r}", read)

    async def frozen_inputs(self, run_id: str) -> list[FrozenInput]:
        """First-k decisions of ``run_id``, by node then activation (E4)."""

        def read(conn: sqlite3.Connection) -> list[FrozenInput]:
            _require_run(conn, run_id)
            rows = conn.execute(
                "SELECT node_id, activation, payload_json FROM frozen_inputs WHERE run_id = ? "
                "ORDER BY node_id, activation",
                (run_id,),
            )
            return [FrozenInput(node_id=r[0], activation=r[1], payload_json=r[2]) for r in rows]

        return await self._read(f"run {run_id!r}", read)

    async def events(self, run_id: str, *, after_seq: int = 0) -> list[EventRow]:
        """Events of ``run_id`` with ``seq > after_seq``, in seq order."""

        def read(conn: sqlite3.Connection) -> list[EventRow]:
            _require_run(conn, run_id)
            rows = conn.execute(
                f"SELECT {EVENT_COLUMNS} FROM events WHERE run_id = ? AND seq > ? ORDER BY seq",
                (run_id, after_seq),
            )
            return [event_from_row(r) for r in rows]

        return await self._read(f"run {run_id!r}", read)

    async def acquire_lease(self, run_id: str, owner: str, ttl: float) -> int:
        """Lease ``run_id`` to ``owner`` for ``ttl`` seconds; return the fencing token (D6)."""
        check_ttl(ttl)

        def apply(conn: sqlite3.Connection) -> int:
            holder, expires, lease_token = _select_lease(conn, run_id)
            now = self._clock()
            token = grant_lease(
                run_id, owner, now=now, holder=holder, expires=expires, lease_token=lease_token
            )
            conn.execute(
                "UPDATE runs SET lease_owner = ?, lease_expires = ?, lease_token = ? WHERE run_id = ?",
                (owner, now + ttl, token, run_id),
            )
            return token

        return await self._write(f"run {run_id!r}", apply)

    async def heartbeat(self, run_id: str, owner: str, token: int, ttl: float) -> None:
        """Extend ``owner``'s lease on ``run_id`` to ``ttl`` from now; ``LeaseLost`` if ``token`` is stale."""
        check_ttl(ttl)

        def apply(conn: sqlite3.Connection) -> None:
            holder, _expires, lease_token = _select_lease(conn, run_id)
            check_holder(run_id, owner, token, holder=holder, lease_token=lease_token)
            conn.execute(
                "UPDATE runs SET lease_expires = ? WHERE run_id = ?", (self._clock() + ttl, run_id)
            )

        await self._write(f"run {run_id!r}", apply)

    async def release_lease(self, run_id: str, owner: str, token: int) -> None:
        """Drop ``owner``'s lease on ``run_id`` if still held with ``token``; else do nothing."""
        await self._write(
            f"run {run_id!r}",
            lambda conn: conn.execute(
                "UPDATE runs SET lease_owner = NULL, lease_expires = NULL "
                "WHERE run_id = ? AND lease_owner = ? AND lease_token = ?",
                (run_id, owner, token),
            ),
        )

    async def expired_leases(self, now: float, *, limit: int = 100) -> list[str]:
        """Ids of ``running`` runs with no lease or one that expired before ``now``, at most ``limit``."""
        params = (now, max(limit, 0))
        return await self._read(
            "finding expired leases",
            lambda conn: [r[0] for r in conn.execute(EXPIRED_LEASES, params)],
        )


def _one(conn: sqlite3.Connection, sql: str, run_id: str) -> Any:
    """The one row ``sql`` selects for ``run_id``; :class:`RunNotFound` if there is none."""
    row = conn.execute(sql, (run_id,)).fetchone()
    if row is None:
        raise RunNotFound(f"no run {run_id!r} in the store")
    return row


def _select_run(conn: sqlite3.Connection, run_id: str) -> RunRecord:
    return record_from_row(_one(conn, f"SELECT {RUN_COLUMNS} FROM runs WHERE run_id = ?", run_id))


def _require_run(conn: sqlite3.Connection, run_id: str) -> None:
    _one(conn, "SELECT 1 FROM runs WHERE run_id = ?", run_id)


def _select_lease(conn: sqlite3.Connection, run_id: str) -> tuple[str | None, float | None, int]:
    sql = "SELECT lease_owner, lease_expires, lease_token FROM runs WHERE run_id = ?"
    holder, expires, token = _one(conn, sql, run_id)
    return holder, expires, token
