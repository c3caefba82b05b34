"""Execution semantics E1-E11, through the public API only.

Orderings are forced with ``asyncio.Event``s and event-bus listeners, never
with sleeps: a test that waits on something the engine must do first would
hang (caught by ``HANG_GUARD``) rather than pass by luck.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import Counter, defaultdict

import pytest

import tailrace as tr

#: Seconds before a test that would deadlock gives up. Not a timing assertion:
#: every test here finishes in milliseconds unless the engine is wrong.
HANG_GUARD = 10.0

ET = tr.EventType


class Recorder:
    """Collects every event an engine publishes."""

    def __init__(self, engine: tr.Engine) -> None:
        self.events: list[tr.Event] = []
        self.hooks: list = []
        engine.bus.subscribe(self._on_event)

    def _on_event(self, event: tr.Event) -> None:
        self.events.append(event)
        for hook in list(self.hooks):
            hook(event)

    def on(self, type_: tr.EventType, node_id: str, action, visit: int | None = None) -> None:
        """Call ``action()`` when ``node_id`` emits ``type_`` (optionally for one visit)."""

        def hook(event: tr.Event) -> None:
            if (
                event.type is type_
                and event.node_id == node_id
                and (visit is None or event.visit == visit)
            ):
                action()

        self.hooks.append(hook)

    async def until(self, predicate) -> None:
        """Wait until ``predicate()`` holds, re-checking after every event."""
        if predicate():
            return
        reached = asyncio.Event()

        def hook(event: tr.Event) -> None:
            if predicate():
                reached.set()

        self.hooks.append(hook)
        try:
            await reached.wait()
        finally:
            self.hooks.remove(hook)

    def of(self, *types: tr.EventType) -> list[tr.Event]:
        return [e for e in self.events if e.type in types]

    def node_events(self, node_id: str) -> list[tuple[str, int | None, int | None]]:
        return [(e.type.value, e.visit, e.attempt) for e in self.events if e.node_id == node_id]

    def index(self, type_: tr.EventType, node_id: str, visit: int = 1) -> int:
        for i, e in enumerate(self.events):
            if e.type is type_ and e.node_id == node_id and e.visit == visit:
                return i
        raise AssertionError(f"no {type_.value} event for {node_id!r} visit {visit}")


def visit() -> int:
    ctx = tr.current_node()
    assert ctx is not None
    return ctx.visit


async def run(engine: tr.Engine, graph: tr.Graph, payload=None, **kwargs) -> tr.RunResult:
    async with asyncio.timeout(HANG_GUARD):
        return await engine.run(graph, payload, **kwargs)


# ---------------------------------------------------------------------------
# E1 eager dispatch
# ---------------------------------------------------------------------------


async def test_e1_eager_dispatch_no_barrier():
    """A fast branch's downstream completes while its slow sibling still runs."""
    g = tr.Graph("eager")
    slow_may_finish = asyncio.Event()
    seen_by_slow = {}

    @g.task()
    async def src(x):
        return x

    @g.task()
    async def slow(x):
        await slow_may_finish.wait()
        seen_by_slow["fast_done"] = True
        return "slow"

    @g.task()
    async def fast(x):
        return "fast"

    @g.task()
    async def fast_child(x):
        return f"child of {x}"

    @g.task()
    async def fast_grandchild(x):
        return f"grandchild of {x}"

    g.add_edge("src", "slow")
    g.chain("src", "fast", "fast_child", "fast_grandchild")

    engine = tr.Engine()
    rec = Recorder(engine)
    rec.on(ET.NODE_COMPLETED, "fast_grandchild", slow_may_finish.set)
    result = await run(engine, g, 1)

    assert seen_by_slow == {"fast_done": True}
    assert result.results["fast_grandchild"] == "grandchild of child of fast"
    assert rec.index(ET.NODE_COMPLETED, "fast_grandchild") < rec.index(ET.NODE_COMPLETED, "slow")
    assert rec.index(ET.NODE_STARTED, "fast_grandchild") < rec.index(ET.NODE_COMPLETED, "slow")


async def test_e1_entry_nodes_all_start_at_once():
    g = tr.Graph("entries")
    all_in = asyncio.Event()
    running = set()

    def make(name):
        async def handler(x):
            running.add(name)
            if len(running) == 3:
                all_in.set()
            await all_in.wait()  # deadlocks unless all three run together
            return name

        g.add_node(name, handler)

    for name in ("p", "q", "r"):
        make(name)
    result = await run(tr.Engine(), g, None)
    assert result.results == {"p": "p", "q": "q", "r": "r"}


# ---------------------------------------------------------------------------
# E2 determinism (in process; PYTHONHASHSEED is covered in test_determinism.py)
# ---------------------------------------------------------------------------


async def test_e2_simultaneously_ready_nodes_dispatch_in_definition_order():
    g = tr.Graph("order")
    entered = []

    def make(name):
        async def handler(x):
            entered.append(name)
            return name

        g.add_node(name, handler)

    for name in ("src", "zeta", "alpha", "mu", "beta"):
        make(name)
    for name in ("beta", "mu", "alpha", "zeta"):  # edges added in reverse
        g.add_edge("src", name)

    engine = tr.Engine()
    rec = Recorder(engine)
    await run(engine, g)
    started = [e.node_id for e in rec.of(ET.NODE_STARTED)]
    assert started == ["src", "zeta", "alpha", "mu", "beta"]
    assert entered == ["src", "zeta", "alpha", "mu", "beta"]


async def test_e2_entries_dispatch_in_definition_order():
    g = tr.Graph("entries")
    for name in ("n3", "n1", "n2"):
        g.add_node(name, lambda x: x)
    engine = tr.Engine()
    rec = Recorder(engine)
    await run(engine, g)
    assert [e.node_id for e in rec.of(ET.NODE_STARTED)] == ["n3", "n1", "n2"]


async def test_e2_one_harvest_is_processed_in_definition_order():
    """y finishes before x in loop order, but both land in one harvest: x is processed first."""
    g = tr.Graph("batch")
    go = asyncio.Event()

    @g.task()
    async def src(x):
        return x

    @g.task()
    async def x(v):
        await go.wait()
        await asyncio.sleep(0)  # finish after y, still within the same wake-up
        return "X"

    @g.task()
    async def y(v):
        await go.wait()
        return "Y"

    @g.task(any_of=True)
    async def first(v):
        return v

    g.add_edge("src", "x")
    g.add_edge("src", "y")
    g.add_edge("x", "first")
    g.add_edge("y", "first")

    engine = tr.Engine()
    rec = Recorder(engine)
    rec.on(ET.NODE_COMPLETED, "src", go.set)
    result = await run(engine, g, 0)
    completed = [e.node_id for e in rec.of(ET.NODE_COMPLETED)]
    assert completed.index("x") < completed.index("y")
    assert result.results["first"] == "X"


async def test_e2_repeated_runs_give_identical_results_and_event_order():
    outcomes = []
    for _ in range(3):
        engine = tr.Engine()
        rec = Recorder(engine)
        result = await run(engine, _mixed_graph(), 3)
        per_node = defaultdict(list)
        for e in rec.events:
            if e.node_id is not None:
                per_node[e.node_id].append((e.type.value, e.visit, e.attempt))
        outcomes.append((result.results, result.visits, result.late_inputs, dict(per_node)))
    assert outcomes[0] == outcomes[1] == outcomes[2]


def _mixed_graph() -> tr.Graph:
    g = tr.Graph("mixed")

    @g.task()
    async def start(x):
        return x

    @g.task()
    async def left(x):
        await asyncio.sleep(0)
        return ("L", x)

    @g.task()
    async def right(x):
        return ("R", x)

    @g.aggregate(required=1)
    async def quick(xs):
        return ("Q", tuple(xs))

    @g.task(any_of=True)
    async def either(x):
        return ("E", x)

    @g.switch()
    async def loop_check(x):
        return "again" if visit() < 3 else "done"

    @g.task()
    async def body(x):
        return ("B", visit())

    @g.task()
    async def end(x):
        return ("END", x)

    g.add_edge("start", "left")
    g.add_edge("start", "right")
    g.add_edge("left", "quick")
    g.add_edge("right", "quick")
    g.add_edge("left", "either")
    g.add_edge("right", "either")
    g.add_edge("quick", "body")
    g.add_edge("body", "loop_check")
    g.add_edge("loop_check", "body", route="again")
    g.add_edge("loop_check", "end", route="done")
    return g


