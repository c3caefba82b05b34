"""Cancelling runs: ``Engine.cancel`` and the worker's side of it.

A queued run is cancelled by the store in one compare-and-set. A running run
gets a cancel request in the store; the engine driving it ends it at its next
harvest (``RunLoop.request_cancel``): this engine's at once, another
process's worker when the ``cancel`` wake-up (or its next poll) reaches it.
A run nobody drives, suspended on a gate or orphaned by a dead owner, is
cancelled right here under its lease: open questions superseded, a
``run_cancelled`` event, status ``cancelled``, in one commit.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from .._codec import DEFAULT_CODEC
from .._errors import LeaseHeld
from .._events import EventType
from ..stores import EventRow, Harvest, QuestionStatus, RunRecord, RunStatus
from ._lease import acquire_lease, release_quietly, run_to_end
from ._owner import owner_is_dead

if TYPE_CHECKING:
    from ._engine import Engine

logger = logging.getLogger("tailrace.workers")


async def cancel_run(engine: Engine, run_id: str) -> str:
    """``Engine.cancel``: cancel ``run_id`` now or at its next harvest; return its status now."""
    store = engine.store
    if store is None:
        raise ValueError("cancel needs an engine with a store: Engine(store=...)")
    status = await store.request_cancel(run_id)
    if status is RunStatus.RUNNING and engine.request_cancel(run_id):
        return status.value  # ours: it ends at its next harvest
    if status in (RunStatus.RUNNING, RunStatus.SUSPENDED):
        record = await store.get_run(run_id)
        if not _driven(record, time.time()):
            try:
                return (await cancel_undriven(engine, run_id)).value
            except LeaseHeld:
                pass  # someone took it meanwhile: it sees the request
    return (await store.get_run(run_id)).status.value


def _driven(record: RunRecord, now: float) -> bool:
    """Whether a live owner holds ``record``'s lease (so it is theirs to end)."""
    return (
        record.lease_owner is not None
        and record.lease_expires is not None
        and record.lease_expires >= now
        and not owner_is_dead(record.lease_owner)
    )


async def cancel_undriven(engine: Engine, run_id: str) -> RunStatus:
    """End ``run_id``, which nobody drives, as ``cancelled`` under its lease; return its status.

    Takes the lease (at once from a provably dead owner), supersedes open and
    answered questions, and commits a ``run_cancelled`` event with the status.
    A run that finished meanwhile is left as it is. :class:`LeaseHeld` if a
    live owner holds it.
    """
    store = engine.store
    assert store is not None
    token = await acquire_lease(store, run_id, engine.owner, engine.lease_ttl)
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
            q.question_id
            for q in questions
            if q.status in (QuestionStatus.OPEN, QuestionStatus.ANSWERED)
            or (q.status is QuestionStatus.EXPIRED and q.applied_at is None)
        ]
        harvest = Harvest(
            state_json=record.state_json, status=RunStatus.CANCELLED, events=[event],
            superseded=open_ids, finished_at=now,
        )  # fmt: skip
        await store.commit(run_id, token, harvest)
        logger.info("run %s cancelled (nobody was driving it)", run_id)
        return RunStatus.CANCELLED
    finally:
        await run_to_end(release_quietly(store, run_id, engine.owner, token))
