"""The dashboard in a real browser: Debian's Chromium driven by Playwright for Python.

Playwright's own browser download cannot work here, so the system browser is
its executable (``.ci/run`` installs the ``chromium`` package when missing).
The dashboard is served by uvicorn on 127.0.0.1; runs are driven by real
engines on the same SQLite file, in threads of their own. Every page is
screenshotted into a folder this module prints (``$TAILRACE_SCREENSHOTS`` when
set), and no page may log a console error (a CSP violation would).
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import tailrace as tr
from tailrace.cli._evolve import run_demo
from tailrace.ui import UiConfig
from tailrace.ui._links import run_url
from tests.ui.support import (
    TOKEN,
    Background,
    Factory,
    in_thread,
    scenarios,
    served,
)

CHROMIUM = next(
    (
        p
        for p in (
            os.environ.get("TAILRACE_CHROMIUM"),
            shutil.which("chromium"),
            "/usr/bin/chromium",
        )
        if p and Path(p).exists()
    ),
    None,
)
pytestmark = [
    pytest.mark.slow,  # a real browser
    pytest.mark.skipif(
        CHROMIUM is None,
        reason="no chromium binary: install Debian's package (apt-get install -y chromium) or set TAILRACE_CHROMIUM",
    ),
]
WAIT_MS = 20_000  # generous: only there so a bug fails a test instead of hanging it
STEPS = ("step1", "step2", "step3", "step4")

if CHROMIUM is not None:
    from playwright.sync_api import Browser, Page, expect, sync_playwright


@dataclass
class Site:
    """The served dashboard and what it shows."""

    url: str
    factory: Factory
    ids: dict[str, str]
    gates: Any
    live: tr.Graph
    question: str


@pytest.fixture(scope="module")
def shots(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where screenshots go; printed so a person can look at them."""
    wanted = os.environ.get("TAILRACE_SCREENSHOTS")
    folder = Path(wanted) if wanted else tmp_path_factory.mktemp("screenshots")
    folder.mkdir(parents=True, exist_ok=True)
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():
            reporter.ensure_newline()
            reporter.write_line(f"dashboard screenshots: {folder}")
    return folder


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    """A store with one run of each kind, an evolution and a waiting question, served."""
    root = tmp_path_factory.mktemp("ui-browser")
    factory = scenarios.sqlite_factory(root / "runs.db")
    gates = scenarios.Gates(*STEPS)
    live = scenarios.live_graph(gates, len(STEPS))

    async def setup() -> tuple[dict[str, str], str]:
        ids = await scenarios.make_runs(factory)
        async with scenarios.opened(factory) as store:
            await run_demo(store=store, tasks=24, workers=2, rollouts=80, latency=0.0005)
            result = await tr.Engine(store=store).run(
                scenarios.approval, "v2.0", run_id="approve-v2"
            )
            await scenarios.fleet(store)
        return ids, result.questions[0].question_id

    ids, question = in_thread(setup)
    config = UiConfig(
        store=factory, token=TOKEN, location="runs.db", graphs=[live], artifacts=["demo-routing-0"]
    )
    with served(config) as url:
        yield Site(url=url, factory=factory, ids=ids, gates=gates, live=live, question=question)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM)
        yield chromium
        chromium.close()


@pytest.fixture
def open_page(browser: Browser) -> Iterator[Any]:
    """Opens pages in fresh browser contexts; fails the test on any console error."""
    contexts = []
    problems: list[str] = []

    def new(login_url: str | None = None, *, refused: int | None = None) -> Page:
        """A page in a new context; ``refused`` is the one error status the test provokes."""
        context = browser.new_context(viewport={"width": 1280, "height": 860})
        contexts.append(context)
        page = context.new_page()
        expected = f"the server responded with a status of {refused} "

        def console(message: Any) -> None:
            if message.type == "error" and (refused is None or expected not in message.text):
                problems.append(message.text)

        page.on("console", console)
        page.on("pageerror", lambda exc: problems.append(str(exc)))
        if login_url is not None:  # the login form: the token is typed, never in an address
            page.goto(login_url)
            page.locator("form.login-form input[name=token]").fill(TOKEN)
            page.locator("form.login-form button[type=submit]").click()
            page.wait_for_url("**/questions")
        return page

    yield new
    for context in contexts:
        context.close()
    assert problems == [], problems


