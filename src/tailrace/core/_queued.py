"""Queued runs over a store: ``Engine.submit``, ``Engine.wait`` and ``Engine.cancel`` (W1, W5).

Submitting stores the run ``queued`` with its input already encoded (D5: a
bad input fails here, not in a worker) and the graph's reference, so any
worker that can load the graph runs it. For ``lpt`` queues the run carries an
estimate of its duration: the caller's, or the
:class:`~tailrace.tail.DurationEstimator` fitted on the graph's completed
queued runs (``seconds ~ b + m * cost``), refreshed from the store every
:data:`REFRESH` seconds.

Waiting rebuilds the result from the store, whichever process ran the run:
with the run's graph (this engine ran, submitted or was given it, or its
module reference imports), from the node rows exactly as a resume would see
them, ``output`` included; without it, from the result rows (``output`` is
then None). The waiter sleeps on the store's change feed (a run that ends
releases its lease, which wakes it), re-checking at most every
:data:`RECHECK` seconds and at least every second.

Cancelling a queued run is one compare-and-set in the store. A running run
gets a cancel request in the store; the engine driving it ends it at its next
harvest (``RunLoop.request_cancel``): this engine's at once, another
process's worker when the ``cancel`` wake-up (or its next poll) reaches it.
A run nobody drives, suspended on a gate or orphaned by a dead owner, is
cancelled right here under its lease: open questions superseded, a
``run_cancelled`` event, status ``cancelled``, in one commit.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import json
import logging
import math
import time
import uuid
import weakref
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from .._codec import DEFAULT_CODEC, Codec
from .._errors import (
    DuplicateRun,
    EncodeError,
    GraphError,
    LeaseHeld,
    NotResumable,
    RunFailed,
    TailraceError,
)
from .._events import EventType
from .._lineage import own_run_id
from ..graph import Graph, guess_reference, shape_json
from ..stores import (
    TERMINAL_STATUSES,
    EventRow,
    Harvest,
    NewRun,
    QuestionRow,
    QuestionStatus,
    RunRecord,
    RunStatus,
    RunStore,
    StoredRun,
    Submission,
)
from ..tail import DurationEstimator
from ._children import ChildClaims, ChildSubmit, cancel_children, tree_questions
from ._lease import acquire_lease, owner_is_dead, release_quietly, run_to_end
from ._outcome import NodeReport, RunResult
from ._restore import find_graph, restore_run
from ._state import NodeStatus

logger = logging.getLogger("tailrace.workers")


@dataclass(frozen=True, slots=True, kw_only=True)
class Queueing:
    """What queued-run code needs from the engine it serves: values and callbacks.

    ``store`` holds the runs; ``codec`` encodes inputs and decodes results;
    ``owner`` and ``lease_ttl`` are the engine's lease settings (D6).
    """

    store: RunStore
    codec: Codec
    owner: str
    lease_ttl: float
    #: known(record): the graph the engine ran, submitted or was given for a stored run.
    known: Callable[[RunRecord], Graph | None]
    #: register(graph): let the engine drive runs of ``graph`` (and of its child graphs).
    register: Callable[[Graph], None]
    #: guard(run_id): held while the engine ends a run; LeaseHeld if it drives it already.
    guard: Callable[[str], AbstractContextManager[None]]
    #: request_cancel(run_id): the engine's loop of the run ends it; False if it drives none.
    request_cancel: Callable[[str], bool]
    #: cancel(run_id): cancel a run and its child runs (R3).
    cancel: Callable[[str], Awaitable[str]]


def store_needed(store: RunStore | None, what: str) -> RunStore:
    """``store``, or a ValueError saying that ``what`` needs an engine with one."""
    if store is None:
        raise ValueError(f"{what} needs an engine with a store: Engine(store=...)")
    return store


#: Seconds an estimator fitted from the store is reused before it is fitted again.
REFRESH = 30.0
#: How many completed runs an estimator is fitted on.
HISTORY = 200


class RunEstimates:
    """Duration estimators per graph fingerprint, fitted from one store's completed runs."""

    def __init__(self, store: RunStore) -> None:
        self.store = store
        self._fitted: dict[str, tuple[float, DurationEstimator]] = {}

    async def estimate(self, fingerprint: str, cost: float | None) -> float:
        """Expected seconds of a run of ``fingerprint`` with ``cost`` (0 with no history)."""
        fitted = self._fitted.get(fingerprint)
        if fitted is None or time.monotonic() - fitted[0] > REFRESH:
            estimator = DurationEstimator(prior=0.0)
            for seen_cost, seconds in reversed(
                await self.store.run_durations(fingerprint, limit=HISTORY)
            ):
                # A row written by an older tailrace or by hand may hold a cost
                # that is no number: it is skipped, never fitted (nor raised on).
                if _finite(seen_cost) and _finite(seconds):
                    estimator.observe(float(seen_cost), max(float(seconds), 0.0))
            fitted = self._fitted[fingerprint] = (time.monotonic(), estimator)
        return fitted[1].estimate(cost or 0.0)


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


