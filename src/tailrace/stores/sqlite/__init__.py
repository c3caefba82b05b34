"""The SQLite store: WAL, one writer thread with group commit, reader threads."""

from ._store import SQLiteStore as SQLiteStore

__all__ = ["SQLiteStore"]