def login(site: Site) -> str:
    return f"{site.url}/login?next=/questions"


def test_a_live_runs_gantt_gains_bars_as_nodes_finish_without_a_reload(
    site: Site, open_page: Any, shots: Path
) -> None:
    started = threading.Event()

    async def drive() -> tr.RunResult:
        bus = tr.EventBus()  # published once committed: the page can read it
        bus.subscribe(lambda e: started.set(), tr.EventType.NODE_STARTED)
        async with scenarios.opened(site.factory) as store:
            return await tr.Engine(store=store, bus=bus).run(site.live, "go", run_id="live")

    run = Background(drive)
    assert started.wait(scenarios.GUARD)
    page = open_page()
    page.goto(f"{site.url}/runs/live")
    bars = page.locator("#run-gantt g.bar")
    expect(page.locator("#run-status")).to_have_text("running")
    expect(bars).to_have_count(1)
    page.evaluate("window.__sameDocument = true")  # gone if the page reloads
    expect(page.locator("body")).to_have_attribute("data-stream", "open", timeout=WAIT_MS)
    site.gates.release("step1")
    expect(bars).to_have_count(2, timeout=WAIT_MS)  # step1 completed, step2 running
    expect(page.locator("#run-gantt g.bar.o-completed")).to_have_count(1)
    page.screenshot(path=shots / "run-live.png", full_page=True)
    for step in STEPS[1:]:
        site.gates.release(step)
    expect(page.locator("body")).to_have_attribute("data-status", "completed", timeout=WAIT_MS)
    assert run.join().status == "completed"
    expect(page.locator("#run-gantt g.bar.o-completed")).to_have_count(len(STEPS))
    expect(page.locator("#run-status")).to_have_text("completed")
    expect(page.locator("#event-rows tr")).to_have_count(2 + 2 * len(STEPS))  # appended live
    assert page.evaluate("window.__sameDocument") is True
    page.screenshot(path=shots / "run-live-completed.png", full_page=True)


def test_answering_in_the_inbox_completes_the_run_and_a_late_answer_sees_who_won(
    site: Site, open_page: Any, shots: Path
) -> None:
    alice, bob = open_page(login(site)), open_page(login(site), refused=409)
    card = f"article[data-question='{site.question}']"
    for page in (bob, alice):  # bob opens the inbox before alice answers
        page.goto(f"{site.url}/questions")
        expect(page.locator(card)).to_be_visible()
    alice.locator(f"{card} textarea[name=answer]").fill('"ship it"')
    alice.locator(f"{card} input[name=by]").fill("alice")
    alice.screenshot(path=shots / "inbox.png", full_page=True)
    alice.locator(f"{card} button[type=submit]").click()
    alice.wait_for_url("**/runs/approve-v2?answered=*")
    expect(alice.locator("#flash")).to_contain_text("was recorded")
    expect(alice.locator("#run-status")).to_have_text("completed", timeout=WAIT_MS)
    expect(alice.locator("#run-nodes")).to_contain_text('{"shipped": "ship it"}')
    alice.screenshot(path=shots / "answered-run.png", full_page=True)

    bob.locator(f"{card} textarea[name=answer]").fill('"hold it"')
    bob.locator(f"{card} input[name=by]").fill("bob")
    bob.locator(f"{card} button[type=submit]").click()
    expect(bob.locator("#lost")).to_contain_text("Too late: the first answer won.")
    expect(bob.locator("#lost .who")).to_have_text("alice")
    expect(bob.locator("pre.answer")).to_have_text("ship it")
    bob.screenshot(path=shots / "late-answer.png", full_page=True)


