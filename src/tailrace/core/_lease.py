"""Leases of a run (D6): owner names, holding a lease with a heartbeat, letting go of it safely.

:class:`Lease` is an ``async with`` object: it acquires the run's lease
(taking it over at once from an owner that provably died), renews it at a
third of its lifetime, hears cancel requests recorded in the store, and
releases it on the way out. A lease lost to another owner cancels the task
that holds it, which then raises :class:`~tailrace.LeaseLost`.
:func:`run_to_end` is cleanup that cancellation cannot cut short;
:func:`mark_failed` is a daemon's last word on a run.

An owner is ``host:pid:start:nonce``: the host, the process id, the process's
start time (clock ticks since boot, from ``/proc``; ``0`` where there is no
``/proc``) and a random nonce. The start time guards against PID reuse: a
new process that got the same id started later, so it does not match. A
lease whose owner is on this host and whose process is gone can be taken
over at once instead of waiting for the lease to expire; anything not proved
dead (another host, an owner name of another shape, a live process) is
treated as alive.

>>> owner = make_owner()
>>> owner_is_dead(owner)
False
>>> owner_is_dead("elsewhere:1:0:abcd")
False
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from types import TracebackType

from .._codec import DEFAULT_CODEC
from .._errors import LeaseHeld, LeaseLapsed, LeaseLost, StoreError
from .._events import EventType
from ..stores import EventRow, Harvest, QuestionStatus, RunRecord, RunStatus, RunStore

logger = logging.getLogger("tailrace.persist")

#: The share of a lease's ttl by which its holder stops the run before the lease could
#: expire, when the store does not answer its renewals (a cut): whoever adopts the run
#: after the expiry is then its only driver.
LAPSE_SHARE = 1 / 6


class Lease:
    """The lease of run ``run_id`` for ``owner`` (D6), held for the body of an ``async with``.

    ``ttl`` is the lease lifetime in seconds, renewed every ``ttl / 3``.
    ``on_cancel_request`` is called once when the store records a cancel
    request for the run (``Engine.cancel`` from another process): heard by a
    heartbeat, or by a commit that reports it (:meth:`cancel_requested`). Entering
    acquires the lease (``token`` is its fencing token); leaving releases it,
    shielded from cancellation. If a heartbeat finds the lease taken over,
    the holding task is cancelled and the ``async with`` raises
    :class:`~tailrace.LeaseLost` instead of the cancellation. If the store
    does not answer the renewals until a sixth of the ttl before the lease
    could expire (:data:`LAPSE_SHARE`, counted from when the last renewal
    was sent), the holding task is cancelled likewise and the ``async with``
    raises :class:`~tailrace.LeaseLapsed` (W7): a holder cut off from the
    store stops driving before anyone may adopt the run.
    """

    def __init__(
        self,
        store: RunStore,
        run_id: str,
        owner: str,
        ttl: float,
        *,
        on_cancel_request: Callable[[], object] | None = None,
    ) -> None:
        self.store = store
        self.run_id = run_id
        self.owner = owner
        self.ttl = ttl
        self.token = 0
        #: Set when a heartbeat found the lease taken over.
        self.lost: LeaseLost | None = None
        self._on_cancel_request = on_cancel_request
        self._heard = False
        self._holder: asyncio.Task[object] | None = None
        #: The token of a claim's lease this lease continues (see :meth:`held`).
        self._claimed: int | None = None
        self._stop = asyncio.Event()
        self._beat: asyncio.Task[None] | None = None
        #: Set when a commit let go of the lease (a suspension on child runs, R4), and
        #: while such a commit is in flight.
        self._released = False
        self._releasing = False
        #: When (monotonic) the lease lapses here unless renewed, and when it last was.
        self._lapses_at = self._renewed_at = time.monotonic()
        self._stray: asyncio.Future[None] | None = None

    def held(self, record: RunRecord) -> Lease:
        """Take the lease as ``record`` shows it held, if by this owner for a while yet.

        A queue's claim leases the run to its claimant (and bumps the token),
        so the claimant's driver has nothing to acquire: entering keeps the
        token the claim gave instead of writing it again. The commits and
        beats check that token, so a lease lost meanwhile is found out as
        ever (D6). A lease near its expiry is acquired again as usual.
        """
        remaining = (record.lease_expires or 0.0) - self.store.clock()  # stamped on its clock
        if record.lease_owner == self.owner and remaining > self.ttl / 2:
            self._claimed = record.lease_token
            self._renewed(time.monotonic(), remaining)
        return self

    @property
    def continues_claim(self) -> bool:
        """Whether entering keeps a claim's lease (:meth:`held`) rather than acquiring one."""
        return self._claimed is not None

    async def __aenter__(self) -> Lease:
        if self._claimed is not None:
            self.token = self._claimed
        else:
            sent = time.monotonic()
            self.token = await acquire_lease(self.store, self.run_id, self.owner, self.ttl)
            self._renewed(sent, self.ttl)
        self._holder = asyncio.current_task()
        assert self._holder is not None
        self._beat = asyncio.create_task(self._heartbeat(), name=f"lease:{self.run_id}")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await run_to_end(self._let_go())
        if (
            isinstance(exc, asyncio.CancelledError)
            and self.lost is not None
            and self._holder is not None
            and self._holder.uncancel() == 0
        ):
            raise self.lost from None

    async def _let_go(self) -> None:
        # Stopped, not cancelled: a beat in the middle of a query finishes it
        # (cancelling a driver mid-query can leave its connection stuck).
        self._stop.set()
        if self._beat is not None:
            await asyncio.gather(self._beat, return_exceptions=True)
        if self._stray is not None:  # a beat still in flight (cancelled if the lease lapsed)
            await asyncio.gather(self._stray, return_exceptions=True)
        if self.lost is None and not self._released:
            await release_quietly(self.store, self.run_id, self.owner, self.token)

    @property
    def released(self) -> bool:
        """Whether a commit let go of the lease (:meth:`letting_go`): nothing more is written."""
        return self._released

    @contextlib.contextmanager
    def letting_go(self) -> Iterator[None]:
        """Around a commit that releases the lease (a run suspending on its children, R4,
        or ending).

        A beat that finds the lease gone while that commit is in flight lost
        nothing (the commit says whether it landed). Once it has, no more
        beats, and nothing to release on the way out; if it failed, the lease
        is the run's as before.
        """
        self._releasing = True
        try:
            yield
        finally:
            self._releasing = False
        self._released = True
        self._stop.set()

    def cancel_requested(self) -> None:
        """The store says a cancel of the run is requested: tell the run, once (W5)."""
        if not self._heard and self._on_cancel_request is not None:
            self._heard = True
            self._on_cancel_request()

    async def _heartbeat(self) -> None:
        pause, sent = self.ttl / 3, time.monotonic()
        while True:
            due = max(sent + pause - time.monotonic(), 0.0)  # counted from the last beat sent
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), min(due, self._left()))
            if self._stop.is_set():
                return
            if self._left() <= 0:
                self._lose(OUTAGES.lapsed(self.owner, self._lapsed()))
                return
            sent = time.monotonic()
            beat = asyncio.ensure_future(self._renew(sent))
            if not await self._in_time(beat):
                return
            try:
                beat.result()
                pause = self.ttl / 3
            except LeaseLost as exc:
                if self._released:
                    return  # a beat sent as the commit let go
                if self._releasing:
                    continue  # the commit in flight let go: it tells whether that landed
                self._lose(exc)
                return
            except StoreError:
                # A hiccup: a beat may still land before the lease lapses (beats go
                # more often meanwhile); a lease really lost shows up as LeaseLost.
                logger.warning("heartbeat of run %s failed; retrying", self.run_id, exc_info=True)
                pause = self.ttl / 12
                continue
            # Renewed: the look for a cancel request has the renewed lease's time.
            heard = asyncio.ensure_future(self._hear_cancel_request())
            if not await self._in_time(heard):
                return
            if not heard.cancelled() and (failure := heard.exception()) is not None:
                logger.warning(
                    "run %s: looking for a cancel request failed: %s", self.run_id, failure
                )

    async def _in_time(self, work: asyncio.Future[None]) -> bool:
        """Whether ``work`` (a call to the store) ended before the lease could lapse here;
        if not, the lease lapsed (unless the lease was let go meanwhile), and ``work`` is
        awaited on the way out. Not cut short by a timeout around the call: a driver may
        hold a cancellation back for seconds (psycopg first asks the server to cancel)."""
        stopping = asyncio.ensure_future(self._stop.wait())
        await asyncio.wait(
            (work, stopping), timeout=max(self._left(), 0.0), return_when=asyncio.FIRST_COMPLETED
        )
        stopping.cancel()
        if work.done():
            return True
        self._stray = work  # awaited on the way out (a call mid-query finishes it)
        if not self._stop.is_set():  # the lease could lapse before the store answers
            work.cancel()
            self._lose(OUTAGES.lapsed(self.owner, self._lapsed()))
        return False

    async def _renew(self, sent: float) -> None:
        await self.store.heartbeat(self.run_id, self.owner, self.token, self.ttl)
        self._renewed(sent, self.ttl)

    async def _hear_cancel_request(self) -> None:
        """A run that commits nothing for a while (a long handler) hears a cancel request
        from another process here, within a beat."""
        if not self._heard and self._on_cancel_request is not None:
            record = await self.store.get_run(self.run_id)
            if record.cancel_requested_at is not None:
                self.cancel_requested()

    def _renewed(self, sent: float, remaining: float) -> None:
        """The lease runs ``remaining`` seconds from ``sent`` (monotonic): it lapses here a
        share of the ttl sooner (:data:`LAPSE_SHARE`), before anyone may take it over."""
        self._lapses_at = sent + remaining - LAPSE_SHARE * self.ttl
        self._renewed_at = sent
        OUTAGES.answered(self.owner)

    def _left(self) -> float:
        return self._lapses_at - time.monotonic()

    def _lapsed(self) -> LeaseLapsed:
        ago = time.monotonic() - self._renewed_at
        return LeaseLapsed(
            f"run {self.run_id!r}: the store did not answer in time to renew the lease of "
            f"{self.owner!r} (renewed {ago:.3g} s ago, ttl {self.ttl:g} s): the run stopped "
            "before the lease could expire; another owner adopts it"
        )

    def _lose(self, exc: LeaseLost) -> None:
        """The lease is lost (taken over, or lapsed here): the holding task is cancelled."""
        self.lost = exc
        assert self._holder is not None
        self._holder.cancel()


