"""Runs for the dashboard's tests, made by the real engine on a real store.

Loaded by path as ``tailrace_tests_ui_scenarios`` (``tests.ui.support`` does it),
so the graphs here have a module reference a run records and the dashboard can
import, like an installed package's graphs.

Handlers never sleep to order themselves: the slow tool waits for the merge
to fire (an event), the hedged node's first attempt waits until it is
cancelled, the stuck node waits until its run is cut.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import tailrace as tr
from tailrace.stores import Queue, RunStore, SQLiteStore, WorkerRow
from tailrace.tail._hooks import TailHooks

GUARD = 30.0  # seconds; only there so a bug fails a test instead of hanging it
MODULE = "tailrace_tests_ui_scenarios"
HOSTILE = '</script><script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2">'

_signals: dict[tuple[str, int], asyncio.Event] = {}


def signal(name: str) -> asyncio.Event:
    """An asyncio event named ``name`` on the running loop."""
    key = (name, id(asyncio.get_running_loop()))
    return _signals.setdefault(key, asyncio.Event())


# -- research: a fan-out, a first-k merge with a straggler, a loop -------------------------------

research = tr.Graph("research")


@research.task()
async def plan(topic: str) -> dict[str, Any]:
    return {"topic": topic}


async def _fast(plan: dict[str, Any]) -> str:
    return f"notes on {plan['topic']}"


async def _slow(plan: dict[str, Any]) -> str:
    await signal(f"merged:{plan['topic']}").wait()  # finishes after the merge fired: late (E5)
    return f"late notes on {plan['topic']}"


for _name, _handler in (("search", _fast), ("papers", _fast), ("issues", _slow)):
    research.add_node(_name, _handler)
    research.add_edge("plan", _name)


@research.aggregate(required=2)
async def merge(notes: list[str]) -> dict[str, Any]:
    topic = notes[0].rpartition(" on ")[2]
    signal(f"merged:{topic}").set()
    return {"notes": notes, "draft": 0, "topic": topic}


for _name in ("search", "papers", "issues"):
    research.add_edge(_name, "merge")


@research.task(max_visits=3)
async def write(state: dict[str, Any]) -> dict[str, Any]:
    return {**state, "draft": state["draft"] + 1}


@research.switch()
async def review(state: dict[str, Any]) -> str:
    return "again" if state["draft"] < 2 else "done"


@research.task()
async def publish(state: dict[str, Any]) -> dict[str, Any]:
    return state


research.add_edge("merge", "write")
research.add_edge("write", "review")
research.add_edge("review", "write", route="again")
research.add_edge("review", "publish", route="done")


# -- approval: a gate ------------------------------------------------------------------------------

approval = tr.Graph("approval")


@approval.task()
async def draft(text: str) -> dict[str, Any]:
    return {"draft": text}


@approval.gate()
async def approve(state: dict[str, Any]) -> dict[str, Any]:
    return {"question": f"Ship {state['draft']}?", "draft": state["draft"]}


@approval.task()
async def ship(answer: Any) -> dict[str, Any]:
    return {"shipped": answer}


approval.chain("draft", "approve", "ship")


# -- tail: a retried try, a straggler and its hedge ------------------------------------------------

tail = tr.Graph("tail")
_hedge_calls: dict[str, int] = {}


@tail.task(retry=tr.RetryPolicy(attempts=3, backoff=0.001))
async def flaky(key: str) -> str:
    node = tr.current_node()
    if node is not None and node.attempt == 1:
        raise ConnectionError("<b>upstream</b> reset")
    return key


@tail.task(hedge=True)
async def hedged(key: str) -> str:
    _hedge_calls[key] = _hedge_calls.get(key, 0) + 1
    if _hedge_calls[key] == 1:
        await asyncio.Event().wait()  # straggles until the hedge wins and cancels it
    return f"{key} by the hedge"


tail.chain("flaky", "hedged")


def trained_tail() -> TailHooks:
    """Tail hooks that expect ``hedged`` to take 10 ms, so it straggles at once (T3)."""
    hooks = TailHooks(factor=3.0)
    for _ in range(3):
        hooks.estimator("hedged").observe(1.0, 0.01)
    return hooks


# -- cut: a run stopped in the middle of a node, then resumed (D3) ----------------------------------

cut = tr.Graph("cut")
_cut_once: set[str] = set()


@cut.task()
async def first(key: str) -> str:
    return key


@cut.task()
async def stuck(key: str) -> str:
    if key not in _cut_once:
        _cut_once.add(key)
        await asyncio.Event().wait()  # the first attempt never ends: its run is cut
    return f"{key} resumed"


cut.chain("first", "stuck")


# -- quick and local graphs --------------------------------------------------------------------------

cut_free = tr.Graph("quick")


@cut_free.task()
async def only(x: Any) -> Any:
    return x


def local_graph() -> tr.Graph:
    """``a -> b, a -> c``, built in a function, so no module reference can find it."""
    g = tr.Graph("local")
    for name in ("a", "b", "c"):
        g.add_node(name, only)
    g.add_edge("a", "b")
    g.add_edge("a", "c")
    return g


def local_gate_graph() -> tr.Graph:
    """``ask`` (a gate) ``-> after``, built in a function: only ``--graphs`` can name it."""
    g = tr.Graph("local-gate")
    g.add_node("ask", only, tr.NodeKind.GATE)
    g.add_node("after", only)
    g.add_edge("ask", "after")
    return g


# -- failing and hostile runs ------------------------------------------------------------------------

failing = tr.Graph("failing")


@failing.task()
async def boom(x: Any) -> Any:
    raise ValueError(f"broke on {x!r} <i>really</i>")


hostile = tr.Graph("hostile<b>graph</b>")


@hostile.gate(name="ask<script>alert(1)</script>")
async def ask_hostile(x: Any) -> str:
    return HOSTILE


# -- making runs ----------------------------------------------------------------------------------


def sqlite_factory(path: Path) -> Callable[[bool], RunStore]:
    """Makes SQLite stores on ``path``, read-only when asked."""
    return lambda read_only: SQLiteStore(path, read_only=read_only)


@contextlib.asynccontextmanager
async def opened(factory: Callable[[bool], RunStore]) -> AsyncIterator[RunStore]:
    store = factory(False)
    async with store:
        yield store


async def make_runs(factory: Callable[[bool], RunStore]) -> dict[str, str]:
    """One run of each kind; returns run ids by kind."""
    async with asyncio.timeout(GUARD), opened(factory) as store:
        engine = tr.Engine(store=store)
        await engine.run(research, "tail latency", run_id="r-research")
        await engine.run(approval, "v1.2", run_id="r-gated")
        unique = uuid.uuid4().hex  # handlers key their behaviour on it, once per call
        await tr.Engine(store=store, tail=trained_tail()).run(tail, unique, run_id="r-tail")
        with contextlib.suppress(ValueError):
            await engine.run(failing, "<x>", run_id="r-failed")
        await engine.run(hostile, HOSTILE, run_id=f"r-{HOSTILE}")
        await cut_and_resume(store, "r-cut")
    return {
        "research": "r-research",
        "gated": "r-gated",
        "tail": "r-tail",
        "failed": "r-failed",
        "hostile": f"r-{HOSTILE}",
        "cut": "r-cut",
    }


async def cut_and_resume(store: RunStore, run_id: str, *, resume: bool = True) -> None:
    """Run ``cut`` until ``stuck`` has started (durably), stop it there, then resume it."""
    bus = tr.EventBus()
    durable = asyncio.Event()  # events are published once committed
    bus.subscribe(lambda e: e.node_id == "stuck" and durable.set(), tr.EventType.NODE_STARTED)
    key = uuid.uuid4().hex
    task = asyncio.create_task(tr.Engine(store=store, bus=bus).run(cut, key, run_id=run_id))
    await durable.wait()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    if resume:
        await tr.Engine(store=store).resume(run_id, cut)


async def started(store: RunStore, run_id: str, node_id: str) -> bool:
    """Whether ``node_id`` of ``run_id`` has a durable ``node_started`` (False before the run exists)."""
    try:
        events = await store.events(run_id)
    except tr.RunNotFound:
        return False
    return any(e.type == "node_started" and e.node_id == node_id for e in events)


async def fleet(store: RunStore) -> None:
    """Two queues (one declared), three queued runs, one finished direct run, a worker's report."""
    engine = tr.Engine(store=store)
    await store.declare_queue(Queue("emails", concurrency=2, limit=100, period=60.0))
    for n in range(2):
        await engine.submit(cut_free, n, queue="emails", run_id=f"mail-{n}")
    await engine.submit(cut_free, 9, queue="reports", run_id="report-0")
    await engine.run(cut_free, 1, run_id="direct")
    now = time.time()
    await store.worker_seen(
        WorkerRow(worker_id="otherhost:4242:1.0:abc", queues=("emails",), concurrency=4,
                  started_at=now - 30, seen_at=now, running=0)
    )  # fmt: skip


class Gates:
    """Threading events a handler in another thread's loop waits on (live-run tests)."""

    def __init__(self, *names: str) -> None:
        self.events = {name: threading.Event() for name in names}

    def release(self, name: str) -> None:
        self.events[name].set()

    async def wait(self, name: str) -> None:
        await asyncio.to_thread(self.events[name].wait, GUARD)


def live_graph(gates: Gates, steps: int) -> tr.Graph:
    """``step1 -> ... -> stepN``; each step finishes when the test releases it."""
    g = tr.Graph("live")
    for n in range(1, steps + 1):

        async def step(x: Any, name: str = f"step{n}") -> Any:
            await gates.wait(name)
            return x

        g.add_node(f"step{n}", step)
    g.chain(*(f"step{n}" for n in range(1, steps + 1)))
    return g