# ---------------------------------------------------------------------------
# E3 admission
# ---------------------------------------------------------------------------


class Concurrency:
    """Counts handlers in flight, overall and per run."""

    def __init__(self) -> None:
        self.current = 0
        self.peak = 0
        self.per_run = Counter()
        self.per_run_peak = Counter()

    def enter(self) -> None:
        ctx = tr.current_node()
        assert ctx is not None
        self.current += 1
        self.peak = max(self.peak, self.current)
        self.per_run[ctx.run_id] += 1
        self.per_run_peak[ctx.run_id] = max(self.per_run_peak[ctx.run_id], self.per_run[ctx.run_id])

    def leave(self) -> None:
        ctx = tr.current_node()
        assert ctx is not None
        self.current -= 1
        self.per_run[ctx.run_id] -= 1


def _wide_graph(name: str, width: int, conc: Concurrency) -> tr.Graph:
    g = tr.Graph(name)

    async def work(x):
        conc.enter()
        for _ in range(3):
            await asyncio.sleep(0)
        conc.leave()
        return x

    g.add_node("src", work)
    for i in range(width):
        g.add_node(f"w{i}", work)
        g.add_edge("src", f"w{i}")
    return g


async def test_e3_capacity_is_never_exceeded():
    conc = Concurrency()
    engine = tr.Engine(capacity=3)
    started = []
    engine.bus.subscribe(lambda e: started.append(e.node_id), ET.NODE_STARTED)
    result = await run(engine, _wide_graph("wide", 10, conc), 1)
    assert len(result.results) == 11
    assert conc.peak == 3
    assert sorted(started) == sorted(result.results)  # one NODE_STARTED per admission


async def test_e3_event_log_never_shows_more_than_capacity_in_flight():
    """The node admitted into a freed slot is started after the node that freed it completed."""
    g = tr.Graph("pair")
    g.add_node("a", lambda x: "a")
    g.add_node("b", lambda x: "b")
    engine = tr.Engine(capacity=1)
    rec = Recorder(engine)
    await run(engine, g)
    assert [(e.type.value, e.node_id) for e in rec.of(ET.NODE_STARTED, ET.NODE_COMPLETED)] == [
        ("node_started", "a"),
        ("node_completed", "a"),
        ("node_started", "b"),
        ("node_completed", "b"),
    ]


async def test_e3_capacity_is_shared_across_runs():
    conc = Concurrency()
    engine = tr.Engine(capacity=2)
    async with asyncio.timeout(HANG_GUARD):
        results = await asyncio.gather(
            *(engine.run(_wide_graph(f"g{i}", 6, conc), i) for i in range(4))
        )
    assert all(len(r.results) == 7 for r in results)
    assert conc.peak == 2


async def test_e3_queued_nodes_are_pending_and_silent():
    engine = tr.Engine(capacity=1)
    rec = Recorder(engine)
    g = tr.Graph("silent")
    release = asyncio.Event()
    snapshot = {}

    @g.task()
    async def holder(x):
        await release.wait()
        return 1

    @g.task()
    async def waiter(x):
        return 2

    task = asyncio.create_task(run(engine, g))
    await rec.until(lambda: rec.of(ET.NODE_STARTED))
    for _ in range(10):  # give the engine every chance to (wrongly) start the waiter
        await asyncio.sleep(0)
    snapshot["started"] = [e.node_id for e in rec.of(ET.NODE_STARTED)]
    release.set()
    result = await task
    assert snapshot["started"] == ["holder"]
    assert rec.node_events("waiter") == [("node_started", 1, 1), ("node_completed", 1, 1)]
    assert result.results == {"holder": 1, "waiter": 2}


async def test_e3_node_started_is_published_on_admission_across_runs():
    """A slot handed over by another run's completion starts the node: its NODE_STARTED is published then."""
    engine = tr.Engine(capacity=1)
    rec = Recorder(engine)
    hold, a_in, b_release = asyncio.Event(), asyncio.Event(), asyncio.Event()

    ga = tr.Graph("A")

    @ga.task()
    async def a1(x):
        a_in.set()
        await hold.wait()
        return "a1"

    gb = tr.Graph("B")

    b1_in = asyncio.Event()

    @gb.task()
    async def b1(x):
        b1_in.set()
        await b_release.wait()
        return "b1"

    async with asyncio.timeout(HANG_GUARD):
        run_a = asyncio.create_task(engine.run(ga))
        await a_in.wait()
        run_b = asyncio.create_task(engine.run(gb))
        await rec.until(lambda: len(rec.of(ET.RUN_STARTED)) == 2)
        hold.set()
        await run_a
        await b1_in.wait()
        for _ in range(10):
            await asyncio.sleep(0)
        published_while_running = [e.node_id for e in rec.of(ET.NODE_STARTED)]
        b_release.set()
        await run_b
    assert published_while_running == ["a1", "b1"], (
        "b1 was admitted and is running, but its NODE_STARTED is not published yet"
    )


async def test_e3_priority_orders_queued_nodes_only():
    """'hold' keeps its slot throughout; the others start by priority, ties by arrival."""
    g = tr.Graph("prio")
    entered = []
    hold_go = asyncio.Event()

    @g.task()
    async def hold(x):
        entered.append("hold")
        await hold_go.wait()  # a node that got a slot keeps it
        return "hold"

    @g.task()
    async def src(x):
        entered.append("src")
        return x

    def make(name, priority):
        async def handler(x):
            entered.append(name)
            await asyncio.sleep(0)
            return name

        g.add_node(name, handler, priority=priority)
        g.add_edge("src", name)

    make("low", 1)
    make("high", 9)
    make("mid", 5)
    make("high_too", 9)  # same priority as 'high': arrival order breaks the tie
    engine = tr.Engine(capacity=2, admission="priority")
    rec = Recorder(engine)
    rec.on(ET.NODE_STARTED, "low", hold_go.set)
    await run(engine, g)
    assert entered == ["hold", "src", "high", "high_too", "mid", "low"]
    assert [e.node_id for e in rec.of(ET.NODE_STARTED)] == entered
    assert rec.node_events("hold") == [("node_started", 1, 1), ("node_completed", 1, 1)]


async def test_e3_priority_lets_a_later_queued_node_overtake():
    """Across runs: 'high' queues after 'low' but starts first."""
    engine = tr.Engine(capacity=1, admission="priority")
    rec = Recorder(engine)
    hold_go, hold_in = asyncio.Event(), asyncio.Event()
    entered = []

    def graph(name, priority):
        g = tr.Graph(name)

        async def handler(x):
            entered.append(name)
            if name == "hold":
                hold_in.set()
                await hold_go.wait()
            return name

        g.add_node(name, handler, priority=priority)
        return g

    async with asyncio.timeout(HANG_GUARD):
        run_hold = asyncio.create_task(engine.run(graph("hold", 0)))
        await hold_in.wait()
        run_low = asyncio.create_task(engine.run(graph("low", 1)))
        await rec.until(lambda: len(rec.of(ET.RUN_STARTED)) == 2)
        run_high = asyncio.create_task(engine.run(graph("high", 9)))
        await rec.until(lambda: len(rec.of(ET.RUN_STARTED)) == 3)
        hold_go.set()
        await asyncio.gather(run_hold, run_low, run_high)
    assert entered == ["hold", "high", "low"]


