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


async def run_one_node(path: Path, handler: object, run_id: str) -> None:
    """Run a one-node graph named ``run_id`` as run ``run_id`` on a SQLite store at ``path``."""
    g = tr.Graph(run_id)
    g.add_node("talk", handler)  # type: ignore[arg-type]
    async with SQLiteStore(path) as store:
        await tr.Engine(store=store).run(g, 0, run_id=run_id)


def test_a_run_that_never_streamed_says_so(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    asyncio.run(run_one_node(db, lambda x: x, "quiet"))
    with dashboard(scenarios.sqlite_factory(db)) as client:
        page = client.get(run_url("quiet")).text
    assert "no node of this run streamed" in page


CONTROLS = "red\x1b[31m!\x1b[0m bell\x07 nul\x00 c1\x85 invoice\u202egnp.exe"


def test_control_and_bidi_characters_in_chunks_show_escaped_as_tail_prints_them(
    tmp_path: Path,
) -> None:
    async def talk(x: int) -> str:
        ctx = current_node()
        assert ctx is not None
        ctx.stream(CONTROLS)
        ctx.stream({"name": "invoice\u202egnp.exe", "c1": "\x85"})
        return "ok"

    db = tmp_path / "runs.db"
    asyncio.run(run_one_node(db, talk, "controls"))
    with dashboard(scenarios.sqlite_factory(db)) as client:
        page = client.get(run_url("controls")).text
        body = client.get("/stream/runs/controls?after=0").text
    update = json.loads(body.split("\n\n")[0].split("data: ", 1)[1])
    for shown in (page.split('id="run-streams"', 1)[1], update["parts"]["run-streams"]):
        section = shown.split("</section>", 1)[0]
        assert not any(ch in section for ch in "\x1b\x07\x00\x85\u202e"), repr(section)
        assert r"red\x1b[31m!\x1b[0m bell\x07 nul\x00 c1\x85 invoice\u202egnp.exe" in section
        plain = section.replace("&#34;", '"')
        assert r'{"name": "invoice\u202egnp.exe", "c1": "\u0085"}' in plain


def test_the_run_page_holds_each_attempts_tail_not_its_whole_stream(tmp_path: Path) -> None:
    import tracemalloc

    from tailrace.ui._chunks import TEXT_CHARS, read_streams

    piece = "0123456789" * 250  # 2,500 characters a chunk: 10 MB streamed in all

    async def talk(x: int) -> str:
        ctx = current_node()
        assert ctx is not None
        for n in range(4_000):
            ctx.stream(f"{n:06d}{piece}")
        return "ok"

    async def make_and_read(path: Path) -> tuple[object, int]:
        g = tr.Graph("long_stream")
        g.add_node("talk", talk)
        async with SQLiteStore(path) as store:
            await tr.Engine(store=store).run(g, 0, run_id="long")
            tracemalloc.start()
            try:
                streams = await read_streams(store, "long")
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
        return streams, peak

    streams, peak = asyncio.run(make_and_read(tmp_path / "runs.db"))
    [card] = streams.cards  # type: ignore[attr-defined]
    assert card.chunks == 4_000 and card.cut and card.outcome == "accepted"
    assert card.text == (f"{3_999:06d}{piece}" * 2)[-TEXT_CHARS:]
    # What the page holds is a batch of rows and the tail, never the 10 MB streamed.
    assert peak < 6_000_000, peak


def test_the_run_page_reads_only_the_stream_rows_it_shows(tmp_path: Path) -> None:
    from typing import Any

    from tailrace.stores import ChunkRow, StreamTail

    piece = "x" * 100  # 2,000 chunks of 100 characters: the page shows the last 4,000

    async def talk(x: int) -> str:
        ctx = current_node()
        assert ctx is not None
        for n in range(2_000):
            ctx.stream(f"{n:04d}{piece}")
        return "ok"

    read: list[int] = []

    class Counting(SQLiteStore):
        async def chunks(self, run_id: str, **options: Any) -> list[ChunkRow]:
            rows = await super().chunks(run_id, **options)
            read.append(len(rows))
            return rows

        async def stream_tails(self, run_id: str, **options: Any) -> list[StreamTail]:
            tails = await super().stream_tails(run_id, **options)
            read.append(sum(len(t.rows) for t in tails))
            return tails

    db = tmp_path / "runs.db"
    asyncio.run(run_one_node(db, talk, "chatty"))
    factory = lambda read_only: Counting(db, read_only=read_only)  # noqa: E731
    with dashboard(factory) as client:
        page = client.get(run_url("chatty")).text
    section = page.split('id="run-streams"', 1)[1].split("</section>", 1)[0]
    assert f"1999{piece}" in section and "2000 chunks" in section
    # The rows holding the 4,000 characters shown (40 or so, twice at most) and the mark,
    # not all 2,001.
    assert 0 < sum(read) <= 100, read
