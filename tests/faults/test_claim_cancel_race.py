"""A claim racing a cancel, with real processes: a worker claims, a canceller in another process
cancels (W1, W5, D1).

The deterministic version (``tests/workers/test_submit_hardening.py``) cancels
between a claim and the claimant's start in one process. Here a ``tailrace
worker`` subprocess (one slot, FIFO) claims queued runs while a canceller
subprocess (``race_canceller.py``) watches them and cancels each the moment it
sees it claimed, or a seeded moment later; the test process only submits and
reads. Repeated over many runs on a SQLite file and on Postgres, so cancels
land right after claims. Then:

- a run cancelled right after its claim (the canceller saw it claimed, no
  node done, and cancelled at once) ends ``cancelled``: the request is never
  lost between the claim and the run loop (the loop hears it at the latest
  at its next commit);
- a run that ends ``cancelled`` never has every node committed, and its
  last event is ``run_cancelled``; a cancel asked later, mid-run, may meet
  the run finishing its last steps, which then completes (counted, printed);
- no (run, node, visit) started twice, in any process;
- every run ends, cancelled or completed, with its lease released.
"""

from __future__ import annotations

import collections
import json
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tailrace import Engine
from tailrace.stores import TERMINAL_STATUSES, RunStatus, open_store
from tests import fixtures

pytestmark = pytest.mark.slow  # real worker and canceller processes

HERE = Path(__file__).resolve().parent
GRAPHS = HERE.parent / "workers" / "fleet_graphs.py"  # its graph ``race``
CANCELLER = HERE / "race_canceller.py"
graphs = fixtures.load_module("fleet_graphs", GRAPHS)
fleet = fixtures.load_module(
    "tailrace_bench_fleet", HERE.parents[1] / "bench" / "fleet.py"
)  # the console-script helper the fleet tests share
RUNS = int(os.environ.get("TAILRACE_RACE_RUNS", "40"))
SEED = int(os.environ.get("TAILRACE_RACE_SEED", "20261202"))


@pytest.fixture(params=fixtures.SHARED_STORES)
def database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """The store's URL: a SQLite file, or a fresh Postgres schema dropped afterwards."""
    with fixtures.shared_database(request.param, tmp_path, "race") as url:
        yield url


def spawn(args: list[str], log: Path, side: Path) -> subprocess.Popen[bytes]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("TAILRACE_")}
    environ.update({graphs.SIDE_ENV: str(side), "COLUMNS": "300"})
    with log.open("wb") as out:  # the child keeps its copy
        return subprocess.Popen(args, stdout=out, stderr=out, env=environ)


def starts(side: Path) -> collections.Counter[tuple[str, str, int]]:
    counts: collections.Counter[tuple[str, str, int]] = collections.Counter()
    for line in side.read_text().splitlines() if side.exists() else ():
        run_id, node_id, visit = line.split()
        counts[(run_id, node_id, int(visit))] += 1
    return counts


async def test_a_cancel_racing_a_claim_in_another_process_is_never_lost(
    database: str, tmp_path: Path
) -> None:
    side, report = tmp_path / "side.log", tmp_path / "cancels.jsonl"
    seed = SEED + random.Random(database).randrange(1000)
    procs: list[subprocess.Popen[bytes]] = []
    async with open_store(database) as store:
        engine = Engine(store=store)
        ids = [
            await engine.submit(graphs.race, n, queue="race", run_id=f"race-{n:03d}")
            for n in range(RUNS)
        ]  # queued first; FIFO with one slot: claimed in this order
        try:
            canceller = [sys.executable, str(CANCELLER), database, str(report), str(seed), *ids]
            procs.append(spawn(canceller, tmp_path / "canceller.log", side))
            worker = [*fleet.tailrace_command(), "worker", "--db", database, "--graphs",
                      str(GRAPHS), "--queue", "race", "--concurrency", "1",
                      "--max-interval", "0.02", "--lease-ttl", "30"]  # fmt: skip
            procs.append(spawn(worker, tmp_path / "worker.log", side))

            async def all_ended() -> bool:
                for proc, name in zip(procs, ("canceller", "worker"), strict=True):
                    code = proc.poll()
                    assert code in (None, 0), f"{name} exited {code}: " + (
                        tmp_path / f"{name}.log"
                    ).read_text(errors="replace")
                runs = [await store.get_run(run_id) for run_id in ids]
                return all(r.status in TERMINAL_STATUSES for r in runs)

            await fixtures.until(all_ended, "every run to end", guard=240)
            assert procs[0].wait(fixtures.HANG_GUARD) == 0
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.terminate()
                proc.wait(fixtures.HANG_GUARD)
        records = {run_id: await store.get_run(run_id) for run_id in ids}
        committed = {run_id: {r.node_id for r in await store.results(run_id)} for run_id in ids}
        last_events = {run_id: (await store.events(run_id))[-1].type for run_id in ids}
    cancels = {c["run_id"]: c for c in map(json.loads, report.read_text().splitlines())}
    assert sorted(cancels) == ids
    accepted = [run_id for run_id in ids if cancels[run_id]["answer"] != "completed"]
    right_after_claim = [
        run_id
        for run_id in accepted
        if cancels[run_id]["delay"] == 0
        and cancels[run_id]["seen"] == "running"
        and cancels[run_id]["nodes_done"] == 0
    ]
    problems = []
    for run_id in ids:
        record, done, answer = records[run_id], committed[run_id], cancels[run_id]["answer"]
        if record.lease_owner is not None:
            problems.append(f"{run_id}: lease still held by {record.lease_owner}")
        if record.status is RunStatus.CANCELLED:
            if done >= set(graphs.RACE_STEPS):
                problems.append(f"{run_id}: cancelled, yet every node committed")
            if last_events[run_id] != "run_cancelled":
                problems.append(f"{run_id}: cancelled, last event {last_events[run_id]}")
        elif run_id in right_after_claim:  # the claim race itself: never lost
            problems.append(f"{run_id}: cancelled right after its claim, yet {record.status}")
        elif answer != "completed" and record.status is not RunStatus.COMPLETED:
            problems.append(f"{run_id}: cancel answered {answer!r}, run is {record.status}")
    # A cancel asked mid-run may meet a run finishing its last steps: it completes.
    finished_anyway = [r for r in accepted if records[r].status is RunStatus.COMPLETED]
    twice = [key for key, n in starts(side).items() if n > 1]
    summary = (
        f"{len(accepted)} cancels accepted of {RUNS}, {len(right_after_claim)} right after "
        f"the claim, {len(finished_anyway)} mid-run ones met a run finishing; "
        f"problems: {problems}; started twice: {twice}"
    )
    print(summary)
    assert problems == [] and twice == [], summary
    assert right_after_claim, summary  # the race was hit: cancels landed between claim and start
