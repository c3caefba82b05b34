"""The Postgres store's queues, claims, workers and wake-ups.

Claims select candidate rows with ``FOR UPDATE OF r SKIP LOCKED``, so
workers claiming at once never wait on, nor take, each other's rows. A queue
whose limits need counting (``concurrency``, a rate limit) is claimed under a
transaction-scoped advisory lock on the queue's name: the count and the claim
are then one step, and READ COMMITTED lets the next claimer's count see the
runs the previous one marked. Partitions need no lock: a run qualifies only
while no run of its partition is live or older, and a concurrent claimer's
uncommitted claim still reads as ``queued`` and older.

A claim whose COMMIT answer was lost returns the runs it marked (they are
known before COMMIT); a cancelled claim releases what it leased, shielded,
so those runs are adopted at once rather than after their ttl.

Wake-ups: ``submit_run``, ``answer``, ``release_lease`` and
``request_cancel`` send ``NOTIFY`` on the schema's channel inside their
transaction (delivered on commit). :class:`PostgresQueues` keeps one
``LISTEN`` connection per store object while anyone subscribes, and falls
back to polling (every kind reported every half second) while it is down.
"""

from __future__ import annotations

import hashlib
import logging

from .._queue_rules import (
    claimable_queue,
    declared_queue,
)
from .._records import (
    Queue,
)
from .._sql._queues import (
    CLAIM_SET,
    SELECT_QUEUE,
)
from .._sql._statements import INSERT_QUEUED_RUN
from ._connections import XID, Conn
from ._sql import pg

logger = logging.getLogger("tailrace.stores.postgres")

#: First key of the advisory lock that serialises counted claims of one queue ("tq").
QUEUE_LOCK = 0x7471
#: Seconds between two "anything may have changed" while the listening connection is down.
FALLBACK_POLL = 0.5
SKIP_LOCKED = " FOR UPDATE OF r SKIP LOCKED"
INSERT_QUEUED = (
    f"{pg(INSERT_QUEUED_RUN)} ON CONFLICT DO NOTHING RETURNING pg_current_xact_id()::text"
)
#: Values: owner, lease_expires, now, now, run ids. ``CLAIM_RUN`` for every run a claim
#: locked, in one statement that also gives the transaction's id (its first write): a
#: claim that finds nothing writes nothing and commits read-only.
CLAIM_RUNS = pg(CLAIM_SET) + f"WHERE run_id = ANY(%s) AND status = 'queued' RETURNING run_id, {XID}"


def notify_channel(schema: str) -> str:
    """The ``NOTIFY`` channel of a schema's store (an identifier of at most 63 bytes)."""
    name = f"tailrace.{schema}"
    if len(name.encode()) <= 63:
        return name
    return "tailrace." + hashlib.sha256(schema.encode()).hexdigest()[:32]


async def declared(conn: Conn, name: str) -> Queue | None:
    """The declared limits of queue ``name`` (defaults if never declared; None: unusable)."""
    cur = await conn.execute(pg(SELECT_QUEUE), (name,))
    return declared_queue(name, await cur.fetchone())


async def claimable(conn: Conn, name: str) -> Queue | None:
    """The limits a claim on queue ``name`` keeps; None while it is paused or unusable."""
    cur = await conn.execute(pg(SELECT_QUEUE), (name,))
    return claimable_queue(name, await cur.fetchone())


async def count_rows(conn: Conn, query: str, params: tuple[object, ...]) -> int:
    cur = await conn.execute(pg(query), params)
    row = await cur.fetchone()
    return int(row[0]) if row is not None else 0


async def transaction_id(conn: Conn) -> str | None:
    """The transaction's id, assigned now (before any write), for ``pg_xact_status``."""
    cur = await conn.execute(f"SELECT {XID}")
    row = await cur.fetchone()
    return None if row is None else str(row[0])


async def lock_queue(conn: Conn, schema: str, queue: str) -> None:
    await conn.execute(
        "SELECT pg_advisory_xact_lock(%s, hashtext(%s))", (QUEUE_LOCK, f"{schema}:{queue}")
    )
