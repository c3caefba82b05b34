"""The Postgres store under faults: lost connections, lost COMMIT answers, deadlocks,
cancellations and timeouts, unreachable servers, text Postgres cannot keep.

Issue 9, findings 9, 4 (the store's side) and 3 (NUL on Postgres). Every test
runs against the server at ``TAILRACE_TEST_POSTGRES_DSN`` (CI starts one), in
a schema of its own, with the store's sessions named by a unique
``application_name`` so that a test can find and kill exactly its own backends.
A lost COMMIT answer is made by a socket proxy between the store and the
server that forwards the COMMIT and drops the server's reply. Orderings are
forced by row locks held on a connection of the test's own and by polling
what the server reports; ``HANG_GUARD`` is a deadlock guard, never a timing
assertion.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tailrace._errors import StoreError
from tailrace.stores import (
    EventRow,
    Harvest,
    NewRun,
    NodeRow,
    QuestionRow,
    QuestionStatus,
    ResultRow,
    RunStatus,
    Submission,
)
from tests import fixtures
from tests.fixtures import POSTGRES_DSN

HANG_GUARD = 20.0
TTL = 30.0

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.skipif(POSTGRES_DSN is None, reason="TAILRACE_TEST_POSTGRES_DSN is not set"),
]

if POSTGRES_DSN is not None:
    import psycopg
    from psycopg import sql
    from psycopg.conninfo import make_conninfo

    from tailrace.stores import PostgresStore


# --- a schema of one's own, and a connection of the test's --------------------------------


@dataclass
class Pg:
    """One test's schema, the DSN its stores use, and back doors to the same database."""

    dsn: str
    schema: str
    app: str

    def store(self, *, dsn: str | None = None, **options: Any) -> PostgresStore:
        target = make_conninfo(dsn or self.dsn, application_name=self.app)
        return PostgresStore(target, schema=self.schema, **options)

    @contextlib.asynccontextmanager
    async def raw(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """A connection of the test's own (not the store's), in the test's schema."""
        conn = await psycopg.AsyncConnection.connect(self.dsn, autocommit=True)
        try:
            await conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(self.schema)))
            yield conn
        finally:
            await conn.close()

    async def fetch(self, query: str, *params: object) -> list[tuple[Any, ...]]:
        async with self.raw() as conn:
            cur = await conn.execute(query, params or None)
            return list(await cur.fetchall())

    async def store_backends(self, *, waiting: bool = False) -> list[int]:
        """Pids of the store's sessions (those waiting for a lock only, if ``waiting``)."""
        lock = " AND wait_event_type = 'Lock'" if waiting else ""
        rows = await self.fetch(
            f"SELECT pid FROM pg_stat_activity WHERE application_name = %s{lock}", self.app
        )
        return [r[0] for r in rows]


@pytest.fixture
async def pg() -> AsyncIterator[Pg]:
    assert POSTGRES_DSN is not None
    tag = uuid.uuid4().hex[:12]
    db = Pg(POSTGRES_DSN, f"tailrace_faults_{tag}", f"tailrace-test-{tag}")
    try:
        yield db
    finally:
        async with await psycopg.AsyncConnection.connect(POSTGRES_DSN, autocommit=True) as conn:
            await conn.execute(
                sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(db.schema))
            )


async def until(check: Callable[[], Any], what: str) -> None:
    """Poll ``check`` (sync or async) until it is true; fail after ``HANG_GUARD`` seconds."""
    async with asyncio.timeout(HANG_GUARD):
        while True:
            value = check()
            if asyncio.iscoroutine(value):
                value = await value
            if value:
                return
            await asyncio.sleep(0.01)
    pytest.fail(f"never: {what}")  # pragma: no cover


def new_run(run_id: str = "r1") -> NewRun:
    return NewRun(
        run_id=run_id, graph_name="g", graph_ref="pkg.mod:g", fingerprint="fp",
        input_json='{"x":1}', created_at=1.0,
    )  # fmt: skip


