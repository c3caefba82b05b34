"""A span processor that raises never changes a run: not its outcome, not what is stored.

A real OpenTelemetry SDK provider with a processor that raises on start, on
end, or on both; the run is durable on a real SQLite file and must complete
once, stored once, with the same results as an untraced run.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tailrace import Engine, Graph
from tailrace.integrations.otel import instrument
from tailrace.stores import RunStatus, SQLiteStore


class Raising(SpanProcessor):
    """Raises from the hooks named in ``on``."""

    def __init__(self, on: set[str]) -> None:
        self.on = on
        self.calls = 0

    def on_start(self, span: Span, parent_context: object = None) -> None:
        if "start" in self.on:
            self.calls += 1
            raise RuntimeError("span processor broke on start")

    def on_end(self, span: ReadableSpan) -> None:
        if "end" in self.on:
            self.calls += 1
            raise RuntimeError("span processor broke on end")


def pipeline() -> Graph:
    g = Graph("traced")

    @g.task()
    async def fetch(x: int) -> int:
        return x + 1

    @g.task()
    async def double(x: int) -> int:
        return 2 * x

    g.add_edge("fetch", "double")
    return g


@pytest.mark.parametrize("on", [{"start"}, {"end"}, {"start", "end"}])
async def test_a_raising_span_processor_never_changes_the_run(
    tmp_path: Path, on: set[str], caplog: pytest.LogCaptureFixture
) -> None:
    raising = Raising(on)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(raising)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    async with SQLiteStore(tmp_path / "runs.db") as store:
        engine = Engine(store=store)
        with (
            caplog.at_level(logging.WARNING, logger="tailrace.otel"),
            instrument(engine, tracer_provider=provider),
        ):
            result = await engine.run(pipeline(), 20, run_id="r1")
        assert result.status is RunStatus.COMPLETED and result.output == 42
        runs = await store.list_runs()
        assert [(r.run_id, r.status) for r in runs] == [("r1", RunStatus.COMPLETED)]
        events = [e.type for e in await store.events("r1")]
        assert events.count("node_completed") == 2 and events[-1] == "run_completed"
    assert raising.calls > 0
    said = [r for r in caplog.records if "tracing failed" in r.getMessage()]
    assert len(said) == 1  # said once, however many spans failed
    provider.shutdown()
