"""Hosts of their own for fleet tests: network namespaces, a private Postgres, links to cut.

A :class:`Network` is one namespace for a PostgreSQL 15 server and ``hosts``
namespaces for workers, each joined to the server's by a veth pair of its own
(a point-to-point /24: host ``n`` is ``10.213.n.2``, its server end
``10.213.n.1``). The addresses exist only inside the namespaces, so parallel
tests never collide; every name (namespaces, veths, host names) carries a
random tag, so neither do theirs. Each process on host ``n`` also gets a UTS
namespace whose host name is :meth:`Network.hostname`, so its lease owner
(``host:pid:start:nonce``) names its host as on a real fleet: a worker on
another host cannot tell by its pid whether it is alive, only by the store.
The test process itself reaches the server over its Unix socket (file-system
sockets are not namespaced), which no cut touches.

Use::

    from tests.workers import _netns

    with _netns.network(tmp_path, hosts=3) as net:  # skips the test, saying why, if it cannot
        target = net.start_postgres()                # bench/fleet.py's Target (Unix socket)
        async with open_store(target.url) as store:
            worker = net.start_worker(1, GRAPHS, env={...}, lease_ttl=3, heartbeat=0.5)
            await asyncio.to_thread(net.wait_ready, [worker])
            net.cut(1)                               # or net.cut(1, how="drop")
            ...
            net.restore(1)
    # everything it started is stopped and every namespace it made deleted, failed test or not

API:

- :func:`why_not` is ``None`` when this machine can run such a test, else the
  reason (not root, no ``ip``/``tc``/``unshare``/``runuser``, no PostgreSQL
  at ``$TAILRACE_PG_BINDIR`` or ``/usr/lib/postgresql/15/bin``, no
  ``postgres`` user, the kernel refuses a namespace, a veth pair or a
  blackhole qdisc). :func:`network` skips with it.
- :func:`network(workdir, hosts) <network>` is a context manager: builds the
  namespaces and links, yields the :class:`Network`, and tears everything down
  on the way out (:meth:`Network.close`).
- :meth:`Network.start_postgres(**settings) <Network.start_postgres>` starts
  the server in its namespace (``-c key=value`` per setting, over
  :data:`SERVER`: every address, ``fsync=off``, 200 connections, a session
  into a dead link dropped within ~3 s; trust for the hosts' subnet),
  creates its database and returns the test's :class:`Target` (a fresh
  schema, reached over the Unix socket; ``target.rows(sql)`` reads it).
  :meth:`Network.host_target(n, **libpq) <Network.host_target>` is the same
  schema as host ``n`` reaches it, over TCP, with :data:`LIBPQ` options
  (a connection into a dead link breaks within 2 s instead of hanging) and
  any given in ``libpq``.
- :meth:`Network.start_worker(host, graph_file, ...) <Network.start_worker>`
  starts a ``tailrace worker`` (bench/fleet.py's :class:`WorkerProcess`: its
  ``proc.pid`` is the worker's own pid, its output in ``worker.log``) on host
  ``host``; ``queues``, ``env`` (added to its environment) and ``libpq`` as
  above, and every other keyword becomes a ``--flag value`` of the command
  (``lease_ttl=3`` is ``--lease-ttl 3``). :meth:`Network.wait_ready` waits for
  the banners (blocking: run it in a thread from async code).
- :meth:`Network.spawn(host, args, name=, env=) <Network.spawn>` runs any other
  command on host ``host`` (a script opening its own engine, say), its output
  in ``workdir/NAME.log``; it is stopped with the rest.
- :meth:`Network.cut(host, how=) <Network.cut>` cuts host ``host`` off:
  ``"down"`` sets its link down (its own sends fail at once, as on a pulled
  cable), ``"drop"`` makes both ends drop every packet silently (a blackhole
  qdisc each: the link stays up and TCP notices only by its timeouts, as when a
  switch or firewall between them fails). :meth:`Network.restore` undoes it.
- :meth:`Network.close` (run by :func:`network`) restores the links still
  cut, sends SIGTERM to every process it started, SIGKILLs those still there after ``grace`` seconds
  (each by its own pid), stops the server (``pg_ctl``, else SIGKILL to its
  postmaster's pid), removes its files and deletes the namespaces it made
  (their veths go with them). It never touches anything it did not make.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests import fixtures

fleet = fixtures.load_module(
    "tailrace_bench_fleet", Path(__file__).resolve().parents[2] / "bench" / "fleet.py"
)

PG_BIN = Path(os.environ.get("TAILRACE_PG_BINDIR", "/usr/lib/postgresql/15/bin"))
#: The hosts' subnet (``10.213.n.0/24`` per host), inside the namespaces only.
SUBNET = "10.213"
#: libpq options of a host's DSN: connecting gives up after 2 s, and a connection with
#: data unacknowledged for 2 s (or silent for 3) breaks, rather than after the kernel's
#: retransmission timeout (about 15 minutes).
LIBPQ = {
    "connect_timeout": "2", "tcp_user_timeout": "2000", "keepalives": "1",
    "keepalives_idle": "1", "keepalives_interval": "1", "keepalives_count": "2",
}  # fmt: skip
#: The server's settings unless :meth:`Network.start_postgres` is given others: it also
#: drops a session into a dead link within seconds (its keepalives and user timeout), as
#: a production server should, so a cut host's open transaction does not hold its locks
#: for the kernel's two hours.
SERVER = {
    "listen_addresses": "*", "fsync": "off", "max_connections": "200",
    "tcp_keepalives_idle": "1", "tcp_keepalives_interval": "1", "tcp_keepalives_count": "2",
    "tcp_user_timeout": "2000",
}  # fmt: skip
CUTS = ("down", "drop")


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(args, capture_output=True, text=True, check=False, timeout=60)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


def _started(pid: int) -> str | None:
    """Process ``pid``'s start time (clock ticks since boot); None once it is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()
    return None if fields[0] == "Z" else fields[19]


