"""A Postgres statement timeout (57014) under a lock held elsewhere is retried, not fatal.

A real server: the store's connections run with ``statement_timeout = 100ms``;
another connection holds the run's row lock. The store's commit times out,
is retried (said in its log), and lands once the lock is let go: the run
keeps its writer, nothing is lost or written twice.
"""

from __future__ import annotations

import asyncio
import logging
import urllib.parse

import psycopg
import pytest
from psycopg import sql

from tailrace.stores import EventRow, Harvest, NewRun, PostgresStore, RunStatus
from tests import fixtures

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.skipif(
        fixtures.POSTGRES_DSN is None, reason="TAILRACE_TEST_POSTGRES_DSN is not set"
    ),
]


def with_timeout(dsn: str, ms: int) -> str:
    parts = urllib.parse.urlsplit(dsn)
    query = [*urllib.parse.parse_qsl(parts.query), ("options", f"-c statement_timeout={ms}")]
    encoded = urllib.parse.urlencode(query, quote_via=urllib.parse.quote)
    return urllib.parse.urlunsplit(parts._replace(query=encoded))


async def test_a_commit_cut_by_statement_timeout_is_retried_until_the_lock_is_gone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert fixtures.POSTGRES_DSN is not None
    async with fixtures.postgres_schema() as schema:
        store = PostgresStore(with_timeout(fixtures.POSTGRES_DSN, 100), schema=schema)
        async with store:
            await store.create_run(
                NewRun(run_id="r1", graph_name="g", graph_ref=None, fingerprint="fp",
                       input_json="null", created_at=1.0)
            )  # fmt: skip
            token = await store.acquire_lease("r1", "me", 60.0)
            event = EventRow(
                seq=1, type="run_started", node_id=None, visit=None, attempt=None, ts=1.0,
                data_json="{}",
            )  # fmt: skip
            async with await psycopg.AsyncConnection.connect(fixtures.POSTGRES_DSN) as holder:
                await holder.execute(
                    sql.SQL("SET search_path TO {}").format(sql.Identifier(schema))
                )
                await holder.execute("SELECT 1 FROM runs WHERE run_id = 'r1' FOR UPDATE")
                with caplog.at_level(logging.INFO, logger="tailrace.stores.postgres"):
                    commit = asyncio.create_task(
                        store.commit("r1", token, Harvest(state_json="{}", events=[event]))
                    )
                    await fixtures.until(
                        lambda: any("retrying" in r.getMessage() for r in caplog.records),
                        "the timed-out commit to be retried",
                    )
                    assert not commit.done()
                await holder.rollback()  # the lock is let go
            await asyncio.wait_for(commit, fixtures.HANG_GUARD)
            assert [e.seq for e in await store.events("r1")] == [1]
            record = await store.get_run("r1")
            assert record.status is RunStatus.RUNNING and record.lease_owner == "me"
