"""Helpers of the dashboard's tests, loaded by ``conftest.py`` as ``tailrace_tests_ui_support``.

Test modules import it by that name (``tests/`` is not a package).
"""

from __future__ import annotations

import contextlib
import os
import sys
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from starlette.testclient import TestClient

from tailrace.stores import RunStore
from tailrace.ui import UiConfig, create_app

scenarios = sys.modules["tailrace_tests_ui_scenarios"]

TOKEN = "test-token-0123456789"
POSTGRES_DSN = os.environ.get("TAILRACE_TEST_POSTGRES_DSN")


Factory = Callable[[bool], RunStore]


@contextlib.asynccontextmanager
async def postgres_schema() -> AsyncIterator[Factory]:
    """A factory of Postgres stores on a fresh schema, dropped afterwards."""
    import psycopg
    from psycopg import sql

    from tailrace.stores import PostgresStore

    assert POSTGRES_DSN is not None
    schema = f"tailrace_ui_{uuid.uuid4().hex[:12]}"
    try:
        yield lambda read_only: PostgresStore(POSTGRES_DSN, schema=schema, read_only=read_only)
    finally:
        async with await psycopg.AsyncConnection.connect(POSTGRES_DSN, autocommit=True) as conn:
            await conn.execute(
                sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema))
            )


@contextlib.contextmanager
def dashboard(factory: Factory, **options: Any) -> Iterator[TestClient]:
    """The app on ``factory``'s database under TestClient, its lifespan running."""
    config = UiConfig(
        store=factory, token=TOKEN, location="test.db", allowed_hosts=("testserver",), **options
    )
    with TestClient(create_app(config), follow_redirects=False) as client:
        yield client


def resumer_of(client: TestClient) -> Any:
    """The app's background resumer (to wait for a resume it started)."""
    return client.app.state.ui.resumer  # type: ignore[attr-defined]
