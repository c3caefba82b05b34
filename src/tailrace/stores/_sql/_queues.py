"""Queue SQL shared by the SQLite and Postgres stores, in the common dialect.

The statements mirror ``_queue_rules``: ``claim_candidates`` is
``claim_order`` as a query, ``ACTIVE_IN_QUEUE`` is ``holds_slot``. Postgres
appends ``FOR UPDATE OF r SKIP LOCKED`` to the candidate queries, so
concurrent claimers skip each other's rows instead of waiting for them (the
ranking of candidates sits in a subquery, which the lock does not touch).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from ..._errors import CorruptRecord
from .._queue_rules import run_count_order
from .._records import (
    Queue,
    RunCount,
    RunStatus,
)
from ._statements import RUN_COLUMNS

QUEUE_COLUMNS = (
    "name, concurrency, worker_concurrency, rate_limit, rate_period, ordering, "
    "partition_concurrency, partition_rate_limit"
)
WORKER_COLUMNS = (
    "worker_id, queues_json, concurrency, started_at, seen_at, running, dead_after, session"
)

UPSERT_QUEUE = (
    f"INSERT INTO queues ({QUEUE_COLUMNS}, declared_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) "
    "ON CONFLICT (name) DO UPDATE SET concurrency = excluded.concurrency, "
    "worker_concurrency = excluded.worker_concurrency, rate_limit = excluded.rate_limit, "
    "rate_period = excluded.rate_period, ordering = excluded.ordering, "
    "partition_concurrency = excluded.partition_concurrency, "
    "partition_rate_limit = excluded.partition_rate_limit, declared_at = excluded.declared_at"
)
#: A declaration keeps the queue's pause: ``paused_at`` is set and cleared on its own.
SELECT_QUEUE = f"SELECT {QUEUE_COLUMNS}, paused_at FROM queues WHERE name = ?"
SELECT_QUEUES = f"SELECT {QUEUE_COLUMNS}, paused_at FROM queues ORDER BY name"
#: Values: name, declared_at, paused_at. Pauses a queue (declaring it with the defaults
#: if it never was); a later declaration keeps the pause.
PAUSE_QUEUE = (
    "INSERT INTO queues (name, rate_period, ordering, partition_concurrency, declared_at, "
    "paused_at) VALUES (?, 1.0, 'fifo', 1, ?, ?) "
    "ON CONFLICT (name) DO UPDATE SET paused_at = COALESCE(queues.paused_at, excluded.paused_at)"
)
#: Values: name.
UNPAUSE_QUEUE = "UPDATE queues SET paused_at = NULL WHERE name = ? AND paused_at IS NOT NULL"
#: Values: queue. Its live runs (a queue is deleted only without any).
LIVE_IN_QUEUE = (
    "SELECT COUNT(*) FROM runs WHERE queue_name = ? "
    "AND status IN ('queued', 'running', 'suspended')"
)
#: Values: name.
DELETE_QUEUE = "DELETE FROM queues WHERE name = ?"

#: Values: owner, lease_expires, now, run_id. A cancelled run running again, leased to
#: its reopener (W5); exactly one row changes when it was still cancelled.
REOPEN_CANCELLED = (
    "UPDATE runs SET status = 'running', finished_at = NULL, cancel_requested_at = NULL, "
    "lease_owner = ?, lease_expires = ?, lease_token = lease_token + 1, updated_at = ? "
    "WHERE run_id = ? AND status = 'cancelled'"
)
#: Values: run_id, node_id. A node the cancellation stopped, queued to run again.
REQUEUE_CANCELLED_NODE = (
    "UPDATE node_states SET status = 'queued' WHERE run_id = ? AND node_id = ? "
    "AND status = 'cancelled'"
)

GRAPH_COLUMNS = "name, fingerprint, graph_ref, registered_at"
#: A later registration of the same shape refreshes its reference and time.
UPSERT_GRAPH = (
    f"INSERT INTO graphs ({GRAPH_COLUMNS}) VALUES (?, ?, ?, ?) "
    "ON CONFLICT (name, fingerprint) DO UPDATE SET graph_ref = excluded.graph_ref, "
    "registered_at = excluded.registered_at"
)
#: Values: name. Newest registration first.
SELECT_GRAPHS_NAMED = (
    f"SELECT {GRAPH_COLUMNS} FROM graphs WHERE name = ? ORDER BY registered_at DESC, fingerprint"
)

SCHEDULE_COLUMNS = (
    "name, cron, graph_name, graph_ref, fingerprint, input_json, queue, declared_at, last_tick"
)
#: A declaration replaces what to run and when, and keeps the ticks already submitted.
UPSERT_SCHEDULE = (
    f"INSERT INTO schedules ({SCHEDULE_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) "
    "ON CONFLICT (name) DO UPDATE SET cron = excluded.cron, graph_name = excluded.graph_name, "
    "graph_ref = excluded.graph_ref, fingerprint = excluded.fingerprint, "
    "input_json = excluded.input_json, queue = excluded.queue, "
    "declared_at = excluded.declared_at"
)
SELECT_SCHEDULES = f"SELECT {SCHEDULE_COLUMNS} FROM schedules ORDER BY name"
SELECT_SCHEDULE = f"SELECT {SCHEDULE_COLUMNS} FROM schedules WHERE name = ?"
#: Values: tick, name, tick. The compare-and-set that makes one caller submit a tick.
ADVANCE_SCHEDULE = (
    "UPDATE schedules SET last_tick = ? WHERE name = ? AND (last_tick IS NULL OR last_tick < ?)"
)
DELETE_SCHEDULE = "DELETE FROM schedules WHERE name = ?"

_REPORT = "worker_id, queues_json, concurrency, started_at, seen_at, running, dead_after, host"
#: A worker's report (a heartbeat). ``session`` is left as it is: only joining a session
#: sets it, so a report can never put back the row of a session the fleet buried. No
#: index covers what a report rewrites, so Postgres updates the row in place (HOT).
UPSERT_WORKER = (
    f"INSERT INTO workers ({_REPORT}) VALUES (?, ?, ?, ?, ?, ?, ?, ?) "
    "ON CONFLICT (worker_id) DO UPDATE SET queues_json = excluded.queues_json, "
    "concurrency = excluded.concurrency, started_at = excluded.started_at, "
    "seen_at = excluded.seen_at, running = excluded.running, dead_after = excluded.dead_after, "
    "host = excluded.host"
)
#: A worker joins a store session (W7): its report, and the session it is alive with.
JOIN_WORKER = (
    f"INSERT INTO workers ({_REPORT}, session) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) "
    "ON CONFLICT (worker_id) DO UPDATE SET queues_json = excluded.queues_json, "
    "concurrency = excluded.concurrency, started_at = excluded.started_at, "
    "seen_at = excluded.seen_at, running = excluded.running, dead_after = excluded.dead_after, "
    "host = excluded.host, session = excluded.session"
)
#: Values: session. How many workers a session holds.
SESSION_WORKERS = "SELECT COUNT(*) FROM workers WHERE session = ?"
#: Values: session. The ring of sessions (``workers_by_session``), one index entry each:
#: the next one after a session, the first, the previous one, the last.
NEXT_SESSION = "SELECT MIN(session) FROM workers WHERE session > ?"
FIRST_SESSION = "SELECT MIN(session) FROM workers WHERE session IS NOT NULL"
PREVIOUS_SESSION = "SELECT MAX(session) FROM workers WHERE session < ?"
LAST_SESSION = "SELECT MAX(session) FROM workers WHERE session IS NOT NULL"
#: Values: now, session. The leases of a session that is gone expire now, fenced (a new
#: token: its workers' writes are refused from now on, D6), for the fleet to adopt.
BURY_LEASES = (
    "UPDATE runs SET lease_expires = ?, lease_token = lease_token + 1 "
    "WHERE lease_owner IN (SELECT worker_id FROM workers WHERE session = ?) "
    "AND status IN ('running', 'suspended')"
)
#: Values: session.
DELETE_SESSION = "DELETE FROM workers WHERE session = ?"
#: Values: now. Rows that hold no session and stopped reporting (a worker of a release
#: without sessions): removed as a worker joins (an indexed look at rows without one).
LEFT_BEHIND = "DELETE FROM workers WHERE session IS NULL AND seen_at + dead_after < ?"
#: Values: now, now, now. One row per heartbeat: what is worth a look and what comes
#: due (see ``Pulse``); each probe is an indexed look at one row at most.
PULSE_PROBES = (
    "SELECT (SELECT 1 FROM questions q JOIN runs r ON r.run_id = q.run_id "
    "WHERE (q.status = 'answered' OR (q.status = 'expired' AND q.applied_at IS NULL)) "
    "AND (q.retry_at IS NULL OR q.retry_at <= ?) AND r.status = 'suspended' LIMIT 1), "
    "(SELECT 1 FROM runs WHERE status = 'running' AND (lease_owner IS NULL "
    "OR lease_expires IS NULL OR lease_expires < ?) LIMIT 1), "
    "(SELECT 1 FROM questions WHERE status = 'open' "
    "AND (poller IS NOT NULL OR deadline IS NOT NULL) LIMIT 1), "
    "(SELECT MIN(lease_expires) FROM runs WHERE status = 'running' AND lease_expires >= ?), "
    "(SELECT MIN(deadline) FROM runs WHERE deadline IS NOT NULL "
    "AND status IN ('queued', 'suspended'))"
)
#: Values: queue, now. When the queue's next delayed run may start (``runs_by_not_before``).
NEXT_NOT_BEFORE = (
    "SELECT MIN(not_before) FROM runs WHERE queue_name = ? AND status = 'queued' "
    "AND not_before IS NOT NULL AND not_before > ?"
)
#: Values: owner.
ANY_CANCEL_REQUEST = (
    "SELECT 1 FROM runs WHERE lease_owner = ? AND status = 'running' "
    "AND cancel_requested_at IS NOT NULL LIMIT 1"
)
SELECT_WORKERS = f"SELECT {WORKER_COLUMNS} FROM workers ORDER BY worker_id"
DELETE_WORKER = "DELETE FROM workers WHERE worker_id = ?"

#: Values: queue, now. Runs holding a slot of the queue (``holds_slot``).
ACTIVE_IN_QUEUE = (
    "SELECT COUNT(*) FROM runs WHERE queue_name = ? AND (status = 'running' "
    "OR (status = 'suspended' AND lease_expires >= ?))"
)
#: Values: queue, since. Runs claimed after ``since`` (the rate limit's window).
STARTED_SINCE = "SELECT COUNT(*) FROM runs WHERE queue_name = ? AND started_at > ?"

#: Among runs of one priority and turn, how a queue orders them (see ``claim_key``).
_TIE = {
    "fifo": "r.queued_at, r.run_id",
    "priority": "r.queued_at, r.run_id",
    "lpt": "COALESCE(r.estimate, 0) DESC, r.queued_at, r.run_id",
}
#: How runs with no partition key take their turns: the queue's own order.
_UNKEYED_TURN = {
    "fifo": "-{t}.priority, ",
    "lpt": "-{t}.priority, -COALESCE({t}.estimate, 0), ",
}


def _graph_filters(alias: str, graphs: int | None, skip: int) -> str:
    """``AND`` clauses keeping runs of those graphs (when given) and none of the skipped ones."""
    key = f"({alias}.graph_name || '/' || {alias}.fingerprint)"
    return ("" if graphs is None else f"AND {key} IN ({', '.join('?' * graphs)}) ") + (
        "" if not skip else f"AND {key} NOT IN ({', '.join('?' * skip)}) "
    )


def claim_candidates(queue: Queue, graphs: int | None = None, skip: int = 0) -> str:
    """Values: those :func:`candidate_params` lists. Queued runs of the queue that may
    start now, in claim order (of those graphs only, when given, and none of the
    skipped ones): ``claim_order`` as a query (W2).

    The subquery ``c`` gives each queued run its turn and, for a keyed run,
    when its partition last started a run; the outer query keeps a keyed run
    only while its turn fits its partition's concurrency and rate limit.
    Keyed runs are ranked within their partitions; unkeyed runs take their
    turns in the queue's own order, so only the first of them (the claim's
    ``limit``, with room for rows other claimers hold) are ranked: a claim
    reads the queue's keyed runs and a few unkeyed ones, not its whole backlog.
    """
    turn = _UNKEYED_TURN.get(queue.order, _UNKEYED_TURN["fifo"])
    keyed = (
        "SELECT q.run_id, ROW_NUMBER() OVER (PARTITION BY q.partition_key "
        "ORDER BY q.queued_at, q.run_id) AS turn, "
        "(SELECT MAX(s.started_at) FROM runs s "
        "WHERE s.queue_name = q.queue_name AND s.partition_key = q.partition_key "
        "AND s.started_at IS NOT NULL) AS served "
        "FROM runs q WHERE q.queue_name = ? AND q.status = 'queued' "
        "AND q.partition_key IS NOT NULL AND (q.not_before IS NULL OR q.not_before <= ?)"
    )
    unkeyed = (
        f"SELECT u.run_id, ROW_NUMBER() OVER (ORDER BY {turn.format(t='u')}u.queued_at, "
        "u.run_id) AS turn, NULL AS served FROM (SELECT q.run_id, q.priority, q.estimate, "
        "q.queued_at FROM runs q WHERE q.queue_name = ? AND q.status = 'queued' "
        "AND q.partition_key IS NULL AND (q.not_before IS NULL OR q.not_before <= ?) "
        + _graph_filters("q", graphs, skip)
        + f"ORDER BY {turn.format(t='q')}q.queued_at, q.run_id LIMIT ?) u"
    )
    fits = (
        "(r.partition_key IS NULL OR (c.turn + (SELECT COUNT(*) FROM runs o "
        "WHERE o.queue_name = r.queue_name AND o.partition_key = r.partition_key "
        "AND o.status IN ('running', 'suspended')) <= ?"
        + (
            ""
            if queue.partition_limit is None
            else " AND c.turn + (SELECT COUNT(*) FROM runs o WHERE o.queue_name = r.queue_name "
            "AND o.partition_key = r.partition_key AND o.started_at > ?) <= ?"
        )
        + ")) "
    )
    return (
        f"SELECT r.run_id FROM runs r JOIN ({keyed} UNION ALL {unkeyed}) c "
        f"ON c.run_id = r.run_id WHERE r.status = 'queued' AND {fits}"
        + _graph_filters("r", graphs, skip)
        + "ORDER BY r.priority DESC, c.turn, (c.served IS NOT NULL), c.served, "
        + f"{_TIE[queue.order]} LIMIT ?"
    )


#: Unkeyed runs ranked per claim beyond its ``limit``: room for the rows other
#: claimers hold now (``SKIP LOCKED`` passes over them).
UNKEYED_ROOM = 64


def candidate_params(
    queue: Queue,
    now: float,
    graphs: Sequence[str] | None,
    skip: Sequence[str],
    limit: int,
) -> tuple[object, ...]:
    """The values of :func:`claim_candidates`' query for a claim of ``limit`` runs at ``now``."""
    rate: tuple[object, ...] = ()
    if queue.partition_limit is not None:
        rate = (now - queue.period, queue.partition_limit)
    filters = (*(graphs or ()), *skip)
    unkeyed = (queue.name, now, *filters, 4 * limit + UNKEYED_ROOM)
    return (queue.name, now, *unkeyed, queue.partition_concurrency, *rate, *filters, limit)


