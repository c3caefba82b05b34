"""Graphs and handlers for the executor tests, run in this process and in Ray workers.

Loaded by path under the name ``tailrace_tests_executors`` (the Ray driver test's
child process loads it the same way), and pickled
by value for Ray, so workers need not import it. Handlers are closures over a
directory: they coordinate with the test and with each other through files in
it (Ray workers are other processes), never through sleeps as
synchronisation: a handler that waits polls for a file until a generous
deadline, and reports that the deadline passed rather than hang.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import tailrace as tr
from tailrace.executors import ExecutorLost

#: A handler waiting for a file or a cancellation gives up after this long (s).
DEADLINE = 60.0


def mark(directory: str, name: str, text: str = "") -> None:
    """Create ``directory/name`` holding ``text`` (the write is complete when the name appears)."""
    tmp = Path(directory, f".{name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.rename(Path(directory, name))


def read_mark(directory: str, name: str) -> str:
    """The text of ``directory/name``."""
    return Path(directory, name).read_text()


def marked(directory: str, name: str) -> bool:
    """Whether ``directory/name`` exists."""
    return Path(directory, name).exists()


def claim(directory: str, name: str) -> bool:
    """True for the first caller, across processes (an exclusive create)."""
    try:
        os.close(os.open(Path(directory, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def log_execution(directory: str, node_id: str) -> None:
    """Append ``node_id visit try pid`` to ``directory/executions`` (one write: atomic)."""
    ctx = tr.current_node()
    assert ctx is not None, "current_node() is set while a handler runs, here and on Ray"
    line = f"{node_id} {ctx.visit} {ctx.attempt} {os.getpid()}\n"
    fd = os.open(Path(directory, "executions"), os.O_CREAT | os.O_APPEND | os.O_WRONLY)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def executions(directory: str) -> list[tuple[str, int, int, int]]:
    """The lines :func:`log_execution` wrote: (node, visit, try, pid)."""
    path = Path(directory, "executions")
    if not path.exists():
        return []
    rows = [line.split() for line in path.read_text().splitlines()]
    return [(n, int(v), int(a), int(p)) for n, v, a, p in rows]


async def until_marked(directory: str, name: str) -> bool:
    """Poll for ``directory/name``; False if the deadline passed first."""
    deadline = time.monotonic() + DEADLINE
    while not marked(directory, name):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


async def until_cancelled(directory: str, name: str) -> str:
    """Wait to be cancelled, marking ``name.started`` then ``name.cancelled``; "not cancelled" at the deadline."""
    mark(directory, f"{name}.started")
    try:
        deadline = time.monotonic() + DEADLINE
        # Short sleeps on purpose: in a Ray worker, ray.cancel's interrupt lands only when
        # the loop wakes (it does not interrupt a long sleep).
        while time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
    except asyncio.CancelledError:
        mark(directory, f"{name}.cancelled")
        raise
    return "not cancelled"


# -- the semantics suite's graphs -------------------------------------------------------------


def first_k(directory: str) -> tr.Graph:
    """src -> w1, w2, w3 -> merge(required=2); w3 finishes only after merge ran (E4, E5)."""
    g = tr.Graph("first-k")

    async def src(x: Any) -> Any:
        return x

    async def quick(x: Any) -> str:
        node = tr.current_node()
        assert node is not None
        return f"{node.node_id}:{x}"

    async def late(x: Any) -> str:
        if not await until_marked(directory, "merged"):
            return "w3 gave up waiting"
        return f"w3:{x}"

    async def merge(xs: Any) -> list[str]:
        mark(directory, "merged")
        return list(xs)

    g.add_node("src", src)
    g.add_node("w1", quick)
    g.add_node("w2", quick)
    g.add_node("w3", late)
    g.add_node("merge", merge, "aggregate", required=2)
    for w in ("w1", "w2", "w3"):
        g.add_edge("src", w)
        g.add_edge(w, "merge")
    return g


def teardown(directory: str) -> tr.Graph:
    """src -> bad, slow: bad raises once slow runs; slow must be cancelled (E9)."""
    g = tr.Graph("teardown")

    async def src(x: Any) -> Any:
        return x

    async def bad(x: Any) -> None:
        await until_marked(directory, "slow.started")
        raise ValueError(f"bad input {x}")

    async def slow(x: Any) -> str:
        return await until_cancelled(directory, "slow")

    g.add_node("src", src)
    g.add_node("bad", bad)
    g.add_node("slow", slow)
    g.add_edge("src", "bad")
    g.add_edge("src", "slow")
    return g


def flaky(directory: str, *, fail_with: type[Exception], retry_on: type[Exception]) -> tr.Graph:
    """One node failing with ``fail_with`` on its first two tries, retried on ``retry_on`` (E11)."""
    g = tr.Graph("flaky")

    def flaky_step(x: Any) -> dict[str, Any]:  # sync: runs in the thread pool locally
        node = tr.current_node()
        assert node is not None
        log_execution(directory, "flaky")
        if node.attempt < 3:
            raise fail_with(f"try {node.attempt} of {x}")
        return {"input": x, "try": node.attempt}

    g.add_node("flaky", flaky_step, retry=tr.RetryPolicy(attempts=3, retry_on=(retry_on,)))
    return g


def timing_out(directory: str, timeout: float) -> tr.Graph:
    """A node whose first try outlives ``timeout`` and is retried on TimeoutError (E11)."""
    g = tr.Graph("timeout")

    async def step(x: Any) -> str:
        node = tr.current_node()
        assert node is not None
        if node.attempt == 1:
            return await until_cancelled(directory, "try1")
        return f"try {node.attempt}"

    policy = tr.RetryPolicy(attempts=2, retry_on=(TimeoutError,))
    g.add_node("step", step, timeout=timeout, retry=policy)
    return g


def hedged(directory: str) -> tr.Graph:
    """A hedged node whose first attempt hangs until cancelled; the backup wins (T3)."""
    g = tr.Graph("hedge")

    async def h(x: Any) -> str:
        if claim(directory, "primary"):
            return await until_cancelled(directory, "primary")
        node = tr.current_node(required=True)  # the backup knows it is one, wherever it runs
        return f"backup:{x}" if node.backup and node.backup_of == 1 else f"no backup? {node}"

    g.add_node("h", h, hedge=True)
    return g


# -- the Ray-only tests' graphs ---------------------------------------------------------------


def killable(directory: str) -> tr.Graph:
    """Try 1 writes its worker's pid and waits (to be SIGKILLed); try 2 answers."""
    g = tr.Graph("killable")

    def work(x: Any) -> dict[str, Any]:
        node = tr.current_node()
        assert node is not None
        log_execution(directory, "work")
        if node.attempt == 1:
            mark(directory, "pid1", str(os.getpid()))
            deadline = time.monotonic() + DEADLINE
            while time.monotonic() < deadline:
                time.sleep(0.01)
            return {"error": "not killed"}
        return {"square": x * x, "pid": os.getpid()}

    g.add_node("work", work, retry=tr.RetryPolicy(attempts=2, retry_on=(ExecutorLost,)))
    return g


