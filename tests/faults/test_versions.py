"""Faults around versions and forks: a migration racing a live driver, a migration racing a
resume (between its read and its lease, between a suspension and its settling, and in a
loop against answers through a slow link), a store failing mid-migration, a fork racing its
running source (a commit between the fork's reads, forks in a loop), a fork cancelled or
SIGKILLed mid-run then resumed (V1-V4, D3, D6).

The stores run on a fake wall clock, so a lease expires when a test says so.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import signal
import sys
import textwrap
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

import tailrace as tr
from tailrace._errors import LeaseLost, RunNotFound, StoreError
from tailrace.stores import RunStatus, RunStore, SQLiteStore
from tests import fixtures
from tests.durable.test_resume import (
    Backend,
    Probe,
    backend,
    committed,
    crash,
    engine,
    fork_graph,
    new_id,
    running,
    until,
)
from tests.durable.test_versions import gate_graph
from tests.faults import _faulty as faulty

__all__ = ["backend"]

TTL = 30.0


def versions(probe: Probe) -> tuple[tr.Graph, tr.Graph]:
    """``fork_graph`` and a second version with a step after its sink."""
    old, new = fork_graph(probe), fork_graph(probe)
    new.add_node("extra", probe.task(lambda xs: "extra"))
    new.add_edge("sink", "extra")
    return old, new


async def test_migrate_racing_a_live_driver_one_side_loses_cleanly(backend: Backend) -> None:
    probe = Probe()
    old, new = versions(probe)
    probe.held = {"c", "d"}
    run_id = new_id("raced")
    driver = engine(backend)
    task = asyncio.create_task(driver.run(old, "in", run_id=run_id))
    await until(running(backend, run_id, "c", "d"), "c and d running")
    rows = await backend.raw_nodes(run_id)

    held = await engine(backend).migrate(new, apply=True)  # the driver's lease is live

    assert [m.outcome for m in held.runs] == [tr.MoveOutcome.HELD]
    assert (await backend.store.get_run(run_id)).fingerprint == old.fingerprint()

    backend.clock.advance(TTL + 1)  # the driver stalls past its lease: it can be taken over
    moved = await engine(backend).migrate(new, apply=True)
    assert [m.outcome for m in moved.runs] == [tr.MoveOutcome.MOVED]

    probe.release_all()  # the old driver wakes up and tries to commit: fenced out (D6)
    with pytest.raises(LeaseLost):
        await task
    assert await backend.raw_nodes(run_id) == rows  # nothing of the old driver's was written
    record = await backend.store.get_run(run_id)
    assert record.fingerprint == new.fingerprint()

    result = await engine(backend).resume(run_id, new)
    assert result.status is RunStatus.COMPLETED and result.results["extra"] == "extra"
    assert probe.runs[("a", 1)] == 1 and probe.runs[("b", 1)] == 1  # reused, not re-run


class FailingMoves(faulty.DelegatingStore):
    """Forwards everything; the ``fail_at``-th ``move_run`` raises before reaching the store."""

    def __init__(self, inner: RunStore, *, fail_at: int) -> None:
        super().__init__(inner)
        self.fail_at = fail_at
        self.moves = 0

    def before(self, name: str) -> None:
        if name == "move_run":
            self.moves += 1
            if self.moves == self.fail_at:
                raise StoreError("the database went away (injected)")


async def test_a_store_failing_mid_migration_moves_each_run_whole_or_not(
    backend: Backend,
) -> None:
    probe = Probe()
    old, new = versions(probe)
    ids = []
    for _ in range(3):
        probe.held = {"c", "d"}
        run_id = new_id("batch")
        task = asyncio.create_task(engine(backend).run(old, "in", run_id=run_id))
        await until(running(backend, run_id, "c", "d"), "c and d running")
        await crash(task)
        ids.append(run_id)
    probe.held.clear()
    backend.clock.advance(TTL + 1)  # the crashed runs' leases expire
    failing = FailingMoves(backend.store, fail_at=2)

    with pytest.raises(StoreError, match="injected"):
        await tr.Engine(store=failing, lease_ttl=TTL).migrate(new, apply=True)

    fingerprints = [(await backend.store.get_run(r)).fingerprint for r in sorted(ids)]
    assert fingerprints.count(new.fingerprint()) == 1  # moved before the failure
    assert fingerprints.count(old.fingerprint()) == 2  # the failed one and the one after
    for run_id in ids:  # no lease is left behind by the failed move
        assert (await backend.store.get_run(run_id)).lease_owner is None

    again = await engine(backend).migrate(new, apply=True)
    assert again.count(tr.MoveOutcome.MOVED) == 2 and again.count(tr.MoveOutcome.CURRENT) == 1
    for run_id in ids:
        result = await engine(backend).resume(run_id, new)
        assert result.results["extra"] == "extra"


# --- a migration racing a resume ------------------------------------------------------------


class Migrates(faulty.DelegatingStore):
    """Forwards everything; :meth:`land` runs ``migrate()`` (on the real store) once, at the
    moment a subclass picks."""

    def __init__(self, inner: RunStore, migrate: Callable[[], Awaitable[tr.MigrationReport]]):
        super().__init__(inner)
        self._migrate: Callable[[], Awaitable[tr.MigrationReport]] | None = migrate
        self.moved: tr.MigrationReport | None = None

    async def land(self) -> None:
        """Run the migration, the first time only."""
        if self._migrate is not None:
            migrate, self._migrate = self._migrate, None
            self.moved = await migrate()


class MigratesBeforeTheFirstLease(Migrates):
    """The migration lands just before the first lease asked for: between a resume's first
    read of its run and its lease."""

    async def acquire_lease(
        self, run_id: str, owner: str, ttl: float, *, steal_from: str | None = None
    ) -> int:
        """Run the migration, once, then forward."""
        await self.land()
        return await super().acquire_lease(run_id, owner, ttl, steal_from=steal_from)


class MigratesAfterSuspending(Migrates):
    """An answer and the migration land just before the first read of the questions of a run
    that is suspended with nobody holding it: between a drive's suspension and its settling."""

    async def list_questions(self, **options: Any) -> list[tr.QuestionRow]:
        """Once the run suspended and was let go of: answer its question, migrate, forward."""
        run_id = options.get("run_id")
        if run_id is not None and self._migrate is not None:
            record = await self.inner.get_run(run_id)
            if record.status is RunStatus.SUSPENDED and record.lease_owner is None:
                (question,) = await self.inner.list_questions(run_id=run_id)
                await self.inner.answer(question.question_id, '"ok"', by="raced")
                await self.land()
        return await self.inner.list_questions(**options)