#: Values: owner, lease_expires, now, now (then what picks the runs). A claim's lease.
CLAIM_SET = (
    "UPDATE runs SET status = 'running', lease_owner = ?, lease_expires = ?, "
    "lease_token = lease_token + 1, started_at = ?, updated_at = ? "
)
#: Values: owner, lease_expires, now, now, run_id. Exactly one row changes when
#: the run was still queued.
CLAIM_RUN = CLAIM_SET + "WHERE run_id = ? AND status = 'queued'"

#: Values: now, now, limit. Due answers (``DUE_ANSWERS`` order) of suspended runs
#: nobody holds, with the run's queue; a run may appear once per due question.
ANSWER_CANDIDATES = (
    "SELECT q.question_id, r.run_id, r.queue_name FROM questions q "
    "JOIN runs r ON r.run_id = q.run_id "
    "WHERE (q.status = 'answered' OR (q.status = 'expired' AND q.applied_at IS NULL)) "
    "AND (q.retry_at IS NULL OR q.retry_at <= ?) AND r.status = 'suspended' "
    "AND (r.lease_owner IS NULL OR r.lease_expires IS NULL OR r.lease_expires < ?) "
    "ORDER BY CASE WHEN q.retry_at IS NULL THEN 0 ELSE 1 END, "
    "COALESCE(q.retry_at, q.answered_at, 0), q.question_id LIMIT ?"
)
#: Values: owner, lease_expires, run_id, now. Leases a suspended run nobody holds.
LEASE_FOR_ANSWER = (
    "UPDATE runs SET lease_owner = ?, lease_expires = ?, lease_token = lease_token + 1 "
    "WHERE run_id = ? AND status = 'suspended' "
    "AND (lease_owner IS NULL OR lease_expires IS NULL OR lease_expires < ?)"
)

