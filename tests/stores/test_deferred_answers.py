"""Answers a daemon cannot apply back off, visibly, and never hide one it can (Q4; issue 9, finding 5).

``defer_answer`` records the reason, counts the attempt and sets ``retry_at``;
``unapplied_answers`` leaves an answer out until it is due and lists fresh
answers before deferred ones, so any number of stuck answers cannot starve a
sweep that reads the first hundred. Run against every backend; migration 4
adds the columns to an older SQLite database in place (D4).
"""

from __future__ import annotations

import sqlite3
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tailrace._errors import QuestionNotFound
from tailrace.stores import Harvest, NewRun, QuestionRow, QuestionStatus, RunStore, SQLiteStore
from tailrace.stores._rules import MAX_APPLY_ERROR
from tailrace.stores._sql._statements import (
    CREATE_MIGRATIONS_TABLE,
    MIGRATIONS,
    QUESTION_FIELDS,
    question_params,
)
from tests.fixtures import migration_1_run

if TYPE_CHECKING:
    from tests.fixtures import Backend

#: How to bring question "q1" into each state (as in test_questions).
STATES = ["open", "answered", "expired", "applied", "expired-applied", "superseded"]
#: States whose answer is still waiting to be applied: the only ones a deferral changes.
UNAPPLIED = {"answered", "expired"}


def new_run(run_id: str = "r1") -> NewRun:
    return NewRun(
        run_id=run_id, graph_name="g", graph_ref=None, fingerprint="fp", input_json="null",
        created_at=1.0,
    )  # fmt: skip


def question(question_id: str = "q1") -> QuestionRow:
    return QuestionRow(
        question_id=question_id, run_id="r1", node_id="gate", visit=1, turn=1,
        prompt_json='{"ask":"ok?"}', created_at=1.0,
    )  # fmt: skip


async def leased_run(store: RunStore) -> int:
    await store.create_run(new_run("r1"))
    return await store.acquire_lease("r1", "A", 30.0)


async def open_questions(store: RunStore, token: int, *rows: QuestionRow) -> None:
    await store.commit("r1", token, Harvest(state_json="{}", questions=rows))


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


async def answered(store: RunStore, *ids: str, backend: Backend) -> None:
    """Open ``ids`` on run r1 and answer them one clock second apart, in order."""
    token = await leased_run(store)
    await open_questions(store, token, *(question(q) for q in ids))
    for q in ids:
        backend.clock.advance(1)
        await store.answer(q, '"ok"', by="alice")


async def test_a_deferral_records_the_error_counts_attempts_and_sets_retry_at(
    backend: Backend,
) -> None:
    store = backend.store
    await answered(store, "q1", backend=backend)
    now = backend.clock.now
    await store.defer_answer("q1", error="GraphError: cannot import app:g", retry_at=now + 30)
    row = await store.get_question("q1")
    assert (row.status, row.apply_error, row.apply_attempts, row.retry_at) == (
        QuestionStatus.ANSWERED, "GraphError: cannot import app:g", 1, now + 30,
    )  # fmt: skip
    await store.defer_answer("q1", error="still failing", retry_at=now + 90)
    row = await store.get_question("q1")
    assert (row.apply_error, row.apply_attempts, row.retry_at) == ("still failing", 2, now + 90)


async def test_a_new_question_has_no_apply_error(store: RunStore) -> None:
    await question_in(store, "answered")
    row = await store.get_question("q1")
    assert (row.apply_error, row.apply_attempts, row.retry_at) == (None, 0, None)


async def test_a_deferred_answer_is_left_out_until_it_is_due(backend: Backend) -> None:
    store = backend.store
    await answered(store, "q1", "q2", backend=backend)
    await store.defer_answer("q1", error="boom", retry_at=backend.clock.now + 60)
    assert [q.question_id for q in await store.unapplied_answers()] == ["q2"]
    backend.clock.advance(59)
    assert [q.question_id for q in await store.unapplied_answers()] == ["q2"]
    backend.clock.advance(1)  # due exactly at retry_at
    assert [q.question_id for q in await store.unapplied_answers()] == ["q2", "q1"]


