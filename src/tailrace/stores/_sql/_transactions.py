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

from ..._errors import RunNotFound
from .._records import (
    ChunkRow,
    EventRow,
    FrozenInput,
    Harvest,
    ItemRow,
    NodeRow,
    QuestionRow,
    QuestionStatus,
    ResultRow,
    RunRecord,
    RunStatus,
    StoredRun,
    StreamHead,
)
from .._rules import (
    check_commit,
    check_holder,
    check_move,
    check_readable,
    grant_lease,
    not_applicable,
    not_open,
    parse_question_status,
    parse_status,
    question_not_found,
)
from ._queues import CANCEL_QUEUED, REQUEST_CANCEL
from ._statements import (
    ANSWER_QUESTION,
    APPLY_QUESTION,
    EVENT_COLUMNS,
    LAST_CHUNK_SEQ,
    MOVE_RUN,
    PRUNE_STREAMS,
    QUESTION_STATE,
    RUN_COLUMNS,
    SELECT_CHUNKS,
    SELECT_FOR_MOVE,
    SELECT_FRONTIERS,
    SELECT_ITEMS,
    SELECT_OPEN_STREAMS,
    SELECT_QUESTION,
    SELECT_SHAPE,
    SUPERSEDE_QUESTION,
    chunk_from_row,
    event_from_row,
    question_from_row,
    record_from_row,
)

T = TypeVar("T")
Row = Sequence[Any]
Params = Sequence[object]

SELECT_RUN = f"SELECT {RUN_COLUMNS} FROM runs WHERE run_id = ?"
RUN_EXISTS = "SELECT 1 FROM runs WHERE run_id = ?"
SELECT_FOR_COMMIT = (
    "SELECT status, format_version, lease_token, cancel_requested_at FROM runs WHERE run_id = ?"
)
SELECT_LEASE = "SELECT lease_owner, lease_expires, lease_token FROM runs WHERE run_id = ?"
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

    async def write_harvest(self, run_id: str, harvest: Harvest, now: float) -> None:
        """Write ``harvest``'s rows and update the run (a duplicate row: ``StoreError``)."""

    async def signal(self, kind: str) -> None:
        """Wake watchers with a change of ``kind`` when this transaction commits."""


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


async def commit_harvest(tx: Tx, run_id: str, token: int, harvest: Harvest, now: float) -> bool:
    """Apply ``harvest`` to run ``run_id`` if ``token`` is current (D1, D6, Q3); may refuse it all.

    Returns whether a cancel of the run is requested (read under the row lock, W5).
    """
    row = await tx.lock(SELECT_FOR_COMMIT, (run_id,))
    if row is None:
        raise run_not_found(run_id)
    status, format_version, lease_token, cancel_requested_at = row
    check_commit(
        run_id, current=parse_status(run_id, status), format_version=format_version,
        lease_token=lease_token, token=token, new=harvest.status,
    )  # fmt: skip
    await tx.write_harvest(run_id, harvest, now)
    if harvest.chunks:  # readers in other processes wake on it (S3)
        await tx.signal("stream")
    if harvest.applied or harvest.superseded:  # most harvests change no question
        await apply_question_changes(tx, run_id, harvest, now)
    return cancel_requested_at is not None


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


async def load_run(tx: Tx, run_id: str) -> StoredRun:
    """Run ``run_id`` and its node rows (read in one transaction); ``UnsupportedFormat`` if newer."""
    record = record_from_row(await run_row(tx, SELECT_RUN, run_id))
    check_readable(run_id, record.format_version)
    rows = await tx.all(SELECT_NODES, (run_id,))
    nodes = {r[0]: NodeRow(node_id=r[0], status=r[1], visits=r[2], data_json=r[3]) for r in rows}
    items = [ItemRow(*r) for r in await tx.all(SELECT_ITEMS, (run_id,))]
    return StoredRun(run=record, nodes=nodes, items=items)


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


async def frozen_inputs(tx: Tx, run_id: str) -> list[FrozenInput]:
    rows = await rows_of_run(tx, run_id, SELECT_FROZEN, (run_id,))
    return [FrozenInput(node_id=r[0], activation=r[1], payload_json=r[2]) for r in rows]


async def events(tx: Tx, run_id: str, after_seq: int) -> list[EventRow]:
    rows = await rows_of_run(tx, run_id, SELECT_EVENTS, (run_id, after_seq))
    return [event_from_row(r) for r in rows]


async def chunks(tx: Tx, run_id: str, after: int, limit: int) -> list[ChunkRow]:
    rows = await rows_of_run(tx, run_id, SELECT_CHUNKS, (run_id, after, limit))
    return [chunk_from_row(r) for r in rows]


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
    holder, expires, lease_token = await run_row(tx, SELECT_LEASE, run_id, lock=True)
    now = clock()
    token = grant_lease(
        run_id, owner, now=now, holder=holder, expires=expires, lease_token=lease_token,
        steal_from=steal_from,
    )  # fmt: skip
    await tx.change(UPDATE_LEASE, (owner, now + ttl, token, run_id))
    return token, token != lease_token


async def extend_lease(
    tx: Tx, run_id: str, owner: str, token: int, ttl: float, clock: Callable[[], float]
) -> None:
    """Extend ``owner``'s lease on ``run_id`` to ``ttl`` from now; ``LeaseLost`` if ``token`` is stale."""
    holder, _expires, lease_token = await run_row(tx, SELECT_LEASE, run_id, lock=True)
    check_holder(run_id, owner, token, holder=holder, lease_token=lease_token)
    await tx.change(EXTEND_LEASE, (clock() + ttl, run_id))


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
        raise not_open(question_id, (await question_state(tx, question_id))[0])
    await tx.signal("answer")
    return question_from_row(row)
