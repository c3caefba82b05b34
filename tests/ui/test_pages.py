"""Reading pages through Starlette's TestClient: runs, a run, questions, evolution, guards."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path
from typing import Any

import tailrace as tr
from tailrace.stores import MemoryStore, NewRun, QuestionStatus, RunRecord, RunStatus
from tailrace.ui._links import run_url
from tailrace.ui._views import RUN_FILTERS, runs_page
from tests.ui.support import Factory, dashboard, scenarios


def run_ids(html: str) -> list[str]:
    """Run ids in the runs table, in page order (ids are unescaped from their title)."""
    import html as html_lib

    return [
        html_lib.unescape(m)
        for m in re.findall(r'<td class="mono id"><a href="[^"]*" title="([^"]*)"', html)
    ]


def test_runs_are_listed_newest_first_with_counts_per_status(
    made: dict[str, str], sqlite_db: Factory
) -> None:
    with dashboard(sqlite_db) as client:
        page = client.get("/runs")
    assert page.status_code == 200
    assert run_ids(page.text) == [
        made[k] for k in ("cut", "hostile", "failed", "tail", "gated", "research")
    ]
    counts = dict(
        re.findall(
            r'chip-(\w+)[^"]*" href="[^"]*"><i class="dot s-\w+"></i>\w+ <b>(\d+)</b>', page.text
        )
    )
    expected = dict.fromkeys(RUN_FILTERS, "0") | {"suspended": "2", "completed": "3", "failed": "1"}
    assert counts == expected


def test_runs_filter_by_status_and_graph(made: dict[str, str], sqlite_db: Factory) -> None:
    with dashboard(sqlite_db) as client:
        assert run_ids(client.get("/runs?status=suspended").text) == [
            made["hostile"],
            made["gated"],
        ]
        assert run_ids(client.get("/runs?graph=research").text) == [made["research"]]
        assert run_ids(client.get("/runs?graph=research&status=failed").text) == []
        bad = client.get("/runs?status=bogus")
    assert bad.status_code == 400 and "unknown status &#39;bogus&#39;" in bad.text


def test_runs_are_paginated(sqlite_db: Factory) -> None:
    async def many() -> None:
        async with scenarios.opened(sqlite_db) as store:
            engine = tr.Engine(store=store)
            for n in range(7):
                await engine.run(scenarios.cut_free, n, run_id=f"run-{n}")

    asyncio.run(many())
    with dashboard(sqlite_db, page_size=3) as client:
        pages = [run_ids(client.get(f"/runs?page={p}").text) for p in (1, 2, 3)]
        past_the_end = run_ids(client.get("/runs?page=99").text)
        first = client.get("/runs").text
        completed = run_ids(client.get("/runs?status=completed&page=2").text)
        of_graph = run_ids(client.get("/runs?graph=quick&page=3").text)
        hostile = client.get("/runs?graph=a%00b")
    assert pages == [["run-6", "run-5", "run-4"], ["run-3", "run-2", "run-1"], ["run-0"]]
    assert past_the_end == ["run-0"]
    assert "page 1 of 3" in first and 'href="/runs?page=2" rel="next"' in first
    assert completed == ["run-3", "run-2", "run-1"]
    assert of_graph == ["run-0"]
    assert hostile.status_code == 400 and "not a valid name" in hostile.text


async def test_the_runs_page_reads_one_page_of_runs_not_all_of_them() -> None:
    asked: list[dict[str, object]] = []

    class Recording(MemoryStore):
        async def list_runs(self, **options: Any) -> list[RunRecord]:
            asked.append(options)
            return await super().list_runs(**options)

    store = Recording()
    for n in range(50):
        run = NewRun(run_id=f"r{n:02}", graph_name="g", graph_ref=None, fingerprint="f",
                     input_json="null", created_at=float(n))  # fmt: skip
        await store.create_run(run)
    view = await runs_page(
        store, status="orphaned", graph=None, queue=None, page=2, page_size=10, now=100.0
    )
    assert [r.run_id for r in view.rows] == [f"r{n:02}" for n in range(39, 29, -1)]
    assert (view.matching, view.pages, view.counts["orphaned"]) == (50, 5, 50)
    view = await runs_page(store, status=None, graph=None, queue=None, page=3, page_size=10,
                           now=100.0)  # fmt: skip
    assert [r.run_id for r in view.rows] == [f"r{n:02}" for n in range(29, 19, -1)]
    # Every read of a page asks for one page; only the running runs are read whole.
    paged = [o for o in asked if o.get("status") is not RunStatus.RUNNING]
    page = {"status": None, "graph": None, "queue": None, "limit": 10, "offset": 20}
    assert paged == [{**page, "top_level": False}]
    asked.clear()  # hiding the child runs reads one page of top-level runs as well
    view = await runs_page(store, status=None, graph=None, queue=None, page=3, page_size=10,
                           now=100.0, hide_children=True)  # fmt: skip
    assert [o for o in asked if o.get("status") is not RunStatus.RUNNING] == [
        {**page, "top_level": True}
    ]


def test_an_orphaned_run_is_shown_and_filtered_as_such(sqlite_db: Factory) -> None:
    async def orphan() -> None:
        async with scenarios.opened(sqlite_db) as store:
            await scenarios.cut_and_resume(store, "r-orphan", resume=False)

    asyncio.run(orphan())
    with dashboard(sqlite_db) as client:
        assert run_ids(client.get("/runs?status=orphaned").text) == ["r-orphan"]
        page = client.get("/runs/r-orphan").text
    assert 'id="run-status">orphaned<' in page
    assert "o-cut" in page  # nothing drives its open attempt: cut, not running
    assert "Resume here" in page


def test_a_run_page_draws_the_graph_every_attempt_late_inputs_and_the_log(
    made: dict[str, str], sqlite_db: Factory
) -> None:
    with dashboard(sqlite_db) as client:
        page = client.get(run_url(made["research"])).text
    found = re.findall(r'<g class="node st-([\w-]+) kind-\w+" data-node="(\w+)"', page)
    assert sorted(node for _, node in found) == sorted(scenarios.research.nodes)
    assert {status for status, _ in found} == {"completed"}
    assert "drawn whole: imported from tailrace_tests_ui_scenarios:research" in page
    assert (
        page.count('<g class="bar o-completed') == 10
    )  # plan, 3 tools, merge, write x2, review x2, publish
    assert (
        page.count(" late") >= 1
        and '<td class="mono">merge</td><td>1</td><td class="mono">issues</td>' in page
    )
    assert page.count('<tr class="ev ev-') == 24
    data = re.search(r'<script type="application/json" id="page-data">(.*?)</script>', page)
    assert data is not None and json.loads(data.group(1)) == {
        "run_id": "r-research",
        "stream": None,
    }


def test_retries_stragglers_hedges_and_cut_attempts_are_drawn_distinctly(
    made: dict[str, str], sqlite_db: Factory
) -> None:
    with dashboard(sqlite_db) as client:
        tail = client.get(run_url(made["tail"])).text
        cut = client.get(run_url(made["cut"])).text
    assert re.findall(r'<g class="bar (o-\w+(?: hedge)?(?: late)?(?: straggler)?)">', tail) == [
        "o-retried", "o-completed", "o-lost straggler", "o-completed hedge",
    ]  # fmt: skip
    assert "hedged#1 hedge" in tail and "&lt;b&gt;upstream&lt;/b&gt; reset" in tail
    # The backups it raced (T3): started, won, and no hedge policy to budget them.
    assert '<dd id="run-hedging">1 started (1 won), unbudgeted (no hedge policy)</dd>' in tail
    assert 'id="run-hedging"' not in cut
    assert re.findall(r'<g class="bar (o-\w+)">', cut) == ["o-completed", "o-cut", "o-completed"]
    assert "cut by a crash or stop" in cut


def test_a_stored_file_reference_is_never_executed_to_draw_a_graph(
    sqlite_db: Factory, tmp_path: Path
) -> None:
    marker = tmp_path / "executed"
    graph_file = tmp_path / "evil.py"
    graph_file.write_text(f"open({str(marker)!r}, 'w').write('ran')\n")

    async def planted() -> None:
        async with scenarios.opened(sqlite_db) as store:
            await store.create_run(
                NewRun(run_id="planted", graph_name="evil", graph_ref=f"{graph_file}:graph",
                       fingerprint="f" * 16, input_json="null", created_at=time.time())
            )  # fmt: skip

    asyncio.run(planted())
    with dashboard(sqlite_db) as client:
        page = client.get("/runs/planted").text
    assert not marker.exists()
    assert "which a stored reference never executes" in page and "--graphs" in page


def test_graphs_named_with_graphs_are_drawn_whole_whatever_the_reference(
    sqlite_db: Factory,
) -> None:
    graph = scenarios.local_graph()  # built in a function: no module reference finds it

    async def run() -> None:
        async with scenarios.opened(sqlite_db) as store:
            await tr.Engine(store=store).run(graph, 1, run_id="local")

    asyncio.run(run())
    with dashboard(sqlite_db) as client:
        stored = client.get("/runs/local").text
    with dashboard(sqlite_db, graphs=[graph]) as client:
        whole = client.get("/runs/local").text
    assert "drawn whole: named with --graphs" in whole
    # Without --graphs, the structure the run stored when it started draws it whole too.
    assert "drawn whole: from the structure the run stored when it started" in stored
    assert whole.count('<path class="edge') == stored.count('<path class="edge') == len(graph.edges)


def test_the_inbox_tabs_sort_questions_by_state(made: dict[str, str], sqlite_db: Factory) -> None:
    async def states() -> None:
        async with scenarios.opened(sqlite_db) as store:
            engine = tr.Engine(store=store)
            for n, state in enumerate(("answered", "expired", "stuck")):
                result = await engine.run(scenarios.approval, f"v{n}", run_id=f"q-{state}")
                [q] = result.questions
                status = QuestionStatus.EXPIRED if state == "expired" else QuestionStatus.ANSWERED
                await store.answer(q.question_id, '"yes"', by="ci", status=status)
                if state == "stuck":
                    await store.defer_answer(
                        q.question_id, error="graph <b>gone</b>", retry_at=time.time() + 60
                    )

    asyncio.run(states())
    with dashboard(sqlite_db) as client:
        tabs = {
            tab: client.get(f"/questions?tab={tab}").text
            for tab in ("open", "answered", "expired", "stuck", "all")
        }
        assert client.get("/questions?tab=nope").status_code == 400
    shown = {
        tab: re.findall(r'run <a class="mono" href="/runs/([^"]+)"', html)
        for tab, html in tabs.items()
    }
    assert sorted(shown["open"]) == sorted(["r-gated", run_url(made["hostile"])[6:]])
    assert (shown["answered"], shown["expired"], shown["stuck"]) == (
        ["q-answered"],
        ["q-expired"],
        ["q-stuck"],
    )
    assert len(shown["all"]) == 5
    assert (
        "could not be applied" in tabs["stuck"] and "graph &lt;b&gt;gone&lt;/b&gt;" in tabs["stuck"]
    )
    assert 'answered by <b class="who">ci</b>' in tabs["answered"]


def test_stored_markup_is_shown_as_text_everywhere(
    made: dict[str, str], sqlite_db: Factory
) -> None:
    hostile = made["hostile"]
    with dashboard(sqlite_db) as client:
        pages = [
            client.get(u).text
            for u in ("/runs", run_url(hostile), "/questions", run_url(made["failed"]))
        ]
    for page in pages:
        assert (
            "<script>window" not in page and "<img src=x" not in page and "<b>graph</b>" not in page
        )
        assert "<i>really</i>" not in page
    assert "&lt;/script&gt;&lt;script&gt;window.__pwned = 1&lt;/script&gt;" in pages[2]
    assert "hostile&lt;b&gt;graph&lt;/b&gt;" in pages[0]
    assert "ask&lt;script&gt;alert(1)&lt;/script&gt;" in pages[1]
    assert "&lt;i&gt;really&lt;/i&gt;" in pages[3]
    data = re.search(r'id="page-data">(.*?)</script>', pages[1])
    assert data is not None and json.loads(data.group(1))["run_id"] == hostile


def test_every_response_carries_a_strict_content_security_policy(
    made: dict[str, str], sqlite_db: Factory
) -> None:
    with dashboard(sqlite_db) as client:
        response = client.get("/runs")
        css = client.get("/static/app.css")
    policy = response.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "unsafe-inline" not in policy
    assert response.headers["x-content-type-options"] == "nosniff"
    assert css.status_code == 200 and "content-security-policy" in css.headers


def test_requests_for_another_host_are_refused(made: dict[str, str], sqlite_db: Factory) -> None:
    with dashboard(sqlite_db) as client:  # DNS rebinding: a page of evil.example reaching 127.0.0.1
        assert client.get("/runs", headers={"host": "evil.example"}).status_code == 400


def test_unknown_runs_questions_and_ids_no_store_keeps_are_clear_errors(
    made: dict[str, str], sqlite_db: Factory
) -> None:
    with dashboard(sqlite_db) as client:
        run = client.get("/runs/nope")
        question = client.get("/questions/nope")
        nul = client.get("/runs/a%00b")
    assert run.status_code == 404 and "no run &#39;nope&#39; in the store" in run.text
    assert question.status_code == 404 and "nope" in question.text
    assert nul.status_code == 400


def test_a_finished_runs_stream_sends_its_end(made: dict[str, str], sqlite_db: Factory) -> None:
    with dashboard(sqlite_db) as client:
        body = client.get("/stream/runs/r-research?after=20").text
        missing = client.get("/stream/runs/nope")
    messages = [m for m in body.split("\n\n") if m]
    update = json.loads(messages[0].split("data: ", 1)[1])
    assert messages[0].startswith("event: update\nid: 24\n")
    assert [int(s) for s in re.findall(r'data-seq="(\d+)"', update["rows"])] == [21, 22, 23, 24]
    assert update["status"] == "completed"
    assert messages[-1] == 'event: end\ndata: {"status": "completed"}'
    assert missing.status_code == 404


def test_evolution_lists_named_artifacts_and_draws_held_out_reward(sqlite_db: Factory) -> None:
    async def ledger() -> None:
        async with scenarios.opened(sqlite_db) as store:
            await store.commit_artifact("prompt", 0, '{"system": "Be brief."}', '{"initial": true}')
            for n, score in enumerate((0.4, 0.7), start=1):
                meta = {"held_out": score, "sweep": n, "route": "oracle", "probability": 0.9,
                        "edit": {"set": {"system": f"v{n}"}, "note": "<b>tighter</b>"}}  # fmt: skip
                await store.commit_artifact(
                    "prompt", n, json.dumps({"system": f"v{n}"}), json.dumps(meta)
                )

    asyncio.run(ledger())
    with dashboard(sqlite_db, artifacts=["prompt"]) as client:
        index = client.get("/evolution").text
        page = client.get("/evolution/prompt").text
        lookup = client.get("/evolution?artifact=prompt")
        empty = client.get("/evolution/none-yet").text
    assert 'href="/evolution/prompt"' in index and "0.700" in index
    assert page.count('<circle class="point') == 2 and "v3: held-out 0.7000" in page
    assert "&lt;b&gt;tighter&lt;/b&gt;" in page and "set system" in page
    assert lookup.status_code == 303 and lookup.headers["location"] == "/evolution/prompt"
    assert "holds no version of this artifact" in empty


def test_a_run_page_shows_who_drove_each_stretch_as_text(sqlite_db: Factory) -> None:
    """W6 on the dashboard: each stretch's owner, how it began, and the takeovers (W3);
    an owner name from the store is text, never markup."""
    from tailrace.stores import EventRow, Harvest

    async def make() -> None:
        async with sqlite_db(False) as store:
            await store.create_run(
                NewRun(run_id="driven", graph_name="g", graph_ref=None, fingerprint="fp",
                       input_json="null", created_at=1.0)
            )  # fmt: skip
            token = await store.acquire_lease("driven", "<b>first</b>", 30.0)
            opened = [
                EventRow(seq=1, type="run_started", node_id=None, visit=None, attempt=None,
                         ts=2.0, data_json='{"owner": "<b>first</b>"}'),
                EventRow(seq=2, type="run_resumed", node_id=None, visit=None, attempt=None,
                         ts=5.0, data_json='{"owner": "host:7:1:ab"}'),
            ]  # fmt: skip
            await store.commit("driven", token, Harvest(state_json="{}", events=opened))

    asyncio.run(make())
    with dashboard(sqlite_db) as client:
        page = client.get(run_url("driven")).text
    assert "Driven by <span" in page and "2 stretches" in page
    assert "&lt;b&gt;first&lt;/b&gt;" in page and "<b>first</b>" not in page
    assert '<td class="mono">host:7:1:ab</td><td>resumed</td>' in page
