"""The engine agrees with a small sequential reference interpreter on random DAGs (E1-E10).

Hypothesis draws a DAG (10-25 nodes: tasks, ``any_of`` nodes, first-k
aggregates with ``required`` up to the fan-in, switches that pick a route
from their input, sometimes one no edge carries) and a duration per node in
virtual time units. The engine's handlers do not sleep: each waits on its
own ``asyncio.Event``, and a driver releases, whenever the engine is idle,
every waiting handler whose virtual finish time is the earliest (so ties
complete in one harvest). The reference interpreter below simulates the same
virtual clock sequentially and implements the contract directly:

- entries get the run input; everything ready at time t finishes at t + delay;
- a batch of simultaneous completions is processed in definition order (E2);
- an aggregate fires once, on its k-th input, with the k earliest inputs
  listed in definition order of their sources (E4); later inputs are late (E5);
- an ``any_of`` node fires on its first input (E6);
- a switch's successors receive the switch's input; every edge with the
  chosen route is taken, else the ``exit`` edges, else ``RouteError`` (E8);
- the first failure cancels whatever is still running (E9);
- quiescence with an aggregate holding some inputs is a stall (E10).

Engine and reference must agree on every handler's payload and result, the
visits, the late inputs (in order), the outcome and, on failure, the
cancelled set.
"""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import tailrace as tr

ROUTES = ("r0", "r1", tr.EXIT)
NOMATCH = "nomatch"
RUN_INPUT = "in"
SETTLE_LIMIT = 20_000  # loop iterations without progress before we call it a hang


# ---------------------------------------------------------------------------
# the graph spec and the deterministic handler semantics shared by both sides
# ---------------------------------------------------------------------------


@dataclass
class Spec:
    names: list[str]  # definition order
    kind: dict[str, str]  # "task" | "switch" | "aggregate"
    any_of: set[str]
    required: dict[str, int]
    edges: list[tuple[str, str, str | None]]  # insertion order
    options: dict[str, tuple[str, ...]]  # a switch's possible answers
    delay: dict[str, int]

    def entries(self) -> list[str]:
        targets = {t for _, t, _ in self.edges}
        return [n for n in self.names if n not in targets]

    def out_edges(self, name: str) -> list[tuple[str, str | None]]:
        return [(t, r) for s, t, r in self.edges if s == name]


def digest(obj: Any) -> str:
    return hashlib.blake2b(repr(obj).encode(), digest_size=4).hexdigest()


def compute(spec: Spec, name: str, payload: Any) -> str:
    """What node ``name``'s handler returns for ``payload``: deterministic, small."""
    if spec.kind[name] == "switch":
        options = spec.options[name]
        return options[int(digest((name, payload)), 16) % len(options)]
    return f"{name}:{digest(payload)}"


@st.composite
def specs(draw: st.DrawFn) -> Spec:
    n = draw(st.integers(10, 25))
    topo = [f"n{i}" for i in range(n)]  # edges only go forward in this order
    kind: dict[str, str] = {}
    any_of: set[str] = set()
    required: dict[str, int] = {}
    edges: list[tuple[str, str]] = []
    for j, name in enumerate(topo):
        if j == 0 or draw(st.integers(0, 9)) == 0:
            kind[name] = "task"
            continue
        sources = sorted(set(draw(st.lists(st.integers(0, j - 1), min_size=1, max_size=3))))
        fan = len(sources)
        edges.extend((topo[s], name) for s in sources)
        choice = draw(
            st.sampled_from(["aggregate", "any_of"] if fan > 1 else ["task", "aggregate"])
        )
        if choice == "aggregate":
            kind[name] = "aggregate"
            required[name] = draw(st.integers(1, fan))
        else:
            kind[name] = "task"
            if choice == "any_of":
                any_of.add(name)
    has_out = {s for s, _ in edges}
    options: dict[str, tuple[str, ...]] = {}
    routes: dict[tuple[str, str], str | None] = {}
    for name in topo:
        if kind[name] == "task" and name in has_out and draw(st.integers(0, 2)) == 0:
            kind[name] = "switch"
            labels = set()
            for s, t in edges:
                if s == name:
                    routes[(s, t)] = draw(st.sampled_from(ROUTES))
                    labels.add(routes[(s, t)])
            extra = (NOMATCH,) if draw(st.integers(0, 7)) == 0 else ()
            options[name] = tuple(sorted(labels)) + extra
    shuffler = draw(st.randoms(use_true_random=False))
    order = list(range(n))
    shuffler.shuffle(order)
    edge_order = list(range(len(edges)))
    shuffler.shuffle(edge_order)
    delay = {name: draw(st.integers(1, 4)) for name in topo}
    return Spec(
        names=[topo[i] for i in order],
        kind=kind,
        any_of=any_of,
        required=required,
        edges=[(edges[i][0], edges[i][1], routes.get(edges[i])) for i in edge_order],
        options=options,
        delay=delay,
    )


