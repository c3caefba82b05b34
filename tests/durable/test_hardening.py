"""Hardening of durable runs (issue 9): values no store keeps, retries across a
crash, retry events live, large results stored once, dead owners taken over.

Each test runs on memory, SQLite (a real file) and Postgres (when
``TAILRACE_TEST_POSTGRES_DSN`` is set); the crash tests SIGKILL a real child
process and need a store another process can open (SQLite, Postgres).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import signal
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

import tailrace as tr
import tailrace.core._writer
from tailrace.graph import load_file_module
from tailrace.stores import Harvest, RunStatus, RunStore
from tests import fixtures

GUARD = 30.0  # seconds; only there so that a bug fails the test instead of hanging it


@pytest.fixture
async def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    """A location another process can open too: a SQLite file, or a Postgres DSN with a
    fresh schema after a ``#`` (see ``open_location``)."""
    if request.param == "sqlite":
        yield str(tmp_path / "runs.db")
        return
    async with fixtures.postgres_schema("tailrace_hard") as schema:
        yield f"{fixtures.POSTGRES_DSN}#{schema}"


def open_location(location: str) -> RunStore:
    """The store at ``location``: a SQLite path, or ``DSN#schema`` for Postgres."""
    from tailrace.stores import SQLiteStore

    if location.startswith("postgresql"):
        from tailrace.stores import PostgresStore

        dsn, schema = location.rsplit("#", 1)
        return PostgresStore(dsn, schema=schema)
    return SQLiteStore(location)


#: The child scripts open their store with the same function.
OPEN_LOCATION = inspect.getsource(open_location)


