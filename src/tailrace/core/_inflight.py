"""Attempts in flight: one handler attempt, the order a harvest takes them in, how their errors
read, and the bulk stretches (thousands of attempts dispatched or harvested at once)."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import gc
import operator
import traceback
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._state import MapItems


class Attempt:
    """One handler attempt in flight.

    The attempt reports its own end (``value`` or ``error``, then ``finished``)
    from inside its task, so a completion costs no extra trip through the
    event loop before the run loop wakes. (Its task's done-callback, removed
    by that report, only catches a task cancelled before it ever ran.)
    """

    __slots__ = (
        "abandoned",
        "backup_of",
        "backup_timer",
        "error",
        "finished",
        "hedge",
        "index",
        "item",
        "items",
        "progress",
        "released",
        "started",
        "straggled",
        "stream",
        "task",
        "timer",
        "tries",
        "value",
        "visit",
        "waiting",
    )

    def __init__(
        self,
        index: int,
        visit: int,
        started: float,
        hedge: bool = False,
        tries: int = 1,
        item: int = -1,
        items: MapItems | None = None,
    ) -> None:
        self.index = index
        #: The item index of an attempt of a map's item (M2), -1 for a node's attempt.
        self.item = item
        #: The map visit the item belongs to (the node's current one may be newer).
        self.items = items
        self.visit = visit
        self.started = started
        self.hedge = hedge
        self.tries = tries
        #: A backup's: the try of the primary it backs up (its own try number, as streams and
        #: events tag it); None for a primary (T5).
        self.backup_of = tries if hedge else None
        #: Set when the engine cancels it (a hedge loser): its end is not a failure.
        self.abandoned = False
        #: The straggler threshold (seconds) once this attempt crossed it (T3).
        self.straggled: float | None = None
        self.task: asyncio.Task[Any] | None = None
        self.timer: asyncio.TimerHandle | None = None
        #: When a hedge policy backs this attempt up (tail hooks).
        self.backup_timer: asyncio.TimerHandle | None = None
        #: What the handler returned, or the exception it ended with (cancellation included).
        self.value: Any = None
        self.error: BaseException | None = None
        #: True once the attempt ended and was handed to the run loop.
        self.finished = False
        #: A child run's attempt gives its admission slot back as it starts (R4).
        self.released = False
        #: Whether it only waits for a child run to end (``_children``'s values).
        self.waiting = 0
        #: The id of this attempt's open stream once it published a chunk (S1), until its mark.
        self.stream: int | None = None
        #: How far its checkpoints got: those it saved, plus the progress it resumed from (P2).
        self.progress = 0.0

    def abandon(self) -> None:
        """Cancel this attempt on purpose."""
        self.abandoned = True
        if self.task is not None:
            self.task.cancel()
        if self.timer is not None:
            self.timer.cancel()
        if self.backup_timer is not None:
            self.backup_timer.cancel()


#: Harvest order (E2, M7): definition order, then item order, an attempt before its hedge.
harvest_order = operator.attrgetter("index", "item", "hedge")


def describe(exc: BaseException) -> str:
    """``Type: message`` as text any store takes: NUL and lone surrogates escaped."""
    return _storable(f"{type(exc).__name__}: {exc}")


#: A failed attempt's stored traceback keeps at most this many characters: the
#: innermost frames, where the error was raised.
TRACEBACK_CHARS = 8_000


def traceback_text(exc: BaseException) -> str:
    """The traceback of ``exc`` as storable text, cut to its last :data:`TRACEBACK_CHARS`.

    It is data like any stored text: readers render it as text, never as markup.
    """
    text = "".join(traceback.format_exception(exc))
    if len(text) > TRACEBACK_CHARS:
        text = "...\n" + text[-TRACEBACK_CHARS:]
    return _storable(text)


def _storable(text: str) -> str:
    """``text`` with NUL and lone surrogates escaped, so every store takes it."""
    if text.isascii():
        return text.replace("\x00", "\\x00")
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text.replace("\x00", "\\x00")


#: Batches of at least this many nodes are dispatched and harvested with the
#: cyclic garbage collector paused.
BULK = 512


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector for a synchronous stretch of bulk allocation.

    Starting or harvesting thousands of attempts allocates a few containers
    each (task, coroutine, context, attempt); with the collector on, they
    trigger collections whose cost grows with everything alive, so a 10k
    fan-out spent a third of its time in them. Nothing is awaited inside, so
    the collector is off for that stretch only, and back on (if it was on)
    whatever happens; reference counting frees memory as usual meanwhile.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


class InFlight:
    """The attempts of one run in flight, those that ended since the last harvest, and the
    wake-up the run loop waits on.

    An attempt reports its own end (:meth:`finished`) from inside its task;
    the task's done-callback (:meth:`_unreported`) only catches a task
    cancelled before it ran. :meth:`poke` wakes the loop for an empty
    harvest; a poke while the loop is busy elsewhere is kept until it waits.
    """

    __slots__ = ("attempts", "cb_context", "done", "poked", "unreported_cb", "wake")

    def __init__(self) -> None:
        #: Attempts running now, in start order (a dict: ordered, O(1) removal).
        self.attempts: dict[Attempt, None] = {}
        #: Attempts that ended since the last harvest.
        self.done: list[Attempt] = []
        #: What the loop awaits when it has nothing to harvest: set by an end or a poke.
        self.wake: asyncio.Future[None] | None = None
        #: Set by :meth:`poke`; the loop harvests once more before it waits again.
        self.poked = False
        # One bound method and one context for every task's done-callback: not a
        # method object and a context copy per attempt.
        self.unreported_cb = self._unreported
        self.cb_context = contextvars.Context()

    def finished(self, attempt: Attempt) -> None:
        """Hand a finished attempt to the run loop and wake it (once per attempt)."""
        if attempt.finished:
            return
        attempt.finished = True
        if attempt.task is not None:
            attempt.task.remove_done_callback(self.unreported_cb)
            # The task's context refers to the attempt (current_node's handle): letting go
            # of the task here leaves no cycle, so both are freed by reference counting.
            attempt.task = None
        try:
            del self.attempts[attempt]
        except KeyError:
            return  # the run is winding down and no longer harvests it
        self.done.append(attempt)
        wake = self.wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    def _unreported(self, task: asyncio.Task[Any]) -> None:
        """A task ended without its attempt reporting: it was cancelled before it ran."""
        for attempt in self.attempts:
            if attempt.task is task:
                attempt.error = asyncio.CancelledError()  # E9: a cancelled handler failed
                self.finished(attempt)
                return

    def poke(self) -> None:
        """Wake the loop for an empty harvest, so buffered events are committed and published now.

        A poke while the loop is busy elsewhere (a flush) is kept: the loop
        then makes that harvest before it waits again.
        """
        self.poked = True
        wake = self.wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    async def cancel_all(self) -> list[Attempt]:
        """Cancel and await every attempt in flight; the attempts, no longer tracked."""
        attempts = list(self.attempts)
        for attempt in attempts:
            assert attempt.task is not None
            attempt.task.cancel()
        if attempts:
            await asyncio.gather(*(a.task for a in attempts if a.task), return_exceptions=True)
        self.attempts.clear()
        return attempts
