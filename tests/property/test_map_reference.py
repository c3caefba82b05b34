"""The engine's map nodes agree with a sequential reference interpreter (M1-M5, M7).

Hypothesis draws a map: the item count, a duration per item in virtual time
units (ties are common), which items fail, ``required`` (a count or none),
``errors``, ``late`` and the engine's capacity. The engine's item handlers do
not sleep: each waits on its own ``asyncio.Event``, and a driver releases,
whenever the engine is idle, every waiting item whose virtual finish time is
the earliest, so simultaneous finishes complete in one harvest. The reference
below simulates the same clock directly from the contract:

- items are admitted in item order (fifo), as many as the capacity allows; a
  finishing item frees its slot once it is recorded (and a decision it makes
  is taken), before the next finishing item of its batch is looked at, and
  the next queued item starts at that moment;
- a batch of simultaneous finishes is processed in item order (M7);
- the map is decided at its k-th success (or, for ``errors="skip"`` without
  ``required``, once no item is open), its output the k earliest successes
  in item order (M3); a failure with ``errors="fail"`` before the decision
  fails the run; with ``"skip"`` the map fails once fewer than k can still
  succeed (M4);
- at the decision, ``late="cancel"`` cancels every unfinished item (late,
  ``cancelled``, in item order); ``late="record"`` lets them finish and
  records each success as late (``fired``) as it happens (M5).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import tailrace as tr
from tailrace import current_node

SETTLE_LIMIT = 20_000


class Boom(Exception):
    pass


@dataclass
class MapSpec:
    delays: list[int]
    failing: set[int]
    required: int | None
    errors: str
    late: str
    capacity: int | None


@st.composite
def map_specs(draw: st.DrawFn) -> MapSpec:
    n = draw(st.integers(0, 16))
    delays = draw(st.lists(st.integers(1, 4), min_size=n, max_size=n))
    failing = set(draw(st.lists(st.integers(0, max(n - 1, 0)), max_size=3))) if n else set()
    errors = draw(st.sampled_from(["fail", "skip"]))
    required = draw(st.none() | st.integers(1, max(n, 1))) if n else None
    return MapSpec(
        delays=delays,
        failing=failing,
        required=required,
        errors=errors,
        late=draw(st.sampled_from(["record", "cancel"])),
        capacity=draw(st.none() | st.integers(1, 4)),
    )


@dataclass
class Outcome:
    status: str  # "completed" | "failed" (an item's error) | "map_error" (M4)
    output: list[int] | None = None
    late: list[tuple[int, str]] = field(default_factory=list)
    ran: set[int] = field(default_factory=set)


def value(j: int) -> int:
    return j * 7 + 1


def reference(spec: MapSpec) -> Outcome:
    n = len(spec.delays)
    if n == 0:
        return Outcome("completed", [])
    skip = spec.errors == "skip"
    k = None if (spec.required is None and skip) else (spec.required or n)
    out = Outcome("completed")
    queue = list(range(n))
    running: dict[int, int] = {}  # item -> finish time
    succeeded: list[int] = []  # in completion order
    failed = 0
    open_items = n
    decided = False
    now = 0
    capacity = spec.capacity or n

    def admit() -> None:
        while queue and len(running) < capacity:
            j = queue.pop(0)
            running[j] = now + spec.delays[j]
            out.ran.add(j)

    def decide() -> None:
        nonlocal decided
        decided = True
        winners = succeeded if k is None else succeeded[:k]
        out.output = [value(j) for j in sorted(winners)]
        if spec.late == "cancel":
            for j in sorted([*running, *queue]):
                out.late.append((j, "cancelled"))
            running.clear()
            queue.clear()

    def process(j: int) -> str | None:
        """Item ``j`` finished now: record it; the run's end status if it ends here."""
        nonlocal failed, open_items
        open_items -= 1
        if j in spec.failing:
            failed += 1
            if decided:
                return None
            if not skip:
                return "failed"
            if (k is None and open_items == 0 and not succeeded) or (
                k is not None and len(succeeded) + open_items < k
            ):
                return "map_error"
            if k is None and open_items == 0:
                decide()
            return None
        if decided:
            out.late.append((j, "fired"))
            return None
        succeeded.append(j)
        if (k is not None and len(succeeded) >= k) or (k is None and open_items == 0):
            decide()
        return None

    admit()
    while running:
        now = min(running.values())
        batch = sorted(j for j, f in running.items() if f == now)
        for j in batch:
            if j not in running:
                continue  # cancelled by a decision earlier in this batch
            del running[j]
            ended = process(j)
            if ended is not None:
                out.status = ended
                return out
            admit()  # its slot goes to the next queued item once it is recorded
    return out


