"""The daemon core: loops shaped like huey's consumer, run side by side until a graceful stop.

A :class:`Loop` is one loop: each iteration does what work there is; the wait
before the next one doubles while idle and resets when work arrives (a
``due`` time cuts it shorter); an iteration's error is logged and counted,
and the loop goes on; a ``wake`` event ends the wait early; the ``stop``
event ends the loop once the iteration in progress is done.

A :class:`Daemon` runs a main loop with others beside it, each an owned task
of one task group: ``on_startup`` first; once the main loop ends (``stop``
was set), ``drain`` lets the work in flight finish, then the loops beside it
are told to stop and awaited; ``close`` and ``on_shutdown`` run last,
whatever happened.

``tailrace serve`` (:class:`~tailrace.gates.Server`) and ``tailrace worker``
(the fleet's ``Worker``) are both made of these.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any, Protocol

from .._told import Told

#: A startup or shutdown hook: called, and awaited if it returns an awaitable.
Hook = Callable[[], Awaitable[None] | None]
#: One iteration of a loop: does what work there is and says how much.
Step = Callable[[], Awaitable[int]]
#: Something that runs beside the main loop until the event it is given is set.
Beside = Callable[[asyncio.Event], Coroutine[Any, Any, None]]


class ErrorCount(Protocol):
    """Where a loop counts the iterations that failed."""

    errors: int


class Loop:
    """One daemon loop over ``step``, backing off while idle.

    Args:
        name: names the loop in logs ("<name> failed; trying again until it works").
        step: one iteration; returns how much work it did (0: idle).
        interval: first wait after an idle iteration (and the wait after a
            busy one), seconds.
        max_interval: the wait doubles while idle up to this (default:
            ``interval``, a fixed pace).
        stats: its ``errors`` counts the iterations that raised.
        logger: where those are said (:class:`~tailrace._told.Told`): each distinct
            failure once while they go on, and that the loop works again after.
        wake: an event that ends the wait early (cleared before each iteration).
        due: seconds until something is due (None: nothing); the wait is no longer.
        on_work: called after an iteration that did work.
    """

    def __init__(
        self,
        name: str,
        step: Step,
        *,
        interval: float,
        max_interval: float | None = None,
        stats: ErrorCount,
        logger: logging.Logger,
        wake: asyncio.Event | None = None,
        due: Callable[[], float | None] | None = None,
        on_work: Callable[[], None] | None = None,
    ) -> None:
        self.name = name
        self.step = step
        self.interval = interval
        self.max_interval = interval if max_interval is None else max_interval
        self.stats = stats
        self.logger = logger
        self.wake = wake
        self.due = due
        self.on_work = on_work
        self._told = Told(name, logger)  # a store that is away fails each try alike

    async def once(self) -> int:
        """One iteration; an error is counted, said once per reason, and counts as no work."""
        try:
            work = await self.step()
        except Exception as exc:
            self.stats.errors += 1
            self._told.failed(exc)
            return 0
        self._told.worked()
        return work

    async def run(self, stop: asyncio.Event) -> None:
        """Iterate until ``stop`` is set."""
        idle = self.interval  # the pace while idle, doubling; a due moment only cuts one wait
        while not stop.is_set():
            if self.wake is not None:
                self.wake.clear()
            work = await self.once()
            if work and self.on_work is not None:
                self.on_work()
            idle = self.interval if work else min(idle * 2, self.max_interval)
            wait = idle
            soon = self.due() if self.due is not None else None
            if soon is not None:
                wait = min(wait, max(soon, 0.0))
            await nap(stop, self.wake, wait)


class Daemon:
    """``main`` until ``stop``, with ``beside`` (task name -> runner) alongside, then a graceful stop.

    ``on_startup`` runs (or is awaited) before anything; ``drain`` after the
    main loop ends and before the runners beside it are told to stop;
    ``close`` then ``on_shutdown`` after everything stopped, whatever happened.
    """

    def __init__(
        self,
        main: Loop,
        beside: Mapping[str, Beside] | None = None,
        *,
        on_startup: Hook | None = None,
        on_shutdown: Hook | None = None,
        drain: Callable[[], Awaitable[None]] | None = None,
        close: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.main = main
        self.beside = dict(beside or {})
        self.on_startup = on_startup
        self.on_shutdown = on_shutdown
        self.drain = drain
        self.close = close

    async def run(self, stop: asyncio.Event) -> None:
        """Start, serve until ``stop`` is set, drain, stop the loops beside, close, shut down."""
        await call_hook(self.on_startup)
        try:
            closing = asyncio.Event()
            async with asyncio.TaskGroup() as group:
                for name, runner in self.beside.items():
                    group.create_task(runner(closing), name=name)
                try:
                    await self.main.run(stop)
                    if self.drain is not None:
                        await self.drain()
                finally:
                    closing.set()
        finally:
            try:
                if self.close is not None:
                    await self.close()
            finally:
                await call_hook(self.on_shutdown)


async def nap(stop: asyncio.Event, wake: asyncio.Event | None, seconds: float) -> None:
    """Wait ``seconds``, or until ``stop`` or ``wake`` is set (at once if one already is)."""
    events = [stop] if wake is None else [stop, wake]
    if seconds <= 0 or any(event.is_set() for event in events):
        await asyncio.sleep(0)  # still a turn for the rest of the loop
        return
    if len(events) == 1:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await stop.wait()
        return
    waiters = [asyncio.create_task(event.wait()) for event in events]
    try:
        await asyncio.wait(waiters, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)


async def call_hook(hook: Hook | None) -> None:
    """Call ``hook`` (if any), awaiting what it returns when that is awaitable."""
    if hook is None:
        return
    result = hook()
    if inspect.isawaitable(result):
        await result
