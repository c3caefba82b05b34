"""Opening a SQLite file: read-write, migrating only when needed, or read-only, never writing.

A read-write open reads the recorded schema version first and takes the write
lock (``BEGIN IMMEDIATE``) only when there are migrations to apply, so opening
an up-to-date database next to a writer in another process does not wait for
it (D4).

A read-only open never writes, never migrates and never creates a file. It
uses a ``mode=ro`` URI; WAL lets it read while another process holds a write
transaction. One case needs more: a WAL database whose ``-wal``/``-shm`` files
are gone (the last writer closed cleanly) on read-only media, where SQLite
cannot create the ``-shm`` it wants and says "unable to open database file".
There, and only when no ``-wal`` file exists (so the main file holds every
committed page) and the directory is not writable (so no writer can start),
the file is opened ``immutable=1``, which is then exactly true.
"""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path

from ..._errors import StoreError, UnsupportedFormat
from .._sql._statements import (
    CREATE_MIGRATIONS_TABLE,
    MIGRATIONS,
    POSTGRES_ONLY,
    SCHEMA_VERSION,
)
from ._errors import mapped_errors


def newer_schema(where: str, version: int) -> UnsupportedFormat:
    """The error for a database at ``where`` whose schema ``version`` is newer than ours (D4)."""
    return UnsupportedFormat(
        f"{where}: database schema version {version} is newer than this tailrace "
        f"supports ({SCHEMA_VERSION}); upgrade tailrace. Nothing was written."
    )


def recorded_version(conn: sqlite3.Connection) -> int | None:
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
        current = recorded_version(conn)  # again, under the lock: another process may have won
        if current is None:
            conn.execute(CREATE_MIGRATIONS_TABLE)
            current = 0
        if current > SCHEMA_VERSION:
            raise newer_schema(where, current)
        for version, statements in MIGRATIONS:
            if version > current:
                for statement in statements:
                    if not statement.startswith(POSTGRES_ONLY):
                        conn.execute(statement.replace("/*WITHOUT ROWID*/", "WITHOUT ROWID"))
                conn.execute(
                    "INSERT INTO schema_migrations (version, applied_at) VALUES (?, ?)",
                    (version, time.time()),
                )
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def prepare_for_writing(conn: sqlite3.Connection, where: str, timeout: float) -> None:
    """Put the database of ``conn`` in WAL mode at our schema version, locking only if needed;
    ``timeout``: the most seconds to wait for another process switching it meanwhile."""
    version = recorded_version(conn)  # a read: before anything writes, WAL switch included
    if version is not None and version > SCHEMA_VERSION:
        raise newer_schema(where, version)
    mode = conn.execute("PRAGMA journal_mode").fetchone()[0]
    if str(mode).lower() != "wal":
        mode = _switch_to_wal(conn, timeout)
        if str(mode).lower() != "wal":
            raise StoreError(f"{where}: cannot switch to WAL mode (got {mode!r})")
    if version != SCHEMA_VERSION:
        _migrate(conn, where)


def _switch_to_wal(conn: sqlite3.Connection, timeout: float) -> object:
    """``PRAGMA journal_mode = WAL``, tried again while another connection holds the lock.

    The switch needs the file to itself and, when it finds another process
    opening the same new file, may fail at once as "database is locked"
    without waiting out the busy timeout; so it waits here, up to ``timeout``.
    """
    deadline = time.monotonic() + timeout
    pause = 0.005
    while True:
        try:
            return conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        except sqlite3.OperationalError as exc:
            busy = (getattr(exc, "sqlite_errorcode", 0) & 0xFF) in (5, 6)  # BUSY, LOCKED
            if not busy or time.monotonic() + pause > deadline:
                raise
        time.sleep(pause)  # in the opening thread, never on the event loop
        pause = min(pause * 2, 0.1)


# --- read-only -------------------------------------------------------------------------


def _immutable_is_true(path: Path) -> bool:
    """Whether nobody can change ``path``: no ``-wal`` file, and its directory is not writable."""
    wal = path.with_name(path.name + "-wal")
    return not wal.exists() and not os.access(path.parent, os.W_OK)


def _cannot_open(exc: sqlite3.Error) -> bool:
    return (getattr(exc, "sqlite_errorcode", 0) & 0xFF) == sqlite3.SQLITE_CANTOPEN


def check_read_only_schema(conn: sqlite3.Connection, where: str) -> None:
    """Raise unless the database of ``conn`` is a tailrace database at exactly our schema."""
    version = recorded_version(conn)
    if version is None:
        raise StoreError(f"{where}: not a tailrace database (it has no schema_migrations table)")
    if version > SCHEMA_VERSION:
        raise newer_schema(where, version)
    if version < SCHEMA_VERSION:
        raise StoreError(
            f"{where}: database schema version {version} is older than this tailrace's "
            f"({SCHEMA_VERSION}) and a read-only store does not migrate; open it once "
            "read-write (any command that writes, e.g. `tailrace serve`) to upgrade it"
        )


def read_only_uri(path: str, timeout: float) -> str:
    """The URI to read ``path`` with, after checking it is a database we can read (never writes).

    ``StoreError`` naming the path if the file is missing or unreadable, or
    its schema is older than ours; :class:`UnsupportedFormat` if newer.
    """
    where = f"SQLite store {path!r}"
    file = Path(path).absolute()
    if not file.is_file():
        raise StoreError(
            f"{where}: no such database file (a read-only store never creates one; check the path)"
        )
    uri = f"{file.as_uri()}?mode=ro"
    with mapped_errors(where, "cannot open read-only: "):
        try:
            _check_uri(uri, timeout, where)
        except sqlite3.OperationalError as exc:
            if not (_cannot_open(exc) and _immutable_is_true(file)):
                raise
            uri += "&immutable=1"  # read-only media: see the module docstring
            _check_uri(uri, timeout, where)
    return uri


def _check_uri(uri: str, timeout: float, where: str) -> None:
    conn = read_only_connection(uri, timeout)
    try:
        check_read_only_schema(conn, where)
    finally:
        conn.close()


def read_only_connection(uri: str, timeout: float) -> sqlite3.Connection:
    """A connection that cannot write, to the database at ``uri`` (from :func:`read_only_uri`)."""
    return sqlite3.connect(
        uri, uri=True, timeout=timeout, isolation_level=None, check_same_thread=False
    )
