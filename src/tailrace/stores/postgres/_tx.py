"""The Postgres store's :class:`~tailrace.stores._sql._transactions.Tx`: one attempt of a call."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import psycopg

from ..._errors import StoreError
from .._records import Claim, Harvest, NewRun, Submission
from .._sql._statements import queued_run_params
from .._sql._transactions import Clock, Keys, Params, Row, keep_shapes
from ._connections import Attempt, Conn
from ._presence import lock_ring, ring_change
from ._queues import INSERT_QUEUED, claim_queued, lease_answers, transaction_id
from ._sql import changing, locking, notify, returning_too, spelled, write_harvest


class PostgresTx:
    """The Postgres store's :class:`~tailrace.stores._sql._transactions.Tx`: one attempt of a call.

    Statements get psycopg's placeholders. A row read to be written (``lock``)
    is locked ``FOR UPDATE``, so two engines never both write one run (D6);
    ``lock``, ``change`` and ``change_returning`` record the transaction's id
    in ``attempt`` before COMMIT, which settles a lost COMMIT answer. Wake-ups
    are ``NOTIFY`` on ``channel``, delivered on commit. Claims lock as
    ``_queues`` says, in ``schema``.
    """

    __slots__ = ("attempt", "channel", "conn", "schema")

    def __init__(self, conn: Conn, attempt: Attempt, channel: str, schema: str) -> None:
        self.conn = conn
        self.attempt = attempt
        self.channel = channel
        self.schema = schema

    async def one(self, sql: str, params: Params) -> Row | None:
        cur = await self.conn.execute(spelled(sql), params)
        return await cur.fetchone()

    async def all(self, sql: str, params: Params) -> list[Row]:
        cur = await self.conn.execute(spelled(sql), params)
        return list(await cur.fetchall())

    async def lock(self, sql: str, params: Params) -> Row | None:
        cur = await self.conn.execute(locking(sql), params)
        row: Row | None = await cur.fetchone()
        if row is None:
            return None
        self.attempt.xid = row[-1]
        return row[:-1]

    async def change(self, sql: str, params: Params) -> bool:
        cur = await self.conn.execute(changing(sql), params)
        row = await cur.fetchone()
        if row is None:
            return False
        self.attempt.xid = row[0]
        return True

    async def change_all(self, sql: str, params: Params) -> int:
        cur = await self.conn.execute(spelled(sql), params)
        return int(cur.rowcount)

    async def change_returning(self, sql: str, params: Params) -> Row | None:
        cur = await self.conn.execute(returning_too(sql), params)
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

    async def lock_ring(self) -> None:
        await lock_ring(self.conn, self.schema)

    async def ring(self, session: str) -> None:
        await notify(self.conn, self.channel, ring_change(session))

    async def insert_queued(
        self, runs: Sequence[tuple[NewRun, Submission]], *, wake: bool
    ) -> list[str]:
        # Pipelined: every insert (with its origin) goes in one round trip, then the
        # shapes (one per graph version) and the wake-up in one more.
        conn = self.conn
        async with conn.pipeline():
            cursors = [
                await conn.execute(INSERT_QUEUED, queued_run_params(run, q)) for run, q in runs
            ]
            stored: list[NewRun] = []
            for (run, _), cur in zip(runs, cursors, strict=True):
                row = await cur.fetchone()
                if row is not None:  # else submitted before: left as it is
                    self.attempt.xid = row[0]
                    stored.append(run)
            await keep_shapes(self, stored)
            if wake and stored:
                await notify(conn, self.channel, "submit")
        return [run.run_id for run in stored]

    async def claim(self, claim: Claim, graphs: Keys | None, skip: Keys, clock: Clock) -> list[str]:
        c = claim
        ids, xid = await claim_queued(
            self.conn, self.schema, c.queue, c.owner, c.ttl, c.limit, clock, graphs, skip
        )
        self.attempt.xid = self.attempt.xid or xid
        return ids

    async def lease_answers(
        self, owner: str, ttl: float, limit: int, clock: Callable[[], float]
    ) -> list[str]:
        self.attempt.xid = self.attempt.xid or await transaction_id(self.conn)
        return await lease_answers(self.conn, self.schema, owner, ttl, limit, clock)
