"""Hosts that vanish: workers on hosts of their own, one host cut off from Postgres mid-run.

On a :class:`~tests.workers._netns.Network` (a private PostgreSQL 15 in one
network namespace; three hosts, each a namespace with its own veth pair to it and
its own host name), real ``tailrace worker`` processes reach the server over TCP.
Host 1 takes three runs of ``fleet_graphs.slow``; once each one's ``warm`` is
committed and its ``crawl`` running, host 1 is cut off (its link down, or every
packet dropped both ways). Hosts 2 and 3 adopt its runs as soon as the server
drops host 1's session into the dead link (its keepalives: the ring buries it,
W7) or its leases expire, whichever comes first (W3, D6); host 1 stops each
crawl still running as its lease lapses, and says so once. They hold the runs in
their own crawls while the link returns: host 1's commits and lease beats then
meet a newer fencing token, while the runs are still running (so no finished
status refuses them in its stead): nothing host 1 writes lands, and it lets go
of every run. Then the adopters finish; no
committed visit started again (D1: the handlers' start log against the committed
rows, as bench/fleet.py's torture checks it), and host 1 exits cleanly.

Needs root, ``ip netns`` and PostgreSQL 15 (see ``_netns.why_not``); skipped with
the reason otherwise.
"""

from __future__ import annotations

import asyncio
import collections
import os
import pwd
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tailrace import Engine
from tailrace.core import stretches_of
from tailrace.stores import RunStatus, RunStore, open_store
from tests import fixtures
from tests.workers import _netns

pytestmark = pytest.mark.slow  # a PostgreSQL server and three worker processes

GRAPHS = Path(__file__).with_name("fleet_graphs.py")
graphs = fixtures.load_module("fleet_graphs", GRAPHS)
fleet = _netns.fleet
until = fixtures.until
LEASE_TTL = 3.0
#: Every worker's options: 3 s leases (beaten every second), a heartbeat every half second.
OPTIONS = {"lease_ttl": LEASE_TTL, "heartbeat": 0.5, "grace": 1}
#: ``PostgresStore``'s default ``retry_budget``: a call cut off longer than this gives up.
RETRY_BUDGET = 15.0


@pytest.fixture
def net(tmp_path: Path) -> Iterator[_netns.Network]:
    with _netns.network(tmp_path, hosts=3) as made:
        yield made


async def _crawling(store: RunStore, side: Path, runs: list[str], times: int = 1) -> bool:
    """Whether every run's ``crawl`` started ``times`` times and its ``warm`` is committed."""
    started = collections.Counter(await asyncio.to_thread(_lines, side))
    if not all(started[f"{r} crawl 1"] >= times for r in runs):
        return False
    return all([await store.results(r, "warm") for r in runs])


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


async def _all_completed(store: RunStore, runs: list[str]) -> bool:
    return all([(await store.get_run(r)).status is RunStatus.COMPLETED for r in runs])


async def _held(store: RunStore, runs: list[str]) -> dict[str, tuple[object, ...]]:
    """Each run's status, lease (owner, token) and crawl results: what a write of an owner
    that lost the lease would change while the new owner holds the run."""
    held = {}
    for r in runs:
        record = await store.get_run(r)
        held[r] = (record.status, record.lease_owner, record.lease_token,
                   await store.results(r, "crawl"))  # fmt: skip
    return held


def _stats(log: str) -> dict[str, str]:
    """The counts of the ``stopped: WorkerStats(...)`` line a worker prints as it exits."""
    stopped = re.search(r"stopped: WorkerStats\((.*)\)", log)
    assert stopped is not None, log
    return dict(pair.split("=", 1) for pair in stopped.group(1).split(", ")[:-1])


