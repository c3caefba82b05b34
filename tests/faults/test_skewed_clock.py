"""A worker whose clock runs an hour ahead, in a fleet on Postgres (W4).

Ticks are judged by one clock, the store's (on Postgres, the server's): the
skewed worker can neither submit a tick an hour early nor move the
schedule's last tick ahead, so the fleet's other workers go on submitting
every tick as it comes, each once.

The skew is real, not a seam of tailrace's: the worker is a ``tailrace
worker`` process started under libfaketime (``LD_PRELOAD``,
``FAKETIME=+1h``), so every wall clock it reads (``time.time``,
``datetime.now``, SQLite's) is an hour ahead, as on a host whose clock
drifted, while its monotonic clock keeps time. A seam in tailrace (an
environment variable only tests set) would skew only the clocks it was put
in front of, and so could not show that no other one decides a tick.
Skipped where Debian's libfaketime is not installed (``.ci/run`` installs
it) or does not reach this interpreter, and without a Postgres server.
"""

from __future__ import annotations

import contextlib
import datetime
import glob
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tailrace import Engine, Schedule
from tailrace._codec import DEFAULT_CODEC
from tailrace.stores import RunStatus, RunStore, open_store
from tailrace.tail import Cron
from tests import fixtures
from tests.workers.test_fleet import Fleet, graphs

SKEW = 3600.0
#: Debian's library (package libfaketime), wherever its multiarch directory is.
FAKETIME = next(iter(sorted(glob.glob("/usr/lib/*/faketime/libfaketime.so.1"))), None)

pytestmark = [
    pytest.mark.slow,  # worker processes, and a wait for the next minute's tick
    pytest.mark.postgres,
    pytest.mark.skipif(
        fixtures.POSTGRES_DSN is None, reason="TAILRACE_TEST_POSTGRES_DSN is not set"
    ),
    pytest.mark.skipif(
        FAKETIME is None,
        reason="no libfaketime: install Debian's package (apt-get install -y libfaketime)",
    ),
]


def skewed_env() -> dict[str, str]:
    """The environment of a process whose wall clocks run ``SKEW`` seconds ahead."""
    assert FAKETIME is not None
    return {
        "LD_PRELOAD": FAKETIME,
        "FAKETIME": f"+{SKEW:.0f}s",
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",  # asyncio's timers keep time
    }


def require_skew() -> None:
    """Skip unless libfaketime really moves this interpreter's clock."""
    probe = [sys.executable, "-c", "import time; print(time.time())"]
    real = float(subprocess.run(probe, capture_output=True, text=True, check=True).stdout)
    env = {**os.environ, **skewed_env()}
    shown = subprocess.run(probe, env=env, capture_output=True, text=True, check=True).stdout
    if abs(float(shown) - real - SKEW) > 120:
        pytest.skip(f"libfaketime does not skew this interpreter (it read {shown.strip()})")


@contextlib.contextmanager
def fleet(schema: str, tmp_path: Path) -> Iterator[Fleet]:
    """``tailrace worker`` processes on ``schema``, stopped on the way out."""
    workers = Fleet("postgres", tmp_path, schema)
    try:
        yield workers
    finally:
        workers.stop_all()


async def test_a_worker_an_hour_ahead_neither_fires_early_nor_silences_the_schedule(
    tmp_path: Path,
) -> None:
    require_skew()
    every_minute = Cron("* * * * *")
    async with fixtures.postgres_schema() as schema, open_store(fleet_url(schema)) as store:
        declared = await store.now() - 600  # ten minutes ago: the current tick is due
        schedule = Schedule(graphs.chain, "* * * * *", 1, name="ticks", queue="ticks")
        await store.declare_schedule(schedule.row(DEFAULT_CODEC, declared))
        with fleet(schema, tmp_path) as workers:
            workers.start(
                "-q", "ticks", env=skewed_env()
            )  # first, so it looks first: the tick is its to take
            await fixtures.until(lambda: _fired(store), "the skewed worker's first look", guard=60)
            now = await store.now()
            (row,) = await store.schedules()
            report = f"store clock {now}, schedule {row}\n{logs(workers)}"
            assert row.last_tick is not None and row.last_tick <= now, report  # not moved ahead
            workers.start("-q", "ticks")
            # The fleet goes on: the next minute's tick is submitted when it comes.
            following = every_minute.next_after(now)
            await fixtures.until(
                lambda: _ticked(store, following), "the next minute's tick", guard=150
            )
            now = await store.now()
            runs = await store.list_runs(queue="ticks", limit=100)
            ticks = sorted(_tick_of(r.run_id) for r in runs)
            (row,) = await store.schedules()
            report = f"store clock {now}, ticks {ticks}, last {row.last_tick}\n{logs(workers)}"
            assert ticks and max(ticks) <= now, report  # no tick from the future
            assert row.last_tick is not None and row.last_tick <= now, report
            assert following in ticks, report
            assert len(ticks) == len(set(ticks)), report  # one run per tick
            engine = Engine(store=store)
            for run in runs:
                result = await engine.wait(run.run_id, timeout=fixtures.HANG_GUARD * 2)
                assert (result.status, result.output) == (RunStatus.COMPLETED, 4), report


def fleet_url(schema: str) -> str:
    return Fleet("postgres", Path(), schema).url


def logs(workers: Fleet) -> str:
    return "\n".join(workers.log(n) for n in range(len(workers.workers)))


def _tick_of(run_id: str) -> float:
    """The tick a scheduled run's id names (``ticks@YYYY-MM-DDTHH:MMZ``)."""
    stamp = run_id.partition("@")[2]
    at = datetime.datetime.strptime(stamp, "%Y-%m-%dT%H:%MZ").replace(tzinfo=datetime.UTC)
    return at.timestamp()


async def _last_tick(store: RunStore) -> float:
    (row,) = await store.schedules()
    assert row.last_tick is not None
    return row.last_tick


async def _fired(store: RunStore) -> bool:
    return bool(await store.list_runs(queue="ticks", limit=1))


async def _ticked(store: RunStore, tick: float) -> bool:
    return any(_tick_of(r.run_id) == tick for r in await store.list_runs(queue="ticks", limit=100))
