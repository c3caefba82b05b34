"""Leases of a run, held and let go of safely (D6): take-over of dead owners,
cleanup that cancellation cannot cut short, and a daemon's last word on a run.

Used by the persister (each run's lease), the workers (cancel requests) and the
engine (``Engine.fail_run``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING

from .._codec import DEFAULT_CODEC
from .._errors import LeaseHeld, LeaseLost, StoreError
from .._events import EventType
from ..stores import EventRow, Harvest, QuestionStatus, RunStatus, RunStore
from ._owner import owner_is_dead

if TYPE_CHECKING:
    from ._engine import Engine

logger = logging.getLogger("tailrace.persist")


async def acquire_lease(store: RunStore, run_id: str, owner: str, ttl: float) -> int:
    """Lease ``run_id`` for ``owner`` (D6); a lease whose owner provably died is taken over at once.

    The owner is dead when it ran on this host and its process is gone (or
    its pid now belongs to another process): there is no point waiting for
    its lease to expire.
    """
    try:
        return await store.acquire_lease(run_id, owner, ttl)
    except LeaseHeld as exc:
        holder = getattr(exc, "owner", None)
        if not owner_is_dead(holder):
            raise
        logger.info("run %s: its lease owner %s is gone; taking over", run_id, holder)
        return await store.acquire_lease(run_id, owner, ttl, steal_from=holder)


async def release_quietly(store: RunStore, run_id: str, owner: str, token: int) -> None:
    """Release a lease on the way out; a failure is logged (the lease then expires by itself)."""
    try:
        await store.release_lease(run_id, owner, token)
    except (StoreError, LeaseLost) as exc:
        logger.warning(
            "run %s: could not release its lease (%s); it expires by itself", run_id, exc
        )


async def run_to_end(cleanup: Awaitable[None]) -> None:
    """Await ``cleanup`` to its end even if the caller is cancelled meanwhile.

    The cancellation is not swallowed: it is re-raised once the cleanup is done.
    """
    task = asyncio.ensure_future(cleanup)
    cancelled = False
    while True:
        try:
            await asyncio.shield(task)
            break
        except asyncio.CancelledError:
            if task.done():
                raise  # the cleanup itself was cancelled
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError


async def mark_failed(engine: Engine, run_id: str, reason: str) -> None:
    """Record run ``run_id`` as failed with ``reason``, without its graph (a daemon's last word).

    For a run that cannot be resumed (its graph does not load, its rows do not
    decode): takes the lease, supersedes its open questions, writes the status
    and a ``run_failed`` event, and releases.
    """
    store = engine.store
    assert store is not None
    record = await store.get_run(run_id)
    if record.status in (RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED):
        return
    token = await acquire_lease(store, run_id, engine.owner, engine.lease_ttl)
    try:
        open_ids = [
            q.question_id
            for q in await store.list_questions(run_id=run_id)
            if q.status in (QuestionStatus.OPEN, QuestionStatus.ANSWERED)
        ]
        events = await store.events(run_id)
        seq = max((e.seq for e in events), default=0) + 1
        now = time.time()
        event = EventRow(
            seq=seq,
            type=EventType.RUN_FAILED.value,
            node_id=None,
            visit=None,
            attempt=None,
            ts=now,
            data_json=DEFAULT_CODEC.encode({"error": reason}),
        )
        harvest = Harvest(
            state_json=record.state_json,
            status=RunStatus.FAILED,
            error=reason,
            nodes=[],
            results=[],
            frozen=[],
            events=[event],
            nodes_done_delta=0,
            superseded=open_ids,
            finished_at=now,
        )
        await store.commit(run_id, token, harvest)
    finally:
        await run_to_end(release_quietly(store, run_id, engine.owner, token))
