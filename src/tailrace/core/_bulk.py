"""Bulk stretches of allocation: dispatching or harvesting thousands of attempts at once."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

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