#: Values: now, now, run_id. A queued run becomes cancelled; no row changes otherwise.
CANCEL_QUEUED = (
    "UPDATE runs SET status = 'cancelled', finished_at = ?, updated_at = ? "
    "WHERE run_id = ? AND status = 'queued'"
)
#: Values: now, run_id. Marks a running or suspended run for its driver to cancel.
REQUEST_CANCEL = (
    "UPDATE runs SET cancel_requested_at = COALESCE(cancel_requested_at, ?) "
    "WHERE run_id = ? AND status IN ('running', 'suspended')"
)
#: Values: owner.
CANCEL_REQUESTS = (
    "SELECT run_id FROM runs WHERE lease_owner = ? AND status = 'running' "
    "AND cancel_requested_at IS NOT NULL ORDER BY run_id"
)
#: Values: owner, limit.
LEASED_BY = (
    "SELECT run_id FROM runs WHERE lease_owner = ? AND status = 'running' ORDER BY run_id LIMIT ?"
)
#: Values: queue, dedup_key. The live run holding a dedup key.
DEDUP_HOLDER = (
    "SELECT run_id FROM runs WHERE queue_name = ? AND dedup_key = ? "
    "AND status IN ('queued', 'running', 'suspended')"
)
#: Values: fingerprint, limit.
RUN_DURATIONS = (
    "SELECT COALESCE(cost, 0), finished_at - started_at FROM runs WHERE fingerprint = ? "
    "AND status = 'completed' AND started_at IS NOT NULL AND finished_at IS NOT NULL "
    "ORDER BY finished_at DESC LIMIT ?"
)
#: Values: window start, now. Per queue: queued, running, suspended,
#: started within the window, oldest queued submit time.
QUEUE_COUNTS = (
    "SELECT queue_name, SUM(CASE WHEN status = 'queued' THEN 1 ELSE 0 END), "
    "SUM(CASE WHEN status = 'running' THEN 1 ELSE 0 END), "
    "SUM(CASE WHEN status = 'suspended' THEN 1 ELSE 0 END), "
    "SUM(CASE WHEN started_at > ? AND started_at <= ? THEN 1 ELSE 0 END), "
    "MIN(CASE WHEN status = 'queued' THEN queued_at END) "
    "FROM runs WHERE queue_name IS NOT NULL GROUP BY queue_name"
)


