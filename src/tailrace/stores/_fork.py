"""Descriptors a forked child must not keep: what holds a store session alive (W7).

A worker is alive while its session's lock is held: on Postgres by a
connection, on SQLite by a lock file's ``flock``. A process forked from the
worker (``multiprocessing``'s default on Linux, a node's own ``os.fork``)
shares those descriptors, so it would keep the session alive after the
worker died, and its runs un-adopted for as long as it lives. In the child,
each descriptor registered here is pointed at ``/dev/null`` (``dup2``): the
child lets go of the lock and the connection, the parent keeps both, and
whatever the child still does with the descriptor (a connection's goodbye
as it is collected) goes nowhere.
"""

from __future__ import annotations

import contextlib
import os
import threading

_lock = threading.Lock()
_parent_only: set[int] = set()


def parent_only(fd: int) -> None:
    """Let go of ``fd`` in every child forked from now on, until :func:`forget`."""
    with _lock:
        _parent_only.add(fd)


def forget(fd: int) -> None:
    """``fd`` is about to be closed (or was): children keep whatever the number names."""
    with _lock:
        _parent_only.discard(fd)


def _in_child() -> None:
    fds = list(_parent_only)
    _parent_only.clear()
    if not fds:
        return
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for fd in fds:
            with contextlib.suppress(OSError):  # already closed: nothing to let go of
                os.dup2(null, fd, inheritable=False)
    finally:
        os.close(null)


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_in_child)
