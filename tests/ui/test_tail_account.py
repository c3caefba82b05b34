"""The tail's account on the run page (X4): what ``tailrace show`` prints, and the length
distributions behind its KS distance, for each map node whose items are model generations.

Real generations against the project's batching test server, runs on a real SQLite
file, the app under TestClient; the account the page shows is checked against
``tail_accounting`` read through an engine, for a finished run, for a run being
watched live (its page's stream reads the rows once, on from where it stopped),
and for a run whose driver was SIGKILLed mid-generation and resumed.
"""

from __future__ import annotations

import asyncio
import html
import json
import os
import re
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("httpx")

import tailrace as tr
from tailrace.graph import MAX_PARKS
from tailrace.integrations.openai import BatchingServer, ModelClient, TailAccount, tail_accounting
from tailrace.stores import ChunkRow, SQLiteStore
from tailrace.ui._accounts import PAGE, cdf, lengths_of
from tailrace.ui._links import run_url
from tests import fixtures
from tests.cli.test_rollouts import no_generations, two_rounds
from tests.integrations.openai import rollout_graphs
from tests.integrations.openai.test_faults import ROOT, prompts_of
from tests.ui.support import Background, dashboard, scenarios


def tail_section(page: str) -> str:
    """The tail account's card (empty when the page shows none)."""
    start = page.index('id="run-tail"')
    return page[start : page.index('id="run-parked"', start)]


def page_data(page: str) -> Any:
    found = re.search(r'id="page-data">(.*?)</script>', page, re.S)
    assert found is not None
    return json.loads(found.group(1))


def measures_of(part: str) -> list[tuple[str, str]]:
    """The (measure, value) rows of the first tail-measures table in ``part``, as text."""
    table = part[part.index('class="compact tail-measures"') :]
    table = table[: table.index("</table>")]
    return [
        (html.unescape(m), html.unescape(v))
        for m, v in re.findall(r'<tr><td>(.*?)</td><td class="mono">(.*?)</td></tr>', table)
    ]


async def account_of(db: Path, graph: str, node: str, run_id: str) -> TailAccount:
    async with SQLiteStore(db, read_only=True) as store:
        return await tail_accounting(tr.Engine(store=store), graph, node, run_id)


