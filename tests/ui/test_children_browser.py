"""Child runs in a real browser: Debian's Chromium driven by Playwright (see test_browser).

A parent with a hostile id runs a graph that runs a graph, and a map of a
graph; a browser opens its page, follows the tree down to the grandchild and
the breadcrumb back up, with every id shown as text and no console error (a
CSP violation would be one).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import tailrace as tr
from tailrace.ui import UiConfig
from tailrace.ui._links import run_url, runs_url
from tests.ui.support import TOKEN, in_thread, scenarios, served
from tests.ui.test_browser import CHROMIUM, browser, open_page, pytestmark, shots
from tests.ui.test_children import top

__all__ = ["browser", "open_page", "pytestmark", "shots"]  # fixtures and marks, shared

if CHROMIUM is not None:
    from playwright.sync_api import expect


def test_a_hostile_parents_tree_and_breadcrumb_are_followed_in_a_browser(
    tmp_path: Path, open_page: Any, shots: Path
) -> None:
    factory = scenarios.sqlite_factory(tmp_path / "runs.db")
    parent = scenarios.HOSTILE

    async def setup() -> None:
        async with scenarios.opened(factory) as store:
            await tr.Engine(store=store).run(top, "go", run_id=parent)

    in_thread(setup)
    config = UiConfig(store=factory, token=TOKEN, location="runs.db")
    with served(config) as url:
        page = open_page()
        page.goto(url + run_url(parent))
        expect(page.locator(".run-id")).to_have_text(parent)
        expect(page.locator("#child-runs tr.child-row")).to_have_count(4)
        expect(page.locator("#child-runs")).to_contain_text("each")
        expect(page.locator("g.node.child[data-node='sub']")).to_contain_text("⤷ middle")
        page.locator("#run-children").screenshot(path=str(shots / "run-children.png"))
        grandchild = f"{parent}/sub/1/deeper/1"
        page.locator(f"#run-tree a[title='{_css(grandchild)}']").click()
        expect(page.locator(".run-id")).to_have_text(grandchild)
        expect(page.locator("#parent-run")).to_contain_text("deeper#1")
        page.locator("#crumbs a.crumb-parent").first.click()
        expect(page.locator(".run-id")).to_have_text(parent)
        page.goto(url + runs_url(parent=parent))
        expect(page.locator("table.runs tbody tr")).to_have_count(4)
        expect(page.locator("#parent-filter")).to_have_attribute("title", parent)
        assert page.evaluate("window.__pwned") is None  # no injected script or handler ran


def _css(value: str) -> str:
    """``value`` inside a CSS attribute selector in single quotes."""
    return value.replace("\\", "\\\\").replace("'", "\\'")
