"""Where user sync callables run: daemon threads that an abandoned call cannot hold open.

A synchronous ``run`` cut by ``round_timeout`` or by the straggler timer cannot
be stopped: Python has no way to cancel a thread. In asyncio's default
executor (and any ``ThreadPoolExecutor``) its thread is joined when the loop
shuts down and again at interpreter exit, so one abandoned 600 s rollout would
hold ``asyncio.run(evolve(...))`` open for 600 s. Each evolution owns a
:class:`DaemonExecutor` instead: its threads are daemons and are never joined,
and :meth:`DaemonExecutor.shutdown` returns at once, so the evolution returns
as soon as its own work is done and the interpreter exits past a call that is
still running (which is simply dropped, as a cut straggler's result is).
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

_Job = tuple["concurrent.futures.Future[Any]", Callable[..., Any], tuple[Any, ...]]


class DaemonExecutor(concurrent.futures.Executor):
    """A thread pool of daemon threads, reused while idle, never joined.

    A new thread starts whenever a call arrives and no thread is idle, so a
    call never waits behind abandoned ones; idle threads take the next call.

    Args:
        name: Prefix of the threads' names.
    """

    def __init__(self, name: str = "tailrace-evolve") -> None:
        self._name = name
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._started = 0
        self._closed = False

    def submit(  # type: ignore[override]
        self, fn: Callable[..., T], /, *args: Any
    ) -> concurrent.futures.Future[T]:
        """Run ``fn(*args)`` on a daemon thread; returns its future.

        Args:
            fn: The callable.
            args: Its positional arguments.

        Raises:
            RuntimeError: the executor was shut down.
        """
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the evolution's executor is shut down")
            self._jobs.put((future, fn, args))
            if self._idle:
                self._idle -= 1  # that idle thread takes this job
            else:
                self._started += 1
                threading.Thread(
                    target=self._work, name=f"{self._name}-{self._started}", daemon=True
                ).start()
        return future

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, args = job
            if future.set_running_or_notify_cancel():
                try:
                    result = fn(*args)
                except BaseException as exc:  # handed to the awaiting side, as a pool does
                    future.set_exception(exc)
                else:
                    future.set_result(result)
            del job, future, fn, args  # drop references before idling
            with self._lock:
                if self._closed:
                    return
                self._idle += 1

    def shutdown(self, wait: bool = False, *, cancel_futures: bool = False) -> None:
        """Refuse new calls and release idle threads; never waits for running calls.

        Args:
            wait: Ignored (kept for the ``Executor`` signature): a call still
                running is abandoned, never joined.
            cancel_futures: Cancel calls that have not started yet.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            idle, self._idle = self._idle, 0
        if cancel_futures:
            self._cancel_queued()
        for _ in range(idle):
            self._jobs.put(None)

    def _cancel_queued(self) -> None:
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job[0].cancel()
