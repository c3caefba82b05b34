"""The daemon loop every worker, gate server and resumer runs on (``gates._daemon.Loop``).

A due moment (``due``) cuts one wait short; it must never shorten the idle
pace that follows, or the loop wakes before the next due moment, finds
nothing due, and a caller that keeps its look for that moment loses it (the
worker's orphan scan behind a lost wake-up, with a heartbeat an hour away).
"""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from tailrace.gates._daemon import Loop
from tests import fixtures


class _Counts:
    errors = 0


async def test_a_due_moment_does_not_shorten_the_idle_pace_after_it() -> None:
    """Steps at an idle pace of forever, with a due moment 0.1 s then 0.25 s after a step:
    each step is taken at or after the moment it was due, none before."""
    stop = asyncio.Event()
    dues = [0.1, 0.25]
    pending: list[float] = []  # the monotonic moment the loop was told to step at
    early: list[float] = []
    steps = 0

    async def step() -> int:
        nonlocal steps
        now = time.monotonic()
        steps += 1
        if pending and now < pending[-1]:
            early.append(pending[-1] - now)
        if dues:
            pending.append(now + dues.pop(0))
        else:
            stop.set()
        return 0

    def due() -> float | None:
        return pending[-1] - time.monotonic() if pending else None

    loop = Loop(
        "test loop", step, interval=float("inf"), stats=_Counts(),
        logger=logging.getLogger("tests.loop"), due=due,
    )  # fmt: skip
    await asyncio.wait_for(loop.run(stop), fixtures.HANG_GUARD)
    assert steps == 3
    assert early == [], f"stepped {early} s before a due moment"


async def test_an_idle_loop_still_backs_off_and_work_resets_the_pace() -> None:
    """Idle steps wait the interval, doubling up to the cap; a step that worked starts over."""
    stop = asyncio.Event()
    waits: list[float] = []
    last = time.monotonic()
    work = [0, 0, 0, 1, 0]

    async def step() -> int:
        nonlocal last
        now = time.monotonic()
        waits.append(now - last)
        last = now
        if not work:
            stop.set()
            return 0
        return work.pop(0)

    loop = Loop(
        "test loop", step, interval=0.02, max_interval=0.05, stats=_Counts(),
        logger=logging.getLogger("tests.loop"),
    )  # fmt: skip
    await asyncio.wait_for(loop.run(stop), fixtures.HANG_GUARD)
    # After each step: idle 0.04, 0.05 (capped), 0.05; worked: 0.02; idle 0.04.
    floors = [0.04, 0.05, 0.05, 0.02, 0.04]
    assert [w >= f * 0.9 for w, f in zip(waits[1:], floors, strict=True)] == [True] * 5, waits


async def test_a_failure_that_repeats_is_said_once_until_the_loop_works_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A store that is down fails every try alike: one traceback for the streak, a word when
    the loop works again, and a new streak is said again."""
    stop = asyncio.Event()
    outcomes = ["down", "down", "down", "ok", "down", "other", "stop"]

    async def step() -> int:
        outcome = outcomes.pop(0)
        if outcome == "stop":
            stop.set()
        elif outcome != "ok":
            raise RuntimeError(f"the store is {outcome}")
        return 1

    counts = _Counts()
    loop = Loop(
        "test loop", step, interval=0.001, stats=counts, logger=logging.getLogger("tests.loop")
    )
    with caplog.at_level(logging.INFO, logger="tests.loop"):
        await asyncio.wait_for(loop.run(stop), fixtures.HANG_GUARD)
    said = [(r.levelname, r.getMessage(), r.exc_info is not None) for r in caplog.records]
    assert said == [
        ("ERROR", "test loop failed; trying again until it works", True),
        ("INFO", "test loop works again", False),
        ("ERROR", "test loop failed; trying again until it works", True),
        ("ERROR", "test loop failed; trying again until it works", True),  # another reason
        ("INFO", "test loop works again", False),
    ]
    assert counts.errors == 5
