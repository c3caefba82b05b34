"""The threads ``def`` handlers run in: a pool of the engine's own, bounded.

A ``def`` handler runs in a thread, in a copy of its attempt's context. Cut
(a late map item cancelled, a timeout, a hedge that lost, a cancelled run),
it cannot be interrupted: the attempt ends at once, its result, checkpoints
and stream chunks are dropped, and its thread runs on until the function
returns. The pool counts that thread as busy until then. On asyncio's
default pool, shared by the whole process and ``min(32, cpus + 4)`` threads
large, a few such threads held up every other ``def`` handler; an engine's
own pool of ``capacity + 32`` threads (``Engine(handler_threads=)``) lets
that many cut handlers run on beyond what its capacity admits before one
of them delays a live handler.

The engine makes the pool when its first ``def`` handler runs and keeps it
for its lifetime; when the engine is collected (or the interpreter exits)
the pool is shut down without waiting for the threads still running.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

#: Threads an engine's pool has beyond its capacity, for cut handlers still running.
HEADROOM = 32


class HandlerThreads:
    """An engine's pool for ``def`` handlers: ``size`` threads, made when first used.

    >>> threads = HandlerThreads(2)
    >>> asyncio.run(run_sync(threads, lambda x: 2 * x, 21))
    42
    >>> threads.shutdown()
    """

    __slots__ = ("__weakref__", "_pool", "size")

    def __init__(self, size: int) -> None:
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"handler_threads must be an integer >= 1, got {size!r}")
        self.size = size
        self._pool: ThreadPoolExecutor | None = None

    @classmethod
    def for_capacity(cls, capacity: int | None, size: int | None) -> HandlerThreads:
        """``size`` threads, or by default the engine's ``capacity`` plus :data:`HEADROOM`."""
        return cls(size if size is not None else (capacity or 0) + HEADROOM)

    def pool(self) -> ThreadPoolExecutor:
        """The pool, made now if it is not yet."""
        pool = self._pool
        if pool is None:
            pool = self._pool = ThreadPoolExecutor(self.size, thread_name_prefix="tailrace-def")
            # The engine's way out: its threads go when it does, nobody waits for them.
            weakref.finalize(self, pool.shutdown, wait=False)
        return pool

    def shutdown(self) -> None:
        """Let the threads go without waiting for those still running; idempotent."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False)


#: The pool of the engine running the current attempt, for executors that run a
#: ``def`` handler in this process (:class:`~tailrace.executors.LocalExecutor`).
current_threads: contextvars.ContextVar[HandlerThreads | None] = contextvars.ContextVar(
    "tailrace_threads", default=None
)


async def run_sync(
    threads: HandlerThreads | None, handler: Callable[[Any], Any], payload: Any
) -> Any:
    """``handler(payload)`` in a thread of ``threads`` (None: asyncio's default pool), in a
    copy of the caller's context; a coroutine it returns is awaited here (a generator is a
    value, never awaited)."""
    pool = None if threads is None else threads.pool()
    context = contextvars.copy_context()
    result = await asyncio.get_running_loop().run_in_executor(pool, context.run, handler, payload)
    if inspect.iscoroutine(result):
        result = await result
    return result
