"""Claims under faults: claimers SIGKILLed mid-claim, a lease that fails mid-claim (W1, W2).

A claim ranks its candidates (locking nothing), then leases the first of them
still queued, in one transaction. Whatever cuts it (its process killed
between the look and the lease, or while it commits, or a statement that
fails after the look) leaves each run queued or leased by exactly one claim:
nothing is lost and nothing is claimed twice, and a partition never runs two
runs at once. Real processes on a SQLite file and on Postgres; a failing
statement is a real trigger in the database.
"""

from __future__ import annotations

import asyncio
import collections
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tailrace._errors import StoreError
from tailrace.stores import Harvest, NewRun, Queue, RunStatus, RunStore, Submission, open_store
from tests import fixtures

HERE = Path(__file__).resolve().parent
CLAIMER = HERE / "claimer.py"
SEED = int(os.environ.get("TAILRACE_CLAIM_FAULT_SEED", "20261203"))
PARTITIONS, PER_PARTITION, LOOSE, DELAYED = 30, 6, 60, 20
KILLS = 8


@pytest.fixture(params=fixtures.SHARED_STORES)
def database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """The store's URL: a SQLite file, or a fresh Postgres schema dropped afterwards."""
    with fixtures.shared_database(request.param, tmp_path, "claimfault") as url:
        yield url


def new_run(run_id: str, at: float) -> NewRun:
    return NewRun(run_id=run_id, graph_name="g", graph_ref=None, fingerprint="fp",
                  input_json="null", created_at=at)  # fmt: skip


async def fill(store: RunStore) -> list[str]:
    """Keyed runs (one at a time per partition), unkeyed ones, delayed ones that came due."""
    await store.declare_queue(Queue("q"))
    now = time.time()
    runs = [
        (new_run(f"k{p:02}-{n}", now - 100 + n), Submission(queue="q", partition=f"p{p:02}"))
        for n in range(PER_PARTITION)
        for p in range(PARTITIONS)
    ]
    runs += [(new_run(f"u{n:03}", now - 50 + n), Submission(queue="q")) for n in range(LOOSE)]
    runs += [
        (
            new_run(f"d{n:02}", now - 80),
            Submission(
                queue="q", partition=f"p{n % 3:02}" if n % 2 else None, not_before=now - 1 - n
            ),
        )
        for n in range(DELAYED)
    ]
    await store.submit_runs(runs)
    return [run.run_id for run, _ in runs]


class Claimers:
    """Claimer processes on ``url``, each logging to its own file; killed and replaced."""

    def __init__(self, url: str, workdir: Path, rng: random.Random) -> None:
        self.url, self.workdir, self.rng = url, workdir, rng
        self.live: list[subprocess.Popen[bytes]] = []
        self.dead: list[str] = []  # owners SIGKILLed
        self._owners: dict[int, str] = {}
        self._born = 0

    def spawn(self) -> None:
        owner = f"claimer-{self._born}"
        self._born += 1
        log = self.workdir / f"{owner}.out"
        environ = {k: v for k, v in os.environ.items() if not k.startswith("TAILRACE_")}
        args = [sys.executable, str(CLAIMER), self.url, str(self.workdir / f"{owner}.log"),
                owner, str(self.rng.randrange(1 << 30))]  # fmt: skip
        with log.open("wb") as out:  # the child keeps its copy
            proc = subprocess.Popen(args, stdout=out, stderr=out, env=environ)
        self.live.append(proc)
        self._owners[proc.pid] = owner

    def kill_one(self) -> None:
        proc = self.rng.choice(self.live)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(fixtures.HANG_GUARD)
        self.live.remove(proc)
        self.dead.append(self._owners[proc.pid])

    def check_alive(self) -> None:
        for proc in self.live:
            code = proc.poll()
            owner = self._owners[proc.pid]
            assert code is None, f"{owner} exited {code}: " + (
                self.workdir / f"{owner}.out"
            ).read_text(errors="replace")

    def stop(self) -> None:
        for proc in self.live:
            proc.terminate()
        for proc in self.live:
            proc.wait(fixtures.HANG_GUARD)
        self.live.clear()

    def claimed(self) -> collections.Counter[str]:
        """How many times each run id was logged as claimed, by any claimer."""
        counts: collections.Counter[str] = collections.Counter()
        for log in self.workdir.glob("claimer-*.log"):
            for line in log.read_text().splitlines():
                counts[line.split()[1]] += 1
        return counts


def live_per_partition(records: list[object]) -> collections.Counter[str]:
    return collections.Counter(
        r.partition_key  # type: ignore[attr-defined]
        for r in records
        if r.status is RunStatus.RUNNING and r.partition_key is not None  # type: ignore[attr-defined]
    )


