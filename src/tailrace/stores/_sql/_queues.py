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
#: A later registration of the same version refreshes its reference, never its time (its deploy).
UPSERT_GRAPH = (
    f"INSERT INTO graphs ({GRAPH_COLUMNS}) VALUES (?, ?, ?, ?) "
    "ON CONFLICT (name, fingerprint) DO UPDATE SET graph_ref = excluded.graph_ref"
)
#: Values: name, fingerprint. When the other versions of a graph name were deployed last.
NEWEST_OTHER_GRAPH = "SELECT MAX(registered_at) FROM graphs WHERE name = ? AND fingerprint <> ?"
#: Values: name. The version deployed last first.
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
#: Values: tick, name, tick, the store's clock. The compare-and-set that makes one caller
#: submit a tick (``tick_is_due``; the caller checked that the tick has come).
ADVANCE_SCHEDULE = (
    "UPDATE schedules SET last_tick = ? WHERE name = ?"
    " AND (last_tick IS NULL OR last_tick < ? OR last_tick > ?)"
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
SESSION_WORKERS = "SELECT worker_id FROM workers WHERE session = ?"
#: Values: session. The ring of sessions (``workers_by_session``), one index entry each:
#: the next one after a session, the first, the previous one, the last.
NEXT_SESSION = "SELECT MIN(session) FROM workers WHERE session > ?"
FIRST_SESSION = "SELECT MIN(session) FROM workers WHERE session IS NOT NULL"
PREVIOUS_SESSION = "SELECT MAX(session) FROM workers WHERE session < ?"
LAST_SESSION = "SELECT MAX(session) FROM workers WHERE session IS NOT NULL"
#: Values: session. The leases of a session that is gone expire, fenced (a new token: its
#: workers' writes are refused from now on, D6), for the fleet to adopt: at time 0, not at
#: the burier's clock, so every worker finds them expired whatever its own clock says.
BURY_LEASES = (
    "UPDATE runs SET lease_expires = 0, lease_token = lease_token + 1 "
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


def in_line_at(alias: str) -> str:
    """When a run took its place in line (``_queue_rules.in_line_at``): its submit time, or
    its ``not_before`` when later. Written as the indexes ``runs_in_line`` and
    ``runs_delayed`` hold it, so a query that sorts by it reads them in order."""
    t = f"{alias}." if alias else ""
    return f"(CASE WHEN {t}not_before > {t}queued_at THEN {t}not_before ELSE {t}queued_at END)"


#: Among runs of one priority and turn, how a queue orders them (see ``claim_key``).
_TIE = {
    "fifo": "c.at, c.run_id",
    "priority": "c.at, c.run_id",
    "lpt": "COALESCE(c.estimate, 0) DESC, c.at, c.run_id",
}
#: The claim order of the candidates (``claim_order``'s sort key).
_CLAIM_ORDER = {
    order: f"c.prio DESC, c.turn, (c.served IS NOT NULL), c.served, {tie}"
    for order, tie in _TIE.items()
}
#: How runs with no partition key take their turns: the queue's own order. Each
#: matches an index of queued runs (``runs_loose``, ``runs_loose_lpt``) key for key.
_LOOSE_ORDER = {
    "fifo": "q.priority DESC, q.queued_at, q.run_id",
    "priority": "q.priority DESC, q.queued_at, q.run_id",
    "lpt": "q.priority DESC, COALESCE(q.estimate, 0) DESC, q.queued_at, q.run_id",
}
#: The same order over the candidates' columns, to rank them into turns.
_LOOSE_TURN = {
    "fifo": "u.prio DESC, u.at, u.run_id",
    "priority": "u.prio DESC, u.at, u.run_id",
    "lpt": "u.prio DESC, COALESCE(u.estimate, 0) DESC, u.at, u.run_id",
}
#: A partition's next queued run in line ``{after}`` a place: ``{column}`` of it, from one
#: probe of the index ``runs_in_line``.
_NEXT_IN_LINE = (
    "(SELECT {column} FROM runs k WHERE k.queue_name = ? AND k.status = 'queued' "
    "AND k.partition_key = {pk} {after}ORDER BY " + in_line_at("k") + ", k.run_id LIMIT 1)"
)
#: The first partition key of a queued run ``{after}`` one: one probe of ``runs_in_line``.
_NEXT_KEY = (
    "(SELECT k.partition_key FROM runs k WHERE k.queue_name = ? AND k.status = 'queued' "
    "AND k.partition_key IS NOT NULL {after}ORDER BY k.partition_key LIMIT 1)"
)
#: Columns a claim does not read (an index holds what it does), typed for a UNION.
_NO_NUMBER, _NO_TEXT = "CAST(NULL AS DOUBLE PRECISION)", "CAST(NULL AS TEXT)"


def _graph_filters(key: str, graphs: int | None, skip: int) -> str:
    """``AND`` clauses keeping runs whose ``key`` (``name/fingerprint``) is of those graphs
    (when given) and none of the skipped ones."""
    return ("" if graphs is None else f"AND {key} IN ({', '.join('?' * graphs)}) ") + (
        "" if not skip else f"AND {key} NOT IN ({', '.join('?' * skip)}) "
    )


def _graph_key(alias: str) -> str:
    return f"({alias}.graph_name || '/' || {alias}.fingerprint)"


def _of_run(column: str, wanted: bool, typed: str) -> str:
    """``column`` of the run ``c.run_id`` (a primary-key probe), or ``typed`` NULL when not
    ``wanted`` (the columns a claim does not sort or filter by stay unread)."""
    if not wanted:
        return typed
    return f"(SELECT r.{column} FROM runs r WHERE r.run_id = c.run_id)"


def claim_candidates(
    queue: Queue,
    now: float,
    limit: int,
    window: int,
    graphs: Sequence[str] | None = None,
    skip: Sequence[str] = (),
    *,
    keyed: bool = True,
    lateral: bool = False,
    lock: bool = False,
) -> tuple[str, tuple[object, ...]]:
    """The query (and its values) of the first ``window`` queued runs of ``queue`` that a
    claim of ``limit`` may take at ``now``, in claim order (of ``graphs`` only, when given,
    and none of ``skip``): ``claim_order`` as a query (W2). The claim takes the first
    ``limit`` of them it can (``window`` leaves room for those other claims hold:
    ``claim_window``); with ``lock`` (Postgres) the query itself locks them, in claim
    order, passing over the rows other claims hold (``FOR UPDATE SKIP LOCKED``), and
    returns those.

    It reads index entries in proportion to the queue's partitions and to
    ``window``, never to its backlog: every look at ``runs`` is an indexed
    probe or an index range that stops at a limit.

    - ``walk`` skips through the keyed queued runs in partition order (a loose
      index scan: one probe per partition key);
    - ``parts``: per partition, the room its concurrency and rate limit leave
      and when it last started a run;
    - ``line``: a partition's first runs in line, as many as its room, up to
      the first still delayed; each with the priority of the partition's first;
    - ``loose``: the first ``window`` unkeyed runs not delayed, in the queue's
      order, and the ``limit`` unkeyed delayed runs that came due earliest,
      ranked together into turns.

    Without ``keyed`` (a queue with no keyed run queued: SQLite looks first,
    in process, as that costs less than the walk's plan) the query ranks only
    the unkeyed runs. With ``lateral`` (Postgres), one probe of the walk reads a partition's key
    and its first run in line together, and each next run in line is one
    probe; without it (SQLite, in process), each column is a probe of its own.
    The ranking locks nothing: only the runs a claim takes are locked, one by
    one in claim order (a ``LATERAL`` lock per candidate, stopping at
    ``limit``).
    """
    sql = _Query()
    if keyed:
        (_lateral_line if lateral else _scalar_line)(sql, queue, now)
    else:
        sql.add("WITH ")
    order, kept = queue.order, (*(graphs or ()), *skip)
    graph_count, filtered = (
        (None if graphs is None else len(graphs)),
        graphs is not None or bool(kept),
    )
    keep_loose = _graph_filters(_graph_key("q"), graph_count, len(skip))
    estimate = "q.estimate" if order == "lpt" else _NO_NUMBER
    graph = _graph_key("q") if filtered else _NO_TEXT
    sql.add(
        f"loose(run_id, at, prio, estimate, gkey) AS (SELECT * FROM (SELECT q.run_id, "
        f"q.queued_at, q.priority, {estimate}, {graph} FROM runs q WHERE q.queue_name = ? "
        "AND q.status = 'queued' AND q.partition_key IS NULL AND q.not_before IS NULL "
        f"{keep_loose}ORDER BY {_LOOSE_ORDER[order]} LIMIT ?) i UNION ALL "
        f"SELECT * FROM (SELECT q.run_id, {in_line_at('q')}, q.priority, {estimate}, {graph} "
        "FROM runs q WHERE q.queue_name = ? AND q.status = 'queued' "
        f"AND q.partition_key IS NULL AND q.not_before IS NOT NULL AND {in_line_at('q')} <= ? "
        f"{keep_loose}ORDER BY {in_line_at('q')}, q.run_id LIMIT ?) d), ",
        queue.name, *kept, window, queue.name, now, *kept, limit,
    )  # fmt: skip
    in_line = (
        "SELECT c.run_id, c.turn, c.prio, c.served, c.at, "
        f"{_of_run('estimate', order == 'lpt', _NO_NUMBER)} AS estimate, "
        f"{_of_run('graph_name', filtered, _NO_TEXT)} || '/' || "
        f"{_of_run('fingerprint', filtered, _NO_TEXT)} AS gkey "
        "FROM line c WHERE c.run_id IS NOT NULL UNION ALL "
    )
    sql.add(
        "cands AS (SELECT c.run_id, ROW_NUMBER() OVER (ORDER BY "
        f"{_CLAIM_ORDER[order]}) AS n FROM ({in_line if keyed else ''}"
        f"SELECT u.run_id, ROW_NUMBER() OVER (ORDER BY {_LOOSE_TURN[order]}) AS turn, "
        f"u.prio, {_NO_NUMBER} AS served, u.at, u.estimate, u.gkey FROM loose u) c "
        f"WHERE 1 = 1 {_graph_filters('c.gkey', graph_count, len(skip))}"
        f"ORDER BY {_CLAIM_ORDER[order]} LIMIT ?) ",
        *kept, window,
    )  # fmt: skip
    if lock:
        sql.add(
            "SELECT l.run_id FROM (SELECT run_id, n FROM cands ORDER BY n) c "
            "CROSS JOIN LATERAL (SELECT r.run_id FROM runs r WHERE r.run_id = c.run_id "
            "AND r.status = 'queued' FOR UPDATE SKIP LOCKED) l LIMIT ?",
            limit,
        )
    else:
        sql.add("SELECT run_id FROM cands ORDER BY n")
    return sql.text(), sql.values()


def _parts(sql: _Query, queue: Queue, now: float, *heads: object) -> None:
    """``parts``: each partition ``walk`` found, the room its concurrency (and rate limit)
    leave, when it last started a run, and ``heads``: more columns of ``walk s`` (text,
    then the values of its placeholders)."""
    q = queue.name
    sql.add(
        "parts AS MATERIALIZED (SELECT s.pk, ? - (SELECT COUNT(*) FROM runs o "
        "WHERE o.queue_name = ? AND o.partition_key = s.pk "
        "AND o.status IN ('running', 'suspended')) AS room, ",
        queue.partition_concurrency, q,
    )  # fmt: skip
    if queue.partition_limit is None:
        sql.add("CAST(NULL AS BIGINT) AS rate, ")
    else:
        sql.add(
            "? - (SELECT COUNT(*) FROM runs o WHERE o.queue_name = ? "
            "AND o.partition_key = s.pk AND o.started_at > ?) AS rate, ",
            queue.partition_limit, q, now - queue.period,
        )  # fmt: skip
    text, *values = heads or ("",)
    sql.add(
        "(SELECT MAX(o.started_at) FROM runs o WHERE o.queue_name = ? "
        f"AND o.partition_key = s.pk AND o.started_at IS NOT NULL) AS served{text} "
        "FROM walk s WHERE s.pk IS NOT NULL), ",
        q, *values,
    )  # fmt: skip


def _if_due(alias: str, at: str | None = None) -> str:
    """A run in line is handed out once due: its id, or NULL while it is still delayed
    (``at``: its place in line, when a column holds it)."""
    place = at or in_line_at(alias)
    return f"CASE WHEN {alias}.not_before IS NULL OR {place} <= ? THEN {alias}.run_id END"


#: A partition's line starts while it has room (and rate) for a run, and goes on while it
#: has room for one more. ``parts`` is materialized: its room is counted once.
_ROOM = "p.room > 0 AND (p.rate IS NULL OR p.rate > 0)"
_ROOM_LEFT = "l.run_id IS NOT NULL AND l.turn < l.room AND (l.rate IS NULL OR l.turn < l.rate)"


def _scalar_line(sql: _Query, queue: Queue, now: float) -> None:
    """``walk``, ``parts`` and ``line`` with a scalar subquery per probe (any dialect)."""
    q = queue.name
    sql.add(
        f"WITH RECURSIVE walk(pk) AS (SELECT {_NEXT_KEY.format(after='')} UNION ALL "
        f"SELECT {_NEXT_KEY.format(after='AND k.partition_key > w.pk ')} FROM walk w "
        "WHERE w.pk IS NOT NULL), ",
        q, q,
    )  # fmt: skip
    _parts(sql, queue, now)
    first = {"pk": "p.pk", "after": ""}
    after = {"pk": "l.pk", "after": f"AND ({in_line_at('k')}, k.run_id) > (l.at, l.run_id) "}
    sql.add(
        "line(pk, turn, at, run_id, room, rate, served, prio) AS (SELECT p.pk, 1, "
        f"{_NEXT_IN_LINE.format(column=in_line_at('k'), **first)}, "
        f"{_NEXT_IN_LINE.format(column=_if_due('k'), **first)}, p.room, p.rate, p.served, "
        "(SELECT h.priority FROM runs h WHERE h.run_id = "
        f"{_NEXT_IN_LINE.format(column='k.run_id', **first)}) FROM parts p WHERE {_ROOM} "
        f"UNION ALL SELECT l.pk, l.turn + 1, "
        f"{_NEXT_IN_LINE.format(column=in_line_at('k'), **after)}, "
        f"{_NEXT_IN_LINE.format(column=_if_due('k'), **after)}, l.room, l.rate, l.served, "
        f"l.prio FROM line l WHERE {_ROOM_LEFT}), ",
        q, now, q, q, q, now, q,
    )  # fmt: skip


def _lateral_line(sql: _Query, queue: Queue, now: float) -> None:
    """``walk``, ``parts`` and ``line`` with ``LATERAL`` probes that read whole rows
    (Postgres): one probe per partition for its key and first run in line."""
    q = queue.name
    head = (
        f"SELECT k.partition_key, {in_line_at('k')}, k.run_id, k.not_before, k.priority "
        "FROM runs k WHERE k.queue_name = ? AND k.status = 'queued' "
        "AND k.partition_key IS NOT NULL {after}"
        f"ORDER BY k.partition_key, {in_line_at('k')}, k.run_id LIMIT 1"
    )
    sql.add(
        f"WITH RECURSIVE walk(pk, at, run_id, not_before, prio) AS (SELECT * FROM "
        f"({head.format(after='')}) f UNION ALL SELECT f.* FROM walk w CROSS JOIN LATERAL "
        f"({head.format(after='AND k.partition_key > w.pk ')}) f), ",
        q, q,
    )  # fmt: skip
    _parts(sql, queue, now, f", s.at, {_if_due('s', 's.at')} AS run_id, s.prio", now)
    sql.add(
        "line(pk, turn, at, run_id, room, rate, served, prio) AS (SELECT p.pk, 1, p.at, "
        f"p.run_id, p.room, p.rate, p.served, p.prio FROM parts p WHERE {_ROOM} UNION ALL "
        f"SELECT l.pk, l.turn + 1, n.at, {_if_due('n', 'n.at')}, l.room, l.rate, l.served, "
        f"l.prio FROM line l CROSS JOIN LATERAL (SELECT {in_line_at('k')} AS at, k.run_id, "
        "k.not_before FROM runs k WHERE k.queue_name = ? AND k.status = 'queued' "
        f"AND k.partition_key = l.pk AND ({in_line_at('k')}, k.run_id) > (l.at, l.run_id) "
        f"ORDER BY {in_line_at('k')}, k.run_id LIMIT 1) n WHERE {_ROOM_LEFT}), ",
        now, q,
    )  # fmt: skip


class _Query:
    """A statement written piece by piece, each piece with the values of its placeholders."""

    def __init__(self) -> None:
        self._texts: list[str] = []
        self._values: list[object] = []

    def add(self, text: str, *values: object) -> None:
        if text.count("?") != len(values):
            raise AssertionError(f"{text.count('?')} placeholders, {len(values)} values: {text}")
        self._texts.append(text)
        self._values.extend(values)

    def text(self) -> str:
        return "".join(self._texts)

    def values(self) -> tuple[object, ...]:
        return tuple(self._values)


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
    status: str | None, queue: str | None, graph: str | None, parent: str | None = None,
    *, top_level: bool = False,
) -> tuple[str, tuple[object, ...]]:  # fmt: skip
    """``list_runs``'s query, newest first, filtered by ``status``, ``queue``, ``graph`` and
    ``parent`` (or to the runs that are no run's child: ``top_level``).

    It ends in ``LIMIT ? OFFSET ?``, whose values the caller appends.
    """
    where: list[str] = ["parent_run_id IS NULL"] if top_level else []
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
#: The same, of the runs that are no run's child (R1).
TOP_LEVEL_RUN_COUNTS = RUN_COUNTS.replace("FROM runs ", "FROM runs WHERE parent_run_id IS NULL ")


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
#: Values: queue. Whether a keyed run of it is queued (one probe of ``runs_in_line``).
ANY_KEYED = (
    "SELECT 1 FROM runs WHERE queue_name = ? AND status = 'queued' "
    "AND partition_key IS NOT NULL LIMIT 1"
)
