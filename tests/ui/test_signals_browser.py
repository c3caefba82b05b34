"""The dashboard's signals in a real browser: Debian's Chromium driven by Playwright (see
test_browser): after "Fork from here" the fork's page follows the fork to its end (its
buttons and its fork forms too, without a reload), and the map items table shows its
winners and slowest items whole inside its card.
"""

from __future__ import annotations

import asyncio
import re
import threading
from pathlib import Path
from typing import Any

import pytest

import tailrace as tr
from tailrace.ui import UiConfig
from tailrace.ui._links import run_url
from tests.ui.support import TOKEN, in_thread, scenarios, served
from tests.ui.test_browser import CHROMIUM, WAIT_MS, browser, open_page, pytestmark, shots

__all__ = ["browser", "open_page", "pytestmark", "shots"]  # fixtures and marks, shared

if CHROMIUM is not None:
    from playwright.sync_api import expect


def held_chain(release: threading.Event) -> tr.Graph:
    """``a -> b -> c``; ``b`` waits until ``release`` is set."""
    g = tr.Graph("held_chain")

    async def step(x: Any) -> Any:
        return x

    async def held(x: Any) -> Any:
        await asyncio.to_thread(release.wait, scenarios.GUARD)
        return x

    g.add_node("a", step)
    g.add_node("b", held)
    g.add_node("c", step)
    g.chain("a", "b", "c")
    return g


def test_a_forks_page_follows_it_to_its_end_buttons_and_fork_forms_included(
    tmp_path: Path, open_page: Any, shots: Path
) -> None:
    factory = scenarios.sqlite_factory(tmp_path / "runs.db")
    release = threading.Event()
    graph = held_chain(release)

    async def source() -> None:
        release.set()
        async with scenarios.opened(factory) as store:
            await tr.Engine(store=store).run(graph, "in", run_id="source")
        release.clear()  # the fork's b waits until the test lets it go

    in_thread(source)
    config = UiConfig(store=factory, token=TOKEN, location="runs.db", graphs=[graph])
    try:
        with served(config) as url:
            page = open_page(f"{url}/login?next=/questions")
            page.goto(url + run_url("source"))
            row = page.locator("#fork-nodes tr", has_text="b")
            row.get_by_role("button", name="Fork from here").click()
            page.wait_for_url(re.compile(r".*/runs/[0-9a-f]{32}$"), timeout=WAIT_MS)
            expect(page.locator("#run-status")).to_have_text("running", timeout=WAIT_MS)
            expect(page.locator("body")).to_have_attribute("data-stream", "open", timeout=WAIT_MS)
            expect(page.locator("#run-actions button", has_text="Cancel run")).to_have_count(1)
            expect(page.locator("#fork-nodes button")).to_have_count(2)  # a (reused) and b ran
            page.screenshot(path=shots / "fork-running.png", full_page=True)
            release.set()
            expect(page.locator("#run-status")).to_have_text("completed", timeout=WAIT_MS)
            expect(page.locator("#resume-note")).to_contain_text("the run is completed")
            # Without a reload: the buttons of a running run are gone, every node can be forked.
            expect(page.locator("#run-actions button")).to_have_count(0, timeout=WAIT_MS)
            expect(page.locator("#fork-nodes button")).to_have_count(3, timeout=WAIT_MS)
            expect(page.locator("#run-versions")).not_to_contain_text("No node has run yet")
            page.screenshot(path=shots / "fork-completed.png", full_page=True)
    finally:
        release.set()


#: Where the first row's cell under the header ``column`` of the map items table stands:
#: "seen", or what is wrong with it (outside the card, or covered by something else).
CELL_SEEN = """column => {
  const card = document.querySelector("#run-maps");
  const table = card.querySelector("table");
  const heads = [...table.querySelectorAll("thead th")].map(th => th.textContent.trim());
  const cell = table.querySelector("tbody tr").children[heads.indexOf(column)];
  cell.scrollIntoView({block: "center"});
  const r = cell.getBoundingClientRect(), c = card.getBoundingClientRect();
  if (r.right > c.right + 0.5 || r.left < c.left - 0.5) { return "outside the card"; }
  const at = document.elementFromPoint(r.right - 3, r.top + r.height / 2);
  return at !== null && cell.contains(at) ? "seen" : "covered";
}"""


def wide_map() -> tr.Graph:
    """40 items, 30 kept: a long winners list; items of several durations: a slowest list."""
    g = tr.Graph("wide_map_view")

    @g.task()
    def prompts(n: int) -> list[int]:
        return list(range(n))

    @g.map(required=30)
    async def rollout_with_a_rather_long_node_name(x: int) -> int:
        await asyncio.sleep(0.002 * (x % 7))
        return x

    g.chain("prompts", "rollout_with_a_rather_long_node_name")
    return g


def test_the_map_items_table_shows_its_winners_and_slowest_whole(
    tmp_path: Path, open_page: Any, shots: Path
) -> None:
    factory = scenarios.sqlite_factory(tmp_path / "runs.db")

    async def run() -> None:
        async with scenarios.opened(factory) as store:
            await tr.Engine(store=store, capacity=40).run(wide_map(), 40, run_id="wide")

    in_thread(run)
    config = UiConfig(store=factory, token=TOKEN, location="runs.db")
    with served(config) as url:
        page = open_page()
        page.goto(url + run_url("wide"))
        maps = page.locator("#run-maps")
        expect(maps).to_contain_text("(+18)")  # 12 winners shown, the other 18 counted
        for column in ("winners", "slowest"):
            # The cell lies inside the map card and nothing covers it: it is what a person sees.
            where = page.evaluate(CELL_SEEN, column)
            assert where == "seen", f"the {column} cell is {where}"
        maps.screenshot(path=str(shots / "map-items.png"))


def test_the_tail_account_renders_for_a_person(tmp_path: Path, open_page: Any, shots: Path) -> None:
    pytest.importorskip("httpx")
    from tests.cli.test_rollouts import two_rounds

    db = tmp_path / "runs.db"
    first, _ = in_thread(lambda: two_rounds(db))
    config = UiConfig(store=scenarios.sqlite_factory(db), token=TOKEN, location="runs.db")
    with served(config) as url:
        page = open_page()
        page.goto(url + run_url(first))
        card = page.locator("#run-tail")
        expect(card.locator("table.tail-measures")).to_contain_text("6 / 4 / 2 / 0")
        expect(card.locator("svg.cdf polyline")).to_have_count(2)
        expect(card.locator("svg.cdf line.ks-gap")).to_have_count(1)
        card.screenshot(path=str(shots / "tail-account.png"))
