"""Transaction bodies both SQL stores share, written once over a :class:`Tx`.

A body is an ``async`` function of a :class:`Tx`: the statements of one call
of the contract, the checks between them (``_rules``) and what it returns.
A backend holds its connection, dialect and locking, and hands its
transaction to the body as a :class:`Tx`:

- SQLite runs the body on its writer (or a reader) thread with
  :func:`run_now`: its ``Tx`` methods do their work at once and never
  suspend, so the body completes in one step, inside the thread's
  ``BEGIN IMMEDIATE`` (or read) transaction.
- Postgres awaits the body on a pooled connection inside its transaction;
  its ``Tx`` spells the statements with ``%s``, locks the rows it reads with
  :meth:`Tx.lock` (``FOR UPDATE``) and records the transaction's id for its
  lost-``COMMIT`` check.

Statements are written in SQLite's ``?`` style (see ``_statements``).
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Protocol, TypeVar

from ..._errors import RunExists, RunNotFound
from .._artifacts import stale_version
from .._queue_rules import (
    deployed_at,
    join_params,
    paused_names,
    pulse_of,
    queue_not_empty,
    queue_params,
    queue_rows,
    schedule_from_row,
    schedule_params,
    scheduled_run,
    stats_from_counts,
    worker_params,
    worker_rows,
)
from .._records import (
    TERMINAL_STATUSES,
    ArtifactVersion,
    CheckpointRow,
    ChunkRow,
    Claim,
    EventRow,
    FrozenInput,
    GraphRow,
    Harvest,
    ItemRow,
    NewRun,
    NodeRow,
    ParkedRow,
    ParkedStatus,
    Pulse,
    QuestionRow,
    QuestionStatus,
    Queue,
    QueueStats,
    ResultRow,
    RunRecord,
    RunSnapshot,
    RunStatus,
    ScheduleRow,
    StoredRun,
    StreamHead,
    StreamTail,
    Submission,
    WorkerRow,
)
from .._rules import (
    check_commit,
    check_holder,
    check_move,
    check_readable,
    children_left,
    grant_lease,
    is_recovery,
    not_applicable,
    not_open,
    parse_question_status,
    parse_status,
    question_not_found,
)
from ._queues import (
    ADVANCE_SCHEDULE,
    ANY_CANCEL_REQUEST,
    ANY_QUEUED,
    BURY_LEASES,
    CANCEL_QUEUED,
    DEDUP_HOLDER,
    DELETE_QUEUE,
    DELETE_SESSION,
    FIRST_SESSION,
    JOIN_WORKER,
    LAST_SESSION,
    LEFT_BEHIND,
    LIVE_IN_QUEUE,
    NEWEST_OTHER_GRAPH,
    NEXT_NOT_BEFORE,
    NEXT_SESSION,
    PAUSE_QUEUE,
    PREVIOUS_SESSION,
    PULSE_PROBES,
    QUEUE_COUNTS,
    REOPEN_CANCELLED,
    REQUEST_CANCEL,
    REQUEUE_CANCELLED_NODE,
    RETURN_CLAIM,
    SELECT_QUEUES,
    SELECT_SCHEDULE,
    SELECT_WORKERS,
    SESSION_WORKERS,
    UNPAUSE_QUEUE,
    UPSERT_GRAPH,
    UPSERT_QUEUE,
    UPSERT_SCHEDULE,
    UPSERT_WORKER,
)
from ._statements import (
    ANSWER_QUESTION,
    APPLY_QUESTION,
    ARTIFACT_HEAD_VERSION,
    CHILD_ENDED,
    CLAIM_PARKED,
    DROP_PARKED,
    EVENT_COLUMNS,
    INSERT_ARTIFACT,
    INSERT_QUEUED_RUN,
    INSERT_RUN,
    INSERT_SHAPE,
    LAST_CHUNK_SEQ,
    MOVE_RUN,
    OVERDUE_RUNS,
    PRUNE_STREAMS,
    QUESTION_RUN,
    QUESTION_STATE,
    RELEASE_SUSPENDED,
    RUN_COLUMNS,
    SELECT_CHECKPOINTS,
    SELECT_CHUNKS,
    SELECT_FOR_MOVE,
    SELECT_FRONTIERS,
    SELECT_ITEMS,
    SELECT_OPEN_STREAMS,
    SELECT_OUTPUTS,
    SELECT_PARKED,
    SELECT_QUESTION,
    SELECT_SHAPE,
    SELECT_STATUSES,
    SELECT_STREAM_TAILS,
    SET_WAKE_AFTER,
    SUPERSEDE_QUESTION,
    UNCLAIM_PARKED,
    WAKE_SUSPENDED,
    artifact_params,
    chunk_from_row,
    event_from_row,
    new_run_params,
    question_from_row,
    queued_run_params,
    record_from_row,
    shape_params,
)

T = TypeVar("T")
Row = Sequence[Any]
Params = Sequence[object]
#: Graph keys (``name:fingerprint``) a claim takes or skips.
Keys = tuple[str, ...]
Clock = Callable[[], float]

SELECT_RUN = f"SELECT {RUN_COLUMNS} FROM runs WHERE run_id = ?"
RUN_EXISTS = "SELECT 1 FROM runs WHERE run_id = ?"
SELECT_FOR_COMMIT = (
    "SELECT status, format_version, lease_token, cancel_requested_at, parent_run_id "
    "FROM runs WHERE run_id = ?"
)
SELECT_LEASE = "SELECT lease_owner, lease_expires, lease_token FROM runs WHERE run_id = ?"
SELECT_LEASE_STATUS = (
    "SELECT lease_owner, lease_expires, lease_token, status FROM runs WHERE run_id = ?"
)
#: A queued run (a submission, a tick's), unless its id or its dedup key is taken.
INSERT_SCHEDULED_RUN = f"{INSERT_QUEUED_RUN} ON CONFLICT DO NOTHING"
#: A new run, unless its id is taken.
INSERT_NEW_RUN = f"{INSERT_RUN} ON CONFLICT (run_id) DO NOTHING"
#: A new artifact version, unless another commit took its number.
INSERT_NEW_ARTIFACT = f"{INSERT_ARTIFACT} ON CONFLICT DO NOTHING"
RELEASE_LEASE = (
    "UPDATE runs SET lease_owner = NULL, lease_expires = NULL "
    "WHERE run_id = ? AND lease_owner = ? AND lease_token = ?"
)
COUNT_RECOVERY = "UPDATE runs SET recoveries = recoveries + 1 WHERE run_id = ?"
SELECT_STATUS = "SELECT status FROM runs WHERE run_id = ?"
UPDATE_LEASE = (
    "UPDATE runs SET lease_owner = ?, lease_expires = ?, lease_token = ? WHERE run_id = ?"
)
EXTEND_LEASE = "UPDATE runs SET lease_expires = ? WHERE run_id = ?"
SELECT_NODES = "SELECT node_id, status, visits, data_json FROM node_states WHERE run_id = ?"
SELECT_RESULTS = "SELECT node_id, visit, value_json FROM results WHERE run_id = ?"
SELECT_FROZEN = (
    "SELECT node_id, activation, payload_json FROM frozen_inputs WHERE run_id = ? "
    "ORDER BY node_id, activation"
)
SELECT_EVENTS = f"SELECT {EVENT_COLUMNS} FROM events WHERE run_id = ? AND seq > ? ORDER BY seq"


class Tx(Protocol):
    """One transaction of a SQL store, as the shared bodies see it."""

    async def one(self, sql: str, params: Params) -> Row | None:
        """The first row ``sql`` selects (or returns), or None."""

    async def all(self, sql: str, params: Params) -> list[Row]:
        """Every row ``sql`` selects."""

    async def lock(self, sql: str, params: Params) -> Row | None:
        """Like :meth:`one`, the row locked until the transaction ends (a write follows)."""

    async def change(self, sql: str, params: Params) -> bool:
        """Run a compare-and-set ``UPDATE``: whether it changed a row."""

    async def change_returning(self, sql: str, params: Params) -> Row | None:
        """Run an ``UPDATE ... RETURNING``: the row it changed, or None."""

    async def change_all(self, sql: str, params: Params) -> int:
        """Run an ``UPDATE`` of any number of rows: how many it changed."""

    async def write_harvest(self, run_id: str, harvest: Harvest, now: float) -> None:
        """Write ``harvest``'s rows, update the run and signal :func:`harvest_signals`.

        A duplicate row raises ``StoreError``. The wake-ups go with the writes
        (Postgres sends them in the same pipeline: no round trip of their own).
        """

    async def signal(self, kind: str) -> None:
        """Wake watchers with a change of ``kind`` when this transaction commits."""

    async def lock_ring(self) -> None:
        """Hold the ring of store sessions until the transaction ends (W7): joins and burials
        take turns, so a session that joins is always watched (SQLite's ``BEGIN
        IMMEDIATE`` already takes turns; Postgres takes an advisory lock)."""

    async def ring(self, session: str) -> None:
        """Tell store session ``session``, when this transaction commits, that the session it
        watches changed (Postgres addresses it: ``ring:<session>``; SQLite wakes every
        watcher with ``ring``)."""

    async def insert_queued(
        self, runs: Sequence[tuple[NewRun, Submission]], *, wake: bool
    ) -> list[str]:
        """Queue each of ``runs`` not stored yet, with its graph's shape: the ids it stored.

        With ``wake``, signal ``submit`` when it stored any (Postgres sends all
        of it in one pipeline).
        """

    async def claim(self, claim: Claim, graphs: Keys | None, skip: Keys, clock: Clock) -> list[str]:
        """Lease up to ``claim.limit`` runs of ``claim.queue`` within its limits, in claim order
        (W2), of ``graphs`` (any if None) but not of ``skip``.

        The backend's locking makes counting and claiming one step: SQLite's
        ``BEGIN IMMEDIATE``; Postgres's ``SKIP LOCKED`` and an advisory lock
        on a queue whose limits need counting.
        """

    async def lease_answers(
        self, owner: str, ttl: float, limit: int, clock: Callable[[], float]
    ) -> list[str]:
        """Lease suspended runs with a due answer, within their queues' limits: the id of one
        due question per run leased."""


def run_now(body: Coroutine[Any, Any, T]) -> T:
    """Run ``body`` on this thread at once; its ``Tx`` must never suspend (SQLite's does not)."""
    try:
        body.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    body.close()
    raise RuntimeError("a transaction body suspended on a Tx that must not suspend")


def run_not_found(run_id: str) -> RunNotFound:
    return RunNotFound(f"no run {run_id!r} in the store")


async def run_row(tx: Tx, sql: str, run_id: str, *, lock: bool = False) -> Row:
    """The one row ``sql`` selects for ``run_id`` (locked if ``lock``); :class:`RunNotFound` if none."""
    row = await (tx.lock if lock else tx.one)(sql, (run_id,))
    if row is None:
        raise run_not_found(run_id)
    return row


# --- runs ------------------------------------------------------------------------------


async def create_run(tx: Tx, run: NewRun) -> None:
    """Store ``run`` as running, with its graph's shape; :class:`RunExists` if its id is taken."""
    if not await tx.change(INSERT_NEW_RUN, new_run_params(run)):
        raise RunExists(f"run {run.run_id!r} already exists")
    await keep_shapes(tx, [run])


async def keep_shapes(tx: Tx, runs: Sequence[NewRun]) -> None:
    """Keep the graph structure of ``runs``, once per graph version (V1)."""
    shapes: dict[tuple[str, str], tuple[object, ...]] = {}
    for run in runs:
        params = shape_params(run)
        if params is not None:
            shapes.setdefault((run.graph_name, run.fingerprint), params)
    for params in shapes.values():
        await tx.change_all(INSERT_SHAPE, params)


async def submit_run(tx: Tx, run: NewRun, q: Submission) -> str:
    """Queue ``run`` unless a live run holds its dedup key: the id of the run that stands.

    The insert goes first and its conflict tells: on Postgres a dedup holder may
    finish between the insert and the look, so it is tried again (a few times).
    """
    for _ in range(3):
        if await tx.change(INSERT_SCHEDULED_RUN, queued_run_params(run, q)):
            await keep_shapes(tx, [run])
            await tx.signal("submit")
            return run.run_id
        if q.dedup_key is not None:
            holder = await tx.one(DEDUP_HOLDER, (q.queue, q.dedup_key))
            if holder is not None:
                return str(holder[0])
        if await tx.one(RUN_EXISTS, (run.run_id,)) is not None:
            raise RunExists(f"run {run.run_id!r} already exists")
    raise RunExists(f"run {run.run_id!r}: its dedup key {q.dedup_key!r} keeps changing hands")


async def commit_harvest(tx: Tx, run_id: str, token: int, harvest: Harvest, now: float) -> bool:
    """Apply ``harvest`` to run ``run_id`` if ``token`` is current (D1, D6, Q3); may refuse it all.

    A harvest that ends the run lets go of its lease too (see ``RunStore.commit``).
    Returns whether a cancel of the run is requested (read under the row lock, W5).
    """
    row = await tx.lock(SELECT_FOR_COMMIT, (run_id,))
    if row is None:
        raise run_not_found(run_id)
    status, format_version, lease_token, cancel_requested_at, parent = row
    check_commit(
        run_id, current=parse_status(run_id, status), format_version=format_version,
        lease_token=lease_token, token=token, new=harvest.status,
    )  # fmt: skip
    await tx.write_harvest(run_id, harvest, now)
    if harvest.status is RunStatus.SUSPENDED:
        await tx.change(SET_WAKE_AFTER, (harvest.wake_after, run_id))
        if harvest.waiting_on:
            await suspend_on_children(tx, run_id, harvest, now)
    if harvest.status in TERMINAL_STATUSES and parent is not None:
        await child_ended(tx, parent, harvest.status, now)
    if harvest.applied or harvest.superseded:  # most harvests change no question
        await apply_question_changes(tx, run_id, harvest, now)
    if harvest.unclaimed:
        await unclaim_parked(tx, harvest.unclaimed)
    return cancel_requested_at is not None


def harvest_signals(harvest: Harvest) -> tuple[str, ...]:
    """The wake-ups a harvest's own writes send (``Tx.write_harvest``).

    ``release``: a harvest that ends its run let go of the lease in its
    UPDATE; ``stream``: readers in other processes wake on new chunks (S3).
    """
    signals = ("release",) if harvest.status in TERMINAL_STATUSES else ()
    return (*signals, "stream") if harvest.chunks else signals


async def apply_question_changes(tx: Tx, run_id: str, harvest: Harvest, now: float) -> None:
    """Apply, then supersede, the questions of ``harvest`` (inserted already); refuse it all on a lost CAS.

    Each apply is one ``UPDATE ... WHERE`` checked by what it changed, so
    across connections and processes exactly one harvest applies an answer
    (Q3): a racing transaction waits for the row, re-checks the condition and
    finds the answer applied. Ids go in sorted order, so that two harvests
    never wait on each other's rows.
    """
    for question_id in sorted(harvest.applied):
        if not await tx.change(APPLY_QUESTION, (now, question_id)):
            status, applied_at = await question_state(tx, question_id)
            raise not_applicable(question_id, status, applied_at, run_id=run_id)
    for question_id in sorted(harvest.superseded):
        await question_cas(tx, SUPERSEDE_QUESTION, (question_id,), question_id)


#: What ``load_run`` reads, each with the run id as its one value: the run, its nodes,
#: its map items and its checkpoints (a store may send them together: Postgres pipelines).
LOAD_RUN = (SELECT_RUN, SELECT_NODES, SELECT_ITEMS, SELECT_CHECKPOINTS)
#: A run's row and whether it has node, map item or checkpoint rows: a run with none
#: (one a worker just claimed from its queue) is loaded whole by this one statement.
SELECT_BARE_RUN = (
    f"SELECT {RUN_COLUMNS}, "
    "EXISTS (SELECT 1 FROM node_states n WHERE n.run_id = runs.run_id) "
    "OR EXISTS (SELECT 1 FROM map_items i WHERE i.run_id = runs.run_id) "
    "OR EXISTS (SELECT 1 FROM checkpoints c WHERE c.run_id = runs.run_id) "
    "FROM runs WHERE run_id = ?"
)


async def load_run(tx: Tx, run_id: str) -> StoredRun:
    """Run ``run_id`` and its node rows (read in one transaction); ``UnsupportedFormat`` if newer."""
    return stored_run(run_id, [await tx.all(sql, (run_id,)) for sql in LOAD_RUN])


def bare_run(run_id: str, row: Row | None) -> StoredRun | None:
    """The :class:`StoredRun` from a row of :data:`SELECT_BARE_RUN`, or None when the run
    has node rows (then :data:`LOAD_RUN` reads them)."""
    if row is None:
        raise run_not_found(run_id)
    if row[-1]:
        return None
    return stored_run(run_id, [[row[:-1]], [], [], []])


def stored_run(run_id: str, rows: Sequence[Sequence[Row]]) -> StoredRun:
    """The :class:`StoredRun` from the rows of each of :data:`LOAD_RUN`, in its order."""
    runs, node_rows, item_rows, checkpoint_rows = rows
    if not runs:
        raise run_not_found(run_id)
    record = record_from_row(runs[0])
    check_readable(run_id, record.format_version)
    nodes = {
        r[0]: NodeRow(node_id=r[0], status=r[1], visits=r[2], data_json=r[3]) for r in node_rows
    }
    items = [ItemRow(*r) for r in item_rows]
    checkpoints = [CheckpointRow(*r) for r in checkpoint_rows]
    return StoredRun(run=record, nodes=nodes, items=items, checkpoints=checkpoints)


async def get_run(tx: Tx, run_id: str) -> RunRecord:
    return record_from_row(await run_row(tx, SELECT_RUN, run_id))


async def rows_of_run(tx: Tx, run_id: str, sql: str, params: Params) -> list[Row]:
    """Rows of ``sql``, or :class:`RunNotFound` when they are none and the run does not exist."""
    rows = await tx.all(sql, params)
    if not rows:
        await run_row(tx, RUN_EXISTS, run_id)
    return rows


async def results(tx: Tx, run_id: str, node_id: str | None) -> list[ResultRow]:
    sql, params = SELECT_RESULTS, (run_id,) if node_id is None else (run_id, node_id)
    if node_id is not None:
        sql += " AND node_id = ?"
    rows = await rows_of_run(tx, run_id, sql + " ORDER BY node_id, visit", params)
    return [ResultRow(node_id=r[0], visit=r[1], value_json=r[2]) for r in rows]


#: Run ids per query of :func:`rows_for_ids`.
IDS_PER_QUERY = 128


async def rows_for_ids(tx: Tx, sql: str, run_ids: Sequence[str]) -> list[Row]:
    """The rows ``sql`` (``... run_id IN ({ids}) ...``) selects for ``run_ids``, a batch of
    ids per query; a few statement shapes (a batch is padded with its last id)."""
    found: list[Row] = []
    for start in range(0, len(run_ids), IDS_PER_QUERY):
        ids = list(run_ids[start : start + IDS_PER_QUERY])
        width = 1 << (len(ids) - 1).bit_length()
        ids += [ids[-1]] * (width - len(ids))
        found += await tx.all(sql.format(ids=", ".join("?" * width)), ids)
    return found


async def outputs(tx: Tx, run_ids: list[str]) -> dict[str, str]:
    """The stored outputs of the completed runs among ``run_ids`` (R1), by id."""
    return {str(r[0]): str(r[1]) for r in await rows_for_ids(tx, SELECT_OUTPUTS, run_ids)}


async def frozen_inputs(tx: Tx, run_id: str) -> list[FrozenInput]:
    rows = await rows_of_run(tx, run_id, SELECT_FROZEN, (run_id,))
    return [FrozenInput(node_id=r[0], activation=r[1], payload_json=r[2]) for r in rows]


async def events(tx: Tx, run_id: str, after_seq: int) -> list[EventRow]:
    rows = await rows_of_run(tx, run_id, SELECT_EVENTS, (run_id, after_seq))
    return [event_from_row(r) for r in rows]


async def chunks(tx: Tx, run_id: str, after: int, limit: int | None) -> list[ChunkRow]:
    """The stream rows of run ``run_id`` past ``after``, at most ``limit`` (the dialect's
    no-limit value: every one)."""
    rows = await rows_of_run(tx, run_id, SELECT_CHUNKS, (run_id, after, limit))
    return [chunk_from_row(r) for r in rows]


async def snapshot(tx: Tx, run_id: str, no_limit: int | None) -> RunSnapshot:
    """Run ``run_id`` with its results, first-k decisions and stream rows, read in one
    transaction that sees one moment (``RunStore.snapshot``)."""
    return RunSnapshot(
        stored=await load_run(tx, run_id),
        results=await results(tx, run_id, None),
        frozen=await frozen_inputs(tx, run_id),
        chunks=await chunks(tx, run_id, 0, no_limit),
    )


async def stream_tails(tx: Tx, run_id: str, chars: int, limit: int) -> list[StreamTail]:
    """The tail of each of the run's first ``limit`` streams (``RunStore.stream_tails``)."""
    params = (run_id, limit, run_id, run_id, chars)
    streams: dict[int, tuple[list[ChunkRow], int]] = {}
    for row in await rows_of_run(tx, run_id, SELECT_STREAM_TAILS, params):
        chunk = chunk_from_row(row[:-1])
        streams.setdefault(chunk.stream, ([], int(row[-1])))[0].append(chunk)
    return [
        StreamTail(rows=tuple(rows), chunks=chunks)
        for _, (rows, chunks) in sorted(streams.items())  # in the order the streams began
    ]


async def stream_head(tx: Tx, run_id: str) -> StreamHead:
    row = await tx.one(LAST_CHUNK_SEQ, (run_id,))
    last = int(row[0]) if row is not None else 0
    if last == 0:
        await run_row(tx, RUN_EXISTS, run_id)
        return StreamHead()
    open_rows = await tx.all(SELECT_OPEN_STREAMS, (run_id,))
    return StreamHead(last_seq=last, open=tuple(chunk_from_row(r) for r in open_rows))


async def prune_streams(tx: Tx, finished_before: float) -> int:
    row = await tx.one(_COUNT_PRUNED, (finished_before,))
    count = int(row[0]) if row is not None else 0
    if count:
        await tx.change(PRUNE_STREAMS, (finished_before,))
    return count


#: Values: finished_before. How many stream rows :data:`PRUNE_STREAMS` deletes.
_COUNT_PRUNED = "SELECT COUNT(*) " + PRUNE_STREAMS.removeprefix("DELETE ")


async def request_cancel(tx: Tx, run_id: str, now: float) -> RunStatus:
    """Cancel run ``run_id`` if queued, else mark a live one's cancel request; its status now."""
    await tx.change(CANCEL_QUEUED, (now, now, run_id))
    await tx.change(REQUEST_CANCEL, (now, run_id))
    (status,) = await run_row(tx, SELECT_STATUS, run_id)
    await tx.signal("cancel")
    return parse_status(run_id, status)


# --- graph versions (V1-V3) -------------------------------------------------------------


async def move_run(
    tx: Tx,
    run_id: str,
    owner: str,
    token: int,
    *,
    fingerprint: str,
    graph_ref: str | None,
    expected: str,
    now: float,
) -> None:
    """Move run ``run_id`` onto the graph version ``fingerprint`` if ``owner`` holds it with ``token``."""
    status, current, holder, lease_token = await run_row(tx, SELECT_FOR_MOVE, run_id, lock=True)
    check_move(
        run_id, owner, token, status=parse_status(run_id, status), fingerprint=current,
        holder=holder, lease_token=lease_token, expected=expected,
    )  # fmt: skip
    await tx.change(MOVE_RUN, (fingerprint, graph_ref, now, run_id))


async def frontiers(tx: Tx, graph_name: str) -> dict[str, tuple[str, ...]]:
    found: dict[str, list[str]] = {}
    for run_id, node_id in await tx.all(SELECT_FRONTIERS, (graph_name,)):
        found.setdefault(run_id, []).append(node_id)
    return {run_id: tuple(nodes) for run_id, nodes in found.items()}


async def graph_shape(tx: Tx, graph_name: str, fingerprint: str) -> str | None:
    row = await tx.one(SELECT_SHAPE, (graph_name, fingerprint))
    return None if row is None else str(row[0])


# --- the heartbeat (idle cost) ----------------------------------------------------------


async def pulse(tx: Tx, worker: WorkerRow, now: float) -> Pulse:
    """Report ``worker`` and look at what is worth a look, one indexed probe each (``Pulse``)."""
    await tx.change(UPSERT_WORKER, worker_params(worker))
    kinds: set[str] = set()
    for name in worker.queues:
        if await tx.one(ANY_QUEUED, (name,)) is not None:
            kinds.add("submit")
            break
    probes = await tx.one(PULSE_PROBES, (now, now, now))
    answer, orphan, gates, expiry, deadline = probes or (None,) * 5
    if answer is not None:
        kinds.add("answer")
    if orphan is not None:
        kinds.add("release")
    if await tx.one(ANY_CANCEL_REQUEST, (worker.worker_id,)) is not None:
        kinds.add("cancel")
    delayed = [await tx.one(NEXT_NOT_BEFORE, (name, now)) for name in worker.queues]
    due = [expiry, *(row[0] for row in delayed if row is not None)]
    return pulse_of(kinds, gates=gates is not None, now=now, deadline=deadline, due=due)


# --- store sessions: liveness without writes (W7) ----------------------------------------


async def join_session(
    tx: Tx, session: str, workers: Sequence[WorkerRow], now: float, *, again: bool
) -> frozenset[str]:
    """``workers`` join ``session`` (again, after it lapsed): their rows name it, rows left
    behind go, and the session before it in the ring is told to watch it. Returns which of
    ``workers`` had their rows there before (all of them at first): one missing that did
    not leave meanwhile means the fleet buried the session."""
    await tx.lock_ring()
    listed = {w.worker_id for w in workers}
    kept = frozenset(listed)
    if again:
        kept = frozenset(str(r[0]) for r in await tx.all(SESSION_WORKERS, (session,))) & listed
    await tx.change_all(LEFT_BEHIND, (now,))
    for worker in workers:
        await tx.change_all(JOIN_WORKER, join_params(worker, session))
    before = await ring_neighbour_of(tx, session, after=False)
    if before is not None:
        await tx.ring(before)
    return kept


async def bury_session(tx: Tx, session: str) -> int:
    """Session ``session`` is gone: its workers' leases expire (at time 0, for every
    clock), fenced, and their rows go; wake the fleet to adopt. Returns how many runs'
    leases expired."""
    await tx.lock_ring()
    expired = await tx.change_all(BURY_LEASES, (session,))
    await tx.change_all(DELETE_SESSION, (session,))
    if expired:
        await tx.signal("release")
        await tx.signal("answer")  # a suspended run leased for an answer is due again
    return expired


async def ring_neighbour_of(tx: Tx, session: str, *, after: bool) -> str | None:
    """The session after (else before) ``session`` in the ring, wrapping round; None alone."""
    near, far = (NEXT_SESSION, FIRST_SESSION) if after else (PREVIOUS_SESSION, LAST_SESSION)
    row = await tx.one(near, (session,))
    if row is None or row[0] is None:
        row = await tx.one(far, ())
    found = None if row is None or row[0] is None else str(row[0])
    return None if found == session else found


# --- queues (W2) ------------------------------------------------------------------------


async def declare_queue(tx: Tx, queue: Queue, now: float) -> None:
    """Store ``queue``'s limits (keeping its pause); new limits may let more runs start."""
    await tx.change_all(UPSERT_QUEUE, queue_params(queue, now))
    await tx.signal("submit")
    await tx.signal("config")


async def queue_stats(tx: Tx, now: float, window: float) -> list[QueueStats]:
    """Every queue's statistics over the last ``window`` seconds (read as of one moment)."""
    counts = await tx.all(QUEUE_COUNTS, (now - window, now))
    rows = await tx.all(SELECT_QUEUES, ())
    workers = worker_rows(await tx.all(SELECT_WORKERS, ()))
    return stats_from_counts(counts, queue_rows(rows), workers, now, window, paused_names(rows))


async def return_claim(tx: Tx, run_id: str, owner: str, now: float) -> bool:
    """Queue ``run_id`` again if ``owner`` claimed it and it has not started yet."""
    if await tx.change_all(RETURN_CLAIM, (now, run_id, owner)) != 1:
        return False
    await tx.signal("submit")  # queued again: wake the workers
    return True


async def pause_queue(tx: Tx, name: str, now: float) -> None:
    """Pause queue ``name`` (declaring it with the defaults if it never was)."""
    await tx.change(PAUSE_QUEUE, (name, now, now))
    await tx.signal("config")


async def resume_queue(tx: Tx, name: str) -> bool:
    """Lift the pause of queue ``name``; True if it was paused (workers are woken)."""
    lifted = await tx.change(UNPAUSE_QUEUE, (name,))
    if lifted:
        await tx.signal("submit")
        await tx.signal("config")
    return lifted


async def delete_queue(tx: Tx, name: str) -> bool:
    """Drop the declaration of queue ``name`` if it holds no live run; True if there was one."""
    row = await tx.one(LIVE_IN_QUEUE, (name,))
    live = int(row[0]) if row is not None else 0
    if live:
        raise queue_not_empty(name, live)
    deleted = await tx.change(DELETE_QUEUE, (name,))
    if deleted:
        await tx.signal("config")
    return deleted


async def register_graph(tx: Tx, row: GraphRow) -> None:
    """Record that a worker can drive ``row``'s version: a version known already keeps when it
    was deployed (a stale worker restarting changes nothing), a new one is the newest of its name."""
    newest = await tx.one(NEWEST_OTHER_GRAPH, (row.name, row.fingerprint))
    last = None if newest is None or newest[0] is None else float(newest[0])
    at = deployed_at(row.registered_at, last)
    await tx.change_all(UPSERT_GRAPH, (row.name, row.fingerprint, row.graph_ref, at))


async def declare_schedule(tx: Tx, row: ScheduleRow) -> None:
    """Store schedule ``row`` (checked, first tick set), keeping the ticks already submitted."""
    await tx.change(UPSERT_SCHEDULE, schedule_params(row))
    await tx.signal("config")


async def fire_schedule(tx: Tx, name: str, tick: float, store_now: float, now: float) -> str | None:
    """Submit schedule ``name``'s run for ``tick`` unless someone did; its run id, or None.

    ``store_now`` is the store's clock the tick is judged by (``tick_is_due``);
    ``now`` stamps the run.
    """
    row = await tx.one(SELECT_SCHEDULE, (name,))
    if row is None:
        return None
    schedule = schedule_from_row(row)
    if not await tx.change(ADVANCE_SCHEDULE, (tick, name, tick, store_now)):
        return None  # another worker submitted this tick (or a later one)
    run, submission = scheduled_run(schedule, tick, now)
    if not await tx.change(INSERT_SCHEDULED_RUN, queued_run_params(run, submission)):
        return None  # the tick's run exists already (its schedule was declared again)
    await tx.signal("submit")
    return run.run_id


async def reopen_cancelled(
    tx: Tx, run_id: str, owner: str, ttl: float, nodes: Sequence[str], now: float
) -> bool:
    """Run ``run_id`` cancelled -> running, leased to ``owner``, ``nodes`` queued again (W5)."""
    await run_row(tx, SELECT_STATUS, run_id, lock=True)  # RunNotFound if absent
    if not await tx.change(REOPEN_CANCELLED, (owner, now + ttl, now, run_id)):
        return False
    for node_id in nodes:
        await tx.change(REQUEUE_CANCELLED_NODE, (run_id, node_id))
    return True


# --- leases (D6) -------------------------------------------------------------------------


async def take_lease(
    tx: Tx,
    run_id: str,
    owner: str,
    ttl: float,
    steal_from: str | None,
    clock: Callable[[], float],
) -> tuple[int, bool]:
    """Lease run ``run_id`` to ``owner``: ``(token, whether it is a new grant)``, not a renewal of one's own."""
    holder, expires, lease_token, status = await run_row(tx, SELECT_LEASE_STATUS, run_id, lock=True)
    now = clock()
    token = grant_lease(
        run_id, owner, now=now, holder=holder, expires=expires, lease_token=lease_token,
        steal_from=steal_from,
    )  # fmt: skip
    await tx.change(UPDATE_LEASE, (owner, now + ttl, token, run_id))
    if is_recovery(status, holder, owner, new_grant=token != lease_token):
        await tx.change(COUNT_RECOVERY, (run_id,))
    return token, token != lease_token


async def extend_lease(
    tx: Tx, run_id: str, owner: str, token: int, ttl: float, clock: Callable[[], float]
) -> None:
    """Extend ``owner``'s lease on ``run_id`` to ``ttl`` from now; ``LeaseLost`` if ``token`` is stale."""
    holder, _expires, lease_token = await run_row(tx, SELECT_LEASE, run_id, lock=True)
    check_holder(run_id, owner, token, holder=holder, lease_token=lease_token)
    await tx.change(EXTEND_LEASE, (clock() + ttl, run_id))


async def release_lease(tx: Tx, run_id: str, owner: str, token: int) -> None:
    """Let go of ``owner``'s lease on ``run_id`` if ``token`` is still current; wake workers."""
    if await tx.change_all(RELEASE_LEASE, (run_id, owner, token)):
        await tx.signal("release")  # a run finished, suspended or was let go: workers look


#: Values: run id, owner. A claim's lease let go (its caller was cancelled).
RELEASE_CLAIMED = (
    "UPDATE runs SET lease_owner = NULL, lease_expires = NULL WHERE run_id = ? AND lease_owner = ?"
)


async def release_claimed(tx: Tx, run_ids: Sequence[str], owner: str) -> None:
    """Let go of ``owner``'s leases on ``run_ids`` (a claim whose caller was cancelled):
    those runs are adopted at once instead of after their ttl."""
    for run_id in run_ids:
        await tx.change_all(RELEASE_CLAIMED, (run_id, owner))
    await tx.signal("release")


# --- the question ledger (Q2-Q5) -------------------------------------------------------------


async def question_state(tx: Tx, question_id: str) -> tuple[QuestionStatus, Any]:
    """``(status, applied_at)`` of question ``question_id``; :class:`QuestionNotFound` if absent."""
    row = await tx.one(QUESTION_STATE, (question_id,))
    if row is None:
        raise question_not_found(question_id)
    return parse_question_status(question_id, row[0]), row[1]


async def get_question(tx: Tx, question_id: str) -> QuestionRow:
    row = await tx.one(SELECT_QUESTION, (question_id,))
    if row is None:
        raise question_not_found(question_id)
    return question_from_row(row)


async def question_cas(tx: Tx, update: str, values: Params, question_id: str) -> bool:
    """Run a question compare-and-set: True if it changed the row, False if it did not apply."""
    if await tx.change(update, values):
        return True
    await question_state(tx, question_id)  # QuestionNotFound when there is no such question
    return False


async def answer(
    tx: Tx,
    question_id: str,
    answer_json: str,
    by: str | None,
    status: QuestionStatus,
    now: float,
) -> QuestionRow:
    """First answer wins: one ``UPDATE ... WHERE status = 'open'`` (Q2); the new row."""
    row = await tx.change_returning(
        ANSWER_QUESTION, (status.value, answer_json, by, now, question_id)
    )
    if row is None:  # a question never goes back to open: this state is final enough
        state = (await question_state(tx, question_id))[0]
        run = await tx.one(QUESTION_RUN, (question_id,))
        raise not_open(
            question_id, state, None if run is None else (run[0], parse_status(run[0], run[1]))
        )
    await tx.signal("answer")
    return question_from_row(row)


# --- parked items (P3, P4) ----------------------------------------------------------------


async def list_parked(
    tx: Tx,
    graph_name: str | None,
    node_id: str | None,
    status: str | None,
    claimed_by: str | None,
    run_id: str | None = None,
) -> list[ParkedRow]:
    """Parked items matching every filter given, oldest first."""
    where, params = [], []
    for column, value in (
        ("graph_name", graph_name), ("node_id", node_id), ("status", status),
        ("claimed_by", claimed_by), ("run_id", run_id),
    ):  # fmt: skip
        if value is not None:
            where.append(f"{column} = ?")
            params.append(value)
    sql = SELECT_PARKED + (" WHERE " + " AND ".join(where) if where else "")
    rows = await tx.all(sql + " ORDER BY parked_at, park_id", params)
    return [ParkedRow(*r) for r in rows]


async def claim_parked(
    tx: Tx, graph_name: str, node_id: str, claimant: str, limit: int, now: float
) -> list[ParkedRow]:
    """Claim parked items of ``node_id`` for ``claimant`` until it holds ``limit`` (P4); every
    item it holds, oldest first. Claiming again returns the same items: it is idempotent."""
    held = await list_parked(tx, None, None, ParkedStatus.CLAIMED, claimant)
    if len(held) < limit:
        await tx.change_all(CLAIM_PARKED, (graph_name, node_id, limit - len(held), claimant, now))
    return await list_parked(tx, None, None, None, claimant)


async def unclaim_parked(tx: Tx, pairs: Sequence[tuple[str, str]]) -> int:
    """Return each ``(claimant, park_id)`` still claimed by its claimant to ``parked`` (P4);
    how many went back."""
    back = 0
    for claimant, park_id in pairs:
        back += await tx.change(UNCLAIM_PARKED, (park_id, claimant))
    return back


async def suspend_on_children(tx: Tx, run_id: str, harvest: Harvest, now: float) -> None:
    """Run ``run_id`` suspends waiting on ``harvest.waiting_on`` (R4), under its row lock.

    It lets go of its lease here, so a child ending from now on finds it free
    to wake, whether or not its process lives on. A child that ended before
    found it running and woke nothing: those ends are counted now, and when
    they are enough (or one failed) the run is queued again at once.
    """
    await tx.change_all(RELEASE_SUSPENDED, (run_id,))
    await tx.signal("release")
    rows = await rows_for_ids(tx, SELECT_STATUSES, sorted(set(harvest.waiting_on)))
    statuses = [parse_status(str(child), str(status)) for child, status in rows]
    ended = [status for status in statuses if status in TERMINAL_STATUSES]
    if not ended:
        return
    left = children_left(harvest.wake_after, ended)
    if left is None:
        await wake_suspended(tx, run_id, now)
    else:
        await tx.change(SET_WAKE_AFTER, (left, run_id))


async def child_ended(tx: Tx, parent: str, status: RunStatus, now: float) -> None:
    """A child of ``parent`` ended with ``status`` (R4): a completion counts down what the
    suspended parent waits for; the last one, a failure or a cancel wakes it.

    One UPDATE locks the parent's row and counts down. It matches the row
    whatever its status, so on Postgres it waits for a suspension committing
    on it at this moment (which read this child as still running) and then
    computes the count on the suspended row. An UPDATE that named the status
    in its WHERE would test the last committed row (still running), match
    nothing and not wait, and nobody would count this end.
    """
    row = await tx.change_returning(CHILD_ENDED, (status is RunStatus.COMPLETED, parent))
    if row is None or row[0] != RunStatus.SUSPENDED.value:
        return  # a running parent counts the children that ended when it suspends
    left = row[1]
    if status is RunStatus.COMPLETED and left is not None and left >= 1:
        return  # counted down: more completions to wait for
    await wake_suspended(tx, parent, now)


async def wake_suspended(tx: Tx, run_id: str, now: float) -> bool:
    """Queue ``run_id`` again if it is suspended, on a queue and nobody holds it (``can_wake``,
    R4); wake workers."""
    if not await tx.change(WAKE_SUSPENDED, (now, run_id, now)):
        return False
    await tx.signal("submit")
    return True


async def overdue_runs(tx: Tx, now: float, limit: int) -> list[str]:
    """Queued and suspended runs past their deadline (R6), soonest deadline first."""
    return [r[0] for r in await tx.all(OVERDUE_RUNS, (now, limit))]


async def drop_parked(tx: Tx, park_id: str) -> bool:
    """Drop parked item ``park_id`` if it is still parked: whether it was."""
    return await tx.change(DROP_PARKED, (park_id,))


# --- the evolve ledger -------------------------------------------------------------------


async def commit_artifact(tx: Tx, version: ArtifactVersion) -> ArtifactVersion:
    """Store ``version`` if the head is the one before it; :class:`StaleVersion` otherwise.

    Of racing commits the primary key lets one insert through; the others
    read the winner's head.
    """
    artifact_id, expected = version.artifact_id, version.version - 1
    head = await artifact_head_version(tx, artifact_id)
    if head == expected:
        if await tx.change(INSERT_NEW_ARTIFACT, artifact_params(version)):
            return version
        head = await artifact_head_version(tx, artifact_id)  # the winner's
    raise stale_version(artifact_id, expected, head)


async def artifact_head_version(tx: Tx, artifact_id: str) -> int:
    """The head version of ``artifact_id``, 0 when it has none."""
    row = await tx.one(ARTIFACT_HEAD_VERSION, (artifact_id,))
    return int(row[0]) if row is not None else 0