def list_runs_query(
    status: str | None, queue: str | None, graph: str | None, parent: str | None = None
) -> tuple[str, tuple[object, ...]]:
    """``list_runs``'s query, newest first, filtered by ``status``, ``queue``, ``graph`` and ``parent``.

    It ends in ``LIMIT ? OFFSET ?``, whose values the caller appends.
    """
    where: list[str] = []
    params: list[object] = []
    filters = (
        ("status", status), ("queue_name", queue), ("graph_name", graph),
        ("parent_run_id", parent),
    )  # fmt: skip
    for column, value in filters:
        if value is not None:
            where.append(f"{column} = ?")
            params.append(value)
    clause = f"WHERE {' AND '.join(where)} " if where else ""
    order = "ORDER BY created_at DESC, run_id DESC LIMIT ? OFFSET ?"
    return f"SELECT {RUN_COLUMNS} FROM runs {clause}{order}", tuple(params)


#: Runs per graph name, queue and status.
RUN_COUNTS = (
    "SELECT graph_name, queue_name, status, COUNT(*) FROM runs "
    "GROUP BY graph_name, queue_name, status"
)


def run_counts_from_rows(rows: Iterable[Sequence[Any]]) -> list[RunCount]:
    """The :class:`RunCount` s of :data:`RUN_COUNTS`'s rows, in one order on every backend."""
    counts = []
    for graph, queue, status, n in rows:
        try:
            known = RunStatus(status)
        except ValueError:
            raise CorruptRecord(f"runs of graph {graph!r} have unknown status {status!r}") from None
        counts.append(RunCount(graph_name=graph, queue_name=queue, status=known, count=int(n)))
    return sorted(counts, key=run_count_order)


#: Values: kind. What a SQLite watcher reads when ``data_version`` moves.
BUMP_SIGNAL = "UPDATE signals SET n = n + 1 WHERE kind = ?"

#: Values: now, run_id, owner. A claimed run that never started goes back to its
#: queue (its claimant cannot drive it); exactly one row changes when it did.
RETURN_CLAIM = (
    "UPDATE runs SET status = 'queued', lease_owner = NULL, lease_expires = NULL, "
    "started_at = NULL, updated_at = ? WHERE run_id = ? AND lease_owner = ? "
    "AND status = 'running' AND NOT EXISTS (SELECT 1 FROM events e WHERE e.run_id = runs.run_id)"
)
SELECT_SIGNALS = "SELECT kind, n FROM signals"
#: Values: queue. Whether a queue has a run waiting (a claim's cheap first look).
ANY_QUEUED = "SELECT 1 FROM runs WHERE queue_name = ? AND status = 'queued' LIMIT 1"