def question(question_id: str, run_id: str = "r1") -> QuestionRow:
    return QuestionRow(
        question_id=question_id, run_id=run_id, node_id="gate", visit=1, turn=1,
        prompt_json='"ok?"', created_at=1.0,
    )  # fmt: skip


def event(seq: int, data_json: str = "{}") -> EventRow:
    return EventRow(
        seq=seq, type="node_completed", node_id="a", visit=1, attempt=1, ts=1.0,
        data_json=data_json,
    )  # fmt: skip


def full_harvest(*, applied: tuple[str, ...] = ()) -> Harvest:
    """A harvest with a row of every kind: re-applying it would break a primary key or a CAS."""
    return Harvest(
        state_json='{"turn":2}',
        nodes=(NodeRow(node_id="a", status="completed", visits=1, data_json="{}"),),
        results=(ResultRow(node_id="a", visit=1, value_json='"A"'),),
        events=(event(1),),
        applied=applied,
        nodes_done_delta=1,
    )


async def leased_run(store: PostgresStore, run_id: str = "r1") -> int:
    await store.create_run(new_run(run_id))
    return await store.acquire_lease(run_id, "owner-A", TTL)


async def answered_question(store: PostgresStore, token: int, run_id: str = "r1") -> None:
    await store.commit(run_id, token, Harvest(state_json="{}", questions=(question("q1", run_id),)))
    await store.answer("q1", '"yes"', by="alice")


async def assert_applied_once(store: PostgresStore, run_id: str = "r1") -> None:
    """The full harvest is in the store exactly once."""
    assert await store.results(run_id) == [ResultRow(node_id="a", visit=1, value_json='"A"')]
    assert [e.seq for e in await store.events(run_id)] == [1]
    assert (await store.get_run(run_id)).nodes_done == 1
    assert (await store.load_run(run_id)).nodes["a"].status == "completed"


# --- a proxy that loses the answer to a COMMIT ------------------------------------------


class CommitCutter(fixtures.SocketProxy):
    """A unix-socket proxy in front of the server that can cut a connection at its next COMMIT.

    Armed with ``after=True``, it forwards the COMMIT, waits for the server's
    answer (the transaction is then durable), drops that answer and closes
    the connection: the client cannot know whether its COMMIT landed. With
    ``after=False`` it closes the connection instead of forwarding the COMMIT.
    """

    def __init__(self, target: str, directory: Path) -> None:
        super().__init__(target, directory)
        self.armed: bool | None = None
        self.cuts = 0
        self._drop_next = False

    def arm(self, *, after: bool) -> None:
        self.armed = after

    async def link(self, client: fixtures.Ends, server: fixtures.Ends) -> None:
        (reader, writer), (up_reader, up_writer) = client, server
        answer = asyncio.Event()
        async with asyncio.TaskGroup() as group:
            down = group.create_task(self._pump(up_reader, writer, answer))
            await self._client_to_server(reader, up_writer, answer)
            down.cancel()

    async def _client_to_server(
        self,
        reader: asyncio.StreamReader,
        up: asyncio.StreamWriter,
        answer: asyncio.Event,
    ) -> None:
        while chunk := await reader.read(65536):
            if self.armed is not None and b"COMMIT" in chunk:
                after, self.armed = self.armed, None
                if after:
                    answer.clear()
                    self._drop_next = True
                    up.write(chunk)
                    await up.drain()
                    await answer.wait()  # the server answered: the COMMIT is durable
                self.cuts += 1
                return
            up.write(chunk)
            await up.drain()

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, answer: asyncio.Event
    ) -> None:
        while chunk := await reader.read(65536):
            if self._drop_next:
                self._drop_next = False
                answer.set()
                return
            writer.write(chunk)
            await writer.drain()


@pytest.fixture
async def cutter(pg: Pg, tmp_path: Path) -> AsyncIterator[CommitCutter]:
    async with CommitCutter.before(pg.dsn, tmp_path) as proxy:
        yield proxy


def through(pg: Pg, proxy: CommitCutter) -> str:
    return proxy.dsn(pg.dsn)