def gate_versions(probe: Probe) -> tuple[tr.Graph, tr.Graph]:
    """``prep`` -> ``review`` (a gate) -> ``ship``; version 2 adds ``ship`` -> ``notify``."""
    return gate_graph(probe), gate_graph(probe, extra=True)


async def test_a_migration_landing_between_a_resumes_read_and_its_lease_is_followed(
    backend: Backend,
) -> None:
    """The resume picks the version from its read under the lease: the run, moved onto
    version 2 meanwhile, is driven on version 2, whole (V1-V3, D6)."""
    probe = Probe()
    v1, v2 = gate_versions(probe)
    run_id = new_id("raced")
    assert (await engine(backend).run(v1, "x", run_id=run_id)).status is RunStatus.SUSPENDED
    (question,) = await backend.store.list_questions(run_id=run_id)
    await engine(backend).answer(question.question_id, "ok", resume=False)
    racing = MigratesBeforeTheFirstLease(
        backend.store, lambda: engine(backend).migrate(v2, apply=True)
    )
    resumer = tr.Engine(store=racing, lease_ttl=TTL)
    resumer.register(v1, v2)

    result = await resumer.resume(run_id)

    assert racing.moved is not None and racing.moved.count(tr.MoveOutcome.MOVED) == 1
    assert result.status is RunStatus.COMPLETED
    assert result.results["notify"] == "notified"  # version 2's node ran
    assert (await backend.store.get_run(run_id)).fingerprint == v2.fingerprint()
    waited = await engine(backend).wait(run_id, graph=v2)
    assert waited.output == result.output == "notified"


async def test_a_migration_landing_before_a_suspended_drive_settles_is_not_rolled_back(
    backend: Backend,
) -> None:
    """An answer and a migration land between a run's suspension and its driver's settling:
    the driver applies the answer on the version the run was moved to, never moving it back
    onto the graph it was started with."""
    probe = Probe()
    v1, v2 = gate_versions(probe)
    run_id = new_id("settled")
    racing = MigratesAfterSuspending(backend.store, lambda: engine(backend).migrate(v2, apply=True))
    driver = tr.Engine(store=racing, lease_ttl=TTL)
    driver.register(v2)

    result = await driver.run(v1, "x", run_id=run_id)

    assert racing.moved is not None and racing.moved.count(tr.MoveOutcome.MOVED) == 1
    assert result.status is RunStatus.COMPLETED
    assert result.results["notify"] == "notified"
    assert (await backend.store.get_run(run_id)).fingerprint == v2.fingerprint()


