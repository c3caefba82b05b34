"""The dashboard beyond loopback, honest times and bars, and the first day's small things."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import sys
import time
from pathlib import Path

import pytest
from starlette.testclient import TestClient

import tailrace as tr
from tailrace.core import make_owner
from tailrace.stores import RunStatus, WorkerRow
from tailrace.ui._security import TOKEN_COOKIE
from tests.ui.support import TOKEN, Factory, dashboard

scenarios = sys.modules["tailrace_tests_ui_scenarios"]
HOSTILE_HOSTS = ("127.0.0.1", "localhost", "127.0.0.1:8765", "evil.example", "[::1]")


def gated(factory: Factory, run_id: str = "secret-run") -> str:
    """A run suspended on its gate; returns its question id."""

    async def run() -> str:
        async with scenarios.opened(factory) as store:
            result = await tr.Engine(store=store).run(scenarios.approval, "v9", run_id=run_id)
            return str(result.questions[0].question_id)

    return asyncio.run(run())


def status_of(factory: Factory, run_id: str) -> RunStatus:
    async def read() -> RunStatus:
        async with scenarios.opened(factory) as store:
            return (await store.get_run(run_id)).status

    return asyncio.run(read())


def beyond_loopback(factory: Factory) -> object:
    """The app as ``tailrace ui --host 0.0.0.0`` makes it: any Host, reading needs the token."""
    return dashboard(factory, allowed_hosts=("*",), reading_needs_token=True)


def log_in(client: TestClient, token: str = TOKEN, after: str = "/runs") -> object:
    return client.post("/login", data={"token": token, "next": after})


# -- reading beyond loopback needs the token ------------------------------------------------------


@pytest.mark.parametrize("host", HOSTILE_HOSTS)
def test_beyond_loopback_no_page_or_stream_is_read_without_logging_in(
    sqlite_db: Factory, host: str
) -> None:
    qid = gated(sqlite_db)
    with beyond_loopback(sqlite_db) as client:  # type: ignore[attr-defined]
        client.headers["host"] = host
        answers = {
            path: client.get(path)
            for path in (
                "/runs",
                "/runs/secret-run",
                "/runs/no-such-run",
                f"/questions/{qid}",
                "/questions?tab=all",
                "/queues",
                "/evolution",
                "/stream/runs/secret-run",
            )
        }
        css = client.get("/static/app.css")
    assert css.status_code == 200  # the login page needs its stylesheet
    for path, response in answers.items():
        assert response.status_code == 401, path
        shown = re.sub(r'name="next" value="[^"]*"', "", response.text)  # the asker's own path
        assert "secret-run" not in shown and qid not in shown and "v9" not in shown, path
        assert "test.db" not in shown, path  # not even the store's name
        if not path.startswith("/stream/"):
            assert 'action="/login"' in response.text and 'name="token"' in response.text
            assert "set-cookie" not in response.headers


def test_logging_in_with_a_form_post_sets_a_strict_http_only_cookie_and_reading_works(
    sqlite_db: Factory,
) -> None:
    gated(sqlite_db)
    with beyond_loopback(sqlite_db) as client:  # type: ignore[attr-defined]
        client.headers["host"] = "dash.example:8765"
        form = client.get("/login?next=/runs/secret-run")
        wrong = log_in(client, "guess", "/runs/secret-run")
        still_out = client.get("/runs")
        right = log_in(client, TOKEN, "/runs/secret-run")
        page = client.get("/runs/secret-run")
        with client.stream("GET", "/stream/runs/secret-run") as stream:
            first = next(stream.iter_lines())
            kind = stream.headers["content-type"]
    assert form.status_code == 200 and 'value="/runs/secret-run"' in form.text
    assert wrong.status_code == 401 and 'action="/login"' in wrong.text
    assert "That is not the token" in wrong.text and "guess" not in wrong.text
    assert TOKEN not in wrong.text and "set-cookie" not in wrong.headers
    assert still_out.status_code == 401
    assert right.status_code == 303 and right.headers["location"] == "/runs/secret-run"
    cookie = right.headers["set-cookie"].lower()
    assert f"{TOKEN_COOKIE}=" in cookie and "httponly" in cookie and "samesite=strict" in cookie
    assert TOKEN not in right.headers["location"]
    assert page.status_code == 200 and "secret-run" in page.text
    assert kind.startswith("text/event-stream") and first.startswith("event: ")


def test_a_token_in_the_address_never_logs_in_and_leaves_the_address(sqlite_db: Factory) -> None:
    gated(sqlite_db)
    with beyond_loopback(sqlite_db) as client:  # type: ignore[attr-defined]
        sent = client.get(f"/runs/secret-run?token={TOKEN}&x=1")
        after = client.get("/runs")
    assert sent.status_code == 303 and TOKEN not in sent.headers["location"]
    assert sent.headers["location"].startswith("/login?next=")
    assert "set-cookie" not in sent.headers and after.status_code == 401
    with dashboard(sqlite_db) as client:  # on loopback too: the login form takes the token
        sent = client.get(f"/questions?token={TOKEN}")
    assert sent.status_code == 303 and TOKEN not in sent.headers["location"]
    assert "set-cookie" not in sent.headers


def test_the_login_goes_on_only_to_pages_of_this_site(sqlite_db: Factory) -> None:
    with beyond_loopback(sqlite_db) as client:  # type: ignore[attr-defined]
        places = [
            log_in(client, TOKEN, target).headers["location"]
            for target in ("//evil.example/x", "https://evil.example/", "/\\evil.example", "")
        ]
    assert places == ["/runs"] * 4


def test_on_loopback_reading_stays_open(sqlite_db: Factory) -> None:
    gated(sqlite_db)
    with dashboard(sqlite_db) as client:
        page = client.get("/runs/secret-run")
    assert page.status_code == 200 and "secret-run" in page.text


def test_beyond_loopback_a_change_still_needs_the_token_and_a_refusal_shows_nothing(
    sqlite_db: Factory,
) -> None:
    qid = gated(sqlite_db)
    with beyond_loopback(sqlite_db) as client:  # type: ignore[attr-defined]
        refused = client.post(f"/answer/{qid}", data={"answer": '"yes"', "token": "guess"})
        client.cookies.set(TOKEN_COOKIE, TOKEN)
        also_refused = client.post(f"/answer/{qid}", data={"answer": '"yes"'})
        client.cookies.clear()
        cancelled = client.post(
            "/cancel/runs/secret-run", headers={"x-tailrace-token": TOKEN}, follow_redirects=False
        )
    assert refused.status_code == 403 and "secret-run" not in refused.text
    assert also_refused.status_code == 403  # the cookie alone never authorises a change (CSRF)
    assert cancelled.status_code == 303
    assert status_of(sqlite_db, "secret-run") is RunStatus.CANCELLED


# -- the first day's small things ------------------------------------------------------------------


def machine_gated(factory: Factory) -> str:
    """A run suspended on a machine gate (a question with a poller); returns its question id."""
    graph = tr.Graph("machine")
    graph.add_node("checks", scenarios.only, "gate", poller="ci")
    graph.add_node("deploy", scenarios.only)
    graph.add_edge("checks", "deploy")

    async def run() -> str:
        async with scenarios.opened(factory) as store:
            result = await tr.Engine(store=store).run(graph, {"sha": "abc"}, run_id="machine-run")
            return str(result.questions[0].question_id)

    return asyncio.run(run())


def cut(factory: Factory, run_id: str) -> None:
    """A run stopped in the middle of a node: running, held by nobody."""

    async def make() -> None:
        async with scenarios.opened(factory) as store:
            await scenarios.cut_and_resume(store, run_id, resume=False)

    asyncio.run(make())


def held(factory: Factory, run_id: str) -> None:
    """Hold ``run_id``'s lease as a live process (this one) would: it shows as running."""

    async def take() -> None:
        async with scenarios.opened(factory) as store:
            assert await store.acquire_lease(run_id, make_owner(), 300.0) is not None

    asyncio.run(take())