def test_hostile_stored_text_renders_literally(site: Site, open_page: Any, shots: Path) -> None:
    page = open_page(login(site))
    hostile = site.ids["hostile"]
    page.goto(site.url + run_url(hostile))
    expect(page.locator(".run-id")).to_have_text(hostile)
    expect(page.locator("#run-questions pre.prompt")).to_have_text(scenarios.HOSTILE)
    expect(page.locator("#run-graph")).to_contain_text("ask<script>alert(1)</script>")
    page.screenshot(path=shots / "hostile-run.png", full_page=True)
    page.goto(f"{site.url}/runs")
    expect(page.locator("table.runs")).to_contain_text("hostile<b>graph</b>")
    assert page.evaluate("window.__pwned") is None  # no injected script or handler ran


def test_a_change_without_the_token_is_refused(site: Site, open_page: Any, shots: Path) -> None:
    page = open_page(refused=403)  # never logged in: the form asks for the token
    question = site.ids["gated"]
    page.goto(f"{site.url}/questions")
    card = page.locator("article.question", has=page.locator(f"a[href='/runs/{question}']"))
    card.locator("textarea[name=answer]").fill('"yes"')
    card.locator("input[name=token]").fill("not-the-token")
    card.locator("button[type=submit]").click()
    expect(page.locator("h1")).to_have_text("Refused: the token is missing or wrong")
    page.screenshot(path=shots / "refused.png", full_page=True)
    response = page.request.post(
        f"{site.url}/answer/{card_id(page, site, question)}", form={"answer": '"yes"'}
    )
    assert response.status == 403
    page.goto(f"{site.url}/runs/{question}")
    expect(page.locator("#run-status")).to_have_text("suspended")
    expect(page.locator("#run-questions .q-pill-open")).to_have_count(1)


def card_id(page: Page, site: Site, run_id: str) -> str:
    page.goto(f"{site.url}/runs/{run_id}")
    value = page.locator("#run-questions article.question").get_attribute("data-question")
    assert value
    return value


@pytest.mark.parametrize(
    "name, path",
    [
        ("runs", "/runs"),
        ("run-research", "/runs/r-research"),
        ("run-tail", "/runs/r-tail"),
        ("run-cut", "/runs/r-cut"),
        ("run-failed", "/runs/r-failed"),
        ("evolution", "/evolution"),
        ("artifact", "/evolution/demo-routing-0"),
        ("questions-all", "/questions?tab=all"),
        ("queues", "/queues"),
        ("run-queued", "/runs/mail-0"),
    ],
)
def test_every_page_renders_for_a_person(
    site: Site, open_page: Any, shots: Path, name: str, path: str
) -> None:
    page = open_page(login(site))
    response = page.goto(site.url + path)
    assert response is not None and response.status == 200
    expect(page.locator("h1").first).to_be_visible()
    page.screenshot(path=shots / f"{name}.png", full_page=True)


def cancellable_graph(ticks: int) -> tr.Graph:
    """``start`` fans out to a gate (``approve -> ship``) and to ``tick``, a short step that
    loops back to itself (E7), keeping the page's live updates flowing while the gate waits."""
    g = tr.Graph("cancellable")
    g.add_node("start", scenarios.only)
    g.add_node("approve", scenarios.only, tr.NodeKind.GATE)
    g.add_node("ship", scenarios.only)

    async def tick(x: Any) -> Any:
        await asyncio.sleep(0.05)
        return x

    g.add_node("tick", tick, max_visits=ticks)
    g.add_edge("start", "approve")
    g.add_edge("approve", "ship")
    g.add_edge("start", "tick")
    g.add_edge("tick", "tick")
    return g


