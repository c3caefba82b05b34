"""A Postgres restart while durable runs are in flight (issue 9, finding 9).

These tests start a second, throwaway PostgreSQL of their own (like
``.ci/postgres.sh``: ``initdb`` into a temp dir, a unix socket only, run as
the ``postgres`` user when we are root), because they stop and start it; the
server of ``TAILRACE_TEST_POSTGRES_DSN`` is never touched. They are marked
``postgres`` and skip where that variable is unset (CI always sets it) or
where ``initdb`` is missing. The server is stopped at teardown by its own data
directory (``pg_ctl``), falling back to its postmaster's PID.

The outage is real: ``pg_ctl stop -m fast`` closes every connection of the
store; the runs' next commits fail, and the store re-runs them on fresh
connections once the server is back. ``HANG_GUARD`` is a deadlock guard,
never a timing assertion.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

import tailrace as tr
from tailrace._errors import StoreError
from tailrace.stores import MemoryStore, NewRun, RunStatus, Submission, WorkerRow
from tailrace.stores._presence import GRACE
from tests.fixtures import POSTGRES_DSN

BINDIR = Path(os.environ.get("TAILRACE_PG_BINDIR", "/usr/lib/postgresql/15/bin"))
HANG_GUARD = 45.0
if TYPE_CHECKING or POSTGRES_DSN is not None:
    from tailrace.stores import PostgresStore
BRANCHES, DEPTH = 11, 18  # start + 11 chains of 18 + join = 200 nodes
GATES = (9, 14)  # the nodes of each chain that wait for the test
RUNS = 3

pytestmark = [
    pytest.mark.slow,  # starts, stops and restarts a server of its own
    pytest.mark.postgres,
    pytest.mark.skipif(POSTGRES_DSN is None, reason="TAILRACE_TEST_POSTGRES_DSN is not set"),
    pytest.mark.skipif(not (BINDIR / "initdb").exists(), reason=f"no initdb in {BINDIR}"),
]


# --- a server of our own ----------------------------------------------------------------


def as_owner(*argv: str) -> list[str]:
    """``argv`` run as the ``postgres`` user when we are root (initdb refuses root)."""
    return ["runuser", "-u", "postgres", "--", *argv] if os.geteuid() == 0 else list(argv)


class Server:
    """A throwaway PostgreSQL in ``directory``, listening on a unix socket there only."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.data = directory / "data"
        self.dsn = f"postgresql://postgres@/tailrace_restart?host={directory}"

    def create(self) -> None:
        subprocess.run(
            as_owner(str(BINDIR / "initdb"), "-D", str(self.data), "-U", "postgres",
                     "-A", "trust", "-E", "UTF8", "--no-sync"),
            check=True, capture_output=True,
        )  # fmt: skip
        subprocess.run(self._pg_ctl("start"), check=True, capture_output=True)
        subprocess.run(
            [str(BINDIR / "createdb"), "-h", str(self.directory), "-U", "postgres",
             "tailrace_restart"],
            check=True, capture_output=True,
        )  # fmt: skip

    def _pg_ctl(self, action: str, mode: str = "fast") -> list[str]:
        options = f"-k {self.directory} -c listen_addresses='' -c fsync=off"
        argv = [str(BINDIR / "pg_ctl"), "-D", str(self.data), "-w", "-t", "30", "-m", mode]
        if action == "start":
            argv += ["-l", str(self.directory / "server.log"), "-o", options]
        return as_owner(*argv, action)

    async def stop(self) -> None:
        await self._ctl("stop")

    async def start(self) -> None:
        await self._ctl("start")

    async def _ctl(self, action: str) -> None:
        """``pg_ctl`` in a subprocess while the event loop (and the runs) go on."""
        proc = await asyncio.create_subprocess_exec(
            *self._pg_ctl(action), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        _, err = await proc.communicate()
        assert proc.returncode == 0, f"pg_ctl {action}: {err.decode()}"

    def destroy(self) -> None:
        """Stop the server by its data dir, else by its postmaster's PID; remove its files."""
        pidfile = self.data / "postmaster.pid"
        if pidfile.exists():
            done = subprocess.run(self._pg_ctl("stop", "immediate"), capture_output=True)
            if done.returncode != 0 and pidfile.exists():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pidfile.read_text().split()[0]), signal.SIGKILL)
        shutil.rmtree(self.directory, ignore_errors=True)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    # Under /tmp, not pytest's tmp_path: the postgres user must reach the directory,
    # and a unix socket path must stay short.
    directory = Path(tempfile.mkdtemp(prefix="tailrace-pg2-"))
    if os.geteuid() == 0:
        shutil.chown(directory, "postgres", "postgres")
    srv = Server(directory)
    try:
        srv.create()
        yield srv
    finally:
        srv.destroy()


