"""The dashboard says what happened, not something that looks like it (issue 37, finding 12).

Real runs on real SQLite files, the app under TestClient with its lifespan
running: a parent that suspended to wait for its child runs is drawn
suspended, never "cut by a crash"; parked map items have a mark of their own
(counted, drawn and streamed as parked, not cancelled or discarded); a page
rendered before its run changed gets the changed buttons and fork forms from
its live stream; the runs list shows each run's version, what it was forked
from, and hides child runs when asked; a stretch being driven now runs until
now; a version says which file and attribute it is.
"""

from __future__ import annotations

import asyncio
import html
import json
import re
import time
from pathlib import Path
from typing import Any

import tailrace as tr
from tailrace._attempts import attempts_from_events
from tailrace.cli._load import load_graphs
from tailrace.core import make_owner
from tailrace.stores import EventRow, Harvest, NewRun, RunStatus, RunStore
from tailrace.ui._links import run_url, runs_url
from tests.ui.support import TOKEN, Background, Factory, dashboard, scenarios, submit_and_work
from tests.ui.test_children import fleet_child, fleet_parent, make_tree, suspend_on_a_queued_child
from tests.ui.test_hardening import cut, held
from tests.ui.test_versions_view import Chain, completed_chain, run_on


def section(page: str, element_id: str) -> str:
    """The HTML from the element with ``element_id`` to the end of its first table (or 4,000 chars)."""
    start = page.index(f'id="{element_id}"')
    end = page.find("</table>", start)
    return page[start : end if end > 0 else start + 4000]


def page_data(page: str) -> Any:
    """The JSON the page hands its script (the live stream's address)."""
    found = re.search(r'id="page-data">(.*?)</script>', page, re.S)
    assert found is not None
    return json.loads(found.group(1))


def bar_classes(page: str) -> list[str]:
    """The outcome class of every Gantt bar on the page, in order."""
    return re.findall(r'<g class="bar o-([a-z]+)', page)


# -- a parent waiting on its children -----------------------------------------------------------


def parent_waits_then_completes(factory: Factory, run_id: str) -> None:
    """``fleet_parent`` on queue ``parents`` with its child on ``kids``: it suspends, then ends."""
    submit_and_work(
        factory, fleet_parent, run_id, queues=["parents", "kids"],
        graphs=[fleet_parent, fleet_child], until=RunStatus.COMPLETED,
    )  # fmt: skip

    async def types() -> list[str]:
        async with scenarios.opened(factory) as store:
            return [e.type for e in await store.events(run_id)]

    seen = asyncio.run(types())
    assert "run_suspended" in seen and "run_resumed" in seen  # it did wait suspended


def test_a_parent_that_suspended_for_its_children_is_drawn_suspended_not_cut(
    sqlite_db: Factory,
) -> None:
    parent_waits_then_completes(sqlite_db, "boss-done")
    suspend_on_a_queued_child(sqlite_db, "boss-waiting")
    with dashboard(sqlite_db) as client:
        done = client.get(run_url("boss-done")).text
        waiting = client.get(run_url("boss-waiting")).text
    for page in (done, waiting):
        assert "cut" not in bar_classes(page), bar_classes(page)
        assert "cut by a crash" not in section(page, "run-gantt")
        assert bar_classes(page).count("suspended") == 1
        assert "suspended for its child runs" in section(page, "run-gantt")  # the legend
    # The wait ends when the child's end woke the parent; the re-attached node completes.
    assert bar_classes(done) == ["suspended", "children", "completed"]
    # Still waiting: the wait runs until now.
    assert bar_classes(waiting) == ["suspended", "children"]
    assert "waiting for its child runs" in section(waiting, "run-gantt")