async def test_e3_fifo_ignores_priority():
    g = tr.Graph("fifo")
    entered = []
    for name, priority in (("a", 0), ("b", 1), ("c", 9)):

        async def handler(x, name=name):
            entered.append(name)
            return name

        g.add_node(name, handler, priority=priority)
    await run(tr.Engine(capacity=1, admission="fifo"), g)
    assert entered == ["a", "b", "c"]


async def test_e3_run_capacity_bounds_each_run_separately():
    conc = Concurrency()
    both_in = asyncio.Event()

    def graph(name):
        g = tr.Graph(name)

        async def work(x):
            conc.enter()
            if conc.current >= 2:
                both_in.set()
            await both_in.wait()  # deadlocks if run_capacity were shared
            await asyncio.sleep(0)
            conc.leave()
            return x

        for i in range(4):
            g.add_node(f"n{i}", work)
        return g

    engine = tr.Engine(run_capacity=1)
    async with asyncio.timeout(HANG_GUARD):
        results = await asyncio.gather(engine.run(graph("r1"), 1), engine.run(graph("r2"), 2))
    assert all(len(r.results) == 4 for r in results)
    assert set(conc.per_run_peak.values()) == {1}
    assert conc.peak == 2


async def test_e3_run_capacity_within_engine_capacity():
    conc = Concurrency()
    engine = tr.Engine(capacity=3, run_capacity=2)
    async with asyncio.timeout(HANG_GUARD):
        await asyncio.gather(*(engine.run(_wide_graph(f"g{i}", 5, conc), i) for i in range(3)))
    assert max(conc.per_run_peak.values()) == 2
    assert conc.peak == 3


@pytest.mark.parametrize("admission", ["fifo", "priority"])
async def test_e3_cancelled_runs_queued_waiter_does_not_block(admission):
    engine = tr.Engine(capacity=1, admission=admission)
    hold, a_in = asyncio.Event(), asyncio.Event()
    ga = tr.Graph("A")

    @ga.task(priority=9)
    async def a1(x):
        a_in.set()
        await hold.wait()

    @ga.task(priority=5)
    async def a2(x):  # queued behind a1; its run is cancelled before it starts
        raise AssertionError("a2 must never start")

    gb = tr.Graph("B")

    @gb.task()
    async def b1(x):
        return "b1"

    async with asyncio.timeout(HANG_GUARD):
        run_a = asyncio.create_task(engine.run(ga))
        await a_in.wait()
        run_b = asyncio.create_task(engine.run(gb))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not run_b.done()
        run_a.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run_a
        result = await run_b
        assert result.results == {"b1": "b1"}
        again = await engine.run(gb)  # the engine's slots are all free again
        assert again.results == {"b1": "b1"}


async def test_e3_sync_handlers_run_in_a_worker_thread():
    g = tr.Graph("threads")
    seen = {}

    @g.task()
    def blocking(x):
        seen["sync"] = threading.get_ident()
        return x

    @g.task()
    async def on_loop(x):
        seen["async"] = threading.get_ident()
        return x

    g.chain("blocking", "on_loop")
    result = await run(tr.Engine(), g, 5)
    assert result.results == {"blocking": 5, "on_loop": 5}
    assert seen["async"] == threading.get_ident()
    assert seen["sync"] != threading.get_ident()


async def test_e3_sync_handler_does_not_block_the_loop():
    g = tr.Graph("threads")
    async_done = threading.Event()

    @g.task()
    def blocking(x):
        assert async_done.wait(HANG_GUARD), "the async sibling never ran"
        return "sync"

    @g.task()
    async def sibling(x):
        async_done.set()
        return "async"

    result = await run(tr.Engine(), g)
    assert result.results == {"blocking": "sync", "sibling": "async"}


def test_e3_engine_options_are_checked():
    with pytest.raises(ValueError, match="capacity"):
        tr.Engine(capacity=0)
    with pytest.raises(ValueError, match="run_capacity"):
        tr.Engine(run_capacity=0)
    with pytest.raises(ValueError, match="bogus"):
        tr.Engine(admission="bogus")


# ---------------------------------------------------------------------------
# E4 first-k aggregates
# ---------------------------------------------------------------------------


async def test_e4_first_k_payload_is_earliest_inputs_in_definition_order():
    """a, b, c into required=2: c first, then a and b in one harvest -> [A, C]."""
    g = tr.Graph("firstk")
    ab_go = asyncio.Event()
    payloads = []

    @g.task()
    async def a(x):
        await ab_go.wait()
        await asyncio.sleep(0)  # a finishes after b, in the same wake-up: definition order decides
        return "A"

    @g.task()
    async def b(x):
        await ab_go.wait()
        return "B"

    @g.task()
    async def c(x):
        return "C"

    @g.aggregate(required=2)
    async def merge(xs):
        payloads.append(list(xs))
        return "merged"

    for src in ("a", "b", "c"):
        g.add_edge(src, "merge")

    engine = tr.Engine()
    rec = Recorder(engine)
    rec.on(ET.NODE_COMPLETED, "c", ab_go.set)
    result = await run(engine, g)
    assert payloads == [["A", "C"]]
    assert result.results == {"a": "A", "b": "B", "c": "C", "merge": "merged"}
    assert result.visits["merge"] == 1
    assert [(i.node_id, i.source_id, i.reason) for i in result.late_inputs] == [
        ("merge", "b", "fired")
    ]
    fired = rec.of(ET.AGGREGATE_FIRED)
    assert [(e.node_id, e.visit) for e in fired] == [("merge", 1)]
    # a and b really completed in one harvest: merge (ready after a) was dispatched after b completed
    assert rec.index(ET.NODE_COMPLETED, "c") < rec.index(ET.NODE_COMPLETED, "a")
    assert rec.index(ET.NODE_COMPLETED, "a") < rec.index(ET.AGGREGATE_FIRED, "merge")
    assert rec.index(ET.AGGREGATE_FIRED, "merge") < rec.index(ET.NODE_COMPLETED, "b")
    assert rec.index(ET.NODE_COMPLETED, "b") < rec.index(ET.NODE_STARTED, "merge")


async def test_e4_required_one_diamond_fires_once_and_records_both():
    g = tr.Graph("diamond")
    y_go = asyncio.Event()
    payloads = []

    @g.task()
    async def src(x):
        return x

    @g.task()
    async def x(v):
        return f"X{v}"

    @g.task()
    async def y(v):
        await y_go.wait()
        return f"Y{v}"

    @g.aggregate(required=1)
    async def join(xs):
        payloads.append(list(xs))
        return "joined"

    g.add_edge("src", "x")
    g.add_edge("src", "y")
    g.add_edge("x", "join")
    g.add_edge("y", "join")

    engine = tr.Engine()
    rec = Recorder(engine)
    rec.on(ET.NODE_COMPLETED, "join", y_go.set)
    result = await run(engine, g, 1)
    assert payloads == [["X1"]]
    assert result.results == {"src": 1, "x": "X1", "y": "Y1", "join": "joined"}
    assert result.visits == {"src": 1, "x": 1, "y": 1, "join": 1}
    assert len(rec.of(ET.AGGREGATE_FIRED)) == 1


async def test_e4_default_quorum_is_full_fan_in_listed_in_definition_order():
    g = tr.Graph("all")
    gates = {name: asyncio.Event() for name in ("p", "q", "r")}
    payloads = []

    def make(name):
        async def handler(x):
            await gates[name].wait()
            return name.upper()

        g.add_node(name, handler)

    for name in ("p", "q", "r"):
        make(name)

    @g.aggregate()
    async def merge(xs):
        payloads.append(list(xs))
        return len(xs)

    for name in ("p", "q", "r"):
        g.add_edge(name, "merge")

    engine = tr.Engine()
    rec = Recorder(engine)
    # completion order r, p, q: the payload is still in definition order
    rec.on(ET.NODE_COMPLETED, "r", gates["p"].set)
    rec.on(ET.NODE_COMPLETED, "p", gates["q"].set)
    gates["r"].set()
    result = await run(engine, g)
    assert payloads == [["P", "Q", "R"]]
    assert result.results["merge"] == 3
    assert result.late_inputs == ()