async def test_now_overrides_the_clock(backend: Backend) -> None:
    store = backend.store
    await answered(store, "q1", backend=backend)
    retry_at = backend.clock.now + 60
    await store.defer_answer("q1", error="boom", retry_at=retry_at)
    assert await store.unapplied_answers(now=retry_at - 1) == []
    assert [q.question_id for q in await store.unapplied_answers(now=retry_at)] == ["q1"]


async def test_fresh_answers_come_first_then_deferred_ones_by_retry_at(backend: Backend) -> None:
    store = backend.store
    await answered(store, "old", "older-retry", "fresh-1", "fresh-2", backend=backend)
    base = backend.clock.now
    await store.defer_answer("old", error="x", retry_at=base + 2)
    await store.defer_answer("older-retry", error="x", retry_at=base + 1)
    backend.clock.advance(5)  # both deferrals are due
    order = [q.question_id for q in await store.unapplied_answers()]
    assert order == ["fresh-1", "fresh-2", "older-retry", "old"]
    assert [q.question_id for q in await store.unapplied_answers(limit=3)] == order[:3]


async def test_a_hundred_stuck_answers_never_hide_an_applicable_one(backend: Backend) -> None:
    """The sweep reads 100 at a time: deferred answers, even all due, come after a fresh one."""
    store = backend.store
    stuck = [f"stuck-{i:03}" for i in range(100)]
    await answered(store, *stuck, backend=backend)
    for q in stuck:
        await store.defer_answer(q, error="cannot load graph", retry_at=backend.clock.now)
    token = await store.acquire_lease("r1", "A", 30.0)
    await open_questions(store, token, question("late"))
    backend.clock.advance(1)
    await store.answer("late", '"go"')
    first = await store.unapplied_answers(limit=100)
    assert first[0].question_id == "late"
    assert [q.question_id for q in first[1:]] == stuck[:99]


@pytest.mark.parametrize("state", STATES)
async def test_a_deferral_changes_only_an_unapplied_answer(backend: Backend, state: str) -> None:
    store = backend.store
    await question_in(store, state)
    before = await store.get_question("q1")
    await store.defer_answer("q1", error="boom", retry_at=backend.clock.now + 5)
    row = await store.get_question("q1")
    if state in UNAPPLIED:
        assert (row.apply_error, row.apply_attempts) == ("boom", 1)
        assert (row.status, row.answer_json, row.applied_at) == (
            before.status, before.answer_json, before.applied_at,
        )  # fmt: skip
    else:
        assert row == before


async def test_applying_or_superseding_keeps_the_error_as_history(backend: Backend) -> None:
    store = backend.store
    await answered(store, "q1", "q2", backend=backend)
    await store.defer_answer("q1", error="boom", retry_at=backend.clock.now + 5)
    await store.defer_answer("q2", error="bang", retry_at=backend.clock.now + 5)
    assert await store.mark_applied("q1")
    assert await store.supersede("q2")
    applied, superseded = await store.get_question("q1"), await store.get_question("q2")
    assert (applied.status, applied.apply_error, applied.apply_attempts) == (
        QuestionStatus.APPLIED, "boom", 1,
    )  # fmt: skip
    assert (superseded.status, superseded.apply_error) == (QuestionStatus.SUPERSEDED, "bang")
    backend.clock.advance(10)
    assert await store.unapplied_answers() == []  # the error does not make them due again


async def test_a_harvest_applies_a_deferred_answer(backend: Backend) -> None:
    store = backend.store
    token = await question_in(store, "answered")
    await store.defer_answer("q1", error="busy", retry_at=backend.clock.now + 5)
    await store.commit("r1", token, Harvest(state_json="{}", applied=("q1",)))
    row = await store.get_question("q1")
    assert (row.status, row.apply_attempts) == (QuestionStatus.APPLIED, 1)


