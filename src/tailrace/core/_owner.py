"""Lease owner names, and whether the process behind one is provably gone (D6).

An owner is ``host:pid:start:nonce``: the host, the process id, the process's
start time (clock ticks since boot, from ``/proc``; ``0`` where there is no
``/proc``) and a random nonce. The start time guards against PID reuse: a
new process that got the same id started later, so it does not match.

A lease whose owner is on this host and whose process is gone can be taken
over at once instead of waiting for the lease to expire. Anything we cannot
prove dead (another host, an owner name of another shape, a live process) is
treated as alive.

>>> owner = make_owner()
>>> owner_is_dead(owner)
False
>>> owner_is_dead("elsewhere:1:0:abcd")
False
"""

from __future__ import annotations

import functools
import os
import socket
import uuid


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