def test_the_cancel_button_is_kept_out_of_the_live_updates_and_asks_first(
    sqlite_db: Factory,
) -> None:
    cut(sqlite_db, "secret-run")
    held(sqlite_db, "secret-run")  # a running run held by a live process: its page streams
    with dashboard(sqlite_db) as client:
        client.post("/login", data={"token": TOKEN})
        page = client.get("/runs/secret-run").text
        with client.stream("GET", "/stream/runs/secret-run") as stream:
            lines = stream.iter_lines()
            update = next(line for line in lines if line.startswith("data: "))
    header = page[page.index('id="run-header"') : page.index('id="run-actions"')]
    actions = page[page.index('id="run-actions"') : page.index('id="run-questions"')]
    assert "Cancel run" not in header and "Cancel run" in actions
    assert 'data-confirm="Cancel run secret-run?' in actions
    parts = json.loads(update.removeprefix("data: "))["parts"]
    assert "run-header" in parts and "run-actions" not in parts  # the button stays put


def test_after_a_cancel_the_page_and_the_gate_follow_the_stored_status(
    sqlite_db: Factory,
) -> None:
    gated(sqlite_db, "asked-run")
    cut(sqlite_db, "driven-run")
    held(sqlite_db, "driven-run")  # driven by a live process: cancel is only requested
    with dashboard(sqlite_db) as client:
        pages = {}
        for run_id in ("asked-run", "driven-run"):
            done = client.post(f"/cancel/runs/{run_id}", data={"token": TOKEN})
            pages[run_id] = client.get(done.headers["location"]).text
    asked, driven = pages["asked-run"], pages["driven-run"]
    assert "running now" not in driven and "You asked to cancel this run." in driven
    assert 'id="run-status">running<' in driven and 'id="cancel-note"' in driven
    assert 'id="run-status">cancelled<' in asked and "cancelled now" not in asked
    gate = re.search(r'<g class="node st-(\w+) kind-gate" data-node="approve">', asked)
    assert gate and gate.group(1) == "cancelled"
    assert "o-waiting" not in asked and "waiting for an answer" not in asked
    nodes = asked[asked.index('id="run-nodes"') :]
    assert '<td class="mono">approve</td><td><span class="pill small s-cancelled">' in nodes


