"""The run page's streams (S1-S4): one card per attempt, the winner marked, losers greyed, chunk
text escaped; the live stream sends the streams part when rows come."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import tailrace as tr
from tailrace import current_node
from tailrace.stores import SQLiteStore
from tailrace.ui._links import run_url
from tests.ui.support import dashboard, scenarios

HOSTILE = "<script>alert(1)</script><img src=x onerror=alert(2)>"


async def make_run(path: Path) -> None:
    calls = 0

    async def talk(x: int) -> str:
        nonlocal calls
        calls += 1
        ctx = current_node()
        assert ctx is not None
        ctx.stream(f"try {calls}: ")
        ctx.stream(HOSTILE)
        ctx.stream({"n": calls})
        if calls == 1:
            raise RuntimeError("first try fails")
        return "ok"

    g = tr.Graph("streams_view")
    g.add_node("talk", talk, retry=tr.graph.RetryPolicy(attempts=2))
    async with SQLiteStore(path) as store:
        await tr.Engine(store=store).run(g, 0, run_id="streamed")


def test_the_run_page_shows_each_attempts_stream_escaped_with_its_mark(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    asyncio.run(make_run(db))
    with dashboard(scenarios.sqlite_factory(db)) as client:
        page = client.get(run_url("streamed")).text
        body = client.get("/stream/runs/streamed?after=0").text
    assert HOSTILE not in page and "<img" not in page.split('id="run-streams"')[1][:4000]
    escaped = "&lt;script&gt;alert(1)&lt;/script&gt;&lt;img src=x onerror=alert(2)&gt;"
    section = page.split('id="run-streams"', 1)[1].split("</section>", 1)[0]
    cards = section.split('class="stream-card ')[1:]
    assert len(cards) == 2
    assert cards[0].startswith("stream-discarded") and "talk v1 try 1" in cards[0]
    assert f"try 1: {escaped}" in cards[0] and '{"n": 1}' in cards[0].replace("&#34;", '"')
    assert cards[1].startswith("stream-accepted") and "accepted: winner" in cards[1]
    assert "talk v1 try 2" in cards[1]
    update = json.loads(body.split("\n\n")[0].split("data: ", 1)[1])
    part = update["parts"]["run-streams"]
    assert escaped in part and HOSTILE not in part


def test_a_run_that_never_streamed_says_so(tmp_path: Path) -> None:
    async def quiet(path: Path) -> None:
        g = tr.Graph("quiet")
        g.add_node("q", lambda x: x)
        async with SQLiteStore(path) as store:
            await tr.Engine(store=store).run(g, 0, run_id="quiet")

    db = tmp_path / "runs.db"
    asyncio.run(quiet(db))
    with dashboard(scenarios.sqlite_factory(db)) as client:
        page = client.get(run_url("quiet")).text
    assert "no node of this run streamed" in page