def test_the_timeline_of_a_suspension_for_children_shows_the_wait_between_the_attempts() -> None:
    def ev(seq: int, type: str, ts: float, node: str | None = None, attempt: int = 1,
           **data: Any) -> EventRow:  # fmt: skip
        return EventRow(seq=seq, type=type, node_id=node, visit=1 if node else None,
                        attempt=attempt if node else None, ts=ts, data_json=json.dumps(data))  # fmt: skip

    events = [
        ev(1, "run_started", 0.0),
        ev(2, "node_started", 1.0, "delegate", child="p/delegate/1"),
        ev(3, "run_suspended", 1.5, reason="children", children=["p/delegate/1"]),
        ev(4, "run_resumed", 9.0),
        ev(5, "node_started", 9.0, "delegate", attempt=2, child="p/delegate/1"),
        ev(6, "node_completed", 9.5, "delegate", attempt=2),
        ev(7, "run_completed", 9.5),
    ]
    shape = [
        (a.label, a.attempt, a.start, a.end, a.outcome.value)
        for a in attempts_from_events(events, live=False)
    ]
    assert shape == [
        ("delegate#1", 1, 1.0, 1.5, "suspended"),
        ("delegate#1", None, 1.5, 9.0, "children"),
        ("delegate#1", 2, 9.0, 9.5, "completed"),
    ]
    # A parent cancelled while it waits: its wait ends there, nothing is cut.
    cancelled = [*events[:3], ev(4, "run_cancelled", 4.0)]
    assert [
        (a.start, a.end, a.outcome.value) for a in attempts_from_events(cancelled, live=False)
    ] == [(1.0, 1.5, "suspended"), (1.5, 4.0, "cancelled")]


# -- parked items ------------------------------------------------------------------------------


def parking_graph() -> tr.Graph:
    """Four items streaming a line each; two kept, the two slow ones parked with a checkpoint."""
    g = tr.Graph("parking_view")

    @g.task()
    def prompts(n: int) -> list[int]:
        return list(range(n))

    async def roll(x: int) -> int:
        ctx = tr.current_node(required=True)
        ctx.stream(f"item {x} says <b>hi</b>")
        ctx.checkpoint(x)
        if x >= 2:
            await asyncio.Event().wait()  # parked when the first two are in
        return x

    g.add_node("roll", roll, "map", required=2, late="park")
    g.chain("prompts", "roll")
    return g