@pytest.mark.parametrize(
    ("how", "end_while_cut"),
    [
        # Its sends fail at once; its handlers end while it is cut off, and their
        # commits retry until the link returns, then are refused.
        pytest.param("down", True, id="link-down-handlers-end"),
        # Every packet dropped both ways (TCP notices by its timeouts); its handlers
        # run on, and a lease beat finds each lease taken over once the link returns.
        pytest.param("drop", False, id="packets-dropped-handlers-run-on"),
    ],
)
async def test_a_cut_hosts_runs_are_adopted_and_nothing_it_writes_after_lands(
    net: _netns.Network, tmp_path: Path, end_while_cut: bool, how: str
) -> None:
    target = await asyncio.to_thread(net.start_postgres)
    side = fleet.SideFile(target)  # the handlers' start log: `run node visit` per start
    ended = tmp_path / "crawls-end"  # host 1's crawls end once it exists
    adopted = tmp_path / "adopters-crawls-end"  # and the other hosts' crawls
    crawl_on_1 = {"TAILRACE_TEST_CRAWL_UNTIL": str(ended)} if end_while_cut else {}

    def env(**crawl: str) -> dict[str, str]:
        return {graphs.SIDE_ENV: str(side.path), "TAILRACE_TEST_CRAWL": "3600", **crawl}

    async with open_store(target.url) as store:
        submitter = Engine(store=store)
        # Host 1 alone takes three runs (all its slots) and crawls them slowly.
        cut = net.start_worker(1, GRAPHS, env=env(**crawl_on_1), concurrency=3, **OPTIONS)
        doomed = [await submitter.submit(graphs.slow, n) for n in range(3)]
        await until(
            lambda: _crawling(store, side.path, doomed),
            "host 1 to crawl its three runs, warm committed", guard=60,
        )  # fmt: skip
        others = [
            net.start_worker(n, GRAPHS, env=env(TAILRACE_TEST_CRAWL_UNTIL=str(adopted)),
                             concurrency=4, **OPTIONS)
            for n in (2, 3)
        ]  # fmt: skip
        await asyncio.to_thread(net.wait_ready, others)
        net.cut(1, how)
        cut_at = time.time()
        ended.touch()  # (when host 1 waits for it) its crawls end now, while it is cut off
        expires = {r: (await store.get_run(r)).lease_expires for r in doomed}
        side.snapshot()  # every warm is committed: none may start again
        spared = [await submitter.submit(graphs.slow, n) for n in range(3, 6)]
        everyone = doomed + spared
        # The other hosts adopt host 1's runs and crawl them again; they hold them there.
        await until(
            lambda: _crawling(store, side.path, doomed, times=2),
            "host 1's runs to be adopted and crawling again", guard=90,
        )  # fmt: skip
        await until(lambda: _crawling(store, side.path, spared), "the spared runs to crawl")
        side.snapshot()
        before = await _held(store, doomed)
        assert cut.proc.poll() is None, cut.log.read_text()  # cut off, not dead
        said_while_cut = cut.log.read_text()

        # The link returns while the adopters hold the runs, still running: the fencing
        # token refuses host 1's commits and lease beats (D6).
        net.restore(1)
        cut_for = time.time() - cut_at

        async def let_go() -> bool:
            mine = [w for w in await store.workers() if f":{cut.proc.pid}:" in w.worker_id]
            return bool(mine) and mine[0].seen_at > time.time() - 1 and mine[0].running == 0

        await until(let_go, "host 1 to report again, driving nothing", guard=60)
        after = await _held(store, doomed)
        side.snapshot()
        adopted.touch()  # the adopters' crawls end: every run completes
        await until(lambda: _all_completed(store, everyone), "every run to complete", guard=60)
        side.snapshot()
        cut.proc.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(cut.proc.wait, fixtures.HANG_GUARD)
        events = {r: await store.events(r) for r in doomed}
        outputs = {r: (await submitter.wait(r, timeout=5)).output for r in everyone}
        for worker in others:
            assert worker.proc.poll() is None, worker.log.read_text()

    log = cut.log.read_text()
    assert code == 0, log
    assert after == before, log  # nothing host 1 wrote after the cut landed (D6)
    assert {h[0] for h in before.values()} == {RunStatus.RUNNING}, before
    assert all(h[3] == [] for h in before.values()), before
    stats = _stats(log)
    # It let go of its runs: none completed or failed there. Handlers still running end
    # in LeaseLost (counted busy); a run whose commit was retrying when the lease was
    # found lost ends its job cancelled, which the stats do not count. A call cut off
    # longer than the store's retry budget gives up (an error, logged); none is shorter.
    assert (stats["claimed"], stats["completed"], stats["failed"]) == ("3", "0", "0"), stats
    if cut_for < RETRY_BUDGET - 5:
        assert stats["errors"] == "0", log
    if not end_while_cut:
        # Its handlers were running when it was cut off: it stopped each, as its lease
        # lapsed before it could expire (W7: counted lapsed), or as a beat found its lease
        # taken over once the link returned (counted busy), and said so once.
        assert int(stats["lapsed"]) + int(stats["busy"]) == 3, stats
        assert int(stats["lapsed"]) >= 1, stats
        assert log.count("is cut off from the store") == 1, log

    checked = fleet.Stats(store="postgres", seed=0)
    side.check(checked)  # no visit committed at a snapshot started after it (D1)
    assert (checked.reexec_committed, checked.problems) == (0, []), checked.problems
    starts = collections.Counter(tuple(line.split()) for line in _lines(side.path))
    assert outputs == {r: n + 1 for n, r in enumerate(everyone)}
    delays = []
    for run_id in doomed:
        # Warm was committed before the cut: never run again. Host 1's crawl never
        # committed; an adopter on another host ran it once more, and committed it.
        assert starts[(run_id, "warm", "1")] == 1, starts
        assert starts[(run_id, "crawl", "1")] == 2, starts
        stretches = stretches_of(events[run_id])
        assert [s.how for s in stretches] == ["started", "resumed"], stretches
        first, adopter = (s.owner or "" for s in stretches)
        assert first.startswith(f"{net.hostname(1)}:{cut.proc.pid}:"), first
        assert adopter.split(":")[0] in (net.hostname(2), net.hostname(3)), adopter
        assert before[run_id][1] == adopter, (before[run_id], adopter)
        # The server drops host 1's session into the dead link (its keepalives) and the
        # fleet buries it, or its leases expire, whichever comes first (W7, W3): the runs
        # are adopted by then, not after another lease.
        expiry = expires[run_id]
        assert expiry is not None and stretches[1].started_at < expiry + LEASE_TTL, (
            stretches, expiry,
        )  # fmt: skip
        delays.append(stretches[1].started_at - cut_at)
    for run_id in spared:
        assert [starts[(run_id, node, "1")] for node in ("warm", "crawl")] == [1, 1], starts
    assert len(starts) == 2 * len(everyone)  # warm and crawl, visit 1 of each run
    print(
        f"cut ({how}) for {cut_for:.1f} s; adopted after "
        + ", ".join(f"{d:.2f}" for d in sorted(delays))
        + f" s (lease {LEASE_TTL:g} s); host 1 said while cut:\n{said_while_cut}"
    )


