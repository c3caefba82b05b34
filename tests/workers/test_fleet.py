"""Worker processes on one store (issue 10): the fleet torture, claims, adoption, draining.

Real ``tailrace worker`` processes on a real SQLite file or Postgres schema,
SIGKILLed and SIGTERMed for real. The torture's harness is
``bench/fleet.py`` (imported by path; run it directly for more kills:
``python bench/fleet.py torture --kills 100``). ``TAILRACE_FLEET_SEED`` and
``TAILRACE_FLEET_KILLS`` override its seed and kill count.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from tailrace import Engine
from tailrace.core import stretches_of
from tailrace.stores import QuestionStatus, RunStatus, RunStore, open_store
from tests import fixtures

pytestmark = pytest.mark.slow  # fleets of worker processes, SIGKILLed and restarted

GRAPHS = Path(__file__).with_name("fleet_graphs.py")
graphs = fixtures.load_module("fleet_graphs", GRAPHS)
fleet = fixtures.load_module(
    "tailrace_bench_fleet", Path(__file__).resolve().parents[2] / "bench" / "fleet.py"
)
until = fixtures.until
KILLS = int(os.environ.get("TAILRACE_FLEET_KILLS", "30"))
SEED = int(os.environ.get("TAILRACE_FLEET_SEED", "20261201"))


# --- the torture ---------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("store", fixtures.SHARED_STORES)
def test_a_fleet_with_workers_killed_completes_every_run_exactly(
    store: str, tmp_path: Path
) -> None:
    seed = SEED + (1 if store == "postgres" else 0)
    config = fleet.TortureConfig(runs=400, kills=KILLS)
    stats = fleet.torture(
        store, workdir=tmp_path, seed=seed, dsn=fixtures.POSTGRES_DSN, config=config
    )
    report = f"{stats}\n" + "\n".join(stats.problems)
    assert stats.kills >= KILLS, report
    assert stats.mid_run_kills >= KILLS // 3, report  # kills cut runs, not only start-ups
    assert stats.adopted_runs >= 1, report
    assert (stats.runs, stats.completed) == (400, 400), report
    assert stats.mismatches == 0, report
    assert stats.reexec_committed == 0, report
    assert stats.snapshots > stats.kills, report
    assert stats.running_samples > 100, report
    assert 1 <= stats.max_running <= config.concurrency, report
    assert stats.rate_violations == 0, report
    assert stats.partition_violations == 0, report
    assert stats.dedup_violations == 0, report
    assert stats.problems == [], report


# --- worker processes ------------------------------------------------------------------------


class Fleet:
    """``tailrace worker`` processes on one database, and the side file their handlers write."""

    def __init__(self, kind: str, tmp_path: Path, schema: str | None) -> None:
        self.url = (
            str(tmp_path / "fleet.db")
            if kind == "sqlite"
            else f"{fixtures.POSTGRES_DSN}&schema={schema}"
            if "?" in (fixtures.POSTGRES_DSN or "")
            else f"{fixtures.POSTGRES_DSN}?schema={schema}"
        )
        self.tmp_path = tmp_path
        self.side = tmp_path / "side.log"
        self.workers: list[subprocess.Popen[bytes]] = []

    def start(self, *extra: object, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        n = len(self.workers)
        environ = {k: v for k, v in os.environ.items() if not k.startswith("TAILRACE_")}
        environ.update({graphs.SIDE_ENV: str(self.side), "COLUMNS": "300", **(env or {})})
        args = [*fleet.tailrace_command(), "worker", "--db", self.url, "--graphs", str(GRAPHS)]
        with (self.tmp_path / f"worker-{n}.log").open("wb") as log:  # the child keeps its copy
            proc = subprocess.Popen([*args, *map(str, extra)], stdout=log, stderr=log, env=environ)
        self.workers.append(proc)
        return proc

    def log(self, n: int) -> str:
        return (self.tmp_path / f"worker-{n}.log").read_text(errors="replace")

    def starts(self) -> collections.Counter[tuple[str, str, int]]:
        """How often each (run, node, visit) started, from the side file."""
        counts: collections.Counter[tuple[str, str, int]] = collections.Counter()
        if self.side.exists():
            for line in self.side.read_text().splitlines():
                run_id, node_id, visit = line.split()
                counts[(run_id, node_id, int(visit))] += 1
        return counts

    def stop_all(self) -> None:
        for proc in self.workers:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.workers:
            try:
                proc.wait(timeout=fixtures.HANG_GUARD)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


async def show(workers: Fleet, run_id: str) -> subprocess.CompletedProcess[str]:
    """``tailrace show RUN_ID`` on the fleet's store, in a process of its own."""
    return await asyncio.to_thread(
        subprocess.run,
        [*fleet.tailrace_command(), "show", run_id, "--db", workers.url],
        capture_output=True, text=True, env={**os.environ, "COLUMNS": "300"}, check=True,
    )  # fmt: skip