async def _spawn(script: Path, location: str, *args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(sys.executable, str(script), location, *args)


async def _reap(child: asyncio.subprocess.Process) -> None:
    if child.returncode is None:
        child.kill()
        await child.wait()


store = fixtures.each_store  # the fixture: each store in turn, on a fresh database


# -- finding 3: values the codec lets through but a store refuses ----------------


def _deep(n: int) -> Any:
    value: Any = "bottom"
    for _ in range(n):
        value = [value]
    return value


BAD_RESULTS: dict[str, Callable[[], Any]] = {
    "deeper than the recursion limit": lambda: _deep(sys.getrecursionlimit() * 4),
    "a lone surrogate": lambda: {"text": "caf\ud800"},
    "a lone surrogate in a key": lambda: {"\udcff": 1},
}


@pytest.mark.parametrize("what", sorted(BAD_RESULTS))
async def test_3_a_value_no_store_keeps_fails_its_node_before_any_commit(
    store: RunStore, what: str
) -> None:
    ran: list[str] = []

    async def produce(x: Any) -> Any:
        return BAD_RESULTS[what]()

    g = tr.Graph("bad-value")
    g.add_node("ok", _record(ran, "ok"))
    g.add_node("produce", produce)
    g.add_node("after", _record(ran, "after"))
    g.chain("ok", "produce", "after")
    engine = tr.Engine(store=store)
    with pytest.raises(tr.EncodeError, match=r"node 'produce' \(visit 1\)"):
        async with asyncio.timeout(GUARD):
            await engine.run(g, 1, run_id=f"bad-{len(what)}")
    record = await store.get_run(f"bad-{len(what)}")
    assert record.status == RunStatus.FAILED, record  # failed, never left running
    assert "produce" in (record.error or "")
    assert [r.node_id for r in await store.results(record.run_id)] == ["ok"]
    assert ran == ["ok"]


@pytest.mark.parametrize(
    "message", ["NUL \x00 inside", "surrogate \ud800 inside", "[/etc/app.conf] \x00\ud800"]
)
async def test_3_handler_errors_with_nul_or_surrogates_are_stored_readably(
    store: RunStore, message: str
) -> None:
    g = tr.Graph("bad-error")

    @g.task()
    async def boom(x: Any) -> None:
        raise ValueError(message)

    with pytest.raises(ValueError) as raised:
        await tr.Engine(store=store).run(g, None, run_id="bad-error")
    assert str(raised.value) == message  # the handler's own exception, unwrapped (E9)
    record = await store.get_run("bad-error")
    assert record.status == RunStatus.FAILED
    assert record.error is not None and record.error.startswith("ValueError: ")
    assert "\x00" not in record.error
    record.error.encode("utf-8")  # every store can hold it; no lone surrogate left


async def test_3_nul_in_a_result_string_round_trips(store: RunStore) -> None:
    g = tr.Graph("nul")

    @g.task()
    async def produce(x: Any) -> str:
        return "a\x00b"

    result = await tr.Engine(store=store).run(g, None, run_id="nul")
    assert result.output == "a\x00b"
    assert [r.value_json for r in await store.results("nul")] == ['"a\\u0000b"']


@pytest.mark.parametrize("run_id", ["", "a\x00b", "x\ud800"])
async def test_3_run_ids_no_store_can_key_on_are_refused_up_front(
    store: RunStore, run_id: str
) -> None:
    g = tr.Graph("ids")
    g.add_node("a", _record([], "a"))
    with pytest.raises(ValueError, match="run id"):
        await tr.Engine(store=store).run(g, None, run_id=run_id)
    assert await store.list_runs() == []


def _record(ran: list[str], name: str) -> Callable[[Any], Any]:
    async def handler(x: Any) -> Any:
        ran.append(name)
        return x

    handler.__name__ = name
    return handler


# -- finding 18: every retry is an event, committed and published when it happens


async def test_18_a_retry_is_durable_and_published_while_the_node_backs_off(
    store: RunStore,
) -> None:
    seen = asyncio.Event()
    events: list[tr.Event] = []

    def listener(event: tr.Event) -> None:
        events.append(event)
        seen.set()

    bus = tr.EventBus()
    bus.subscribe(listener, tr.EventType.NODE_RETRYING)
    g = tr.Graph("retry-live")

    @g.task(retry=tr.RetryPolicy(attempts=3, backoff=3600.0))
    async def flaky(x: Any) -> None:
        raise RuntimeError("try again")

    task = asyncio.create_task(tr.Engine(store=store, bus=bus).run(g, None, run_id="live"))
    async with asyncio.timeout(GUARD):
        await seen.wait()  # published while the node sleeps its hour-long backoff

    async def committed() -> list[tr.Event]:
        return [e for e in await store.events("live") if e.type == "node_retrying"]

    stored = await _wait_for(committed, "the retry to be committed during the backoff")
    assert [(e.node_id, e.attempt) for e in events] == [("flaky", 1)]
    assert [(e.node_id, e.attempt) for e in stored] == [("flaky", 1)]
    assert not task.done()
    node = (await store.load_run("live")).nodes["flaky"]
    assert '"attempts":2' in node.data_json and "retry_due" in node.data_json
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


# -- finding 17: a retried node keeps its attempts across a crash ----------------

CHILD = """
from __future__ import annotations
import asyncio, os, sys
import tailrace as tr
OPEN_LOCATION

g = tr.Graph("retried")

# The first retry follows at once, the second an hour later: killed in between.
@g.task(retry=tr.RetryPolicy(attempts=3, backoff=0.001, multiplier=3.6e6, max_backoff=3600))
async def flaky(x):
    node = tr.current_node()
    with open(os.environ["LOG"], "a") as log:
        log.write(f"{node.attempt}\\n")
    if node.attempt < 3:
        raise RuntimeError(f"attempt {node.attempt} failed")
    return "third time lucky"

async def main():
    async with open_location(sys.argv[1]) as store:
        await tr.Engine(store=store, lease_ttl=3600).run(g, None, run_id="retried")

if __name__ == "__main__":
    asyncio.run(main())
"""


async def _wait_for(check: Callable[[], Any], what: str) -> Any:
    return await fixtures.until(check, what, guard=GUARD, every=0.02)


@pytest.mark.parametrize("store_url", fixtures.SHARED_STORES, indirect=True)
async def test_17_a_node_killed_during_its_backoff_continues_its_retry_policy(
    tmp_path: Path, store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = tmp_path / "retried.py"
    script.write_text(textwrap.dedent(CHILD).replace("OPEN_LOCATION", OPEN_LOCATION))
    log = tmp_path / "attempts.log"
    monkeypatch.setenv("LOG", str(log))  # the child, and this process when it resumes
    child = await _spawn(script, store_url)
    try:
        async with open_location(store_url) as store:

            async def second_retry_committed() -> bool:
                try:
                    events = await store.events("retried")
                except tr.RunNotFound:
                    return False
                return [e.attempt for e in events if e.type == "node_retrying"] == [1, 2]

            # Both failures are committed while the node waits an hour before try 3.
            await _wait_for(second_retry_committed, "the second retry to be committed")
            child.send_signal(signal.SIGKILL)
            await child.wait()
            assert log.read_text().split() == ["1", "2"]

            # The resumed node waits out what is left of its backoff: make it short.
            row = (await store.load_run("retried")).nodes["flaky"]
            assert '"attempts":3' in row.data_json
            module = load_file_module(str(script))
            engine = tr.Engine(store=store, owner="rescuer")
            await _expire_backoff(store, engine, module.g)
    finally:
        await _reap(child)
    assert log.read_text().split() == ["1", "2", "3"]  # not 1, 2, 1, 2, 3


async def _expire_backoff(store: RunStore, engine: tr.Engine, graph: tr.Graph) -> None:
    """Resume with the backoff's due time moved to now (the stored due time is an hour away)."""
    import json

    from tailrace.stores import NodeRow

    stored = await store.load_run("retried")
    row = stored.nodes["flaky"]
    data = json.loads(row.data_json)
    assert data["retry_due"] > time.time() + 60  # the due time survived the crash
    data["retry_due"] = time.time()
    patched = NodeRow(
        node_id="flaky", status=row.status, visits=row.visits, data_json=json.dumps(data)
    )
    token = await store.acquire_lease("retried", "patcher", 60, steal_from=stored.run.lease_owner)
    await store.commit("retried", token, Harvest(state_json=stored.run.state_json, nodes=[patched]))
    await store.release_lease("retried", "patcher", token)
    async with asyncio.timeout(GUARD):
        result = await engine.resume("retried", graph)
    assert (result.status, result.output) == ("completed", "third time lucky")
    assert result.nodes["flaky"].attempts == 3


# -- finding 13: a large result is stored once ------------------------------------


async def test_13_a_large_result_is_stored_once_and_restored_by_reference(
    store: RunStore,
) -> None:
    big = "x" * 2_000_000
    g = tr.Graph("big")

    @g.task()
    async def produce(x: Any) -> str:
        return big

    @g.gate()
    async def review(text: str) -> str:
        return f"review {len(text)} characters"

    @g.task()
    async def consume(answer: Any) -> Any:
        return answer

    g.chain("produce", "review", "consume")
    first = await tr.Engine(store=store).run(g, None, run_id="big")
    assert first.status == "suspended"
    stored = await store.load_run("big")
    node_chars = sum(len(row.data_json) for row in stored.nodes.values())
    result_chars = sum(len(r.value_json) for r in await store.results("big"))
    assert result_chars >= len(big)
    assert node_chars < 10_000, node_chars  # node rows refer to the result row
    (question,) = first.questions
    await store.answer(question.question_id, '"ok"', by="test")
    second = await tr.Engine(store=store).resume("big", g)  # a fresh engine restores from rows
    assert second.status == "completed"
    assert second.results["produce"] == big  # the referenced value, read back
    assert second.output == "ok"


# -- finding 10: a crashed owner's run is taken over at once ---------------------

HANGER = """
from __future__ import annotations
import asyncio, sys
import tailrace as tr
OPEN_LOCATION

g = tr.Graph("hanger")

@g.task()
async def hang(x):
    await asyncio.Event().wait()

async def main():
    async with open_location(sys.argv[1]) as store:
        await tr.Engine(store=store, lease_ttl=3600).run(g, None, run_id="orphan")

if __name__ == "__main__":
    asyncio.run(main())
"""


@pytest.mark.parametrize("store_url", fixtures.SHARED_STORES, indirect=True)
async def test_10_a_run_whose_local_owner_died_is_taken_over_without_waiting(
    tmp_path: Path, store_url: str
) -> None:
    script = tmp_path / "hanger.py"
    script.write_text(textwrap.dedent(HANGER).replace("OPEN_LOCATION", OPEN_LOCATION))
    child = await _spawn(script, store_url)
    try:
        async with open_location(store_url) as store:

            async def started() -> bool:
                try:
                    events = await store.events("orphan")
                except tr.RunNotFound:
                    return False
                return any(e.type == "node_started" for e in events)

            await _wait_for(started, "the child to start its node")
            live = tr.Engine(store=store, owner="impatient")
            with pytest.raises(tr.LeaseHeld, match="orphan"):
                await live.resume("orphan", load_file_module(str(script)).g)
            child.send_signal(signal.SIGKILL)
            await child.wait()
            record = await store.get_run("orphan")
            assert record.lease_expires is not None and record.lease_expires > time.time() + 600
            task = asyncio.create_task(
                tr.Engine(store=store, owner="rescuer").resume(
                    "orphan", load_file_module(str(script)).g
                )
            )

            async def taken_over() -> bool:
                return (await store.get_run("orphan")).lease_owner == "rescuer"

            await _wait_for(taken_over, "the rescuer to take the lease over")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
    finally:
        await _reap(child)


# -- durability modes (issue 13): "sync" never runs a successor on a lost value ---


class HeldCommits:
    """A store whose commits of ``node``'s result wait until ``release`` is set."""

    def __init__(self, inner: RunStore, node: str) -> None:
        self.inner = inner
        self.node = node
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def commit(self, run_id: str, token: int, harvest: Harvest) -> None:
        if any(r.node_id == self.node for r in harvest.results):
            self.entered.set()
            await self.release.wait()
        await self.inner.commit(run_id, token, harvest)


@pytest.mark.parametrize("durability", ["sync", "async"])
async def test_13_sync_starts_a_successor_only_once_its_upstream_is_durable(
    store: RunStore, durability: str
) -> None:
    held = HeldCommits(store, "a")
    b_started = asyncio.Event()
    g = tr.Graph("modes")

    @g.task()
    async def a(x: Any) -> int:
        return 1

    @g.task()
    async def b(x: int) -> int:
        b_started.set()
        return x + 1

    g.add_edge("a", "b")
    engine = tr.Engine(store=held, durability=durability)  # type: ignore[arg-type]
    task = asyncio.create_task(engine.run(g, None, run_id=f"modes-{durability}"))
    async with asyncio.timeout(GUARD):
        await held.entered.wait()  # a's completion is being written, not yet durable
        if durability == "async":
            await b_started.wait()  # pipelined: b runs on a value not yet durable
        else:
            for _ in range(50):  # the loop gets every chance to start b; it must not
                await asyncio.sleep(0.001)
            assert not b_started.is_set()
        held.release.set()
        result = await task
    assert result.output == 2 and b_started.is_set()


async def test_13_durability_is_checked_and_overridable_per_run(store: RunStore) -> None:
    with pytest.raises(ValueError, match="durability"):
        tr.Engine(store=store, durability="eventually")
    g = tr.Graph("per-run")
    g.add_node("a", _record([], "a"))
    with pytest.raises(ValueError, match="durability"):
        await tr.Engine(store=store).run(g, 1, durability="later")
    assert (await tr.Engine(store=store).run(g, 1, durability="sync")).output == 1


class CountingCommits:
    """A store that counts the node rows and events of every commit."""

    def __init__(self, inner: RunStore) -> None:
        self.inner = inner
        self.node_rows = 0
        self.event_seqs: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def commit(self, run_id: str, token: int, harvest: Harvest) -> None:
        self.node_rows += len(harvest.nodes)
        self.event_seqs += [e.seq for e in harvest.events]
        await self.inner.commit(run_id, token, harvest)


async def test_13_async_writes_gather_a_window_of_harvests_one_row_per_node(
    store: RunStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A window longer than the run: whatever the machine's load, every harvest of the
    # run gathers into the window, staged once when the run completes.
    monkeypatch.setattr(tailrace.core._writer, "GROUP_WINDOW", 3600.0)
    counting = CountingCommits(store)
    g = tr.Graph("window")
    names = [f"s{i}" for i in range(200)]
    for name in names:
        g.add_node(name, _record([], name))
    g.chain(*names)
    result = await tr.Engine(store=counting).run(g, 0)  # type: ignore[arg-type]
    assert result.status == "completed"
    # Each node starts and completes (two changes) within the window: one row per
    # node reaches the store, and every event does, in order.
    assert counting.node_rows == len(names)
    assert counting.event_seqs == list(range(1, len(counting.event_seqs) + 1))
    stored = await store.events(result.run_id)
    assert [e.seq for e in stored] == counting.event_seqs


async def _has_result(store: RunStore, run_id: str, node_id: str) -> bool:
    try:
        return bool(await store.results(run_id, node_id))
    except tr.RunNotFound:
        return False


async def test_13_a_window_ends_on_its_own_while_a_long_node_runs(store: RunStore) -> None:
    release = asyncio.Event()
    g = tr.Graph("long-after-short")

    @g.task()
    async def short(x: Any) -> str:
        return "short"

    @g.task()
    async def long(x: Any) -> str:
        await release.wait()
        return "long"

    g.add_edge("short", "long")
    engine = tr.Engine(store=store)
    task = asyncio.create_task(engine.run(g, None, run_id="windowed"))
    async with asyncio.timeout(GUARD):
        # short's completion is written while long still runs: the window's end
        # wakes the loop, nothing else would until long finishes.
        await _wait_for(lambda: _has_result(store, "windowed", "short"), "short's commit")
        assert not task.done()
        release.set()
        assert (await task).output == "long"


def _gated_pair(b_started: asyncio.Event) -> tr.Graph:
    """review (gate) -> a -> b, where ``b`` flags that it started."""
    g = tr.Graph("kept")

    @g.gate()
    async def review(x: Any) -> Any:
        return {"ask": "go?"}

    @g.task()
    async def a(answer: Any) -> int:
        return 1

    @g.task()
    async def b(x: int) -> int:
        b_started.set()
        return x + 1

    g.chain("review", "a", "b")
    return g


@pytest.mark.parametrize("override", [None, "async"])
async def test_13_a_run_keeps_its_durability_across_a_resume(
    store: RunStore, override: str | None
) -> None:
    b_started = asyncio.Event()
    g = _gated_pair(b_started)
    first = await tr.Engine(store=store).run(g, None, run_id="kept", durability="sync")
    assert first.status == "suspended"
    assert json.loads((await store.get_run("kept")).state_json)["durability"] == "sync"
    await store.answer(first.questions[0].question_id, '"go"', by="test")
    held = HeldCommits(store, "a")
    engine = tr.Engine(store=held)  # type: ignore[arg-type]  # its default: "async"
    resumed = asyncio.create_task(engine.resume("kept", g, durability=override))
    async with asyncio.timeout(GUARD):
        await held.entered.wait()  # a's completion is being written, not yet durable
        if override is None:  # the run's own "sync": b waits for a's commit
            for _ in range(50):
                await asyncio.sleep(0.001)
            assert not b_started.is_set()
        else:  # overridden at resume: pipelined
            await b_started.wait()
        held.release.set()
        assert (await resumed).output == 2
    expected = "sync" if override is None else override
    assert json.loads((await store.get_run("kept")).state_json)["durability"] == expected


async def test_13_a_stored_durability_that_is_not_a_mode_is_refused_naming_the_run(
    store: RunStore,
) -> None:
    g = _gated_pair(asyncio.Event())
    first = await tr.Engine(store=store).run(g, None, run_id="odd-mode")
    assert first.status == "suspended"
    record = await store.get_run("odd-mode")
    state = json.loads(record.state_json)
    assert state["durability"] == "async"
    state["durability"] = "<script>"
    harvest = Harvest(state_json=json.dumps(state), status=RunStatus.RUNNING)
    token = await store.acquire_lease("odd-mode", "test", 60.0)
    await store.commit("odd-mode", token, harvest)  # a hostile or damaged state row
    await store.release_lease("odd-mode", "test", token)
    damaged = await store.get_run("odd-mode")
    with pytest.raises(tr.CorruptRecord, match=r"odd-mode.*'<script>'"):
        await tr.Engine(store=store).resume("odd-mode", g)
    after = await store.get_run("odd-mode")  # refused before anything was written
    assert (after.status, after.state_json) == (damaged.status, damaged.state_json)


RANDOM_CHAIN = """
from __future__ import annotations
import asyncio, os, sys, uuid
import tailrace as tr
OPEN_LOCATION

g = tr.Graph("random-chain")
STEPS = 40

def step(i):
    async def handler(x):
        value = f"{i}:{uuid.uuid4().hex}"  # a different value each time it runs
        with open(os.environ["LOG"], "a") as log:
            log.write(f"{i} {x} {value}\\n")  # the input this step acted on
        await asyncio.sleep(0.002)
        return value
    handler.__name__ = f"s{i}"
    return handler

for i in range(STEPS):
    g.add_node(f"s{i}", step(i))
g.chain(*[f"s{i}" for i in range(STEPS)])

async def main():
    async with open_location(sys.argv[1]) as store:
        # "sync" is chosen for this run only: resumes keep it from the store.
        engine = tr.Engine(store=store, lease_ttl=3600)
        run = engine.resume("chain", g) if sys.argv[2] == "resume" else engine.run(
            g, "start", run_id="chain", durability="sync")
        await run

if __name__ == "__main__":
    asyncio.run(main())
"""


@pytest.mark.slow
@pytest.mark.parametrize("store_url", fixtures.SHARED_STORES, indirect=True)
async def test_13_sync_a_successor_never_acted_on_a_value_a_crash_lost(
    tmp_path: Path, store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = tmp_path / "random_chain.py"
    script.write_text(textwrap.dedent(RANDOM_CHAIN).replace("OPEN_LOCATION", OPEN_LOCATION))
    log = tmp_path / "steps.log"
    monkeypatch.setenv("LOG", str(log))
    mode = "run"
    for kill_after in (3, 9, 17, 26):  # SIGKILL after that many steps ran, then resume
        child = await _spawn(script, store_url, mode)
        try:

            async def ran_enough(n: int = kill_after) -> bool:
                return log.exists() and len(log.read_text().splitlines()) >= n

            await _wait_for(ran_enough, f"{kill_after} steps to run")
            child.send_signal(signal.SIGKILL)
            await child.wait()
        finally:
            await _reap(child)
        mode = "resume"
    child = await _spawn(script, store_url, "resume")
    assert await asyncio.wait_for(child.wait(), GUARD) == 0
    async with open_location(store_url) as store:
        assert (await store.get_run("chain")).status == RunStatus.COMPLETED
        committed = {r.value_json.strip('"') for r in await store.results("chain")}
    acted_on = [line.split()[1] for line in log.read_text().splitlines()]
    # Every input a step acted on was durable: an upstream value a crash lost never fed
    # a successor (in "async" mode it may have).
    lost = [value for value in acted_on if value != "start" and value not in committed]
    assert lost == []
    assert len(committed) == 40
