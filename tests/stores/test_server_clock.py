"""How a Postgres store follows its server's clock (``stores/postgres/_clock.py``, D6).

The samples here are made up (a server clock a fixed offset from this
process's monotonic clock, round trips of chosen lengths), so the choice of
offset is checked exactly; ``tests/faults/test_skewed_clock.py`` checks the
store's clock against a real server from a host an hour off.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import pytest

from tailrace.stores.postgres._clock import MAX_DRIFT, Sample, ServerClock

#: The server's clock, this far from this process's monotonic clock.
OFFSET = 1_700_000_000.0


def samples(*trips: float, skew: float = 0.0) -> list[Sample]:
    """Samples taken now with round trips ``trips``, the server read at each trip's start
    (the worst case: the middle of the trip errs by half of it), ``skew`` off ``OFFSET``."""
    now = time.monotonic()
    return [(now, now + OFFSET + skew, now + trip) for trip in trips]


def sending(taken: list[Sample]) -> Callable[[], Awaitable[Sample]]:
    """A sampler that hands out ``taken``, one a call."""
    left = list(taken)

    async def sample() -> Sample:
        return left.pop(0)

    return sample


async def test_the_offset_comes_from_the_shortest_round_trip_within_half_of_it() -> None:
    clock = ServerClock("test")
    await clock.measure(sending(samples(0.4, 0.01, 0.2)), 3)
    read = clock()
    assert read - (time.monotonic() + OFFSET) == pytest.approx(-0.005, abs=0.002)
    assert clock.error() == pytest.approx(0.005, abs=0.001)


async def test_a_slower_refresh_keeps_the_tighter_offset_and_a_faster_one_replaces_it() -> None:
    clock = ServerClock("test")
    await clock.measure(sending(samples(0.002)), 1)
    assert not clock.due()  # a minute to the next measurement
    # A refresh whose best round trip was slow, whose server reading is a second off: kept out.
    await clock.measure(sending(samples(4.0, 3.0, skew=1.0)), 2)
    assert abs(clock() - (time.monotonic() + OFFSET)) < 0.01
    assert clock.error() < 0.002 + 60 * MAX_DRIFT
    # A faster one, a second off (the server's clock was stepped): taken.
    await clock.measure(sending(samples(0.001, skew=1.0)), 1)
    assert clock() - (time.monotonic() + OFFSET) == pytest.approx(1.0, abs=0.01)


def test_before_a_measurement_the_hosts_clock_stands_in() -> None:
    clock = ServerClock("test")
    assert clock.due()
    assert abs(clock() - time.time()) < 1.0