#: The longest queue name, partition or dedup key a run may carry (every store indexes them).
MAX_KEY_CHARS = 200
#: Priorities are stored as 32-bit integers on every backend.
PRIORITY_RANGE = (-(2**31), 2**31 - 1)


def _checked_key(name: str, value: Any, *, optional: bool) -> str | None:
    """``value`` if it is a key every store takes (text, 1..200 characters, no NUL or lone
    surrogate); else a ValueError naming the option ``name`` and what it accepts."""
    if value is None and optional:
        return None
    accepted = f"a non-empty string of at most {MAX_KEY_CHARS} characters" + (
        " or None" if optional else ""
    )
    if (
        not isinstance(value, str)
        or not value
        or len(value) > MAX_KEY_CHARS
        or "\x00" in value
        or any(0xD800 <= ord(c) <= 0xDFFF for c in value)
    ):
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        raise ValueError(f"submit: {name} must be {accepted} (no NUL), got {shown}")
    return value


def _checked_number(name: str, value: Any) -> float | None:
    """``value`` (None, or a finite number >= 0) as a float; else a ValueError naming ``name``."""
    if value is None:
        return None
    if not _finite(value) or value < 0:
        raise ValueError(f"submit: {name} must be a finite number >= 0 or None, got {value!r}")
    return float(value)


def checked_time(name: str, value: float | datetime.datetime | None) -> float | None:
    """``value`` (None, seconds since the epoch, or an aware ``datetime``) as epoch seconds;
    else a ValueError naming ``name``."""
    if value is None:
        return None
    if isinstance(value, datetime.datetime):
        if value.tzinfo is None:
            raise ValueError(
                f"submit: {name} must be a timezone-aware datetime (its zone decides the "
                f"instant), got naive {value.isoformat()}"
            )
        return value.timestamp()
    if not _finite(value):
        raise ValueError(
            f"submit: {name} must be seconds since the epoch or a datetime, got {value!r}"
        )
    return float(value)


_ESTIMATES: weakref.WeakKeyDictionary[RunStore, RunEstimates] = weakref.WeakKeyDictionary()


def estimates_of(store: RunStore) -> RunEstimates:
    """The estimators of ``store`` (one set per store object)."""
    found = _ESTIMATES.get(store)
    if found is None:
        found = _ESTIMATES[store] = RunEstimates(store)
    return found