@pytest.fixture
async def running(server: Server) -> Server:
    """The server, started if an earlier test left it stopped."""
    if not (server.data / "postmaster.pid").exists():
        await server.start()
    return server


@contextlib.asynccontextmanager
async def store_on(server: Server, **options: Any) -> AsyncIterator[PostgresStore]:
    async with PostgresStore(server.dsn, schema=f"s_{uuid.uuid4().hex[:10]}", **options) as store:
        yield store


async def until(check: Callable[[], bool], what: str) -> None:
    """Poll ``check`` until it holds (state we cannot wait on); fail after ``HANG_GUARD`` s."""
    async with asyncio.timeout(HANG_GUARD):
        while True:
            if check():
                return
            await asyncio.sleep(0.01)
    pytest.fail(f"never: {what}")  # pragma: no cover


# --- 200-node runs -----------------------------------------------------------------------


class Calls:
    """Counts handler executions by (run, node); holds the nodes at ``GATES`` until opened."""

    def __init__(self) -> None:
        self.count: Counter[tuple[str, str]] = Counter()
        self.waiting: Counter[int] = Counter()
        self.gates = {depth: asyncio.Event() for depth in GATES}

    def handler(self, fn: Callable[[Any], Any], *, depth: int = -1) -> Callable[..., Any]:
        async def handle(payload: Any) -> Any:
            ctx = tr.current_node()
            assert ctx is not None
            self.count[ctx.run_id, ctx.node_id] += 1
            if depth in self.gates:
                self.waiting[depth] += 1
                await self.gates[depth].wait()
            return fn(payload)

        return handle

    async def at_gate(self, depth: int) -> None:
        await until(lambda: self.waiting[depth] == RUNS * BRANCHES, f"every chain at {depth}")


def graph(calls: Calls) -> tr.Graph:
    """``start`` -> 11 chains of 18 nodes -> ``join`` (an aggregate): 200 nodes."""
    g = tr.Graph("restart200")
    g.add_node("start", calls.handler(lambda x: x))
    g.add_node("join", calls.handler(lambda xs: sum(xs) % 1_000_003), "aggregate")
    for b in range(BRANCHES):
        names = [f"b{b}_{d}" for d in range(DEPTH)]
        for d, name in enumerate(names):
            g.add_node(name, calls.handler(lambda x, b=b, d=d: x * 3 + b + d, depth=d))
        g.chain("start", *names)
        g.add_edge(names[-1], "join")
    return g


async def uninterrupted() -> dict[str, Any]:
    calls = Calls()
    for gate in calls.gates.values():
        gate.set()
    result = await tr.Engine(store=MemoryStore()).run(graph(calls), 1, run_id="reference")
    assert result.status == "completed"
    return result.results