def test_the_runs_header_counts_what_every_filter_leaves(sqlite_db: Factory) -> None:
    async def make() -> None:
        async with scenarios.opened(sqlite_db) as store:
            await scenarios.fleet(store)  # graph quick: 3 queued, 1 completed

    asyncio.run(make())
    gated(sqlite_db)
    with dashboard(sqlite_db) as client:
        queued = client.get("/runs?status=queued&graph=quick").text
        emails = client.get("/runs?status=queued&queue=emails").text
        done = client.get("/runs?status=completed&graph=approval").text
    count = r'<p class="sub" id="runs-count">([^<]*)<'
    assert re.search(count, queued).group(1).startswith("3 queued runs of graph ")  # type: ignore[union-attr]
    assert re.search(count, emails).group(1).startswith("2 queued runs in queue ")  # type: ignore[union-attr]
    assert re.search(count, done).group(1).startswith("0 completed runs of graph ")  # type: ignore[union-attr]


def test_the_queues_page_shows_dead_workers_marked_dead_in_the_clis_rate_units(
    sqlite_db: Factory,
) -> None:
    dead = f"{socket.gethostname()}:999999999:12345:gone"  # this host, a pid that cannot exist

    async def make() -> None:
        async with scenarios.opened(sqlite_db) as store:
            await scenarios.fleet(store)
            now = time.time()
            await store.worker_seen(
                WorkerRow(worker_id=dead, queues=("emails",), concurrency=2,
                          started_at=now - 50, seen_at=now - 1)
            )  # fmt: skip
            assert await store.claim_runs("emails", dead, 300.0, limit=1) == ["mail-0"]
            # Its report is gone (another worker forgot it), its lease is not: still shown.
            assert await store.claim_runs("reports", f"{dead}2", 300.0, limit=1) == ["report-0"]

    asyncio.run(make())
    with dashboard(sqlite_db) as client:
        page = client.get("/queues").text
    rows = re.findall(
        r'<td class="mono" title="([^"]+)">.*?<span class="pill small w-(\w+)">', page, re.S
    )
    assert (dead, "dead") in rows and (f"{dead}2", "dead") in rows
    assert ("otherhost:4242:1.0:abc", "live") in rows
    assert "started/s (60s)" in page and "starts / min" not in page
    emails = page[page.index("/runs?queue=emails") : page.index("/runs?queue=reports")]
    cells = re.findall(r'<td class="num">(.*?)</td>', emails, re.S)
    assert cells[3] == "0.0167"  # one claim in 60 s, as `tailrace queues` prints it
    assert cells[4].startswith("1 ") and "1 dead" in cells[4]  # only the live one serves