def durable_fan(directory: str) -> tr.Graph:
    """a -> b1..b4 -> join -> tail; join's first execution waits for ever (its driver is killed)."""
    g = tr.Graph("durable-fan")

    def a(x: Any) -> int:
        log_execution(directory, "a")
        return int(x)

    def b(x: Any) -> int:
        node = tr.current_node()
        assert node is not None
        log_execution(directory, node.node_id)
        return x * 10 + int(node.node_id[1:])

    def join(xs: Any) -> int:
        log_execution(directory, "join")
        if claim(directory, "join.first"):
            mark(directory, "join.started")
            deadline = time.monotonic() + DEADLINE
            while time.monotonic() < deadline:
                time.sleep(0.01)
        return sum(xs)

    def tail(x: Any) -> dict[str, int]:
        log_execution(directory, "tail")
        return {"total": x}

    retry = tr.RetryPolicy(attempts=2, retry_on=(ExecutorLost,))
    g.add_node("a", a)
    for i in range(1, 5):
        g.add_node(f"b{i}", b, retry=retry)
        g.add_edge("a", f"b{i}")
    g.add_node("join", join, "aggregate", retry=retry)
    for i in range(1, 5):
        g.add_edge(f"b{i}", "join")
    g.add_node("tail", tail)
    g.add_edge("join", "tail")
    return g


def placed() -> tr.Graph:
    """Nodes that report what Ray gave them: their resources and their runtime_env."""
    g = tr.Graph("placed")

    def resources(x: Any) -> dict[str, float]:
        import ray

        return dict(ray.get_runtime_context().get_assigned_resources())

    def environment(x: Any) -> str | None:
        return os.environ.get("TAILRACE_TEST_ENV")

    g.add_node("wide", resources, resources={"num_cpus": 2})
    g.add_node("env", environment, runtime_env={"env_vars": {"TAILRACE_TEST_ENV": "from-node"}})
    return g


