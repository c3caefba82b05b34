"""Store sessions: a worker is alive while its store session is, and the fleet sees it die (W7).

Every store object that has a worker present holds one *session* (an id of
its own, ``host:pid:nonce``) and a *token* for it that its database or its
host gives up by itself when the process dies: on Postgres, a session-level
advisory lock held by a connection of its own (the server drops it when the
connection ends, and a SIGKILLed process's sockets are closed by the
kernel); on SQLite, a lock file held with ``flock`` (the kernel drops it with
the process). Holding a token costs no write and no read.

The sessions form a ring in the order of their ids (the ``session`` column
of ``workers``), and each watches the next one: it waits until that
session's token is free (Postgres: a blocking ``pg_advisory_lock_shared``,
which the server grants the moment the holder's connection ends; SQLite: the
lock file probed every :data:`PROBE` seconds, a local system call), then
*buries* it while holding its token: in one transaction, the leases of the
runs its workers hold expire at once with a new fencing token (D6: their
writes are refused from then on) and its rows go; the ``release`` wake-up
sends the fleet to adopt the runs. Then it watches the next one. So a
dead worker's runs are adopted in a few milliseconds of its death, and an
idle fleet watches itself without a single transaction.

Joining the ring tells the session before the newcomer to watch the
newcomer instead (``ring:<session>``: a Postgres notification addressed to
it; on SQLite every watcher looks again, one local read); joins and burials
take turns (``Tx.lock_ring``), so a session that joins is always watched. A
watcher also looks at the ring again every :data:`RING_REREAD` seconds,
whatever it was told; a wait that lasted :data:`WAIT` seconds is made again
(on Postgres, an aborted statement: no commit). On Postgres, a token found
free at once (not freed while watched: a session that died unwatched, or one
being taken back after a server restart ended them all) is given
:data:`GRACE` seconds, counted from when it was first found free, to be
taken back before the session is buried; one found free right after the
watcher buried the session before it is given none unless the server is
that young (a restart ends the watcher's wait too, so the burial before it
followed a grace). A SQLite lock file is never lost while its process
lives: one found free is buried at once. A token that cannot be seen (a
SQLite lock file missing while its session has rows) proves nothing: that
session is left to its leases, and the watcher watches the one after it.

A session that ends while its process lives (its connection was terminated,
the server restarted) is taken back by its store: the same token, once the
database gives it. If the fleet buried the session meanwhile (its rows are
gone), its workers are told (:class:`~tailrace.stores.Lapse`): their leases
were fenced, their runs adopted elsewhere. A session whose process is cut
off from the database keeps its token on the server until the server sees
the connection dead; leases are the fallback then (D6, W3).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import functools
import logging
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Protocol, TypeVar

from .._errors import StoreError
from .._told import Told
from ._contract import ChangeFeed, Presence
from ._records import Lapse, WorkerRow

logger = logging.getLogger("tailrace.stores.sessions")

T = TypeVar("T")

#: Seconds after which a watcher looks at the ring again, whatever it was told.
RING_REREAD = 600.0
#: The longest one wait for a token lasts before it is made again: a waiting Postgres
#: statement holds back the horizon of what vacuum may remove, by this much at most.
WAIT = 60.0
#: Seconds a watcher gives a session whose Postgres token it found free at once to take
#: it back (a server restart ends every session: each takes its own back within a second
#: or two) before burying it.
GRACE = 5.0
#: Seconds between two looks at a lock file (SQLite) whose holder is alive.
PROBE = 0.05
#: The first and the longest pause before taking a lost session back, or watching again.
_FIRST_PAUSE, _LONGEST_PAUSE = 0.05, 2.0


def new_session() -> str:
    """A fresh session id: ``host:pid:nonce`` (its order places it in the ring)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"


#: How a ring change addressed to one session begins (Postgres notifications).
RING_PREFIX = "ring:"


def ring_change(session: str) -> str:
    """The change kind that tells ``session`` that the session it watches changed."""
    return RING_PREFIX + session


class Outlived(enum.Enum):
    """How a wait for another session's token ended (``Tokens.outlive``)."""

    #: Its holder gave it up while we waited: the session ended.
    ENDED = "ended"
    #: It was free when we asked: ended, or being taken back (``GRACE``).
    FREE = "free"
    #: The wait ran out first: look at the ring again.
    WAITED_OUT = "waited out"
    #: Its token cannot be seen from here (SQLite: no lock file): not proof of death.
    UNSEEN = "unseen"


