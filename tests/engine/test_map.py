"""Map nodes (M1-M5, M7): a handler per item of a list known only at run time.

Every test goes through the public API: ``@g.map``, ``Engine.run``, ``RunResult``,
events on the bus and ``current_node()``. Handlers wait on events rather than
sleeping wherever the completion order is what the test is about.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import tailrace as tr
from tailrace import MapError, current_node
from tailrace.stores import RunStore
from tailrace.tail import TailHooks
from tests import fixtures

each_store = fixtures.each_store  # the fixture: each backend in turn, on a fresh database

GUARD = 10.0  # seconds; only there so that a bug fails the test instead of hanging it


def fan(
    handler: Any, *, sink: bool = True, source: Any = None, **options: Any
) -> tuple[tr.Graph, list[Any]]:
    """``items -> each (map) [-> done]``; ``items`` returns the run input unless ``source``."""
    g = tr.Graph("fan")
    seen: list[Any] = []

    @g.task()
    def items(x: Any) -> Any:
        return x if source is None else source(x)

    g.add_node("each", handler, "map", **options)
    g.add_edge("items", "each")
    if sink:

        @g.task()
        def done(results: list[Any]) -> list[Any]:
            seen.append(results)
            return results

        g.add_edge("each", "done")
    return g, seen


class Gates:
    """One ``asyncio.Event`` per item: a test releases items in the order it wants."""

    def __init__(self, n: int) -> None:
        self.events = [asyncio.Event() for _ in range(n)]
        self.started: list[int] = []
        self.cancelled: list[int] = []

    async def handler(self, x: int) -> int:
        ctx = current_node()
        assert ctx is not None and ctx.item is not None
        self.started.append(ctx.item)
        try:
            await self.events[ctx.item].wait()
        except asyncio.CancelledError:
            self.cancelled.append(ctx.item)
            raise
        return x * 10

    def release(self, *items: int) -> None:
        for j in items:
            self.events[j].set()


async def until_started(gates: Gates, count: int) -> None:
    await fixtures.until(lambda: len(gates.started) >= count, f"{count} items started")


# -- M1: one attempt per item; the input must be a list ---------------------------------


async def test_a_map_runs_its_handler_once_per_item_and_outputs_the_results_in_item_order() -> None:
    calls: list[tuple[int, int | None]] = []

    async def double(x: int) -> int:
        ctx = current_node()
        assert ctx is not None
        calls.append((x, ctx.item))
        await asyncio.sleep(0.001 * (5 - x))  # later items finish first
        return 2 * x

    g, seen = fan(double)
    result = await tr.Engine().run(g, [0, 1, 2, 3, 4])
    assert result.status == "completed"
    assert result.results["each"] == [0, 2, 4, 6, 8]
    assert seen == [[0, 2, 4, 6, 8]]
    assert sorted(calls) == [(x, x) for x in range(5)]


async def test_current_node_names_the_map_visit_and_item() -> None:
    contexts: list[tr.NodeContext] = []

    def look(x: str) -> str:
        ctx = current_node()
        assert ctx is not None
        contexts.append(ctx)
        return x

    g, _ = fan(look, sink=False)
    result = await tr.Engine().run(g, ["a", "b"])
    assert sorted((c.node_id, c.visit, c.attempt, c.item) for c in contexts) == [
        ("each", 1, 1, 0),
        ("each", 1, 1, 1),
    ]
    assert all(c.run_id == result.run_id for c in contexts)


async def test_a_tuple_is_a_list_in_memory() -> None:
    g, _ = fan(lambda x: x + 1, sink=False, source=tuple)
    result = await tr.Engine().run(g, [1, 2])
    assert result.output == [2, 3]


@pytest.mark.parametrize(("bad", "type_name"), [("abc", "str"), ({"a": 1}, "dict"), (3, "int")])
async def test_an_input_that_is_not_a_list_fails_the_node_naming_it_and_the_type(
    bad: Any, type_name: str
) -> None:
    g, seen = fan(lambda x: x)
    with pytest.raises(MapError, match=rf"map 'each': its input must be a list, got {type_name}"):
        await tr.Engine().run(g, bad)
    assert seen == []


async def test_a_generator_into_a_map_fails_the_map_naming_it_and_the_type() -> None:
    g, seen = fan(lambda x: x, source=lambda x: (n for n in range(x)))
    with pytest.raises(MapError, match=r"map 'each': its input must be a list, got generator"):
        await tr.Engine().run(g, 3)
    assert seen == []


def test_late_park_on_a_map_without_required_is_refused_naming_the_map() -> None:
    g = tr.Graph("park")
    with pytest.raises(tr.GraphError, match=r"map 'each': late='park' .* give it required="):
        g.add_node("each", lambda x: x, "map", late="park")
    with pytest.raises(tr.GraphError, match=r"map 'skip': late='park'"):
        g.add_node("skip", lambda x: x, "map", late="park", errors="skip")
    assert g.add_node("kept", lambda x: x, "map", late="park", required=1).late == "park"


def test_an_aggregate_that_parks_late_inputs_refuses_a_map_input_naming_both() -> None:
    g = tr.Graph("agg-park")
    g.add_node("start", lambda x: x)
    g.add_node("each", lambda x: x, "map")
    g.add_node("other", lambda x: x)
    g.add_node("first", lambda xs: xs, "aggregate", required=1, late="park")
    for source, target in (("start", "each"), ("start", "other"), ("each", "first"),
                           ("other", "first")):  # fmt: skip
        g.add_edge(source, target)
    with pytest.raises(
        tr.GraphError, match=r"aggregate 'first': late='park' cannot park map 'each'"
    ):
        g.validate()


async def test_more_items_than_max_items_fails_naming_the_count() -> None:
    g, _ = fan(lambda x: x, max_items=3)
    with pytest.raises(MapError, match=r"map 'each': 4 items exceed its max_items=3"):
        await tr.Engine().run(g, [1, 2, 3, 4])


async def test_the_default_max_items_is_ten_thousand() -> None:
    g, _ = fan(lambda x: x, sink=False)
    with pytest.raises(MapError, match="10001 items exceed its max_items=10000"):
        await tr.Engine().run(g, list(range(10_001)))


async def test_an_empty_list_yields_an_empty_list_at_once() -> None:
    calls: list[int] = []
    g, seen = fan(calls.append, required=3)
    result = await tr.Engine().run(g, [])
    assert result.results["each"] == [] and seen == [[]] and calls == []


async def test_a_map_failure_at_dispatch_cancels_its_siblings_and_fails_the_run() -> None:
    g = tr.Graph("siblings")

    @g.task()
    def start(x: Any) -> Any:
        return x

    @g.task()
    async def slow(x: Any) -> None:
        await asyncio.sleep(GUARD)

    g.add_node("each", lambda x: x, "map")
    g.add_edge("start", "slow")
    g.add_edge("start", "each")
    events: list[tr.Event] = []
    bus = tr.EventBus()
    bus.subscribe(events.append)
    async with asyncio.timeout(GUARD):
        with pytest.raises(MapError, match="got str"):
            await tr.Engine(bus=bus).run(g, "not a list")
    tail = [(e.type.value, e.node_id) for e in events[-2:]]
    assert tail == [("node_cancelled", "slow"), ("node_failed", "each")]  # E9: NODE_FAILED last


# -- M2: items are attempts: admitted, retried, timed out, hedged, evented ------------------


async def test_capacity_counts_items_and_fifo_keeps_item_order() -> None:
    running = 0
    peak = 0
    order: list[int] = []

    async def item(x: int) -> int:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        order.append(x)
        await asyncio.sleep(0.001)
        running -= 1
        return x

    g, _ = fan(item, sink=False)
    result = await tr.Engine(capacity=2).run(g, list(range(8)))
    assert result.output == list(range(8))
    assert peak == 2
    assert order == list(range(8))


async def test_priority_admission_puts_a_prioritised_node_before_the_items() -> None:
    order: list[str] = []
    g = tr.Graph("prio")

    @g.task()
    def start(x: Any) -> Any:
        return x

    async def item(x: int) -> int:
        order.append(f"item{x}")
        await asyncio.sleep(0)
        return x

    @g.task(priority=5)
    async def urgent(x: Any) -> str:
        order.append("urgent")
        return "u"

    g.add_node("each", item, "map")
    g.add_edge("start", "each")
    g.add_edge("start", "urgent")
    await tr.Engine(capacity=1, admission="priority").run(g, [0, 1, 2])
    assert order[0] == "urgent"
    assert order[1:] == ["item0", "item1", "item2"]


async def test_lpt_admits_the_longest_items_first_by_their_cost() -> None:
    order: list[int] = []

    async def item(x: int) -> int:
        order.append(x)
        await asyncio.sleep(0)
        return x

    g, _ = fan(item, sink=False, cost=lambda x: float(x))
    result = await tr.Engine(capacity=1, admission="lpt").run(g, [3, 9, 1, 7])
    assert order == [9, 7, 3, 1]
    assert result.output == [3, 9, 1, 7]  # the output stays in item order


async def test_retries_apply_per_item_and_every_try_is_an_event() -> None:
    tries: dict[int, int] = {}

    def flaky(x: int) -> int:
        tries[x] = tries.get(x, 0) + 1
        if x == 1 and tries[x] < 3:
            raise ConnectionError(f"item {x} try {tries[x]}")
        return x

    events: list[tr.Event] = []
    bus = tr.EventBus()
    bus.subscribe(events.append)
    g, _ = fan(flaky, sink=False, retry=tr.RetryPolicy(attempts=3))
    result = await tr.Engine(bus=bus).run(g, [0, 1, 2])
    assert result.output == [0, 1, 2]
    assert tries == {0: 1, 1: 3, 2: 1}
    retrying = [(e.attempt, e.data["item"]) for e in events if e.type == "node_retrying"]
    assert retrying == [(1, 1), (2, 1)]
    completed = [
        (e.data["item"], e.attempt)
        for e in events
        if e.type == "node_completed" and "item" in e.data
    ]
    assert sorted(completed) == [(0, 1), (1, 3), (2, 1)]


async def test_a_timeout_applies_per_item() -> None:
    async def item(x: int) -> int:
        if x == 2:
            await asyncio.sleep(GUARD)
        return x

    g, _ = fan(item, sink=False, timeout=0.05, errors="skip")
    result = await tr.Engine().run(g, [0, 1, 2, 3])
    assert result.output == [0, 1, 3]


async def test_every_item_event_carries_its_item_index() -> None:
    events: list[tr.Event] = []
    bus = tr.EventBus()
    bus.subscribe(events.append)
    g, _ = fan(lambda x: x, sink=False)
    await tr.Engine(bus=bus).run(g, ["a", "b", "c"])
    mine = [e for e in events if e.node_id == "each"]
    started = [e.data.get("item") for e in mine if e.type == "node_started"]
    assert started == [None, 0, 1, 2]  # the map's own start, then one per item
    assert mine[0].data == {"items": 3}
    done = [e for e in mine if e.type == "node_completed"]
    assert [e.data.get("item") for e in done] == [0, 1, 2, None]
    assert done[-1].data["winners"] == [0, 1, 2] and done[-1].data["k"] == 3


async def test_hedging_applies_per_item_and_the_backup_wins_a_stalled_item() -> None:
    stalled = asyncio.Event()
    calls: list[tuple[int, int]] = []

    async def item(x: int) -> int:
        ctx = current_node()
        assert ctx is not None and ctx.item is not None
        calls.append((ctx.item, ctx.attempt))
        first = sum(1 for j, _ in calls if j == ctx.item) == 1
        if x == 3 and first:
            await stalled.wait()  # the first attempt of item 3 stalls; its backup does not
        await asyncio.sleep(0.01)
        return x

    g, _ = fan(item, sink=False, hedge=True, cost=1.0)
    engine = tr.Engine(tail=TailHooks(factor=2.0, min_samples=1))
    async with asyncio.timeout(GUARD):
        # Teach the estimator the item time: map items observe it like nodes (T1).
        await engine.run(g, [0, 1, 2])
        calls.clear()
        result = await engine.run(g, [0, 1, 2, 3, 4])
    assert result.output == [0, 1, 2, 3, 4]
    assert result.hedges == 1 and result.stragglers >= 1
    assert sorted(j for j, _ in calls).count(3) == 2  # item 3 ran twice: its first and its backup


# -- M3: required=k, the k earliest in item order, decided once ----------------------------


async def test_required_k_completes_at_the_kth_success_with_the_earliest_in_item_order() -> None:
    gates = Gates(5)
    g, seen = fan(gates.handler, required=2)
    task = asyncio.create_task(tr.Engine().run(g, [0, 1, 2, 3, 4]))
    await until_started(gates, 5)
    gates.release(4)
    await asyncio.sleep(0.01)
    gates.release(1)
    await asyncio.sleep(0.01)
    assert seen == [[10, 40]]  # decided at the 2nd success, in item order
    gates.release(0, 2, 3)  # late="record": the others run on and are recorded late
    async with asyncio.timeout(GUARD):
        result = await task
    assert result.results["each"] == [10, 40]
    assert [(x.item, x.reason) for x in result.late_inputs] == [
        (0, "fired"),
        (2, "fired"),
        (3, "fired"),
    ]
    assert all(x.node_id == x.source_id == "each" and x.activation == 1 for x in result.late_inputs)


async def test_required_may_be_a_function_of_the_item_count() -> None:
    g, _ = fan(lambda x: x, sink=False, required=lambda n: n // 2)
    result = await tr.Engine().run(g, list(range(9)))
    assert len(result.output) == 4


async def test_same_batch_ties_go_by_item_order() -> None:
    gates = Gates(4)
    g, seen = fan(gates.handler, required=2)
    task = asyncio.create_task(tr.Engine().run(g, [0, 1, 2, 3]))
    await until_started(gates, 4)
    gates.release(3, 2, 1)  # three finish in one harvest: the two lowest items win
    await asyncio.sleep(0.01)
    async with asyncio.timeout(GUARD):
        gates.release(0)
        result = await task
    assert result.results["each"] == [10, 20]
    assert seen == [[10, 20]]


@pytest.mark.parametrize(("required", "message"), [(5, "required=5 is outside 1..3")])
async def test_k_above_the_item_count_fails_naming_node_k_and_count(
    required: int, message: str
) -> None:
    g, _ = fan(lambda x: x, required=required)
    with pytest.raises(MapError, match=rf"map 'each': {message} \(its item count\)"):
        await tr.Engine().run(g, [1, 2, 3])


async def test_a_required_function_returning_zero_is_refused_naming_the_count() -> None:
    g, _ = fan(lambda x: x, required=lambda n: n // 10)
    with pytest.raises(MapError, match=r"required=0 is outside 1..5"):
        await tr.Engine().run(g, [1, 2, 3, 4, 5])


async def test_a_required_function_that_raises_fails_the_node_naming_it() -> None:
    def broken(n: int) -> int:
        raise RuntimeError("no quorum today")

    g, _ = fan(lambda x: x, required=broken)
    with pytest.raises(MapError, match=r"map 'each': required\(2\) raised RuntimeError"):
        await tr.Engine().run(g, [1, 2])


# -- M4: errors="fail" | "skip" ------------------------------------------------------------


async def test_an_item_error_fails_the_node_and_the_run_with_the_original_exception() -> None:
    class Boom(Exception):
        pass

    cancelled: list[int] = []

    async def item(x: int) -> int:
        if x == 1:
            raise Boom("item one")
        try:
            await asyncio.sleep(GUARD)
        except asyncio.CancelledError:
            cancelled.append(x)
            raise
        return x

    g, _ = fan(item)
    with pytest.raises(Boom, match="item one"):
        await tr.Engine().run(g, [0, 1, 2])
    assert sorted(cancelled) == [0, 2]  # E9: the siblings are cancelled and awaited


async def test_skip_records_failed_items_and_decides_over_the_others() -> None:
    def item(x: int) -> int:
        if x % 2:
            raise ValueError(f"odd {x}")
        return x

    events: list[tr.Event] = []
    bus = tr.EventBus()
    bus.subscribe(events.append, tr.EventType.NODE_FAILED)
    g, _ = fan(item, errors="skip", required=2)
    result = await tr.Engine(bus=bus).run(g, [1, 2, 3, 4])
    assert result.results["each"] == [2, 4]
    failed = sorted((e.data["item"], e.data["error"]) for e in events)
    assert failed == [(0, "ValueError: odd 1"), (2, "ValueError: odd 3")]


async def test_skip_without_required_keeps_every_item_that_succeeds() -> None:
    def item(x: int) -> int:
        if x == 2:
            raise ValueError("two")
        return x

    g, _ = fan(item, sink=False, errors="skip")
    assert (await tr.Engine().run(g, [0, 1, 2, 3])).output == [0, 1, 3]


async def test_skip_fails_the_node_when_fewer_than_k_can_still_succeed_listing_the_errors() -> None:
    def item(x: int) -> int:
        if x < 3:
            raise ValueError(f"bad {x}")
        return x

    g, _ = fan(item, errors="skip", required=3)
    with pytest.raises(MapError) as caught:
        await tr.Engine().run(g, [0, 1, 2, 3, 4])
    message = str(caught.value)
    assert "map 'each': 3 of 5 items failed, so fewer than k=3 can still succeed" in message
    assert "item 0: ValueError: bad 0" in message and "item 2: ValueError: bad 2" in message
    assert caught.value.errors == {
        0: "ValueError: bad 0",
        1: "ValueError: bad 1",
        2: "ValueError: bad 2",
    }


async def test_skip_with_every_item_failing_fails_the_node() -> None:
    def item(x: int) -> int:
        raise ValueError("never")

    g, _ = fan(item, sink=False, errors="skip")
    with pytest.raises(MapError, match="2 of 2 items failed"):
        await tr.Engine().run(g, [0, 1])


# -- M5: late items: record or cancel ------------------------------------------------------


async def test_late_cancel_cancels_running_and_queued_items_and_returns_at_the_decision() -> None:
    gates = Gates(6)
    g, seen = fan(gates.handler, required=2, late="cancel")
    engine = tr.Engine(capacity=4)  # items 4 and 5 wait for a slot
    task = asyncio.create_task(engine.run(g, list(range(6))))
    await until_started(gates, 4)
    gates.release(2, 0)
    async with asyncio.timeout(GUARD):  # with "record" this run would wait for the rest
        result = await task
    assert result.results["each"] == [0, 20]
    # Every item that started and did not win was cancelled and awaited (an item
    # may start in the slot a winner freed earlier in the deciding harvest).
    assert sorted(gates.cancelled) == sorted(set(gates.started) - {0, 2})
    assert {1, 3} <= set(gates.cancelled)
    late = [(x.item, x.reason) for x in result.late_inputs]
    assert late == [(1, "cancelled"), (3, "cancelled"), (4, "cancelled"), (5, "cancelled")]
    assert engine.slots is not None and engine.slots.in_use == 0  # every slot came back
    assert seen == [[0, 20]]


async def test_late_record_waits_for_the_late_items_and_records_their_results() -> None:
    gates = Gates(3)
    events: list[tr.Event] = []
    bus = tr.EventBus()
    bus.subscribe(events.append, tr.EventType.NODE_LATE_INPUT)
    g, seen = fan(gates.handler, required=1)
    task = asyncio.create_task(tr.Engine(bus=bus).run(g, [0, 1, 2]))
    await until_started(gates, 3)
    gates.release(1)
    await asyncio.sleep(0.01)
    assert seen == [[10]] and not task.done()  # decided; the late items still run
    gates.release(0, 2)
    async with asyncio.timeout(GUARD):
        result = await task
    assert [(x.item, x.reason) for x in result.late_inputs] == [(0, "fired"), (2, "fired")]
    assert [(e.data["item"], e.data["reason"]) for e in events] == [(0, "fired"), (2, "fired")]


async def test_late_must_be_one_of_the_policies_and_resume_parked_applies_to_maps() -> None:
    g = tr.Graph("policies")
    with pytest.raises(tr.GraphError, match="late must be 'record' or 'cancel' or 'park'"):
        g.add_node("each", lambda x: x, "map", late="later")
    with pytest.raises(tr.GraphError, match="resume_parked= applies to maps only"):
        g.add_node("task", lambda x: x, resume_parked=True)


# -- G1 and G3: every option is checked and survives the JSON form ---------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"errors": "ignore"}, "errors must be 'fail' or 'skip'"),
        ({"max_items": 0}, "max_items must be an integer >= 1"),
        ({"required": 0}, "required=0 must be >= 1"),
        ({"required": "two"}, "required must be an integer"),
        ({"any_of": True}, "a map takes one input list; it cannot be any_of"),
    ],
)
def test_bad_map_options_are_refused_naming_the_node(options: dict[str, Any], message: str) -> None:
    g = tr.Graph("bad")
    with pytest.raises(tr.GraphError, match=message) as caught:
        g.add_node("each", lambda x: x, "map", **options)
    assert "'each'" in str(caught.value)


@pytest.mark.parametrize(
    ("kind", "options", "message"),
    [
        ("task", {"errors": "skip"}, "errors= applies to maps only"),
        ("task", {"max_items": 5}, "max_items= applies to maps only"),
        ("task", {"late": "cancel"}, "late= applies to aggregates and maps only"),
        ("aggregate", {"required": len}, "required= must be an integer"),
    ],
)
def test_map_options_on_other_kinds_are_refused(
    kind: str, options: dict[str, Any], message: str
) -> None:
    g = tr.Graph("bad")
    with pytest.raises(tr.GraphError, match=message):
        g.add_node("n", lambda x: x, kind, **options)


def half(n: int) -> int:
    """A module-level ``required`` function, so the JSON form can name it."""
    return max(1, n // 2)


def item_cost(x: Any) -> float:
    return 1.0


def identity(x: Any) -> Any:
    return x


def test_the_json_form_round_trips_every_map_option() -> None:
    g = tr.Graph("json")
    g.add_node("start", identity)
    g.add_node(
        "each",
        identity,
        "map",
        required=half,
        late="cancel",
        errors="skip",
        max_items=50,
        cost=item_cost,
        hedge=True,
        retry=tr.RetryPolicy(attempts=2),
        timeout=3.0,
    )
    g.add_edge("start", "each")
    doc = g.to_dict()
    each = doc["nodes"][1]
    assert each["kind"] == "map"
    assert each["required"] == {"ref": f"{__name__}:half"}
    assert (each["late"], each["errors"], each["max_items"]) == ("cancel", "skip", 50)
    back = tr.Graph.from_dict(doc)
    assert back.to_json() == g.to_json()
    assert back.fingerprint() == g.fingerprint()
    assert back.nodes["each"].quorum(10) == 5


def test_a_maps_fingerprint_depends_on_its_required() -> None:
    def graph(required: Any) -> tr.Graph:
        g = tr.Graph("fp")
        g.add_node("start", identity)
        g.add_node("each", identity, "map", required=required)
        g.add_edge("start", "each")
        return g

    assert graph(2).fingerprint() != graph(3).fingerprint()
    assert graph(half).fingerprint() != graph(2).fingerprint()


def test_a_map_declared_with_the_decorator_is_a_map() -> None:
    g = tr.Graph("decorated")

    @g.map(required=2, late="cancel", max_items=10)
    def each(x: int) -> int:
        return x

    node = g.nodes["each"]
    assert (node.kind, node.required, node.late, node.max_items) == ("map", 2, "cancel", 10)


# -- M7 and the store: durable values, determinism ------------------------------------------


async def test_a_durable_map_reads_back_json_values_and_stores_one_row_per_item(
    each_store: RunStore,
) -> None:
    g, _ = fan(lambda x: {"x": x, "pair": (x, x)}, sink=False)
    engine = tr.Engine(store=each_store)
    result = await engine.run(g, [1, 2])
    assert result.output == [{"x": 1, "pair": [1, 1]}, {"x": 2, "pair": [2, 2]}]
    stored = await each_store.load_run(result.run_id)
    assert [(r.node_id, r.visit, r.item, r.status) for r in stored.items] == [
        ("each", 1, 0, "completed"),
        ("each", 1, 1, "completed"),
    ]
    again = await engine.wait(result.run_id)  # read back from the store (D3)
    assert again.output == result.output


async def test_a_map_inside_a_loop_gets_fresh_items_each_visit(each_store: RunStore) -> None:
    g = tr.Graph("loop")

    @g.task()
    def seed(n: int) -> dict[str, Any]:
        return {"round": 0, "xs": list(range(n))}

    @g.task(max_visits=3)
    def plan(state: dict[str, Any]) -> list[int]:
        return [x + state["round"] for x in state["xs"]]

    @g.map(required=2, max_visits=3)
    def score(x: int) -> int:
        return x * x

    @g.switch(max_visits=3)
    def again(scores: list[int]) -> str:
        return "more" if scores[0] < 4 else "stop"

    @g.task(max_visits=3)
    def bump(scores: list[int]) -> dict[str, Any]:
        return {"round": scores[0] + 1, "xs": [0, 1, 2]}

    @g.task()
    def final(scores: list[int]) -> list[int]:
        return scores

    g.add_node("merge", lambda x: x, any_of=True, max_visits=4)
    g.add_edge("seed", "merge")
    g.add_edge("merge", "plan")
    g.chain("plan", "score", "again")
    g.add_edge("again", "bump", route="more")
    g.add_edge("again", "final", route="stop")
    g.add_edge("bump", "merge")
    result = await tr.Engine(store=each_store).run(g, 3)
    assert result.status == "completed"
    assert result.visits["score"] >= 2
    stored = await each_store.load_run(result.run_id)
    visits = sorted({r.visit for r in stored.items})
    assert visits == list(range(1, result.visits["score"] + 1))


# -- Q7: M-of-N approvals ---------------------------------------------------------------------


def approvals(required: int, late: str = "cancel") -> tr.Graph:
    g = tr.Graph("approvals")

    @g.task()
    def change(x: str) -> str:
        return x

    for who in ("alice", "bob", "carol"):

        def ask(change: str, who: str = who) -> str:
            return f"{who}: approve {change}?"

        ask.__name__ = ask.__qualname__ = who
        g.add_node(who, ask, "gate")
        g.add_edge("change", who)

    @g.aggregate(required=required, late=late)
    def decision(answers: list[Any]) -> list[Any]:
        return answers

    for who in ("alice", "bob", "carol"):
        g.add_edge(who, "decision")
    return g


async def test_two_of_three_approvals_complete_the_run_and_withdraw_the_third_question(
    each_store: RunStore,
) -> None:
    engine = tr.Engine(store=each_store)
    g = approvals(2)
    engine.register(g)
    first = await engine.run(g, "deploy v2")
    assert first.status == "suspended"
    by_node = {q.node_id: q.question_id for q in first.questions}
    assert sorted(by_node) == ["alice", "bob", "carol"]
    after_one = await engine.answer(by_node["carol"], "yes")
    assert after_one is not None and after_one.status == "suspended"
    done = await engine.answer(by_node["alice"], "yes")
    assert done is not None and done.status == "completed"
    assert done.results["decision"] == ["yes", "yes"]
    assert done.nodes["bob"].status == "cancelled"
    assert [(x.node_id, x.source_id, x.reason) for x in done.late_inputs] == [
        ("decision", "bob", "cancelled")
    ]
    bob = await each_store.get_question(by_node["bob"])
    assert bob.status == "superseded"
    with pytest.raises(tr.AlreadyAnswered, match="superseded: it was withdrawn"):
        await engine.answer(by_node["bob"], "yes")
    assert (await each_store.get_question(by_node["bob"])).answer_json is None


async def test_with_late_record_the_run_still_waits_for_the_third_answer(
    each_store: RunStore,
) -> None:
    engine = tr.Engine(store=each_store)
    g = approvals(2, late="record")
    first = await engine.run(g, "deploy")
    by_node = {q.node_id: q.question_id for q in first.questions}
    await engine.answer(by_node["alice"], "yes")
    second = await engine.answer(by_node["bob"], "no")
    assert second is not None and second.status == "suspended"
    assert [q.node_id for q in second.questions] == ["carol"]
    last = await engine.answer(by_node["carol"], "yes")
    assert last is not None and last.status == "completed"
