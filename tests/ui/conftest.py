"""Fixtures for the dashboard's tests: real runs in real stores, the app under TestClient.

``scenarios.py`` (graphs and runs) and ``support.py`` (helpers) are loaded once
as ``tailrace_tests_ui_scenarios`` and ``tailrace_tests_ui_support``
(``tests/`` is not a package), so runs record a module reference the dashboard
can import and test modules import the helpers by those names.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

HERE = Path(__file__).resolve().parent


def _load(name: str, path: Path) -> ModuleType:
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


scenarios = _load("tailrace_tests_ui_scenarios", HERE / "scenarios.py")
support = _load("tailrace_tests_ui_support", HERE / "support.py")
Factory = support.Factory
POSTGRES_DSN = support.POSTGRES_DSN


@pytest.fixture
def sqlite_db(tmp_path: Path) -> Factory:
    """A factory of stores on a fresh SQLite file."""
    factory: Factory = scenarios.sqlite_factory(tmp_path / "runs.db")
    return factory


@pytest.fixture(
    params=[
        "sqlite",
        pytest.param(
            "postgres",
            marks=[
                pytest.mark.postgres,
                pytest.mark.skipif(
                    POSTGRES_DSN is None, reason="TAILRACE_TEST_POSTGRES_DSN is not set"
                ),
            ],
        ),
    ]
)
def any_db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Factory]:
    """Each SQL store in turn (Postgres when a server is configured)."""
    if request.param == "sqlite":
        yield scenarios.sqlite_factory(tmp_path / "runs.db")
        return
    schema = support.postgres_schema()
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