async def test_deferring_an_unknown_question_raises(store: RunStore) -> None:
    with pytest.raises(QuestionNotFound, match="nope"):
        await store.defer_answer("nope", error="x", retry_at=1.0)


@pytest.mark.parametrize("retry_at", [float("nan"), float("inf"), "soon", None, True])
async def test_retry_at_must_be_a_finite_time(backend: Backend, retry_at: Any) -> None:
    store = backend.store
    await answered(store, "q1", backend=backend)
    with pytest.raises(ValueError, match="retry_at"):
        await store.defer_answer("q1", error="x", retry_at=retry_at)
    assert (await store.get_question("q1")).apply_attempts == 0


async def test_the_error_must_be_text(backend: Backend) -> None:
    await answered(backend.store, "q1", backend=backend)
    with pytest.raises(ValueError, match="error must be text"):
        await backend.store.defer_answer("q1", error=RuntimeError("x"), retry_at=1.0)  # type: ignore[arg-type]


async def test_any_error_text_is_kept_escaped_and_cut(backend: Backend) -> None:
    store = backend.store
    await answered(store, "q1", "q2", backend=backend)
    await store.defer_answer("q1", error="bad \x00 byte, \ud800 half", retry_at=1.0)
    assert (await store.get_question("q1")).apply_error == "bad \\x00 byte, \\ud800 half"
    await store.defer_answer("q2", error="é" * (MAX_APPLY_ERROR + 10), retry_at=1.0)
    long = (await store.get_question("q2")).apply_error
    assert long == "é" * (MAX_APPLY_ERROR - 1) + "\u2026"


async def test_a_harvest_cannot_open_a_question_with_an_apply_error(store: RunStore) -> None:
    token = await leased_run(store)
    with pytest.raises(ValueError, match="open and unanswered"):
        await open_questions(store, token, replace(question("q1"), apply_attempts=1))
    assert await store.list_questions() == []


async def test_deferrals_are_durable(backend: Backend) -> None:
    if backend.sibling is None:
        pytest.skip("a memory store is one process's own")
    await answered(backend.store, "q1", backend=backend)
    await backend.store.defer_answer("q1", error="boom", retry_at=backend.clock.now + 5)
    async with backend.sibling() as other:
        row = await other.get_question("q1")
    assert (row.apply_error, row.apply_attempts, row.retry_at) == (
        "boom", 1, backend.clock.now + 5,
    )  # fmt: skip


# --- D4: migration 4 adds the columns to a version-3 database in place ---------------------


async def test_sqlite_upgrades_a_version_3_database(tmp_path: Path) -> None:
    path = tmp_path / "v3.db"
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute(CREATE_MIGRATIONS_TABLE)
    for version, statements in MIGRATIONS[:3]:
        for statement in statements:
            conn.execute(statement.replace("/*WITHOUT ROWID*/", "WITHOUT ROWID"))
        conn.execute("INSERT INTO schema_migrations VALUES (?, 0)", (version,))
    conn.execute(*migration_1_run(new_run("r1")))
    old_fields = QUESTION_FIELDS[: QUESTION_FIELDS.index("applied_at") + 1]
    conn.execute(
        f"INSERT INTO questions ({', '.join(old_fields)}) "
        f"VALUES ({', '.join('?' * len(old_fields))})",
        question_params(question("q1"))[: len(old_fields)],
    )
    conn.close()
    async with SQLiteStore(path) as store:
        row = await store.get_question("q1")
        assert (row.apply_error, row.apply_attempts, row.retry_at) == (None, 0, None)
        await put_in_state(store, "answered")
        await store.defer_answer("q1", error="boom", retry_at=1.0)
        assert (await store.get_question("q1")).apply_attempts == 1
    with sqlite3.connect(path) as conn:
        versions = conn.execute("SELECT version FROM schema_migrations ORDER BY version").fetchall()
    conn.close()
    assert (4,) in versions  # migration 4 (deferred answers) among them