async def test_e4_aggregate_with_one_input():
    g = tr.Graph("single")
    g.add_node("src", lambda x: x + 1)
    g.add_node("agg", lambda xs: list(xs), tr.NodeKind.AGGREGATE)
    g.chain("src", "agg")
    result = await run(tr.Engine(), g, 1)
    assert result.results == {"src": 2, "agg": [2]}


# ---------------------------------------------------------------------------
# E5 stragglers
# ---------------------------------------------------------------------------


async def test_e5_straggler_is_recorded_and_never_refires():
    g = tr.Graph("straggler")
    slow_go = asyncio.Event()
    fired = []

    @g.task()
    async def fast(x):
        return "fast"

    @g.task()
    async def slow(x):
        await slow_go.wait()
        return "slow"

    @g.aggregate(required=1)
    async def merge(xs):
        fired.append(list(xs))
        return "merged"

    @g.task()
    async def after(x):
        return x

    g.add_edge("fast", "merge")
    g.add_edge("slow", "merge")
    g.chain("merge", "after")

    engine = tr.Engine()
    rec = Recorder(engine)
    rec.on(ET.NODE_COMPLETED, "after", slow_go.set)
    result = await run(engine, g)
    assert fired == [["fast"]]
    assert result.status == "completed"
    assert result.results == {"fast": "fast", "slow": "slow", "merge": "merged", "after": "merged"}
    assert result.visits == {"fast": 1, "slow": 1, "merge": 1, "after": 1}
    assert result.late_inputs == (
        tr.LateInput(node_id="merge", source_id="slow", activation=1, reason="fired"),
    )
    late_events = rec.of(ET.NODE_LATE_INPUT)
    assert [(e.node_id, e.data["source"], e.data["reason"]) for e in late_events] == [
        ("merge", "slow", "fired")
    ]
    assert len(rec.of(ET.AGGREGATE_FIRED)) == 1
    # the late input is reported after the straggler's own completion
    assert rec.index(ET.NODE_COMPLETED, "slow") < rec.events.index(late_events[0])


async def test_e5_late_input_event_names_the_visit_that_fired():
    """NODE_LATE_INPUT carries the (1-based) visit of the activation it was late for."""
    g = tr.Graph("straggler")
    slow_go = asyncio.Event()
    g.add_node("fast", lambda x: "fast")

    async def slow(x):
        await slow_go.wait()
        return "slow"

    g.add_node("slow", slow)
    g.add_node("merge", lambda xs: xs, tr.NodeKind.AGGREGATE, required=1)
    g.add_edge("fast", "merge")
    g.add_edge("slow", "merge")
    engine = tr.Engine()
    rec = Recorder(engine)
    rec.on(ET.NODE_COMPLETED, "merge", slow_go.set)
    result = await run(engine, g)
    (fired,) = rec.of(ET.AGGREGATE_FIRED)
    (late,) = rec.of(ET.NODE_LATE_INPUT)
    assert fired.visit == 1
    assert late.visit == fired.visit, f"late input event has visit={late.visit}; visits are 1-based"
    (recorded,) = result.late_inputs
    assert recorded.activation == late.visit


# ---------------------------------------------------------------------------
# E6 any_of
# ---------------------------------------------------------------------------


async def test_e6_any_of_receives_the_triggering_input():
    g = tr.Graph("anyof")
    slow_go = asyncio.Event()
    received = []

    @g.task()
    async def src(x):
        return x

    @g.task()
    async def slow(x):
        await slow_go.wait()
        return "slow"

    @g.task()
    async def quick(x):
        return "quick"

    @g.task(any_of=True)
    async def first(x):
        received.append(x)
        return f"got {x}"

    g.add_edge("src", "slow")
    g.add_edge("src", "quick")
    g.add_edge("slow", "first")
    g.add_edge("quick", "first")

    engine = tr.Engine()
    rec = Recorder(engine)
    rec.on(ET.NODE_COMPLETED, "first", slow_go.set)
    result = await run(engine, g)
    assert received == ["quick"]
    assert result.results["first"] == "got quick"
    assert result.visits["first"] == 1
    assert [(i.node_id, i.source_id) for i in result.late_inputs] == [("first", "slow")]


async def test_e6_same_batch_tie_goes_to_definition_order():
    g = tr.Graph("tie")
    go = asyncio.Event()

    @g.task()
    async def src(x):
        return x

    @g.task()
    async def early(x):  # defined first, finishes last within the wake-up
        await go.wait()
        await asyncio.sleep(0)
        return "early"

    @g.task()
    async def late(x):
        await go.wait()
        return "late"

    @g.task(any_of=True)
    async def first(x):
        return x

    g.add_edge("src", "late")  # edge order must not matter
    g.add_edge("src", "early")
    g.add_edge("late", "first")
    g.add_edge("early", "first")
    engine = tr.Engine()
    rec = Recorder(engine)
    rec.on(ET.NODE_COMPLETED, "src", go.set)
    result = await run(engine, g)
    assert result.results["first"] == "early"
    assert [(i.node_id, i.source_id) for i in result.late_inputs] == [("first", "late")]


# ---------------------------------------------------------------------------
# E7 loops
# ---------------------------------------------------------------------------


async def test_e7_self_loop_with_max_visits_runs_exactly_that_often():
    g = tr.Graph("spin")
    calls = []

    @g.task(max_visits=3)
    async def spin(x):
        calls.append((x, visit()))
        return x + 1

    g.add_edge("spin", "spin")
    engine = tr.Engine()
    rec = Recorder(engine)
    result = await run(engine, g, 0)
    assert calls == [(0, 1), (1, 2), (2, 3)]
    assert result.visits == {"spin": 3}
    assert result.results == {"spin": 3}
    # the 4th delivery is refused: it would have been visit 4
    assert [(i.node_id, i.source_id, i.activation, i.reason) for i in result.late_inputs] == [
        ("spin", "spin", 4, "max_visits")
    ]
    assert [e.visit for e in rec.of(ET.NODE_STARTED)] == [1, 2, 3]


async def test_e7_max_visits_is_never_exceeded_when_a_switch_keeps_looping():
    g = tr.Graph("bounded")

    @g.task()
    async def start(x):
        return 0

    @g.task(max_visits=4)
    async def body(x):
        return x + 1

    @g.switch()
    async def check(x):
        return "again"  # would loop forever without max_visits

    @g.task()
    async def done(x):
        return x

    g.chain("start", "body", "check")
    g.add_edge("check", "body", route="again")
    g.add_edge("check", "done", route=tr.EXIT)
    result = await run(tr.Engine(), g)
    assert result.visits == {"start": 1, "body": 4, "check": 4, "done": 0}
    assert result.results["body"] == 4
    assert [(i.node_id, i.reason) for i in result.late_inputs] == [("body", "max_visits")]


async def test_e7_switch_loop_without_max_visits_runs_until_exit():
    g = tr.Graph("until")
    g.add_node("start", lambda x: 0)
    g.add_node("inc", lambda x: x + 1)
    g.add_node("check", lambda x: "again" if x < 10 else "stop", tr.NodeKind.SWITCH)
    g.add_node("done", lambda x: ("done", x))
    g.chain("start", "inc", "check")
    g.add_edge("check", "inc", route="again")
    g.add_edge("check", "done", route=tr.EXIT)
    result = await run(tr.Engine(), g)
    assert result.visits == {"start": 1, "inc": 10, "check": 10, "done": 1}
    assert result.results["done"] == ("done", 10)
    assert result.results["check"] == "stop"
    assert result.late_inputs == ()


