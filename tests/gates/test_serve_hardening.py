"""The serve daemon under faults (issue 9): nothing stuck blocks anything else, nothing retries hot.

- Finding 5: answers the daemon cannot apply (a graph that no longer loads)
  are deferred with backoff and logged once with the reason; an applicable
  answer behind 150 of them is applied within a few iterations (Q4). An
  answer of a run no target handles is not the daemon's: skipped, not deferred.
- Finding 19: pollers run concurrently, under a time limit, in threads the
  daemon owns; a hanging poller holds up neither other gates nor deadlines
  (Q5) nor the daemon's shutdown, and is not started again while it runs.
- Finding 3 (daemon side): an orphaned run that can never be resumed (its
  graph does not import, a stored row does not decode) is marked failed with
  the reason, once; a handler failing during adoption fails its run (E9, Q6).
- Several daemons on one store apply each answer exactly once (Q3).
- Extra ``Resumable`` targets (``Server(targets=...)``): their questions are
  routed to them, polled and timed out like tailrace gates, and their
  orphaned runs adopted.

Tests poll observed state with a generous bound; none times anything.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import tailrace as tr
from tailrace.gates import GateTimeout, Server, WaitState
from tailrace.stores import (
    Harvest,
    NewRun,
    NodeRow,
    QuestionRow,
    QuestionStatus,
    RunRecord,
    RunStatus,
    RunStore,
)
from tests.gates import backends

HERE = Path(__file__).resolve().parent


graphs = backends.graphs
backend = backends.backend  # the fixture: each store in turn
side = backends.side
eventually = backends.eventually
is_status = backends.is_status
Backend = backends.Backend
TIMEOUT = backends.TIMEOUT
APPROVAL_REF = f"{backends.GRAPH_FILE}:approval"
#: A module reference that does not import: the graph "no longer loads".
MISSING_REF = "tailrace_tests_no_such_module:graph"


def _gate_graph(name: str) -> tr.Graph:
    """ask (gate) -> after; built in a function, so no module reference finds it."""
    g = tr.Graph(name)

    @g.gate()
    async def ask(x: Any) -> Any:
        return {"ask": x}

    @g.task()
    async def after(answer: Any) -> Any:
        return answer

    g.chain("ask", "after")
    return g


async def _suspended_approval(engine: tr.Engine) -> tuple[str, QuestionRow]:
    result = await engine.run(graphs.approval, "v1", graph_ref=APPROVAL_REF)
    assert result.status == "suspended"
    [question] = result.questions
    return result.run_id, question


async def _question(store: RunStore, question_id: str) -> QuestionRow:
    return await store.get_question(question_id)


# -- finding 5: stuck answers never starve the others -------------------------------------


@pytest.mark.slow
async def test_finding5_unappliable_answers_never_starve_an_applicable_one(
    backend: Backend, side: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = await backend.store()
    owner = tr.Engine(store=store)  # ran the graphs; the daemon's engine cannot load the stuck one
    unloadable = _gate_graph("unloadable")
    stuck: list[QuestionRow] = []
    for i in range(150):
        result = await owner.run(unloadable, i, graph_ref=MISSING_REF)
        stuck += result.questions
    for i, question in enumerate(stuck):
        await owner.answer(question.question_id, i, resume=False)
    run_id, good = await _suspended_approval(owner)
    await owner.answer(good.question_id, {"side": str(side)}, resume=False)  # answered last
    server = Server(graphs.engine(await backend.store()), retry_base=0.05, retry_max=0.1)

    with caplog.at_level(logging.DEBUG, logger="tailrace"):
        for _ in range(3):
            await server.once()
            if await is_status(store, run_id, "completed"):
                break
        assert await is_status(store, run_id, "completed"), server.stats
        iterations = server.stats.iterations

        async def all_retried() -> bool:  # later retries back off and stay quiet
            await server.once()
            rows = [await _question(store, q.question_id) for q in stuck]
            return all(row.apply_attempts >= 2 for row in rows)

        await eventually(all_retried, "every stuck answer to be retried")

    assert iterations <= 3
    assert graphs.executions(side, run_id, "ship") == 1
    warnings = [
        r for r in caplog.records if r.name == "tailrace.gates" and r.levelno >= logging.WARNING
    ]
    per_question = collections.Counter(str(r.args[0]) for r in warnings)  # type: ignore[index]
    assert per_question == {q.question_id: 1 for q in stuck}
    assert all(r.exc_info is None for r in warnings)  # a reason, not a traceback
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    for question in stuck:
        row = await _question(store, question.question_id)
        assert row.status is QuestionStatus.ANSWERED
        assert row.apply_error is not None and MISSING_REF in row.apply_error
        assert "cannot import" in row.apply_error
        assert row.retry_at is not None
    assert server.stats.stuck >= 150 and server.stats.applied == 1
    assert server.stats.errors == 0
    assert (await store.get_run(stuck[0].run_id)).status is RunStatus.SUSPENDED  # kept, not failed


async def test_finding5_an_answer_no_target_handles_is_skipped_not_deferred(
    backend: Backend,
) -> None:
    store = await backend.store()
    owner = tr.Engine(store=store)
    result = await owner.run(_gate_graph("elsewhere"), 1)  # no reference: only its owner can resume
    assert (await store.get_run(result.run_id)).graph_ref is None
    [question] = result.questions
    await owner.answer(question.question_id, "yes", resume=False)
    server = Server(graphs.engine(await backend.store()))

    for _ in range(3):
        await server.once()

    row = await _question(store, question.question_id)
    assert row.status is QuestionStatus.ANSWERED
    assert (row.apply_error, row.apply_attempts, row.retry_at) == (None, 0, None)
    assert server.stats.stuck == 0 and server.stats.outcomes == {}
    done = await owner.resume(result.run_id)
    assert done.status == "completed" and done.results["after"] == "yes"


# -- finding 19: a hanging poller holds up nothing ------------------------------------------


def _machine_gates(deadline: float) -> tr.Graph:
    """Four machine gates side by side, each with its own poller; ``timed`` has a deadline."""
    g = tr.Graph("machines")

    @g.task()
    async def start(x: Any) -> Any:
        return x

    async def prompt(x: Any) -> Any:
        return {"sha": x}

    g.add_node("stuck_sync", prompt, kind="gate", poller="blocked_sync")
    g.add_node("stuck_async", prompt, kind="gate", poller="blocked_async")
    g.add_node("timed", prompt, kind="gate", poller="pending", deadline=deadline)
    g.add_node("quick", prompt, kind="gate", poller="quick")
    for gate in ("stuck_sync", "stuck_async", "timed", "quick"):
        g.add_edge("start", gate)
    return g


async def test_finding19_deadlines_and_other_pollers_go_on_while_pollers_hang(
    backend: Backend,
) -> None:
    engine = await backend.engine()
    store = engine.store
    assert store is not None
    release = threading.Event()
    sync_calls: list[Any] = []

    def blocked_sync(prompt: Any) -> Any:
        sync_calls.append(prompt)
        release.wait()  # a CI API that never answers, until the test lets go
        return None

    async def blocked_async(prompt: Any) -> Any:
        await asyncio.Event().wait()  # never set

    pollers = {
        "blocked_sync": blocked_sync,
        "blocked_async": blocked_async,
        "pending": lambda prompt: None,
        "quick": lambda prompt: {"green": prompt["sha"]},
    }
    result = await engine.run(_machine_gates(deadline=1.0), "abc")
    gates = {q.node_id: q for q in result.questions}
    # The time limit is longer than this test waits: only concurrency can get past the hangs.
    server = Server(engine, pollers=pollers, interval=0.01, max_interval=0.05, poll_timeout=600)
    stop = asyncio.Event()
    serving = asyncio.create_task(server.run(stop))
    try:

        async def settled(node: str, status: QuestionStatus) -> bool:
            row = await _question(store, gates[node].question_id)
            return row.status is status and row.applied_at is not None

        await eventually(lambda: settled("quick", QuestionStatus.APPLIED), "the quick poller")
        await eventually(lambda: settled("timed", QuestionStatus.EXPIRED), "the 1 s deadline")
        assert not serving.done()
        stop.set()
        stats = await asyncio.wait_for(serving, TIMEOUT)  # returns though a poller still blocks
        assert not release.is_set() and len(sync_calls) == 1  # never started twice meanwhile
    finally:
        stop.set()
        release.set()

    timed = await _question(store, gates["timed"].question_id)
    assert timed.answered_by == "deadline" and timed.deadline is not None
    assert timed.answered_at is not None and timed.answered_at >= timed.deadline
    assert (await _question(store, gates["quick"].question_id)).answered_by == "poller:quick"
    for node in ("stuck_sync", "stuck_async"):
        assert (await _question(store, gates[node].question_id)).status is QuestionStatus.OPEN
    [after_timeout] = await store.results(result.run_id, "timed")
    assert GateTimeout(question_id=timed.question_id, deadline=timed.deadline) == json.loads(
        after_timeout.value_json
    )
    assert stats.expired == 1 and stats.poll_timeouts == 0


async def test_finding19_a_poll_past_its_limit_is_abandoned_and_not_restarted_while_it_runs(
    backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    engine = await backend.engine()
    store = engine.store
    assert store is not None
    release = threading.Event()
    sync_calls: list[Any] = []
    async_calls: list[Any] = []

    def blocked_sync(prompt: Any) -> Any:
        sync_calls.append(prompt)
        if len(sync_calls) == 1:
            release.wait()
            return {"late": True}  # returned after it was abandoned: dropped
        return {"green": True}

    async def blocked_async(prompt: Any) -> Any:
        async_calls.append(prompt)
        await asyncio.Event().wait()

    g = tr.Graph("limits")

    async def ask(x: Any) -> Any:
        return {"sha": x}

    g.add_node("sync_gate", ask, kind="gate", poller="blocked_sync")
    g.add_node("async_gate", ask, kind="gate", poller="blocked_async")
    result = await engine.run(g, "abc")
    gates = {q.node_id: q.question_id for q in result.questions}
    pollers = {"blocked_sync": blocked_sync, "blocked_async": blocked_async}
    server = Server(engine, pollers=pollers, interval=0.01, max_interval=0.02, poll_timeout=0.1)
    stop = asyncio.Event()
    serving = asyncio.create_task(server.run(stop))
    try:
        with caplog.at_level(logging.DEBUG, logger="tailrace.serve"):

            async def async_cut_thrice() -> bool:
                return len(async_calls) >= 4  # three limits passed: several ticks went by

            await eventually(async_cut_thrice, "the async poller to be cut and polled again")
            assert len(sync_calls) == 1  # abandoned past its limit, but still running
            release.set()

            async def answered() -> bool:
                row = await _question(store, gates["sync_gate"])
                return row.status is QuestionStatus.APPLIED

            await eventually(answered, "the sync poller, polled again once it returned")
    finally:
        stop.set()
        release.set()
    stats = await asyncio.wait_for(serving, TIMEOUT)

    row = await _question(store, gates["sync_gate"])
    assert row.answer_json is not None and json.loads(row.answer_json) == {"green": True}
    assert len(sync_calls) == 2
    assert stats.poll_timeouts >= 4  # the sync poll once, the async one at least thrice
    timeouts = [
        r for r in caplog.records if r.levelno >= logging.WARNING and "timed out" in r.getMessage()
    ]
    per_question = collections.Counter(str(r.args[1]) for r in timeouts)  # type: ignore[index]
    assert per_question == {gates["sync_gate"]: 1, gates["async_gate"]: 1}  # logged once each


EXIT_SCRIPT = """
import asyncio
import sys
import threading