def test_parked_items_are_counted_drawn_and_streamed_as_parked(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"

    async def park() -> None:
        async with scenarios.opened(scenarios.sqlite_factory(path)) as store:
            result = await tr.Engine(store=store).run(parking_graph(), 4, run_id="parking")
            assert [(x.item, x.reason) for x in result.late_inputs] == [
                (2, "parked"),
                (3, "parked"),
            ]

    asyncio.run(park())
    with dashboard(scenarios.sqlite_factory(path)) as client:
        page = client.get(run_url("parking")).text
    maps = section(page, "run-maps")
    header = re.findall(r"<th[^>]*>([^<]*)</th>", maps)
    row = [re.sub(r"<[^>]+>", "", c) for c in re.findall(r"<td[^>]*>(.*?)</td>", maps)]
    cells = dict(zip(header, row, strict=True))
    assert (cells["parked"], cells["cancelled"], cells["completed"]) == ("2", "0", "2")
    assert bar_classes(page).count("parked") == 2 and "cancelled" not in bar_classes(page)
    assert "parked (continues next round)" in section(page, "run-gantt")  # its legend entry
    streams = page[page.index('id="run-streams"') :]
    streams = streams[: streams.index("</section>")]
    assert streams.count("stream-card stream-parked") == 2
    assert "stream-discarded" not in streams and "discarded" not in streams
    assert streams.count("stream-card stream-accepted") == 2
    assert "item 2 says &lt;b&gt;hi&lt;/b&gt;" in streams  # its text, as text


# -- a page rendered before its run changed ----------------------------------------------------


def test_a_page_rendered_while_its_run_ran_gets_the_buttons_and_fork_forms_it_ended_with(
    sqlite_db: Factory,
) -> None:
    """The page shows Cancel and one fork form while the run runs; the run then ends before the
    page's stream starts. The stream sends the actions and the versions part as they are now."""
    gates = scenarios.Gates("step1", "step2")
    live = scenarios.live_graph(gates, 2)

    async def drive() -> tr.RunResult:
        async with scenarios.opened(sqlite_db) as store:
            return await tr.Engine(store=store).run(live, "go", run_id="changed")

    async def started() -> bool:
        async with scenarios.opened(sqlite_db) as store:
            return await scenarios.started(store, "changed", "step1")

    run = Background(drive)
    with dashboard(sqlite_db, graphs=[live]) as client:
        client.post("/login", data={"token": TOKEN})
        deadline = time.monotonic() + scenarios.GUARD
        while not asyncio.run(started()):
            assert time.monotonic() < deadline, "step1 never started"
            time.sleep(0.02)
        page = client.get(run_url("changed")).text
        assert "Cancel run" in section(page, "run-actions")
        assert page.count("Fork from here</button>") == 1  # step1 runs: only it can be forked
        data = page_data(page)
        gates.release("step1")
        gates.release("step2")
        assert run.join().status is RunStatus.COMPLETED
        parts: dict[str, str] = {}
        with client.stream("GET", data["stream"]) as stream:
            for line in stream.iter_lines():
                if line.startswith("data: "):
                    parts.update(json.loads(line.removeprefix("data: ")).get("parts", {}))
    assert "run-actions" in parts and "Cancel run" not in parts["run-actions"]
    assert "run-versions" in parts
    assert "No node has run yet" not in parts["run-versions"]
    assert parts["run-versions"].count("Fork from here</button>") == 2  # step1 and step2 ran


def test_a_page_whose_run_did_not_change_gets_no_actions_or_versions_resent(
    sqlite_db: Factory,
) -> None:
    cut(sqlite_db, "steady")
    held(sqlite_db, "steady")  # running, held by a live process: its page streams
    with dashboard(sqlite_db, graphs=[scenarios.cut]) as client:
        client.post("/login", data={"token": TOKEN})
        page = client.get(run_url("steady")).text
        assert "Cancel run" in section(page, "run-actions") and "Fork from here" in page
        with client.stream("GET", page_data(page)["stream"]) as stream:
            update = next(line for line in stream.iter_lines() if line.startswith("data: "))
    parts = json.loads(update.removeprefix("data: "))["parts"]
    assert "run-header" in parts  # the first update sends what changes every second
    assert "run-actions" not in parts and "run-versions" not in parts  # the forms stay put


# -- the runs list -------------------------------------------------------------------------------


def test_the_runs_list_shows_versions_forks_and_hides_child_runs_when_asked(
    sqlite_db: Factory,
) -> None:
    make_tree(sqlite_db, "p1")  # p1 and 5 descendants
    chain = Chain()
    completed_chain(sqlite_db, chain, "source")

    async def fork(store: RunStore) -> None:
        result = await tr.Engine(store=store).fork(
            "source", at="b", graph=chain.graph, fork_id="fk"
        )
        assert result.status is RunStatus.COMPLETED

    run_on(sqlite_db, fork)
    with dashboard(sqlite_db) as client:
        everything = client.get(runs_url()).text
        top = client.get("/runs?children=hide").text
        top_done = client.get("/runs?children=hide&status=completed").text
    heads = re.findall(r"<th[^>]*>([^<]*)</th>", everything)
    assert "version" in heads and "forked from" in heads
    row = everything[everything.index('title="fk"') :]
    row = row[: row.index("</tr>")]
    assert chain.graph.fingerprint()[:8] in row
    assert f'href="{run_url("source")}"' in row and ">b<" in row  # the source run and its node
    listed = re.findall(r'<td class="mono id"><a href="[^"]*" title="([^"]*)"', top)
    assert sorted(html.unescape(t) for t in listed) == ["fk", "p1", "source"]
    assert "3 runs" in top and "child runs hidden" in top
    assert 'id="hide-children"' in everything and 'id="show-children"' in top  # the toggle
    chip = re.search(
        r'<a class="chip chip-completed on[^"]*" href="([^"]*)">.*?<b>(\d+)</b>', top_done, re.S
    )
    assert chip is not None and chip.group(2) == "3"  # counted without the child runs
    assert "children=hide" in html.unescape(chip.group(1))  # the chips keep it hidden
    completed = re.search(
        r'<a class="chip chip-completed[^"]*" href="[^"]*">.*?<b>(\d+)</b>', everything, re.S
    )
    assert completed is not None and completed.group(1) == "8"  # 3 runs and 5 descendants


# -- who drives it now -------------------------------------------------------------------------


def test_a_stretch_being_driven_now_runs_until_now(sqlite_db: Factory) -> None:
    now = time.time()
    owner = make_owner()

    async def make(store: RunStore) -> None:
        await store.create_run(
            NewRun(run_id="driving", graph_name="g", graph_ref=None, fingerprint="fp",
                   input_json="null", created_at=now - 90)
        )  # fmt: skip
        token = await store.acquire_lease("driving", owner, 300.0)
        opened = [
            EventRow(seq=1, type="run_started", node_id=None, visit=None, attempt=None,
                     ts=now - 80, data_json=json.dumps({"owner": "host:7:1:ab"})),
            EventRow(seq=2, type="run_resumed", node_id=None, visit=None, attempt=None,
                     ts=now - 40, data_json=json.dumps({"owner": owner})),
        ]  # fmt: skip
        await store.commit("driving", token, Harvest(state_json="{}", events=opened))

    run_on(sqlite_db, make)
    with dashboard(sqlite_db) as client:
        page = client.get(run_url("driving")).text
    drivers = section(page, "run-drivers")
    rows = re.findall(r"<tr>(.*?)</tr>", drivers, re.S)[1:]
    assert len(rows) == 2
    assert "0.0 ms" not in rows[1]
    seconds = re.search(r'<td class="num">(\d+) s', rows[1])
    assert seconds is not None and int(seconds.group(1)) >= 40, rows[1]
    assert "driving now" in rows[1] and "driving now" not in rows[0]


# -- versions by file and attribute --------------------------------------------------------------

FLOW = """
import tailrace as tr

async def step(x):
    return x

flow = tr.Graph("flow")
flow.add_node("a", step)
flow.add_node("b", step)
flow.add_edge("a", "b")
{extra}
"""


def test_a_version_says_which_file_and_attribute_it_is(tmp_path: Path, sqlite_db: Factory) -> None:
    (tmp_path / "flow_v1.py").write_text(FLOW.format(extra=""))
    (tmp_path / "flow_v2.py").write_text(
        FLOW.format(extra='flow.add_node("c", step)\nflow.add_edge("b", "c")')
    )
    (v1,) = load_graphs([str(tmp_path / "flow_v1.py")])
    (v2,) = load_graphs([str(tmp_path / "flow_v2.py")])

    async def run(store: RunStore) -> None:
        result = await tr.Engine(store=store).run(v1, 1, run_id="versioned")
        assert result.status is RunStatus.COMPLETED

    run_on(sqlite_db, run)
    with dashboard(sqlite_db, graphs=[v1, v2]) as client:
        page = client.get(run_url("versioned")).text
        runs = client.get(runs_url()).text
    header = section(page, "run-header")
    assert "flow_v1.py:flow" in header
    assert "tailrace_file_" not in re.sub(r'title="[^"]*"', "", header)  # not as a bare hash
    versions = section(page, "other-versions")
    assert "flow_v2.py:flow" in versions and v2.fingerprint()[:8] in versions
    assert "flow_v1.py:flow" in runs


def test_a_hostile_source_run_id_is_text_in_the_runs_lists_fork_column(
    sqlite_db: Factory,
) -> None:
    chain = Chain()
    completed_chain(sqlite_db, chain, scenarios.HOSTILE)

    async def fork(store: RunStore) -> None:
        await tr.Engine(store=store).fork(
            scenarios.HOSTILE, at="b", graph=chain.graph, fork_id="fk"
        )

    run_on(sqlite_db, fork)
    with dashboard(sqlite_db) as client:
        runs = client.get(runs_url()).text
    assert "<script>window.__pwned" not in runs and "<img src=x" not in runs
    row = runs[runs.index('title="fk"') :]
    row = row[: row.index("</tr>")]
    assert f'href="{run_url(scenarios.HOSTILE)}"' in row
    assert html.escape(scenarios.HOSTILE)[:20] in row