# ---------------------------------------------------------------------------
# the reference interpreter
# ---------------------------------------------------------------------------


@dataclass
class Outcome:
    status: str  # "completed" | "stalled" | "route_error"
    culprits: list[str] = field(default_factory=list)  # stalled aggregates / failing switch
    payloads: dict[str, Any] = field(default_factory=dict)
    returned: dict[str, Any] = field(default_factory=dict)
    visits: dict[str, int] = field(default_factory=dict)
    late: list[tuple[str, str, int, str]] = field(default_factory=list)
    cancelled: set[str] = field(default_factory=set)
    message: str = ""  # the engine's error message


def reference(spec: Spec) -> Outcome:
    position = {name: i for i, name in enumerate(spec.names)}
    out = Outcome(status="completed", visits={n: 0 for n in spec.names})
    collected: dict[str, dict[str, tuple[int, Any]]] = {n: {} for n in spec.names}
    seq = 0
    ready: list[tuple[str, Any]] = []
    running: dict[str, tuple[int, Any]] = {}

    def fire(target: str, payload: Any) -> None:
        out.visits[target] += 1
        ready.append((target, payload))

    def deliver(source: str, target: str, value: Any) -> None:
        nonlocal seq
        if out.visits[target] >= 1:
            out.late.append((target, source, 1, "fired"))
            return
        if spec.kind[target] != "aggregate":
            fire(target, value)
            return
        seq += 1
        inputs = collected[target]
        inputs[source] = (seq, value)
        if len(inputs) == spec.required[target]:
            winners = sorted(inputs, key=lambda s: inputs[s][0])  # exactly k of them
            fire(target, [inputs[s][1] for s in sorted(winners, key=position.__getitem__)])
            collected[target] = {}

    now = 0
    for name in spec.entries():
        fire(name, RUN_INPUT)
    while True:
        for name, payload in ready:
            running[name] = (now + spec.delay[name], payload)
        ready.clear()
        if not running:
            break
        now = min(finish for finish, _ in running.values())
        batch = sorted((n for n, (f, _) in running.items() if f == now), key=position.__getitem__)
        for name in batch:
            payload = running.pop(name)[1]
            out.payloads[name] = payload
            result = out.returned[name] = compute(spec, name, payload)
            edges = spec.out_edges(name)
            if spec.kind[name] == "switch":
                taken = [t for t, r in edges if r == result] or [
                    t for t, r in edges if r == tr.EXIT
                ]
                if not taken:
                    if out.status != "route_error":
                        out.status, out.culprits = "route_error", [name, result]
                    continue
                value = payload
            else:
                taken, value = [t for t, _ in edges], result
            for target in taken:
                deliver(name, target, value)
        if out.status == "route_error":
            out.cancelled = set(running)
            return out
    waiting = sorted(n for n, inputs in collected.items() if inputs)
    if waiting:
        out.status, out.culprits = "stalled", waiting
    return out


# ---------------------------------------------------------------------------
# the engine, driven on the same virtual clock
# ---------------------------------------------------------------------------


class VirtualClock:
    """Holds every handler on an Event and releases them in virtual-time order."""

    def __init__(self, spec: Spec) -> None:
        self.spec = spec
        self.now = 0
        self.waiting: dict[str, tuple[int, asyncio.Event]] = {}
        self.payloads: dict[str, Any] = {}
        self.returned: dict[str, Any] = {}
        self.started: set[str] = set()
        self.finished: set[str] = set()
        self.run_started = False
        self.events: list[tr.Event] = []

    def handler(self, name: str):
        async def handle(payload: Any) -> Any:
            gate = asyncio.Event()
            self.waiting[name] = (self.now + self.spec.delay[name], gate)
            await gate.wait()
            self.payloads[name] = payload
            result = self.returned[name] = compute(self.spec, name, payload)
            return result

        return handle

    def on_event(self, event: tr.Event) -> None:
        self.events.append(event)
        if event.type is tr.EventType.RUN_STARTED:
            self.run_started = True
        elif event.type is tr.EventType.NODE_STARTED:
            assert event.node_id not in self.started, f"{event.node_id} started twice in a DAG"
            self.started.add(event.node_id)
        elif event.type in (
            tr.EventType.NODE_COMPLETED,
            tr.EventType.NODE_FAILED,
            tr.EventType.NODE_CANCELLED,
        ):
            self.finished.add(event.node_id)

    def idle(self) -> bool:
        """Every handler the engine started is parked on its gate."""
        return self.run_started and (self.started - self.finished) <= self.waiting.keys()

    async def drive(self, run: asyncio.Task) -> None:
        while not run.done():
            for _ in range(SETTLE_LIMIT):
                if run.done() or (self.idle() and self.waiting):
                    break
                await asyncio.sleep(0)
            else:
                raise AssertionError(
                    f"engine neither finished nor started anything new; waiting={sorted(self.waiting)}, "
                    f"started-but-unfinished={sorted(self.started - self.finished)}"
                )
            if run.done():
                return
            self.now = min(finish for finish, _ in self.waiting.values())
            for name in [n for n, (f, _) in self.waiting.items() if f == self.now]:
                self.waiting.pop(name)[1].set()


