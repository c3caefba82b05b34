"""Child runs on the dashboard (R1): parent links, the children table, the tree, the runs filter.

Runs are made by the real engine on a real SQLite file: a parent whose node
runs a graph that itself runs a graph (a grandchild), and a map of a graph
(one child per item), through ``Engine.run``; a parent on a queue whose child
waits on another queue through ``Engine.submit`` and a :class:`~tailrace.Worker`
serving the parent's queue only (the parent suspends, its child stays queued).
"""

from __future__ import annotations

import asyncio
import html
import json
import re
import threading

import pytest

import tailrace as tr
from tailrace.stores import RunStatus
from tailrace.ui._layout import layout, shape_of_graph
from tailrace.ui._links import run_url, runs_url
from tests.ui.support import Factory, dashboard, scenarios, submit_and_work

leaf = tr.Graph("leaf")


@leaf.task()
async def finish(x: object) -> str:
    return f"leaf {x}"


middle = tr.Graph("middle")


@middle.task()
async def prepare(x: object) -> object:
    return x


middle.add_node("deeper", leaf)
middle.add_edge("prepare", "deeper")

top = tr.Graph("top")


@top.task()
async def split(x: object) -> list[int]:
    return [1, 2, 3]


top.add_node("sub", middle)
top.add_node("each", leaf, kind="map")
top.add_edge("split", "sub")
top.add_edge("split", "each")

fleet_child = tr.Graph("fleet_child")


@fleet_child.task()
async def work(x: object) -> str:
    return f"worked {x}"


fleet_parent = tr.Graph("fleet_parent")
fleet_parent.add_node("delegate", fleet_child, queue="kids")


def make_tree(factory: Factory, run_id: str) -> None:
    async def run() -> None:
        async with scenarios.opened(factory) as store:
            result = await tr.Engine(store=store).run(top, "go", run_id=run_id)
            assert result.status is RunStatus.COMPLETED

    asyncio.run(run())


def suspend_on_a_queued_child(factory: Factory, run_id: str) -> None:
    submit_and_work(
        factory, fleet_parent, run_id, queues=["parents"], graphs=[fleet_parent],
        until=RunStatus.SUSPENDED,
    )  # fmt: skip


def section(page: str, element_id: str) -> str:
    """The HTML of the element with ``element_id`` up to the next card (enough to search in)."""
    start = page.index(f'id="{element_id}"')
    return page[start : page.find('<section class="card"', start + 1)]


def child_rows(page: str) -> list[list[str]]:
    """The children table's rows as cell texts, the whole child id (its link's title) first."""
    table = section(page, "child-runs")
    rows = []
    for row in re.findall(r'<tr class="child-row">(.*?)</tr>', table):
        cells = re.findall(r"<td[^>]*>(.*?)</td>", row)
        title = re.search(r'title="([^"]*)"', cells[0])
        assert title is not None, row
        texts = [html.unescape(re.sub(r"<[^>]+>", "", cell)).strip() for cell in cells[1:]]
        rows.append([html.unescape(title.group(1)), *texts])
    return rows


def test_a_parent_lists_its_children_by_node_and_item_and_shows_the_tree(
    sqlite_db: Factory,
) -> None:
    make_tree(sqlite_db, "p1")
    with dashboard(sqlite_db) as client:
        page = client.get(run_url("p1")).text
    assert child_rows(page) == [
        ["p1/each/1/0", "each", "1", "0", "leaf", "", "completed"],
        ["p1/each/1/1", "each", "1", "1", "leaf", "", "completed"],
        ["p1/each/1/2", "each", "1", "2", "leaf", "", "completed"],
        ["p1/sub/1", "sub", "1", "", "middle", "", "completed"],
    ]
    assert 'title="p1/each/1/2">…/each/1/2</a>' in section(
        page, "child-runs"
    )  # shown after the parent's id
    for child in ("p1/each/1/0", "p1/sub/1", "p1/sub/1/deeper/1"):
        assert f'href="{run_url(child)}"' in page
    tree = section(page, "run-tree")
    # The grandchild sits in a list nested inside its parent's item.
    nested = re.search(
        r'title="p1/sub/1">…/sub/1</a>.*?<ul class="run-tree">.*?'
        r'title="p1/sub/1/deeper/1">…/deeper/1</a>',
        tree,
        re.S,
    )
    assert nested is not None, tree
    assert "and " not in tree  # nothing left out
    assert f'href="{runs_url(parent="p1")}"' in page
    assert 'id="parent-run"' not in page  # a top-level run has no parent