class Held(Protocol):
    """A session's token, held."""

    async def lost(self) -> str:
        """Wait until the token is lost while held (its connection ended); the reason."""

    async def release(self, *, rows_left: bool) -> None:
        """Give the token up (the session leaves); ``rows_left``: the session's rows could
        not all be removed, so the token is left for a burier to find free."""


class Tokens(Protocol):
    """A backend's session tokens."""

    async def hold(self, session: str) -> Held:
        """Take ``session``'s token (``StoreError`` if the database cannot give it now)."""

    def outlive(self, session: str) -> AbstractAsyncContextManager[Outlived]:
        """Wait until ``session``'s token is free, and hold it (shared) for the body, which
        gets how the wait ended (not held when it ran out)."""

    async def buried(self, session: str) -> None:
        """``session`` was buried: remove what is left of its token (SQLite: its file)."""

    async def grace(self, *, after_burial: bool) -> float:
        """Seconds from now a session whose token was found free at once is given to take it
        back before it is buried; ``after_burial``: found right after the watcher buried the
        session before it."""

    async def close(self) -> None:
        """Let go of what watching holds (a connection)."""


class Ring(Protocol):
    """The store's side of the ring: the shared transactions (see ``_sql._transactions``)."""

    async def _join_session(
        self, session: str, workers: list[WorkerRow], *, again: bool
    ) -> frozenset[str]: ...

    async def _bury_session(self, session: str) -> int: ...

    async def _ring_next(self, session: str) -> str | None: ...

    async def _forget_worker(self, worker_id: str) -> None: ...

    def clock(self) -> float: ...

    def changes(self) -> AbstractAsyncContextManager[ChangeFeed]: ...


class _Forever:
    """A token nothing outside the process can take: the memory store's."""

    async def lost(self) -> str:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")  # pragma: no cover

    async def release(self, *, rows_left: bool) -> None:
        """Nothing to give up."""


class MemoryTokens:
    """The memory store's tokens: its one session lives as long as the store object."""

    async def hold(self, session: str) -> Held:
        return _Forever()

    @contextlib.asynccontextmanager
    async def outlive(self, session: str) -> AsyncIterator[Outlived]:
        yield Outlived.ENDED  # no session but this store's own exists in memory

    async def buried(self, session: str) -> None:
        """Nothing is left of a session."""

    async def grace(self, *, after_burial: bool) -> float:
        return 0.0  # a token lost is a store object gone

    async def close(self) -> None:
        """Nothing is held open."""


class _Presence(Presence):
    """One worker's presence: its lapses, queued for it."""

    def __init__(self, session: str, worker: WorkerRow) -> None:
        self.session = session
        self.worker = worker
        self._lapses: asyncio.Queue[Lapse] = asyncio.Queue()

    async def lapse(self) -> Lapse:
        return await self._lapses.get()

    def post(self, lapse: Lapse) -> None:
        self._lapses.put_nowait(lapse)


