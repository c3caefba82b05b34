"""The tail's account on the run span (X4): under ``instrument``, each run span ends with a
``tailrace.tail_account`` event per map node of generations, with the numbers
``tail_accounting`` reads back from the store for the same run; a failed run has one too, a
run the caller cancels and a store that fails as the account is read cost it, never the run.
Spans go to the OpenTelemetry SDK's in-memory exporter; the generations to the batching
test server."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("httpx")
pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import tailrace as tr
from tailrace.graph import MAX_PARKS
from tailrace.integrations.openai import BatchingServer, ModelClient, TailAccount, tail_accounting
from tailrace.integrations.otel import instrument
from tailrace.stores import ParkedStatus, SQLiteStore
from tests import fixtures
from tests.integrations.openai.test_rollouts import rollouts, spread


@pytest.fixture
def exporter() -> Iterator[tuple[InMemorySpanExporter, TracerProvider]]:
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    yield memory, provider
    provider.shutdown()


@pytest.fixture
async def server() -> AsyncIterator[BatchingServer]:
    async with BatchingServer(median_tokens=40, sigma=1.0, step=0.001) as srv:
        yield srv


def run_span(memory: InMemorySpanExporter, run_id: str) -> ReadableSpan:
    """The one run span of ``run_id`` (a run, resume or fork call)."""
    [span] = [
        s
        for s in memory.get_finished_spans()
        if s.attributes and s.attributes.get("tailrace.run_id") == run_id and s.parent is None
    ]
    return span


def accounts_on(span: ReadableSpan) -> dict[str, dict[str, Any]]:
    """Node -> the attributes of its ``tailrace.tail_account`` event on ``span``."""
    found = [dict(e.attributes or {}) for e in span.events if e.name == "tailrace.tail_account"]
    return {str(a.pop("tailrace.node")): a for a in found}


def totals(account: TailAccount) -> dict[str, Any]:
    """What the span's event says of ``account`` (the documented attribute names)."""
    tail = {
        "tokens_decoded": account.decoded, "tokens_salvaged": account.salvaged,
        "tokens_wasted": account.wasted, "tokens_kept": account.kept,
        "items_launched": account.launched, "items_accepted": account.accepted,
        "items_parked": account.parked, "items_cancelled": account.cancelled,
        "items_stale": account.stale, "ks": account.ks, "lengths_censored": account.censored,
        "max_rounds": account.max_rounds, "starvation_bound": account.starvation_bound,
        "items_starving": len(account.starving),
    }  # fmt: skip
    return {f"tailrace.tail.{k}": v for k, v in tail.items()}


@pytest.mark.parametrize("late", ["park", "cancel"])
async def test_each_run_span_ends_with_the_tail_account_of_its_map_of_generations(
    server: BatchingServer, exporter: Any, tmp_path: Path, late: str
) -> None:
    memory, provider = exporter
    clients: dict[str, ModelClient] = {}
    options: dict[str, Any] = {"required": 3, "late": late}
    if late == "park":  # its own bound on parks (P5): the account's starvation bound
        options.update(resume_parked=True, max_parks=2)
    g = rollouts(clients, **options)
    runs = []
    async with SQLiteStore(tmp_path / "runs.db") as store:
        engine = tr.Engine(store=store)
        with instrument(engine, tracer_provider=provider):
            for version, prompts in (("v1", spread(server, 3, 3)), ("v2", spread(server, 2, 1))):
                async with ModelClient(
                    server.url, "m", version=version, checkpoint_every=2
                ) as client:
                    clients["now"] = client
                    runs.append((await engine.run(g, prompts)).run_id)
        for run_id in runs:
            account = await tail_accounting(engine, g, "rollout", run_id)
            assert accounts_on(run_span(memory, run_id)) == {"rollout": totals(account)}
        first, second = [await tail_accounting(engine, g, "rollout", r) for r in runs]
    assert first.decoded > 0 and first.accepted == 3
    assert (first.parked, first.cancelled) == ((3, 0) if late == "park" else (0, 3))
    if late == "park":  # the second round took the parked first: they continued, a round old
        assert first.wasted <= 3 * 2  # at most what followed each parked item's checkpoint
        assert second.salvaged > 0 and second.stale > 0 and second.max_rounds >= 1
        assert first.starvation_bound == second.starvation_bound == 2
    else:  # the losers' tokens were thrown away
        assert first.wasted > 0 and second.salvaged == 0
        assert first.starvation_bound == MAX_PARKS


