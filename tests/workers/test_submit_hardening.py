"""Hostile arguments and stored rows around queued runs: submit, wait, resume, graph identity.

Each test runs on every store (a real SQLite file, a Postgres schema, memory)
and checks both the error (naming the culprit) and that nothing was stored or
run because of it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import sqlite3
from pathlib import Path

import pytest

from tailrace import Engine, Graph, GraphMismatch, NotResumable
from tailrace.stores import RunStatus, SQLiteStore
from tailrace.workers import Queue, Worker
from tests import fixtures

store = fixtures.each_store


def shaped(name: str, calls: list[str], *, gated: bool = False) -> Graph:
    """A graph named ``name`` (``step``, then a gate if ``gated``); one shape per ``gated``."""
    g = Graph(name)

    @g.task(name="step")
    async def step(x: object) -> str:
        calls.append(name)
        return f"{name}:{x}"

    if gated:

        @g.gate(name="ask")
        async def ask(x: object) -> str:
            return f"approve {x}?"

        @g.task(name="done")
        async def done(x: object) -> str:
            calls.append(f"{name}.done")
            return str(x)

        g.chain("step", "ask", "done")
    return g


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("cost", math.inf),
        ("cost", math.nan),
        ("cost", -1.0),
        ("cost", "3"),
        ("estimate", "zzz"),
        ("estimate", math.nan),
        ("estimate", -math.inf),
        ("estimate", True),
    ],
)
async def test_submit_refuses_a_bad_cost_or_estimate_naming_it_and_stores_nothing(
    store, option: str, value: object
) -> None:
    engine = Engine(store=store)
    options = {"cost": 1.0, "estimate": 2.0, option: value}
    with pytest.raises(ValueError, match=rf"submit: {option} must be a finite number >= 0"):
        await engine.submit(shaped("g", []), 1, **options)  # type: ignore[arg-type]
    assert await store.list_runs() == []


async def test_a_stored_cost_that_is_no_number_never_poisons_later_estimates(
    tmp_path: Path,
) -> None:
    path = tmp_path / "runs.db"
    graph = shaped("g", [])
    async with SQLiteStore(path) as first:
        engine = Engine(store=first)
        run_id = await engine.submit(graph, 1, cost=2.0, estimate=1.0)
        stop = asyncio.Event()
        working = asyncio.create_task(Worker(first, graphs=[graph], poll_interval=0.05).run(stop))
        try:
            result = await engine.wait(run_id, timeout=fixtures.HANG_GUARD)
        finally:
            stop.set()
            await working
        assert result.status is RunStatus.COMPLETED
    with sqlite3.connect(path) as db:  # an older writer, or an operator, stored +inf
        db.execute("UPDATE runs SET cost = 9e999 WHERE run_id = ?", (run_id,))
    async with SQLiteStore(path) as second:
        engine = Engine(store=second)
        for _ in range(3):  # every later submit without an estimate still works
            queued = await engine.submit(graph, 1, cost=1.0)
            record = await second.get_run(queued)
            assert record.estimate is not None and math.isfinite(record.estimate)


@pytest.mark.parametrize("bad", [math.nan, "5", True])
async def test_wait_refuses_a_timeout_that_is_no_number(store, bad: object) -> None:
    engine = Engine(store=store)
    run_id = await engine.submit(shaped("g", []), 1)
    with pytest.raises(ValueError, match="wait: timeout must be a number of seconds"):
        await engine.wait(run_id, timeout=bad)  # type: ignore[arg-type]


async def test_resume_of_a_queued_run_refuses_before_running_anything(store) -> None:
    calls: list[str] = []
    graph = shaped("g", calls)
    engine = Engine(store=store)
    run_id = await engine.submit(graph, 1, queue="q")
    with pytest.raises(NotResumable, match=r"is queued: a worker serving queue 'q'"):
        await engine.resume(run_id, graph)
    assert calls == []
    record = await store.get_run(run_id)
    assert record.status is RunStatus.QUEUED and record.lease_owner is None
    assert await store.events(run_id) == []


async def test_a_run_is_never_driven_by_a_graph_of_another_name(store) -> None:
    calls: list[str] = []
    summarize = shaped("summarize", calls, gated=True)
    translate = shaped("translate", calls, gated=True)
    assert summarize.compile().fingerprint == translate.compile().fingerprint
    run_id = "r-translate"
    suspended = await Engine(store=store).run(translate, "x", run_id=run_id)
    assert suspended.status is RunStatus.SUSPENDED
    [question] = suspended.questions
    await store.answer(question.question_id, '"yes"')
    calls.clear()

    other = Engine(store=store)
    other.register(summarize)
    assert other.graph_for(await store.get_run(run_id)) is None
    assert other.knows_graph(summarize.compile().fingerprint, "summarize")
    assert not other.knows_graph(summarize.compile().fingerprint, "translate")
    with pytest.raises(GraphMismatch, match="is a run of graph 'translate', not of 'summarize'"):
        await other.resume(run_id, summarize, force=True)
    assert calls == []
    assert (await store.get_run(run_id)).status is RunStatus.SUSPENDED

    both = Engine(store=store)
    both.register(summarize, translate)
    assert both.graph_for(await store.get_run(run_id)) is translate
    resumed = await both.resume(run_id)
    assert resumed.status is RunStatus.COMPLETED and calls == ["translate.done"]


async def test_a_cancel_right_after_a_claim_is_never_lost(store) -> None:
    calls: list[str] = []
    graph = shaped("g", calls)
    worker_engine, other = Engine(store=store), Engine(store=store)
    worker_engine.register(graph)
    run_id = await other.submit(graph, 1, queue="q")
    assert await store.claim_runs("q", worker_engine.owner, 30.0, limit=1) == [run_id]
    # Claimed, not started yet: the request is recorded for the claimant to hear.
    assert await other.cancel(run_id) == "running"
    result = await worker_engine.start_claimed(run_id)
    assert result.status is RunStatus.CANCELLED and calls == []
    record = await store.get_run(run_id)
    assert record.status is RunStatus.CANCELLED and record.lease_owner is None
    assert [e.type for e in await store.events(run_id)][-1] == "run_cancelled"


async def test_a_cancel_from_another_engine_is_heard_at_the_next_commit(store) -> None:
    """W5: a plain ``engine.run`` (no worker, a heartbeat far off) asked to cancel by another
    engine on the store ends cancelled at its next harvest: no node after it runs."""
    started: list[str] = []
    release = asyncio.Event()
    g = Graph("heard")

    @g.task(name="first")
    async def first(x: int) -> int:
        started.append("first")
        await release.wait()
        return x

    for name in ("second", "third", "fourth"):

        async def step(x: int, name: str = name) -> int:
            started.append(name)
            await asyncio.sleep(0)
            return x

        g.add_node(name, step)
    g.chain("first", "second", "third", "fourth")
    driver, other = Engine(store=store, lease_ttl=300.0), Engine(store=store)
    run = asyncio.create_task(driver.run(g, 1, run_id="heard", durability="sync"))
    await fixtures.until(lambda: started == ["first"], "first to start")
    # Recorded for the driver to hear; a commit still in flight may report it at once.
    assert await other.cancel("heard") in ("running", "cancelled")
    release.set()
    result = await asyncio.wait_for(run, fixtures.HANG_GUARD)
    assert result.status is RunStatus.CANCELLED
    assert "fourth" not in started  # heard at the commit of first's harvest
    done = {r.node_id for r in await store.results("heard")}
    assert done <= {"first", "second"}, done


@pytest.mark.parametrize(
    ("option", "value", "says"),
    [
        ("queue", "", "queue must be a non-empty string"),
        ("queue", 7, "queue must be a non-empty string"),
        ("queue", "q" * 1_000_000, "queue must be a non-empty string of at most 200"),
        ("queue", "a\x00b", "queue must be a non-empty string"),
        ("partition", 5, "partition must be a non-empty string of at most 200 characters or None"),
        ("dedup_key", ["a"], "dedup_key must be a non-empty string"),
        ("dedup_key", "k" * 1_000_000, "dedup_key must be a non-empty string of at most 200"),
        ("priority", 2**63, "priority must be an integer within"),
        ("priority", 2**31, "priority must be an integer within"),
        ("priority", 1.5, "priority must be an integer within"),
    ],
)
async def test_submit_names_a_bad_option_the_same_on_every_store(
    store, option: str, value: object, says: str
) -> None:
    with pytest.raises(ValueError, match=f"submit: {says}"):
        await Engine(store=store).submit(shaped("g", []), 1, **{option: value})  # type: ignore[arg-type]
    assert await store.list_runs() == []


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (
            lambda s: Worker(s, concurrency=math.nan),
            "Worker: concurrency must be an integer within",
        ),
        (lambda s: Worker(s, concurrency=2.5), "Worker: concurrency must be an integer within"),
        (
            lambda s: Worker(s, concurrency=math.inf),
            "Worker: concurrency must be an integer within",
        ),
        (lambda s: Worker(s, concurrency=2**63), "Worker: concurrency must be an integer within"),
        (lambda s: Worker(s, concurrency=True), "Worker: concurrency must be an integer within"),
        (lambda s: Worker(s, lease_ttl=math.nan), "Worker: lease_ttl must be a finite number"),
        (lambda s: Worker(s, poll_interval="1"), "Worker: poll_interval must be a finite number"),
        (
            lambda s: Queue("q", concurrency=True),
            "queue 'q': concurrency must be an integer within",
        ),
        (lambda s: Queue("q", limit=2**40), "queue 'q': limit must be an integer within"),
        (lambda s: Queue("q" * 1_000_000), "queue name must be a non-empty string of at most 200"),
    ],
)
async def test_hostile_limits_are_refused_when_declared_naming_the_option(
    store, make: object, says: str
) -> None:
    with pytest.raises(ValueError, match=says):
        make(store)  # type: ignore[operator]
    assert await store.queues() == [] and await store.workers() == []


async def test_a_worker_without_a_runs_graph_hands_it_back_for_one_that_has_it(
    store, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[str] = []
    current = shaped("pipeline", calls)
    stale = shaped("pipeline", calls, gated=True)  # an older deploy: same name, other shape
    assert current.compile().fingerprint != stale.compile().fingerprint
    engine = Engine(store=store)
    ids = [await engine.submit(current, n, queue="q") for n in range(20)]

    stop = asyncio.Event()
    stale_worker = Worker(store, queues=["q"], graphs=[stale], poll_interval=0.05)
    with caplog.at_level(logging.WARNING, logger="tailrace.workers"):
        stale_running = asyncio.create_task(stale_worker.run(stop))
        await fixtures.until(
            lambda: any("went back to queue" in r.getMessage() for r in caplog.records),
            "the stale worker to hand a run back",
        )
        good_running = asyncio.create_task(
            Worker(store, queues=["q"], graphs=[current], poll_interval=0.05).run(stop)
        )
        try:
            results = [await engine.wait(run_id, timeout=fixtures.HANG_GUARD) for run_id in ids]
        finally:
            stop.set()
            await asyncio.gather(stale_running, good_running)
    assert [r.status for r in results] == [RunStatus.COMPLETED] * 20
    assert sorted(calls) == ["pipeline"] * 20  # each run once, by the worker that has it
    said = [r for r in caplog.records if "went back to queue" in r.getMessage()]
    assert len(said) == 1  # once per graph, however many runs
    assert stale_worker.stats.errors == 0


async def test_return_claim_refuses_a_run_that_started_or_is_not_the_callers(store) -> None:
    graph = shaped("g", [])
    engine = Engine(store=store)
    run_id = await engine.submit(graph, 1, queue="q")
    assert await store.claim_runs("q", "w1", 30.0, limit=1, skip=[("g", "other")]) == [run_id]
    assert not await store.return_claim(run_id, "w2")  # not its claimant
    assert await store.return_claim(run_id, "w1")
    record = await store.get_run(run_id)
    assert (record.status, record.lease_owner, record.started_at) == (RunStatus.QUEUED, None, None)
    fingerprint = graph.compile().fingerprint
    assert await store.claim_runs("q", "w1", 30.0, limit=1, skip=[("g", fingerprint)]) == []
    assert await store.claim_runs("q", "w1", 30.0, limit=1, graphs=[("h", fingerprint)]) == []
    assert await store.claim_runs("q", "w1", 30.0, limit=1, graphs=[("g", fingerprint)]) == [run_id]
    engine.register(graph)
    worker_engine = Engine(store=store, owner="w1")
    worker_engine.register(graph)
    await worker_engine.start_claimed(run_id)
    assert not await store.return_claim(run_id, "w1")  # it ran: never re-queued


def machine_gated(deadline: float | None) -> Graph:
    g = Graph("ci")

    async def ci(x: object) -> dict[str, object]:
        return {"sha": x}

    g.add_node("ci", ci, kind="gate", poller="ci_status", deadline=deadline)

    @g.task()
    async def merge(result: object) -> object:
        return result

    g.add_edge("ci", "merge")
    return g


async def test_a_workers_stats_count_polls_poller_errors_and_expired_deadlines(
    store, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[object] = []

    def ci_status(prompt: object) -> object:
        if prompt != {"sha": "abc"}:
            return None  # still pending: its deadline answers it
        calls.append(prompt)
        if len(calls) <= 7:
            raise ConnectionError("CI API down")
        return {"state": "green"}

    engine = Engine(store=store)
    polled_graph, deadline_graph = machine_gated(None), machine_gated(0.05)
    polled = await engine.run(polled_graph, "abc", run_id="polled")
    expiring = await engine.run(deadline_graph, "def", run_id="expiring")
    assert polled.status is RunStatus.SUSPENDED and expiring.status is RunStatus.SUSPENDED
    worker = Worker(
        store, queues=["q"], graphs=[polled_graph], pollers={"ci_status": ci_status},
        poll_interval=0.02,
    )  # fmt: skip
    stop = asyncio.Event()
    with caplog.at_level(logging.CRITICAL):
        running = asyncio.create_task(worker.run(stop))
        try:
            for run_id in ("polled", "expiring"):
                await fixtures.until(
                    lambda run_id=run_id: _finished(store, run_id), f"run {run_id} to finish"
                )
        finally:
            stop.set()
            stats = await running
    assert stats.polled >= 8 and stats.errors >= 7 and stats.expired == 1


async def _finished(store: object, run_id: str) -> bool:
    record = await store.get_run(run_id)  # type: ignore[attr-defined]
    return bool(record.status is RunStatus.COMPLETED)


async def test_answers_of_runs_no_target_drives_never_hide_an_applicable_one(store) -> None:
    from tailrace.gates import Outcome, ResumeWorker

    foreign = shaped("foreign", [], gated=True)  # started in-process, with no reference
    starter = Engine(store=store)
    for n in range(120):
        result = await starter.run(foreign, n, run_id=f"f{n:03}")
        await store.answer(result.questions[0].question_id, '"yes"')
    calls: list[str] = []
    ours = shaped("ours", calls, gated=True)
    daemon_engine = Engine(store=store)
    daemon_engine.register(ours)
    mine = await daemon_engine.run(ours, "x", run_id="mine")
    await store.answer(mine.questions[0].question_id, '"yes"')  # the newest answer
    worker = ResumeWorker(engine=daemon_engine)
    applied = 0
    for _ in range(3):  # a few rounds, never 60
        applied += (await worker.sweep(limit=100)).get(Outcome.APPLIED, 0)
    assert applied == 1 and calls[-1] == "ours.done"
    assert (await store.get_run("mine")).status is RunStatus.COMPLETED


def on_executor(name: str, calls: list[str]) -> Graph:
    g = Graph("remote")

    @g.task(executor=name)
    async def crunch(x: int) -> int:
        calls.append("crunch")
        return x * 2

    return g


async def test_a_worker_with_a_runs_executor_drives_it_one_without_hands_it_back(
    store, caplog: pytest.LogCaptureFixture
) -> None:
    from tailrace.executors import LocalExecutor

    calls: list[str] = []
    graph = on_executor("ray", calls)
    engine = Engine(store=store)
    run_id = await engine.submit(graph, 21, queue="q")
    stop = asyncio.Event()
    without = Worker(store, queues=["q"], graphs=[graph], poll_interval=0.02)
    with caplog.at_level(logging.WARNING, logger="tailrace.workers"):
        first = asyncio.create_task(without.run(stop))
        await fixtures.until(
            lambda: any("went back to queue" in r.getMessage() for r in caplog.records),
            "the worker without the executor to hand the run back",
        )
    assert (await store.get_run(run_id)).status is RunStatus.QUEUED and calls == []
    executor = LocalExecutor()
    second = asyncio.create_task(
        Worker(
            store, queues=["q"], graphs=[graph], poll_interval=0.02, executors={"ray": executor}
        ).run(stop)
    )
    try:
        result = await engine.wait(run_id, timeout=fixtures.HANG_GUARD)
    finally:
        stop.set()
        await asyncio.gather(first, second)
        await executor.aclose()
    assert result.status is RunStatus.COMPLETED and result.output == 42 and calls == ["crunch"]


async def test_a_worker_says_one_line_when_a_run_starts_and_one_when_it_ends(
    store, caplog: pytest.LogCaptureFixture
) -> None:
    graph = shaped("g", [])
    engine = Engine(store=store)
    run_id = await engine.submit(graph, 1, queue="q")
    stop = asyncio.Event()
    with caplog.at_level(logging.INFO, logger="tailrace.workers"):
        running = asyncio.create_task(
            Worker(store, queues=["q"], graphs=[graph], poll_interval=0.02).run(stop)
        )
        try:
            await engine.wait(run_id, timeout=fixtures.HANG_GUARD)
            await fixtures.until(
                lambda: any(f"run {run_id}: completed" in r.getMessage() for r in caplog.records),
                "the worker's end line",
            )
        finally:
            stop.set()
            await running
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"run {run_id}:")]
    assert lines[0] == f"run {run_id}: claimed from queue 'q'"
    assert sum(": completed (" in line for line in lines) == 1
