"""A stale worker on a children's queue (R3): a rolling deploy never fails a child that a live
worker can drive.

Real ``tailrace worker`` processes on a SQLite file or a Postgres schema, as two deploys
of one module: the parents' worker and the new deploy's kids workers import
``stale_flows`` from ``deploys/new``, the stale worker from ``deploys/old`` (its kid has
one node more). The stale worker claims children it cannot drive and hands them back;
the new kids worker is SIGKILLed mid-way, after its replacement reported. Every parent
completes, no child fails or runs on the stale worker, none runs more than twice (the
killed worker's, again on its adopter). Once the replacement leaves too, no live worker of
``kids`` can drive the new kid: the stale worker fails the next parent's children, naming
the graph and the queue.
"""

from __future__ import annotations

import collections
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import tailrace as tr
from tailrace.stores import RunStatus, RunStore, open_store
from tests import fixtures

HERE = Path(__file__).parent
new = fixtures.load_module("stale_flows", HERE / "deploys" / "new" / "stale_flows.py")
stale_work = fixtures.load_module("stale_work", HERE / "stale_work.py")
procs = fixtures.procs
#: A hang guard that outlasts the adoption of a SIGKILLed worker's runs on a loaded machine.
GUARD = 3 * fixtures.HANG_GUARD
until = fixtures.until


@pytest.fixture(params=fixtures.SHARED_STORES)
async def shared(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    """The URL of a fresh SQLite file or Postgres schema that several processes can open."""
    async with fixtures.shared_url(request.param, tmp_path, "stale") as url:
        yield url


def _env(deploy: str, side: Path) -> dict[str, str]:
    """A worker's environment: module ``stale_flows`` from ``deploys/<deploy>``."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("TAILRACE_")}
    path = [fixtures.ROOT / "src", fixtures.ROOT, HERE / "deploys" / deploy]
    environ.update({stale_work.SIDE_ENV: str(side), "PYTHONPATH": os.pathsep.join(map(str, path))})
    return environ


def _starts(side: Path) -> collections.Counter[str]:
    return collections.Counter(side.read_text().split() if side.exists() else [])


async def _serving(store: RunStore, queue: str, count: int) -> bool:
    return sum(queue in w.queues for w in await store.workers()) >= count


@pytest.mark.slow
async def test_a_stale_worker_on_a_childrens_queue_fails_no_child_a_live_worker_can_drive(
    shared: str, tmp_path: Path, procs: fixtures.Procs
) -> None:
    side, stale_side = tmp_path / "side.log", tmp_path / "stale.log"
    procs.worker(shared, "stale_flows", "parents", env=_env("new", side))
    procs.worker(shared, "stale_flows", "kids", env=_env("old", stale_side))
    first = procs.worker(shared, "stale_flows", "kids", env=_env("new", side), concurrency=2)
    async with open_store(shared) as store:
        await until(lambda: _serving(store, "kids", 2), "both workers of kids to report")
        engine = tr.Engine(store=store)
        spec = {"count": 3, "sleep": 0.3}
        parents = [await engine.submit(new.stale_family, spec, queue="parents") for _ in range(10)]
        await until(lambda: sum(_starts(side).values()) >= 6, "some children to run")
        replacement = procs.worker(
            shared, "stale_flows", "kids", env=_env("new", side), concurrency=2
        )
        await until(lambda: _serving(store, "kids", 3), "the replacement to report")
        first.send_signal(signal.SIGKILL)
        first.wait()  # reaped: provably dead, the children it ran are adopted at once
        results = [await engine.wait(run_id, timeout=GUARD) for run_id in parents]
        children = [c for run_id in parents for c in await store.list_runs(parent=run_id)]
        failed = [r.run_id for r in await store.list_runs(status=RunStatus.FAILED)]
        # The replacement leaves too (drained): no live worker of kids can drive the new kid.
        replacement.send_signal(signal.SIGTERM)
        replacement.wait()
        last = await engine.submit(new.stale_family, spec, queue="parents")
        with pytest.raises(tr.RunFailed) as refused:
            await engine.wait(last, timeout=GUARD)
    assert [r.output for r in results] == [[0, 10, 20]] * 10
    assert len(children) == 30 and {c.status for c in children} == {RunStatus.COMPLETED}
    assert failed == []
    starts = _starts(side)
    assert set(starts) == {c.run_id for c in children}
    assert set(starts.values()) <= {1, 2} and sum(n == 2 for n in starts.values()) <= 2
    assert not _starts(stale_side)  # the stale worker drove no child
    stale_log = (tmp_path / "proc-1.log").read_text()
    assert "went back to queue 'kids'" in stale_log  # it did claim one, and handed it back
    assert "'stale_kid'" in str(refused.value)
    assert "nor can any other live worker of queue 'kids'" in str(refused.value)
