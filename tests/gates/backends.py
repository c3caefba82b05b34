"""What the gate test modules share: the store backends, polling helpers, the side file.

Built on :mod:`tests.fixtures`. Test modules import it (``from tests.gates import
backends``) and bind its fixtures at module level (``backend = backends.backend``), so
pytest finds them there. The gate graphs keep one top-level name in every process
(a storm's child processes load the same file), so they are loaded by path.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

import tailrace as tr
from tailrace.stores import RunStore
from tests import fixtures

HERE = Path(__file__).resolve().parent
GRAPH_FILE = HERE / "gate_graphs.py"
#: Generous bound on any wait in these tests: they poll observed state, never time it.
TIMEOUT = 20.0

graphs = fixtures.load_module("tailrace_tests_gate_graphs", GRAPH_FILE)


class Backend(fixtures.Database):
    """A database under test: ``store()`` opens another store instance on it."""

    async def engine(self, **options: Any) -> tr.Engine:
        """An engine (its own owner) on a new store instance, told about the gate graphs."""
        return graphs.engine(await self.store(), **options)


@pytest.fixture(params=fixtures.ALL_STORES)
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    """Each store in turn on a fresh database; every store it opened is closed afterwards."""
    async with fixtures.database(
        request.param, tmp_path, cls=Backend, filename="gates.db", max_size=4
    ) as opened:
        yield opened


@pytest.fixture
def side(tmp_path: Path) -> Path:
    """The side file nodes that must run once count their executions in."""
    return tmp_path / "side.log"


async def eventually(
    check: Callable[[], Awaitable[bool]], what: str, within: float = TIMEOUT
) -> None:
    """Poll ``check`` until it is true; fail naming ``what`` after ``within`` seconds."""
    await fixtures.until(check, what, guard=within, every=0.01)


async def run_status(store: RunStore, run_id: str) -> str:
    """The stored status of ``run_id``."""
    return (await store.get_run(run_id)).status.value


async def is_status(store: RunStore, run_id: str, status: str) -> bool:
    """Whether ``run_id`` is stored with ``status``."""
    return await run_status(store, run_id) == status