def lone_slow(directory: str) -> tr.Graph:
    """One node that waits until it is cancelled."""
    g = tr.Graph("lone-slow")

    async def slow(x: Any) -> str:
        return await until_cancelled(directory, "slow")

    g.add_node("slow", slow)
    return g


def blocked(directory: str, timeout: float) -> tr.Graph:
    """One node blocked in one long sleep, which ray.cancel's interrupt does not wake."""
    g = tr.Graph("blocked")

    def sleeper(x: Any) -> str:
        mark(directory, "sleeper.pid", str(os.getpid()))
        time.sleep(DEADLINE)
        return "slept"

    g.add_node("sleeper", sleeper, timeout=timeout)
    return g


def where_am_i(x: int) -> dict[str, Any]:
    """A map item's view of itself, from wherever it runs (another process on Ray)."""
    ctx = tr.current_node()
    assert ctx is not None
    return {"x": x, "item": ctx.item, "node": ctx.node_id, "pid": os.getpid()}


def mapped() -> tr.Graph:
    """``items -> each`` (a map of 4 items), the items run by the engine's executor."""
    g = tr.Graph("executor_map")
    g.add_node("items", lambda n: list(range(n)))
    g.add_node("each", where_am_i, "map", required=4)
    g.chain("items", "each")
    return g


def across_nodes(directory: str) -> tr.Graph:
    """first -> work -> after; work marks the Ray node it runs on, then waits for ``go``.

    Each try of ``work`` writes ``work.<try>`` holding its Ray node's id, and
    returns that id once ``directory/go`` exists (the test removes the node of
    the first try before it makes ``go``): retried on :class:`ExecutorLost`.
    """
    g = tr.Graph("across-nodes")

    def first(x: Any) -> int:
        log_execution(directory, "first")
        return int(x)

    def work(x: int) -> dict[str, Any]:
        import ray  # the extra: only ever imported where this runs on Ray

        node = tr.current_node()
        assert node is not None
        log_execution(directory, "work")
        here = ray.get_runtime_context().get_node_id()
        mark(directory, f"work.{node.attempt}", here)
        deadline = time.monotonic() + DEADLINE
        while not marked(directory, "go") and time.monotonic() < deadline:
            time.sleep(0.01)
        return {"x": x, "node": here, "try": node.attempt}

    def after(r: dict[str, Any]) -> dict[str, Any]:
        log_execution(directory, "after")
        return r

    g.add_node("first", first)
    g.add_node("work", work, retry=tr.RetryPolicy(attempts=3, retry_on=(ExecutorLost,)))
    g.add_node("after", after)
    g.chain("first", "work", "after")
    return g


def spread_across_nodes(directory: str, quick: int) -> tr.Graph:
    """items -> spread (a map on Ray, one CPU an item) -> total.

    Each try of an item marks ``spread.<item>.<try>`` with its Ray node's id.
    The first ``quick`` items return at once; the others wait for
    ``directory/go`` (the test removes a node while they wait). Items are
    retried on :class:`ExecutorLost`.
    """
    g = tr.Graph("spread-across-nodes")

    def items(n: Any) -> list[int]:
        return list(range(int(n)))

    def spread(item: int) -> dict[str, Any]:
        import ray  # the extra: only ever imported where this runs on Ray

        node = tr.current_node()
        assert node is not None and node.item == item
        here = ray.get_runtime_context().get_node_id()
        mark(directory, f"spread.{item}.{node.attempt}", here)
        deadline = time.monotonic() + DEADLINE
        while item >= quick and not marked(directory, "go") and time.monotonic() < deadline:
            time.sleep(0.01)
        return {"item": item, "node": here, "try": node.attempt}

    g.add_node("items", items)
    g.add_node(
        "spread", spread, "map", resources={"num_cpus": 1},
        retry=tr.RetryPolicy(attempts=3, retry_on=(ExecutorLost,)),
    )  # fmt: skip
    g.add_node("total", lambda results: {"items": len(results)})
    g.chain("items", "spread", "total")
    return g


def tries(directory: str, item: int) -> dict[int, str]:
    """The tries of ``spread``'s ``item`` that started, each with the Ray node it ran on."""
    found = {}
    for path in Path(directory).glob(f"spread.{item}.*"):
        found[int(path.name.rsplit(".", 1)[1])] = path.read_text()
    return found