@pytest.fixture(params=fixtures.SHARED_STORES)
def fleet_of(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Fleet]:
    schema = fixtures.new_schema("fleet") if request.param == "postgres" else None
    workers = Fleet(request.param, tmp_path, schema)
    try:
        yield workers
    finally:
        workers.stop_all()
        if schema is not None:
            fixtures.drop_schema_sync(schema)


@contextlib.asynccontextmanager
async def engine(workers: Fleet) -> AsyncIterator[Engine]:
    async with open_store(workers.url) as store:
        yield Engine(store=store)


async def _count(engine: Engine, status: RunStatus, total: int) -> bool:
    assert engine.store is not None
    runs = await engine.store.list_runs(status=status, limit=total + 1)
    return len(runs) >= total


@pytest.mark.slow
async def test_eight_workers_never_drive_a_run_twice_and_four_apply_each_answer_once(
    fleet_of: Fleet,
) -> None:
    total = 1000
    async with engine(fleet_of) as submitter:
        ids = [await submitter.submit(graphs.gated, n) for n in range(total)]
        for _ in range(8):
            fleet_of.start("--concurrency", 16, "--max-interval", 0.5)
        await until(
            lambda: _count(submitter, RunStatus.SUSPENDED, total),
            "every run to suspend on its gate", guard=240,
        )  # fmt: skip
        for proc in fleet_of.workers[4:]:
            proc.send_signal(signal.SIGTERM)  # four go; four apply the answers
        assert submitter.store is not None
        questions = await submitter.store.list_questions(status=QuestionStatus.OPEN)
        assert len(questions) == total
        await asyncio.gather(
            *(submitter.answer(q.question_id, "ok", resume=False) for q in questions)
        )
        await until(
            lambda: _count(submitter, RunStatus.COMPLETED, total),
            "every answered run to complete", guard=240,
        )  # fmt: skip
        rows = await submitter.store.list_questions(limit=total + 1)
        events = {run_id: await submitter.store.events(run_id) for run_id in ids[:200]}
    starts = fleet_of.starts()
    assert len(starts) == 2 * total  # ask and after, once each per run
    assert set(starts.values()) == {1}, [k for k, v in starts.items() if v > 1][:5]
    assert {q.status for q in rows} == {QuestionStatus.APPLIED}
    for run_id, rows_of in events.items():
        types = [e.type for e in rows_of]
        assert types.count("run_started") == 1, run_id
        assert types.count("question_answered") == 1, run_id


