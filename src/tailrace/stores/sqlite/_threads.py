"""The SQLite store's threads: one writer with group commit, a few readers.

Writes never run on the event loop. Each write is a request on a queue; the
single :class:`Writer` thread drains every request waiting, applies them in one
``BEGIN IMMEDIATE ... COMMIT`` with each request inside its own SAVEPOINT
``tailrace_write`` (so a fenced-out or refused request is rolled back alone),
and only after COMMIT resolves each caller's future on its own loop.
:class:`Readers` run reads on threads with their own read-only connections.

Cancellation: the writer *claims* the requests of a group
under a lock before it begins the transaction. A caller cancelled before its
request was claimed withdraws it and the writer skips it: it did not happen. A
request already claimed runs to COMMIT or rollback regardless, so the write
connection is never left mid-transaction; a caller that passed an ``undo``
(``acquire_lease``: release the lease it just granted) waits for the outcome,
shielded, and commits the undo before ``CancelledError`` propagates, so the
call did not happen in effect either.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import operator
import queue
import sqlite3
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import chain, repeat
from typing import Any, TypeVar, cast

from ..._errors import StoreError
from ._errors import mapped, mapped_errors, store_error

T = TypeVar("T")
logger = logging.getLogger("tailrace.stores")

#: Seconds between two WAL checkpoints while writes go on (see :class:`Checkpointer`).
CHECKPOINT_INTERVAL = 0.5

# --- the writer thread ---------------------------------------------------------


@dataclass(slots=True)
class _Write:
    apply: Callable[[sqlite3.Connection], object]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]
    context: str
    #: Both flags change only under the writer's lock. ``claimed``: the writer
    #: took it into a group (it will run); ``abandoned``: nobody waits for it
    #: any more (skipped if not claimed yet, its outcome dropped otherwise).
    claimed: bool = False
    abandoned: bool = False


_Outcome = tuple[_Write, bool, object]
#: Given what a write returned, the write that undoes it (or None: nothing to undo).
Undo = Callable[[T], Callable[[sqlite3.Connection], object] | None]


def _settle(write: _Write, ok: bool, value: Any) -> None:
    if write.future.done() or write.abandoned:  # nobody is waiting for it any more
        return
    if ok:
        write.future.set_result(value)
    else:
        write.future.set_exception(value)


def _deliver(write: _Write, ok: bool, value: object) -> None:
    with contextlib.suppress(RuntimeError):  # a closed loop: nobody is waiting any more
        write.loop.call_soon_threadsafe(_settle, write, ok, value)


async def finish_despite_cancellation(future: asyncio.Future[T]) -> T:
    """Wait for ``future`` however often the waiting task is cancelled meanwhile.

    Only for work that is already under way and bounded (a claimed write, a
    thread that is closing connections); the caller re-raises the
    cancellation afterwards, so it is delayed, never swallowed.
    """
    while True:
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            if future.cancelled():
                raise


def _broken(exc: Exception, context: str) -> StoreError:
    """What every caller of a group hears when the writer itself failed (a bug, not the driver)."""
    error = StoreError(f"{context}: {exc!r}")
    error.__cause__ = exc
    return error


class Writer:
    """Owns the write connection on one thread and commits queued writes in groups."""

    def __init__(
        self,
        conn: sqlite3.Connection,
        *,
        max_batch: int,
        name: str,
        on_commit: Callable[[], None] | None = None,
    ) -> None:
        self._conn = conn
        self._max_batch = max_batch
        #: Called on the writer thread after each COMMIT (the checkpointer's nudge).
        self._on_commit = on_commit
        self._queue: queue.SimpleQueue[_Write | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._stopping = False
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    async def submit(
        self,
        context: str,
        apply: Callable[[sqlite3.Connection], T],
        *,
        undo: Undo[T] | None = None,
    ) -> T:
        """Queue ``apply`` and wait until the group it joined has committed.

        Cancelled before the writer claimed it, it is skipped. Cancelled
        after, it completes; with ``undo``, the write ``undo(result)`` returns
        is committed too before ``CancelledError`` propagates.
        """
        write = self._enqueue(context, apply)
        if undo is None:
            # Nothing to undo: the future itself may be cancelled with the caller
            # (its outcome is then dropped), which saves the shield's extra trip
            # through the event loop on every write.
            try:
                return cast("T", await write.future)
            except asyncio.CancelledError:
                self._withdraw(write, waiting=False)
                raise
        try:
            return cast("T", await asyncio.shield(write.future))
        except asyncio.CancelledError:
            if self._withdraw(write, waiting=True):
                await self._undo_after_cancellation(write, undo)
            raise

    def _enqueue(self, context: str, apply: Callable[[sqlite3.Connection], object]) -> _Write:
        loop = asyncio.get_running_loop()
        write = _Write(apply, loop, loop.create_future(), context)
        with self._lock:
            if self._stopping:
                raise StoreError(f"{context}: the SQLite store is closed")
            self._queue.put(write)
        return write

    def _withdraw(self, write: _Write, *, waiting: bool) -> bool:
        """The caller of ``write`` was cancelled: whether the writer had claimed it already.

        Unclaimed, it is abandoned (the writer skips it). Claimed, it runs;
        it is abandoned too unless the caller is ``waiting`` for its outcome.
        """
        with self._lock:
            if not write.claimed or not waiting:
                write.abandoned = True
            return write.claimed

    async def _undo_after_cancellation(self, write: _Write, undo: Undo[Any]) -> None:
        try:
            value = await finish_despite_cancellation(write.future)
        except Exception:  # the write failed: there is nothing to undo
            return
        compensation = undo(value)
        if compensation is None:
            return
        context = f"{write.context}: undoing a cancelled call"
        try:
            await finish_despite_cancellation(self._enqueue(context, compensation).future)
        except Exception:  # closing, or the database failed: say so, the caller is gone
            logger.warning("%s failed", context, exc_info=True)

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
                        _deliver(write, False, _broken(exc, write.context))
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

    def _claim(self, batch: list[_Write]) -> list[_Write]:
        """The requests of ``batch`` whose callers still wait, now claimed: they will run."""
        with self._lock:
            live = [w for w in batch if not w.abandoned]
            for w in live:
                w.claimed = True
        return live

    def _commit_batch(self, batch: list[_Write]) -> None:
        live = self._claim(batch)  # a caller cancelled before this point withdrew its request
        if not live:
            return
        try:
            self._conn.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            for w in live:
                _deliver(w, False, store_error(exc, w.context, "cannot begin a write: "))
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
            else:
                if self._on_commit is not None:
                    self._on_commit()
        for w, ok, value in outcomes:
            _deliver(w, ok, value)

    def _apply_one(self, write: _Write) -> tuple[bool, object, bool]:
        """Run one request in its own savepoint: ``(ok, value or error, transaction lost)``."""
        conn = self._conn
        try:
            conn.execute("SAVEPOINT tailrace_write")
        except sqlite3.Error as exc:
            return False, mapped(exc, write.context), True
        try:
            value = write.apply(conn)
        except Exception as exc:
            error = mapped(exc, write.context)
            try:
                conn.execute("ROLLBACK TO tailrace_write")
                conn.execute("RELEASE tailrace_write")
            except sqlite3.Error:
                return False, error, True
            return False, error, not conn.in_transaction
        try:
            conn.execute("RELEASE tailrace_write")
        except sqlite3.Error as exc:
            return False, mapped(exc, write.context), True
        return True, value, False

    def _rollback_quietly(self) -> None:
        if self._conn.in_transaction:  # if ROLLBACK fails too, the next BEGIN reports it
            with contextlib.suppress(sqlite3.Error):
                self._conn.execute("ROLLBACK")


class Checkpointer:
    """Copies the WAL back into the database file, on its own thread and connection.

    The write connection runs no checkpoint at COMMIT (``wal_autocheckpoint =
    0``): a checkpoint syncs the database file, which on a busy disk can take
    hundreds of milliseconds, and every commit queued behind it (with every
    reader in another process waiting for one) would wait as long. Here a
    PASSIVE checkpoint runs at most every ``interval`` seconds while commits
    go on; the writer keeps appending to the WAL meanwhile. The last
    connection to close checkpoints what is left, as SQLite always does.
    """

    def __init__(
        self, connect: Callable[[], sqlite3.Connection], interval: float = CHECKPOINT_INTERVAL
    ) -> None:
        self._connect = connect
        self._interval = interval
        self._written = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(
            target=self._main, name="tailrace-sqlite-checkpoint", daemon=True
        )
        self._thread.start()

    def written(self) -> None:
        """A commit added to the WAL (any thread): a checkpoint is due."""
        self._written.set()

    def stop(self) -> None:
        """End the thread (blocking); a checkpoint under way completes first."""
        self._stopping.set()
        self._written.set()
        self._thread.join()

    def _main(self) -> None:
        conn: sqlite3.Connection | None = None
        try:
            conn = self._connect()
            while True:
                self._written.wait()
                if self._stopping.is_set():
                    return
                self._written.clear()
                with contextlib.suppress(sqlite3.OperationalError):  # busy: the next commit retries
                    conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
                if self._stopping.wait(self._interval):
                    return
        except Exception:  # the file is gone or broken: the writer reports that itself
            logger.exception("SQLite checkpointer stopped")
        finally:
            if conn is not None:
                conn.close()


def _all_failed(outcomes: list[_Outcome], live: list[_Write], reason: str) -> list[_Outcome]:
    """Outcomes once the group's transaction is gone: own errors stay, the rest fail."""
    failed: list[_Outcome] = [
        (w, False, v if not ok else StoreError(f"{w.context}: {reason}")) for w, ok, v in outcomes
    ]
    failed += [(w, False, StoreError(f"{w.context}: {reason}")) for w in live[len(outcomes) :]]
    return failed