def test_the_cancel_button_clicked_while_updates_flow_asks_then_cancels_the_run(
    site: Site, open_page: Any, shots: Path
) -> None:
    """A person clicks Cancel on a live run (a gate waiting, ticks streaming in): one click
    hits the button, the browser asks, the run ends cancelled and the page says so live."""
    graph = cancellable_graph(1_000)
    asked = threading.Event()

    async def drive() -> tr.RunResult:
        bus = tr.EventBus()
        bus.subscribe(lambda e: asked.set(), tr.EventType.QUESTION_OPENED)
        async with scenarios.opened(site.factory) as store:
            engine = tr.Engine(store=store, bus=bus, lease_ttl=1.5)  # hears a cancel in a beat
            return await engine.run(graph, "go", run_id="cancel-me")

    run = Background(drive)
    assert asked.wait(scenarios.GUARD)
    page = open_page(login(site))
    dialogs: list[str] = []

    def confirm(dialog: Any) -> None:
        dialogs.append(dialog.message)
        dialog.accept()

    page.on("dialog", confirm)
    page.goto(f"{site.url}/runs/cancel-me")
    expect(page.locator("body")).to_have_attribute("data-stream", "open", timeout=WAIT_MS)
    expect(page.locator("#run-status")).to_have_text("running")
    expect(page.locator("#run-gantt g.bar.o-waiting")).to_have_count(1)
    events = page.locator("#event-rows tr")
    seen = events.count()
    expect(events).not_to_have_count(seen, timeout=WAIT_MS)  # updates flow while we click
    page.screenshot(path=shots / "cancel-live.png", full_page=True)
    page.locator("#cancel-form button[type=submit]").click()  # one ordinary click
    page.wait_for_url("**/runs/cancel-me?cancelled=1")
    assert dialogs == ["Cancel run cancel-me? Its nodes stop and it cannot be resumed."]
    expect(page.locator("#flash")).to_contain_text("You asked to cancel this run.")
    expect(page.locator("#run-status")).to_have_text("cancelled", timeout=WAIT_MS)
    assert run.join().status == "cancelled"
    expect(page.locator("#run-gantt g.bar.o-waiting")).to_have_count(0)
    expect(page.locator("g.node[data-node='approve']")).to_have_class(re.compile(r"st-cancelled"))
    expect(page.locator("body")).not_to_contain_text("running now")
    expect(page.locator("body")).not_to_contain_text("waiting for an answer from")
    page.screenshot(path=shots / "cancelled.png", full_page=True)


def test_a_runs_streams_appear_live_with_the_loser_greyed_and_text_literal(
    site: Site, open_page: Any, shots: Path
) -> None:
    """S1-S4 in the browser: each attempt's card fills as chunks are committed, a failed try is
    greyed as discarded, the winner marked once its result is, hostile chunk text inert."""
    hostile = '<img src=x onerror="window.__pwned=1"><script>window.__pwned=2</script>'
    second_try = threading.Event()
    release = threading.Event()

    async def talk(x: str) -> str:
        ctx = tr.current_node()
        assert ctx is not None
        ctx.stream(f"try {ctx.attempt}: {hostile}")
        if ctx.attempt == 1:
            raise RuntimeError("the first try fails")
        second_try.set()
        await asyncio.to_thread(release.wait, scenarios.GUARD)
        ctx.stream(" done")
        return "ok"

    g = tr.Graph("streams_live")
    g.add_node("talk", talk, retry=tr.graph.RetryPolicy(attempts=2))

    async def drive() -> tr.RunResult:
        async with scenarios.opened(site.factory) as store:
            return await tr.Engine(store=store).run(g, "go", run_id="streams-live")

    run = Background(drive)
    assert second_try.wait(scenarios.GUARD)
    page = open_page()
    page.goto(f"{site.url}/runs/streams-live")
    cards = page.locator("#run-streams .stream-card")
    expect(cards).to_have_count(2, timeout=WAIT_MS)
    expect(cards.nth(0)).to_have_class(re.compile("stream-discarded"))
    expect(cards.nth(0).locator("pre.stream-text")).to_have_text(f"try 1: {hostile}")
    expect(cards.nth(1)).to_have_class(re.compile("stream-streaming"))
    page.screenshot(path=shots / "streams-live.png", full_page=True)
    release.set()
    expect(cards.nth(1)).to_have_class(re.compile("stream-accepted"), timeout=WAIT_MS)
    expect(cards.nth(1).locator("pre.stream-text")).to_have_text(f"try 2: {hostile} done")
    expect(cards.nth(1)).to_contain_text("accepted: winner")
    assert run.join().status == "completed"
    assert page.evaluate("window.__pwned") is None  # no injected script or handler ran
    page.screenshot(path=shots / "streams-done.png", full_page=True)
