"""Replicas of one model behind several base URLs: least outstanding requests first (X6).

A replica that answered ``Retry-After`` is left out until that time has
passed; when every replica waits, a request goes to the one free soonest
after waiting for it. Requests of one unit (run, node, visit, item) avoid
the replicas already serving another attempt of it, so a hedge's backup
goes to another replica than its primary.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass(slots=True)
class Replica:
    """One base URL, its requests in flight, and until when it asked to be left alone."""

    url: str
    outstanding: int = 0
    not_before: float = 0.0
    units: Counter[Hashable] = field(default_factory=Counter)


class Replicas:
    """The replicas one client spreads its requests over (least outstanding requests).

    Args:
        urls: The API roots, one per replica (``http://host:port/v1``).
        clock: Monotonic seconds (a fake clock in tests).
    """

    def __init__(self, urls: Sequence[str], *, clock: Callable[[], float] = time.monotonic) -> None:
        if not urls:
            raise ValueError("a model client needs at least one base URL")
        self.replicas = [Replica(url.rstrip("/") + "/") for url in urls]
        self._clock = clock

    def pick(self, unit: Hashable | None = None) -> tuple[Replica, float]:
        """The replica for the next request of ``unit`` and the seconds to wait before it."""
        now = self._clock()
        busy = {id(r) for r in self.replicas if unit is not None and r.units[unit]}
        ready = [r for r in self.replicas if r.not_before <= now]
        choices = [r for r in ready if id(r) not in busy] or ready
        if choices:
            return min(choices, key=lambda r: r.outstanding), 0.0
        soonest = min(self.replicas, key=lambda r: (r.not_before, r.outstanding))
        return soonest, soonest.not_before - now

    @contextmanager
    def serving(self, replica: Replica, unit: Hashable | None = None) -> Iterator[None]:
        """Count a request of ``unit`` as outstanding at ``replica`` while the block runs."""
        replica.outstanding += 1
        if unit is not None:
            replica.units[unit] += 1
        try:
            yield
        finally:
            replica.outstanding -= 1
            if unit is not None:
                replica.units[unit] -= 1
                if not replica.units[unit]:
                    del replica.units[unit]

    def wait_out(self, replica: Replica, seconds: float) -> None:
        """Leave ``replica`` out for ``seconds`` (its ``Retry-After``)."""
        replica.not_before = max(replica.not_before, self._clock() + seconds)