class VirtualClock:
    """Holds every item on an Event and releases them in virtual-time order."""

    def __init__(self, spec: MapSpec) -> None:
        self.spec = spec
        self.now = 0
        self.waiting: dict[int, tuple[int, asyncio.Event]] = {}
        self.started: set[int] = set()
        self.finished: set[int] = set()
        self.expanded = False

    async def handler(self, x: int) -> int:
        ctx = current_node()
        assert ctx is not None and ctx.item is not None
        j = ctx.item
        gate = asyncio.Event()
        self.waiting[j] = (self.now + self.spec.delays[j], gate)
        await gate.wait()
        if j in self.spec.failing:
            raise Boom(f"item {j}")
        return value(j)

    def on_event(self, e: tr.Event) -> None:
        if e.node_id != "each":
            return
        item = e.data.get("item")
        if e.type is tr.EventType.NODE_STARTED:
            if item is None:
                self.expanded = True
            else:
                assert item not in self.started, f"item {item} started twice"
                self.started.add(item)
        elif item is not None and e.type in (
            tr.EventType.NODE_COMPLETED,
            tr.EventType.NODE_FAILED,
            tr.EventType.NODE_CANCELLED,
        ):
            self.finished.add(item)
            self.waiting.pop(item, None)

    def idle(self) -> bool:
        return self.expanded and (self.started - self.finished) <= self.waiting.keys()

    async def drive(self, run: asyncio.Task[Any]) -> None:
        while not run.done():
            for _ in range(SETTLE_LIMIT):
                if run.done() or (self.idle() and self.waiting):
                    break
                await asyncio.sleep(0)
            else:
                raise AssertionError(f"stuck: waiting={sorted(self.waiting)}")
            if run.done():
                return
            self.now = min(finish for finish, _ in self.waiting.values())
            for j in [j for j, (f, _) in self.waiting.items() if f == self.now]:
                self.waiting.pop(j)[1].set()


async def run_engine(spec: MapSpec) -> tuple[Outcome, VirtualClock]:
    clock = VirtualClock(spec)
    g = tr.Graph("map_reference")

    @g.task()
    def items(n: int) -> list[int]:
        return list(range(n))

    g.add_node(
        "each",
        clock.handler,
        "map",
        required=spec.required,
        errors=spec.errors,
        late=spec.late,
    )
    g.add_edge("items", "each")
    engine = tr.Engine(capacity=spec.capacity)
    engine.bus.subscribe(clock.on_event)
    run = asyncio.create_task(engine.run(g, len(spec.delays)))
    try:
        await clock.drive(run)
    finally:
        if not run.done():
            run.cancel()
        await asyncio.gather(run, return_exceptions=True)
    exc = run.exception()
    if isinstance(exc, Boom):
        return Outcome("failed", ran=clock.started), clock
    if isinstance(exc, tr.MapError):
        return Outcome("map_error", ran=clock.started), clock
    if exc is not None:
        raise exc
    result = run.result()
    late = [(x.item, x.reason) for x in result.late_inputs]
    assert all(x.item is not None for x in result.late_inputs)
    assert engine.slots is None or engine.slots.in_use == 0
    return Outcome("completed", result.output, late, clock.started), clock


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=map_specs())
def test_engine_maps_match_the_reference(spec: MapSpec) -> None:
    expected = reference(spec)
    event(f"outcome: {expected.status}")
    event(f"late: {spec.late}, {min(len(expected.late), 3)}+")
    actual, _clock = asyncio.run(run_engine(spec))
    assert actual.status == expected.status
    if expected.status == "completed":
        assert actual.output == expected.output
        assert actual.late == expected.late
    if expected.status == "completed":  # the same items ran: queued ones cancelled never start
        assert actual.ran == expected.ran


def test_the_reference_itself_on_a_known_map() -> None:
    spec = MapSpec(
        delays=[3, 1, 2, 1], failing={3}, required=2, errors="skip", late="record", capacity=None
    )
    out = reference(spec)
    assert out.status == "completed"
    assert out.output == [value(1), value(2)]  # 1 at t=1, 3 fails at t=1, 2 at t=2
    assert out.late == [(0, "fired")]
    actual, _ = asyncio.run(run_engine(spec))
    assert (actual.status, actual.output, actual.late) == (out.status, out.output, out.late)
