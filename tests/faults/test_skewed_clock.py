"""Workers whose clocks run an hour ahead or behind, in a fleet on Postgres (W4, D6).

Ticks are judged by one clock, the store's (on Postgres, the server's): the
skewed worker can neither submit a tick an hour early nor move the
schedule's last tick ahead, so the fleet's other workers go on submitting
every tick as it comes, each once. Leases are stamped and judged on the same
clock (the server's, followed by each store from its host): a worker an hour
ahead that stops renewing has its run adopted once its lease expires by the
server's clock, not an hour late; a worker an hour behind writes no lease
that others see expired, and neither adopts another's live run.

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

import asyncio
import contextlib
import datetime
import glob
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tailrace import Engine, LeaseLost, Schedule
from tailrace._codec import DEFAULT_CODEC
from tailrace.core import stretches_of
from tailrace.stores import RunStatus, RunStore, open_store
from tailrace.tail import Cron
from tests import fixtures
from tests.workers.test_fleet import Fleet, graphs
from tests.workers.test_fleet import fleet as bench

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


def skewed_env(skew: float = SKEW) -> dict[str, str]:
    """The environment of a process whose wall clocks run ``skew`` seconds ahead."""
    assert FAKETIME is not None
    return {
        "LD_PRELOAD": FAKETIME,
        "FAKETIME": f"{skew:+.0f}s",
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


#: A process under libfaketime: how far its store's clock is from the server's, seconds.
CLOCK_GAP = """
import asyncio, sys
from tailrace.stores import open_store

async def main() -> None:
    async with open_store(sys.argv[1]) as store:
        before = await store.now()
        here = store.clock()
        after = await store.now()
        print(max(before - here, here - after, 0.0))

asyncio.run(main())
"""


@pytest.mark.parametrize("skew", [SKEW, -SKEW])
async def test_a_stores_clock_on_a_skewed_host_reads_the_servers(skew: float) -> None:
    """``RunStore.clock()`` in a process whose wall clock is an hour off reads the server's
    clock (between two reads of it, within a second on any load), not its host's."""
    require_skew()
    async with fixtures.postgres_schema() as schema, open_store(fleet_url(schema)):
        env = {k: v for k, v in os.environ.items() if not k.startswith("TAILRACE_")}
        probe = [sys.executable, "-c", CLOCK_GAP, fleet_url(schema)]
        done = await asyncio.to_thread(
            subprocess.run, probe, env={**env, **skewed_env(skew)}, capture_output=True,
            text=True, check=False,
        )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert float(done.stdout) < 1.0, done.stdout


#: The leases of the lease tests' workers, and their heartbeat, seconds: short, so that a
#: lease expires many times over within a test, and an hour's skew dwarfs them.
TTL = ("--lease-ttl", 6, "--heartbeat", 1)


async def test_a_run_of_a_stopped_worker_an_hour_ahead_is_adopted_when_its_lease_expires(
    tmp_path: Path,
) -> None:
    """D6: a worker an hour ahead drives a run, then stops (SIGSTOP: its store session stays
    held at the server, so nobody buries it; it only stops renewing). Its lease was stamped
    on the server's clock, so a worker with a true clock adopts the run within the lease's
    6 s, not an hour later; the committed node is not run again; and when the stopped
    worker wakes, it stops the run unwritten (its lease lapsed while it slept), its lease
    renewal is refused (fenced), and the run stays as its adopter finished it."""
    require_skew()
    async with fixtures.postgres_schema() as schema, open_store(fleet_url(schema)) as store:
        engine = Engine(store=store)
        with fleet(schema, tmp_path) as workers:
            crawled = tmp_path / "crawled"  # the stopped worker's crawl ends once this exists
            ahead = workers.start(
                *TTL,
                "--concurrency",
                1,
                env={**skewed_env(), "TAILRACE_TEST_CRAWL_UNTIL": str(crawled)},
            )
            run_id = await engine.submit(graphs.slow, 1)
            await fixtures.until(
                lambda: _crawling(workers, store, run_id), "the skewed worker to crawl", guard=60
            )
            held = await store.get_run(run_id)  # the skewed worker's lease: owner and token
            assert held.lease_owner is not None and f":{ahead.pid}:" in held.lease_owner
            ahead.send_signal(signal.SIGSTOP)
            try:
                workers.start(*TTL, env={"TAILRACE_TEST_CRAWL": "0"})
                # An hour's lease would outlast this wait many times over.
                result = await engine.wait(run_id, timeout=60)
                report = f"{result}\n{logs(workers)}"
                assert (result.status, result.output) == (RunStatus.COMPLETED, 2), report
                finished = await store.get_run(run_id)
                events = await store.events(run_id)
            finally:
                ahead.send_signal(signal.SIGCONT)
            crawled.touch()  # were the woken worker still crawling, it would commit now
            await fixtures.until(
                lambda: _lost(workers, run_id), "the woken worker to lose the run", guard=60
            )
            report = logs(workers)
            assert await store.get_run(run_id) == finished, report  # nothing it wrote landed
            assert await store.events(run_id) == events, report
            with pytest.raises(LeaseLost):  # its renewal, were it made late, is fenced out
                await store.heartbeat(run_id, held.lease_owner, held.lease_token, 6.0)
            drivers = stretches_of(events)
    assert [d.how for d in drivers] == ["started", "resumed"], report
    assert drivers[0].owner is not None and f":{ahead.pid}:" in drivers[0].owner, report
    assert workers.starts()[(run_id, "warm", 1)] == 1, report  # committed: not run again
    assert workers.starts()[(run_id, "crawl", 1)] == 2, report  # cut short, then the adopter's


