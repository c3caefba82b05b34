"""The server's clock, followed from here: what a Postgres store stamps and judges times by.

Every worker of a fleet stamps leases' expiry, delays and its reports, and
judges others' leases expired, on one timeline, the server's
(``clock_timestamp()``), so that a host whose wall clock runs ahead or behind
neither writes leases that expire late (or early) for everyone else nor sees
others' live leases as expired. Reading the server for every stamp would cost
a round trip each; instead the store measures once how far the server's clock
is from this process's monotonic clock (which no one sets: a step of the
host's wall clock moves nothing here) and adds that offset.

One measurement sends ``SELECT clock_timestamp()`` a few times and keeps the
sample with the shortest round trip: the server read its clock somewhere
within that round trip, so taking its middle errs by at most half of it.
The offset is measured when the store opens and again at most once every
``REFRESH`` seconds (the next call to the store after that sends the samples
first), keeping the new offset only when its bound is the tighter one. The
error of :meth:`ServerClock.now` is therefore at most half the kept sample's
round trip plus the drift of the local monotonic clock against the server's
since it was taken (``MAX_DRIFT``, 500 ppm, the most NTP slews a clock: 0.3 s in
ten minutes; an undisciplined quartz drifts far less), plus any step of the
server's own clock since then.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable

logger = logging.getLogger("tailrace.stores.postgres")

#: The server's clock (seconds since the epoch): what every worker of a fleet reads alike.
SERVER_CLOCK = "SELECT EXTRACT(EPOCH FROM clock_timestamp())::float8"
#: Most seconds between two measurements of the offset: ten minutes, so an idle worker's
#: store adds two statements per ten minutes (its heartbeat is one transaction per 30 s),
#: for a drift of at most 0.3 s, well inside the sixth of a lease ttl by which a lease
#: that is not renewed lapses before it could expire (W7).
REFRESH = 600.0
#: Most rate difference, seconds per second, assumed between this host's monotonic clock and
#: the server's clock between two measurements.
MAX_DRIFT = 500e-6
#: Samples sent when the store opens, and at each refresh.
OPEN_SAMPLES, REFRESH_SAMPLES = 5, 2

#: One sample: the local monotonic clock before the round trip, the server's clock, after.
Sample = tuple[float, float, float]


class ServerClock:
    """The server's wall clock read from this process's monotonic clock plus a measured offset."""

    def __init__(self, where: str) -> None:
        self._where = where
        self._offset: float | None = None
        #: Half the kept sample's round trip, and when (monotonic) it was taken.
        self._half_trip = math.inf
        self._taken = 0.0
        self._next = 0.0

    def __call__(self) -> float:
        """The server's clock now, in seconds since the epoch (this host's before a measurement)."""
        if self._offset is None:
            return time.time()
        return time.monotonic() + self._offset

    def error(self) -> float:
        """The bound on how far :meth:`__call__` may be from the server's clock now, seconds."""
        return self._half_trip + (time.monotonic() - self._taken) * MAX_DRIFT

    def due(self) -> bool:
        """Whether the offset is to be measured (again) before the next call."""
        return time.monotonic() >= self._next

    async def measure(self, sample: Callable[[], Awaitable[Sample]], samples: int) -> None:
        """Send ``samples`` samples; keep the best if its bound beats the one held."""
        self._next = time.monotonic() + REFRESH  # one measurement at a time
        best: Sample | None = None
        for _ in range(samples):
            taken = await sample()
            if best is None or taken[2] - taken[0] < best[2] - best[0]:
                best = taken
        assert best is not None
        before, server, after = best
        half_trip = (after - before) / 2
        if self._offset is not None and half_trip > self.error():
            return  # a slow round trip: the held offset, drift included, is still the closer
        offset = server - (before + after) / 2
        if self._offset is not None and abs(offset - self._offset) > 1.0:
            logger.info(
                "%s: the server's clock moved %.3f s against this host's since the last "
                "measurement", self._where, offset - self._offset,
            )  # fmt: skip
        self._offset, self._half_trip, self._taken = offset, half_trip, after