class Sessions:
    """A store object's session: held while any worker of it is present, and its watch.

    ``ring`` is the store (its shared transactions and its change feed);
    ``tokens`` the backend's tokens; ``where`` names the store in logs.
    """

    def __init__(self, ring: Ring, tokens: Tokens, where: str) -> None:
        self.session = new_session()
        self._ring = ring
        self._tokens = tokens
        self._where = where
        self._present: dict[str, _Presence] = {}
        self._held: Held | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._guard = asyncio.Lock()
        #: A worker's row could not be removed: the session's token is left for a burier.
        self._rows_left = False
        #: Sessions whose token this process cannot see: left to their leases.
        self._unseen: set[str] = set()
        #: When the session watched, whose token was found free at once, is buried unless
        #: taken back (monotonic; kept across looks at the ring, so news delays no burial).
        self._free_until: dict[str, float] = {}

    @contextlib.asynccontextmanager
    async def present(self, worker: WorkerRow) -> AsyncIterator[Presence]:
        """``worker`` present in this store's session while the ``async with`` lasts."""
        handle = _Presence(self.session, dataclasses.replace(worker, session=self.session))
        async with self._guard:
            if not self._present:
                await self._open()
            self._present[worker.worker_id] = handle
        try:
            await self._ring._join_session(self.session, [handle.worker], again=False)
            yield handle
        finally:
            # To its end even if cancelled (waiting for the guard too): else its row stays.
            await finish(self._leave(worker.worker_id))

    async def _leave(self, worker_id: str) -> None:
        """``worker_id`` leaves: its row goes, and the session with the last one."""
        async with self._guard:
            self._present.pop(worker_id, None)
            try:
                await self._forget(worker_id)
            finally:
                if not self._present:
                    await self._close()

    async def _forget(self, worker_id: str) -> None:
        """Remove the row of ``worker_id``, which left; one that cannot be removed goes with
        the session, when it is buried."""
        try:
            await self._ring._forget_worker(worker_id)
        except StoreError as exc:
            self._rows_left = True
            logger.warning("%s: worker %s left: %s", self._where, worker_id, exc)

    async def _open(self) -> None:
        self._held = await self._tokens.hold(self.session)
        self._tasks = [
            asyncio.create_task(self._keep(), name=f"tailrace-session:{self.session}"),
            asyncio.create_task(self._watch(), name=f"tailrace-ring:{self.session}"),
        ]

    async def _close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        held, self._held = self._held, None
        rows_left, self._rows_left = self._rows_left, False
        try:
            if held is not None:
                await held.release(rows_left=rows_left)
        finally:
            await self._tokens.close()

    # -- keeping the session ----------------------------------------------------------

    async def _keep(self) -> None:
        """Take the session back each time it is lost, and tell the workers what happened
        (a failure is said once per reason, and the session kept all the same)."""
        told = Told(f"{self._where}: keeping session {self.session}", logger)
        while True:
            try:
                await self._take_back()
                told.worked()
            except Exception as exc:  # never stop keeping it: the workers rely on it
                told.failed(exc)
                await asyncio.sleep(_LONGEST_PAUSE)

    async def _take_back(self) -> None:
        """Wait until the session is lost, take it back, and tell the workers."""
        assert self._held is not None
        reason = await self._held.lost()
        lost_at = time.monotonic()
        logger.warning(
            "%s: store session %s ended (%s); taking it back", self._where, self.session, reason
        )
        self._held = await patiently(
            functools.partial(self._tokens.hold, self.session),
            f"{self._where}: taking session {self.session} back",
        )
        workers = [
            dataclasses.replace(p.worker, seen_at=self._ring.clock())
            for p in self._present.values()
        ]
        had = await patiently(
            functools.partial(self._ring._join_session, self.session, workers, again=True),
            f"{self._where}: joining session {self.session} again",
        )
        # A worker that left while this joined: its row was written back; take it away
        # again (it popped itself from the present ones before removing its row).
        for worker in workers:
            if worker.worker_id not in self._present:
                await self._forget(worker.worker_id)
        # Buried if a worker still here lost its row: one that left took its own away.
        buried = any(w.worker_id not in had for w in workers if w.worker_id in self._present)
        lapse = Lapse(reason=reason, seconds=time.monotonic() - lost_at, buried=buried)
        for presence in self._present.values():
            presence.post(lapse)

    # -- watching the next session ------------------------------------------------------

    async def _watch(self) -> None:
        """Watch the next session of the ring, bury it when it is gone, then the next."""
        told = Told(f"{self._where}: watching the ring", logger)
        while True:
            try:
                async with self._ring.changes() as feed:
                    await self._watch_with(feed, told)
            except Exception as exc:  # never stop watching: the fleet relies on it
                told.failed(exc)
                await asyncio.sleep(_LONGEST_PAUSE)

    async def _watch_with(self, feed: ChangeFeed, told: Told) -> None:
        pause = _FIRST_PAUSE
        after_burial = False
        while True:
            try:
                after, buried, after_burial = await self._next_watched(), after_burial, False
                if after is None:
                    await self._ring_news(feed)
                else:
                    after_burial = await self._outlive(after, feed, buried)
                pause = _FIRST_PAUSE
                told.worked()
            except Exception as exc:  # never stop watching: the fleet relies on it
                told.failed(exc)
                await asyncio.sleep(pause)
                pause = min(pause * 2, _LONGEST_PAUSE)

    async def _next_watched(self) -> str | None:
        """The next session of the ring whose token this process can see, if any."""
        after = await self._ring._ring_next(self.session)
        passed: set[str] = set()
        while after in self._unseen and after not in passed:
            passed.add(after)
            after = await self._ring._ring_next(after)
            if after == self.session:
                return None
        return None if after in self._unseen else after

    async def _unseen_token(self, session: str) -> None:
        """``session``'s token cannot be seen from here: unless it left meanwhile (its rows
        go before its token), it is left to its leases, and said so once."""
        if await self._ring._ring_next(self.session) != session:
            return  # it left, or the ring changed: look again
        self._unseen.add(session)
        logger.warning(
            "%s: cannot see the token of store session %s (is the database opened through "
            "another path?); its runs are left to their leases",
            self._where, session,
        )  # fmt: skip

    async def _outlive(self, session: str, feed: ChangeFeed, after_burial: bool) -> bool:
        """Bury ``session`` once it is gone, unless the ring changes first: whether it was
        buried (a failure of the watch is raised: the caller logs it and watches again)."""
        for other in [s for s in self._free_until if s != session]:
            del self._free_until[other]
        buried = await first_of(self._bury_when_gone(session, after_burial), self._ring_news(feed))
        return bool(buried)

    async def _bury_when_gone(self, session: str, after_burial: bool) -> bool:
        """Bury ``session`` once its token comes free while watched; one found free at once
        is given the tokens' grace to be taken back first (counted from when it was first
        found free). A wait that ran out (:data:`WAIT`) is made again. Returns whether
        ``session`` was buried (not if its token cannot be seen)."""
        while True:
            async with self._tokens.outlive(session) as outlived:
                if outlived is Outlived.WAITED_OUT:
                    self._free_until.pop(session, None)  # held: it was taken back
                    continue
                if outlived is Outlived.UNSEEN:
                    await self._unseen_token(session)
                    return False
                if outlived is Outlived.FREE and session not in self._free_until:
                    grace = await self._tokens.grace(after_burial=after_burial)
                    self._free_until[session] = time.monotonic() + grace
                left = 0.0
                if outlived is Outlived.FREE:
                    left = self._free_until[session] - time.monotonic()
                if left <= 0:
                    # Held to its end, token and all: the session cannot be taken back
                    # (and find itself whole) between its token coming free and its burial.
                    expired = await finish(self._ring._bury_session(session))
                    self._free_until.pop(session, None)
                    await self._tokens.buried(session)
                    logger.info(
                        "%s: store session %s is gone; the leases of its %d runs expired for "
                        "the fleet to adopt",
                        self._where, session, expired,
                    )  # fmt: skip
                    return True
            await asyncio.sleep(left)

    async def _ring_news(self, feed: ChangeFeed) -> None:
        """Return when the ring changed for this session, or after :data:`RING_REREAD` seconds."""
        mine = ring_change(self.session)
        deadline = time.monotonic() + RING_REREAD
        while (left := deadline - time.monotonic()) > 0:
            kinds = await feed.wait(left)
            if "ring" in kinds or mine in kinds:
                return

    async def close(self) -> None:
        """The store closes: stop watching and give the session up."""
        async with self._guard:
            self._rows_left = self._rows_left or bool(self._present)
            self._present.clear()
            if self._held is not None or self._tasks:
                await self._close()


async def first_of(work: Awaitable[T], other: Awaitable[object]) -> T | None:
    """What ``work`` gives (or raises), or None if ``other`` ends first; the one still
    running is cancelled and awaited."""
    task = asyncio.ensure_future(work)
    rival = asyncio.ensure_future(other)
    try:
        await asyncio.wait((task, rival), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (task, rival):
            pending.cancel()
        await asyncio.gather(task, rival, return_exceptions=True)
    return task.result() if task.done() and not task.cancelled() else None


async def patiently(call: Callable[[], Awaitable[T]], what: str) -> T:
    """``call()`` until it succeeds, pausing longer after each failure (each reason said
    once)."""
    pause = _FIRST_PAUSE
    told = Told(what, logger)
    while True:
        try:
            result = await call()
        except Exception as exc:
            told.failed(exc)
            await asyncio.sleep(pause)
            pause = min(pause * 2, _LONGEST_PAUSE)
        else:
            told.worked()
            return result


async def finish(work: Awaitable[T]) -> T:
    """Await ``work`` to its end even if the caller is cancelled meanwhile (then re-raised)."""
    task = asyncio.ensure_future(work)
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(task)
            break
        except asyncio.CancelledError:
            if task.done():
                raise
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return result