def test_the_run_page_shows_the_tail_account_of_a_map_of_generations(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    first, second = asyncio.run(two_rounds(db))  # 6 launched, 4 kept, 2 parked; then continued
    with dashboard(scenarios.sqlite_factory(db)) as client:
        pages = [client.get(run_url(run_id)).text for run_id in (first, second)]
    for page, run_id in zip(pages, (first, second), strict=True):
        account = asyncio.run(account_of(db, "cli_rollouts", "sample", run_id))
        part = tail_section(page)
        assert 'data-node="sample"' in part
        assert measures_of(part) == account.measures()  # what ``tailrace show`` prints
        rows = dict(
            re.findall(r'<tr class="lengths-(\w+)"><td>.*?</td><td class="num">(\d+)</td>', part)
        )
        assert rows == {"accepted": str(account.accepted), "launched": str(account.launched)}
        assert f"KS distance <b>{account.ks:.3f}</b>" in part
    first_measures = dict(measures_of(tail_section(pages[0])))
    assert first_measures["items launched / accepted / parked / cancelled"] == "6 / 4 / 2 / 0"
    assert "(2 not final)" in tail_section(pages[0])  # the parked lengths are lower bounds
    assert dict(measures_of(tail_section(pages[1])))["accepted under another model version"] == "2"
    assert pages[0].count('<polyline class="cdf-line') == 2  # accepted and launched


def test_the_tail_account_bounds_starvation_by_the_maps_own_max_parks(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    first = asyncio.run(two_rounds(db))[0]  # its map: required=4, late="park"
    graph = tr.Graph("cli_rollouts")  # the run's graph, as --graphs hands it to the dashboard
    graph.add_node("sample", lambda p: p, "map", required=4, late="park", resume_parked=True,
                   max_parks=1)  # fmt: skip
    with dashboard(scenarios.sqlite_factory(db), graphs=(graph,)) as client:
        named = dict(measures_of(tail_section(client.get(run_url(first)).text)))
    with dashboard(scenarios.sqlite_factory(db)) as client:
        unknown = dict(measures_of(tail_section(client.get(run_url(first)).text)))
    # the map parks an item once at most (P5): both parked items starve at that bound
    assert named["most rounds waited"].endswith("(bound 1)")
    assert named["starving parked items"].count(f"{first}/sample/") == 2
    assert unknown["most rounds waited"].endswith(f"(bound {MAX_PARKS})")
    assert unknown["starving parked items"] == "none"


def test_a_run_without_generations_shows_no_tail_account_and_reads_no_stream_rows(
    tmp_path: Path,
) -> None:
    db = tmp_path / "runs.db"
    run_id = asyncio.run(no_generations(db))  # a map streaming text, a task streaming "usage"
    read: list[int] = []

    class Counting(SQLiteStore):
        async def chunks(self, run_id: str, **options: Any) -> list[ChunkRow]:
            rows = await super().chunks(run_id, **options)
            read.append(len(rows))
            return rows

    factory = lambda read_only: Counting(db, read_only=read_only)  # noqa: E731
    with dashboard(factory) as client:
        page = client.get(run_url(run_id)).text
    assert tail_section(page) == 'id="run-tail"></div>\n<div '
    assert read == []  # its stream tails said no generation: the rows were not read


def test_a_watched_run_gets_its_tail_account_live_as_its_generations_end(tmp_path: Path) -> None:
    """The page opens before any generation ended; its stream's updates carry the account as
    they end, and the last one is the account of the whole run."""
    db = tmp_path / "runs.db"
    read: list[int] = []  # rows of each read of the run's rows for the account

    class Counting(SQLiteStore):
        async def chunks(self, run_id: str, **options: Any) -> list[ChunkRow]:
            rows = await super().chunks(run_id, **options)
            if options.get("limit") == PAGE:
                read.append(len(rows))
            return rows

    factory = lambda read_only: Counting(db, read_only=read_only)  # noqa: E731
    go = threading.Event()  # the generations start once the page follows the run

    async def drive() -> tr.RunResult:
        async with (
            BatchingServer(median_tokens=40, step=0.01) as server,
            ModelClient(server.url, "m", version="v1") as client,
            SQLiteStore(db) as store,
        ):
            g = tr.Graph("watched")

            async def sample(prompt: str) -> str:
                await asyncio.to_thread(go.wait, scenarios.GUARD)
                return (await client.complete(prompt, max_tokens=400)).text

            g.add_node("sample", sample, "map", required=4, late="park")
            return await tr.Engine(store=store).run(g, prompts_of(server, 4, 3), run_id="watched")

    async def items_started() -> bool:
        async with SQLiteStore(db) as store:
            return await scenarios.started(store, "watched", "sample")

    run = Background(drive)
    asyncio.run(fixtures.until(items_started, "the map's items started"))
    parts: list[str] = []
    try:
        with dashboard(factory, poll_interval=0.02) as client:
            page = client.get(run_url("watched")).text
            assert tail_section(page) == 'id="run-tail"></div>\n<div '  # nothing ended yet
            with client.stream("GET", page_data(page)["stream"]) as events:
                for line in events.iter_lines():
                    if line.startswith("data: "):
                        go.set()  # the page follows the run: let the generations go
                        update = json.loads(line.removeprefix("data: "))
                        if "run-tail" in update.get("parts", {}):
                            parts.append(update["parts"]["run-tail"])
            followed = sum(read)
            final = client.get(run_url("watched")).text
    finally:
        go.set()
    assert run.join().status == "completed"
    account = asyncio.run(account_of(db, "watched", "sample", "watched"))
    assert measures_of(tail_section(final)) == account.measures()
    shown = [measures_of(part) for part in parts if "tail-measures" in part]
    assert shown, "the live page received the tail account"
    assert shown[-1] == account.measures()  # read on incrementally, it adds up the same
    total = sum(read) - followed  # the last page read every row once
    assert 0 < followed <= total  # the live page read each row once, not once per update


@pytest.mark.slow  # a child process, SIGKILLed mid-generation
def test_after_a_crash_mid_generation_the_page_accounts_like_tail_accounting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attempts cut by the crash end with no usage chunk (their stream is marked discarded by
    the resume): the page counts what they streamed, exactly as ``tail_accounting`` does."""
    db = tmp_path / "runs.db"

    async def crash_and_resume() -> None:
        async with BatchingServer(median_tokens=40, step=0.01) as server:
            prompts = prompts_of(server, 2, 3)
            monkeypatch.setenv("ROLLOUT_URLS", server.url)
            child = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "tests.integrations.openai.rollout_graphs", str(db),
                "crashed", server.url, *prompts, cwd=ROOT,
            )  # fmt: skip
            try:
                async with SQLiteStore(db) as store:

                    async def streaming() -> bool:
                        try:
                            rows = await store.chunks("crashed", limit=10_000)
                        except tr.RunNotFound:
                            return False
                        usage = sum('"usage"' in (r.data_json or "") for r in rows)
                        text = {r.item for r in rows if '"tokens"' in (r.data_json or "")}
                        return usage >= 1 and len(text) >= 4  # some ended, others mid-stream

                    await fixtures.until(streaming, "generations under way")
                    os.kill(child.pid, signal.SIGKILL)
                    await child.wait()
                    result = await tr.Engine(store=store).resume("crashed", rollout_graphs.graph)
                    assert result.status == "completed"
            finally:
                if child.returncode is None:
                    child.kill()
                    await child.wait()
            assert child.returncode == -signal.SIGKILL

    asyncio.run(crash_and_resume())
    with dashboard(scenarios.sqlite_factory(db)) as client:
        page = client.get(run_url("crashed")).text
    assert 'class="bar o-cut' in page  # the crash is drawn as one
    account = asyncio.run(account_of(db, "llm_rollouts", "rollout", "crashed"))
    assert account.wasted > 0 or account.salvaged > 0  # the cut attempts are in the account
    assert measures_of(tail_section(page)) == account.measures()


def test_the_length_distributions_are_quantiles_and_two_step_cdfs_with_the_ks_gap() -> None:
    accepted, launched = [10, 20, 20, 30], [10, 20, 20, 30, 90, 120]
    assert lengths_of("accepted", accepted).quantiles == (20, 30, 30)
    launched_lengths = lengths_of("launched", launched, censored=2)
    assert (launched_lengths.count, launched_lengths.longest, launched_lengths.censored) == (
        6, 120, 2,
    )  # fmt: skip
    chart = cdf(accepted, launched)
    # The KS gap is where the CDFs are farthest apart: at 30, 1.0 accepted vs 4/6 launched.
    track_h = chart.height - 10 - 24
    assert abs((chart.gap_y2 - chart.gap_y1) - track_h / 3) < 0.2
    assert chart.x_ticks[-1][1] == "120"
    points = [tuple(map(float, p.split(","))) for p in chart.accepted.split()]
    ys = [y for _, y in points]
    assert ys == sorted(ys, reverse=True)  # a CDF only climbs (y grows downwards)
    assert len({x for x, _ in points}) == 5  # 0, each distinct length, the right edge


def test_a_hostile_node_id_and_parked_origin_are_text_in_the_tail_account(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    node = f"sample{scenarios.HOSTILE}"

    async def run() -> str:
        async with (
            BatchingServer(median_tokens=20) as server,
            ModelClient(server.url, "m") as client,
            SQLiteStore(db) as store,
        ):
            g = tr.Graph("hostile_generations")

            async def sample(prompt: str) -> str:
                return (await client.complete(prompt, max_tokens=200)).text

            g.add_node(node, sample, "map", required=2, late="park")
            prompts = [f"{scenarios.HOSTILE} {i}" for i in range(4)]
            result = await tr.Engine(store=store).run(g, prompts, run_id=scenarios.HOSTILE)
            return result.run_id

    run_id = asyncio.run(run())
    with dashboard(scenarios.sqlite_factory(db)) as client:
        page = client.get(run_url(run_id)).text
    part = tail_section(page)
    assert "<script>window.__pwned" not in part and "<img src=x" not in part
    assert html.escape(node)[:40] in part
    account = asyncio.run(account_of(db, "hostile_generations", node, run_id))
    assert measures_of(part) == account.measures()