async def submit_run(
    queueing: Queueing,
    graph: Graph | str,
    input: Any,
    *,
    queue: str,
    run_id: str | None,
    priority: int,
    partition: str | None,
    dedup_key: str | None,
    on_duplicate: str,
    cost: float | None,
    estimate: float | None,
    graph_ref: str | None,
    not_before: float | datetime.datetime | None = None,
    deadline: float | None = None,
) -> str:
    """``Engine.submit``: store the run ``queued`` and return its id (or the dedup holder's)."""
    store = queueing.store
    if on_duplicate not in ("return", "raise"):
        raise ValueError(f"on_duplicate must be 'return' or 'raise', got {on_duplicate!r}")
    low, high = PRIORITY_RANGE
    if not isinstance(priority, int) or isinstance(priority, bool) or not low <= priority <= high:
        raise ValueError(
            f"submit: priority must be an integer within {low}..{high}, got {priority!r}"
        )
    _checked_key("queue", queue, optional=False)
    _checked_key("partition", partition, optional=True)
    _checked_key("dedup_key", dedup_key, optional=True)
    # Checked before anything is stored: a bad cost would poison the graph's
    # estimates once its run completes, a bad estimate would sort an lpt queue.
    cost = _checked_number("cost", cost)
    estimate = _checked_number("estimate", estimate)
    delay = checked_time("not_before", not_before)
    name, fingerprint, graph_ref = await _what_to_run(queueing, graph, graph_ref)
    run_id = uuid.uuid4().hex if run_id is None else own_run_id(run_id)
    try:
        input_json = queueing.codec.encode(input)
    except (TypeError, ValueError) as exc:
        raise EncodeError(f"run {run_id!r}: input is not encodable: {exc}") from exc
    if estimate is None:
        estimate = await estimates_of(store).estimate(fingerprint, cost)
    new = NewRun(
        run_id=run_id, graph_name=name, graph_ref=graph_ref, fingerprint=fingerprint,
        input_json=input_json, created_at=store.clock(),
        shape_json=shape_json(graph) if isinstance(graph, Graph) else None,
        deadline=deadline,
    )  # fmt: skip
    submission = Submission(
        queue=queue, priority=priority, partition=partition, dedup_key=dedup_key, cost=cost,
        estimate=estimate, not_before=delay,
    )  # fmt: skip
    stored = await store.submit_run(new, submission)
    if stored != run_id and on_duplicate == "raise":
        assert dedup_key is not None
        raise DuplicateRun(
            f"queue {queue!r}: dedup key {dedup_key!r} is held by live run {stored!r}; "
            f"run {run_id!r} was not submitted",
            run_id=stored, queue=queue, dedup_key=dedup_key,
        )  # fmt: skip
    return stored


async def submit_children(
    queueing: Queueing, children: list[ChildSubmit], lender: ChildClaims | None
) -> list[Exception | None]:
    """Store ``children`` ``queued``, in one write; per child, the error that kept it out.

    A child whose input does not encode is refused alone (``EncodeError``);
    one submitted before is left as it is (R2). A failed write fails them all.
    ``lender``, when given, lends its free slots: the children it can take are
    claimed in the same write and start in this process.
    """
    store, codec = queueing.store, queueing.codec
    errors: list[Exception | None] = []
    rows: list[tuple[NewRun, Submission]] = []
    for child in children:
        try:
            name, fingerprint, graph_ref = await _what_to_run(queueing, child.graph, None)
            input_json = codec.encode(child.input)
        except (TypeError, ValueError) as exc:
            errors.append(EncodeError(f"run {child.run_id!r}: input is not encodable: {exc}"))
            continue
        errors.append(None)
        new = NewRun(
            run_id=child.run_id, graph_name=name, graph_ref=graph_ref, fingerprint=fingerprint,
            input_json=input_json, created_at=0.0, shape_json=shape_json(child.graph),
            parent_run_id=child.parent, deadline=child.deadline,
        )  # fmt: skip
        estimate = await estimates_of(store).estimate(fingerprint, None)
        rows.append(
            (new, Submission(queue=child.queue, priority=child.priority, estimate=estimate))
        )
    if not rows:
        return errors
    now = store.clock()  # queued from the write on, not from the reads before it
    rows = [(dataclasses.replace(new, created_at=now), q) for new, q in rows]
    queues = {q.queue for _, q in rows}
    claim = lender.reserve(next(iter(queues))) if lender is not None and len(queues) == 1 else None
    if claim is None:
        await store.submit_runs(rows)
        return errors
    assert lender is not None
    claimed: list[str] = []
    try:  # the slots this process has free take what they can, in the same write
        _, claimed = await store.submit_and_claim(rows, claim)
    finally:
        lender.settle(claim, claimed)
    return errors