# --- finding 9: a lost COMMIT answer, lost connections, deadlocks ------------------------------


@pytest.mark.parametrize("after", [True, False], ids=["commit-landed", "commit-lost"])
async def test_a_commit_whose_answer_is_lost_is_applied_exactly_once(
    pg: Pg, cutter: CommitCutter, after: bool, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tailrace.stores.postgres")
    async with pg.store(dsn=through(pg, cutter), max_size=1) as store:
        token = await leased_run(store)
        await answered_question(store, token)
        cutter.arm(after=after)
        await store.commit(
            "r1", token, full_harvest(applied=("q1",))
        )  # no error, no AlreadyAnswered
        assert cutter.cuts == 1
        await assert_applied_once(store)
        assert (await store.get_question("q1")).status is QuestionStatus.APPLIED
    landed = [r for r in caplog.records if "had landed" in r.getMessage()]
    assert len(landed) == (1 if after else 0)


@pytest.mark.parametrize("after", [True, False], ids=["commit-landed", "commit-lost"])
async def test_a_claim_whose_commit_answer_is_lost_hands_out_its_runs_once(
    pg: Pg, cutter: CommitCutter, after: bool
) -> None:
    """The claim's transaction id comes from its one UPDATE: a lost COMMIT answer is settled
    by it, so the claimer gets the runs it leased (not a re-run finding nothing) or, if the
    COMMIT never landed, leases them in a re-run; either way each run is claimed once."""
    async with pg.store(dsn=through(pg, cutter), max_size=1) as store:
        await store.submit_runs([(new_run(r), Submission(queue="q")) for r in ("r1", "r2")])
        before = {r: (await store.get_run(r)).lease_token for r in ("r1", "r2")}
        cutter.arm(after=after)
        claimed = await store.claim_runs("q", "w", TTL, limit=2)
        assert cutter.cuts == 1
        assert sorted(claimed) == ["r1", "r2"]
        for run_id in ("r1", "r2"):
            record = await store.get_run(run_id)
            assert (record.status, record.lease_owner) == (RunStatus.RUNNING, "w")
            assert record.lease_token == before[run_id] + 1  # leased by one claim only
        assert await store.claim_runs("q", "w2", TTL, limit=2) == []


async def test_other_writes_whose_commit_answer_is_lost_are_not_repeated(
    pg: Pg, cutter: CommitCutter
) -> None:
    async with pg.store(dsn=through(pg, cutter), max_size=1) as store:
        cutter.arm(after=True)
        await store.create_run(new_run("r1"))  # not RunExists: the lost insert was ours
        token = await store.acquire_lease("r1", "owner-A", TTL)
        await store.commit("r1", token, Harvest(state_json="{}", questions=(question("q1"),)))
        cutter.arm(after=True)
        row = await store.answer("q1", '"yes"', by="alice")  # not AlreadyAnswered
        assert (row.status, row.answer_json, row.answered_by) == ("answered", '"yes"', "alice")
        cutter.arm(after=True)
        assert await store.mark_applied("q1") is True  # it was this call that applied it
        cutter.arm(after=True)
        version = await store.commit_artifact("prompts", 0, '{"a":"x"}')  # not StaleVersion
        assert version.version == 1
        assert cutter.cuts == 4
        assert [v.version for v in await store.artifact_history("prompts")] == [1]
        assert (await store.get_question("q1")).status is QuestionStatus.APPLIED


async def test_the_pool_replaces_connections_the_server_killed(
    pg: Pg, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tailrace.stores.postgres")
    async with pg.store(min_size=2, max_size=2) as store:
        token = await leased_run(store)
        await until(lambda: _count(pg.store_backends(), 2), "two pooled connections")
        killed = await pg.store_backends()
        async with pg.raw() as raw:
            for pid in killed:
                await raw.execute("SELECT pg_terminate_backend(%s)", (pid,))
        await until(lambda: _gone(pg.store_backends(), killed), "the killed sessions gone")
        await store.heartbeat("r1", "owner-A", token, TTL)
        assert (await store.get_run("r1")).lease_owner == "owner-A"
    # The pool checked each connection before handing it out: no call ever saw a dead one.
    assert [r.getMessage() for r in caplog.records if "retrying" in r.getMessage()] == []


async def _count(pids: Any, n: int) -> bool:
    return len(await pids) >= n


async def _gone(pids: Any, killed: list[int]) -> bool:
    return not set(await pids) & set(killed)


async def test_a_transaction_whose_backend_is_killed_is_rerun_whole(
    pg: Pg, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tailrace.stores.postgres")
    async with pg.store(max_size=2) as store:
        token = await leased_run(store)
        await answered_question(store, token)
        async with pg.raw() as raw, raw.transaction():
            await raw.execute("SELECT 1 FROM questions WHERE question_id = 'q1' FOR UPDATE")
            commit = asyncio.create_task(store.commit("r1", token, full_harvest(applied=("q1",))))
            await until(lambda: _count(pg.store_backends(waiting=True), 1), "the commit waits")
            for pid in await pg.store_backends(waiting=True):
                await raw.execute("SELECT pg_terminate_backend(%s)", (pid,))
        await commit
        await assert_applied_once(store)
    assert any("administrator command" in r.getMessage() for r in caplog.records)


async def test_a_commit_chosen_as_deadlock_victim_is_rerun_whole(
    pg: Pg, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tailrace.stores.postgres")
    async with pg.store(max_size=2) as store:
        token = await leased_run(store)
        await answered_question(store, token)
        async with pg.raw() as raw:
            await raw.execute("SET deadlock_timeout = '60s'")  # the store's session detects it
            async with raw.transaction():
                await raw.execute("SELECT 1 FROM questions WHERE question_id = 'q1' FOR UPDATE")
                harvest = full_harvest(applied=("q1",))
                commit = asyncio.create_task(store.commit("r1", token, harvest))
                await until(lambda: _count(pg.store_backends(waiting=True), 1), "commit waits")
                await raw.execute("SELECT 1 FROM runs WHERE run_id = 'r1' FOR UPDATE")  # cycle
        await commit
        await assert_applied_once(store)
        assert (await store.get_question("q1")).status is QuestionStatus.APPLIED
    assert any("deadlock detected" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    ("host", "reason"),
    [("missing-dir", "No such file or directory"), ("127.0.0.1:1", "refused")],
    ids=["no-socket", "refused"],
)
async def test_an_unreachable_server_fails_fast_with_the_drivers_reason(
    pg: Pg, tmp_path: Path, host: str, reason: str
) -> None:
    if host == "missing-dir":
        dsn = make_conninfo(pg.dsn, host=str(tmp_path / host))
    else:
        dsn = make_conninfo(pg.dsn, host="127.0.0.1", port="1")
    store = pg.store(dsn=dsn, connect_timeout=2)
    async with asyncio.timeout(HANG_GUARD):  # the pool would wait 30 s
        with pytest.raises(StoreError, match=reason) as info:
            await store.open()
    assert "pool initialization" not in str(info.value)
    assert pg.schema in str(info.value)
    assert isinstance(info.value.__cause__, psycopg.OperationalError)


# --- finding 4: cancellation and timeouts ------------------------------------------------------


async def test_a_timeout_around_a_call_waiting_for_the_busy_pool_fires(pg: Pg) -> None:
    async with pg.store(max_size=1) as store:
        token = await leased_run(store)
        async with pg.raw() as raw:
            async with raw.transaction():
                await raw.execute("SELECT 1 FROM runs WHERE run_id = 'r1' FOR UPDATE")
                beat = asyncio.create_task(store.heartbeat("r1", "owner-A", token, TTL))
                await until(lambda: _count(pg.store_backends(waiting=True), 1), "pool busy")
                with pytest.raises(TimeoutError):  # not a StoreError after the 15 s budget
                    async with asyncio.timeout(0.2):
                        await store.get_run("r1")
                assert not beat.done()
            await beat
        assert (await store.get_run("r1")).lease_owner == "owner-A"  # the pool is usable


def after_hops(hops: int, action: Callable[[], object]) -> None:
    """Call ``action`` ``hops`` event-loop iterations from now."""
    if hops == 0:
        action()
    else:
        asyncio.get_running_loop().call_soon(after_hops, hops - 1, action)


async def test_a_timeout_that_fires_as_the_pool_hands_over_is_honoured(pg: Pg) -> None:
    """CPython 3.11's ``wait_for`` inside psycopg_pool drops a cancellation at the handover."""
    async with pg.store(max_size=1) as store:
        await leased_run(store)
        outcomes = [await timeout_at_handover(store, hops) for hops in range(16)]
        assert "expired-but-returned" not in outcomes, outcomes
        assert "timed-out" in outcomes  # the timeout did land in the handover window
        assert (await store.get_run("r1")).lease_owner == "owner-A"


async def timeout_at_handover(store: PostgresStore, hops: int) -> str:
    """Call the store with the pool busy; free it and fire the call's timeout ``hops`` later."""
    pool = store._db._pool  # back door: hold the only connection, give it back at a chosen moment
    assert pool is not None
    scopes: list[asyncio.Timeout] = []

    async def call() -> str:
        async with asyncio.timeout(None) as scope:
            scopes.append(scope)
            await store.get_run("r1")
        return "expired-but-returned" if scope.expired() else "returned"

    async with asyncio.timeout(HANG_GUARD), pool.connection():  # a leaked connection hangs here
        victim = asyncio.create_task(call())
        await until(lambda: pool.get_stats().get("requests_waiting", 0) == 1, "queued")
    loop = asyncio.get_running_loop()
    after_hops(hops, lambda: scopes[0].reschedule(loop.time()))
    try:
        return await victim
    except TimeoutError:
        return "timed-out"


@pytest.mark.parametrize("call", ["release_lease", "heartbeat", "commit"])
async def test_a_shielded_call_completes_though_its_caller_is_cancelled(pg: Pg, call: str) -> None:
    async with pg.store(max_size=1) as store:
        token = await leased_run(store)
        work = {
            "release_lease": lambda: store.release_lease("r1", "owner-A", token),
            "heartbeat": lambda: store.heartbeat("r1", "owner-A", token, 2 * TTL),
            "commit": lambda: store.commit("r1", token, full_harvest()),
        }[call]
        before = await store.get_run("r1")
        async with pg.raw() as raw:
            async with raw.transaction():
                await raw.execute("SELECT 1 FROM runs WHERE run_id = 'r1' FOR UPDATE")

                async def caller() -> None:
                    await asyncio.shield(work())

                task = asyncio.create_task(caller())
                await until(lambda: _count(pg.store_backends(waiting=True), 1), "the call waits")
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            after = await _poll_changed(store, before)
        if call == "release_lease":
            assert after.lease_owner is None
        elif call == "heartbeat":
            assert after.lease_expires is not None and before.lease_expires is not None
            assert after.lease_expires > before.lease_expires
        else:
            await assert_applied_once(store)


async def _poll_changed(store: PostgresStore, before: Any) -> Any:
    seen: list[Any] = []

    async def changed() -> bool:
        seen[:] = [await store.get_run("r1")]
        return bool(seen[0] != before)

    await until(changed, "the shielded call landed")
    return seen[0]


async def test_a_cancelled_acquire_lease_leaves_no_lease(pg: Pg) -> None:
    async with pg.store(max_size=1) as store:
        outcomes: list[str] = []
        for hops in range(1000):
            outcomes.append(await cancel_acquire(store, f"r{hops}", hops))
            if outcomes[-1] == "finished-first":
                break
        assert outcomes[-1] == "finished-first"
        assert outcomes.count("cancelled") >= 3


async def cancel_acquire(store: PostgresStore, run_id: str, hops: int) -> str:
    """Cancel an ``acquire_lease`` ``hops`` loop iterations in; check that no lease is left."""
    await store.create_run(new_run(run_id))
    task = asyncio.create_task(store.acquire_lease(run_id, "owner-A", TTL))
    requested: list[bool] = []
    after_hops(hops, lambda: requested.append(task.cancel()))
    try:
        token = await task
    except asyncio.CancelledError:
        record = await store.get_run(run_id)
        assert record.lease_owner is None, f"cancelled after {hops} hops: the lease was left"
        return "cancelled"
    await until(lambda: requested, "the cancel request")
    assert requested == [False], "the acquire returned though it was cancelled"
    await store.release_lease(run_id, "owner-A", token)
    return "finished-first"


# --- finding 3 (NUL and lone surrogates on Postgres), driver errors, read-only --------------


def with_result(value_json: str, node_id: str = "a") -> Harvest:
    return Harvest(
        state_json="{}", results=(ResultRow(node_id=node_id, visit=1, value_json=value_json),)
    )


TEXT_CASES = {
    "nul-state": (Harvest(state_json='{"s":"\x00"}'), "state_json"),
    "surrogate-state": (Harvest(state_json='"\ud800"'), "state_json"),
    "nul-result": (with_result('"\x00"'), "result of node 'a' visit 1"),
    "surrogate-event": (
        Harvest(state_json="{}", events=(event(1, '"\udc80"'),)),
        "data_json of event seq 1",
    ),
    "nul-node-id": (with_result("1", node_id="a\x00"), "node_id"),
}


@pytest.mark.parametrize("case", list(TEXT_CASES))
async def test_text_postgres_cannot_keep_is_refused_naming_the_field(pg: Pg, case: str) -> None:
    bad, field = TEXT_CASES[case]
    async with pg.store() as store:
        token = await leased_run(store)
        before = await store.load_run("r1")
        with pytest.raises(ValueError, match=f"run 'r1'.*{re.escape(field)}") as info:
            await store.commit("r1", token, bad)
        assert not isinstance(info.value, psycopg.Error)
        assert await store.load_run("r1") == before
        assert await store.results("r1") == [] and await store.events("r1") == []


async def test_nul_in_ids_and_answers_is_refused_naming_the_field(pg: Pg) -> None:
    async with pg.store() as store:
        with pytest.raises(ValueError, match="run_id"):
            await store.create_run(new_run("bad\x00id"))
        with pytest.raises(ValueError, match="input_json"):
            await store.create_run(
                NewRun(run_id="r2", graph_name="g", graph_ref=None, fingerprint="fp",
                       input_json='"\x00"', created_at=1.0)
            )  # fmt: skip
        assert await store.list_runs() == []
        token = await leased_run(store)
        await store.commit("r1", token, Harvest(state_json="{}", questions=(question("q1"),)))
        with pytest.raises(ValueError, match=r"question 'q1'.*answer_json"):
            await store.answer("q1", '"\x00"')
        with pytest.raises(ValueError, match="by"):
            await store.answer("q1", '"yes"', by="al\x00ice")
        assert (await store.get_question("q1")).status is QuestionStatus.OPEN


async def test_driver_errors_become_store_errors_naming_the_run(pg: Pg) -> None:
    async with pg.store() as store:
        await leased_run(store)
        async with pg.raw() as raw:
            await raw.execute("DROP TABLE events")
        with pytest.raises(StoreError, match=r"run 'r1'.*events") as info:
            await store.events("r1")
        assert isinstance(info.value.__cause__, psycopg.Error)


async def test_a_read_only_store_reads_and_refuses_writes(pg: Pg) -> None:
    async with pg.store() as store:
        await leased_run(store)
    async with pg.store(read_only=True) as reader:
        assert reader.read_only
        assert (await reader.get_run("r1")).status is RunStatus.RUNNING
        with pytest.raises(StoreError, match="read-only"):
            await reader.create_run(new_run("r2"))
        with pytest.raises(StoreError, match="read-only"):
            await reader.release_lease("r1", "owner-A", 1)
    nowhere = PostgresStore(pg.dsn, schema=f"{pg.schema}_none", read_only=True)
    with pytest.raises(StoreError, match="no tailrace tables"):
        await nowhere.open()
