"""Change feeds: one source of wake-ups per store, fanned out to every subscriber.

A store owns a :class:`ChangeHub`. The first subscriber starts the store's
source (a Postgres ``LISTEN`` connection, a SQLite ``data_version`` watcher
thread; memory has none: its writes deliver directly), the last one to leave
stops it, so a worker and any number of ``Engine.wait`` calls share one
connection or thread. ``deliver`` may be called from any thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable

from ._contract import ChangeFeed
from ._records import CHANGE_KINDS

logger = logging.getLogger("tailrace.stores.changes")

#: Stops a started source.
Stop = Callable[[], Awaitable[None]]
#: Starts a source that delivers to the hub; returns how to stop it.
Start = Callable[["ChangeHub"], Awaitable[Stop]]


class Subscription(ChangeFeed):
    """One subscriber's feed, bound to the event loop it was made on."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._kinds: set[str] = set()
        self._event = asyncio.Event()

    def post(self, kinds: frozenset[str]) -> None:
        """Add ``kinds`` to what the next ``wait`` reports; callable from any thread."""
        try:
            on_loop = asyncio.get_running_loop() is self._loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            self._add(kinds)
            return
        with contextlib.suppress(RuntimeError):  # its loop closed: nobody waits any more
            self._loop.call_soon_threadsafe(self._add, kinds)

    def _add(self, kinds: frozenset[str]) -> None:
        self._kinds |= kinds
        self._event.set()

    async def wait(self, seconds: float) -> frozenset[str]:
        """The kinds delivered since the last call; waits up to ``seconds`` for one."""
        if not self._kinds and seconds > 0:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(seconds):
                    await self._event.wait()
        kinds, self._kinds = frozenset(self._kinds), set()
        self._event.clear()
        return kinds


class ChangeHub:
    """Fans a store's changes out to its subscribers; ``start`` runs while anyone listens."""

    def __init__(self, start: Start | None = None) -> None:
        self._start = start
        self._lock = threading.Lock()
        self._subscribers: set[Subscription] = set()
        self._stop: Stop | None = None

    def deliver(self, kinds: frozenset[str]) -> None:
        """Tell every subscriber that ``kinds`` changed (from any thread)."""
        with self._lock:
            subscribers = list(self._subscribers)
        for subscriber in subscribers:
            subscriber.post(kinds)

    def deliver_all(self) -> None:
        """Tell every subscriber that anything may have changed (a fallback, a reconnection)."""
        self.deliver(CHANGE_KINDS)

    @contextlib.asynccontextmanager
    async def subscribe(self) -> AsyncIterator[ChangeFeed]:
        """A feed of changes made from now on, while the ``async with`` lasts."""
        feed = Subscription()
        with self._lock:
            first = not self._subscribers
            self._subscribers.add(feed)
        try:
            if first and self._start is not None:
                self._stop = await self._start(self)
            yield feed
        finally:
            with self._lock:
                self._subscribers.discard(feed)
                stop = self._stop if not self._subscribers else None
                if stop is not None:
                    self._stop = None
            if stop is not None:
                await stop()

    async def close(self) -> None:
        """Stop the source (the store closes); subscribers left get no more wake-ups."""
        stop, self._stop = self._stop, None
        if stop is not None:
            await stop()