async def test_runs_in_flight_survive_a_server_restart(running: Server) -> None:
    expected = await uninterrupted()
    assert len(expected) == 200
    calls = Calls()
    async with store_on(running) as store:
        engine = tr.Engine(store=store)
        run_ids = [f"restart-{i}-{uuid.uuid4().hex[:6]}" for i in range(RUNS)]
        async with asyncio.timeout(HANG_GUARD), asyncio.TaskGroup() as group:
            runs = [group.create_task(engine.run(graph(calls), 1, run_id=r)) for r in run_ids]
            await calls.at_gate(GATES[0])
            calls.gates[GATES[0]].set()  # commits in flight as the server goes down...
            await running.stop()
            await calls.at_gate(GATES[1])
            calls.gates[GATES[1]].set()  # ...and more of them while it is down
            await until(lambda: pool_saw_the_outage(store), "the store meeting the dead server")
            await running.start()
        for run_id, task in zip(run_ids, runs, strict=True):
            result = task.result()
            assert result.status == "completed"
            assert result.results == expected
            record = await store.get_run(run_id)
            assert record.status is RunStatus.COMPLETED and record.nodes_done == 200
            rows = await store.results(run_id)
            assert sorted(r.node_id for r in rows) == sorted(expected)  # one row per node
            seqs = [e.seq for e in await store.events(run_id)]
            assert seqs == sorted(set(seqs))
    # No node ran twice: a committed visit was never re-run, nor was any other.
    assert set(calls.count.values()) == {1}
    assert len(calls.count) == RUNS * 200


async def test_a_restart_buries_no_live_worker(running: Server) -> None:
    """W7: a restart ends every store session at once; each store takes its own back, and
    no watcher takes a session being taken back for gone: no lease is fenced, and every
    present worker learns its session lapsed, unburied."""
    schema = f"s_{uuid.uuid4().hex[:10]}"
    now = time.time()
    async with contextlib.AsyncExitStack() as stack:
        stores = [
            await stack.enter_async_context(PostgresStore(running.dsn, schema=schema))
            for _ in range(4)
        ]
        rows = [
            WorkerRow(worker_id=f"w{n}", queues=("q",), concurrency=1, started_at=now, seen_at=now)
            for n in range(4)
        ]
        present = [
            await stack.enter_async_context(store.presence(row))
            for store, row in zip(stores, rows, strict=True)
        ]
        for n, store in enumerate(stores):
            await store.submit_run(
                NewRun(run_id=f"r{n}", graph_name="g", graph_ref=None, fingerprint="f",
                       input_json="1", created_at=1.0),
                Submission(queue="q"),
            )  # fmt: skip
            assert await store.claim_runs("q", f"w{n}", 3600.0, limit=1) == [f"r{n}"]
        tokens = [(await stores[0].get_run(f"r{n}")).lease_token for n in range(4)]
        await running.stop()
        await running.start()
        async with asyncio.timeout(HANG_GUARD):
            lapses = [await p.lapse() for p in present]
        await asyncio.sleep(2 * GRACE)  # a watcher that took one for gone buries it by then
        after = [(await stores[0].get_run(f"r{n}")).lease_token for n in range(4)]
        workers = await stores[0].workers()
    assert [lapse.buried for lapse in lapses] == [False] * 4, lapses
    assert after == tokens
    assert sorted(w.worker_id for w in workers) == ["w0", "w1", "w2", "w3"]


def pool_saw_the_outage(store: PostgresStore) -> bool:
    """Whether the store's pool lost connections or has callers waiting for one (a back door)."""
    pool = store._db._pool
    assert pool is not None
    stats = pool.get_stats()
    return stats.get("connections_lost", 0) > 0 or stats.get("requests_waiting", 0) > 0


async def test_a_stopped_server_is_reported_with_the_drivers_reason(running: Server) -> None:
    async with store_on(running, retry_budget=1.0, connect_timeout=2) as store:
        await store.list_runs()
        await running.stop()
        try:
            async with asyncio.timeout(HANG_GUARD):
                with pytest.raises(StoreError, match="No such file or directory") as info:
                    await store.list_runs()
                assert "cannot reach the Postgres server" in str(info.value)
                fresh = PostgresStore(running.dsn, connect_timeout=2)
                with pytest.raises(StoreError, match="No such file or directory") as info:
                    await fresh.open()
                assert "pool initialization" not in str(info.value)
        finally:
            await running.start()
        async with asyncio.timeout(HANG_GUARD):
            while True:  # the same store serves again once the server is back
                with contextlib.suppress(StoreError):
                    assert await store.list_runs() == []
                    break