async def test_answers_resuming_runs_while_a_migration_loops_leave_each_run_whole(
    backend: Backend,
) -> None:
    """Real tasks racing: every run waiting on its gate is answered (and resumed) while
    another engine migrates the live runs onto version 2, then back onto version 1, in a
    loop. Each run ends on the version it is recorded on: version 2's node ran exactly on
    the runs recorded on it, and what ``wait`` reads elsewhere is what the resume returned."""
    probe = Probe()
    v1, v2 = gate_versions(probe)
    starter = engine(backend)
    ids = [new_id(f"run{i}") for i in range(30)]
    for run_id in ids:
        assert (await starter.run(v1, "x", run_id=run_id)).status is RunStatus.SUSPENDED
    questions = [(await backend.store.list_questions(run_id=r))[0] for r in ids]
    # Its store across a slow link: other engines' writes land between its reads.
    answerer = tr.Engine(store=faulty.LaggingStore(backend.store, 0.002), lease_ttl=TTL)
    answerer.register(v1, v2)
    answered = asyncio.Event()
    moved = 0

    async def migrating() -> None:
        nonlocal moved
        migrator = engine(backend)
        for version in itertools.cycle((v2, v1)):
            if answered.is_set():
                return
            moved += (await migrator.migrate(version, apply=True)).count(tr.MoveOutcome.MOVED)

    async def answering(n: int, question: tr.QuestionRow) -> tr.RunResult | None:
        await asyncio.sleep(0.005 * n)  # spread over the migrations' rounds
        return await answerer.answer(question.question_id, "ok")

    loop = asyncio.create_task(migrating())
    try:
        results = await asyncio.gather(*itertools.starmap(answering, enumerate(questions)))
    finally:
        answered.set()
        await loop
    for run_id, result in zip(ids, results, strict=True):
        if result is None:  # the migration held the run when its answer tried to resume it
            result = await answerer.resume(run_id)
        assert result.status is RunStatus.COMPLETED
        on_v2 = (await backend.store.get_run(run_id)).fingerprint == v2.fingerprint()
        assert ("notify" in result.results) == on_v2, run_id
        waited = await engine(backend).wait(run_id, graph=v2 if on_v2 else v1)
        assert waited.output == result.output
    assert moved >= 1


async def test_a_fork_cancelled_mid_run_resumes_rerunning_only_what_was_in_flight(
    backend: Backend,
) -> None:
    probe = Probe()
    g = fork_graph(probe)
    source_id = new_id("source")
    eng = engine(backend)
    source = await eng.run(g, "in", run_id=source_id)
    probe.held = {"c"}
    fork_id = new_id("fork")
    task = asyncio.create_task(eng.fork(source_id, at="c", fork_id=fork_id))
    await until(running(backend, fork_id, "c"), "the fork's c running")
    await crash(task)
    probe.held.clear()
    assert {r.node_id for r in await backend.store.results(fork_id)} == {"a", "b", "d"}

    result = await engine(backend).resume(fork_id, g)

    assert result.results == source.results
    assert probe.executions("a") == 1 and probe.executions("b") == 1 and probe.executions("d") == 1
    assert probe.executions("c") == 3  # the source's, the cancelled one, the resumed one
    assert probe.executions("sink") == 2


# --- a fork racing its running source ----------------------------------------------------------


class SourceCommitsAfterTheFirstRead(faulty.DelegatingStore):
    """Forwards everything; just after the first read of run ``source_id`` (a fork reading
    its source), ``commit()`` lets the source commit more before anything else is read."""

    def __init__(
        self, inner: RunStore, source_id: str, commit: Callable[[], Awaitable[None]]
    ) -> None:
        super().__init__(inner)
        self.source_id = source_id
        self.source_commits: Callable[[], Awaitable[None]] | None = commit

    async def _after(self, run_id: str) -> None:
        if run_id == self.source_id and self.source_commits is not None:
            commit, self.source_commits = self.source_commits, None
            await commit()

    async def load_run(self, run_id: str) -> tr.stores.StoredRun:
        """Forward, then let the source commit (once)."""
        stored = await super().load_run(run_id)
        await self._after(run_id)
        return stored

    async def snapshot(self, run_id: str) -> Any:
        """Forward, then let the source commit (once)."""
        taken = await self.inner.snapshot(run_id)
        await self._after(run_id)
        return taken


