"""Fixtures for the dashboard's tests: real runs in real stores, the app under TestClient.

The graphs and runs (``scenarios``) and the helpers come from :mod:`tests.ui.support`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import fixtures
from tests.ui.support import Factory, postgres_schema, scenarios


@pytest.fixture
def sqlite_db(tmp_path: Path) -> Factory:
    """A factory of stores on a fresh SQLite file."""
    factory: Factory = scenarios.sqlite_factory(tmp_path / "runs.db")
    return factory


@pytest.fixture(params=fixtures.SHARED_STORES)
def any_db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Factory]:
    """Each SQL store in turn (Postgres when a server is configured)."""
    if request.param == "sqlite":
        yield scenarios.sqlite_factory(tmp_path / "runs.db")
        return
    schema = postgres_schema()
    factory = asyncio.run(schema.__aenter__())
    try:
        yield factory
    finally:
        asyncio.run(schema.__aexit__(None, None, None))


@pytest.fixture
def made(sqlite_db: Factory) -> dict[str, str]:
    """One run of each scenario in ``sqlite_db``; run ids by kind."""
    ids: dict[str, str] = asyncio.run(scenarios.make_runs(sqlite_db))
    return ids
