"""The Postgres store's statements: the shared SQL with psycopg's placeholders, and the work run in a transaction."""

from __future__ import annotations

import functools
import itertools
from typing import Any

import psycopg

from ..._errors import StoreError
from .._records import (
    Harvest,
)
from .._sql._statements import (
    ARTIFACT_HEAD_VERSION,
    INSERT_ARTIFACT,
    INSERT_RUN,
    UPDATE_RUN,
    UPSERT_CHECKPOINT,
    UPSERT_ITEM,
    UPSERT_NODE,
    checkpoint_params,
    harvest_rows,
    item_params,
    node_params,
    run_update_params,
)
from .._sql._transactions import Params, Row, harvest_signals
from ._connections import XID, Attempt, Conn, Work


def pg(statement: str) -> str:
    """The shared SQL with psycopg's placeholders (and its row locks where the SQL marks them)."""
    return statement.replace("?", "%s").replace("/*SKIP LOCKED*/", "FOR UPDATE SKIP LOCKED")


def returning_xid(statement: str) -> str:
    """``statement`` (an UPDATE or INSERT of the shared SQL) also returning the transaction id."""
    return f"{pg(statement)} RETURNING {XID}"


PG_INSERT_RUN = f"{pg(INSERT_RUN)} ON CONFLICT (run_id) DO NOTHING RETURNING {XID}"
PG_INSERT_ARTIFACT = f"{pg(INSERT_ARTIFACT)} ON CONFLICT DO NOTHING RETURNING {XID}"


def fetch_all(query: str, params: tuple[object, ...]) -> Work[list[tuple[Any, ...]]]:
    """Work that returns every row of ``query``."""

    async def read(conn: Conn, attempt: Attempt) -> list[tuple[Any, ...]]:
        cur = await conn.execute(query, params)
        return list(await cur.fetchall())

    return read


async def changed(conn: Conn) -> bool:
    """The result of a compare-and-set that turned out to have committed: it changed the row."""
    return True


async def artifact_head_version(conn: Conn, artifact_id: str) -> int:
    """The head version of ``artifact_id``, 0 when it has none."""
    cur = await conn.execute(pg(ARTIFACT_HEAD_VERSION), (artifact_id,))
    row = await cur.fetchone()
    return int(row[0]) if row is not None else 0


async def write_harvest(
    conn: Conn, channel: str, run_id: str, harvest: Harvest, now: float
) -> None:
    """Upsert the node rows, insert the append-only rows and questions, update the run, notify.

    Everything goes in one pipeline: one round trip, the wake-ups included.
    """
    async with conn.pipeline(), conn.cursor() as cur:
        if harvest.nodes:
            await cur.executemany(pg(UPSERT_NODE), node_params(run_id, harvest))
        if harvest.items:
            await cur.executemany(pg(UPSERT_ITEM), item_params(run_id, harvest))
        if harvest.checkpoints:
            await cur.executemany(pg(UPSERT_CHECKPOINT), checkpoint_params(run_id, harvest))
        rows = harvest_rows(run_id, harvest)
        for statement, group in itertools.groupby(rows, key=lambda row: row[0]):
            await cur.executemany(pg(statement), [values for _, values, _ in group])
        await cur.execute(pg(UPDATE_RUN), run_update_params(run_id, harvest, now))
        for kind in harvest_signals(harvest):
            await notify(conn, channel, kind)


@functools.lru_cache(maxsize=256)
def _spelled(statement: str) -> str:
    return pg(statement)


@functools.lru_cache(maxsize=64)
def _locking(select: str) -> str:
    """``select`` (of one row) also returning the transaction id, its row locked ``FOR UPDATE``."""
    columns, rest = pg(select).split(" FROM ", 1)
    return f"{columns}, {XID} FROM {rest} FOR UPDATE"


@functools.lru_cache(maxsize=64)
def _changing(update: str) -> str:
    return returning_xid(update)


@functools.lru_cache(maxsize=64)
def _returning_too(update: str) -> str:
    """``update`` (which has a RETURNING clause) also returning the transaction id."""
    return f"{pg(update)}, {XID}"


async def notify(conn: Conn, channel: str, kind: str) -> None:
    """Send a change of ``kind``; delivered to listeners when the transaction commits."""
    await conn.execute("SELECT pg_notify(%s, %s)", (channel, kind))


class PostgresTx:
    """The Postgres store's :class:`~tailrace.stores._sql._transactions.Tx`: one attempt of a call.

    Statements get psycopg's placeholders. A row read to be written (``lock``)
    is locked ``FOR UPDATE``, so two engines never both write one run (D6);
    ``lock``, ``change`` and ``change_returning`` record the transaction's id
    in ``attempt`` before COMMIT, which settles a lost COMMIT answer. Wake-ups
    are ``NOTIFY`` on ``channel``, delivered on commit.
    """

    __slots__ = ("attempt", "channel", "conn")

    def __init__(self, conn: Conn, attempt: Attempt, channel: str) -> None:
        self.conn = conn
        self.attempt = attempt
        self.channel = channel

    async def one(self, sql: str, params: Params) -> Row | None:
        cur = await self.conn.execute(_spelled(sql), params)
        return await cur.fetchone()

    async def all(self, sql: str, params: Params) -> list[Row]:
        cur = await self.conn.execute(_spelled(sql), params)
        return list(await cur.fetchall())

    async def lock(self, sql: str, params: Params) -> Row | None:
        cur = await self.conn.execute(_locking(sql), params)
        row: Row | None = await cur.fetchone()
        if row is None:
            return None
        self.attempt.xid = row[-1]
        return row[:-1]

    async def change(self, sql: str, params: Params) -> bool:
        cur = await self.conn.execute(_changing(sql), params)
        row = await cur.fetchone()
        if row is None:
            return False
        self.attempt.xid = row[0]
        return True

    async def change_all(self, sql: str, params: Params) -> int:
        cur = await self.conn.execute(_spelled(sql), params)
        return int(cur.rowcount)

    async def change_returning(self, sql: str, params: Params) -> Row | None:
        cur = await self.conn.execute(_returning_too(sql), params)
        row: Row | None = await cur.fetchone()
        if row is None:
            return None
        self.attempt.xid = row[-1]
        return row[:-1]

    async def write_harvest(self, run_id: str, harvest: Harvest, now: float) -> None:
        try:
            await write_harvest(self.conn, self.channel, run_id, harvest, now)
        except psycopg.errors.UniqueViolation as exc:  # nothing committed is rewritten (D1)
            raise StoreError(
                f"run {run_id!r}: harvest would rewrite a committed row "
                f"({exc.diag.message_detail}); nothing of it was written"
            ) from exc

    async def signal(self, kind: str) -> None:
        await notify(self.conn, self.channel, kind)