async def _what_to_run(
    queueing: Queueing, graph: Graph | str, graph_ref: str | None
) -> tuple[str, str, str | None]:
    """The name, fingerprint and reference a submitted run of ``graph`` is stored with.

    A :class:`Graph` is compiled (G1) and registered with the engine; a name
    is looked up among the graphs workers registered in the store (the
    newest registration of that name), so a submitter needs no graph code.
    """
    if isinstance(graph, Graph):
        topo = graph.compile()
        queueing.register(graph)
        return graph.name, topo.fingerprint, graph_ref or guess_reference(graph)
    if not isinstance(graph, str) or not graph:
        raise ValueError(f"submit: graph must be a Graph or a graph's name, got {graph!r}")
    registered = await queueing.store.graphs_named(graph)
    if not registered:
        raise GraphError(
            f"submit: no worker registered a graph named {graph!r} in this store; start a "
            "worker that has it (tailrace worker --graphs FILE_OR_MODULE), or pass the Graph"
        )
    newest = registered[0]
    return newest.name, newest.fingerprint, graph_ref or newest.graph_ref


async def reopen_cancelled(store: RunStore, run_id: str, owner: str, ttl: float) -> None:
    """Make the cancelled run ``run_id`` running again for ``owner`` to resume (W5).

    The nodes to run again are those the cancellation stopped: the
    ``node_cancelled`` events of the run's final write, just before its
    ``run_cancelled`` (a straggler cancelled as late, E5, stays cancelled).
    A run that is not cancelled is left to the resume's own checks.
    """
    record = await store.get_run(run_id)
    if record.status is not RunStatus.CANCELLED:
        return
    events = await store.events(run_id)
    if not any(e.type != EventType.RUN_CANCELLED.value for e in events):
        raise NotResumable(
            f"run {run_id!r} was cancelled before it started; nothing to continue (submit it again)"
        )
    await store.reopen_cancelled(run_id, owner, ttl, nodes=stopped_by_cancel(events))


def stopped_by_cancel(events: list[EventRow]) -> list[str]:
    """The nodes the run's cancellation stopped, from its events (see :func:`reopen_cancelled`)."""
    nodes: list[str] = []
    last = max(
        (n for n, e in enumerate(events) if e.type == EventType.RUN_CANCELLED.value), default=None
    )
    if last is None:
        return nodes
    for event in reversed(events[:last]):
        if event.type != EventType.NODE_CANCELLED.value:
            break
        try:
            data = json.loads(event.data_json)
        except ValueError:
            data = {}
        late = isinstance(data, dict) and data.get("reason") == "late"
        if event.node_id is not None and not late and event.node_id not in nodes:
            nodes.append(event.node_id)
    return sorted(nodes)


# -- waiting --------------------------------------------------------------------

#: Seconds between two looks at the run while wake-ups keep coming.
RECHECK = 0.02
#: Seconds between two looks with no wake-up at all (the fallback).
FALLBACK = 1.0


def to_apply(question: QuestionRow) -> bool:
    """Whether ``question`` holds an answer (or an expiry) its run has not applied yet (Q3)."""
    return question.status is QuestionStatus.ANSWERED or (
        question.status is QuestionStatus.EXPIRED and question.applied_at is None
    )


async def settled(store: RunStore, record: RunRecord, now: float) -> bool:
    """Whether ``record`` is where ``wait`` returns: finished, or suspended with nothing to resume it.

    A suspended run someone holds (it is being resumed), one with an answer
    not applied yet (a worker is about to resume it), or one with a child run
    that is not settled (it is queued again when the child ends), is not settled.
    """
    if record.status in (RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED):
        return True
    if record.status is not RunStatus.SUSPENDED:
        return False
    if record.lease_expires is not None and record.lease_expires >= now:
        return False
    if any(to_apply(q) for q in await store.list_questions(run_id=record.run_id)):
        return False
    # A run waiting on child runs is settled only when each live child is, and none it
    # suspended for has ended (it is about to be queued again or resumed) (R4, R5).
    children = await store.list_runs(parent=record.run_id)
    if not children:
        return True
    for child in children:
        if child.status in (RunStatus.QUEUED, RunStatus.RUNNING):
            return False
        if child.status is RunStatus.SUSPENDED and not await settled(store, child, now):
            return False
    awaited = await awaited_children(store, record.run_id)
    return not any(c.status in TERMINAL_STATUSES and c.run_id in awaited for c in children)


