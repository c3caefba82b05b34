"""NUL and lone surrogates in ids and names (issue 9, finding 3, store side), on every backend.

What the databases do with them: SQLite keeps a NUL inside TEXT but its SQL
functions (``length``, ``LIKE``...) stop at it; Postgres refuses it outright
("cannot contain NUL"); a lone surrogate is not UTF-8, so the ``sqlite3``
driver raises ``UnicodeEncodeError`` and psycopg an encoding error. The
contract: every store refuses such a name up front with a ``ValueError``
naming the field, before touching the database, so nothing is written.
Free-text error messages are stored escaped instead.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import pytest

from tailrace.stores import (
    EventRow,
    FrozenInput,
    Harvest,
    NewRun,
    NodeRow,
    QuestionRow,
    ResultRow,
    RunStatus,
    RunStore,
)

if TYPE_CHECKING:
    from tests.fixtures import Backend

TTL = 30.0
BAD = {"nul": "a\x00b", "surrogate": "a\ud800b"}


def new_run(
    run_id: str = "r1",
    *,
    graph_name: str = "g",
    graph_ref: str | None = None,
    fingerprint: str = "fp",
) -> NewRun:
    return NewRun(
        run_id=run_id, graph_name=graph_name, graph_ref=graph_ref, fingerprint=fingerprint,
        input_json="null", created_at=1.0,
    )  # fmt: skip


def question(question_id: str = "q1", *, node_id: str = "gate") -> QuestionRow:
    return QuestionRow(
        question_id=question_id, run_id="r1", node_id=node_id, visit=1, turn=1,
        prompt_json="{}", created_at=1.0,
    )  # fmt: skip


def harvest(**parts: object) -> Harvest:
    return Harvest(state_json='{"written":true}', **parts)  # type: ignore[arg-type]


def node(node_id: str) -> NodeRow:
    return NodeRow(node_id=node_id, status="completed", visits=1, data_json="{}")


def result(node_id: str) -> ResultRow:
    return ResultRow(node_id=node_id, visit=1, value_json="1")


def frozen(node_id: str) -> FrozenInput:
    return FrozenInput(node_id=node_id, activation=1, payload_json="[]")


def event(node_id: str) -> EventRow:
    return EventRow(seq=1, type="x", node_id=node_id, visit=1, attempt=1, ts=1.0, data_json="{}")


Call = Callable[[RunStore, int, str], Awaitable[object]]

#: (what is named, the call with the bad text ``b``, the field the error must name).
CALLS: list[tuple[str, Call, str]] = [
    ("create run_id", lambda s, t, b: s.create_run(new_run(b)), "run_id"),
    ("create graph_name", lambda s, t, b: s.create_run(new_run("r2", graph_name=b)), "graph_name"),
    ("create graph_ref", lambda s, t, b: s.create_run(new_run("r2", graph_ref=b)), "graph_ref"),
    (
        "create fingerprint",
        lambda s, t, b: s.create_run(new_run("r2", fingerprint=b)),
        "fingerprint",
    ),
    ("lease run_id", lambda s, t, b: s.acquire_lease(b, "A", TTL), "run_id"),
    ("lease owner", lambda s, t, b: s.acquire_lease("r1", b, TTL), "owner"),
    ("steal_from", lambda s, t, b: s.acquire_lease("r1", "B", TTL, steal_from=b), "steal_from"),
    ("heartbeat owner", lambda s, t, b: s.heartbeat("r1", b, t, TTL), "owner"),
    ("release owner", lambda s, t, b: s.release_lease("r1", b, t), "owner"),
    ("commit run_id", lambda s, t, b: s.commit(b, t, harvest()), "run_id"),
    ("node row", lambda s, t, b: s.commit("r1", t, harvest(nodes=(node(b),))), "node_id"),
    ("result", lambda s, t, b: s.commit("r1", t, harvest(results=(result(b),))), "node_id"),
    ("frozen input", lambda s, t, b: s.commit("r1", t, harvest(frozen=(frozen(b),))), "node_id"),
    ("event", lambda s, t, b: s.commit("r1", t, harvest(events=(event(b),))), "node_id"),
    (
        "new question id",
        lambda s, t, b: s.commit("r1", t, harvest(questions=(question(b),))),
        "question_id",
    ),
    (
        "new question node",
        lambda s, t, b: s.commit("r1", t, harvest(questions=(question("q2", node_id=b),))),
        "node_id",
    ),
    ("applied id", lambda s, t, b: s.commit("r1", t, harvest(applied=(b,))), "question_id"),
    ("superseded id", lambda s, t, b: s.commit("r1", t, harvest(superseded=(b,))), "question_id"),
    ("answer id", lambda s, t, b: s.answer(b, "1"), "question_id"),
    ("answer by", lambda s, t, b: s.answer("q1", "1", by=b), "by"),
    ("get_question", lambda s, t, b: s.get_question(b), "question_id"),
    ("mark_applied", lambda s, t, b: s.mark_applied(b), "question_id"),
    ("supersede", lambda s, t, b: s.supersede(b), "question_id"),
    ("defer_answer", lambda s, t, b: s.defer_answer(b, error="x", retry_at=1.0), "question_id"),
    ("list_questions", lambda s, t, b: s.list_questions(run_id=b), "run_id"),
    ("get_run", lambda s, t, b: s.get_run(b), "run_id"),
    ("load_run", lambda s, t, b: s.load_run(b), "run_id"),
    ("results run", lambda s, t, b: s.results(b), "run_id"),
    ("results node", lambda s, t, b: s.results("r1", b), "node_id"),
    ("frozen_inputs", lambda s, t, b: s.frozen_inputs(b), "run_id"),
    ("events", lambda s, t, b: s.events(b), "run_id"),
    ("artifact_head", lambda s, t, b: s.artifact_head(b), "artifact_id"),
    ("commit_artifact", lambda s, t, b: s.commit_artifact(b, 0, "{}"), "artifact_id"),
    ("artifact_history", lambda s, t, b: s.artifact_history(b), "artifact_id"),
]


async def snapshot(store: RunStore) -> tuple[object, ...]:
    """Everything the calls above could change."""
    return (
        await store.list_runs(),
        await store.list_questions(),
        await store.events("r1"),
        await store.results("r1"),
        await store.artifact_head("prompt"),
    )


@pytest.mark.parametrize("kind", sorted(BAD))
@pytest.mark.parametrize(("what", "call", "field"), CALLS, ids=[c[0] for c in CALLS])
async def test_a_bad_name_is_a_value_error_naming_the_field(
    store: RunStore, kind: str, what: str, call: Call, field: str
) -> None:
    await store.create_run(new_run("r1"))
    token = await store.acquire_lease("r1", "A", TTL)
    await store.commit("r1", token, Harvest(state_json="{}", questions=(question("q1"),)))
    before = await snapshot(store)
    with pytest.raises(ValueError) as info:
        await call(store, token, BAD[kind])
    message = str(info.value)
    assert message.startswith(field) or f": {field} " in message, message
    assert repr(BAD[kind]) in message  # shown escaped, never raw
    assert ("NUL" if kind == "nul" else "surrogate") in message
    assert await snapshot(store) == before  # nothing was written


async def test_a_run_error_is_stored_escaped(store: RunStore) -> None:
    await store.create_run(new_run("r1"))
    token = await store.acquire_lease("r1", "A", TTL)
    error = "ValueError: bad \x00 byte and \udcff half"
    await store.commit(
        "r1", token, Harvest(state_json="{}", status=RunStatus.FAILED, error=error, finished_at=2.0)
    )
    record = await store.get_run("r1")
    assert (record.status, record.error) == (
        RunStatus.FAILED, "ValueError: bad \\x00 byte and \\udcff half",
    )  # fmt: skip


async def test_ordinary_unicode_names_are_kept(backend: Backend) -> None:
    store = backend.store
    name = "run-é-字-🚀"
    await store.create_run(new_run(name))
    token = await store.acquire_lease(name, "owner-ü", TTL)
    await store.commit(name, token, Harvest(state_json="{}", nodes=(node("nœud"),)))
    stored = await store.load_run(name)
    assert (stored.run.run_id, stored.run.lease_owner, list(stored.nodes)) == (
        name, "owner-ü", ["nœud"],
    )  # fmt: skip