def test_a_child_links_its_parent_and_every_ancestor(sqlite_db: Factory) -> None:
    make_tree(sqlite_db, "p1")
    with dashboard(sqlite_db) as client:
        grandchild = client.get(run_url("p1/sub/1/deeper/1")).text
        item = client.get(run_url("p1/each/1/2")).text
    crumbs = section(grandchild, "crumbs")
    assert crumbs.index(f'href="{run_url("p1")}"') < crumbs.index(f'href="{run_url("p1/sub/1")}"')
    parent = section(grandchild, "parent-run")
    assert f'href="{run_url("p1/sub/1")}"' in parent and "deeper#1" in parent
    assert "each#1[2]" in section(item, "parent-run")
    assert 'id="children"' not in item  # a child without children of its own lists none


def test_the_graph_marks_the_nodes_that_run_child_runs_with_their_graph_and_queue(
    sqlite_db: Factory,
) -> None:
    make_tree(sqlite_db, "p1")
    suspend_on_a_queued_child(sqlite_db, "boss")
    with dashboard(sqlite_db) as client:
        tree_page = client.get(run_url("p1")).text
        fleet_page = client.get(run_url("boss")).text
    found = re.findall(r'<g class="node ([^"]*)" data-node="([^"]*)"', tree_page)
    marked = {node: classes.split() for classes, node in found}
    assert "child" not in marked["split"]
    assert "child" in marked["sub"] and "child" in marked["each"]
    assert 'data-node="sub" data-child-graph="middle"' in tree_page
    assert "runs graph leaf as a child run per item in its parent's process" in tree_page
    assert (
        'data-node="delegate" data-child-graph="fleet_child" data-child-queue="kids"' in fleet_page
    )
    assert "⤷ fleet_child@kids" in fleet_page
    assert "runs graph fleet_child as a child run on queue kids" in fleet_page


def test_the_drawing_of_a_graph_at_hand_marks_child_nodes_too() -> None:
    drawing = layout(shape_of_graph(top), {})
    child = {n.id: n.child for n in drawing.nodes}
    assert child["split"] is None
    assert child["sub"] is not None and child["sub"].graph == "middle"
    assert child["each"] is not None and child["each"].queue is None
    fleet = {n.id: n for n in layout(shape_of_graph(fleet_parent), {}).nodes}
    assert fleet["delegate"].child is not None and fleet["delegate"].child.queue == "kids"
    assert "⤷ fleet_child@kids" in fleet["delegate"].meta


def test_a_suspended_parent_lists_its_queued_child(sqlite_db: Factory) -> None:
    suspend_on_a_queued_child(sqlite_db, "boss")
    with dashboard(sqlite_db) as client:
        page = client.get(run_url("boss")).text
        child = client.get(run_url("boss/delegate/1")).text
    assert child_rows(page) == [
        ["boss/delegate/1", "delegate", "1", "", "fleet_child", "kids", "queued"]
    ]
    assert 'class="pill big s-suspended"' in page
    assert f'href="{run_url("boss")}"' in section(child, "parent-run")


