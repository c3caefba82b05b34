"""Child runs in one process (R1-R3, R5, R6): a graph as a node's handler.

Every test drives real runs through the public API: ``Engine.run`` on a
memory, SQLite or Postgres store; the child runs are looked up in the store
by the id R1 gives them.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import random
import string
from collections import Counter
from typing import Any

import pytest

import tailrace as tr
from tailrace._attempts import attempts_from_events, map_summaries
from tailrace.stores import RunStatus, RunStore
from tests import fixtures

each_store = fixtures.each_store
GUARD = 30.0

#: Module-level graphs, so the JSON form can name them by reference (G3).
review = tr.Graph("review")


@review.task()
async def read(doc: dict[str, Any]) -> dict[str, Any]:
    return {**doc, "read": True}


@review.task()
async def score(doc: dict[str, Any]) -> int:
    return len(doc["text"])


review.chain("read", "score")

pipeline = tr.Graph("pipeline")


@pipeline.task()
async def draft(text: str) -> dict[str, Any]:
    return {"text": text}


pipeline.add_node("reviewed", review)


@pipeline.task()
async def publish(points: int) -> str:
    return f"{points} points"


pipeline.chain("draft", "reviewed", "publish")


async def test_a_graph_as_handler_runs_a_child_run_with_its_own_id_and_parent(
    each_store: RunStore,
) -> None:
    engine = tr.Engine(store=each_store)
    result = await engine.run(pipeline, "hello", run_id="p")
    assert result.status is RunStatus.COMPLETED
    assert result.output == "5 points"
    assert result.results["reviewed"] == 5  # the child's output is the node's result
    child = await each_store.get_run("p/reviewed/1")
    assert child.parent_run_id == "p"
    assert child.graph_name == "review"
    assert child.status is RunStatus.COMPLETED
    assert [r.run_id for r in await each_store.list_runs(parent="p")] == ["p/reviewed/1"]
    # The child is a run like any other: its results are stored under its own id.
    assert {r.node_id for r in await each_store.results("p/reviewed/1")} == {"read", "score"}
    events = await each_store.events("p")
    started = [e for e in events if e.type == "node_started" and e.node_id == "reviewed"]
    assert '"child":"p/reviewed/1"' in started[0].data_json.replace(" ", "")


async def test_a_child_run_in_memory_needs_no_store() -> None:
    result = await tr.Engine().run(pipeline, "abc")
    assert result.output == "3 points"


def slow_child(durations: dict[int, float], started: Counter[int]) -> tr.Graph:
    child = tr.Graph("slow_child")

    @child.task()
    async def work(x: int) -> int:
        started[x] += 1
        await asyncio.sleep(durations.get(x, 0.0))
        return x * 10

    return child


async def test_a_map_of_graphs_keeps_the_first_k_children_and_cancels_the_late_ones(
    each_store: RunStore,
) -> None:
    started: Counter[int] = Counter()
    child = slow_child({0: 5.0, 1: 0.01, 2: 5.0, 3: 0.02, 4: 5.0}, started)
    g = tr.Graph("fan")
    g.add_node("each", child, "map", required=2, late="cancel")
    engine = tr.Engine(store=each_store)
    result = await asyncio.wait_for(engine.run(g, [0, 1, 2, 3, 4], run_id="fan"), GUARD)
    assert result.output == [10, 30]  # items 1 and 3, in item order (M3)
    assert sorted(li.item for li in result.late_inputs) == [0, 2, 4]
    children = {r.run_id: r.status for r in await each_store.list_runs(parent="fan")}
    assert children == {
        "fan/each/1/0": RunStatus.CANCELLED,
        "fan/each/1/1": RunStatus.COMPLETED,
        "fan/each/1/2": RunStatus.CANCELLED,
        "fan/each/1/3": RunStatus.COMPLETED,
        "fan/each/1/4": RunStatus.CANCELLED,
    }
    assert started == Counter({0: 1, 1: 1, 2: 1, 3: 1, 4: 1})  # each child once (R2)


async def test_a_failing_child_fails_its_node_with_the_original_exception(
    each_store: RunStore,
) -> None:
    class Broken(Exception):
        pass

    child = tr.Graph("breaks")

    @child.task()
    async def boom(x: int) -> int:
        raise Broken(f"bad {x}")

    g = tr.Graph("holds_breaking")
    g.add_node("sub", child)
    with pytest.raises(Broken, match="bad 7"):
        await tr.Engine(store=each_store).run(g, 7, run_id="f")
    assert (await each_store.get_run("f")).status is RunStatus.FAILED
    assert (await each_store.get_run("f/sub/1")).status is RunStatus.FAILED


async def test_cancelling_a_parent_cancels_its_running_child(each_store: RunStore) -> None:
    started: Counter[int] = Counter()
    g = tr.Graph("cancels")
    g.add_node("sub", slow_child({1: 60.0}, started))
    engine = tr.Engine(store=each_store)
    run = asyncio.create_task(engine.run(g, 1, run_id="c"))
    await fixtures.until(lambda: started[1] == 1, "the child's node started")
    await engine.cancel("c")
    result = await asyncio.wait_for(run, GUARD)
    assert result.status is RunStatus.CANCELLED
    assert (await each_store.get_run("c/sub/1")).status is RunStatus.CANCELLED


async def test_a_deadline_cancels_a_late_run_and_its_children(each_store: RunStore) -> None:
    started: Counter[int] = Counter()
    g = tr.Graph("late")
    g.add_node("sub", slow_child({1: 60.0}, started))
    engine = tr.Engine(store=each_store)
    deadline = datetime.timedelta(seconds=0.3)
    result = await asyncio.wait_for(engine.run(g, 1, run_id="d", deadline=deadline), GUARD)
    assert result.status is RunStatus.CANCELLED
    parent = await each_store.get_run("d")
    assert parent.deadline is not None and parent.error is not None
    assert "deadline" in parent.error
    child = await each_store.get_run("d/sub/1")
    assert child.status is RunStatus.CANCELLED
    assert child.deadline == parent.deadline  # a child inherits its parent's deadline
    events = [e for e in await each_store.events("d") if e.type == "run_cancelled"]
    assert '"reason":"deadline"' in events[0].data_json.replace(" ", "")


async def test_a_deadline_already_past_cancels_before_anything_runs() -> None:
    ran: list[int] = []
    g = tr.Graph("past")

    @g.task()
    async def step(x: int) -> int:
        ran.append(x)
        return x

    result = await tr.Engine().run(g, 1, deadline=datetime.datetime.now(datetime.UTC))
    assert result.status is RunStatus.CANCELLED
    assert ran == []


@pytest.mark.parametrize(
    "deadline",
    [float("nan"), "tomorrow", datetime.datetime(2030, 1, 1), True],
)
async def test_a_bad_deadline_is_refused_before_anything_is_stored(
    each_store: RunStore, deadline: Any
) -> None:
    with pytest.raises(ValueError, match="deadline"):
        await tr.Engine(store=each_store).run(pipeline, "x", run_id="bad", deadline=deadline)
    assert await each_store.list_runs() == []


async def test_a_child_waiting_on_a_person_suspends_its_parent_and_the_answer_resumes_both(
    each_store: RunStore,
) -> None:
    child = tr.Graph("asks")

    @child.gate()
    async def approve(x: int) -> str:
        return f"approve {x}?"

    @child.task()
    async def apply(answer: str) -> str:
        return f"applied {answer}"

    child.chain("approve", "apply")
    g = tr.Graph("waits_on_child")
    g.add_node("sub", child)

    @g.task()
    async def after(text: str) -> str:
        return text.upper()

    g.chain("sub", "after")
    engine = tr.Engine(store=each_store)
    result = await asyncio.wait_for(engine.run(g, 3, run_id="q"), GUARD)
    assert result.status is RunStatus.SUSPENDED
    # R5: the child's question is listed for its parent.
    assert [q.run_id for q in result.questions] == ["q/sub/1"]
    assert result.questions[0].node_id == "approve"
    await engine.answer(result.questions[0].question_id, "yes")
    assert (await each_store.get_run("q/sub/1")).status is RunStatus.COMPLETED
    parent = await each_store.get_run("q")
    assert parent.status is RunStatus.COMPLETED  # resumed after its child, by the answerer
    final = await engine.wait("q", graph=g)
    assert final.output == "APPLIED YES"


def test_a_child_node_refuses_per_attempt_options() -> None:
    g = tr.Graph("refuses")
    for option, value in (
        ("retry", tr.RetryPolicy()),
        ("timeout", 1.0),
        ("hedge", True),
        ("executor", "ray"),
    ):
        with pytest.raises(tr.GraphError, match=f"node 'n': {option}= does not apply"):
            g.add_node("n", review, **{option: value})
    with pytest.raises(tr.GraphError, match="only tasks and maps take a Graph"):
        g.add_node("n", review, "gate")
    with pytest.raises(tr.GraphError, match="late='park' does not apply to child runs"):
        g.add_node("n", review, "map", late="park")
    with pytest.raises(tr.GraphError, match="queue= applies to nodes whose handler is a Graph"):
        g.add_node("n", lambda x: x, queue="q")
    with pytest.raises(tr.GraphError, match="cannot run itself"):
        g.add_node("n", g)
    assert g.nodes == {}  # nothing was added by a refused call


def test_a_cycle_of_graphs_is_refused_at_compile() -> None:
    a, b = tr.Graph("a"), tr.Graph("b")
    a.add_node("to_b", b)
    b.add_node("to_a", a)
    with pytest.raises(tr.GraphError, match="cycle of graphs"):
        a.compile()


def test_the_json_form_names_a_child_graph_by_reference() -> None:
    doc = pipeline.to_dict()
    node = next(n for n in doc["nodes"] if n["id"] == "reviewed")
    assert node["handler"] == "tests.engine.test_children:review"
    again = tr.Graph.from_dict(doc)
    assert again.nodes["reviewed"].handler is review
    assert again.fingerprint() == pipeline.fingerprint()
    assert again.structure()["children"] == {"reviewed": {"graph": "review", "queue": None}}


async def test_children_on_a_queue_need_a_store() -> None:
    g = tr.Graph("queued_in_memory")
    g.add_node("sub", review, queue="kids")
    with pytest.raises(tr.GraphError, match="need an engine with a store"):
        await tr.Engine().run(g, {"text": "x"})


async def test_a_parent_resumed_after_a_stop_reattaches_to_its_child(
    each_store: RunStore,
) -> None:
    """R2 in process: the parent's task is cancelled mid-child (a worker letting go);
    resuming the parent drives the same child on from where it stopped."""
    calls: Counter[str] = Counter()
    hold = asyncio.Event()
    child = tr.Graph("two_steps")

    @child.task()
    async def first(x: int) -> int:
        calls["first"] += 1
        return x + 1

    @child.task()
    async def second(x: int) -> int:
        calls["second"] += 1
        await hold.wait()
        return x * 2

    child.chain("first", "second")
    g = tr.Graph("reattaches")
    g.add_node("sub", child)
    run = asyncio.create_task(tr.Engine(store=each_store).run(g, 1, run_id="r2"))
    await fixtures.until(lambda: calls["second"] == 1, "the child's second step started")
    await fixtures.until(
        lambda: _committed(each_store, "r2/sub/1", "first"), "the child's first step committed"
    )
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    hold.set()
    result = await asyncio.wait_for(tr.Engine(store=each_store).resume("r2", g), GUARD)
    assert result.output == 4
    assert calls == Counter({"first": 1, "second": 2})  # the child's committed step kept
    assert [r.run_id for r in await each_store.list_runs(parent="r2")] == ["r2/sub/1"]


async def _committed(store: RunStore, run_id: str, node_id: str) -> bool:
    try:
        return any(r.node_id == node_id for r in await store.results(run_id))
    except tr.RunNotFound:
        return False


async def test_a_late_child_that_completed_before_its_cancel_is_late_fired_not_cancelled(
    each_store: RunStore,
) -> None:
    """Children 3-5 commit their end, then their parent's attempts are held (in the look at
    the parent that follows a child's end) until the map decides on items 0-2 and cancels
    them: each late item's reason then matches its child run's status, in every view."""
    go = asyncio.Event()
    child = tr.Graph("quick")

    @child.task()
    async def work(x: int) -> int:
        if x < 3:
            await go.wait()  # the first three end only once the other three are held
        return x * 10

    g = tr.Graph("holds_late")
    g.add_node("each", child, "map", required=3, late="cancel")
    held: list[str] = []
    get_run = each_store.get_run

    async def held_get_run(run_id: str) -> Any:
        task = asyncio.current_task()
        if run_id == "hl" and task is not None and task.get_name() == "each" and len(held) < 3:
            held.append(run_id)  # a child's end is committed; its parent's attempt waits here
            await asyncio.Event().wait()  # until the map cancels it
        return await get_run(run_id)

    each_store.get_run = held_get_run  # type: ignore[method-assign]
    engine = tr.Engine(store=each_store)
    run = asyncio.create_task(engine.run(g, [0, 1, 2, 3, 4, 5], run_id="hl"))
    await fixtures.until(lambda: len(held) == 3, "three children ended and were held")
    go.set()
    result = await asyncio.wait_for(run, GUARD)
    assert result.output == [0, 10, 20]
    children = {r.run_id: r.status for r in await each_store.list_runs(parent="hl")}
    assert all(children[f"hl/each/1/{j}"] is RunStatus.COMPLETED for j in range(6)), children
    late = {li.item: li.reason for li in result.late_inputs}
    assert late == {3: "fired", 4: "fired", 5: "fired"}
    events = await each_store.events("hl")
    cancelled = [e for e in events if e.type == "node_cancelled"]
    assert cancelled == []
    logged = [json.loads(e.data_json) for e in events if e.type == "node_late_input"]
    assert {d["item"]: d["reason"] for d in logged} == late and len(logged) == 3
    (summary,) = map_summaries(events, attempts_from_events(events))
    assert (summary.completed, summary.late, summary.cancelled) == (3, 3, 0)


async def test_a_late_child_input_that_completed_before_its_cancel_is_late_fired_not_cancelled(
    each_store: RunStore,
) -> None:
    """Child ``slow`` commits its end, then its parent's attempt is held (in the look at the
    parent that follows a child's end) until ``first`` fires on ``fast`` and cancels it: the
    late input's reason then matches its child run's status, in every view (E5, R3)."""
    go = asyncio.Event()
    child = tr.Graph("quick")

    @child.task()
    async def work(x: int) -> int:
        if x == 0:
            await go.wait()  # fast's child ends only once slow's attempt is held
        return x * 10

    g = tr.Graph("holds_late_input")

    @g.task()
    def start(x: int) -> int:
        return x

    g.add_node("fast", lambda x: 0)
    g.add_node("fast_child", child)
    g.add_node("slow", child)

    @g.aggregate(required=1, late="cancel")
    def first(xs: list[int]) -> int:
        return xs[0]

    g.chain("start", "fast", "fast_child", "first")
    g.chain("start", "slow", "first")
    held: list[str] = []
    get_run = each_store.get_run

    async def held_get_run(run_id: str) -> Any:
        task = asyncio.current_task()
        if run_id == "hi" and task is not None and task.get_name() == "slow" and not held:
            held.append(run_id)  # slow's child's end is committed; its attempt waits here
            await asyncio.Event().wait()  # until first fires and cancels it
        return await get_run(run_id)

    each_store.get_run = held_get_run  # type: ignore[method-assign]
    engine = tr.Engine(store=each_store)
    run = asyncio.create_task(engine.run(g, 1, run_id="hi"))
    await fixtures.until(lambda: bool(held), "slow's child ended and was held")
    go.set()
    result = await asyncio.wait_for(run, GUARD)
    assert result.output == 0
    children = {r.run_id: r.status for r in await each_store.list_runs(parent="hi")}
    assert children["hi/slow/1"] is RunStatus.COMPLETED, children
    late = [(li.node_id, li.source_id, li.activation, li.reason) for li in result.late_inputs]
    assert late == [("first", "slow", 1, "fired")]
    assert result.nodes["slow"].status is tr.NodeStatus.COMPLETED
    assert result.results["slow"] == 10
    events = await each_store.events("hi")
    assert [e for e in events if e.type == "node_cancelled"] == []
    logged = [json.loads(e.data_json) for e in events if e.type == "node_late_input"]
    assert [(d["source"], d["reason"]) for d in logged] == [("slow", "fired")]


# --- child ids: their own namespace, bounded like run ids (R1) -------------------------------

echo = tr.Graph("echo")
echo.add_node("same", lambda value: value)


async def test_a_run_id_shaped_like_a_child_runs_id_is_refused_so_the_parent_owns_it(
    each_store: RunStore,
) -> None:
    """A run the user names ``victim/kid/1`` would take the id of run ``victim``'s child at
    node ``kid``: it is refused, naming it, by run, submit and fork alike, and ``victim``'s
    child gets its id."""
    engine = tr.Engine(store=each_store)
    victim = tr.Graph("victim")
    victim.add_node("kid", echo)
    for refused in ("victim/kid/1", "victim/kid/1/0", "a/b/c/kid/12"):
        with pytest.raises(ValueError, match="child run") as caught:
            await engine.run(echo, 1, run_id=refused)
        assert repr(refused) in str(caught.value)
    with pytest.raises(ValueError, match="'victim/kid/1'"):
        await engine.submit(echo, 1, run_id="victim/kid/1", queue="q")
    await engine.run(echo, 1, run_id="source")
    with pytest.raises(ValueError, match="'victim/kid/1'"):
        await engine.fork("source", at="same", fork_id="victim/kid/1")
    for allowed in ("HumanEval/0", "reports/2024/q1", "a/b/c", "a/1/2/3"):
        assert (await engine.run(echo, 2, run_id=allowed)).output == 2
    assert (await engine.run(victim, 7, run_id="victim")).output == 7
    assert [r.run_id for r in await each_store.list_runs(parent="victim")] == ["victim/kid/1"]


async def test_a_child_node_named_like_a_maps_item_gets_a_child_id_of_its_own(
    each_store: RunStore,
) -> None:
    """Node ``b/1`` (a child node) and item 1 of map ``b`` both ran ``.../b/1/1``: each child
    id now names one node, visit and item (a ``/`` or ``%`` in a node id is escaped)."""
    g = tr.Graph("slashes")
    g.add_node("plan", lambda n: list(range(n)))
    g.add_node("b", echo, "map")
    g.add_node("b/1", echo)
    g.add_node("7", echo)  # a node id of digits alone
    g.add_node("50%", echo)
    for node in ("b", "b/1", "7", "50%"):
        g.add_edge("plan", node)
    result = await tr.Engine(store=each_store).run(g, 2, run_id="p")
    assert result.status is RunStatus.COMPLETED
    assert result.results == {
        "plan": [0, 1], "b": [0, 1], "b/1": [0, 1], "7": [0, 1], "50%": [0, 1]
    }  # fmt: skip
    ids = sorted(r.run_id for r in await each_store.list_runs(parent="p"))
    assert ids == ["p/%37/1", "p/50%25/1", "p/b%2F1/1", "p/b/1/0", "p/b/1/1"]


def test_a_node_id_no_store_can_key_on_is_refused_as_the_graph_is_built() -> None:
    """G1: a 3,000-character node id (Postgres refused its rows, and the run was left
    running) is refused by ``add_node``, naming the node and the bound."""
    node = "".join(random.Random(37).choices(string.ascii_letters, k=3000))
    g = tr.Graph("long")
    with pytest.raises(tr.GraphError, match="at most 200") as caught:
        g.add_node(node, echo)
    assert node[:40] in str(caught.value) and "3000 characters" in str(caught.value)
    g.add_node(node[:200], echo)  # the longest node id is taken


async def test_a_child_id_longer_than_a_run_id_fails_its_node_naming_node_and_run(
    each_store: RunStore,
) -> None:
    """R1: a child's id is bounded like a run id (512 characters). A long node id under a
    long parent fails that node with an error naming node and run, on every store alike;
    the parent ends failed (never left running) and no child is stored."""
    # Text that does not compress: Postgres refuses such a key sooner than a repeated letter.
    node = "".join(random.Random(37).choices(string.ascii_letters, k=200))
    g = tr.Graph("long")
    g.add_node(node, echo)
    parent = "p" * 500
    engine = tr.Engine(store=each_store)
    with pytest.raises(ValueError, match="child run") as caught:
        await engine.run(g, 1, run_id=parent)
    message = str(caught.value).replace("'", "")
    assert f"run {parent[:20]}" in message and f"node {node[:20]}" in message
    assert "703 characters" in message and "at most 512" in message
    record = await each_store.get_run(parent)
    assert record.status is RunStatus.FAILED
    assert await each_store.list_runs(parent=parent) == []
