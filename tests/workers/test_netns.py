"""Hosts that vanish: workers in network namespaces of their own, one host's link cut mid-run.

A private PostgreSQL 15 listens on TCP in one namespace; each "host" is a
namespace with a veth pair to it and a real ``tailrace worker`` process
reaching the server over TCP. Host A's link goes down while its runs are in
flight: the other hosts adopt them once their leases expire (W3, D6) and
finish them, with no committed visit run twice. Then the link comes back: A's
fencing token no longer holds, so nothing it writes lands, and it lets go of
every run. The test process itself reaches the server over its Unix socket
(file-system sockets are not namespaced).

Needs root, ``ip netns`` and PostgreSQL 15 in ``/usr/lib/postgresql/15/bin``
(override with ``TAILRACE_PG_BINDIR``); skipped with the reason otherwise.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tailrace import Engine
from tailrace.stores import RunStatus, open_store
from tests import fixtures

pytestmark = pytest.mark.slow  # a PostgreSQL server and three worker processes

GRAPHS = Path(__file__).with_name("netns_graphs.py")
graphs = fixtures.load_module("netns_graphs", GRAPHS)
until = fixtures.until
PG_BIN = Path(os.environ.get("TAILRACE_PG_BINDIR", "/usr/lib/postgresql/15/bin"))
SUBNET = "10.213"  # inside the namespaces only: no clash with the machine's own addresses
LEASE_TTL = 3.0
HOSTS = 3
#: The ``tailrace`` command line, its log at INFO with timestamps (how each run ended).
WORKER = [
    sys.executable, "-c",
    "import logging; logging.basicConfig(level=logging.INFO,"
    " format='%(asctime)s %(name)s %(levelname)s %(message)s');"
    " from tailrace.cli import main; main()",
]  # fmt: skip


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, check=check, timeout=30)


def _why_not() -> str | None:
    """Why this machine cannot run the test, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    if shutil.which("runuser") is None:
        return "no `runuser` (initdb refuses root: the server runs as `postgres`)"
    if not (PG_BIN / "postgres").exists():
        return f"no PostgreSQL server at {PG_BIN} (set TAILRACE_PG_BINDIR)"
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        return "no `postgres` user to run the server as"
    probe = f"trprobe{uuid.uuid4().hex[:6]}"
    made = _run("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"the kernel refused a network namespace: {made.stderr.strip()}"
    _run("ip", "netns", "del", probe, check=False)
    return None


@dataclass
class Hosts:
    """Namespaces (a server's and ``HOSTS`` hosts'), their veths, the server and the workers."""

    tmp_path: Path
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:5])
    namespaces: list[str] = field(default_factory=list)
    pg_dir: Path | None = None
    server: subprocess.Popen[bytes] | None = None
    workers: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def server_ns(self) -> str:
        return f"tr{self.tag}pg"

    def host_ns(self, n: int) -> str:
        return f"tr{self.tag}h{n}"

    def veth(self, n: int) -> str:
        return f"tr{self.tag}v{n}"  # the host's end (at most 15 characters: tr+5+v+1)

    # -- the network --------------------------------------------------------------------------

    def build(self) -> None:
        for ns in (self.server_ns, *(self.host_ns(n) for n in range(1, HOSTS + 1))):
            _run("ip", "netns", "add", ns)
            self.namespaces.append(ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        for n in range(1, HOSTS + 1):
            here, there = self.veth(n), f"tr{self.tag}p{n}"
            _run("ip", "link", "add", here, "netns", self.host_ns(n), "type", "veth",
                 "peer", "name", there, "netns", self.server_ns)  # fmt: skip
            _run("ip", "-n", self.server_ns, "addr", "add", f"{SUBNET}.{n}.1/24", "dev", there)
            _run("ip", "-n", self.server_ns, "link", "set", there, "up")
            _run("ip", "-n", self.host_ns(n), "addr", "add", f"{SUBNET}.{n}.2/24", "dev", here)
            _run("ip", "-n", self.host_ns(n), "link", "set", here, "up")

    def link(self, n: int, state: str) -> None:
        """Cut (``down``) or restore (``up``) host ``n``'s link, from inside its namespace."""
        _run("ip", "netns", "exec", self.host_ns(n), "ip", "link", "set", self.veth(n), state)

    # -- the server ---------------------------------------------------------------------------

    def as_postgres(self, *args: str) -> list[str]:
        return ["runuser", "-u", "postgres", "--", *args]

    def start_server(self) -> str:
        """A fresh cluster listening on every address of its namespace; returns the socket DSN."""
        self.pg_dir = Path(tempfile.mkdtemp(prefix="tailrace-netns-pg."))
        shutil.chown(self.pg_dir, "postgres", "postgres")
        data = self.pg_dir / "data"
        _run(*self.as_postgres(str(PG_BIN / "initdb"), "-D", str(data), "-U", "postgres",
                               "-A", "trust", "-E", "UTF8", "--no-sync"))  # fmt: skip
        with (data / "pg_hba.conf").open("a") as hba:
            hba.write(f"host all all {SUBNET}.0.0/16 trust\n")
        with (self.pg_dir / "server.log").open("wb") as log:
            self.server = subprocess.Popen(
                ["ip", "netns", "exec", self.server_ns, *self.as_postgres(
                    str(PG_BIN / "postgres"), "-D", str(data), "-k", str(self.pg_dir),
                    "-c", "listen_addresses=*", "-c", "fsync=off", "-c", "max_connections=200",
                )],
                stdout=log, stderr=log,
            )  # fmt: skip
        deadline = time.monotonic() + 30
        ready = (str(PG_BIN / "pg_isready"), "-q", "-h", str(self.pg_dir))
        while _run(*ready, check=False).returncode:
            if time.monotonic() > deadline or self.server.poll() is not None:
                raise RuntimeError(f"the server did not start: {self.server_log()}")
            time.sleep(0.1)
        _run(str(PG_BIN / "createdb"), "-h", str(self.pg_dir), "-U", "postgres", "tailrace")
        return f"postgresql://postgres@/tailrace?host={self.pg_dir}"

    def server_log(self) -> str:
        assert self.pg_dir is not None
        return (self.pg_dir / "server.log").read_text(errors="replace")

    def stop_server(self) -> None:
        if self.pg_dir is None:
            return
        data = self.pg_dir / "data"
        if self.server is not None and self.server.poll() is None:
            stopped = _run(*self.as_postgres(str(PG_BIN / "pg_ctl"), "-D", str(data), "-m", "fast",
                                             "-w", "-t", "20", "stop"), check=False)  # fmt: skip
            if stopped.returncode != 0 and (data / "postmaster.pid").exists():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    pid = int((data / "postmaster.pid").read_text().split()[0])
                    os.kill(pid, signal.SIGKILL)  # the postmaster, by its own pid
            try:
                self.server.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.server.kill()
                self.server.wait()
        shutil.rmtree(self.pg_dir, ignore_errors=True)

    # -- the workers --------------------------------------------------------------------------

    def dsn(self, n: int) -> str:
        """Host ``n``'s DSN, over TCP; a connection with data unacknowledged for 2 s breaks."""
        return (
            f"postgresql://postgres@{SUBNET}.{n}.1:5432/tailrace?connect_timeout=2"
            "&tcp_user_timeout=2000&keepalives=1&keepalives_idle=1&keepalives_interval=1"
            "&keepalives_count=2"
        )

    def start_worker(self, n: int, crawl: float, concurrency: int) -> subprocess.Popen[bytes]:
        environ = {k: v for k, v in os.environ.items() if not k.startswith("TAILRACE_")}
        environ.update({
            graphs.SIDE_ENV: str(self.side), graphs.CRAWL_ENV: str(crawl), "COLUMNS": "300",
        })  # fmt: skip
        args = [
            "ip", "netns", "exec", self.host_ns(n), *WORKER, "worker",
            "--db", self.dsn(n), "--graphs", str(GRAPHS), "--lease-ttl", str(LEASE_TTL),
            "--heartbeat", "0.5", "--concurrency", str(concurrency), "--grace", "1",
        ]  # fmt: skip
        with (self.tmp_path / f"worker-{n}.log").open("wb") as log:
            proc = subprocess.Popen(args, stdout=log, stderr=log, env=environ)
        self.workers[n] = proc  # `ip netns exec` execs the command: this is the worker's pid
        return proc

    def log(self, n: int) -> str:
        return (self.tmp_path / f"worker-{n}.log").read_text(errors="replace")

    @property
    def side(self) -> Path:
        return self.tmp_path / "side.log"

    def times(self) -> dict[tuple[str, str, int, str], float]:
        """When each (run, node, pid) ``started`` and was ``stopped``, from the side file's
        ``.times`` (the hosts share one clock)."""
        path = Path(f"{self.side}.times")
        found: dict[tuple[str, str, int, str], float] = {}
        if path.exists():
            for line in path.read_text().splitlines():
                run_id, node_id, pid, event, when = line.split()
                found[(run_id, node_id, int(pid), event)] = float(when)
        return found

    def starts(self) -> collections.Counter[tuple[str, str, int, int]]:
        """How often each (run, node, visit, pid) started, from the side file."""
        counts: collections.Counter[tuple[str, str, int, int]] = collections.Counter()
        if self.side.exists():
            for line in self.side.read_text().splitlines():
                run_id, node_id, visit, pid = line.split()
                counts[(run_id, node_id, int(visit), int(pid))] += 1
        return counts

    def stop_workers(self) -> None:
        for proc in self.workers.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.workers.values():
            try:
                proc.wait(timeout=fixtures.HANG_GUARD)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def tear_down(self) -> None:
        self.stop_workers()
        self.stop_server()
        for ns in reversed(self.namespaces):  # deleting a namespace deletes its veth ends
            _run("ip", "netns", "del", ns, check=False)


@pytest.fixture
def hosts(tmp_path: Path) -> Iterator[Hosts]:
    reason = _why_not()
    if reason is not None:
        pytest.skip(reason)
    made = Hosts(tmp_path)
    try:
        made.build()
        yield made
    finally:
        made.tear_down()


async def _all_completed(engine: Engine, ids: list[str]) -> bool:
    assert engine.store is not None
    for run_id in ids:
        if (await engine.store.get_run(run_id)).status is not RunStatus.COMPLETED:
            return False
    return True


async def _settled(engine: Engine, ids: list[str]) -> dict[str, tuple[object, ...]]:
    """Each run's status, committed results and events: what a late write would change."""
    assert engine.store is not None
    store = engine.store
    return {
        run_id: (
            (await store.get_run(run_id)).status,
            *[await store.results(run_id, node) for node in ("hop", "crawl", "land")],
            await store.events(run_id),
        )
        for run_id in ids
    }


@pytest.mark.parametrize(
    "crawl",
    [
        pytest.param(2.0, id="handlers-end-while-cut"),  # their commits wait, then are refused
        pytest.param(60.0, id="handlers-run-on"),  # a lease beat finds the lease taken over
    ],
)
async def test_a_cut_hosts_runs_are_adopted_and_it_lets_go_when_its_link_returns(
    hosts: Hosts, crawl: float
) -> None:
    socket_dsn = await asyncio.to_thread(hosts.start_server)
    async with open_store(socket_dsn) as store:
        submitter = Engine(store=store)
        # Host 1 alone takes three runs (all its slots) and crawls them slowly.
        cut = hosts.start_worker(1, crawl=crawl, concurrency=3)
        doomed = [await submitter.submit(graphs.hops, n) for n in range(3)]

        async def crawling() -> bool:
            started = {(r, node) for r, node, _, pid in hosts.starts() if pid == cut.pid}
            if not all((r, "crawl") in started for r in doomed):
                return False
            return all([await store.results(r, "hop") for r in doomed])

        await until(crawling, "host 1 to crawl its three runs, hop committed", guard=30)
        hosts.link(1, "down")  # before its crawls end: their results never reach the server
        cut_at = time.monotonic()
        others = [hosts.start_worker(n, crawl=0.5, concurrency=4) for n in (2, 3)]
        spared = [await submitter.submit(graphs.hops, n) for n in range(3, 6)]
        await until(lambda: _all_completed(submitter, doomed + spared), "every run", guard=40)
        adopted_after = time.monotonic() - cut_at
        before = await _settled(submitter, doomed + spared)
        outputs = {r: (await submitter.wait(r, timeout=5)).output for r in doomed + spared}
        assert cut.poll() is None, hosts.log(1)  # cut off, not dead

        # The link returns: host 1's commits and lease beats find their token stale.
        hosts.link(1, "up")

        async def let_go() -> bool:
            mine = [w for w in await store.workers() if f":{cut.pid}:" in w.worker_id]
            return bool(mine) and mine[0].seen_at > time.time() - 1 and mine[0].running == 0

        await until(let_go, "host 1 to report again, driving nothing", guard=30)
        cut.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(cut.wait, fixtures.HANG_GUARD)
        after = await _settled(submitter, doomed + spared)
        for proc in others:
            assert proc.poll() is None, hosts.log(others.index(proc) + 2)

    assert code == 0, hosts.log(1)
    stopped = re.search(r"stopped: WorkerStats\((.*)\)", hosts.log(1))
    assert stopped is not None, hosts.log(1)
    stats = dict(pair.split("=", 1) for pair in stopped.group(1).split(", ")[:-1])
    # It let go of its runs: none completed or failed there, no error. Cut off, it could
    # not renew their leases: it stopped each before its lease could expire (counted
    # lapsed, W7), and said so once (a log line per outage, not per run).
    assert (stats["claimed"], stats["completed"], stats["failed"]) == ("3", "0", "0"), stats
    assert stats["errors"] == "0", stats
    if crawl > 30:
        assert stats["lapsed"] == "3", stats
    assert hosts.log(1).count("is cut off from the store") == 1, hosts.log(1)
    times = hosts.times()
    for run_id in doomed:
        if crawl > 30:  # host 1 stopped its crawl before any adopter started its own
            stop = times[(run_id, "crawl", cut.pid, "stopped")]
            adopter_start = times[(run_id, "crawl", outputs[run_id]["pid"], "started")]
            assert stop < adopter_start, (stop, adopter_start)
    # Leases of LEASE_TTL seconds: adoption waits them out (host 1's pid lives on this host).
    assert adopted_after >= LEASE_TTL, adopted_after
    assert after == before  # nothing host 1 wrote after the cut landed
    starts = hosts.starts()
    by_visit: collections.Counter[tuple[str, str, int]] = collections.Counter()
    for (run_id, node_id, visit, _), count in starts.items():
        by_visit[(run_id, node_id, visit)] += count
    adopters = {p.pid for p in others}
    for run_id in doomed:
        # The committed crawl, and what followed it, are an adopter's.
        assert outputs[run_id]["pid"] in adopters, outputs[run_id]
        assert outputs[run_id]["landed"] in adopters, outputs[run_id]
        assert by_visit[(run_id, "hop", 1)] == 1  # committed before the cut: never re-run
        # Host 1's crawl (and its land, when the crawl ended while cut off: commits are
        # pipelined) never committed; the adopter ran each visit once more, and committed it.
        ours = collections.Counter((n, p) for (r, n, _, p), c in starts.items() if r == run_id)
        assert ours[("crawl", cut.pid)] == 1, ours
        assert ours[("crawl", outputs[run_id]["pid"])] == 1, ours
        assert ours[("land", outputs[run_id]["landed"])] == 1, ours
        assert sum(ours.values()) == 4 + ours[("land", cut.pid)], ours  # hop, 2 crawls, land
        # A crawl that ended while cut off may have started its land before the lease
        # lapsed (commits are pipelined); one still running never did.
        assert ours[("land", cut.pid)] in ((0, 1) if crawl < LEASE_TTL else (0,)), ours
        assert before[run_id][0] is RunStatus.COMPLETED
    for run_id in spared:
        assert [by_visit[(run_id, node, 1)] for node in ("hop", "crawl", "land")] == [1, 1, 1]
        assert outputs[run_id]["pid"] in adopters, outputs[run_id]  # host 1 had no slot free
    assert len(by_visit) == 3 * len(doomed + spared)


def test_the_skip_says_why_the_machine_cannot_run_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert _why_not() == "network namespaces need root (ip netns add)"
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(shutil, "which", lambda name: None if name == "ip" else f"/bin/{name}")
    assert _why_not() == "no `ip` command (iproute2)"
    monkeypatch.setattr(shutil, "which", lambda name: f"/bin/{name}")
    monkeypatch.setattr(subprocess, "run", _refused)
    monkeypatch.setattr(pwd, "getpwnam", lambda name: None)
    monkeypatch.setattr(Path, "exists", lambda self: True)
    reason = _why_not()
    assert reason == "the kernel refused a network namespace: mount --make-shared failed"


def _refused(args: object, **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.CompletedProcess(args, 1, "", "mount --make-shared failed\n")