async def test_a_dead_workers_run_is_adopted_at_once_not_after_its_lease(
    fleet_of: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with engine(fleet_of) as submitter:
        run_id = await submitter.submit(graphs.slow, 1)
        # A one-second heartbeat, as the torture's: the dead worker is found in seconds
        # (its lease would last an hour), however loaded the machine.
        beat = ("--lease-ttl", 3600, "--heartbeat", 1.0)
        doomed = fleet_of.start(*beat, env={"TAILRACE_TEST_CRAWL": "3600"})
        await until(lambda: (run_id, "crawl", 1) in fleet_of.starts(), "the run to be crawling")
        assert submitter.store is not None
        # Commits are pipelined: crawl may start before warm's completion is durable.
        await until(lambda: submitter.store.results(run_id, "warm"), "warm to be committed")
        doomed.send_signal(signal.SIGKILL)
        doomed.wait()  # reaped: its pid is gone, provably dead
        monkeypatch.setenv("TAILRACE_TEST_CRAWL", "0")
        fleet_of.start(*beat, env={"TAILRACE_TEST_CRAWL": "0"})
        # The lease would last an hour: only the dead-owner path can finish it in time.
        result = await submitter.wait(run_id, timeout=fixtures.HANG_GUARD)
        drivers = stretches_of(await submitter.store.events(run_id))
    assert (result.status, result.output) == ("completed", 2)
    assert fleet_of.starts()[(run_id, "warm", 1)] == 1  # committed before the kill: not re-run
    # W6: the dead worker's stretch, then its adopter's, each named by its owner (pid inside).
    assert [d.how for d in drivers] == ["started", "resumed"]
    assert drivers[0].owner is not None and f":{doomed.pid}:" in drivers[0].owner
    assert drivers[1].owner is not None and f":{fleet_of.workers[1].pid}:" in drivers[1].owner
    shown = await show(fleet_of, run_id)
    assert "driven by (2 stretches, taken over 1 time)" in shown.stdout
    assert drivers[0].owner in shown.stdout and drivers[1].owner in shown.stdout


async def test_a_sigkilled_workers_runs_are_adopted_by_a_live_worker_within_seconds(
    fleet_of: Fleet,
) -> None:
    """W7: three workers; the one holding runs is SIGKILLed; its store session ends with it,
    the session watching it buries it, and a survivor owns every run long before the 30 s
    leases could expire (the default heartbeat, 30 s, plays no part); each run completes,
    its committed visit never run again."""
    async with engine(fleet_of) as submitter:
        assert submitter.store is not None
        store = submitter.store
        doomed = fleet_of.start("--concurrency", 2, env={"TAILRACE_TEST_CRAWL": "3600"})
        ids = [await submitter.submit(graphs.slow, n) for n in range(2)]

        async def crawling() -> bool:
            started = fleet_of.starts()
            warmed = [await store.results(r, "warm") for r in ids]
            return all((r, "crawl", 1) in started for r in ids) and all(warmed)

        await until(crawling, "the doomed worker to crawl both runs, warm committed")
        survivors = [fleet_of.start(env={"TAILRACE_TEST_CRAWL": "0.2"}) for _ in range(2)]
        await until(lambda: _present(store, 3), "three workers present")
        doomed.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        await asyncio.to_thread(doomed.wait)

        async def adopted() -> bool:
            owners = [(await store.get_run(r)).lease_owner for r in ids]
            return all(o is not None and f":{doomed.pid}:" not in o for o in owners)

        await until(adopted, "a survivor to own every orphaned run")
        adoption = time.monotonic() - killed_at
        results = [await submitter.wait(r, timeout=fixtures.HANG_GUARD) for r in ids]
        drivers = {r: stretches_of(await store.events(r)) for r in ids}
    assert adoption < 10.0, adoption  # leases of 30 s; measured: well under a second
    assert [(r.status, r.output) for r in results] == [("completed", 1), ("completed", 2)]
    starts = fleet_of.starts()
    survivor_pids = {f":{p.pid}:" for p in survivors}
    for run_id in ids:
        assert starts[(run_id, "warm", 1)] == 1  # committed before the kill: never run again
        assert starts[(run_id, "crawl", 1)] == 2  # cut short by the kill, then the adopter's
        assert [d.how for d in drivers[run_id]] == ["started", "resumed"]
        assert any(pid in (drivers[run_id][1].owner or "") for pid in survivor_pids)


async def _present(store: RunStore, count: int) -> bool:
    return sum(w.session is not None for w in await store.workers()) >= count


async def test_sigterm_drains_releases_the_lease_and_another_worker_finishes(
    fleet_of: Fleet,
) -> None:
    async with engine(fleet_of) as submitter:
        run_id = await submitter.submit(graphs.slow, 5)
        first = fleet_of.start("--grace", 0.2, env={"TAILRACE_TEST_CRAWL": "3600"})
        await until(lambda: (run_id, "crawl", 1) in fleet_of.starts(), "the run to be crawling")
        first.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(first.wait, fixtures.HANG_GUARD) == 0, fleet_of.log(0)
        assert submitter.store is not None
        record = await submitter.store.get_run(run_id)
        assert (record.status, record.lease_owner) == (RunStatus.RUNNING, None)
        assert "stopped: WorkerStats(" in fleet_of.log(0)
        fleet_of.start(env={"TAILRACE_TEST_CRAWL": "0"})
        result = await submitter.wait(run_id, timeout=fixtures.HANG_GUARD)
    assert (result.status, result.output) == ("completed", 6)


async def test_a_run_that_kills_its_workers_becomes_a_dead_letter(fleet_of: Fleet) -> None:
    """W3: a run taken over more than ``max_recoveries`` times is failed with the reason."""
    async with engine(fleet_of) as submitter:
        run_id = await submitter.submit(graphs.poison, 1)
        # --max-recoveries 2: the first claim and two adoptions each kill their worker.
        for n in range(3):
            proc = fleet_of.start("--lease-ttl", 2, "--max-recoveries", 2)
            code = await asyncio.to_thread(proc.wait, fixtures.HANG_GUARD)
            assert code == -signal.SIGKILL, fleet_of.log(n)
        last = fleet_of.start("--lease-ttl", 2, "--max-recoveries", 2)
        assert submitter.store is not None
        store = submitter.store

        async def failed() -> bool:
            return (await store.get_run(run_id)).status is RunStatus.FAILED

        await until(failed, "the poison run to be failed")
        record = await store.get_run(run_id)
        other = await submitter.submit(graphs.chain, 3)  # the fleet goes on
        result = await submitter.wait(other, timeout=fixtures.HANG_GUARD)
        assert last.poll() is None, fleet_of.log(3)
        events = [e.type for e in await store.events(run_id)]
    assert record.error is not None
    assert "dead letter: taken over 2 times (max_recoveries 2)" in record.error
    assert result.status == "completed"
    assert fleet_of.starts()[(run_id, "kill_worker", 1)] == 3  # never a fourth time
    assert events[-1] == "run_failed"  # (run_started never became durable before a kill)
    shown = await show(fleet_of, run_id)
    assert "dead letter" in shown.stdout
