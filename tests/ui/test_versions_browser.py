""" "Fork from here" in a real browser: Debian's Chromium driven by Playwright (see test_browser).

A completed run of a graph handed to the dashboard; a logged-in browser
clicks the button on one node, lands on the fork's page and sees it end,
without a console error (a CSP violation would be one).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import tailrace as tr
from tailrace.stores import RunStatus, RunStore
from tailrace.ui import UiConfig
from tailrace.ui._links import run_url
from tests.ui.support import TOKEN, in_thread, scenarios, served
from tests.ui.test_browser import CHROMIUM, WAIT_MS, browser, open_page, pytestmark, shots
from tests.ui.test_versions_view import Chain, deploy

__all__ = ["browser", "open_page", "pytestmark", "shots"]  # fixtures and marks, shared

if CHROMIUM is not None:
    from playwright.sync_api import expect


def test_fork_from_here_in_a_browser_lands_on_the_fork_and_follows_it(
    tmp_path: Path, open_page: Any, shots: Path
) -> None:
    factory = scenarios.sqlite_factory(tmp_path / "runs.db")
    chain = Chain()

    async def setup() -> None:
        async with scenarios.opened(factory) as store:
            await tr.Engine(store=store).run(chain.graph, "in", run_id="source")
            await tr.Engine(store=store).run(deploy(1), "v1", run_id="gated")

    in_thread(setup)
    graphs = [chain.graph, deploy(1), deploy(2), deploy(3)]
    config = UiConfig(store=factory, token=TOKEN, location="runs.db", graphs=graphs)
    with served(config) as url:
        page = open_page(f"{url}/login?next=/questions")
        page.goto(url + run_url("gated"))
        versions = page.locator("#other-versions")
        expect(versions.locator("tr.version-ok")).to_contain_text("compatible")
        expect(versions.locator("tr.version-no")).to_contain_text(
            "review: its kind changed from gate to task"
        )
        page.locator("#run-versions").screenshot(path=str(shots / "run-versions.png"))
        page.goto(url + run_url("source"))
        expect(page.locator("#run-version")).to_have_text(chain.graph.fingerprint()[:8])
        row = page.locator("#fork-nodes tr", has_text="b")
        row.get_by_role("button", name="Fork from here").click()
        page.wait_for_url(re.compile(r".*/runs/[0-9a-f]{32}$"), timeout=WAIT_MS)
        fork_id = page.url.rsplit("/", 1)[1]
        expect(page.locator("#resume-note")).to_contain_text(
            "forked here from run 'source' at node 'b': the run is completed", timeout=WAIT_MS
        )
        expect(page.locator("#forked-from")).to_contain_text("source at b")
        page.screenshot(path=str(shots / "run-fork.png"), full_page=True)

    async def check() -> Any:
        async with scenarios.opened(factory) as store:
            return await _record(store, fork_id)

    fork = in_thread(check)
    assert fork.status is RunStatus.COMPLETED and fork.forked_at == "b"
    assert chain.calls == {"a": 1, "b": 2, "c": 2}


async def _record(store: RunStore, run_id: str) -> Any:
    return await store.get_run(run_id)