def _fan_merge_loop(*, required: int, branches: tuple[str, ...], hooks) -> tr.Graph:
    """start -> a -> branches -> d (aggregate, required) -> s -> a ("again") | done."""
    g = tr.Graph("fanloop")
    payloads = hooks["payloads"]

    @g.task()
    async def start(x):
        return "in"

    @g.task()
    async def a(x):
        v = visit()
        if v in hooks.get("a_sets", {}):
            hooks["a_sets"][v].set()
        return ("a", v)

    def branch(name):
        async def handler(x):
            v = visit()
            wait = hooks.get("waits", {}).get((name, v))
            if wait is not None:
                await wait.wait()
            return (name, v)

        g.add_node(name, handler)

    for name in branches:
        branch(name)

    @g.aggregate(required=required)
    async def d(xs):
        payloads.append(list(xs))
        return ("d", visit())

    @g.switch()
    async def s(x):
        return "again" if visit() < hooks["rounds"] else "stop"

    @g.task()
    async def done(x):
        return x

    g.chain("start", "a")
    for name in branches:
        g.add_edge("a", name)
        g.add_edge(name, "d")
    g.chain("d", "s")
    g.add_edge("s", "a", route="again")
    g.add_edge("s", "done", route=tr.EXIT)
    return g


async def test_e7_loop_with_fan_out_and_first_k_merge_inside():
    """c is slow in round 1: its late result counts for round 1 only; each round has its own quorum.

    Round 1: b wins d (required=1); c(1) still runs.
    Round 2: a(2) releases c(1), whose result is late for activation 1; c re-runs
    only after c(1) finished, c(2) wins round 2 (b(2) waits for it).
    Round 3: b and c finish in one harvest; b wins by definition order.
    """
    c1_go, b2_go = asyncio.Event(), asyncio.Event()
    hooks = {
        "payloads": [],
        "rounds": 3,
        "a_sets": {2: c1_go},
        "waits": {("c", 1): c1_go, ("b", 2): b2_go},
    }
    g = _fan_merge_loop(required=1, branches=("b", "c"), hooks=hooks)
    engine = tr.Engine()
    rec = Recorder(engine)
    rec.on(ET.NODE_COMPLETED, "c", b2_go.set, visit=2)
    concurrency = Counter()
    peak = Counter()

    def count(event):
        if event.type is ET.NODE_STARTED:
            concurrency[event.node_id] += 1
            peak[event.node_id] = max(peak[event.node_id], concurrency[event.node_id])
        elif event.type is ET.NODE_COMPLETED:
            concurrency[event.node_id] -= 1

    engine.bus.subscribe(count)
    result = await run(engine, g)

    assert hooks["payloads"] == [[("b", 1)], [("c", 2)], [("b", 3)]]
    assert result.visits == {"start": 1, "a": 3, "b": 3, "c": 3, "d": 3, "s": 3, "done": 1}
    assert result.results["s"] == "stop"
    assert result.results["done"] == ("d", 3)
    assert [(i.node_id, i.source_id, i.activation, i.reason) for i in result.late_inputs] == [
        ("d", "c", 1, "fired"),
        ("d", "b", 2, "fired"),
        ("d", "c", 3, "fired"),
    ]
    assert [e.visit for e in rec.of(ET.AGGREGATE_FIRED)] == [1, 2, 3]
    # c's second visit started only after its first attempt finished
    assert rec.index(ET.NODE_COMPLETED, "c", 1) < rec.index(ET.NODE_STARTED, "c", 2)
    assert peak["c"] == 1


async def test_e7_quorum_counts_only_the_current_activation():
    """required=2 of 3 inside a loop: e(1) arrives in round 2 and must not count for it."""
    e1_go, b2_go = asyncio.Event(), asyncio.Event()
    hooks = {
        "payloads": [],
        "rounds": 2,
        "a_sets": {2: e1_go},
        "waits": {("e", 1): e1_go, ("b", 2): b2_go},
    }
    g = _fan_merge_loop(required=2, branches=("b", "c", "e"), hooks=hooks)
    engine = tr.Engine()
    rec = Recorder(engine)
    rec.on(ET.NODE_COMPLETED, "d", b2_go.set, visit=2)
    result = await run(engine, g)
    assert hooks["payloads"] == [[("b", 1), ("c", 1)], [("c", 2), ("e", 2)]]
    assert result.visits["d"] == 2
    assert [(i.source_id, i.activation) for i in result.late_inputs] == [("e", 1), ("b", 2)]


async def test_e7_straggler_completion_event_reports_its_attempt():
    """The old activation's NODE_COMPLETED says visit 1, attempt 1, although visit 2 is already queued."""
    c1_go, b2_go = asyncio.Event(), asyncio.Event()
    hooks = {
        "payloads": [],
        "rounds": 2,
        "a_sets": {2: c1_go},
        "waits": {("c", 1): c1_go, ("b", 2): b2_go},
    }
    g = _fan_merge_loop(required=1, branches=("b", "c"), hooks=hooks)
    engine = tr.Engine()
    rec = Recorder(engine)
    rec.on(ET.NODE_COMPLETED, "c", b2_go.set, visit=2)
    await run(engine, g)
    completed = [(v, a) for t, v, a in rec.node_events("c") if t == "node_completed"]
    assert completed == [(1, 1), (2, 1)], completed
    assert all(e.attempt is not None and e.attempt >= 1 for e in rec.of(ET.NODE_COMPLETED)), [
        (e.node_id, e.visit, e.attempt) for e in rec.of(ET.NODE_COMPLETED)
    ]


async def test_e7_branch_skipped_by_a_switch_does_not_desynchronise_the_loop():
    """pick alternates b and c; each round's merge fires on that round's branch, never late."""
    g = tr.Graph("alternate")
    got = []
    g.add_node("start", lambda x: 0)
    g.add_node("a", lambda x: visit())
    g.add_node("pick", lambda v: "b" if v % 2 else "c", tr.NodeKind.SWITCH)
    g.add_node("b", lambda v: ("b", v))
    g.add_node("c", lambda v: ("c", v))

    def merge(xs):
        got.append(xs)
        return xs

    g.add_node("d", merge, tr.NodeKind.AGGREGATE, required=1)
    g.add_node("s", lambda x: "again" if visit() < 4 else "out", tr.NodeKind.SWITCH)
    g.add_node("done", lambda x: x)
    g.chain("start", "a", "pick")
    g.add_edge("pick", "b", route="b")
    g.add_edge("pick", "c", route="c")
    g.add_edge("b", "d")
    g.add_edge("c", "d")
    g.chain("d", "s")
    g.add_edge("s", "a", route="again")
    g.add_edge("s", "done", route=tr.EXIT)
    result = await run(tr.Engine(), g)
    assert got == [[("b", 1)], [("c", 2)], [("b", 3)], [("c", 4)]]
    assert result.visits == {
        "start": 1,
        "a": 4,
        "pick": 4,
        "b": 2,
        "c": 2,
        "d": 4,
        "s": 4,
        "done": 1,
    }
    assert result.late_inputs == ()


async def test_e7_any_of_inside_a_loop_fires_once_per_round():
    g = tr.Graph("anyloop")
    got = []
    quick_done = {v: asyncio.Event() for v in (1, 2, 3)}
    g.add_node("start", lambda x: 0)
    g.add_node("a", lambda x: visit())

    async def quick(v):
        return ("quick", v)

    async def slower(v):
        await quick_done[v].wait()  # finishes after quick's completion was harvested
        return ("slower", v)

    g.add_node("slower", slower)  # defined first, finishes second
    g.add_node("quick", quick)

    async def first(x):
        got.append(x)
        return x

    g.add_node("first", first, any_of=True)
    g.add_node("s", lambda x: "again" if visit() < 3 else "out", tr.NodeKind.SWITCH)
    g.add_node("done", lambda x: x)
    g.chain("start", "a")
    for name in ("slower", "quick"):
        g.add_edge("a", name)
        g.add_edge(name, "first")
    g.chain("first", "s")
    g.add_edge("s", "a", route="again")
    g.add_edge("s", "done", route=tr.EXIT)
    engine = tr.Engine()
    rec = Recorder(engine)
    for v, done in quick_done.items():
        rec.on(ET.NODE_COMPLETED, "quick", done.set, visit=v)
    result = await run(engine, g)
    assert got == [("quick", 1), ("quick", 2), ("quick", 3)]
    assert result.visits["first"] == 3
    assert [(i.source_id, i.activation) for i in result.late_inputs] == [
        ("slower", 1),
        ("slower", 2),
        ("slower", 3),
    ]