async def awaited_children(store: RunStore, run_id: str) -> set[str]:
    """The child runs ``run_id``'s latest suspension waits for (its ``run_suspended`` event)."""
    for event in reversed(await store.events(run_id)):
        if event.type == EventType.RUN_SUSPENDED.value:
            data = DEFAULT_CODEC.decode(event.data_json)
            children = data.get("children") if isinstance(data, dict) else None
            return {str(c) for c in children} if isinstance(children, list) else set()
    return set()


async def wait_for(
    queueing: Queueing,
    run_id: str,
    *,
    timeout: float | None,  # noqa: ASYNC109 (Engine.wait's own argument)
    graph: Graph | None,
) -> RunResult:
    """``Engine.wait``: the run's :class:`RunResult` once :func:`settled`; ``RunFailed`` if it failed."""
    store = queueing.store
    if timeout is not None and (
        not isinstance(timeout, int | float) or isinstance(timeout, bool) or math.isnan(timeout)
    ):
        raise ValueError(f"wait: timeout must be a number of seconds or None, got {timeout!r}")
    deadline = None if timeout is None else time.monotonic() + timeout
    async with store.changes() as feed:
        while True:
            record = await store.get_run(run_id)
            if await settled(store, record, store.clock()):
                return await stored_result(queueing, record, graph)
            left = FALLBACK if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"run {run_id!r} is still {record.status.value} after {timeout:g} s"
                )
            await feed.wait(min(left, FALLBACK))
            await asyncio.sleep(RECHECK)  # let a burst of wake-ups pass: one look for all


async def stored_result(queueing: Queueing, record: RunRecord, graph: Graph | None) -> RunResult:
    """The :class:`RunResult` of ``record`` as stored; raises :class:`RunFailed` for a failed run."""
    store, codec = queueing.store, queueing.codec
    stored = await store.load_run(record.run_id)
    graph = graph or _known_graph(queueing, record)
    if stored.nodes and graph is not None and graph.compile().fingerprint == record.fingerprint:
        result = await _from_state(store, codec, stored, graph)
    else:
        result = await _from_rows(store, codec, stored)
    if record.status is RunStatus.SUSPENDED:
        questions = await tree_questions(store, record.run_id)  # its children's too (R5)
        result = _replace(result, questions=tuple(questions))
    result = _replace(result, parent_run_id=record.parent_run_id)
    if record.status is RunStatus.FAILED:
        raise RunFailed(
            f"run {record.run_id!r} failed: {record.error}",
            run_id=record.run_id, error=record.error, result=result,
        )  # fmt: skip
    return result


def _known_graph(queueing: Queueing, record: RunRecord) -> Graph | None:
    found = queueing.known(record)
    if found is not None:
        return found
    try:
        return find_graph(record)  # a module reference only, never a file
    except TailraceError:
        return None


def _duration(record: RunRecord) -> float:
    start = record.started_at or record.created_at
    return max((record.finished_at or record.updated_at) - start, 0.0)


async def _from_state(store: RunStore, codec: Codec, stored: StoredRun, graph: Graph) -> RunResult:
    """Rebuild the run's state as a resume would (nothing is written), and read the result off it."""
    topo = graph.compile()
    state = (await restore_run(store, codec, topo, stored, [])).state
    ids, nodes = topo.ids, state.nodes
    done = [i for i in topo.sinks if nodes[i].has_result]
    output: Any = (
        nodes[done[0]].result if len(done) == 1 else {ids[i]: nodes[i].result for i in done} or None
    )
    return RunResult(
        run_id=stored.run.run_id,
        status=stored.run.status,
        results={ids[i]: ns.result for i, ns in enumerate(nodes) if ns.has_result},
        visits={ids[i]: ns.visits for i, ns in enumerate(nodes)},
        nodes={
            ids[i]: NodeReport(NodeStatus(stored.nodes[ids[i]].status), ns.visits, ns.attempts, 0.0)
            if ids[i] in stored.nodes
            else NodeReport(ns.status, ns.visits, ns.attempts, 0.0)
            for i, ns in enumerate(nodes)
        },
        duration=_duration(stored.run),
        output=output,
    )


