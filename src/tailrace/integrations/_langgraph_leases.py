"""The run leases a LangGraph driver's graph steps run under (D6).

A step runs under the thread's run lease, so no second driver (thread,
process) works on the thread at once, and under a per-driver lock, so the
driver's own coroutines never share a lease. The lease is renewed while the
step runs, so nobody takes the thread over mid-step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass

from .._errors import LeaseHeld, LeaseLost
from ..core import acquire_lease
from ..stores import RunStore

logger = logging.getLogger("tailrace.integrations.langgraph")


@dataclass(frozen=True, slots=True)
class Lease:
    """The run lease a graph step runs under; ``own`` when the driver took it (and releases it)."""

    owner: str
    token: int
    own: bool


class ThreadLeases:
    """Leases on threads for one driver: ``owner`` in ``store``, lasting ``ttl`` seconds."""

    def __init__(self, store: RunStore, owner: str, ttl: float) -> None:
        self.store = store
        self.owner = owner
        self.ttl = ttl
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()

    @contextlib.asynccontextmanager
    async def own(self, thread_id: str) -> AsyncIterator[Lease]:
        """Hold ``thread_id``'s lock and a lease of our own; :class:`~tailrace.LeaseHeld` if someone else has it."""
        async with self._lock(thread_id):
            # A lease whose owner provably died on this host is taken over at once (D6).
            token = await acquire_lease(self.store, thread_id, self.owner, self.ttl)
            try:
                yield Lease(self.owner, token, own=True)
            finally:
                await self.store.release_lease(thread_id, self.owner, token)

    @contextlib.asynccontextmanager
    async def for_step(self, thread_id: str) -> AsyncIterator[Lease]:
        """Hold ``thread_id``'s lock and the caller's live lease (a worker's), else one of our own."""
        async with self._lock(thread_id):
            lease = await self._take_or_adopt(thread_id)
            try:
                yield lease
            finally:
                if lease.own:
                    await self.store.release_lease(thread_id, lease.owner, lease.token)

    async def keep_alive(self, thread_id: str, lease: Lease) -> None:
        """Renew ``lease`` until cancelled, so nobody takes the thread over mid-step."""
        while True:
            await asyncio.sleep(self.ttl / 3)
            try:
                await self.store.heartbeat(thread_id, lease.owner, lease.token, self.ttl)
            except LeaseLost:
                logger.warning("thread %s: lease lost while its graph step ran", thread_id)
                return
            except Exception:  # a store hiccup: the next renewal may succeed
                logger.exception("thread %s: renewing the lease failed", thread_id)

    def _lock(self, thread_id: str) -> asyncio.Lock:
        lock = self._locks.get(thread_id)
        if lock is None:
            lock = self._locks[thread_id] = asyncio.Lock()
        return lock

    async def _take_or_adopt(self, thread_id: str) -> Lease:
        for _ in range(3):
            try:
                token = await acquire_lease(self.store, thread_id, self.owner, self.ttl)
                return Lease(self.owner, token, own=True)
            except LeaseHeld:
                record = await self.store.get_run(thread_id)
            if record.lease_owner is not None:
                # A step runs under its caller's lease: write with that token, so a
                # takeover of the caller's lease fences our writes too (D6).
                return Lease(record.lease_owner, record.lease_token, own=False)
            # released meanwhile: try to take it
        raise LeaseHeld(f"thread {thread_id!r}: its lease keeps changing hands")