# --- batched inserts -----------------------------------------------------------

#: Rows per multi-row INSERT, largest first (each size is one cached statement).
_CHUNKS = (256, 64, 16, 4, 1)


def insert_rows(conn: sqlite3.Connection, sql: str, rows: Sequence[Sequence[object]]) -> None:
    """Run ``sql``, a one-row ``INSERT ... VALUES (?, ...)``, for each of ``rows``.

    Rows go many to a statement (``VALUES (...), (...), ...``) rather than one
    per step of ``executemany``: SQLite does the same work, but Python releases
    and re-takes the GIL once per statement instead of once per row, and each
    re-take waits for the event loop's thread (the writer's real cost).
    A statement inserts all its rows or none, so errors are the same.
    """
    _insert(conn, sql, rows, None)


def insert_run_rows(
    conn: sqlite3.Connection, sql: str, run_id: str, rows: Sequence[Sequence[object]]
) -> None:
    """Like :func:`insert_rows` for rows of run ``run_id``.

    ``sql``'s first placeholder is the run id and ``rows`` hold the values of
    the others (the store's row tuples, fields in column order): the values
    are laid out with no Python pass per field.
    """
    _insert(conn, sql, rows, run_id)


def _insert(
    conn: sqlite3.Connection, sql: str, rows: Sequence[Sequence[object]], run_id: str | None
) -> None:
    n = len(rows)
    if not n:
        return
    width = len(rows[0]) + (run_id is not None)
    limit = conn.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER)
    head = (run_id,)  # goes before each row's own values: tuple concatenation, in C
    done = 0
    for size in _CHUNKS:
        if size * width > limit or n - done < size:
            continue
        statement = _multi_row(sql, size)
        while n - done >= size:
            chunk = rows[done : done + size]
            whole = chunk if run_id is None else map(operator.add, repeat(head, size), chunk)
            conn.execute(statement, list(chain.from_iterable(whole)))
            done += size


@functools.lru_cache(maxsize=64)
def _multi_row(sql: str, size: int) -> str:
    """``sql`` with its one ``VALUES (...)`` group repeated ``size`` times."""
    start = sql.index("VALUES (") + len("VALUES ")
    end = sql.index(")", start) + 1
    return sql[:start] + ", ".join([sql[start:end]] * size) + sql[end:]


# --- the reader threads --------------------------------------------------------


class Readers:
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
        with mapped_errors(context):
            conn = self._connection()
            conn.execute("BEGIN")
            try:
                return read(conn)
            finally:
                conn.execute("ROLLBACK")

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