@pytest.mark.slow  # real claimer processes, killed and replaced
async def test_claimers_killed_mid_claim_lose_no_run_and_claim_none_twice(
    database: str, tmp_path: Path
) -> None:
    rng = random.Random(SEED + random.Random(database).randrange(1000))
    claimers = Claimers(database, tmp_path, rng)
    async with open_store(database) as store:
        ids = await fill(store)
        thresholds = sorted(rng.sample(range(len(ids) // 10, len(ids) * 8 // 10), KILLS))
        crowded: list[str] = []
        try:
            for _ in range(3):
                claimers.spawn()
            while thresholds:
                claimers.check_alive()
                records = await store.list_runs(queue="q")
                crowded += [f"{k}: {n}" for k, n in live_per_partition(records).items() if n > 1]
                if sum(claimers.claimed().values()) >= thresholds[0]:
                    thresholds.pop(0)
                    claimers.kill_one()
                    claimers.spawn()
                await asyncio.sleep(0.01)

            async def settled() -> bool:
                """Only the dead hold runs, and what is queued waits behind them: a dead
                claimer's unfinished run holds its partition (one run at a time)."""
                claimers.check_alive()
                records = await store.list_runs(queue="q")
                running = [r for r in records if r.status is RunStatus.RUNNING]
                held = {r.partition_key for r in running}
                return all(r.lease_owner in claimers.dead for r in running) and not any(
                    r.status is RunStatus.QUEUED
                    and (r.partition_key is None or r.partition_key not in held)
                    for r in records
                )

            await fixtures.until(settled, "the live claimers to drain what they may", guard=240)
        finally:
            claimers.stop()
        # What the dead left running is theirs alone: finish it as an adopter would.
        orphans = await store.list_runs(queue="q", status=RunStatus.RUNNING)
        assert {r.lease_owner for r in orphans} <= set(claimers.dead), orphans
        for run in orphans:
            await finish(store, run.run_id)
        drained = []
        while batch := await store.claim_runs("q", "drainer", 60.0, limit=50):
            drained += batch
            for run_id in batch:
                await finish(store, run_id)
        records = {r.run_id: r for r in await store.list_runs(queue="q")}
    logged = claimers.claimed()
    assert len(claimers.dead) == KILLS
    assert crowded == [], crowded  # a partition never ran two at once
    assert sorted(records) == sorted(ids)  # nothing lost, nothing made up
    twice = {run_id: n for run_id, n in logged.items() if n > 1}
    assert twice == {}, twice  # no run handed to two claims
    assert not set(drained) & set(logged)
    # Each claim takes a lease: a token of 1 is one claim, ever, and every run was claimed.
    tokens = {run_id: r.lease_token for run_id, r in records.items() if r.lease_token != 1}
    assert tokens == {}, tokens
    assert {r.status for r in records.values()} == {RunStatus.COMPLETED}


async def finish(store: RunStore, run_id: str) -> None:
    token = (await store.get_run(run_id)).lease_token
    await store.commit(run_id, token, Harvest(state_json="{}", status=RunStatus.COMPLETED))


def failing_lease(database: str) -> tuple[str, ...]:
    """A trigger that makes any lease of run ``poison`` (its claim's UPDATE) fail."""
    if "://" not in database:
        return (
            "CREATE TRIGGER poison BEFORE UPDATE OF status ON runs "
            "WHEN NEW.run_id = 'poison' AND NEW.status = 'running' "
            "BEGIN SELECT RAISE(ABORT, 'injected: the lease fails'); END",
        )
    return (
        "CREATE FUNCTION poison() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
        "IF NEW.run_id = 'poison' AND NEW.status = 'running' THEN "
        "RAISE EXCEPTION 'injected: the lease fails'; END IF; RETURN NEW; END $$",
        "CREATE TRIGGER poison BEFORE UPDATE OF status ON runs "
        "FOR EACH ROW EXECUTE FUNCTION poison()",
    )


def run_sql(database: str, statements: tuple[str, ...]) -> None:
    if "://" not in database:
        import sqlite3

        conn = sqlite3.connect(database)
        with conn:
            for statement in statements:
                conn.execute(statement)
        conn.close()
        return
    import psycopg

    dsn, schema = database.rsplit("schema=", 1)
    with psycopg.connect(dsn.rstrip("?&"), autocommit=True,
                         options=f"-c search_path={schema}") as conn:  # fmt: skip
        for statement in statements:
            conn.execute(statement)


async def test_a_claim_whose_lease_fails_after_its_look_leases_nothing(database: str) -> None:
    """The look found the candidates; the lease of one of them fails: the claim raises and
    the whole transaction is undone, the other candidates included. Claimed again once the
    fault is gone, each run is leased by that claim alone."""
    async with open_store(database) as store:
        await store.declare_queue(Queue("q", partition_concurrency=2))
        await store.submit_runs(
            [(new_run("first", 1.0), Submission(queue="q", partition="a")),
             (new_run("poison", 2.0), Submission(queue="q", partition="a")),
             (new_run("other", 3.0), Submission(queue="q", partition="b"))]
        )  # fmt: skip
        run_sql(database, failing_lease(database))
        with pytest.raises(StoreError, match="injected: the lease fails"):
            await store.claim_runs("q", "w1", 30.0, limit=3)
        records = [await store.get_run(r) for r in ("first", "poison", "other")]
        assert [(r.status, r.lease_owner, r.lease_token) for r in records] == [
            (RunStatus.QUEUED, None, 0)
        ] * 3
        assert await store.claim_runs("q", "w1", 30.0, limit=1) == ["first"]
        run_sql(database, ("DROP TRIGGER poison" + ("" if "://" not in database else " ON runs"),))
        assert sorted(await store.claim_runs("q", "w2", 30.0, limit=3)) == ["other", "poison"]
        records = [await store.get_run(r) for r in ("first", "poison", "other")]
        assert [(r.lease_owner, r.lease_token) for r in records] == [
            ("w1", 1), ("w2", 1), ("w2", 1)
        ]  # fmt: skip