async def test_e7_nested_loops():
    g = tr.Graph("nested")
    g.add_node("start", lambda x: 0)
    g.add_node("outer", lambda x: ("outer", visit()))
    g.add_node("inner", lambda x: ("inner", visit()))
    # inner loop: 2 turns per outer turn; outer loop: 3 turns
    g.add_node("inner_check", lambda x: "again" if visit() % 2 == 1 else "out", tr.NodeKind.SWITCH)
    g.add_node("outer_check", lambda x: "again" if visit() < 3 else "stop", tr.NodeKind.SWITCH)
    g.add_node("done", lambda x: "done")
    g.chain("start", "outer", "inner", "inner_check")
    g.add_edge("inner_check", "inner", route="again")
    g.add_edge("inner_check", "outer_check", route="out")
    g.add_edge("outer_check", "outer", route="again")
    g.add_edge("outer_check", "done", route=tr.EXIT)
    result = await run(tr.Engine(), g)
    assert result.visits == {
        "start": 1,
        "outer": 3,
        "inner": 6,
        "inner_check": 6,
        "outer_check": 3,
        "done": 1,
    }
    assert result.late_inputs == ()


# ---------------------------------------------------------------------------
# E8 switches
# ---------------------------------------------------------------------------


def _switch_graph(route, *, with_exit: bool = True):
    g = tr.Graph("switch")
    seen = {}

    @g.task()
    async def start(x):
        return {"payload": x}

    @g.switch()
    async def choose(x):
        return route

    def sink(name):
        async def handler(x):
            seen[name] = x
            return name

        g.add_node(name, handler)

    for name in ("x", "y", "z", "fallback") if with_exit else ("x", "y", "z"):
        sink(name)
    g.chain("start", "choose")
    g.add_edge("choose", "x", route="go")
    g.add_edge("choose", "y", route="go")
    g.add_edge("choose", "z", route="other")
    if with_exit:
        g.add_edge("choose", "fallback", route=tr.EXIT)
    return g, seen


async def test_e8_every_matching_edge_is_taken_with_the_switch_input():
    g, seen = _switch_graph("go")
    result = await run(tr.Engine(), g, 7)
    assert seen == {"x": {"payload": 7}, "y": {"payload": 7}}
    assert result.results["choose"] == "go"
    assert result.visits == {"start": 1, "choose": 1, "x": 1, "y": 1, "z": 0, "fallback": 0}


async def test_e8_single_route():
    g, seen = _switch_graph("other")
    await run(tr.Engine(), g, 7)
    assert seen == {"z": {"payload": 7}}


async def test_e8_unknown_route_falls_back_to_exit():
    g, seen = _switch_graph("nowhere")
    result = await run(tr.Engine(), g, 7)
    assert seen == {"fallback": {"payload": 7}}
    assert result.results["choose"] == "nowhere"


async def test_e8_exit_route_can_be_chosen_explicitly():
    g, seen = _switch_graph(tr.EXIT)
    await run(tr.Engine(), g, 7)
    assert seen == {"fallback": {"payload": 7}}


async def test_e8_unknown_route_without_exit_raises_route_error():
    g, seen = _switch_graph("nowhere", with_exit=False)
    engine = tr.Engine()
    rec = Recorder(engine)
    with pytest.raises(tr.RouteError) as info:
        await run(engine, g, 7)
    assert "choose" in str(info.value)
    assert "nowhere" in str(info.value)
    assert seen == {}
    assert rec.events[-1].type is ET.NODE_FAILED
    assert rec.events[-1].node_id == "choose"


@pytest.mark.parametrize("bad", [None, 3, ["go"]])
async def test_e8_non_string_route_raises_route_error(bad):
    g, seen = _switch_graph(bad)
    with pytest.raises(tr.RouteError, match="choose"):
        await run(tr.Engine(), g, 7)
    assert seen == {}


async def test_e8_sync_switch():
    g = tr.Graph("sync_switch")
    g.add_node("choose", lambda x: "big" if x > 10 else "small", tr.NodeKind.SWITCH)
    g.add_node("big", lambda x: ("big", x))
    g.add_node("small", lambda x: ("small", x))
    g.add_edge("choose", "big", route="big")
    g.add_edge("choose", "small", route="small")
    result = await run(tr.Engine(), g, 42)
    assert result.results == {"choose": "big", "big": ("big", 42)}


# ---------------------------------------------------------------------------
# E9 failure
# ---------------------------------------------------------------------------


class Boom(Exception):
    pass


async def test_e9_failure_cancels_siblings_and_reraises_unwrapped():
    g = tr.Graph("fail")
    err = Boom("original")
    siblings_in = asyncio.Event()
    running = set()
    cleaned = []
    never = asyncio.Event()

    @g.task()
    async def src(x):
        return x

    @g.task()
    async def failing(x):
        await siblings_in.wait()
        raise err

    def sibling(name):
        async def handler(x):
            running.add(name)
            if len(running) == 2:
                siblings_in.set()
            try:
                await never.wait()
            except asyncio.CancelledError:
                await asyncio.sleep(0)  # cleanup that must be awaited before run() raises
                cleaned.append(name)
                raise

        g.add_node(name, handler)

    sibling("s1")
    sibling("s2")

    @g.task()
    async def downstream(x):
        raise AssertionError("must not run")

    for name in ("failing", "s1", "s2"):
        g.add_edge("src", name)
    g.add_edge("failing", "downstream")

    engine = tr.Engine()
    rec = Recorder(engine)
    with pytest.raises(Boom) as info:
        await run(engine, g, 1)
    assert info.value is err
    assert sorted(cleaned) == ["s1", "s2"]
    cancelled = [e.node_id for e in rec.of(ET.NODE_CANCELLED)]
    assert sorted(cancelled) == ["s1", "s2"]
    last = rec.events[-1]
    assert last.type is ET.NODE_FAILED
    assert last.node_id == "failing"
    assert "Boom" in last.data["error"]
    assert not rec.of(ET.RUN_COMPLETED)
    assert rec.node_events("downstream") == []


async def test_e9_sync_handler_failure_is_unwrapped():
    g = tr.Graph("sync_fail")
    err = KeyError("missing")

    @g.task()
    def broken(x):
        raise err

    with pytest.raises(KeyError) as info:
        await run(tr.Engine(), g)
    assert info.value is err


async def test_e9_failure_frees_capacity_for_later_runs():
    engine = tr.Engine(capacity=1)
    g = tr.Graph("fail")

    @g.task()
    async def broken(x):
        raise Boom("x")

    @g.task()
    async def queued(x):
        return "never"

    with pytest.raises(Boom):
        await run(engine, g)
    ok = tr.Graph("ok")
    ok.add_node("n", lambda x: "fine")
    assert (await run(engine, ok)).results == {"n": "fine"}


async def test_e9_handler_raising_cancelled_error_fails_the_run_and_frees_its_slot():
    """A handler whose own code raises CancelledError (it awaited something cancelled) is a failure.

    The engine did not cancel it, so the run must not report success with the
    node still 'running', and the node's capacity slot must be released.
    """
    engine = tr.Engine(capacity=1)
    g = tr.Graph("self_cancel")

    @g.task()
    async def a(x):
        doomed = asyncio.get_running_loop().create_future()
        doomed.cancel()
        await doomed  # raises CancelledError out of the handler

    @g.task()
    async def b(x):
        return "b"

    g.chain("a", "b")
    outcome: BaseException | tr.RunResult
    try:
        async with asyncio.timeout(HANG_GUARD):
            outcome = await engine.run(g)
    except asyncio.CancelledError as exc:
        outcome = exc
    assert not isinstance(outcome, tr.RunResult), (
        f"run reported {outcome.status!r} with nodes {outcome.nodes} although handler 'a' raised"
    )
    ok = tr.Graph("ok")
    ok.add_node("n", lambda x: "fine")
    async with asyncio.timeout(HANG_GUARD):
        assert (await engine.run(ok)).results == {"n": "fine"}


