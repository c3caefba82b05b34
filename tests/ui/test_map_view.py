"""A map node seen everywhere a node is: the dashboard's Gantt and map table, ``tailrace show``,
and OpenTelemetry spans (M2): item rows, folded beyond a screenful with the slowest kept."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import tailrace as tr
from tailrace import current_node
from tailrace._attempts import Outcome, attempts_from_events, fold_items, map_summaries
from tailrace.integrations.otel import instrument
from tailrace.stores import ParkedRow, SQLiteStore
from tailrace.ui._links import run_url
from tests.cli.test_cli import invoke
from tests.ui.support import dashboard, scenarios

ITEMS = 80
SLOW = (17, 63)  # the stragglers: they must stay visible when rows fold


def rollouts() -> tr.Graph:
    g = tr.Graph("rollouts_view")

    @g.task()
    def prompts(n: int) -> list[int]:
        return list(range(n))

    @g.map(required=60, errors="skip")  # late="record": the stragglers run to their end
    async def rollout(x: int) -> int:
        await asyncio.sleep(0.05 if x in SLOW else 0.001)
        if x == 5:
            raise ValueError("rollout five diverged")
        return x

    g.chain("prompts", "rollout")
    return g


async def make_run(path: Path, run_id: str = "map-view") -> tr.RunResult:
    async with SQLiteStore(path) as store:
        return await tr.Engine(store=store, capacity=ITEMS).run(rollouts(), ITEMS, run_id=run_id)


@pytest.fixture
def map_run(tmp_path: Path) -> Path:
    path = tmp_path / "runs.db"
    result = asyncio.run(make_run(path))
    assert result.status == "completed" and len(result.output) == 60
    return path


async def read_events(path: Path) -> list[Any]:
    async with SQLiteStore(path, read_only=True) as store:
        return list(await store.events("map-view"))


def test_attempts_summarise_each_map_visit_and_fold_all_but_the_slowest(map_run: Path) -> None:
    events = asyncio.run(read_events(map_run))
    attempts = attempts_from_events(events, live=False)
    (summary,) = map_summaries(events, attempts)
    assert (summary.node_id, summary.visit, summary.items, summary.k) == ("rollout", 1, ITEMS, 60)
    assert summary.completed == 60 and summary.failed == 1
    assert summary.completed + summary.failed + summary.cancelled + summary.late == ITEMS
    assert summary.winners is not None and 5 not in summary.winners
    folded = fold_items(attempts, keep=10)
    items = [a for a in folded if a.node_id == "rollout" and a.item is not None]
    assert len(items) == 10
    (rest,) = [a for a in folded if a.folded]
    assert rest.folded == ITEMS - 10 and rest.label == "rollout#1[70 more items]"
    assert set(SLOW) <= {a.item for a in items}  # the stragglers are kept
    assert all(a.late for a in items if a.item in SLOW and a.outcome is Outcome.COMPLETED)


def test_the_run_page_shows_the_map_table_and_a_screenful_of_item_rows(map_run: Path) -> None:
    with dashboard(scenarios.sqlite_factory(map_run)) as client:
        page = client.get(run_url("map-view")).text
    assert 'id="run-maps"' in page
    table = page[page.index('id="run-maps"') :]
    assert "rollout#1" in table and f'<td class="num">{ITEMS}</td>' in table
    rows = re.findall(r"rollout#1\[(\d+)\]", page)
    assert 0 < len(set(rows)) <= 30  # item rows, folded beyond a screenful
    assert all(str(j) in rows for j in SLOW)  # the stragglers are kept
    assert "more items]" in page
    assert "rollout#1[5]" in page or "failed" in table  # the failed item is counted


def test_show_prints_the_map_summary_and_folded_timeline(map_run: Path) -> None:
    result = invoke("show", "map-view", "--db", map_run)
    assert result.exit_code == 0, result.output
    assert "map items" in result.output
    assert "rollout#1" in result.output
    assert "more items]" in result.output
    assert "traceback of node rollout item 5 attempt 1" in result.output


async def test_one_span_per_item_attempt_under_the_run_span(tmp_path: Path) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    g = tr.Graph("traced_map")

    @g.task()
    def prompts(n: int) -> list[int]:
        return list(range(n))

    @g.map(retry=tr.RetryPolicy(attempts=2))
    async def each(x: int) -> int:
        ctx = current_node()
        assert ctx is not None
        if x == 2 and ctx.attempt == 1:
            raise ConnectionError("once")
        return x

    g.chain("prompts", "each")
    async with SQLiteStore(tmp_path / "runs.db") as store:
        engine = tr.Engine(store=store)
        instrument(engine, tracer_provider=provider)
        result = await engine.run(g, 4)
    assert result.output == [0, 1, 2, 3]
    spans = exporter.get_finished_spans()
    items = sorted(
        (s.attributes["tailrace.item"], s.attributes["tailrace.attempt"])
        for s in spans
        if s.name == "tailrace.node each" and "tailrace.item" in (s.attributes or {})
    )
    assert items == [(0, 1), (1, 1), (2, 1), (2, 2), (3, 1)]
    (map_span,) = [
        s for s in spans if s.name == "tailrace.node each" and "tailrace.item" not in s.attributes
    ]
    assert map_span.attributes["tailrace.outcome"] == "completed"
    (run_span,) = [s for s in spans if s.parent is None]
    assert all(
        s.parent is not None and s.parent.span_id == run_span.context.span_id
        for s in spans
        if s.name.startswith("tailrace.node")
    )


def test_the_run_page_shows_parked_items_and_a_checkpoint_mark(tmp_path: Path) -> None:
    from tests.durable.test_checkpoints import rollouts

    path = tmp_path / "parked.db"

    async def park() -> None:
        async with SQLiteStore(path) as store:
            await tr.Engine(store=store).run(rollouts([]), 1, run_id="parked-view")

    asyncio.run(park())
    with dashboard(scenarios.sqlite_factory(path)) as client:
        page = client.get(run_url("parked-view")).text
    assert 'id="run-parked"' in page
    parked = page[page.index('id="run-parked"') :]
    parked = parked[: parked.index("</table>")]
    assert parked.count('<td class="mono">roll</td>') == 2
    assert 'class="checkpoint-mark"' in page  # the winners' last checkpoints, on their bars


def test_the_run_page_reads_parked_items_only_of_the_nodes_its_run_parked_at(
    tmp_path: Path,
) -> None:
    from tests.durable.test_checkpoints import rollouts

    path = tmp_path / "parked.db"
    read: list[tuple[dict[str, object], int]] = []

    class Counting(SQLiteStore):
        async def list_parked(self, **options: Any) -> list[ParkedRow]:
            rows = await super().list_parked(**options)
            read.append((options, len(rows)))
            return rows

    async def runs() -> None:
        async with SQLiteStore(path) as store:
            engine = tr.Engine(store=store)
            await engine.run(rollouts([]), 1, run_id="parked-two")  # parks 2 of 6
            await engine.run(rollouts([], late="cancel"), 1, run_id="parked-none")

    asyncio.run(runs())
    factory = lambda read_only: Counting(path, read_only=read_only)  # noqa: E731
    with dashboard(factory) as client:
        page = client.get(run_url("parked-none")).text
        assert "parked-none" in page and read == []  # nothing parked: no parked row read
        page = client.get(run_url("parked-two")).text
    parked = page[page.index('id="run-parked"') :]
    assert parked[: parked.index("</table>")].count('<td class="mono">roll</td>') == 2
    assert [options.get("node_id") for options, _ in read] == ["roll"]


def test_the_run_page_reads_only_the_parked_items_of_its_own_run(tmp_path: Path) -> None:
    from tests.durable.test_checkpoints import rollouts

    path = tmp_path / "parked.db"
    read: list[int] = []

    class Counting(SQLiteStore):
        async def list_parked(self, **options: Any) -> list[ParkedRow]:
            rows = await super().list_parked(**options)
            read.append(len(rows))
            return rows

    async def runs() -> None:
        async with SQLiteStore(path) as store:
            engine = tr.Engine(store=store)
            for n in range(3):  # each parks 2 items under the same graph and node
                await engine.run(rollouts([]), 1, run_id=f"parked-{n}")

    async def parked_by_run() -> dict[str, int]:
        async with SQLiteStore(path) as store:
            rows = await store.list_parked(
                graph_name="parked_rollouts", node_id="roll", status=None
            )
        return {r: sum(p.run_id == r for p in rows) for r in {p.run_id for p in rows}}

    asyncio.run(runs())
    counts = asyncio.run(parked_by_run())
    own = counts["parked-1"]
    assert 0 < own < sum(counts.values())
    factory = lambda read_only: Counting(path, read_only=read_only)  # noqa: E731
    with dashboard(factory) as client:
        page = client.get(run_url("parked-1")).text
    parked = page[page.index('id="run-parked"') :]
    assert parked[: parked.index("</table>")].count('<td class="mono">roll</td>') == own
    assert sum(read) == own, read  # its own items, not every item parked at its node