async def test_a_failed_run_still_ends_with_its_account_and_a_run_without_generations_has_none(
    server: BatchingServer, exporter: Any, tmp_path: Path
) -> None:
    memory, provider = exporter
    g = tr.Graph("fails_after_generating")
    plain = tr.Graph("no_generations")
    plain.add_node("double", lambda x: 2 * x)

    async with (
        SQLiteStore(tmp_path / "runs.db") as store,
        ModelClient(server.url, "m", version="v1") as client,
    ):

        async def rollout(prompt: str) -> str:
            text = (await client.complete(prompt, max_tokens=100)).text
            if prompt == "bad":
                raise ValueError("a judge refused it")
            return text

        g.add_node("rollout", rollout, "map")
        engine = tr.Engine(store=store)
        with instrument(engine, tracer_provider=provider):
            with pytest.raises(ValueError, match="refused"):
                await engine.run(g, ["bad"], run_id="failed")
            await engine.run(plain, 21, run_id="plain")
        account = await tail_accounting(engine, g, "rollout", "failed")
    span = run_span(memory, "failed")
    assert span.attributes and span.attributes["tailrace.outcome"] == "failed"
    assert accounts_on(span) == {"rollout": totals(account)}
    assert account.decoded == server.length("bad", None) and account.accepted == 0
    assert accounts_on(run_span(memory, "plain")) == {}


class ParkedReadFails(SQLiteStore):
    """A SQLite store whose read of a run's parked items fails (once the run is done)."""

    async def list_parked(self, **where: Any) -> list[Any]:
        if where.get("run_id") is not None:
            raise tr.StoreError("injected: the parked items cannot be read")
        return await super().list_parked(**where)


async def test_a_store_failing_as_the_account_is_read_costs_the_account_never_the_run(
    server: BatchingServer,
    exporter: Any,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    memory, provider = exporter
    async with (
        ParkedReadFails(tmp_path / "runs.db") as store,
        ModelClient(server.url, "m") as client,
    ):
        engine = tr.Engine(store=store)
        g = rollouts({"now": client}, required=2, late="park")
        with (
            caplog.at_level(logging.WARNING, "tailrace.otel"),
            instrument(engine, tracer_provider=provider),
        ):
            result = await engine.run(g, spread(server, 2, 2), run_id="r")
        parked = await store.list_parked(graph_name=g.name, status=ParkedStatus.PARKED)
    assert result.status == "completed" and len(result.output) == 2 and len(parked) == 2
    span = run_span(memory, "r")
    assert accounts_on(span) == {} and span.attributes["tailrace.outcome"] == "completed"
    assert [r.message for r in caplog.records].count(
        "tracing failed (the tail's account); runs go on, untraced where the tracer fails "
        "(logged once)"
    ) == 1


async def test_a_run_its_caller_cancels_mid_generation_ends_its_span_without_an_account(
    server: BatchingServer, exporter: Any, tmp_path: Path
) -> None:
    memory, provider = exporter
    slow = max((f"slow {i}" for i in range(100)), key=lambda p: server.length(p, None))
    async with SQLiteStore(tmp_path / "runs.db") as store, ModelClient(server.url, "m") as client:
        engine = tr.Engine(store=store)
        g = rollouts({"now": client})
        with instrument(engine, tracer_provider=provider):
            task = asyncio.create_task(engine.run(g, [slow], run_id="cut"))
            await fixtures.until(lambda: server.stats.running == 1, "the generation started")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
    await fixtures.until(lambda: server.stats.running == 0, "the server stopped generating")
    span = run_span(memory, "cut")
    assert span.attributes and span.attributes["tailrace.outcome"] == "cancelled"
    assert accounts_on(span) == {}
    assert server.stats.disconnected == 1
