"""Queues, workers and cancelling through the dashboard (the fleet's store ledger)."""

from __future__ import annotations

import asyncio
import re

import tailrace as tr
from tailrace.stores import Queue, RunStatus
from tailrace.ui._fleet import limits_text
from tests.ui.support import TOKEN, Factory, dashboard, scenarios


def fleet(factory: Factory) -> None:
    async def make() -> None:
        async with scenarios.opened(factory) as store:
            await scenarios.fleet(store)

    asyncio.run(make())


def status_of(factory: Factory, run_id: str) -> RunStatus:
    async def read() -> RunStatus:
        async with scenarios.opened(factory) as store:
            return (await store.get_run(run_id)).status

    return asyncio.run(read())


def test_the_queues_page_shows_depth_limits_and_workers(any_db: Factory) -> None:
    fleet(any_db)
    with dashboard(any_db) as client:
        page = client.get("/queues").text
    rows = re.findall(r'<td class="mono id"><a href="/runs\?queue=(\w+)">', page)
    assert rows == ["emails", "reports"]
    emails = page[page.index("/runs?queue=emails") : page.index("/runs?queue=reports")]
    assert "2 at once, 100 starts per 1 min" in emails
    assert '<a href="/runs?status=queued&amp;queue=emails"><b>2</b></a>' in emails
    assert "undeclared: no limits" in page
    assert "otherhost:4242:1.0:abc" in page and "w-live" in page


def test_runs_filter_by_queue(any_db: Factory) -> None:
    fleet(any_db)
    with dashboard(any_db) as client:
        emails = client.get("/runs?queue=emails").text
        queued = client.get("/runs?status=queued").text
    ids = re.findall(r'<td class="mono id"><a href="/runs/([^"]+)"', emails)
    assert ids == ["mail-1", "mail-0"] and "in queue <b>emails</b>" in emails
    assert re.findall(r'<td class="mono id"><a href="/runs/([^"]+)"', queued) == [
        "report-0",
        "mail-1",
        "mail-0",
    ]


def test_limits_read_as_words() -> None:
    assert limits_text(None) == "undeclared: no limits"
    assert limits_text(Queue("q")) == "no limits"
    assert (
        limits_text(Queue("q", worker_concurrency=1, limit=5, period=0.5))
        == "1 per worker, 5 starts per 500 ms"
    )


def test_cancel_ends_a_queued_a_suspended_and_an_orphaned_run_and_needs_the_token(
    sqlite_db: Factory,
) -> None:
    fleet(sqlite_db)

    async def more() -> None:
        async with scenarios.opened(sqlite_db) as store:
            await tr.Engine(store=store).run(scenarios.approval, "x", run_id="waiting")
            await scenarios.cut_and_resume(store, "orphan", resume=False)

    asyncio.run(more())
    with dashboard(sqlite_db) as client:
        assert 'action="/cancel/runs/mail-0"' in client.get("/runs/mail-0").text
        assert client.post("/cancel/runs/mail-0").status_code == 403
        assert status_of(sqlite_db, "mail-0") is RunStatus.QUEUED
        done = [
            client.post(f"/cancel/runs/{r}", data={"token": TOKEN})
            for r in ("mail-0", "waiting", "orphan")
        ]
        page = client.get(done[0].headers["location"]).text
        finished = client.get("/runs/direct").text
    assert [r.headers["location"] for r in done] == [
        f"/runs/{r}?cancelled=1" for r in ("mail-0", "waiting", "orphan")
    ]
    assert [status_of(sqlite_db, r) for r in ("mail-0", "waiting", "orphan")] == [
        RunStatus.CANCELLED
    ] * 3
    assert "You asked to cancel this run." in page and 'id="run-status">cancelled<' in page
    assert "Cancel run" not in page and "Cancel run" not in finished


def test_read_only_offers_no_cancel(sqlite_db: Factory) -> None:
    fleet(sqlite_db)
    with dashboard(sqlite_db, read_only=True) as client:
        page = client.get("/runs/mail-0").text
        refused = client.post("/cancel/runs/mail-0", data={"token": TOKEN})
    assert "Cancel run" not in page and refused.status_code == 403
    assert status_of(sqlite_db, "mail-0") is RunStatus.QUEUED