def test_a_machine_gate_is_marked_and_offers_people_no_answer_form(sqlite_db: Factory) -> None:
    qid = machine_gated(sqlite_db)
    with dashboard(sqlite_db) as client:
        client.post("/login", data={"token": TOKEN})
        inbox = client.get("/questions").text
        run = client.get("/runs/machine-run").text
        refused = client.post(f"/answer/{qid}", data={"answer": '"ok"', "token": TOKEN})
    for page in (inbox, run):
        card = page[page.index(f'data-question="{qid}"') :]
        assert "machine gate" in card and 'class="answer-form"' not in card
        assert "the poller <b" in card
    assert refused.status_code == 409 and "Nothing was recorded" in refused.text
    assert status_of(sqlite_db, "machine-run") is RunStatus.SUSPENDED


def test_the_questions_page_is_paged_and_the_header_counts_in_one_query(
    sqlite_db: Factory,
) -> None:
    async def make() -> None:
        async with scenarios.opened(sqlite_db) as store:
            engine = tr.Engine(store=store)
            for n in range(120):
                await engine.run(scenarios.approval, f"v{n}", run_id=f"r{n:03}")

    asyncio.run(make())
    with dashboard(sqlite_db) as client:
        first = client.get("/questions").text
        third = client.get("/questions?page=3").text
        bad = client.get("/questions?page=x")
        runs = client.get("/runs").text
    assert first.count('class="card question-card"') == 50
    assert third.count('class="card question-card"') == 20
    assert "page 1 of 3 · 120 questions" in first and 'rel="next"' in first
    assert "page 3 of 3" in third and 'rel="next"' not in third
    assert bad.status_code == 400
    assert re.search(r'class="tab on"[^>]*>open <b>120</b>', first)
    assert ">120<" in runs  # the header's open-question count


def test_a_failed_attempts_traceback_is_shown_collapsed_and_as_text(sqlite_db: Factory) -> None:
    graph = tr.Graph("boom")

    @graph.task()
    async def boom(x: object) -> None:
        raise LookupError("<script>alert(1)</script> [bold]x[/]")

    async def run() -> None:
        async with scenarios.opened(sqlite_db) as store:
            with pytest.raises(LookupError):
                await tr.Engine(store=store).run(graph, 1, run_id="boom-run")

    asyncio.run(run())
    with dashboard(sqlite_db) as client:
        page = client.get("/runs/boom-run").text
    details = page[page.index('<details class="traceback">') :]
    assert (
        "<summary>traceback</summary>" in details and "Traceback (most recent call last)" in details
    )
    assert "in boom" in details and "<script>alert(1)</script>" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt; [bold]x[/]" in details