def test_the_runs_list_filters_by_parent_and_links_each_childs_parent(sqlite_db: Factory) -> None:
    make_tree(sqlite_db, "p1")
    make_tree(sqlite_db, "p2")
    with dashboard(sqlite_db) as client:
        everything = client.get(runs_url()).text
        children = client.get(runs_url(parent="p1")).text
        queued = client.get(runs_url("queued", parent="p1")).text
        refused = client.get("/runs?parent=a%00b")
    assert "<th>parent</th>" in everything
    assert (
        everything.count('class="parent-link"') == 10
    )  # 5 descendants each: 4 children, 1 grandchild
    listed = [
        html.unescape(m)
        for m in re.findall(r'<td class="mono id"><a href="[^"]*" title="([^"]*)"', children)
    ]
    assert sorted(listed) == ["p1/each/1/0", "p1/each/1/1", "p1/each/1/2", "p1/sub/1"]
    assert children.count(f'class="parent-link" href="{run_url("p1")}"') == 4
    assert "4 runs · child runs of" in children
    chip = html.escape(runs_url("completed", parent="p1"))
    assert f'href="{chip}"' in children  # the chips keep the filter
    assert "No runs with status <b>queued</b>" in queued and "child runs of" in queued
    assert refused.status_code == 400


def test_the_tree_stops_at_its_limit_and_says_how_many_more(
    sqlite_db: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("tailrace.ui._children.TREE_LIMIT", 2)
    make_tree(sqlite_db, "p1")
    with dashboard(sqlite_db) as client:
        page = client.get(run_url("p1")).text
    assert len(child_rows(page)) == 2
    assert "and 2 more: " in section(page, "children")
    tree = section(page, "run-tree")
    assert tree.count("<li><a") == 2 and "and 2 more</li>" in tree
    assert "2 left out" in page


def test_hostile_run_ids_are_text_on_every_page_that_shows_a_child(sqlite_db: Factory) -> None:
    hostile = scenarios.HOSTILE
    make_tree(sqlite_db, hostile)
    escaped = html.escape(hostile, quote=False)
    with dashboard(sqlite_db) as client:
        pages = [
            client.get(run_url(hostile)).text,
            client.get(run_url(f"{hostile}/each/1/1")).text,
            client.get(run_url(f"{hostile}/sub/1/deeper/1")).text,
            client.get(runs_url()).text,
            client.get(runs_url(parent=hostile)).text,
        ]
    for page in pages:
        assert "<script>window.__pwned" not in page and "<img src=x" not in page
        assert escaped[:40] in page
    titles = re.findall(r'<td class="mono id"><a href="[^"]*" title="([^"]*)"', pages[0])
    assert [html.unescape(t) for t in titles][3] == f"{hostile}/sub/1"
    assert f'href="{run_url(hostile)}"' in section(pages[1], "parent-run")


def test_a_suspended_parents_page_updates_live_when_its_child_changes(
    sqlite_db: Factory,
) -> None:
    suspend_on_a_queued_child(sqlite_db, "boss")
    got_it = threading.Event()

    def cancel(run_id: str) -> None:
        async def go() -> None:
            async with scenarios.opened(sqlite_db) as store:
                await tr.Engine(store=store).cancel(run_id)

        asyncio.run(go())

    def change_the_child() -> None:
        cancel("boss/delegate/1")  # the parent itself writes no event for this
        if not got_it.wait(scenarios.GUARD):  # no update came: end the stream, fail the test
            cancel("boss")

    with dashboard(sqlite_db, poll_interval=0.02) as client:
        with client.stream("GET", "/stream/runs/boss") as stream:
            lines = (line for line in stream.iter_lines() if line.startswith("data: "))
            first = json.loads(next(lines).removeprefix("data: "))
            changer = threading.Thread(target=change_the_child)
            changer.start()
            second = json.loads(next(lines).removeprefix("data: "))
            got_it.set()
        changer.join()
    assert "s-queued" in first["parts"]["run-children"]
    assert second["status"] != "cancelled"  # the parent goes on: the update is the child's
    assert "s-cancelled" in second["parts"]["run-children"]
    assert "boss/delegate/1" in second["parts"]["run-children"]
