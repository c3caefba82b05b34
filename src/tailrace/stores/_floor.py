"""Physical floors for the benchmarks: raw single-row commits per second.

These measure what the hardware and database allow with nothing of tailrace
in the way (one row inserted and committed per transaction), with the same
settings the stores use, so ``bench/`` can report a store's rate as a ratio
of the floor measured in the same run. They block; call them outside an event
loop or through :func:`asyncio.to_thread`.
"""

from __future__ import annotations

import os
import sqlite3
import time
import uuid
from typing import Literal

_PAYLOAD = '{"value":"x"}'


def sqlite_raw_commit_rate(
    path: str | os.PathLike[str], n: int, synchronous: Literal["normal", "full"] = "normal"
) -> float:
    """Commits per second of ``n`` single-row insert transactions into SQLite.

    Args:
        path: database file to measure in (a scratch table is made and dropped).
        n: number of transactions to time; at least 1.
        synchronous: ``"normal"`` or ``"full"``, as for :class:`SQLiteStore`;
            the file is put in WAL mode like the store's.
    """
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    if synchronous not in ("normal", "full"):
        raise ValueError(f"synchronous must be 'normal' or 'full', got {synchronous!r}")
    table = f"tailrace_floor_{uuid.uuid4().hex}"
    conn = sqlite3.connect(os.fspath(path), timeout=5.0, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute(f"PRAGMA synchronous = {synchronous.upper()}")
        conn.execute(f"CREATE TABLE {table} (id INTEGER PRIMARY KEY, payload TEXT NOT NULL)")
        try:
            start = time.perf_counter()
            for i in range(n):
                conn.execute("BEGIN IMMEDIATE")
                conn.execute(f"INSERT INTO {table} (id, payload) VALUES (?, ?)", (i, _PAYLOAD))
                conn.execute("COMMIT")
            elapsed = time.perf_counter() - start
        finally:
            conn.execute(f"DROP TABLE {table}")
    finally:
        conn.close()
    return n / elapsed


def postgres_raw_commit_rate(dsn: str, n: int) -> float:
    """Commits per second of ``n`` single-row insert transactions into Postgres.

    Args:
        dsn: libpq connection string or URL (a scratch table is made and dropped).
        n: number of transactions to time; at least 1.
    """
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    import psycopg  # the postgres extra is optional

    table = f"tailrace_floor_{uuid.uuid4().hex}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {table} (id BIGINT PRIMARY KEY, payload TEXT NOT NULL)")
        try:
            start = time.perf_counter()
            for i in range(n):  # autocommit: each INSERT is its own transaction
                conn.execute(f"INSERT INTO {table} (id, payload) VALUES (%s, %s)", (i, _PAYLOAD))
            elapsed = time.perf_counter() - start
        finally:
            conn.execute(f"DROP TABLE {table}")
    return n / elapsed
