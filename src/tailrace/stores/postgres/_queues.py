"""The Postgres store's queues, claims, workers and wake-ups.

A claim ranks a window of queued runs in claim order (``claim_candidates``:
the ranking locks nothing) and, in the same statement, locks the first of
them it can with ``FOR UPDATE SKIP LOCKED``, one by one in claim order up to
its limit, so workers claiming at once never wait on, nor take, each other's
rows; then it leases what it locked. A queue whose limits need counting (``concurrency``, a
rate limit) is claimed under a transaction-scoped advisory lock on the
queue's name: the count and the claim are then one step, and READ COMMITTED
lets the next claimer's count see the runs the previous one marked.
Partitions need no lock: a run is a candidate only while its turn fits its
partition's room, and a concurrent claimer's uncommitted claim still reads
as ``queued`` and earlier in turn, so the two never exceed the room between
them (a run another claim took meanwhile no longer reads as queued).

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
from collections.abc import Callable

from .._presence import RING_PREFIX
from .._queue_rules import (
    claim_window,
    claimable_queue,
    declared_queue,
    free_slots,
)
from .._records import (
    CHANGE_KINDS,
    Queue,
)
from .._sql._queues import (
    ACTIVE_IN_QUEUE,
    ANSWER_CANDIDATES,
    CLAIM_SET,
    LEASE_FOR_ANSWER,
    QUEUE_COLUMNS,
    SELECT_QUEUE,
    STARTED_SINCE,
    claim_candidates,
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
#: Values: queue. Its row (``SELECT_QUEUE``'s columns after the first; NULLs when it was
#: never declared), read as the transaction makes its claims use their prepared
#: statements' generic plans: the candidates' plan is the same whatever the values (one
#: indexed probe per partition, index ranges that stop at a limit), and planning it would
#: cost more than running it. One statement: no round trip of its own for the setting.
CLAIMABLE = (
    "SELECT set_config('plan_cache_mode', 'force_generic_plan', true), "
    + ", ".join(f"q.{column.strip()}" for column in QUEUE_COLUMNS.split(","))
    + ", q.paused_at FROM (SELECT 1) AS one LEFT JOIN queues q ON q.name = %s"
)
#: Values: owner, lease_expires, now, now, run ids. ``CLAIM_RUN`` for every run a claim
#: locked, in one statement that also gives the transaction's id (its first write): a
#: claim that finds nothing writes nothing and commits read-only. The ids join the
#: primary key one by one, whatever the planner makes of ``status``.
CLAIM_RUNS = (
    pg(CLAIM_SET)
    + "FROM unnest(%s::text[]) AS c(run_id) WHERE runs.run_id = c.run_id "
    + f"AND runs.status = 'queued' RETURNING runs.run_id, {XID}"
)


def change_kinds(payload: str) -> frozenset[str]:
    """The change kinds a notification's ``payload`` names; every kind for one it does not
    (a newer writer's). A ring change names the session it is for (``ring:<session>``)."""
    kinds = frozenset(
        k for k in payload.split(",") if k in CHANGE_KINDS or k.startswith(RING_PREFIX)
    )
    return kinds or CHANGE_KINDS


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


async def claim_queued(
    conn: Conn,
    schema: str,
    queue: str,
    owner: str,
    ttl: float,
    limit: int,
    clock: Callable[[], float],
    graphs: tuple[str, ...] | None = None,
    skip: tuple[str, ...] = (),
) -> tuple[list[str], str | None]:
    """Claim up to ``limit`` runs of ``queue`` within its limits, in the transaction of
    ``conn``: (the ids, in claim order; the transaction's id, None when nothing was
    claimed and nothing written)."""
    cur = await conn.execute(CLAIMABLE, (queue,))
    row = await cur.fetchone()
    spec = claimable_queue(queue, None if row is None or row[1] is None else row[1:])
    if spec is None:
        return [], None  # paused, or its row cannot be used (said once): nothing is claimed
    active = started = 0
    if spec.concurrency is not None or spec.limit is not None:
        await lock_queue(conn, schema, queue)
    now = clock()  # once the lock is ours: what the previous holder claimed is in
    if spec.concurrency is not None:
        active = await count_rows(conn, ACTIVE_IN_QUEUE, (queue, now))
    if spec.limit is not None:
        started = await count_rows(conn, STARTED_SINCE, (queue, now - spec.period))
    free = free_slots(spec, want=limit, active=active, started_recently=started)
    if free <= 0:
        return [], None
    window = claim_window(free, skipping=True)
    query, params = claim_candidates(spec, now, free, window, graphs, skip, lateral=True, lock=True)
    cur = await conn.execute(pg(query), params, prepare=True)
    locked = [r[0] for r in await cur.fetchall()]
    if not locked:
        return [], None
    # Stamped after the look: a run of a partition then never starts
    # "before" the finish of the one it waited for (same clock).
    stamp = max(now, clock())
    cur = await conn.execute(CLAIM_RUNS, (owner, stamp + ttl, stamp, stamp, locked))
    rows = await cur.fetchall()
    won = {r[0] for r in rows}
    return [run_id for run_id in locked if run_id in won], (str(rows[0][1]) if rows else None)


async def lease_answers(
    conn: Conn, schema: str, owner: str, ttl: float, limit: int, clock: Callable[[], float]
) -> list[str]:
    """Lease suspended runs with a due answer, within their queues' limits, in the transaction
    of ``conn`` (its id taken first): the id of one due question per run leased."""
    now = clock()
    cur = await conn.execute(pg(ANSWER_CANDIDATES) + SKIP_LOCKED, (now, now, limit * 4 + 8))
    active: dict[str, int | None] = {}
    seen: set[str] = set()
    taken: list[str] = []
    for question_id, run_id, queue_name in await cur.fetchall():
        if len(taken) >= limit or run_id in seen:
            continue
        seen.add(run_id)
        if queue_name is not None and not await slot_for(conn, schema, queue_name, active, now):
            continue
        done = await conn.execute(pg(LEASE_FOR_ANSWER), (owner, now + ttl, run_id, now))
        if done.rowcount == 1:
            taken.append(question_id)
    return taken


async def slot_for(
    conn: Conn, schema: str, queue: str, active: dict[str, int | None], now: float
) -> bool:
    """Whether ``queue`` has a free slot for one more run (counted once, under its lock)."""
    if queue not in active:
        spec = await declared(conn, queue)
        if spec is None:
            active[queue] = 0  # its row cannot be used: paused until declared again
        elif spec.concurrency is None:
            active[queue] = None
        else:
            await lock_queue(conn, schema, queue)
            count = await count_rows(conn, ACTIVE_IN_QUEUE, (queue, now))
            active[queue] = spec.concurrency - count
    free = active[queue]
    if free is None:
        return True
    if free <= 0:
        return False
    active[queue] = free - 1
    return True
