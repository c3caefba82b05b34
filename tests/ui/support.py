"""Helpers of the dashboard's tests, imported as ``tests.ui.support``.

``scenarios`` is ``scenarios.py``, loaded by path as ``tailrace_tests_ui_scenarios``:
runs record that module reference and the dashboard imports it, like an installed
package's graphs.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

from starlette.testclient import TestClient

from tailrace.stores import RunStore
from tailrace.ui import UiConfig, create_app
from tests import fixtures

scenarios = fixtures.load_module(
    "tailrace_tests_ui_scenarios", Path(__file__).with_name("scenarios.py")
)
T = TypeVar("T")

TOKEN = "test-token-0123456789"


Factory = Callable[[bool], RunStore]


@contextlib.asynccontextmanager
async def postgres_schema() -> AsyncIterator[Factory]:
    """A factory of Postgres stores on a fresh schema, dropped afterwards."""
    from tailrace.stores import PostgresStore

    dsn = fixtures.POSTGRES_DSN
    assert dsn is not None
    async with fixtures.postgres_schema("tailrace_ui") as schema:
        yield lambda read_only: PostgresStore(dsn, schema=schema, read_only=read_only)


@contextlib.contextmanager
def dashboard(factory: Factory, **options: Any) -> Iterator[TestClient]:
    """The app on ``factory``'s database under TestClient, its lifespan running."""
    options.setdefault("allowed_hosts", ("testserver",))
    config = UiConfig(store=factory, token=TOKEN, location="test.db", **options)
    with TestClient(create_app(config), follow_redirects=False) as client:
        yield client


def submit_and_work(
    factory: Factory, graph: Any, run_id: str, *, queues: list[str], graphs: list[Any],
    until: Any,
) -> None:  # fmt: skip
    """Submit ``graph`` as ``run_id`` to ``queues[0]``, then work ``queues`` with a worker
    holding ``graphs`` until the run's status is ``until``."""
    import tailrace as tr

    async def run() -> None:
        async with scenarios.opened(factory) as store:
            await tr.Engine(store=store).submit(graph, "job", run_id=run_id, queue=queues[0])
            worker = tr.Worker(store, queues=queues, graphs=graphs, poll_interval=0.02)
            stop = asyncio.Event()
            task = asyncio.create_task(worker.run(stop))

            async def reached() -> bool:
                return (await store.get_run(run_id)).status is until

            try:
                await fixtures.until(reached, f"run {run_id} is {until}")
            finally:
                stop.set()
                await task

    asyncio.run(run())


def resumer_of(client: TestClient) -> Any:
    """The app's background resumer (to wait for a resume it started)."""
    return client.app.state.ui.resumer  # type: ignore[attr-defined]


@contextlib.contextmanager
def served(config: UiConfig) -> Iterator[str]:
    """The dashboard served by uvicorn on 127.0.0.1 (a free port) in a thread; yields its URL."""
    import socket
    import threading

    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(
        uvicorn.Config(create_app(config), log_level="warning", timeout_graceful_shutdown=2)
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + scenarios.GUARD
        while not server.started:  # polling the observed state: uvicorn offers no event
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the dashboard did not start")
            time.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(scenarios.GUARD)
        sock.close()


def in_thread(work: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run ``work`` to completion on a loop of its own thread (the test's thread drives a browser)."""
    import threading

    box: dict[str, Any] = {}

    def main() -> None:
        try:
            box["value"] = asyncio.run(work())
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=main)
    thread.start()
    thread.join(scenarios.GUARD)
    if "error" in box:
        raise box["error"]
    return box["value"]  # type: ignore[no-any-return]


class Background:
    """A coroutine running on its own thread's loop until it ends (a run the page watches)."""

    def __init__(self, work: Callable[[], Coroutine[Any, Any, Any]]) -> None:
        import threading

        self.error: BaseException | None = None
        self.result: Any = None

        def main() -> None:
            try:
                self.result = asyncio.run(work())
            except BaseException as exc:
                self.error = exc

        self.thread = threading.Thread(target=main, daemon=True)
        self.thread.start()

    def join(self) -> Any:
        self.thread.join(scenarios.GUARD)
        assert not self.thread.is_alive(), "the background run did not end"
        if self.error is not None:
            raise self.error
        return self.result