def test_the_skip_says_why_the_machine_cannot_run_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert _netns.why_not() == "network namespaces need root (ip netns add)"
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(shutil, "which", lambda name: None if name == "ip" else f"/bin/{name}")
    assert _netns.why_not() == "no `ip` command (iproute2)"
    monkeypatch.setattr(shutil, "which", lambda name: f"/bin/{name}")
    monkeypatch.setattr(subprocess, "run", _refused)
    monkeypatch.setattr(pwd, "getpwnam", lambda name: None)
    monkeypatch.setattr(Path, "exists", lambda self: True)
    reason = _netns.why_not()
    assert reason == "the kernel refused a network namespace: mount --make-shared failed"
    monkeypatch.setattr(subprocess, "run", _no_blackhole)
    reason = _netns.why_not()
    assert reason == (
        "no blackhole qdisc to drop a host's packets (tc): Error: Specified qdisc kind is unknown."
    )


def _refused(args: object, **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.CompletedProcess(args, 1, "", "mount --make-shared failed\n")


def _no_blackhole(args: tuple[str, ...], **kwargs: object) -> subprocess.CompletedProcess[str]:
    if "qdisc" in args:
        return subprocess.CompletedProcess(args, 2, "", "Error: Specified qdisc kind is unknown.\n")
    return subprocess.CompletedProcess(args, 0, "", "")
