"""Fixtures of the executor tests: the shared graphs module and one local Ray per test run.

Ray starts once per session (``ray.init(num_cpus=2)``, about 3-5 s here) the
first time a test asks for it, and is shut down at the end. Without Ray
installed, the tests that need it are skipped, saying so.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests import fixtures

#: The name ``_graphs.py`` has in every process (the Ray driver test loads it by path too).
GRAPHS_MODULE = "tailrace_tests_executors"


@pytest.fixture(scope="session")
def graphs() -> ModuleType:
    """The graphs and handlers shared by the executor tests."""
    return fixtures.load_module(GRAPHS_MODULE, Path(__file__).with_name("_graphs.py"))


@pytest.fixture(scope="session")
def ray_session(graphs: ModuleType) -> Iterator[Any]:
    """A local Ray with 2 CPUs for the whole test run; yields the ``ray`` module."""
    try:
        import ray
        from ray import cloudpickle
    except ImportError as exc:
        pytest.skip(f"Ray is not installed (pip install 'tailrace[ray]'): {exc}")
    # Workers cannot import the test module: its handlers travel by value.
    cloudpickle.register_pickle_by_value(graphs)
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        cloudpickle.unregister_pickle_by_value(graphs)
        if started:
            ray.shutdown()
