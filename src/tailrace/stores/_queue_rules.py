"""Queue rules every backend shares: claim order, partitions, limits, records.

The memory store applies these functions directly; the SQL stores phrase the
same decisions as queries (``_sql._queues``), checked against these by one
contract suite. ``free_slots`` is where every claim's number comes from.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import json
import logging
import math
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any

from .._errors import QueueNotEmpty
from ..tail import Cron
from ._records import (
    LIVE_STATUSES,
    GraphRow,
    NewRun,
    Pulse,
    Queue,
    QueueStats,
    RunCount,
    RunRecord,
    RunStatus,
    ScheduleRow,
    Submission,
    WorkerRow,
)
from ._rules import check_name, check_ttl

logger = logging.getLogger("tailrace.stores")


def claim_key(queue: Queue, run: RunRecord) -> tuple[Any, ...]:
    """Sort key of a queued ``run`` in ``queue``: smaller is handed out first.

    A higher ``priority`` goes first in every queue (as DBOS does); among runs
    of equal priority, ``fifo`` and ``priority`` take the run's place in line
    (:func:`in_line_at`), then id, and ``lpt`` the larger ``estimate`` first
    (none counts as 0).
    """
    tie = (in_line_at(run), run.run_id)
    if queue.order == "lpt":
        return (-run.priority, -(run.estimate or 0.0), *tie)
    return (-run.priority, *tie)


def in_line_at(run: RunRecord) -> float:
    """When ``run`` took its place in its queue's line: its submit time, or, for a run
    delayed past it, its ``not_before`` (a delayed run joins the line when it comes due)."""
    queued = run.queued_at or 0.0
    if run.not_before is not None and run.not_before > queued:
        return run.not_before
    return queued


def holds_slot(run: RunRecord, now: float) -> bool:
    """Whether ``run`` counts against its queue's ``concurrency`` at ``now``.

    Running runs do (a dead worker's too, until its adopter finishes them); a
    suspended run does only while someone holds its lease, i.e. while it is
    being resumed.
    """
    if run.status is RunStatus.RUNNING:
        return True
    return (
        run.status is RunStatus.SUSPENDED
        and run.lease_expires is not None
        and run.lease_expires >= now
    )


def free_slots(queue: Queue, *, want: int, active: int, started_recently: int) -> int:
    """How many runs a claim on ``queue`` may take: ``want``, within concurrency and rate limit."""
    free = max(want, 0)
    if queue.concurrency is not None:
        free = min(free, queue.concurrency - active)
    if queue.limit is not None:
        free = min(free, queue.limit - started_recently)
    return max(free, 0)


#: Runs a claim looks at beyond its ``limit`` where it passes over rows other claims
#: hold (Postgres's ``SKIP LOCKED``): room for those.
CLAIM_ROOM = 64


def claim_window(limit: int, *, skipping: bool) -> int:
    """How many candidates a claim of ``limit`` runs looks at: ``limit``, and where the
    claim, ``skipping``, passes over the rows other claims hold, room for those. (Of the
    unkeyed delayed runs that came due it looks at ``limit``, see :func:`claim_order`.)"""
    limit = max(limit, 0)
    return 4 * limit + CLAIM_ROOM if skipping else limit


def claim_order(
    queue: Queue,
    runs: Iterable[RunRecord],
    now: float,
    *,
    window: int | None = None,
    drivable: Callable[[RunRecord], bool] | None = None,
) -> list[RunRecord]:
    """The queued runs of ``queue`` that may start at ``now``, in the order a claim takes them (W2).

    ``runs`` are the queue's runs (any status). A run takes its place in line
    when it is submitted, or, delayed (``not_before``), when it comes due
    (:func:`in_line_at`); until then it is not handed out and takes no turn.
    Within a partition key, runs start in that order, at most
    ``partition_concurrency`` running or suspended at once and
    ``partition_limit`` started per ``period`` (a partition whose next run is
    still delayed waits for it). Across keys, a run's *turn* is its place
    among its partition's queued runs; runs with no key take turns as one
    partition, in the queue's order, counting only those ``drivable`` keeps,
    of which a claim looks at the first ``window`` not delayed and the
    ``window`` that came due earliest (all of them without a window). A claim
    takes by priority (a keyed run has its partition's first run's), then
    turn, then the partition served longest ago (never served first), then
    the queue's order. The SQL stores phrase the same rule as
    ``_sql._queues.claim_candidates``.
    """
    runs = [r for r in runs if r.queue_name == queue.name]
    queued = [r for r in runs if r.status is RunStatus.QUEUED]
    groups: dict[str | None, list[RunRecord]] = {}
    for run in sorted(queued, key=_line_order):
        if run.partition_key is None and drivable is not None and not drivable(run):
            continue
        groups.setdefault(run.partition_key, []).append(run)
    due = [r for r in groups.pop(None, []) if r.not_before is not None and _due(r, now)]
    loose = sorted(
        (
            r
            for r in queued
            if r.partition_key is None
            and r.not_before is None
            and (drivable is None or drivable(r))
        ),
        key=lambda r: claim_key(queue, r),
    )
    if window is not None:
        due, loose = due[:window], loose[:window]
    if due or loose:
        groups[None] = sorted(loose + due, key=lambda r: claim_key(queue, r))
    turn: dict[str, int] = {}
    head: dict[str, int] = {}
    for key, members in groups.items():
        if key is not None:  # its runs in line up to the first still delayed
            members[:] = list(itertools.takewhile(lambda r: _due(r, now), members))
            head[key] = members[0].priority if members else 0
        turn.update((r.run_id, n) for n, r in enumerate(members, start=1))
    served: dict[str, float] = {}
    live: Counter[str] = Counter()
    started: Counter[str] = Counter()
    for run in runs:
        key = run.partition_key
        if key is None:
            continue
        if run.started_at is not None:
            served[key] = max(served.get(key, run.started_at), run.started_at)
            started[key] += run.started_at > now - queue.period
        live[key] += run.status in (RunStatus.RUNNING, RunStatus.SUSPENDED)

    def may_start(run: RunRecord) -> bool:
        key = run.partition_key
        if key is None:
            return True
        mine = turn[run.run_id]
        if live[key] + mine > queue.partition_concurrency:
            return False
        return queue.partition_limit is None or started[key] + mine <= queue.partition_limit

    def order(run: RunRecord) -> tuple[Any, ...]:
        key = run.partition_key
        last = None if key is None else served.get(key)
        priority = run.priority if key is None else head[key]
        return (-priority, turn[run.run_id], last is not None, last or 0.0,
                *claim_key(queue, run)[1:])  # fmt: skip

    return sorted((r for members in groups.values() for r in members if may_start(r)), key=order)


def _line_order(run: RunRecord) -> tuple[float, str]:
    return (in_line_at(run), run.run_id)


def _due(run: RunRecord, now: float) -> bool:
    """Whether ``run`` may be handed out at ``now``: not delayed, or its place in line came."""
    return run.not_before is None or in_line_at(run) <= now


def queue_not_empty(name: str, live: int) -> QueueNotEmpty:
    """The refusal to delete queue ``name`` while ``live`` runs are live in it."""
    return QueueNotEmpty(
        f"queue {name!r} still holds {live} live run{'s' if live != 1 else ''} (queued, running "
        "or suspended); cancel or finish them first. Nothing was deleted.",
        queue=name, live=live,
    )  # fmt: skip


def first_schedule(row: ScheduleRow) -> ScheduleRow:
    """``row`` checked (names, cron: ``ValueError`` naming the culprit), as first stored: its
    ``last_tick`` the latest tick before its declaration, so earlier ticks are not due (W4)."""
    check_name("schedule", row.name)
    check_name("queue", row.queue)
    for what in ("graph_name", "fingerprint"):
        check_name(what, getattr(row, what))
    if row.graph_ref is not None:
        check_name("graph_ref", row.graph_ref)
    cron = Cron(row.cron)
    return dataclasses.replace(row, last_tick=cron.latest_at(row.declared_at))


def deployed_at(registered_at: float, newest: float | None) -> float:
    """When a version new to the store is recorded as deployed: at ``registered_at`` (the
    registering host's clock), but after ``newest``, the latest of the versions of its name
    registered before it, so a new version is the newest whatever that host's clock says."""
    if newest is None or registered_at > newest:
        return registered_at
    return math.nextafter(newest, math.inf)


def tick_is_due(last_tick: float | None, tick: float, now: float) -> bool:
    """Whether a schedule whose last submitted tick is ``last_tick`` may submit ``tick`` at
    ``now``, the store's clock (W4).

    A tick is due once it has come and when it is later than the last one; a
    last tick later than ``now`` (stamped by a clock running ahead) holds
    none back, so one host's clock cannot silence a schedule.
    """
    return tick <= now and (last_tick is None or last_tick < tick or last_tick > now)


def next_tick(row: ScheduleRow, now: float) -> float:
    """The tick schedule ``row`` submits next at ``now``, the store's clock: its latest tick
    while that one is due (the next look of any worker submits it), else the next to come."""
    cron = Cron(row.cron)
    latest = cron.latest_at(now)
    if latest is not None and tick_is_due(row.last_tick, latest, now):
        return latest
    return cron.next_after(now)


def graph_from_row(row: Sequence[Any]) -> GraphRow:
    """Decode a ``graphs`` row selected with ``GRAPH_COLUMNS``."""
    name, fingerprint, graph_ref, registered_at = row
    return GraphRow(
        name=name, fingerprint=fingerprint, graph_ref=graph_ref,
        registered_at=float(registered_at),
    )  # fmt: skip


def schedule_params(row: ScheduleRow) -> tuple[object, ...]:
    """Values of the ``schedules`` row of ``row`` (``SCHEDULE_COLUMNS``)."""
    r = row
    return (
        r.name, r.cron, r.graph_name, r.graph_ref, r.fingerprint, r.input_json, r.queue,
        r.declared_at, r.last_tick,
    )  # fmt: skip


def schedule_from_row(row: Sequence[Any]) -> ScheduleRow:
    """Decode a ``schedules`` row selected with ``SCHEDULE_COLUMNS``."""
    name, cron, graph_name, graph_ref, fingerprint, input_json, queue, declared, last = row
    return ScheduleRow(
        name=name, cron=cron, graph_name=graph_name, graph_ref=graph_ref,
        fingerprint=fingerprint, input_json=input_json, queue=queue,
        declared_at=float(declared), last_tick=None if last is None else float(last),
    )  # fmt: skip


def utc_minute(at: float) -> str:
    """``at`` (seconds since the epoch) as ``YYYY-MM-DDTHH:MMZ``, as a scheduled run's id has it."""
    return datetime.datetime.fromtimestamp(at, datetime.UTC).strftime("%Y-%m-%dT%H:%MZ")


def scheduled_run(row: ScheduleRow, tick: float, now: float) -> tuple[NewRun, Submission]:
    """The run schedule ``row`` submits for ``tick``; its id names both, so a tick is one run."""
    run = NewRun(
        run_id=f"{row.name}@{utc_minute(tick)}", graph_name=row.graph_name,
        graph_ref=row.graph_ref, fingerprint=row.fingerprint, input_json=row.input_json,
        created_at=now,
    )  # fmt: skip
    return run, Submission(queue=row.queue)


def check_claim(queue: str, owner: str, ttl: float, limit: int) -> None:
    """Refuse a claim's bad arguments (``ValueError`` naming the field) before touching the store."""
    check_name("queue", queue)
    check_name("owner", owner)
    check_ttl(ttl)
    if not isinstance(limit, int) or isinstance(limit, bool):
        raise ValueError(f"claim limit must be an int, got {limit!r}")


def graph_keys(graphs: Iterable[tuple[str, str]]) -> tuple[str, ...]:
    """The claim filter's keys, ``name/fingerprint``, sorted (a fingerprint holds no ``/``)."""
    keys = set()
    for pair in graphs:
        if (
            not isinstance(pair, tuple)
            or len(pair) != 2
            or not all(isinstance(part, str) and part for part in pair)
            or "/" in pair[1]
        ):
            raise ValueError(f"claim graphs must be (graph name, fingerprint) pairs, got {pair!r}")
        keys.add(f"{pair[0]}/{pair[1]}")
    return tuple(sorted(keys))


def run_graph_key(run: RunRecord) -> str:
    """The claim filter's key of ``run`` (see :func:`graph_keys`)."""
    return f"{run.graph_name}/{run.fingerprint}"


def dedup_holder(runs: Iterable[RunRecord], queue: str, dedup_key: str | None) -> RunRecord | None:
    """The live run of ``queue`` that holds ``dedup_key``, if any."""
    if dedup_key is None:
        return None
    for run in runs:
        if run.queue_name == queue and run.dedup_key == dedup_key and run.status in LIVE_STATUSES:
            return run
    return None


def queue_params(queue: Queue, now: float) -> tuple[object, ...]:
    """Values of the ``queues`` row of ``queue`` declared at ``now``."""
    q = queue
    return (
        q.name, q.concurrency, q.worker_concurrency, q.limit, float(q.period), q.order,
        q.partition_concurrency, q.partition_limit, now,
    )  # fmt: skip


def queue_from_row(row: Sequence[Any]) -> Queue:
    """Decode a ``queues`` row selected with ``QUEUE_COLUMNS``."""
    name, concurrency, worker_concurrency, limit, period, order = row[:6]
    partition_concurrency, partition_limit = row[6:8]
    if not isinstance(period, int | float) or isinstance(period, bool):
        raise ValueError(f"period is not a number of seconds: {period!r}")
    return Queue(
        name, concurrency=concurrency, worker_concurrency=worker_concurrency, limit=limit,
        period=float(period), order=order, partition_concurrency=partition_concurrency,
        partition_limit=partition_limit,
    )  # fmt: skip


def paused_names(rows: Iterable[Sequence[Any]]) -> set[str]:
    """Names of the paused queues among ``queues`` rows selected with ``QUEUE_COLUMNS, paused_at``."""
    return {str(row[0]) for row in rows if len(row) > 8 and row[8] is not None}


#: Rows already reported as unusable (kind, row), so each is said once.
_REPORTED: set[tuple[str, str]] = set()
#: Reported rows remembered at most (a flood of bad rows is not remembered whole).
_MAX_REPORTED = 10_000


def _unusable(kind: str, row: Sequence[Any], exc: Exception, then: str) -> None:
    key = (kind, repr(tuple(row)))
    if key in _REPORTED:
        return
    if len(_REPORTED) < _MAX_REPORTED:
        _REPORTED.add(key)
    logger.warning("a %s row cannot be used (%s): %s; %s", kind, exc, key[1][:200], then)


def queue_rows(rows: Iterable[Sequence[Any]]) -> list[Queue]:
    """The ``queues`` rows that decode into a :class:`Queue`; each other one is reported once.

    A row an operator or an older writer broke (``concurrency = 0``, a word for
    a number) must not stop every worker: it is left out of listings, and its
    queue claims nothing (see :func:`declared_queue`).
    """
    queues = []
    for row in rows:
        try:
            queues.append(queue_from_row(row))
        except (ValueError, TypeError) as exc:
            _unusable("queues", row, exc, "its queue claims nothing until it is declared again")
    return queues


def declared_queue(name: str, row: Sequence[Any] | None) -> Queue | None:
    """The limits of queue ``name`` from its ``queues`` row (defaults without one);
    None when the row cannot be used, so nothing is claimed from it (said once)."""
    if row is None:
        return Queue(name)
    usable = queue_rows([row])
    return usable[0] if usable else None


def claimable_queue(name: str, row: Sequence[Any] | None) -> Queue | None:
    """Like :func:`declared_queue`, and None as well while the queue is paused (its row has a
    ``paused_at``): a claim then hands out nothing (W2)."""
    if row is not None and len(row) > 8 and row[8] is not None:
        return None
    return declared_queue(name, row)


def worker_rows(rows: Iterable[Sequence[Any]]) -> list[WorkerRow]:
    """The ``workers`` rows that decode; each other one is reported once and left out."""
    workers = []
    for row in rows:
        try:
            workers.append(worker_from_row(row))
        except (ValueError, TypeError) as exc:
            _unusable("workers", row, exc, "it is left out of listings and burials")
    return workers


def worker_params(worker: WorkerRow) -> tuple[object, ...]:
    """Values of the ``workers`` row of ``worker``."""
    w = worker
    queues = json.dumps(list(w.queues))
    return (
        w.worker_id, queues, w.concurrency, w.started_at, w.seen_at, w.running, w.dead_after,
        host_of(w.worker_id),
    )  # fmt: skip


def join_params(worker: WorkerRow, session: str) -> tuple[object, ...]:
    """Values of the ``workers`` row of ``worker`` joining store session ``session`` (W7)."""
    return (*worker_params(worker), session)


def pulse_of(
    kinds: Iterable[str],
    *,
    gates: bool,
    now: float,
    deadline: float | None,
    due: Iterable[float | None],
) -> Pulse:
    """The :class:`Pulse` of a heartbeat at ``now`` from what its probes found: ``deadline``
    the earliest deadline of a queued or suspended run, ``due`` the other times that come
    due (a running run's next lease expiry, each queue's next delayed run)."""
    times = [t for t in (*due, deadline) if t is not None and t > now]
    return Pulse(
        kinds=frozenset(kinds), gates=gates, overdue=deadline is not None and deadline <= now,
        due_at=min(times, default=None),
    )  # fmt: skip


def left_behind(worker: WorkerRow, now: float) -> bool:
    """Whether ``worker``'s row holds no session and stopped reporting (removed as one joins)."""
    return worker.session is None and worker.seen_at + worker.dead_after < now


def ring_neighbour(sessions: Iterable[str], session: str, *, after: bool) -> str | None:
    """The session next ``after`` (else before) ``session`` in the ring of ``sessions`` (sorted,
    wrapping round), or None when ``session`` is alone (the memory store's way)."""
    others = sorted(set(sessions) - {session})
    if not others:
        return None
    if after:
        return next((s for s in others if s > session), others[0])
    return next((s for s in reversed(others) if s < session), others[-1])


#: Seconds after which the graph registrations of a worker whose row is gone are dropped
#: (``register_worker_graphs``): a starting worker registers before its first report.
STALE_REGISTRATION = 3600.0


def is_live(worker: WorkerRow, now: float) -> bool:
    """Whether ``worker`` (a row of the store's ``workers``) counts as alive at ``now``.

    Its row is there only while its store session is (the fleet buries a dead session
    and its rows at once, W7); a session held by a process that stopped reporting (hung,
    or cut off with its connection still open at the server) counts as alive only
    within its ``dead_after`` of its last report."""
    return worker.seen_at + worker.dead_after >= now


def host_of(worker_id: str) -> str:
    """The host part of a worker id (``host:pid:start:nonce``)."""
    return worker_id.split(":", 1)[0]


def worker_from_row(row: Sequence[Any]) -> WorkerRow:
    """Decode a ``workers`` row selected with ``WORKER_COLUMNS``."""
    worker_id, queues, concurrency, started_at, seen_at, running, dead_after, session = row
    names = json.loads(queues)
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"queues_json is not a list of names: {queues!r}")
    for what, value in (("concurrency", concurrency), ("running", running)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{what} is not a count: {value!r}")
    for what, value in (
        ("started_at", started_at),
        ("seen_at", seen_at),
        ("dead_after", dead_after),
    ):
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise ValueError(f"{what} is not a time: {value!r}")
    return WorkerRow(
        worker_id=worker_id, queues=tuple(names), concurrency=concurrency,
        started_at=started_at, seen_at=seen_at, running=running, dead_after=float(dead_after),
        session=None if session is None else str(session),
    )  # fmt: skip


def check_worker(worker: WorkerRow) -> None:
    """Refuse names no store can keep in ``worker`` (``ValueError`` naming the field)."""
    check_name("worker_id", worker.worker_id)
    for name in worker.queues:
        check_name("queue", name)


def stats_of(
    names: Iterable[str],
    declared: dict[str, Queue],
    runs: Iterable[RunRecord],
    workers: Iterable[WorkerRow],
    now: float,
    window: float,
    paused: Collection[str] = (),
) -> list[QueueStats]:
    """Per-queue counts for ``queue_stats`` from plain records (the memory store's way)."""
    runs, workers = list(runs), list(workers)
    out: list[QueueStats] = []
    for name in sorted(set(names) | declared.keys()):
        mine = [r for r in runs if r.queue_name == name]
        queued = [r for r in mine if r.status is RunStatus.QUEUED]
        out.append(
            QueueStats(
                name=name,
                queue=declared.get(name),
                queued=len(queued),
                running=sum(r.status is RunStatus.RUNNING for r in mine),
                suspended=sum(r.status is RunStatus.SUSPENDED for r in mine),
                started=sum(
                    r.started_at is not None and now - window < r.started_at <= now for r in mine
                ),
                window=window,
                workers=sum(name in w.queues and w.seen_at > now - window for w in workers),
                oldest_queued_at=min((r.queued_at or 0.0 for r in queued), default=None),
                paused=name in paused,
            )
        )
    return out


def stats_from_counts(
    counts: Iterable[Sequence[Any]],
    declared: Iterable[Queue],
    workers: Iterable[WorkerRow],
    now: float,
    window: float,
    paused: Collection[str] = (),
) -> list[QueueStats]:
    """``queue_stats`` from ``QUEUE_COUNTS`` rows (the SQL stores' way): every queue with runs or declared."""
    by_name = {q.name: q for q in declared}
    rows = {str(r[0]): r for r in counts}
    live = [w for w in workers if w.seen_at > now - window]
    out: list[QueueStats] = []
    for name in sorted(rows.keys() | by_name.keys()):
        _, queued, running, suspended, started, oldest = rows.get(name) or (name, 0, 0, 0, 0, None)
        out.append(
            QueueStats(
                name=name, queue=by_name.get(name), queued=int(queued or 0),
                running=int(running or 0), suspended=int(suspended or 0),
                started=int(started or 0), window=window,
                workers=sum(name in w.queues for w in live),
                oldest_queued_at=None if oldest is None else float(oldest),
                paused=name in paused,
            )
        )  # fmt: skip
    return out


def run_count_order(c: RunCount) -> tuple[str, bool, str, str]:
    """How run counts are listed: by graph, runs of no queue first, then queue and status."""
    return (c.graph_name, c.queue_name is not None, c.queue_name or "", c.status.value)