async def test_workers_an_hour_apart_adopt_none_of_each_others_live_runs(
    tmp_path: Path,
) -> None:
    """D6: workers an hour behind, on time and an hour ahead each drive a run for several of
    their leases' 6 s, renewing as they go: none of the runs is taken over (a worker behind
    would stamp leases already expired for the others, a worker ahead would see the others'
    live leases as expired, were leases on each host's clock), and each completes."""
    require_skew()
    async with fixtures.postgres_schema() as schema, open_store(fleet_url(schema)) as store:
        engine = Engine(store=store)
        with fleet(schema, tmp_path) as workers:
            crawl = {"TAILRACE_TEST_CRAWL": "20"}  # over three leases
            skews = (-SKEW, 0.0, SKEW)
            for n, skew in enumerate(skews):  # each claims from a queue of its own, with room
                # to spare for another's run (it adopts any run whose lease it sees expired)
                options = (*TTL, "--concurrency", 2, "-q", f"q{n}")
                workers.start(*options, env={**crawl, **(skewed_env(skew) if skew else {})})
            await fixtures.until(lambda: _present(store, 3), "three workers present", guard=60)
            ids = [await engine.submit(graphs.slow, n, queue=f"q{n}") for n in range(len(skews))]
            results = [await engine.wait(r, timeout=120) for r in ids]
            report = f"{results}\n{logs(workers)}"
            assert [(r.status, r.output) for r in results] == [
                (RunStatus.COMPLETED, n + 1) for n in range(len(skews))
            ], report
            drivers = {r: stretches_of(await store.events(r)) for r in ids}
    for run_id in ids:
        assert [d.how for d in drivers[run_id]] == ["started"], report  # never taken over
        assert workers.starts()[(run_id, "crawl", 1)] == 1, report
    pids = {f":{p.pid}:" for p in workers.workers}
    owners = {pid for r in ids for pid in pids if pid in (drivers[r][0].owner or "")}
    assert owners == pids, report  # each worker, whatever its clock, drove one run


async def _crawling(workers: Fleet, store: RunStore, run_id: str) -> bool:
    """Whether ``run_id`` is crawling, its warm committed (commits are pipelined)."""
    return (run_id, "crawl", 1) in workers.starts() and bool(await store.results(run_id, "warm"))


async def _present(store: RunStore, count: int) -> bool:
    return sum(w.session is not None for w in await store.workers()) >= count


def _lost(workers: Fleet, run_id: str) -> bool:
    """Whether the first worker's log says it lost ``run_id``'s lease."""
    return any(run_id in line and "lease" in line.lower() for line in workers.log(0).splitlines())


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


@pytest.mark.parametrize("skew", [SKEW, -SKEW])
async def test_the_cli_on_a_skewed_host_judges_leases_and_delays_by_the_servers_clock(
    skew: float,
) -> None:
    """``tailrace runs``, ``show`` and ``tail`` on a host an hour off: a run leased for ten
    minutes to a live worker elsewhere is running, not orphaned; a run delayed by ten
    minutes still waits for its moment; a run whose lease expired is orphaned."""
    require_skew()
    async with fixtures.postgres_schema() as schema, open_store(fleet_url(schema)) as store:
        engine = Engine(store=store)
        live, lapsed = [await engine.submit(graphs.chain, n) for n in (1, 2)]
        delayed = await engine.submit(graphs.chain, 3, not_before=store.clock() + 600.0)
        owner = "elsewhere:1:0:live"  # another host's worker: not judged by a pid here
        assert await store.claim_runs("default", owner, 600.0, limit=2) == [live, lapsed]
        record = await store.get_run(lapsed)
        await store.release_lease(lapsed, owner, record.lease_token)  # orphaned everywhere
        env = {k: v for k, v in os.environ.items() if not k.startswith("TAILRACE_")}
        env = {**env, **skewed_env(skew), "COLUMNS": "300"}

        def cli(*args: str) -> str:
            done = subprocess.run(
                [*bench.tailrace_command(), *args, "--db", fleet_url(schema)],
                env=env, capture_output=True, text=True, check=False,
            )  # fmt: skip
            assert done.returncode == 0 or args[0] == "tail", done.stderr
            return done.stdout + done.stderr

        runs = await asyncio.to_thread(cli, "runs")
        shown = await asyncio.to_thread(cli, "show", live)
        why = await asyncio.to_thread(cli, "tail", delayed, "--no-follow")
    cells = [[c.strip() for c in line.split("│")[1:-1]] for line in runs.splitlines()]
    rows = {row[0]: row[2] for row in cells if row}  # run id: status
    assert (rows[live], rows[lapsed]) == ("running", "running (orphaned)"), runs
    assert "status running" in shown and "orphaned" not in shown, shown
    assert "not before" in why, why