def test_a_queued_run_shows_its_wait_and_a_claimed_one_its_run_time_apart(
    sqlite_db: Factory,
) -> None:
    from tailrace.ui._views import run_times

    now = 1_000.0

    def record(**fields: object) -> object:
        base = {"run_id": "r", "graph_name": "g", "graph_ref": None, "fingerprint": "fp",
                "status": RunStatus.RUNNING, "created_at": 900.0, "updated_at": 990.0,
                "state_json": "{}", "input_json": "null", "error": None, "finished_at": None,
                "nodes_done": 0, "lease_owner": None, "lease_expires": None, "lease_token": 0,
                "format_version": 1}  # fmt: skip
        return tr.stores.RunRecord(**{**base, **fields})  # type: ignore[arg-type]

    queued = run_times(record(status=RunStatus.QUEUED, queued_at=900.0), "queued", now)
    assert queued == ("not yet", "-", "1 min 40 s")
    done = record(status=RunStatus.COMPLETED, queued_at=900.0, started_at=990.0, finished_at=993.5)
    _, duration, waited = run_times(done, "completed", now)  # type: ignore[arg-type]
    assert duration == "3.5 s" and waited == "1 min 30 s"


def test_the_dashboard_never_draws_a_run_with_a_graph_of_another_name(
    sqlite_db: Factory,
) -> None:
    def shaped(name: str) -> tr.Graph:
        g = tr.Graph(name)
        g.add_node("step", scenarios.only)
        return g

    summarize, translate = shaped("summarize"), shaped("translate")
    assert summarize.compile().fingerprint == translate.compile().fingerprint

    async def run() -> None:
        async with scenarios.opened(sqlite_db) as store:
            await tr.Engine(store=store).run(translate, "x", run_id="translate-run")

    asyncio.run(run())
    with dashboard(sqlite_db, graphs=[summarize]) as client:
        page = client.get("/runs/translate-run").text
    with dashboard(sqlite_db, graphs=[translate]) as client:
        right = client.get("/runs/translate-run").text
    assert "named with --graphs" not in page and "named with --graphs" in right


def test_a_graph_that_does_not_import_is_explained_for_each_run_as_its_own(
    sqlite_db: Factory,
) -> None:
    async def make() -> None:
        async with scenarios.opened(sqlite_db) as store:
            for run_id in ("first-run", "second-run"):
                await store.create_run(
                    tr.stores.NewRun(
                        run_id=run_id, graph_name="g", graph_ref="tailrace_no_such_module:graph",
                        fingerprint="fp", input_json="null", created_at=time.time(),
                    )
                )  # fmt: skip

    asyncio.run(make())
    with dashboard(sqlite_db) as client:
        first = client.get("/runs/first-run").text
        second = client.get("/runs/second-run").text
    assert "cannot import its graph" in first and "cannot import its graph" in second
    assert "first-run" not in second.replace('href="/runs/first-run"', "")


def test_the_readme_graph_run_from_its_file_is_drawn_with_every_edge_without_graphs(
    sqlite_db: Factory,
) -> None:
    """The README's command runs ``examples/research.py:graph``, a file reference the dashboard
    never executes: the structure the run stored draws it whole, every edge and route."""
    from tailrace.graph import load_file_module

    path = Path(__file__).resolve().parents[2] / "examples" / "research.py"
    graph = load_file_module(str(path)).graph

    async def run() -> None:
        async with scenarios.opened(sqlite_db) as store:
            engine = tr.Engine(store=store)
            await engine.run(graph, "tail latency", run_id="readme", graph_ref=f"{path}:graph")

    asyncio.run(run())
    with dashboard(sqlite_db) as client:
        page = client.get("/runs/readme").text
    drawn = set(re.findall(r"<title>([\w-]+) → ([\w-]+)(?: \(route [\w-]+\))?</title>", page))
    assert drawn == {(e.source, e.target) for e in graph.edges}
    assert page.count('<path class="edge') == len(graph.edges)
    assert "drawn whole: from the structure the run stored when it started" in page
    assert "which a stored reference never executes" in page  # and why its code is not loaded