def why_not() -> str | None:
    """Why this machine cannot run a test on a :class:`Network`, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    for tool, why in (
        ("ip", "no `ip` command (iproute2)"),
        ("tc", "no `tc` command (iproute2)"),
        ("unshare", "no `unshare` (util-linux: each host gets its own host name)"),
        ("hostname", "no `hostname` command (each host gets its own host name)"),
        ("runuser", "no `runuser` (initdb refuses root: the server runs as `postgres`)"),
    ):
        if shutil.which(tool) is None:
            return why
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
    try:
        for args, why in (
            (("ip", "-n", probe, "link", "add", "trpa", "type", "veth", "peer", "name", "trpb"),
             "the kernel refused a veth pair"),
            (("ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "trpa", "root",
              "blackhole"), "no blackhole qdisc to drop a host's packets (tc)"),
        ):  # fmt: skip
            done = _run(*args, check=False)
            if done.returncode != 0:
                return f"{why}: {done.stderr.strip()}"
    finally:
        _run("ip", "netns", "del", probe, check=False)
    return None


@contextlib.contextmanager
def network(workdir: Path, hosts: int = 3) -> Iterator[Network]:
    """A built :class:`Network` of ``hosts`` hosts, torn down on the way out; skips if it cannot."""
    reason = why_not()
    if reason is not None:
        pytest.skip(reason)
    net = Network(workdir, hosts)
    try:
        net.build()
        yield net
    finally:
        net.close()


class Network:
    """A server namespace and ``hosts`` host namespaces, linked; see the module docstring."""

    def __init__(self, workdir: Path, hosts: int) -> None:
        if not 1 <= hosts <= 254:
            raise ValueError(f"hosts must be 1 to 254, not {hosts}")
        self.workdir = workdir
        self.hosts = hosts
        self.tag = uuid.uuid4().hex[:5]
        self.namespaces: list[str] = []
        self.workers: list[Any] = []  # fleet.WorkerProcess
        self.spawned: list[subprocess.Popen[bytes]] = []
        self.pg_dir: Path | None = None
        self.target: Any = None  # fleet.Target, once the server runs
        self._postmaster: tuple[int, str | None] | None = None  # its pid and start time
        self._cuts: dict[int, str] = {}

    # -- names --------------------------------------------------------------------------------

    @property
    def server_ns(self) -> str:
        return f"tr{self.tag}db"

    def host_ns(self, host: int) -> str:
        return f"tr{self.tag}h{host}"

    def hostname(self, host: int) -> str:
        """Host ``host``'s host name: the first part of its workers' lease owner names."""
        return f"tr{self.tag}-host{host}"

    def _veths(self, host: int) -> tuple[str, str]:
        """Host ``host``'s end and the server's end of its link (at most 15 characters)."""
        return f"tr{self.tag}h{host}", f"tr{self.tag}s{host}"

    def _check(self, host: int) -> None:
        if not 1 <= host <= self.hosts:
            raise ValueError(f"no host {host}: this network has hosts 1 to {self.hosts}")

    # -- the network --------------------------------------------------------------------------

    def build(self) -> None:
        for ns in (self.server_ns, *map(self.host_ns, range(1, self.hosts + 1))):
            _run("ip", "netns", "add", ns)
            self.namespaces.append(ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        for host in range(1, self.hosts + 1):
            here, there = self._veths(host)
            _run("ip", "link", "add", here, "netns", self.host_ns(host), "type", "veth",
                 "peer", "name", there, "netns", self.server_ns)  # fmt: skip
            for ns, dev, address in (
                (self.server_ns, there, f"{SUBNET}.{host}.1/24"),
                (self.host_ns(host), here, f"{SUBNET}.{host}.2/24"),
            ):
                _run("ip", "-n", ns, "addr", "add", address, "dev", dev)
                _run("ip", "-n", ns, "link", "set", dev, "up")

    def cut(self, host: int, how: str = "down") -> None:
        """Cut host ``host`` off the server: ``down`` (its link) or ``drop`` (every packet)."""
        self._check(host)
        if how not in CUTS:
            raise ValueError(f"how must be one of {', '.join(CUTS)}, not {how!r}")
        if host in self._cuts:
            raise ValueError(f"host {host} is already cut ({self._cuts[host]})")
        self._switch(host, how, cut=True)
        self._cuts[host] = how

    def restore(self, host: int) -> None:
        """Undo :meth:`cut` on host ``host``."""
        self._check(host)
        how = self._cuts.pop(host, None)
        if how is None:
            raise ValueError(f"host {host} is not cut")
        self._switch(host, how, cut=False)

    def _switch(self, host: int, how: str, *, cut: bool) -> None:
        here, there = self._veths(host)
        if how == "down":
            _run("ip", "-n", self.host_ns(host), "link", "set", here, "down" if cut else "up")
            return
        change = ("add", "root", "blackhole") if cut else ("del", "root")
        for ns, dev in ((self.host_ns(host), here), (self.server_ns, there)):
            _run("ip", "netns", "exec", ns, "tc", "qdisc", change[0], "dev", dev, *change[1:])

    # -- the server ---------------------------------------------------------------------------

    @staticmethod
    def _as_postgres(*args: str) -> list[str]:
        return ["runuser", "-u", "postgres", "--", *args]

    def start_postgres(self, **settings: str) -> Any:
        """Start the server in its namespace; the test's :class:`Target` (over the Unix socket)."""
        if self.pg_dir is not None:
            raise RuntimeError("the server is already started")
        self.pg_dir = Path(tempfile.mkdtemp(prefix=f"tailrace-netns-{self.tag}."))
        shutil.chown(self.pg_dir, "postgres", "postgres")  # pytest's tmp_path is root's only
        data = self.pg_dir / "data"
        _run(*self._as_postgres(str(PG_BIN / "initdb"), "-D", str(data), "-U", "postgres",
                                "-A", "trust", "-E", "UTF8", "--no-sync"))  # fmt: skip
        with (data / "pg_hba.conf").open("a") as hba:
            hba.write(f"host all all {SUBNET}.0.0/16 trust\n")
        options = " ".join(f"-c {k}='{v}'" for k, v in {**SERVER, **settings}.items())
        started = _run("ip", "netns", "exec", self.server_ns, *self._as_postgres(
            str(PG_BIN / "pg_ctl"), "-D", str(data), "-l", str(self.pg_dir / "server.log"),
            "-w", "-t", "60", "-o", f"-k {self.pg_dir} {options}", "start",
        ), check=False)  # fmt: skip
        pidfile = data / "postmaster.pid"
        if pidfile.exists():  # pg_ctl may fail after the server started: stop it all the same
            pid = int(pidfile.read_text().split()[0])
            self._postmaster = (pid, _started(pid))
        if started.returncode != 0:
            raise RuntimeError(f"the server did not start: {started.stderr}{self.server_log()}")
        _run(str(PG_BIN / "createdb"), "-h", str(self.pg_dir), "-U", "postgres", "tailrace")
        self.target = fleet.Target(
            "postgres", self.workdir, f"postgresql://postgres@/tailrace?host={self.pg_dir}"
        )
        return self.target

    def host_target(self, host: int, **libpq: str) -> Any:
        """The server's database as host ``host`` reaches it (over TCP), in the test's schema."""
        self._check(host)
        if self.target is None:
            raise RuntimeError("start_postgres() first")
        options = "&".join(f"{k}={v}" for k, v in {**LIBPQ, **libpq}.items())
        dsn = f"postgresql://postgres@{SUBNET}.{host}.1:5432/tailrace?{options}"
        return fleet.Target("postgres", self.workdir, dsn, schema=self.target.schema)

    def server_log(self) -> str:
        log = self.pg_dir / "server.log" if self.pg_dir is not None else None
        return log.read_text(errors="replace") if log is not None and log.exists() else ""

    def _stop_postgres(self) -> None:
        if self.pg_dir is None:
            return
        if self._postmaster is not None:
            _run(*self._as_postgres(str(PG_BIN / "pg_ctl"), "-D", str(self.pg_dir / "data"),
                                    "-m", "fast", "-w", "-t", "30", "stop"), check=False)  # fmt: skip
            pid, started = self._postmaster
            deadline = time.monotonic() + 10
            while started is not None and _started(pid) == started:
                if time.monotonic() > deadline:
                    os.kill(pid, signal.SIGKILL)  # its own postmaster, by pid and start time
                    break
                time.sleep(0.05)  # it removes its pid file, then exits
            self._postmaster = None
        shutil.rmtree(self.pg_dir, ignore_errors=True)
        self.pg_dir = None

    # -- processes ------------------------------------------------------------------------------

    def in_host(self, host: int) -> list[str]:
        """The command prefix that runs a command on host ``host`` (exec'd in place: same pid)."""
        self._check(host)
        return [
            "ip", "netns", "exec", self.host_ns(host), "unshare", "--uts",
            "sh", "-c", 'hostname "$0" && exec "$@"', self.hostname(host),
        ]  # fmt: skip

    def start_worker(
        self,
        host: int,
        graph_file: Path,
        name: str | None = None,
        *,
        queues: Sequence[str] = ("default",),
        env: Mapping[str, str] | None = None,
        libpq: Mapping[str, str] | None = None,
        **options: Any,
    ) -> Any:
        """A ``tailrace worker`` on host ``host`` (a :class:`WorkerProcess`); see the module docstring."""
        worker = fleet.WorkerProcess(
            self.host_target(host, **(libpq or {})), graph_file,
            name or f"host{host}-worker{len(self.workers) + 1}", queues,
            env=env, prefix=self.in_host(host), **options,
        )  # fmt: skip
        self.workers.append(worker)
        return worker

    @staticmethod
    def wait_ready(workers: Sequence[Any]) -> None:
        """Block until every worker printed its banner (raises if one exits first)."""
        fleet.wait_ready(workers)

    def spawn(
        self,
        host: int,
        args: Sequence[str],
        *,
        name: str,
        env: Mapping[str, str] | None = None,
    ) -> subprocess.Popen[bytes]:
        """Run ``args`` on host ``host``, output in ``workdir/NAME.log``; stopped with the rest."""
        with (self.workdir / f"{name}.log").open("ab") as log:
            proc = subprocess.Popen(
                [*self.in_host(host), *args], stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
            )  # fmt: skip
        self.spawned.append(proc)
        return proc

    def _stop_processes(self, grace: float) -> None:
        procs = [w.proc for w in self.workers] + self.spawned
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in procs:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                proc.kill()  # by its own pid: `ip netns exec`, unshare and sh exec'd it in place
                proc.wait()

    # -- tear-down ----------------------------------------------------------------------------

    def close(self, grace: float = 15.0) -> None:
        """Stop what it started and delete the namespaces it made; the first error is raised last."""
        errors: list[BaseException] = []
        for step in (
            *(functools.partial(self.restore, host) for host in sorted(self._cuts)),
            lambda: self._stop_processes(grace),  # once restored, a worker drains in time
            self._stop_postgres,
            self._delete_namespaces,
        ):
            try:
                step()
            except Exception as exc:  # every step runs, whatever failed before it
                errors.append(exc)
        if errors:
            raise errors[0]

    def _delete_namespaces(self) -> None:
        failed = []
        for ns in reversed(self.namespaces):  # deleting a namespace deletes its veth ends
            done = _run("ip", "netns", "del", ns, check=False)
            if done.returncode != 0:
                failed.append(f"{ns}: {done.stderr.strip()}")
        self.namespaces.clear()
        self._cuts.clear()
        if failed:
            raise RuntimeError(f"namespaces not deleted: {'; '.join(failed)}")