def chain_graph(probe: Probe, length: int) -> tr.Graph:
    """``n0`` -> ``n1`` -> ... each adding 1 to what it is given."""
    g = tr.Graph("chain")
    names = [f"n{i}" for i in range(length)]
    for name in names:
        g.add_node(name, probe.task(lambda x: x + 1))
    g.chain(*names)
    return g


async def test_a_fork_made_while_its_source_commits_copies_one_moment_and_completes(
    backend: Backend,
) -> None:
    """The source commits ``n1`` after the fork's first read of it: the fork copies the
    source as that read saw it (``n1`` running, so it runs again in the fork), never a
    result of ``n1`` from later, and completes (V4)."""
    probe = Probe()
    g = chain_graph(probe, 3)
    probe.held = {"n1"}
    source_id = new_id("source")
    source = asyncio.create_task(engine(backend).run(g, 0, run_id=source_id))
    await until(running(backend, source_id, "n1"), "the source's n1 running")

    async def source_commits_n1() -> None:
        probe.release_all()
        await until(committed(backend, source_id, ("n1", 1)), "the source's n1 committed")

    racing = SourceCommitsAfterTheFirstRead(backend.store, source_id, source_commits_n1)
    forker = tr.Engine(store=racing, lease_ttl=TTL)
    fork = await forker.fork(source_id, at="n2", graph=g, input=10)

    assert fork.status is RunStatus.COMPLETED
    assert fork.results == {"n0": 1, "n1": 2, "n2": 11}
    assert probe.runs[("n1", 1)] == 2  # the source's, then the fork's own
    assert (await source).results == {"n0": 1, "n1": 2, "n2": 3}
    resumed = await engine(backend).wait(fork.run_id, graph=g)
    assert resumed.results == fork.results


async def test_forks_taken_in_a_loop_while_the_source_runs_all_complete(
    backend: Backend,
) -> None:
    """Real tasks racing: a long chain runs while forks of it near its end are taken again
    and again through a slow link to the store, each reusing what the source ran so far,
    its running node included; every fork completes with the values the chain gives."""
    probe = Probe()
    length = 24
    g = chain_graph(probe, length)
    source_id = new_id("source")

    async def paced(x: int) -> int:  # only the source is slow: forks run at once
        ctx = tr.current_node()
        if ctx is not None and ctx.run_id == source_id:
            await asyncio.sleep(0.01)
        return x + 1

    for node in list(g.nodes.values()):
        g.nodes[node.id] = dataclasses.replace(node, handler=paced)
    source = asyncio.create_task(engine(backend).run(g, 0, run_id=source_id))
    forker = tr.Engine(store=faulty.LaggingStore(backend.store, 0.002), lease_ttl=TTL)
    forks = 0
    try:
        while not source.done():
            at = length - 1 - forks % 3  # past where the source is: its running node is reused
            try:
                fork = await forker.fork(source_id, at=f"n{at}", graph=g, input=100)
            except RunNotFound:
                await asyncio.sleep(0.005)  # the source is not stored yet
                continue
            assert fork.status is RunStatus.COMPLETED, fork.run_id
            # What the source had run (or was running) as the fork read it, then the fork's own.
            ran = sum(1 for i in range(at) if f"n{i}" in fork.results)
            assert fork.results == {
                **{f"n{i}": i + 1 for i in range(ran)},
                **{f"n{i}": 100 + i - at + 1 for i in range(at, length)},
            }
            forks += 1
    finally:
        if not source.done():
            await crash(source)
    assert (await source).results == {f"n{i}": i + 1 for i in range(length)}
    assert forks >= 2


# --- a real process SIGKILLed during a forked run ------------------------------------------

GRAPH_FILE = """
    import os, time
    import tailrace as tr

    LOG = os.environ["VERSIONS_LOG"]

    def logged(name, fn):
        async def handler(x):
            tr.current_node().stream(f"{name} saw {x}")
            with open(LOG, "a") as f:
                f.write(name + "\\n")
            if name == "c" and os.environ.get("VERSIONS_HANG") == "1":
                with open(LOG + ".hung", "w") as f:
                    f.write("c")
                time.sleep(3600)
            return fn(x)
        return handler

    graph = tr.Graph("killed")
    graph.add_node("a", logged("a", lambda x: x + 1))
    graph.add_node("b", logged("b", lambda x: x * 10))
    graph.add_node("c", logged("c", lambda x: x + 5))
    graph.add_node("d", logged("d", lambda x: {"d": x}))
    graph.chain("a", "b", "c", "d")
"""