async def _from_rows(store: RunStore, codec: Codec, stored: StoredRun) -> RunResult:
    """Without the graph: each node's latest result row, its visits and status."""
    results: dict[str, Any] = {}
    for row in await store.results(stored.run.run_id):  # by node, then visit
        results[row.node_id] = codec.decode(row.value_json)
    return RunResult(
        run_id=stored.run.run_id,
        status=stored.run.status,
        results=results,
        visits={node_id: row.visits for node_id, row in stored.nodes.items()},
        nodes={
            node_id: NodeReport(NodeStatus(row.status), row.visits, 0, 0.0)
            for node_id, row in stored.nodes.items()
        },
        duration=_duration(stored.run),
    )


def _replace(result: RunResult, **changes: Any) -> RunResult:
    return dataclasses.replace(result, **changes)


# -- cancelling -----------------------------------------------------------------


async def cancel_run(queueing: Queueing, run_id: str) -> str:
    """``Engine.cancel``: cancel ``run_id`` now or at its next harvest; return its status now."""
    store = queueing.store
    status = await store.request_cancel(run_id)
    now: str | None = None
    if status is RunStatus.RUNNING and queueing.request_cancel(run_id):
        now = status.value  # ours: it ends at its next harvest
    else:
        if status in (RunStatus.RUNNING, RunStatus.SUSPENDED):
            record = await store.get_run(run_id)
            if not _driven(record, store.clock()):
                with contextlib.suppress(LeaseHeld):  # someone took it: it sees the request
                    now = (await cancel_undriven(queueing, run_id)).value
        if now is None:
            now = (await store.get_run(run_id)).status.value
    # R3: its child runs too, wherever they are (queued, running or suspended).
    await cancel_children(store, run_id, queueing.cancel)
    return now


def _driven(record: RunRecord, now: float) -> bool:
    """Whether a live owner holds ``record``'s lease (so it is theirs to end)."""
    return (
        record.lease_owner is not None
        and record.lease_expires is not None
        and record.lease_expires >= now
        and not owner_is_dead(record.lease_owner)
    )


async def cancel_undriven(queueing: Queueing, run_id: str) -> RunStatus:
    """End ``run_id``, which nobody drives, as ``cancelled`` under its lease; return its status.

    Takes the lease (at once from a provably dead owner), supersedes open and
    answered questions, and commits a ``run_cancelled`` event with the status.
    A run that finished meanwhile is left as it is. :class:`LeaseHeld` if a
    live owner holds it.
    """
    # One end per run in this engine: a cancel cascading from a parent and the parent's
    # own attempt may both reach a child at once; the second finds it held (LeaseHeld).
    with queueing.guard(run_id):
        return await cancel_unstarted(queueing, run_id)


async def cancel_unstarted(queueing: Queueing, run_id: str) -> RunStatus:
    """:func:`cancel_undriven` for a caller that holds the engine's guard of ``run_id`` already."""
    store = queueing.store
    token = await acquire_lease(store, run_id, queueing.owner, queueing.lease_ttl)
    try:
        record = await store.get_run(run_id)
        if record.status not in (RunStatus.RUNNING, RunStatus.SUSPENDED):
            return record.status
        questions = await store.list_questions(run_id=run_id)
        events = await store.events(run_id)
        now = time.time()
        event = EventRow(
            seq=max((e.seq for e in events), default=0) + 1, type=EventType.RUN_CANCELLED.value,
            node_id=None, visit=None, attempt=None, ts=now,
            data_json=DEFAULT_CODEC.encode({"reason": "cancel requested"}),
        )  # fmt: skip
        open_ids = [
            q.question_id for q in questions if q.status is QuestionStatus.OPEN or to_apply(q)
        ]
        harvest = Harvest(
            state_json=record.state_json, status=RunStatus.CANCELLED, events=[event],
            superseded=open_ids, finished_at=now,
        )  # fmt: skip
        await store.commit(run_id, token, harvest)
        logger.info("run %s cancelled (nobody was driving it)", run_id)
        return RunStatus.CANCELLED
    finally:
        await run_to_end(release_quietly(store, run_id, queueing.owner, token))
