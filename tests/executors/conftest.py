"""Fixtures of the executor tests: the shared graphs module and one local Ray per test run.

Ray starts once per session (``ray.init(num_cpus=2)``, about 3-5 s here) the
first time a test asks for it, and is shut down at the end. ``ray_cluster``
is a local cluster of several raylets instead, for one test: the session's
Ray steps aside while it runs (one driver connection per process) and comes
back after. Without Ray installed, the tests that need it are skipped, saying so.
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


def _ray_or_skip() -> Any:
    try:
        import ray
    except ImportError as exc:
        pytest.skip(f"Ray is not installed (pip install 'tailrace[ray]'): {exc}")
    return ray


def _init_local(ray: Any) -> None:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)


@pytest.fixture(scope="session")
def ray_session(graphs: ModuleType) -> Iterator[Any]:
    """A local Ray with 2 CPUs for the whole test run; yields the ``ray`` module."""
    ray = _ray_or_skip()
    from ray import cloudpickle

    # Workers cannot import the test module: its handlers travel by value.
    cloudpickle.register_pickle_by_value(graphs)
    started = not ray.is_initialized()
    if started:
        _init_local(ray)
    try:
        yield ray
    finally:
        cloudpickle.unregister_pickle_by_value(graphs)
        if started:
            ray.shutdown()


@pytest.fixture
def ray_cluster(request: pytest.FixtureRequest, graphs: ModuleType) -> Iterator[Any]:
    """A local Ray cluster: a head with no CPUs and two worker raylets of one CPU each
    (or of as many as the test's indirect parameter says).

    Yields the ``ray.cluster_utils.Cluster``, this process connected to it as
    the driver: tasks run on the worker nodes only, one CPU each.
    """
    cpus = getattr(request, "param", 1)
    ray = _ray_or_skip()
    from ray import cloudpickle
    from ray.cluster_utils import Cluster

    session = ray.is_initialized()
    if session:
        ray.shutdown()  # the session's Ray: one driver connection per process
    ours = graphs.__name__ not in cloudpickle.list_registry_pickle_by_value()
    if ours:
        cloudpickle.register_pickle_by_value(graphs)
    small = {"object_store_memory": 80 * 1024 * 1024}
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False, **small}
    )
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=cpus, **small)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        if ours:
            cloudpickle.unregister_pickle_by_value(graphs)
        if session:
            _init_local(ray)
