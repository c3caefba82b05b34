"""The Postgres store's statements: the shared SQL with psycopg's placeholders, and the work run in a transaction."""

from __future__ import annotations

import functools
import itertools

from .._records import (
    Harvest,
)
from .._sql._statements import (
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
from .._sql._transactions import harvest_signals
from ._connections import XID, Conn


def pg(statement: str) -> str:
    """The shared SQL with psycopg's placeholders (and its row locks where the SQL marks them)."""
    return statement.replace("?", "%s").replace("/*SKIP LOCKED*/", "FOR UPDATE SKIP LOCKED")


def returning_xid(statement: str) -> str:
    """``statement`` (an UPDATE or INSERT of the shared SQL) also returning the transaction id."""
    return f"{pg(statement)} RETURNING {XID}"


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
def spelled(statement: str) -> str:
    return pg(statement)


@functools.lru_cache(maxsize=64)
def locking(select: str) -> str:
    """``select`` (of one row) also returning the transaction id, its row locked ``FOR UPDATE``."""
    columns, rest = pg(select).split(" FROM ", 1)
    return f"{columns}, {XID} FROM {rest} FOR UPDATE"


@functools.lru_cache(maxsize=64)
def changing(update: str) -> str:
    return returning_xid(update)


@functools.lru_cache(maxsize=64)
def returning_too(update: str) -> str:
    """``update`` (which has a RETURNING clause) also returning the transaction id."""
    return f"{pg(update)}, {XID}"


async def notify(conn: Conn, channel: str, kind: str) -> None:
    """Send a change of ``kind``; delivered to listeners when the transaction commits."""
    await conn.execute("SELECT pg_notify(%s, %s)", (channel, kind))
