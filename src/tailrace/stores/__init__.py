"""Run stores: one contract (:class:`RunStore`), three backends.

- :class:`MemoryStore`: in process memory; for tests and throwaway runs.
- :class:`SQLiteStore`: the embedded default; one file, WAL, group commit.
- :class:`PostgresStore`: many processes and hosts; needs
  ``pip install 'tailrace[postgres]'`` and is imported only when first used.

:func:`open_store` picks one from a URL or path:

>>> type(open_store(":memory:")).__name__
'MemoryStore'
>>> type(open_store("runs.db")).__name__
'SQLiteStore'
"""

from __future__ import annotations

import os
import typing
import urllib.parse

from ._contract import ChangeFeed as ChangeFeed
from ._contract import Presence as Presence
from ._contract import RunStore as RunStore
from ._queue_rules import next_tick as next_tick
from ._queue_rules import tick_is_due as tick_is_due
from ._records import CHANGE_KINDS as CHANGE_KINDS
from ._records import CHUNK_KINDS as CHUNK_KINDS
from ._records import FORMAT_VERSION as FORMAT_VERSION
from ._records import LIVE_STATUSES as LIVE_STATUSES
from ._records import QUESTION_TRANSITIONS as QUESTION_TRANSITIONS
from ._records import TERMINAL_STATUSES as TERMINAL_STATUSES
from ._records import ArtifactVersion as ArtifactVersion
from ._records import CheckpointRow as CheckpointRow
from ._records import ChunkRow as ChunkRow
from ._records import Claim as Claim
from ._records import EventRow as EventRow
from ._records import FrozenInput as FrozenInput
from ._records import GraphRow as GraphRow
from ._records import Harvest as Harvest
from ._records import ItemRow as ItemRow
from ._records import Lapse as Lapse
from ._records import NewRun as NewRun
from ._records import NodeRow as NodeRow
from ._records import ParkedRow as ParkedRow
from ._records import ParkedStatus as ParkedStatus
from ._records import Pulse as Pulse
from ._records import QuestionRow as QuestionRow
from ._records import QuestionStatus as QuestionStatus
from ._records import Queue as Queue
from ._records import QueueStats as QueueStats
from ._records import ResultRow as ResultRow
from ._records import RunCount as RunCount
from ._records import RunRecord as RunRecord
from ._records import RunSnapshot as RunSnapshot
from ._records import RunStatus as RunStatus
from ._records import ScheduleRow as ScheduleRow
from ._records import StoredRun as StoredRun
from ._records import StreamHead as StreamHead
from ._records import StreamTail as StreamTail
from ._records import Submission as Submission
from ._records import WorkerRow as WorkerRow
from .memory import MemoryStore as MemoryStore
from .sqlite import SQLiteStore as SQLiteStore

if typing.TYPE_CHECKING:
    from .postgres import PostgresStore as PostgresStore

__all__ = [
    "CHANGE_KINDS",
    "CHUNK_KINDS",
    "FORMAT_VERSION",
    "LIVE_STATUSES",
    "QUESTION_TRANSITIONS",
    "TERMINAL_STATUSES",
    "ArtifactVersion",
    "ChangeFeed",
    "CheckpointRow",
    "ChunkRow",
    "Claim",
    "EventRow",
    "FrozenInput",
    "GraphRow",
    "Harvest",
    "ItemRow",
    "Lapse",
    "MemoryStore",
    "NewRun",
    "NodeRow",
    "ParkedRow",
    "ParkedStatus",
    "PostgresStore",
    "Presence",
    "Pulse",
    "QuestionRow",
    "QuestionStatus",
    "Queue",
    "QueueStats",
    "ResultRow",
    "RunCount",
    "RunRecord",
    "RunSnapshot",
    "RunStatus",
    "RunStore",
    "SQLiteStore",
    "ScheduleRow",
    "StoredRun",
    "StreamHead",
    "StreamTail",
    "Submission",
    "WorkerRow",
    "next_tick",
    "open_store",
    "tick_is_due",
]

_POSTGRES_SCHEMES = ("postgresql://", "postgres://")
_MEMORY_NAMES = (":memory:", "memory:")


def _import_postgres_store() -> type[PostgresStore]:
    try:
        from .postgres import PostgresStore  # the postgres extra (psycopg) is optional
    except ImportError as exc:
        raise ImportError(
            "PostgresStore needs psycopg 3 and psycopg-pool: pip install 'tailrace[postgres]'"
        ) from exc
    return PostgresStore


def __getattr__(name: str) -> typing.Any:
    if name == "PostgresStore":  # lazy, so a missing psycopg only matters to its users
        return _import_postgres_store()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def open_store(url_or_path: str | os.PathLike[str], *, read_only: bool = False) -> RunStore:
    """Return an unopened store for ``url_or_path``; use it as ``async with store:``.

    Args:
        url_or_path: ``postgresql://...`` or ``postgres://...`` for
            :class:`PostgresStore` (a ``schema=NAME`` query parameter, which
            libpq does not know, picks the schema holding the tables;
            default ``public``); ``:memory:`` or ``memory:`` for
            :class:`MemoryStore`; anything else is a file path for
            :class:`SQLiteStore`.
        read_only: open an existing database to read it only: no migrations,
            no file created (a missing one is an error naming it), every
            write refused (see :class:`RunStore`). Commands that only read
            (``tailrace runs``, ``show``) pass it, so they work next to a
            writer and on read-only media. A memory store has nothing to
            protect and ignores it.
    """
    target = os.fspath(url_or_path)
    if target.startswith(_POSTGRES_SCHEMES):
        dsn, schema = _split_schema(target)
        return _import_postgres_store()(dsn, schema=schema, read_only=read_only)
    if target in _MEMORY_NAMES:
        return MemoryStore()
    return SQLiteStore(target, read_only=read_only)


def _split_schema(url: str) -> tuple[str, str]:
    """``url`` without its ``schema=`` query parameter, and that schema (default ``public``).

    >>> _split_schema("postgresql://u@h/db?schema=fleet&sslmode=require")
    ('postgresql://u@h/db?sslmode=require', 'fleet')
    """
    parts = urllib.parse.urlsplit(url)
    query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    schemas = [v for k, v in query if k == "schema"]
    if not schemas:
        return url, "public"
    rest = urllib.parse.urlencode([(k, v) for k, v in query if k != "schema"])
    return urllib.parse.urlunsplit(parts._replace(query=rest)), schemas[-1]
