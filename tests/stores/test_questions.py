"""The question ledger, run against every backend (memory, SQLite, Postgres).

Clauses: Q2 (first answer wins: an atomic compare-and-set ``open -> answered``),
Q3 (an answer is applied exactly once, across tasks and processes; a refused
harvest writes nothing), Q4 (unapplied answers are found again), Q5 (expired
questions), D1 (questions are committed with the rest of their harvest) and D4
(migration 2 upgrades a version-1 database in place).
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

import tailrace as tr
import tailrace.stores as stores
from tailrace._errors import (
    AlreadyAnswered,
    LeaseLost,
    QuestionError,
    QuestionNotFound,
    StoreError,
)
from tailrace.stores import (
    QUESTION_TRANSITIONS,
    EventRow,
    Harvest,
    NewRun,
    NodeRow,
    QuestionRow,
    QuestionStatus,
    ResultRow,
    RunStatus,
    RunStore,
    SQLiteStore,
)
from tailrace.stores._sql._statements import (
    CREATE_MIGRATIONS_TABLE,
    MIGRATIONS,
)
from tests.fixtures import POSTGRES_DSN, migration_1_run

if TYPE_CHECKING:
    from tests.fixtures import Backend

TTL = 30.0

SRC_DIR = Path(stores.__file__).resolve().parents[2]


def new_run(run_id: str = "r1") -> NewRun:
    return NewRun(
        run_id=run_id, graph_name="g", graph_ref=None, fingerprint="fp", input_json="null",
        created_at=1.0,
    )  # fmt: skip


def question(
    question_id: str = "q1", run_id: str = "r1", *, created_at: float = 1.0, turn: int = 1
) -> QuestionRow:
    return QuestionRow(
        question_id=question_id, run_id=run_id, node_id="gate", visit=1, turn=turn,
        prompt_json='{"ask":"ok?"}', poller=None, deadline=None, created_at=created_at,
    )  # fmt: skip


def event(seq: int) -> EventRow:
    return EventRow(
        seq=seq, type="node_completed", node_id="a", visit=1, attempt=1, ts=float(seq),
        data_json="{}",
    )  # fmt: skip


def node(node_id: str) -> NodeRow:
    return NodeRow(node_id=node_id, status="completed", visits=1, data_json="{}")


def result(node_id: str) -> ResultRow:
    return ResultRow(node_id=node_id, visit=1, value_json="1")


async def leased_run(store: RunStore, run_id: str = "r1") -> int:
    await store.create_run(new_run(run_id))
    return await store.acquire_lease(run_id, "A", TTL)


async def open_questions(store: RunStore, token: int, *rows: QuestionRow) -> None:
    await store.commit(rows[0].run_id, token, Harvest(state_json="{}", questions=rows))


#: How to bring question "q1" (already open) into each state.
STATES = ["open", "answered", "expired", "applied", "expired-applied", "superseded"]


async def put_in_state(store: RunStore, state: str) -> None:
    if state in ("answered", "applied"):
        await store.answer("q1", '"yes"', by="alice")
    if state in ("expired", "expired-applied"):
        await store.answer("q1", '{"timeout":true}', by="poller", status=QuestionStatus.EXPIRED)
    if state in ("applied", "expired-applied"):
        assert await store.mark_applied("q1")
    if state == "superseded":
        assert await store.supersede("q1")


async def question_in(store: RunStore, state: str) -> int:
    """Run r1, leased, with question q1 in ``state``; returns the lease token."""
    token = await leased_run(store)
    await open_questions(store, token, question("q1"))
    await put_in_state(store, state)
    return token


# --- the facade ---------------------------------------------------------------------


def test_the_ledger_types_are_exported() -> None:
    assert {"QUESTION_TRANSITIONS", "QuestionRow", "QuestionStatus"} <= set(stores.__all__)
    assert QuestionStatus.APPLIED not in QUESTION_TRANSITIONS[QuestionStatus.OPEN]
    assert issubclass(QuestionNotFound, KeyError)
    assert issubclass(AlreadyAnswered, QuestionError)


# --- D1: questions are committed with their harvest -----------------------------------


async def test_harvest_inserts_questions_with_the_rest(store: RunStore) -> None:
    token = await leased_run(store)
    q1, q2 = question("q1"), question("q2", created_at=2.0, turn=3)
    await store.commit(
        "r1",
        token,
        Harvest(
            state_json='{"waiting":true}', status=RunStatus.SUSPENDED, nodes=(node("a"),),
            results=(result("a"),), events=(event(1),), questions=(q1, q2), nodes_done_delta=1,
        ),
    )  # fmt: skip
    assert await store.get_question("q1") == q1
    assert await store.get_question("q2") == q2
    assert await store.list_questions(run_id="r1") == [q1, q2]
    loaded = await store.load_run("r1")
    assert (loaded.run.status, loaded.run.nodes_done, set(loaded.nodes)) == (
        RunStatus.SUSPENDED,
        1,
        {"a"},
    )
    assert await store.events("r1") == [event(1)]


async def test_a_refused_harvest_opens_no_question(store: RunStore) -> None:
    token = await leased_run(store)
    await store.commit("r1", token, Harvest(state_json="{}", results=(result("a"),)))
    doomed = Harvest(state_json='{"x":1}', results=(result("a"),), questions=(question("q1"),))
    with pytest.raises(StoreError, match="r1"):
        await store.commit("r1", token, doomed)
    with pytest.raises(QuestionNotFound, match="q1"):
        await store.get_question("q1")


async def test_a_question_id_is_never_reused(store: RunStore) -> None:
    token = await leased_run(store)
    await open_questions(store, token, question("q1"))
    again = Harvest(state_json='{"x":1}', events=(event(1),), questions=(question("q1", turn=9),))
    with pytest.raises(StoreError, match=r"r1.*q1"):
        await store.commit("r1", token, again)
    twice = Harvest(state_json='{"x":2}', questions=(question("q2"), question("q2")))
    with pytest.raises(StoreError, match="q2"):
        await store.commit("r1", token, twice)
    assert await store.list_questions() == [question("q1")]
    assert await store.events("r1") == []
    assert (await store.get_run("r1")).state_json == "{}"


async def test_a_harvest_only_opens_open_questions(store: RunStore) -> None:
    token = await leased_run(store)
    answered = QuestionRow(
        question_id="q1", run_id="r1", node_id="gate", visit=1, turn=1, prompt_json="{}",
        status=QuestionStatus.ANSWERED, answer_json='"yes"',
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"q1.*open"):
        await store.commit("r1", token, Harvest(state_json='{"x":1}', questions=(answered,)))
    assert await store.list_questions() == []
    assert (await store.get_run("r1")).state_json == "{}"


# --- Q2: first answer wins ----------------------------------------------------------


async def test_first_answer_wins(backend: Backend) -> None:
    store = backend.store
    token = await leased_run(store)
    await open_questions(store, token, question("q1"))
    backend.clock.advance(5)
    row = await store.answer("q1", '"yes"', by="alice")
    assert row == await store.get_question("q1")
    assert (row.status, row.answer_json, row.answered_by) == (
        QuestionStatus.ANSWERED,
        '"yes"',
        "alice",
    )
    assert (row.answered_at, row.applied_at) == (backend.clock.now, None)
    backend.clock.advance(5)
    with pytest.raises(AlreadyAnswered, match=r"'q1'.*answered"):
        await store.answer("q1", '"no"', by="bob")
    with pytest.raises(AlreadyAnswered, match=r"'q1'.*answered"):
        await store.answer("q1", '"late"', status=QuestionStatus.EXPIRED)
    assert await store.get_question("q1") == row


async def test_an_expired_question_can_no_longer_be_answered(backend: Backend) -> None:
    store = backend.store
    token = await leased_run(store)
    await open_questions(store, token, question("q1"))
    row = await store.answer("q1", '{"timeout":1}', by="serve", status=QuestionStatus.EXPIRED)
    assert (row.status, row.answered_at, row.applied_at) == (
        QuestionStatus.EXPIRED,
        backend.clock.now,
        None,
    )
    with pytest.raises(AlreadyAnswered, match=r"'q1'.*expired"):
        await store.answer("q1", '"yes"')
    assert await store.get_question("q1") == row


@pytest.mark.parametrize(
    "status", [QuestionStatus.OPEN, QuestionStatus.APPLIED, QuestionStatus.SUPERSEDED]
)
async def test_an_answer_sets_answered_or_expired_only(
    store: RunStore, status: QuestionStatus
) -> None:
    token = await leased_run(store)
    await open_questions(store, token, question("q1"))
    with pytest.raises(ValueError, match=r"q1.*answered.*expired"):
        await store.answer("q1", '"yes"', status=status)
    assert await store.get_question("q1") == question("q1")


async def test_answer_accepts_the_status_as_plain_text(store: RunStore) -> None:
    token = await leased_run(store)
    await open_questions(store, token, question("q1"))
    row = await store.answer("q1", "1", status="expired")  # type: ignore[arg-type]
    assert row.status is QuestionStatus.EXPIRED


async def test_32_concurrent_answers_have_exactly_one_winner(store: RunStore) -> None:
    token = await leased_run(store)
    await open_questions(store, token, question("q1"))
    outcomes = await asyncio.gather(
        *(store.answer("q1", json.dumps(i), by=f"user-{i}") for i in range(32)),
        return_exceptions=True,
    )
    winners = [o for o in outcomes if isinstance(o, QuestionRow)]
    assert len(winners) == 1
    assert all(isinstance(o, AlreadyAnswered) for o in outcomes if o is not winners[0])
    stored = await store.get_question("q1")
    assert stored == winners[0]
    assert stored.answer_json == json.dumps(int(stored.answered_by.split("-")[1]))  # type: ignore[union-attr]


_ANSWERER = """
import asyncio, json, sys
from tailrace._errors import AlreadyAnswered
from tailrace.stores import QuestionRow, SQLiteStore