class Outages:
    """The owners of this process cut off from the store: each says so once per outage.

    A lease that lapses (the store did not answer its renewals) tells its
    owner's outage; the first one of an outage is logged as a warning that
    the owner stops every run it drives, the others quietly. A lease of that
    owner renewed or acquired again ends the outage, which is said too.
    """

    def __init__(self) -> None:
        self._since: dict[str, float] = {}

    def lapsed(self, owner: str, exc: LeaseLapsed) -> LeaseLapsed:
        """``owner``'s lease lapsed with ``exc`` (returned); said once per outage."""
        if owner in self._since:
            logger.info("%s", exc)
            return exc
        self._since[owner] = time.monotonic()
        logger.warning(
            "%s is cut off from the store: %s. It stops every run it drives before the run's "
            "lease can expire (another owner adopts it), and takes runs again once the store "
            "answers", owner, exc,
        )  # fmt: skip
        return exc

    def answered(self, owner: str) -> None:
        """A lease of ``owner`` was renewed or acquired: its outage, if any, is over."""
        since = self._since.pop(owner, None)
        if since is not None:
            logger.warning(
                "%s: the store answers again, %.3g s after it stopped a run for want of an "
                "answer", owner, time.monotonic() - since,
            )  # fmt: skip


#: This process's owners cut off from the store (see :class:`Outages`).
OUTAGES = Outages()


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