FORK_SCRIPT = """
    import asyncio, sys
    sys.path.insert(0, sys.argv[1])
    import tailrace as tr
    from tailrace.stores import SQLiteStore
    import killed_graph

    async def main():
        async with SQLiteStore(sys.argv[2]) as store:
            engine = tr.Engine(store=store)
            engine.register(killed_graph.graph)
            await engine.fork("source", at="c", fork_id="forked")

    asyncio.run(main())
"""


async def killed_fork(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any]:
    """Run ``source``, then fork it at ``c`` in a subprocess SIGKILLed while ``c`` runs:
    the graph's module and the source's result."""
    (tmp_path / "killed_graph.py").write_text(textwrap.dedent(GRAPH_FILE))
    (tmp_path / "fork.py").write_text(textwrap.dedent(FORK_SCRIPT))
    log = tmp_path / "log"
    monkeypatch.setenv("VERSIONS_LOG", str(log))
    module = fixtures.load_module("killed_graph", tmp_path / "killed_graph.py")
    db = tmp_path / "runs.db"
    async with SQLiteStore(db) as store:
        source = await tr.Engine(store=store).run(module.graph, 1, run_id="source")
    assert source.results["d"] == {"d": 25}
    log.write_text("")

    env = {**os.environ, "VERSIONS_HANG": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    child = await asyncio.create_subprocess_exec(
        sys.executable, str(tmp_path / "fork.py"), str(tmp_path), str(db), env=env
    )
    try:
        await fixtures.until(lambda: (tmp_path / "log.hung").exists(), "the fork's c running")
        os.kill(child.pid, signal.SIGKILL)
    finally:
        await child.wait()
    assert child.returncode == -signal.SIGKILL
    return module, source


@pytest.mark.slow  # a real subprocess, killed and resumed
async def test_sigkill_during_a_forked_run_then_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module, source = await killed_fork(tmp_path, monkeypatch)
    log, db = tmp_path / "log", tmp_path / "runs.db"

    async with SQLiteStore(db) as store:
        record = await store.get_run("forked")
        assert (record.forked_from, record.forked_at) == ("source", "c")
        assert record.status is RunStatus.RUNNING
        kept = {r.node_id for r in await store.results("forked")}
        assert kept == {"a", "b"}  # the reused part was durable before c ran
        result = await tr.Engine(store=store).resume("forked", module.graph)
    assert result.status is RunStatus.COMPLETED and result.results == source.results
    assert log.read_text().split() == ["c", "c", "d"]  # c was in flight: it alone re-ran, then d


@pytest.mark.slow  # a real subprocess, killed and resumed
async def test_sigkill_during_a_fork_keeps_the_carried_streams_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fork's first commit holds the reused nodes' streams: after a SIGKILL and a resume,
    the fork's stream has them once, then the killed try of ``c`` discarded, then its own."""
    module, _ = await killed_fork(tmp_path, monkeypatch)

    async with SQLiteStore(tmp_path / "runs.db") as store:
        engine = tr.Engine(store=store)
        source = [(c.node_id, c.kind.value, c.value) async for c in engine.stream("source")]
        await engine.resume("forked", module.graph)
        chunks = [c async for c in engine.stream("forked")]

    assert [c.seq for c in chunks] == list(range(1, len(chunks) + 1))
    rows = [(c.node_id, c.kind.value, c.value) for c in chunks]
    carried = [
        ("a", "chunk", "a saw 1"),
        ("a", "accepted", None),
        ("b", "chunk", "b saw 2"),
        ("b", "accepted", None),
    ]
    assert source[:4] == carried and rows[:4] == carried  # once, first
    own = rows[4:]  # what the fork ran: c (its killed try's rows, if any, discarded), then d
    assert {node for node, _, _ in own} == {"c", "d"}
    assert [r for r in own if r[1] == "accepted"] == [
        ("c", "accepted", None),
        ("d", "accepted", None),
    ]
    assert own[-2:] == [("d", "chunk", "d saw 25"), ("d", "accepted", None)]