async def main(kind, target, schema, tag):
    if kind == "sqlite":
        store = SQLiteStore(target, busy_timeout=30)
    else:
        from tailrace.stores import PostgresStore
        store = PostgresStore(target, schema=schema, max_size=8)
    async with store:
        print("ready", flush=True)
        await asyncio.to_thread(sys.stdin.readline)  # the start signal: all race at once
        outcomes = await asyncio.gather(
            *(store.answer("q1", json.dumps(f"{tag}-{i}"), by=f"{tag}-{i}") for i in range(8)),
            return_exceptions=True,
        )
    print(json.dumps({
        "wins": [o.answered_by for o in outcomes if isinstance(o, QuestionRow)],
        "lost": sum(isinstance(o, AlreadyAnswered) for o in outcomes),
        "other": [repr(o) for o in outcomes if not isinstance(o, (QuestionRow, AlreadyAnswered))],
    }))

asyncio.run(main(*sys.argv[1:]))
"""


@pytest.mark.slow
async def test_answers_racing_across_processes_have_exactly_one_winner(backend: Backend) -> None:
    if backend.sibling is None:
        pytest.skip("a memory store is one process's own")
    store = backend.store
    token = await leased_run(store)
    await open_questions(store, token, question("q1"))
    if isinstance(store, SQLiteStore):
        args = ["sqlite", store.path, "-"]
    else:
        assert POSTGRES_DSN is not None
        args = ["postgres", POSTGRES_DSN, store.schema]  # type: ignore[attr-defined]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC_DIR), os.environ.get("PYTHONPATH")])),
    }
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            _ANSWERER,
            *args,
            f"p{n}",
            env=env,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        for n in range(4)
    ]
    try:
        for p in procs:
            assert p.stdout is not None
            assert await p.stdout.readline() == b"ready\n", (await p.communicate())[1].decode()
        for p in procs:
            assert p.stdin is not None
            p.stdin.write(b"go\n")
            await p.stdin.drain()
            p.stdin.close()
        reports: list[dict[str, Any]] = []
        for p in procs:
            out, err = await p.communicate()
            assert p.returncode == 0, err.decode()
            reports.append(json.loads(out))
    finally:  # a failed test must not leave its racers waiting on stdin
        for p in procs:
            if p.returncode is None:
                p.kill()
                await p.wait()
    wins = [w for r in reports for w in r["wins"]]
    assert len(wins) == 1
    assert sum(r["lost"] for r in reports) == 31
    assert [o for r in reports for o in r["other"]] == []
    stored = await store.get_question("q1")
    assert (stored.status, stored.answered_by, stored.answer_json) == (
        QuestionStatus.ANSWERED,
        wins[0],
        json.dumps(wins[0]),
    )


# --- Q3: applied exactly once ---------------------------------------------------------


async def test_a_harvest_applies_an_answer(backend: Backend) -> None:
    store = backend.store
    token = await question_in(store, "answered")
    backend.clock.advance(7)
    await store.commit(
        "r1", token, Harvest(state_json='{"resumed":1}', events=(event(1),), applied=("q1",))
    )
    row = await store.get_question("q1")
    assert (row.status, row.applied_at, row.answer_json) == (
        QuestionStatus.APPLIED,
        backend.clock.now,
        '"yes"',
    )
    assert await store.events("r1") == [event(1)]


async def test_applying_twice_refuses_the_whole_second_harvest(backend: Backend) -> None:
    store = backend.store
    token = await question_in(store, "answered")
    await store.commit("r1", token, Harvest(state_json='{"turn":2}', applied=("q1",)))
    await store.create_run(new_run("r0"))
    r0_token = await store.acquire_lease("r0", "A", TTL)
    await open_questions(store, r0_token, question("q0", run_id="r0"))
    applied_once = await store.get_question("q1")
    before = await store.load_run("r1")
    backend.clock.advance(3)
    again = Harvest(
        state_json='{"turn":3}', status=RunStatus.COMPLETED, nodes=(node("after"),),
        results=(result("after"),), events=(event(1), event(2)), questions=(question("q9"),),
        superseded=("q0",), applied=("q1",), nodes_done_delta=1, finished_at=9.0,
    )  # fmt: skip
    with pytest.raises(AlreadyAnswered, match=r"r1.*'q1' is applied.*nothing of this harvest"):
        await store.commit("r1", token, again)
    assert await store.load_run("r1") == before
    assert "after" not in (await store.load_run("r1")).nodes
    assert await store.results("r1") == []
    assert await store.events("r1") == []
    assert await store.get_question("q1") == applied_once
    assert (await store.get_question("q0")).status is QuestionStatus.OPEN
    with pytest.raises(QuestionNotFound, match="q9"):
        await store.get_question("q9")


async def test_one_id_listed_twice_is_applied_at_most_once(store: RunStore) -> None:
    token = await question_in(store, "answered")
    with pytest.raises(AlreadyAnswered, match="q1"):
        await store.commit("r1", token, Harvest(state_json='{"x":1}', applied=("q1", "q1")))
    assert (await store.get_question("q1")).status is QuestionStatus.ANSWERED
    assert (await store.get_run("r1")).state_json == "{}"


async def test_an_expired_question_applied_stays_expired(backend: Backend) -> None:
    store = backend.store
    token = await question_in(store, "expired")
    backend.clock.advance(4)
    await store.commit("r1", token, Harvest(state_json="{}", applied=("q1",)))
    row = await store.get_question("q1")
    assert (row.status, row.applied_at) == (QuestionStatus.EXPIRED, backend.clock.now)
    with pytest.raises(AlreadyAnswered, match=r"'q1' is expired and already applied"):
        await store.commit("r1", token, Harvest(state_json='{"x":1}', applied=("q1",)))
    assert await store.get_question("q1") == row


@pytest.mark.parametrize("state", STATES)
async def test_a_harvest_applies_only_answers_not_applied_yet(store: RunStore, state: str) -> None:
    token = await question_in(store, state)
    before = await store.get_question("q1")
    applies = Harvest(state_json='{"x":1}', events=(event(1),), applied=("q1",))
    if state in ("answered", "expired"):
        await store.commit("r1", token, applies)
        assert (await store.get_question("q1")).applied_at is not None
        return
    status = "expired and already applied" if state == "expired-applied" else state
    with pytest.raises(AlreadyAnswered, match=f"'q1' is {status},"):
        await store.commit("r1", token, applies)
    assert await store.get_question("q1") == before
    assert await store.events("r1") == []


async def test_a_harvest_cannot_apply_a_question_it_opens(store: RunStore) -> None:
    token = await leased_run(store)
    both = Harvest(state_json='{"x":1}', questions=(question("q1"),), applied=("q1",))
    with pytest.raises(AlreadyAnswered, match=r"'q1' is open"):
        await store.commit("r1", token, both)
    assert await store.list_questions() == []


async def test_applying_an_unknown_question_writes_nothing(store: RunStore) -> None:
    token = await leased_run(store)
    with pytest.raises(QuestionNotFound, match="nope"):
        await store.commit("r1", token, Harvest(state_json='{"x":1}', applied=("nope",)))
    with pytest.raises(QuestionNotFound, match="nope"):
        await store.commit("r1", token, Harvest(state_json='{"x":1}', superseded=("nope",)))
    assert (await store.get_run("r1")).state_json == "{}"


async def test_a_fenced_out_harvest_applies_nothing(backend: Backend) -> None:
    store = backend.store
    token = await question_in(store, "answered")
    backend.clock.advance(TTL + 1)
    await store.acquire_lease("r1", "B", TTL)
    with pytest.raises(LeaseLost):
        await store.commit("r1", token, Harvest(state_json="{}", applied=("q1",)))
    assert (await store.get_question("q1")).status is QuestionStatus.ANSWERED


async def test_harvests_racing_to_apply_one_answer_have_one_winner(backend: Backend) -> None:
    """Eight runs (half through a second store on the same database) apply one answer at once."""
    store = backend.store
    await question_in(store, "answered")
    runs = [f"run-{i}" for i in range(8)]
    tokens = {r: await leased_run(store, r) for r in runs}
    other = backend.sibling() if backend.sibling is not None else store
    async with other:
        outcomes = await asyncio.gather(
            *(
                (store if i % 2 else other).commit(
                    r,
                    tokens[r],
                    Harvest(state_json='{"won":1}', events=(event(1),), applied=("q1",)),
                )
                for i, r in enumerate(runs)
            ),
            return_exceptions=True,
        )
    assert sorted(type(o).__name__ for o in outcomes) == ["AlreadyAnswered"] * 7 + ["bool"]
    [winner] = [r for r, o in zip(runs, outcomes, strict=True) if o is False]
    for r in runs:
        won = r == winner
        assert (await store.get_run(r)).state_json == ('{"won":1}' if won else "{}")
        assert await store.events(r) == ([event(1)] if won else [])
    assert (await store.get_question("q1")).status is QuestionStatus.APPLIED


# --- mark_applied and supersede, from every state ---------------------------------------

#: state -> (mark_applied result, status after it; supersede result, status after it)
TABLE = {
    "open": (False, "open", True, "superseded"),
    "answered": (True, "applied", True, "superseded"),
    "expired": (True, "expired", True, "superseded"),
    "applied": (False, "applied", False, "applied"),
    "expired-applied": (False, "expired", False, "expired"),
    "superseded": (False, "superseded", False, "superseded"),
}


@pytest.mark.parametrize("state", STATES)
async def test_mark_applied_from_every_state(backend: Backend, state: str) -> None:
    store = backend.store
    await question_in(store, state)
    before = await store.get_question("q1")
    backend.clock.advance(2)
    ok, after, _, _ = TABLE[state]
    assert await store.mark_applied("q1") is ok
    row = await store.get_question("q1")
    assert row.status == after
    assert row.applied_at == (backend.clock.now if ok else before.applied_at)
    assert await store.mark_applied("q1") is False  # never twice


@pytest.mark.parametrize("state", STATES)
async def test_supersede_from_every_state(store: RunStore, state: str) -> None:
    await question_in(store, state)
    before = await store.get_question("q1")
    _, _, ok, after = TABLE[state]
    assert await store.supersede("q1") is ok
    row = await store.get_question("q1")
    assert row.status == after
    assert (row.answer_json, row.applied_at) == (before.answer_json, before.applied_at)
    assert await store.supersede("q1") is False


@pytest.mark.parametrize("state", STATES)
async def test_a_harvest_supersedes_and_ignores_final_questions(
    store: RunStore, state: str
) -> None:
    token = await question_in(store, state)
    await store.commit("r1", token, Harvest(state_json='{"x":1}', superseded=("q1",)))
    assert (await store.get_question("q1")).status == TABLE[state][3]
    assert (await store.get_run("r1")).state_json == '{"x":1}'


async def test_a_harvest_may_supersede_a_question_it_opens(store: RunStore) -> None:
    token = await leased_run(store)
    await store.commit(
        "r1", token, Harvest(state_json="{}", questions=(question("q1"),), superseded=("q1",))
    )
    assert (await store.get_question("q1")).status is QuestionStatus.SUPERSEDED


# --- queries ---------------------------------------------------------------------------


async def test_unapplied_answers_are_answered_or_expired_not_applied(backend: Backend) -> None:
    store = backend.store
    token = await leased_run(store)
    ids = ["q-open", "q-late", "q-expired", "q-early", "q-applied", "q-exp-applied", "q-super"]
    await open_questions(store, token, *(question(q) for q in ids))
    for q, how in [
        ("q-early", QuestionStatus.ANSWERED), ("q-expired", QuestionStatus.EXPIRED),
        ("q-applied", QuestionStatus.ANSWERED), ("q-exp-applied", QuestionStatus.EXPIRED),
        ("q-super", QuestionStatus.ANSWERED), ("q-late", QuestionStatus.ANSWERED),
    ]:  # fmt: skip
        backend.clock.advance(1)
        await store.answer(q, "1", status=how)
    assert await store.mark_applied("q-applied")
    assert await store.mark_applied("q-exp-applied")
    assert await store.supersede("q-super")
    unapplied = await store.unapplied_answers()
    assert [q.question_id for q in unapplied] == ["q-early", "q-expired", "q-late"]
    assert [q.question_id for q in await store.unapplied_answers(limit=2)] == [
        "q-early",
        "q-expired",
    ]
    assert await store.unapplied_answers(limit=0) == []


async def test_list_questions_oldest_first_and_filtered(store: RunStore) -> None:
    token_1 = await leased_run(store, "r1")
    token_2 = await leased_run(store, "r2")
    await open_questions(
        store, token_1, question("c", created_at=3.0), question("a", created_at=1.0)
    )
    await open_questions(
        store, token_2, question("b", "r2", created_at=2.0), question("d", "r2", created_at=3.0)
    )
    await store.answer("d", "1")
    ids = [q.question_id for q in await store.list_questions()]
    assert ids == ["a", "b", "c", "d"]  # created_at, then id
    assert [q.question_id for q in await store.list_questions(run_id="r2")] == ["b", "d"]
    open_ = await store.list_questions(status=QuestionStatus.OPEN)
    assert [q.question_id for q in open_] == ["a", "b", "c"]
    both = await store.list_questions(status=QuestionStatus.OPEN, run_id="r2")
    assert [q.question_id for q in both] == ["b"]
    assert [q.question_id for q in await store.list_questions(limit=2)] == ["a", "b"]
    assert await store.list_questions(limit=0) == []
    assert await store.list_questions(run_id="nope") == []
    assert await store.list_questions(status=QuestionStatus.APPLIED) == []


async def test_unknown_questions_raise_question_not_found(store: RunStore) -> None:
    calls = [
        store.get_question("nope"), store.answer("nope", "1"), store.mark_applied("nope"),
        store.supersede("nope"),
    ]  # fmt: skip
    for call in calls:
        with pytest.raises(QuestionNotFound, match="nope"):
            await call


# --- D4: migration 2 upgrades a version-1 database in place ---------------------------------


def _version_1_migration() -> tuple[str, ...]:
    version, statements = MIGRATIONS[0]
    assert version == 1
    assert not any("questions" in s for s in statements)
    return statements


async def _use_the_ledger(store: RunStore) -> None:
    assert (await store.get_run("old")).input_json == "null"
    token = await store.acquire_lease("old", "A", TTL)
    await store.commit("old", token, Harvest(state_json="{}", questions=(question("q1", "old"),)))
    assert (await store.answer("q1", "1")).status is QuestionStatus.ANSWERED


async def test_sqlite_upgrades_a_version_1_database(tmp_path: Path) -> None:
    path = tmp_path / "v1.db"
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute(CREATE_MIGRATIONS_TABLE)
    for statement in _version_1_migration():
        conn.execute(statement.replace("/*WITHOUT ROWID*/", "WITHOUT ROWID"))
    conn.execute("INSERT INTO schema_migrations (version, applied_at) VALUES (1, 0)")
    conn.execute(*migration_1_run(new_run("old")))
    conn.close()
    async with SQLiteStore(path) as store:
        await _use_the_ledger(store)
    async with SQLiteStore(path) as store:  # nothing left to apply
        assert (await store.get_question("q1")).status is QuestionStatus.ANSWERED
    with sqlite3.connect(path) as conn:
        versions = conn.execute("SELECT version FROM schema_migrations ORDER BY version").fetchall()
        indexes = {
            r[0]
            for r in conn.execute(
                "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'questions'"
            )
        }
    conn.close()
    assert versions == [(v,) for v, _ in MIGRATIONS]
    assert {"questions_by_status", "questions_by_run"} <= indexes


async def test_a_new_sqlite_database_gets_every_migration(tmp_path: Path) -> None:
    async with SQLiteStore(tmp_path / "new.db"):
        pass
    with sqlite3.connect(tmp_path / "new.db") as conn:
        versions = conn.execute("SELECT version FROM schema_migrations ORDER BY version").fetchall()
    conn.close()
    assert versions == [(v,) for v, _ in MIGRATIONS]
    assert (4,) in versions


@pytest.mark.postgres
@pytest.mark.skipif(POSTGRES_DSN is None, reason="TAILRACE_TEST_POSTGRES_DSN is not set")
async def test_postgres_upgrades_a_version_1_database() -> None:
    import psycopg
    from psycopg import sql

    from tailrace.stores import PostgresStore

    assert POSTGRES_DSN is not None
    schema = f"tailrace_v1_{uuid.uuid4().hex[:12]}"
    ident = sql.Identifier(schema)
    async with await psycopg.AsyncConnection.connect(POSTGRES_DSN, autocommit=True) as conn:
        await conn.execute(sql.SQL("CREATE SCHEMA {}").format(ident))
    try:
        async with await psycopg.AsyncConnection.connect(POSTGRES_DSN) as conn:
            await conn.execute(sql.SQL("SET search_path TO {}").format(ident))
            await conn.execute(CREATE_MIGRATIONS_TABLE)
            for statement in _version_1_migration():
                await conn.execute(statement)
            await conn.execute("INSERT INTO schema_migrations VALUES (1, 0)")
            run_text, run_values = migration_1_run(new_run("old"))
            await conn.execute(run_text.replace("?", "%s"), run_values)
            await conn.commit()
        racers = [PostgresStore(POSTGRES_DSN, schema=schema) for _ in range(3)]
        try:
            await asyncio.gather(*(s.open() for s in racers))  # upgrade once, under the lock
            await _use_the_ledger(racers[0])
            assert (await racers[2].get_question("q1")).status is QuestionStatus.ANSWERED
        finally:
            await asyncio.gather(*(s.close() for s in racers))
        async with await psycopg.AsyncConnection.connect(POSTGRES_DSN) as conn:
            cur = await conn.execute(
                sql.SQL("SELECT version FROM {}.schema_migrations ORDER BY version").format(ident)
            )
            assert await cur.fetchall() == [(v,) for v, _ in MIGRATIONS]
            cur = await conn.execute(
                "SELECT indexname FROM pg_indexes WHERE schemaname = %s AND tablename = 'questions'",
                (schema,),
            )
            assert {"questions_by_status", "questions_by_run"} <= {
                r[0] for r in await cur.fetchall()
            }
    finally:
        async with await psycopg.AsyncConnection.connect(POSTGRES_DSN, autocommit=True) as conn:
            await conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(ident))


async def test_questions_are_counted_by_status_and_listed_by_page(store: RunStore) -> None:
    from tailrace.stores import NewRun

    await store.create_run(
        NewRun(run_id="qp", graph_name="g", graph_ref=None, fingerprint="fp", input_json="null",
               created_at=1.0)
    )  # fmt: skip
    token = await store.acquire_lease("qp", "me", 30.0)
    rows = [
        QuestionRow(
            question_id=f"q{n:02}",
            run_id="qp",
            node_id="gate",
            visit=1,
            turn=0,
            prompt_json="{}",
            poller=None,
            deadline=None,
            created_at=float(n),
        )
        for n in range(25)
    ]
    await store.commit("qp", token, Harvest(state_json="{}", questions=rows))
    await store.answer("q03", '"yes"')
    assert await store.question_counts() == {
        QuestionStatus.OPEN: 24, QuestionStatus.ANSWERED: 1
    }  # fmt: skip
    page = await store.list_questions(status=QuestionStatus.OPEN, limit=10, offset=10)
    assert [q.question_id for q in page] == [f"q{n:02}" for n in range(11, 21)]
    tail = await store.list_questions(limit=10, offset=20)
    assert [q.question_id for q in tail] == [f"q{n:02}" for n in range(20, 25)]
    with pytest.raises(ValueError, match="offset must be an integer >= 0"):
        await store.list_questions(offset=-1)


async def test_answering_a_cancelled_runs_question_says_the_run_was_cancelled(
    backend: Backend,
) -> None:
    """A cancelled run's questions are superseded; an answer to one is refused, saying the
    run was cancelled (not that its consumers went on without it), and changes nothing."""
    gated = tr.Graph("cancelled_gate")

    @gated.gate()
    async def approve(x: int) -> str:
        return f"approve {x}?"

    engine = tr.Engine(store=backend.store)
    result = await engine.run(gated, 1, run_id="c1")
    (asked,) = result.questions
    assert await engine.cancel("c1") == "cancelled"
    with pytest.raises(AlreadyAnswered, match="its run 'c1' was cancelled") as refused:
        await engine.answer(asked.question_id, "yes")
    assert "went on without it" not in str(refused.value)
    row = await backend.store.get_question(asked.question_id)
    assert (row.status, row.answer_json) == (QuestionStatus.SUPERSEDED, None)
    assert (await backend.store.get_run("c1")).status is RunStatus.CANCELLED