async def test_e9_second_failure_in_the_same_harvest():
    g = tr.Graph("two")
    first, second = Boom("first"), Boom("second")

    @g.task()
    async def one(x):
        raise first

    @g.task()
    async def two(x):
        raise second

    engine = tr.Engine()
    rec = Recorder(engine)
    with pytest.raises(Boom) as info:
        await run(engine, g)
    assert info.value is first  # definition order decides which failure is the run's
    failed = [e.node_id for e in rec.of(ET.NODE_FAILED)]
    assert failed == ["two", "one"]
    assert rec.events[-1].node_id == "one"


# ---------------------------------------------------------------------------
# E10 stalls
# ---------------------------------------------------------------------------


async def test_e10_stall_names_the_waiting_aggregate():
    g = tr.Graph("stall")
    g.add_node("start", lambda x: x)
    g.add_node("choose", lambda x: "left", tr.NodeKind.SWITCH)
    g.add_node("left", lambda x: "L")
    g.add_node("right", lambda x: "R")
    g.add_node("needs_both", lambda xs: xs, tr.NodeKind.AGGREGATE)
    g.chain("start", "choose")
    g.add_edge("choose", "left", route="left")
    g.add_edge("choose", "right", route="right")
    g.add_edge("left", "needs_both")
    g.add_edge("right", "needs_both")
    with pytest.raises(tr.StallError) as info:
        await run(tr.Engine(), g)
    assert "needs_both" in str(info.value)
    assert "left" in str(info.value)


async def test_e10_aggregate_that_got_nothing_does_not_stall():
    g = tr.Graph("skipped")
    g.add_node("choose", lambda x: "none", tr.NodeKind.SWITCH)
    g.add_node("left", lambda x: "L")
    g.add_node("right", lambda x: "R")
    g.add_node("done", lambda x: "done")
    g.add_node("needs_both", lambda xs: xs, tr.NodeKind.AGGREGATE)
    g.add_edge("choose", "left", route="left")
    g.add_edge("choose", "right", route="right")
    g.add_edge("choose", "done", route=tr.EXIT)
    g.add_edge("left", "needs_both")
    g.add_edge("right", "needs_both")
    result = await run(tr.Engine(), g)
    assert result.results == {"choose": "none", "done": "done"}
    assert result.visits["needs_both"] == 0


async def test_e10_no_stall_while_work_is_in_flight():
    """The aggregate has 1 of 2 inputs for a while; the run waits instead of stalling."""
    g = tr.Graph("patient")
    go = asyncio.Event()

    async def slow(x):
        await go.wait()
        return "slow"

    g.add_node("fast", lambda x: "fast")
    g.add_node("slow", slow)
    g.add_node("merge", lambda xs: xs, tr.NodeKind.AGGREGATE)
    g.add_edge("fast", "merge")
    g.add_edge("slow", "merge")
    engine = tr.Engine()
    rec = Recorder(engine)
    rec.on(ET.NODE_COMPLETED, "fast", go.set)
    result = await run(engine, g)
    assert result.results["merge"] == ["fast", "slow"]


# ---------------------------------------------------------------------------
# E11 retries, timeouts, attempts, current_node
# ---------------------------------------------------------------------------


async def test_e11_retry_until_success_emits_an_event_per_retry():
    g = tr.Graph("retry")
    contexts = []

    @g.task(retry=tr.RetryPolicy(attempts=3, backoff=0.0, retry_on=(ValueError,)))
    async def flaky(x):
        ctx = tr.current_node()
        contexts.append(ctx)
        if ctx.attempt < 3:
            raise ValueError(f"try {ctx.attempt}")
        return "ok"

    engine = tr.Engine()
    rec = Recorder(engine)
    result = await run(engine, g, run_id="retry-run")
    assert result.results == {"flaky": "ok"}
    assert contexts == [
        tr.NodeContext(run_id="retry-run", node_id="flaky", visit=1, attempt=n) for n in (1, 2, 3)
    ]
    assert rec.node_events("flaky") == [
        ("node_started", 1, 1),
        ("node_retrying", 1, 1),
        ("node_retrying", 1, 2),
        ("node_completed", 1, 3),
    ]
    assert [e.data["error"] for e in rec.of(ET.NODE_RETRYING)] == [
        "ValueError: try 1",
        "ValueError: try 2",
    ]
    assert result.nodes["flaky"].attempts == 3


class Throttled(Exception):
    """A plain exception that asks to be retried later, as a server's ``Retry-After`` does."""

    def __init__(self, retry_after: object) -> None:
        super().__init__("slow down")
        self.retry_after = retry_after


@pytest.mark.parametrize(
    ("retry_after", "waited"),
    [
        (0.05, 0.05),  # longer than the backoff: waited out
        (0.001, 0.01),  # shorter than the backoff: the backoff
        (1e9, 0.1),  # longer than max_backoff: capped there
        (float("nan"), 0.01),  # not a finite number >= 0: ignored
        (float("inf"), 0.01),
        (-5.0, 0.01),
        (True, 0.01),
        ("30", 0.01),
        (None, 0.01),
    ],
)
async def test_e11_a_retry_waits_the_retry_after_its_exception_carries(retry_after, waited):
    g = tr.Graph("retry")
    policy = tr.RetryPolicy(attempts=2, backoff=0.01, max_backoff=0.1, retry_on=(Throttled,))

    @g.task(retry=policy)
    async def throttled(x):
        if tr.current_node().attempt == 1:
            raise Throttled(retry_after)
        return "ok"

    engine = tr.Engine()
    rec = Recorder(engine)
    result = await run(engine, g)
    assert result.results == {"throttled": "ok"}
    assert [e.data["delay"] for e in rec.of(ET.NODE_RETRYING)] == [waited]


async def test_e11_retries_exhausted_raise_the_last_error():
    g = tr.Graph("retry")
    raised = []

    @g.task(retry=tr.RetryPolicy(attempts=3, backoff=0.0, retry_on=(ValueError,)))
    def always(x):
        exc = ValueError(f"try {tr.current_node().attempt}")
        raised.append(exc)
        raise exc

    engine = tr.Engine()
    rec = Recorder(engine)
    with pytest.raises(ValueError) as info:
        await run(engine, g)
    assert len(raised) == 3
    assert info.value is raised[-1]
    assert [e.type for e in rec.of(ET.NODE_RETRYING, ET.NODE_FAILED)] == [
        ET.NODE_RETRYING,
        ET.NODE_RETRYING,
        ET.NODE_FAILED,
    ]
    assert rec.events[-1].attempt == 3


async def test_e11_exceptions_outside_retry_on_are_not_retried():
    g = tr.Graph("retry")
    calls = []

    @g.task(retry=tr.RetryPolicy(attempts=5, backoff=0.0, retry_on=(ValueError,)))
    async def wrong(x):
        calls.append(1)
        raise TypeError("not retryable")

    engine = tr.Engine()
    rec = Recorder(engine)
    with pytest.raises(TypeError):
        await run(engine, g)
    assert calls == [1]
    assert rec.of(ET.NODE_RETRYING) == []


async def test_e11_timeout_raises_timeout_error():
    g = tr.Graph("timeout")

    @g.task(timeout=0.01)
    async def hangs(x):
        await asyncio.Event().wait()

    engine = tr.Engine()
    rec = Recorder(engine)
    with pytest.raises(TimeoutError):
        await run(engine, g)
    assert rec.events[-1].type is ET.NODE_FAILED
    assert rec.events[-1].node_id == "hangs"