async def mark_failed(store: RunStore, run_id: str, owner: str, ttl: float, reason: str) -> None:
    """Record run ``run_id`` as failed with ``reason``, without its graph (a daemon's last word).

    For a run that cannot be resumed (its graph does not load, its rows do not
    decode): takes the lease, supersedes its open questions, writes the status
    and a ``run_failed`` event, and releases.
    """
    record = await store.get_run(run_id)
    if record.status in (RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED):
        return
    token = await acquire_lease(store, run_id, owner, ttl)
    try:
        open_ids = [
            q.question_id
            for q in await store.list_questions(run_id=run_id)
            if q.status in (QuestionStatus.OPEN, QuestionStatus.ANSWERED)
        ]
        events = await store.events(run_id)
        seq = max((e.seq for e in events), default=0) + 1
        now = store.clock()  # the run's times are on the store's clock
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
        await run_to_end(release_quietly(store, run_id, owner, token))


@functools.cache
def _host() -> str:
    return socket.gethostname()


def process_start(pid: int) -> int | None:
    """Start time of process ``pid`` in clock ticks since boot; None if unknown or gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    fields = stat[stat.rfind(b")") + 2 :].split()
    try:
        return int(fields[19])  # field 22 of the whole line: starttime
    except (IndexError, ValueError):
        return None


def make_owner() -> str:
    """A fresh owner name for this process: ``host:pid:start:nonce``."""
    pid = os.getpid()
    return f"{_host()}:{pid}:{process_start(pid) or 0}:{uuid.uuid4().hex[:8]}"


def owner_is_dead(owner: str | None) -> bool:
    """Whether ``owner`` names a process on this host that no longer exists.

    True only when it can be proved: the owner is on this host, and its
    process is gone or a different process now has its pid (PID reuse).
    """
    if not owner:
        return False
    parts = owner.rsplit(":", 3)
    if len(parts) != 4 or parts[0] != _host():
        return False
    try:
        pid, start = int(parts[1]), int(parts[2])
    except ValueError:
        return False
    if pid <= 0 or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # it exists, under another user
    if start == 0:
        return False  # no start time recorded: cannot rule out that it is the same process
    now = process_start(pid)
    return now is not None and now != start
