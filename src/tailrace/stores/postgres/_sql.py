"""The Postgres store's statements: the shared SQL with psycopg's placeholders, and the work run in a transaction."""

from __future__ import annotations

import itertools
from typing import Any

from ..._errors import RunNotFound
from .._records import (
    Harvest,
    QuestionRow,
    QuestionStatus,
)
from .._rules import not_applicable, parse_question_status, question_not_found
from .._sql._statements import (
    ANSWER_QUESTION,
    APPLY_QUESTION,
    ARTIFACT_HEAD_VERSION,
    INSERT_ARTIFACT,
    INSERT_RUN,
    QUESTION_STATE,
    RUN_COLUMNS,
    SELECT_QUESTION,
    SUPERSEDE_QUESTION,
    UPDATE_RUN,
    UPSERT_NODE,
    harvest_rows,
    node_params,
    question_from_row,
    run_update_params,
)
from ._connections import XID, Attempt, Conn, Work


def pg(statement: str) -> str:
    """The shared SQL with psycopg's placeholders."""
    return statement.replace("?", "%s")


def returning_xid(statement: str) -> str:
    """``statement`` (an UPDATE or INSERT of the shared SQL) also returning the transaction id."""
    return f"{pg(statement)} RETURNING {XID}"


SELECT_RUN = f"SELECT {RUN_COLUMNS} FROM runs WHERE run_id = %s"
LOCK_LEASE = (
    f"SELECT lease_owner, lease_expires, lease_token, {XID} FROM runs WHERE run_id = %s FOR UPDATE"
)
LOCK_FOR_COMMIT = (
    f"SELECT status, format_version, lease_token, {XID} FROM runs WHERE run_id = %s FOR UPDATE"
)
PG_INSERT_RUN = f"{pg(INSERT_RUN)} ON CONFLICT (run_id) DO NOTHING RETURNING {XID}"
PG_ANSWER_QUESTION = f"{pg(ANSWER_QUESTION)}, {XID}"  # it already returns the row
PG_INSERT_ARTIFACT = f"{pg(INSERT_ARTIFACT)} ON CONFLICT DO NOTHING RETURNING {XID}"


def fetch_all(query: str, params: tuple[object, ...]) -> Work[list[tuple[Any, ...]]]:
    """Work that returns every row of ``query``."""

    async def read(conn: Conn, attempt: Attempt) -> list[tuple[Any, ...]]:
        cur = await conn.execute(query, params)
        return list(await cur.fetchall())

    return read


async def changed(conn: Conn) -> bool:
    """The result of a compare-and-set that turned out to have committed: it changed the row."""
    return True


def question_cas(update: str, values: tuple[object, ...], question_id: str) -> Work[bool]:
    """A compare-and-set of ``question_id`` (``update`` returns the transaction id): True if it changed the row."""

    async def cas(conn: Conn, attempt: Attempt) -> bool:
        cur = await conn.execute(update, values)
        row = await cur.fetchone()
        if row is not None:
            attempt.xid = row[0]
            return True
        await question_state(conn, question_id)  # QuestionNotFound when there is none
        return False

    return cas


async def select_question(conn: Conn, question_id: str) -> QuestionRow:
    cur = await conn.execute(pg(SELECT_QUESTION), (question_id,))
    row = await cur.fetchone()
    if row is None:
        raise question_not_found(question_id)
    return question_from_row(row)


async def artifact_head_version(conn: Conn, artifact_id: str) -> int:
    """The head version of ``artifact_id``, 0 when it has none."""
    cur = await conn.execute(pg(ARTIFACT_HEAD_VERSION), (artifact_id,))
    row = await cur.fetchone()
    return int(row[0]) if row is not None else 0


async def write_harvest(conn: Conn, run_id: str, harvest: Harvest, now: float) -> None:
    """Upsert the node rows, insert the append-only rows and questions, update the run."""
    async with conn.pipeline(), conn.cursor() as cur:
        if harvest.nodes:
            await cur.executemany(pg(UPSERT_NODE), node_params(run_id, harvest))
        rows = harvest_rows(run_id, harvest)
        for statement, group in itertools.groupby(rows, key=lambda row: row[0]):
            await cur.executemany(pg(statement), [values for _, values, _ in group])
        await cur.execute(pg(UPDATE_RUN), run_update_params(run_id, harvest, now))


async def apply_question_changes(conn: Conn, run_id: str, harvest: Harvest, now: float) -> None:
    """Apply, then supersede, the questions of ``harvest`` (inserted already); refuse it all on a lost CAS.

    Each apply is one ``UPDATE ... WHERE`` checked by its row count: a racing
    transaction waits for the row lock, then re-checks the condition and finds
    the answer applied, so exactly one harvest applies it (Q3). Ids are taken
    in sorted order so that two harvests never wait on each other's rows.
    """
    for question_id in sorted(harvest.applied):
        cur = await conn.execute(pg(APPLY_QUESTION), (now, question_id))
        if cur.rowcount != 1:
            status, applied_at = await question_state(conn, question_id)
            raise not_applicable(question_id, status, applied_at, run_id=run_id)
    for question_id in sorted(harvest.superseded):
        cur = await conn.execute(pg(SUPERSEDE_QUESTION), (question_id,))
        if cur.rowcount != 1:
            await question_state(conn, question_id)  # QuestionNotFound when there is none


async def question_state(conn: Conn, question_id: str) -> tuple[QuestionStatus, Any]:
    """``(status, applied_at)`` of question ``question_id``; :class:`QuestionNotFound` if absent."""
    cur = await conn.execute(pg(QUESTION_STATE), (question_id,))
    row = await cur.fetchone()
    if row is None:
        raise question_not_found(question_id)
    return parse_question_status(question_id, row[0]), row[1]


async def fetch_run_row(conn: Conn, query: str, run_id: str) -> tuple[Any, ...]:
    """The one row ``query`` selects for ``run_id``; :class:`RunNotFound` if there is none."""
    cur = await conn.execute(query, (run_id,))
    row = await cur.fetchone()
    if row is None:
        raise RunNotFound(f"no run {run_id!r} in the store")
    return tuple(row)
