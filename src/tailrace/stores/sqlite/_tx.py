"""The SQLite store's :class:`~tailrace.stores._sql._transactions.Tx`: the thread's connection.

Every method does its work at once and never suspends, so a shared body runs
to its end in one step (``run_now``) on the writer or a reader thread, inside
that thread's transaction: ``BEGIN IMMEDIATE`` already holds the database, so
:meth:`SQLiteTx.lock` needs no lock of its own.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Sequence
from typing import Any

from ..._errors import StoreError
from .._records import Claim, Harvest, NewRun, Submission
from .._sql._statements import (
    INSERT_CHUNK,
    INSERT_EVENT,
    INSERT_QUEUED_RUN,
    INSERT_RESULT,
    INSERT_SHAPE,
    UPDATE_RUN,
    UPSERT_CHECKPOINT,
    UPSERT_ITEM,
    UPSERT_NODE,
    append_only_rows,
    harvest_rows,
    queued_run_params,
    run_update_params,
    shape_params,
)
from .._sql._transactions import RUN_EXISTS, Clock, Keys, Params, Row, harvest_signals
from ._queues import bump, claim_queued, lease_answers
from ._threads import insert_rows, insert_run_rows


class SQLiteTx:
    """A transaction on ``conn`` (the writer's savepoint, or a reader's read transaction)."""

    __slots__ = ("conn",)

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    async def one(self, sql: str, params: Params) -> Row | None:
        row: Row | None = self.conn.execute(sql, params).fetchone()
        return row

    async def all(self, sql: str, params: Params) -> list[Row]:
        return self.conn.execute(sql, params).fetchall()

    async def lock(self, sql: str, params: Params) -> Row | None:
        row: Row | None = self.conn.execute(sql, params).fetchone()
        return row

    async def change(self, sql: str, params: Params) -> bool:
        return bool(self.conn.execute(sql, params).rowcount == 1)

    async def change_all(self, sql: str, params: Params) -> int:
        return int(self.conn.execute(sql, params).rowcount)

    async def change_returning(self, sql: str, params: Params) -> Row | None:
        rows: list[Any] = self.conn.execute(sql, params).fetchall()
        return rows[0] if rows else None

    async def write_harvest(self, run_id: str, harvest: Harvest, now: float) -> None:
        conn = self.conn
        insert_run_rows(conn, UPSERT_NODE, run_id, harvest.nodes)
        if harvest.items:
            insert_run_rows(conn, UPSERT_ITEM, run_id, harvest.items)
        if harvest.checkpoints:
            insert_run_rows(conn, UPSERT_CHECKPOINT, run_id, harvest.checkpoints)
        try:
            insert_run_rows(conn, INSERT_RESULT, run_id, harvest.results)
            insert_run_rows(conn, INSERT_EVENT, run_id, harvest.events)
            if harvest.chunks:
                insert_run_rows(conn, INSERT_CHUNK, run_id, harvest.chunks)
            for sql, rows in append_only_rows(run_id, harvest):
                insert_rows(conn, sql, rows)
        except sqlite3.IntegrityError as exc:  # nothing committed is rewritten (D1)
            what = first_duplicate(conn, run_id, harvest)
            raise StoreError(f"{what} already committed; nothing of it was written") from exc
        conn.execute(UPDATE_RUN, run_update_params(run_id, harvest, now))
        for kind in harvest_signals(harvest):
            bump(conn, kind)

    async def signal(self, kind: str) -> None:
        bump(self.conn, kind)

    async def lock_ring(self) -> None:
        pass  # the writer's BEGIN IMMEDIATE holds the whole database already

    async def ring(self, session: str) -> None:
        bump(self.conn, "ring")  # every watcher looks at its ring again (one local read)

    async def insert_queued(
        self, runs: Sequence[tuple[NewRun, Submission]], *, wake: bool
    ) -> list[str]:
        conn, stored = self.conn, []
        for run, q in runs:
            if conn.execute(RUN_EXISTS, (run.run_id,)).fetchone():
                continue  # submitted before: left as it is
            conn.execute(INSERT_QUEUED_RUN, queued_run_params(run, q))
            shape = shape_params(run)
            if shape is not None:
                conn.execute(INSERT_SHAPE, shape)
            stored.append(run.run_id)
        if wake and stored:
            bump(conn, "submit")
        return stored

    async def claim(self, claim: Claim, graphs: Keys | None, skip: Keys, clock: Clock) -> list[str]:
        c = claim
        return claim_queued(self.conn, c.queue, c.owner, c.ttl, c.limit, clock(), graphs, skip)

    async def lease_answers(
        self, owner: str, ttl: float, limit: int, clock: Callable[[], float]
    ) -> list[str]:
        return lease_answers(self.conn, owner, ttl, limit, clock())


def first_duplicate(conn: sqlite3.Connection, run_id: str, harvest: Harvest) -> str:
    """Describe the first row of ``harvest`` that is already stored (the slow path of an error)."""
    conn.execute("ROLLBACK TO tailrace_write")  # forget this harvest's partial inserts
    for sql, values, what in harvest_rows(run_id, harvest):
        try:
            conn.execute(sql, values)
        except sqlite3.IntegrityError:
            return what
    return f"run {run_id!r}: a row of this harvest"
