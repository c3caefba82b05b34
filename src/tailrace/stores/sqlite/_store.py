"""SQLite run store: WAL, one writer thread with group commit, reader threads.

Writes never run on the event loop. Each write is a request on a queue; the
single writer thread drains every request waiting, applies them in one
``BEGIN IMMEDIATE ... COMMIT`` with each request inside its own SAVEPOINT (so
a fenced-out or failing request is rolled back alone), and only after COMMIT
resolves each caller's future on its own loop. Reads run on a small pool of
threads with their own read-only connections; WAL lets them proceed while the
writer commits. Several processes may share one file: ``BEGIN IMMEDIATE`` and
the busy timeout serialise their writers. The threads live in
``_threads``; the schema and SQL, shared with Postgres, in ``_sql``. The
operations are written once in :class:`~tailrace.stores._sql._base.SQLStore`;
this module runs their bodies on the threads as a
:class:`~tailrace.stores.sqlite._tx.SQLiteTx` (:meth:`SQLiteStore._read_tx`,
:meth:`SQLiteStore._write_tx`), and ``sqlite3`` errors become ours where the
threads run them (``_errors``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import time
from collections.abc import Callable
from typing import Literal, TypeVar

from ..._errors import StoreError
from .._changes import ChangeHub
from .._presence import Sessions
from .._rules import read_only_refusal
from .._sql._base import Body, SQLStore, Texts, Undo
from .._sql._transactions import run_now
from ._errors import mapped_errors
from ._files import prepare_for_writing, read_only_connection, read_only_uri
from ._presence import FileTokens
from ._queues import DataVersionWatch
from ._threads import Checkpointer, Readers, Writer, finish_despite_cancellation
from ._threads import Undo as ConnUndo
from ._tx import SQLiteTx

T = TypeVar("T")


def _on_conn(body: Body[T]) -> Callable[[sqlite3.Connection], T]:
    """What a thread runs on its connection: ``body``, at once (a ``SQLiteTx`` never suspends)."""
    return lambda conn: run_now(body(SQLiteTx(conn)))


async def _open_in_thread(connect: Callable[[], sqlite3.Connection]) -> sqlite3.Connection:
    """``connect()`` on a thread; if the caller is cancelled meanwhile, the connection is closed."""
    opening = asyncio.ensure_future(asyncio.to_thread(connect))
    try:
        return await asyncio.shield(opening)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):  # it failed to open: nothing to close
            (await finish_despite_cancellation(opening)).close()
        raise


# --- the store -----------------------------------------------------------------


class SQLiteStore(SQLStore):
    """The embedded default store: one SQLite file in WAL mode.

    Args:
        path: the database file; created, with its schema, on ``open`` (unless
            ``read_only``).
        synchronous: ``"normal"`` (default; a commit survives a process crash,
            the last ones may be lost on power failure) or ``"full"`` (survives
            power failure, several times slower).
        busy_timeout: seconds to wait for another process's write lock.
        readers: number of reader threads (each has its own connection).
        max_batch: most write requests grouped into one transaction.
        clock: wall clock for lease expiry, seconds since the epoch.
        read_only: read an existing database and never write to it: no
            migrations, no WAL switch, no file created; writes raise
            ``StoreError``. Works next to a writer in another process and on
            read-only media (see ``_files``).
    """

    _no_limit = -1

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        synchronous: Literal["normal", "full"] = "normal",
        busy_timeout: float = 5.0,
        readers: int = 2,
        max_batch: int = 512,
        clock: Callable[[], float] = time.time,
        read_only: bool = False,
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
        self._read_only = read_only
        self._read_uri: str | None = None  # the read-only URI, once open
        self._writer: Writer | None = None
        self._checkpointer: Checkpointer | None = None
        self._readers: Readers | None = None
        self._hub = ChangeHub(lambda hub: DataVersionWatch(self._connect).start(hub))
        where = f"SQLite store {self._path!r}"
        self._sessions = Sessions(self, FileTokens(self._path, where), where)

    @property
    def path(self) -> str:
        """The database file."""
        return self._path

    @property
    def read_only(self) -> bool:
        """Whether this store reads only (it then refuses every write)."""
        return self._read_only

    def _connect(self) -> sqlite3.Connection:
        if self._read_uri is not None:
            return read_only_connection(self._read_uri, self._busy_timeout)
        conn = sqlite3.connect(
            self._path, timeout=self._busy_timeout, isolation_level=None, check_same_thread=False
        )
        conn.execute(f"PRAGMA synchronous = {self._synchronous.upper()}")
        return conn

    def _open_writer_connection(self) -> sqlite3.Connection:
        where = f"SQLite store {self._path!r}"
        with mapped_errors(where, "cannot open: "):
            conn = self._connect()
            try:
                prepare_for_writing(conn, where, self._busy_timeout)
                conn.execute("PRAGMA wal_autocheckpoint = 0")  # the Checkpointer's thread does it
            except BaseException:
                conn.close()
                raise
        return conn

    async def open(self) -> None:
        """Create or migrate the database (or check it, read-only), start the threads. Idempotent."""
        if self._readers is not None:
            return
        if self._read_only:
            self._read_uri = await asyncio.to_thread(read_only_uri, self._path, self._busy_timeout)
        else:
            conn = await _open_in_thread(self._open_writer_connection)
            self._checkpointer = Checkpointer(self._connect)
            self._writer = Writer(
                conn,
                max_batch=self._max_batch,
                name="tailrace-sqlite-writer",
                on_commit=self._checkpointer.written,
            )
        self._readers = Readers(self._connect, self._reader_count)

    async def close(self) -> None:
        """Commit every write already submitted, then stop the threads. Idempotent.

        Once begun, closing completes even if the caller is cancelled meanwhile
        (the cancellation is re-raised afterwards), so no thread or connection
        is left behind.
        """
        await self._sessions.close()
        await self._hub.close()
        writer, readers, checkpointer = self._writer, self._readers, self._checkpointer
        self._writer = self._readers = self._checkpointer = None

        def stop() -> None:
            if writer is not None:
                writer.stop()
            if checkpointer is not None:
                checkpointer.stop()
            if readers is not None:
                readers.close()

        stopping = asyncio.ensure_future(asyncio.to_thread(stop))
        try:
            await asyncio.shield(stopping)
        except asyncio.CancelledError:
            await finish_despite_cancellation(stopping)
            raise

    async def _write(
        self,
        context: str,
        apply: Callable[[sqlite3.Connection], T],
        *,
        undo: ConnUndo[T] | None = None,
    ) -> T:
        if self._readers is None:
            raise StoreError(f"{context}: the SQLite store is not open")
        if self._writer is None:
            raise read_only_refusal(f"SQLite store {self._path!r}", context)
        return await self._writer.submit(context, apply, undo=undo)

    async def _read(self, context: str, read: Callable[[sqlite3.Connection], T]) -> T:
        if self._readers is None:
            raise StoreError(f"{context}: the SQLite store is not open")
        return await self._readers.run(context, read)

    async def _read_tx(self, context: str, body: Body[T], *, snapshot: bool = False) -> T:
        # A reader runs every read in a read transaction: a snapshot in WAL mode.
        return await self._read(context, _on_conn(body))

    async def _write_tx(
        self,
        context: str,
        body: Body[T],
        *,
        landed: Body[T] | None = None,
        texts: Texts | None = None,
        undo: Undo | None = None,
    ) -> T:
        # The writer's COMMIT is local: no answer is ever lost (``landed``), and
        # SQLite stores any text (``texts``).
        if undo is None:
            return await self._write(context, _on_conn(body))

        def undo_on_conn(value: T) -> Callable[[sqlite3.Connection], object] | None:
            compensation = undo()  # what the body recorded as it ran
            return None if compensation is None else _on_conn(compensation)

        return await self._write(context, _on_conn(body), undo=undo_on_conn)