def build_graph(spec: Spec, clock: VirtualClock) -> tr.Graph:
    g = tr.Graph("random")
    kinds = {
        "task": tr.NodeKind.TASK,
        "switch": tr.NodeKind.SWITCH,
        "aggregate": tr.NodeKind.AGGREGATE,
    }
    for name in spec.names:
        g.add_node(
            name,
            clock.handler(name),
            kinds[spec.kind[name]],
            required=spec.required.get(name),
            any_of=name in spec.any_of,
        )
    for source, target, route in spec.edges:
        g.add_edge(source, target, route=route)
    return g


async def run_engine(spec: Spec) -> tuple[Outcome, VirtualClock, Any]:
    clock = VirtualClock(spec)
    engine = tr.Engine()
    engine.bus.subscribe(clock.on_event)
    graph = build_graph(spec, clock)
    run = asyncio.create_task(engine.run(graph, RUN_INPUT))
    try:
        await clock.drive(run)
    finally:
        if not run.done():
            run.cancel()
        await asyncio.gather(run, return_exceptions=True)
    out = Outcome(status="completed", payloads=clock.payloads, returned=clock.returned)
    ET = tr.EventType
    out.late = [
        (e.node_id, e.data["source"], e.visit, e.data["reason"])
        for e in clock.events
        if e.type is ET.NODE_LATE_INPUT
    ]
    out.cancelled = {e.node_id for e in clock.events if e.type is ET.NODE_CANCELLED}
    exc = run.exception()
    if exc is None:
        result = run.result()
        out.visits = dict(result.visits)
        return out, clock, result
    if isinstance(exc, tr.StallError):
        out.status = "stalled"
    elif isinstance(exc, tr.RouteError):
        out.status = "route_error"
    else:
        raise exc
    out.message = str(exc)
    return out, clock, None


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=specs())
def test_engine_matches_reference_interpreter(spec: Spec) -> None:
    expected = reference(spec)
    event(f"outcome: {expected.status}")
    event(f"late inputs: {min(len(expected.late), 3)}+")
    actual, clock, result = asyncio.run(run_engine(spec))

    assert actual.status == expected.status, (actual.status, expected.culprits, actual.message)
    assert actual.payloads == expected.payloads
    assert actual.returned == expected.returned
    assert actual.late == expected.late
    if expected.status == "completed":
        assert result is not None
        assert result.results == expected.returned
        assert result.visits == expected.visits
        assert [
            (i.node_id, i.source_id, i.activation, i.reason) for i in result.late_inputs
        ] == expected.late
        assert {n for n, c in result.visits.items() if c} == clock.started
    elif expected.status == "stalled":
        for name in expected.culprits:
            assert f"{name!r} has" in actual.message, actual.message
        assert actual.message.count(" has [") == len(expected.culprits), actual.message
    else:
        switch, route = expected.culprits
        assert f"switch {switch!r} returned route {route!r}" in actual.message, actual.message
        assert actual.cancelled == expected.cancelled
        last = clock.events[-1]
        assert last.type is tr.EventType.NODE_FAILED and last.node_id == switch


def test_reference_interpreter_on_a_known_graph() -> None:
    """Sanity check of the reference itself: a, b, c -> agg(required=2), c first."""
    spec = Spec(
        names=["a", "b", "c", "agg"],
        kind={"a": "task", "b": "task", "c": "task", "agg": "aggregate"},
        any_of=set(),
        required={"agg": 2},
        edges=[("a", "agg", None), ("b", "agg", None), ("c", "agg", None)],
        options={},
        delay={"a": 2, "b": 2, "c": 1, "agg": 1},
    )
    out = reference(spec)
    assert out.status == "completed"
    assert out.payloads["agg"] == [compute(spec, "a", RUN_INPUT), compute(spec, "c", RUN_INPUT)]
    assert out.late == [("agg", "b", 1, "fired")]
    engine_out, _, result = asyncio.run(run_engine(spec))
    assert engine_out.payloads == out.payloads
    assert result.late_inputs == (
        tr.LateInput(node_id="agg", source_id="b", activation=1, reason="fired"),
    )