async def test_e11_timeout_is_retried_when_in_retry_on():
    g = tr.Graph("timeout")

    @g.task(timeout=0.01, retry=tr.RetryPolicy(attempts=2, backoff=0.0, retry_on=(TimeoutError,)))
    async def first_try_hangs(x):
        if tr.current_node().attempt == 1:
            await asyncio.Event().wait()
        return "second try"

    engine = tr.Engine()
    rec = Recorder(engine)
    result = await run(engine, g)
    assert result.results == {"first_try_hangs": "second try"}
    assert rec.node_events("first_try_hangs") == [
        ("node_started", 1, 1),
        ("node_retrying", 1, 1),
        ("node_completed", 1, 2),
    ]
    assert "TimeoutError" in rec.of(ET.NODE_RETRYING)[0].data["error"]


async def test_e11_timeout_applies_to_sync_handlers():
    g = tr.Graph("timeout")
    release = threading.Event()

    @g.task(timeout=0.01)
    def blocks(x):
        release.wait(HANG_GUARD)

    try:
        with pytest.raises(TimeoutError):
            await run(tr.Engine(), g)
    finally:
        release.set()


async def test_e11_current_node_inside_handlers():
    g = tr.Graph("ctx")
    seen = []

    @g.task()
    async def start(x):
        seen.append(tr.current_node())
        return 0

    @g.task()
    def worker(x):  # sync: runs in a thread, still sees its context
        seen.append(tr.current_node())
        return x + 1

    @g.switch()
    async def check(x):
        return "again" if x < 2 else "stop"

    @g.task()
    async def done(x):
        return x

    g.chain("start", "worker", "check")
    g.add_edge("check", "worker", route="again")
    g.add_edge("check", "done", route=tr.EXIT)
    assert tr.current_node() is None
    result = await run(tr.Engine(), g, run_id="ctx-run")
    assert tr.current_node() is None
    assert result.run_id == "ctx-run"
    assert seen == [
        tr.NodeContext(run_id="ctx-run", node_id="start", visit=1, attempt=1),
        tr.NodeContext(run_id="ctx-run", node_id="worker", visit=1, attempt=1),
        tr.NodeContext(run_id="ctx-run", node_id="worker", visit=2, attempt=1),
    ]


async def test_current_node_required_outside_a_handler_says_so_and_inside_returns_the_node():
    with pytest.raises(RuntimeError, match=r"outside a handler"):
        tr.current_node(required=True).checkpoint(1)
    seen = []
    g = tr.Graph("required")

    @g.task()
    async def step(x):
        seen.append(tr.current_node(required=True))
        return x

    await tr.Engine().run(g, 1, run_id="req")
    assert seen == [tr.NodeContext(run_id="req", node_id="step", visit=1, attempt=1)]


def test_e11_retry_policy_validation_and_backoff():
    with pytest.raises(ValueError, match="attempts"):
        tr.RetryPolicy(attempts=0)
    with pytest.raises(ValueError):
        tr.RetryPolicy(backoff=-1.0)
    policy = tr.RetryPolicy(attempts=5, backoff=0.5, multiplier=2.0, max_backoff=1.5)
    assert [policy.delay(n) for n in (1, 2, 3, 4)] == [0.5, 1.0, 1.5, 1.5]


# ---------------------------------------------------------------------------
# Events
# ---------------------------------------------------------------------------


def _tiny_graph():
    g = tr.Graph("tiny")
    g.add_node("a", lambda x: x + 1)
    g.add_node("b", lambda x: x * 2)
    g.chain("a", "b")
    return g


async def test_events_listener_failure_goes_to_on_error_and_run_completes():
    reported = []
    bus = tr.EventBus(
        on_error=lambda event, listener, exc: reported.append((event.type, listener, exc))
    )
    engine = tr.Engine(bus=bus)
    assert engine.bus is bus

    def bad(event):
        raise RuntimeError("listener bug")

    good = []
    bus.subscribe(bad, ET.NODE_COMPLETED)
    bus.subscribe(good.append)
    result = await run(engine, _tiny_graph(), 1)
    assert result.results == {"a": 2, "b": 4}
    assert [(t, lst) for t, lst, _ in reported] == [
        (ET.NODE_COMPLETED, bad),
        (ET.NODE_COMPLETED, bad),
    ]
    assert all(isinstance(exc, RuntimeError) for _, _, exc in reported)
    assert good[-1].type is ET.RUN_COMPLETED


async def test_events_listener_failure_is_logged_without_on_error(caplog):
    engine = tr.Engine()

    def bad(event):
        raise RuntimeError("listener bug")

    engine.bus.subscribe(bad, ET.RUN_COMPLETED)
    with caplog.at_level(logging.WARNING, logger="tailrace.events"):
        result = await run(engine, _tiny_graph(), 1)
    assert result.status == "completed"
    records = [r for r in caplog.records if r.name == "tailrace.events"]
    assert len(records) == 1
    assert records[0].levelno == logging.WARNING
    assert "run_completed" in records[0].getMessage()
    assert records[0].exc_info is not None


async def test_events_failing_on_error_hook_is_logged(caplog):
    def broken_hook(event, listener, exc):
        raise RuntimeError("hook bug")

    engine = tr.Engine(bus=tr.EventBus(on_error=broken_hook))
    engine.bus.subscribe(lambda e: 1 / 0, ET.RUN_STARTED)
    with caplog.at_level(logging.WARNING, logger="tailrace.events"):
        result = await run(engine, _tiny_graph(), 1)
    assert result.status == "completed"
    assert any("run_started" in r.getMessage() for r in caplog.records)


async def test_events_subscribe_filters_by_type_and_unsubscribes():
    engine = tr.Engine()
    typed, everything = [], []
    stop_typed = engine.bus.subscribe(typed.append, ET.NODE_STARTED, ET.RUN_COMPLETED)
    stop_all = engine.bus.subscribe(everything.append)
    await run(engine, _tiny_graph(), 1)
    assert [e.type for e in typed] == [ET.NODE_STARTED, ET.NODE_STARTED, ET.RUN_COMPLETED]
    assert len(everything) > len(typed)
    stop_typed()
    stop_all()
    typed.clear()
    everything.clear()
    await run(engine, _tiny_graph(), 1)
    assert typed == [] and everything == []


async def test_events_belong_to_their_run_and_are_numbered():
    engine = tr.Engine()
    rec = Recorder(engine)
    r1, r2 = await asyncio.gather(run(engine, _tiny_graph(), 1), run(engine, _tiny_graph(), 2))
    for result in (r1, r2):
        mine = [e for e in rec.events if e.run_id == result.run_id]
        assert [e.seq for e in mine] == list(range(1, len(mine) + 1))
        assert mine[0].type is ET.RUN_STARTED
        assert mine[-1].type is ET.RUN_COMPLETED
    assert r1.run_id != r2.run_id


async def test_events_buses_are_isolated_between_engines():
    e1, e2 = tr.Engine(), tr.Engine()
    rec1, rec2 = Recorder(e1), Recorder(e2)
    result = await run(e1, _tiny_graph(), 1)
    assert {e.run_id for e in rec1.events} == {result.run_id}
    assert rec2.events == []


async def test_events_full_sequence_of_a_simple_run():
    engine = tr.Engine()
    rec = Recorder(engine)
    await run(engine, _tiny_graph(), 1)
    assert [(e.type.value, e.node_id, e.visit, e.attempt) for e in rec.events] == [
        ("run_started", None, None, None),
        ("node_started", "a", 1, 1),
        ("node_completed", "a", 1, 1),
        ("node_started", "b", 1, 1),
        ("node_completed", "b", 1, 1),
        ("run_completed", None, None, None),
    ]


def test_run_convenience_function():
    result = tr.run(_tiny_graph(), 3)
    assert result.status == "completed"
    assert result.results == {"a": 4, "b": 8}
    assert result.nodes["b"].status == "completed"


async def test_none_results_are_recorded():
    g = tr.Graph("none")
    g.add_node("a", lambda x: None)
    g.add_node("b", lambda x: x)
    g.chain("a", "b")
    result = await run(tr.Engine(), g, 1)
    assert result.results == {"a": None, "b": None}
