"""RayExecutor on a local Ray: node placement, a SIGKILLed worker, a SIGKILLed driver.

The session's Ray (``ray_session``) has 2 CPUs. The driver test connects a
second driver, a real subprocess, to that cluster, kills it with SIGKILL while
one of its Ray tasks runs, and resumes the run here.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import textwrap
from collections import Counter
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import tailrace as tr
from tailrace.executors import RayExecutor
from tailrace.stores import SQLiteStore
from tests import fixtures

GUARD = 120.0  # hang guard (s): fails a test only when something hangs

pytestmark = pytest.mark.slow  # a local Ray, SIGKILLed workers and drivers


async def until(predicate: Any, what: str, deadline: float = 60.0) -> None:
    """Poll ``predicate`` (sync or async) until true; fail naming ``what`` past ``deadline``."""
    await fixtures.until(predicate, what, guard=deadline, every=0.02)


async def test_node_resources_and_runtime_env_reach_ray(
    ray_session: Any, graphs: ModuleType
) -> None:
    async with RayExecutor() as ray_executor:
        engine = tr.Engine(executor=ray_executor)
        async with asyncio.timeout(GUARD):
            result = await engine.run(graphs.placed(), None)

    assert result.results["wide"] == {"CPU": 2.0}
    assert result.results["env"] == "from-node"


async def test_map_items_run_on_ray_and_know_their_item(
    ray_session: Any, graphs: ModuleType
) -> None:
    async with RayExecutor() as ray_executor:
        engine = tr.Engine(executor=ray_executor)
        async with asyncio.timeout(GUARD):
            result = await engine.run(graphs.mapped(), 4)
    assert [(r["x"], r["item"], r["node"]) for r in result.output] == [
        (j, j, "each") for j in range(4)
    ]
    assert all(r["pid"] != os.getpid() for r in result.output)  # in Ray's workers (M2)


async def test_a_sigkilled_worker_fails_the_try_and_the_retry_runs_on_another_worker(
    ray_session: Any, graphs: ModuleType, tmp_path: Path
) -> None:
    directory = str(tmp_path)
    bus = tr.EventBus()
    events: list[tr.Event] = []
    bus.subscribe(events.append)
    async with RayExecutor() as ray_executor:
        engine = tr.Engine(executor=ray_executor, bus=bus)
        run = asyncio.create_task(engine.run(graphs.killable(directory), 7))
        try:
            await until(lambda: graphs.marked(directory, "pid1"), "the first try's pid")
            pid1 = int(graphs.read_mark(directory, "pid1"))
            assert pid1 != os.getpid()
            os.kill(pid1, signal.SIGKILL)
            async with asyncio.timeout(GUARD):
                result = await run
        finally:
            run.cancel()

    assert result.results["work"]["square"] == 49
    assert result.results["work"]["pid"] != pid1  # retried on another worker
    [retrying] = [e for e in events if e.type is tr.EventType.NODE_RETRYING]
    assert retrying.data["error"].startswith("ExecutorLost: run ")
    assert "node 'work' (visit 1, try 1)" in retrying.data["error"]
    assert [(row[0], row[2]) for row in graphs.executions(directory)] == [("work", 1), ("work", 2)]


async def test_a_task_deaf_to_the_interrupt_is_killed_after_the_grace_period(
    ray_session: Any, graphs: ModuleType, tmp_path: Path
) -> None:
    directory = str(tmp_path)
    async with RayExecutor(cancel_grace=0.5) as ray_executor:
        engine = tr.Engine(executor=ray_executor)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(GUARD):
                await engine.run(graphs.blocked(directory, timeout=1.0), None)

    # Its sleep would end after a minute and leave the worker alive for the next task:
    # gone now means ray.cancel(force=True) killed it.
    pid = int(graphs.read_mark(directory, "sleeper.pid"))
    await until(lambda: not alive(pid), "the blocked worker to be killed")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


DRIVER = """
import asyncio, importlib.util, sys

spec = importlib.util.spec_from_file_location("tailrace_tests_executors", sys.argv[1])
graphs = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = graphs
spec.loader.exec_module(graphs)

from ray import cloudpickle
cloudpickle.register_pickle_by_value(graphs)

import tailrace as tr
from tailrace.executors import RayExecutor
from tailrace.stores import SQLiteStore

async def main(directory, database, address):
    async with SQLiteStore(database) as store, RayExecutor(address) as ray_executor:
        engine = tr.Engine(store=store, executor=ray_executor, lease_ttl=3600)
        await engine.run(graphs.durable_fan(directory), 3, run_id="fan")

asyncio.run(main(*sys.argv[2:]))
"""


async def test_a_sigkilled_driver_resumes_and_no_committed_visit_runs_again(
    ray_session: Any, graphs: ModuleType, tmp_path: Path
) -> None:
    directory = tmp_path / "work"
    directory.mkdir()
    database = tmp_path / "runs.db"
    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent(DRIVER))
    address = ray_session.get_runtime_context().gcs_address
    graphs_path = Path(graphs.__file__)
    argv = [sys.executable, str(script), str(graphs_path), str(directory), str(database), address]
    log = tmp_path / "driver.log"
    with log.open("wb") as output:  # a file, not a pipe: Ray's logging never blocks the driver
        driver = await asyncio.create_subprocess_exec(*argv, stdout=output, stderr=output)
    try:
        async with SQLiteStore(database) as store:

            async def fanned_out_and_committed() -> bool:
                if driver.returncode is not None:
                    pytest.fail(
                        f"the driver exited: {graphs.read_mark(str(tmp_path), 'driver.log')}"
                    )
                if not graphs.marked(str(directory), "join.started"):
                    return False
                return len(await store.results("fan")) == 5  # a, b1..b4 are durable

            await until(fanned_out_and_committed, "the driver to commit a, b1..b4 and start join")
            driver.send_signal(signal.SIGKILL)
            await driver.wait()
            committed = Counter(row.node_id for row in await store.results("fan"))
            assert committed == {"a": 1, "b1": 1, "b2": 1, "b3": 1, "b4": 1}

            async with RayExecutor() as ray_executor:
                engine = tr.Engine(store=store, executor=ray_executor)
                async with asyncio.timeout(GUARD):
                    result = await engine.resume("fan", graphs.durable_fan(str(directory)))
    finally:
        if driver.returncode is None:
            driver.kill()
        await driver.wait()

    assert result.status == "completed"
    assert result.output == {"total": sum(30 + i for i in range(1, 5))}
    ran = Counter(row[0] for row in graphs.executions(str(directory)))
    # 0 committed visits re-run; join, running when the driver died, ran again.
    assert {node: ran[node] for node in committed} == dict.fromkeys(committed, 1)
    assert (ran["join"], ran["tail"]) == (2, 1)
    # Ray stopped the dead driver's task: the worker running the first join is gone.
    first_join = next(row[3] for row in graphs.executions(str(directory)) if row[0] == "join")
    await until(lambda: not alive(first_join), "the dead driver's join worker to be stopped")


def test_the_guides_example_runs(ray_session: Any, capsys: pytest.CaptureFixture[str]) -> None:
    guide = Path(__file__).parents[2] / "docs" / "ray.md"
    example = guide.read_text().split("```python\n", 1)[1].split("```", 1)[0]
    # Not importable by the workers: Ray pickles its handlers by value.
    exec(compile(example, str(guide), "exec"), {"__name__": "ray_guide_example"})
    assert capsys.readouterr().out == "{'total': 333332833333500000}\n"