import tailrace as tr
from tailrace.gates import serve
from tailrace.stores import QuestionStatus, SQLiteStore

never = threading.Event()


def stuck(prompt):
    never.wait()  # a poller that never returns


async def main(db):
    g = tr.Graph("exit")

    async def ask(x):
        return "?"

    g.add_node("ci", ask, kind="gate", poller="stuck")
    g.add_node("timed", ask, kind="gate", deadline=0.3)
    async with SQLiteStore(db) as store:
        engine = tr.Engine(store=store)
        result = await engine.run(g, 0)
        [timed] = [q for q in result.questions if q.node_id == "timed"]
        stop = asyncio.Event()
        serving = asyncio.create_task(
            serve(engine, stop, pollers={"stuck": stuck}, interval=0.01, poll_timeout=0.05)
        )
        while (await store.get_question(timed.question_id)).status is not QuestionStatus.EXPIRED:
            await asyncio.sleep(0.01)
        stop.set()
        await serving
    print("served", flush=True)


asyncio.run(main(sys.argv[1]))
print("exited", flush=True)
"""


def test_finding19_asyncio_run_of_serve_exits_with_a_sync_poller_stuck(tmp_path: Path) -> None:
    """The stuck poller's thread is a daemon thread of serve's own, not the loop's default
    executor, so neither ``asyncio.run`` nor the interpreter waits for it."""
    script = tmp_path / "serve_exit.py"
    script.write_text(textwrap.dedent(EXIT_SCRIPT))
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "exit.db")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["served", "exited"]


# -- finding 3: runs that cannot be adopted are failed once, never retried hot ----------------


async def _orphan(store: RunStore, run_id: str, graph: tr.Graph | None, ref: str | None) -> None:
    """A ``running`` run with no lease, created long ago: its owner died before leasing it."""
    await store.create_run(
        NewRun(
            run_id=run_id,
            graph_name=graph.name if graph is not None else "gone",
            graph_ref=ref,
            fingerprint=graph.compile().fingerprint if graph is not None else "0" * 16,
            input_json="1",
            created_at=time.time() - 3600,
        )
    )


async def test_finding3_orphans_that_cannot_be_adopted_are_marked_failed_once(
    backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    store = await backend.store()
    chain = tr.Graph("chain")

    @chain.task()
    async def first(x: Any) -> Any:
        return x

    @chain.task()
    async def second(x: Any) -> Any:
        return x

    chain.chain("first", "second")
    exploding = tr.Graph("exploding")

    @exploding.task()
    async def explode(x: Any) -> Any:
        raise RuntimeError("adoption exploded")

    await _orphan(store, "unimportable", None, MISSING_REF)
    await _orphan(store, "corrupt", chain, None)
    token = await store.acquire_lease("corrupt", "crashed-owner", 60.0)
    corrupt_row = NodeRow(node_id="first", status="completed", visits=1, data_json="{not json")
    await store.commit("corrupt", token, Harvest(state_json="{}", nodes=[corrupt_row]))
    await store.release_lease("corrupt", "crashed-owner", token)
    await _orphan(store, "exploding", exploding, None)
    daemon = tr.Engine(store=await backend.store())
    daemon.register(chain, exploding)  # told the graphs, as with serve --graphs
    server = Server(daemon)

    with caplog.at_level(logging.WARNING):
        await server.once()

    records = {r: await store.get_run(r) for r in ("unimportable", "corrupt", "exploding")}
    assert {r: rec.status for r, rec in records.items()} == dict.fromkeys(records, RunStatus.FAILED)
    assert "cannot import" in (records["unimportable"].error or "")
    assert MISSING_REF in (records["unimportable"].error or "")
    assert "CorruptRecord" in (records["corrupt"].error or "")
    assert "'first'" in (records["corrupt"].error or "")
    assert "adoption exploded" in (records["exploding"].error or "")
    assert (server.stats.failed, server.stats.errors, server.stats.adopted) == (3, 0, 0)
    for run_id in records:
        assert sum(run_id in r.getMessage() for r in caplog.records) == 1, run_id
    assert "is marked failed" not in caplog.text

    before = {r: (rec, await store.events(r)) for r, rec in records.items()}
    assert await server.once() == 0  # nothing left to do: no retry
    after = {r: (await store.get_run(r), await store.events(r)) for r in records}
    assert after == before
    assert (server.stats.failed, server.stats.errors) == (3, 0)


# -- several daemons on one store ---------------------------------------------------------------


def _ci_graph(side: Path) -> tr.Graph:
    """ci (machine gate) -> merge, which counts its executions in the side file."""
    g = tr.Graph("ci-once")

    async def ci(x: Any) -> Any:
        return {"sha": x}

    g.add_node("ci", ci, kind="gate", poller="ci_status")

    @g.task()
    async def merge(result: Any) -> Any:
        ctx = tr.current_node()
        assert ctx is not None
        graphs.record(str(side), f"{ctx.run_id} {ctx.node_id} {ctx.visit}")
        return result

    g.chain("ci", "merge")
    return g


async def test_two_servers_on_one_store_apply_each_answer_exactly_once(
    backend: Backend, side: Path
) -> None:
    owner = await backend.engine()
    store = owner.store
    assert store is not None
    ci = _ci_graph(side)
    approvals = [await _suspended_approval(owner) for _ in range(12)]
    machine = [(await owner.run(ci, i)).run_id for i in range(4)]
    for _, question in approvals:
        await owner.answer(question.question_id, {"side": str(side)}, resume=False)
    servers = []
    for _ in range(2):
        engine = await backend.engine()
        engine.register(ci)
        servers.append(
            Server(
                engine,
                pollers={"ci_status": lambda prompt: {"green": prompt["sha"]}},
                interval=0.01,
                max_interval=0.05,
            )
        )
    stop = asyncio.Event()
    serving = [asyncio.create_task(s.run(stop)) for s in servers]
    run_ids = [r for r, _ in approvals] + machine
    try:

        async def all_completed() -> bool:
            return all([await is_status(store, r, "completed") for r in run_ids])

        await eventually(all_completed, "every run to complete")
    finally:
        stop.set()
    stats = await asyncio.wait_for(asyncio.gather(*serving), TIMEOUT)

    for run_id in run_ids:
        node = "merge" if run_id in machine else "ship"
        assert graphs.executions(side, run_id, node) == 1, run_id
        events = [e.type for e in await store.events(run_id)]
        assert events.count("question_answered") == 1, run_id
    assert sum(s.applied for s in stats) == len(run_ids)
    assert await store.unapplied_answers() == []


# -- extra Resumable targets ----------------------------------------------------------------------


class FakeDriver:
    """A tiny external-graph driver: runs named ``fake:<name>``, waiting on questions it lists."""

    def __init__(self, store: RunStore, name: str) -> None:
        self.store = store
        self.graph_name = f"fake:{name}"
        self.waiting: dict[str, set[str]] = {}
        self.applied: list[tuple[str, Any]] = []
        self.adopted: list[str] = []

    def handles(self, run: RunRecord) -> bool:
        return run.graph_name == self.graph_name

    async def start(
        self, run_id: str, gates: list[dict[str, Any]], *, created_at: float | None = None
    ) -> list[QuestionRow]:
        """Create run ``run_id`` suspended on one question per entry of ``gates``."""
        now = time.time()
        await self.store.create_run(
            NewRun(
                run_id=run_id,
                graph_name=self.graph_name,
                graph_ref=None,
                fingerprint="fake",
                input_json="null",
                created_at=created_at or now,
            )
        )
        rows = [
            QuestionRow(
                question_id=f"{run_id}/{i}",
                run_id=run_id,
                node_id=f"gate{i}",
                visit=1,
                turn=1,
                prompt_json=json.dumps(gate.get("prompt")),
                poller=gate.get("poller"),
                deadline=gate.get("deadline"),
                created_at=now,
            )
            for i, gate in enumerate(gates)
        ]
        if rows:
            await self._commit(
                run_id, Harvest(state_json="{}", status=RunStatus.SUSPENDED, questions=rows)
            )
        self.waiting[run_id] = {row.question_id for row in rows}
        return rows

    async def _commit(self, run_id: str, harvest: Harvest) -> None:
        token = await self.store.acquire_lease(run_id, "fake-driver", 30.0)
        try:
            await self.store.commit(run_id, token, harvest)
        finally:
            await self.store.release_lease(run_id, "fake-driver", token)

    async def get_state(self, key: str) -> WaitState:
        return WaitState(questions=frozenset(self.waiting.get(key, ())))

    async def invoke(self, key: str, question: QuestionRow, value: Any) -> bool:
        self.waiting[key].discard(question.question_id)
        self.applied.append((question.question_id, value))
        return False  # the worker marks it applied

    async def adopt(self, key: str) -> None:
        self.adopted.append(key)
        await self._commit(key, Harvest(state_json="{}", status=RunStatus.SUSPENDED))


async def test_server_targets_route_poll_expire_and_adopt_runs_of_other_drivers(
    backend: Backend, side: Path
) -> None:
    store = await backend.store()
    fake = FakeDriver(store, "team")
    other = FakeDriver(store, "other")  # a driver this daemon was not given
    ci, timed, person = await fake.start(
        "thread-1",
        [
            {"prompt": {"sha": "abc"}, "poller": "fake_ci"},
            {"prompt": "late?", "deadline": time.time() - 1.0},
            {"prompt": "approve?"},
        ],
    )
    await store.answer(person.question_id, json.dumps("approved"), by="alice")
    [elsewhere] = await other.start("other-1", [{"prompt": "theirs"}])
    await store.answer(elsewhere.question_id, json.dumps("mine?"), by="bob")
    await fake.start("thread-2", [], created_at=time.time() - 3600)  # running, its owner died
    owner = await backend.engine()
    run_id, question = await _suspended_approval(owner)
    await owner.answer(question.question_id, {"side": str(side)}, resume=False)
    server = Server(
        await backend.engine(),
        targets=[fake],
        pollers={"fake_ci": lambda prompt: {"green": prompt["sha"]}},
    )
    try:

        async def served() -> bool:
            await server.once()
            return len(fake.applied) == 3 and await is_status(store, run_id, "completed")

        await eventually(served, "the fake driver's answers and the engine run")
    finally:
        await server.aclose()

    applied = dict(fake.applied)
    assert len(fake.applied) == 3
    assert applied[ci.question_id] == {"green": "abc"}
    assert isinstance(applied[timed.question_id], GateTimeout)
    assert applied[timed.question_id].question_id == timed.question_id
    assert applied[person.question_id] == "approved"
    rows = {q.question_id: await _question(store, q.question_id) for q in (ci, timed, person)}
    assert rows[ci.question_id].status is QuestionStatus.APPLIED
    assert rows[ci.question_id].answered_by == "poller:fake_ci"
    assert rows[timed.question_id].status is QuestionStatus.EXPIRED
    assert rows[timed.question_id].applied_at is not None
    assert rows[person.question_id].status is QuestionStatus.APPLIED
    theirs = await _question(store, elsewhere.question_id)  # not this daemon's: left alone
    assert theirs.status is QuestionStatus.ANSWERED
    assert (theirs.apply_attempts, theirs.apply_error) == (0, None)
    assert fake.adopted == ["thread-2"] and server.stats.adopted == 1
    assert graphs.executions(side, run_id, "ship") == 1
    assert server.stats.stuck == 0 and server.stats.errors == 0
