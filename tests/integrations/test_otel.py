"""OpenTelemetry tracing (issue 12): the span tree of runs, attempts and the user's own spans.

Spans go to the SDK's ``InMemorySpanExporter``; a span processor also keeps
every span that started, so each test can check that none was left open.
Straggler timers run on pre-trained estimates (3 x 10 ms) and handlers wait on
events, never on sleeps; every run a bug could hang is bounded by
``asyncio.timeout``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

import tailrace as tr
from tailrace.executors import LocalExecutor
from tailrace.integrations.otel import Instrumentation, OtelExecutor, instrument
from tailrace.stores import SQLiteStore
from tailrace.tail import HedgePolicy
from tailrace.tail._hooks import TailHooks

GUARD = 10.0  # seconds; only there so that a bug fails the test instead of hanging it
FAST = 0.01  # pre-trained estimate: the straggler timer fires after 3 x 10 ms


class OpenSpans(SpanProcessor):
    """Keeps the spans that started and have not ended."""

    def __init__(self) -> None:
        self.open: dict[int, Span] = {}
        self.lock = threading.Lock()

    def on_start(self, span: Span, parent_context: Any = None) -> None:
        with self.lock:
            self.open[span.context.span_id] = span

    def on_end(self, span: ReadableSpan) -> None:
        with self.lock:
            self.open.pop(span.context.span_id, None)


class Traces:
    """A tracer provider wired to an in-memory exporter, and what it recorded."""

    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.open_spans = OpenSpans()
        self.provider = TracerProvider()
        self.provider.add_span_processor(self.open_spans)
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.tracer = self.provider.get_tracer("test")

    def spans(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())

    def named(self, name: str) -> list[ReadableSpan]:
        return [s for s in self.spans() if s.name == name]

    def one(self, name: str) -> ReadableSpan:
        [span] = self.named(name)
        return span

    def children(self, parent: ReadableSpan) -> list[ReadableSpan]:
        return [s for s in self.spans() if s.parent and s.parent.span_id == parent.context.span_id]

    def left_open(self) -> list[str]:
        return sorted(s.name for s in self.open_spans.open.values())


@pytest.fixture
def traces() -> Iterator[Traces]:
    t = Traces()
    yield t
    t.provider.shutdown()


@pytest.fixture(params=["memory", "sqlite"])
async def engine_store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Any]:
    """No store (events published before handlers run) or SQLite (handlers run before the commit)."""
    if request.param == "memory":
        yield None
        return
    async with SQLiteStore(tmp_path / "runs.db") as store:
        yield store


def trained(**seconds: float) -> TailHooks:
    """A TailHooks whose estimator for each key already answers ``seconds``."""
    hooks = TailHooks(factor=3.0)
    for key, value in seconds.items():
        for _ in range(3):
            hooks.estimator(key).observe(1.0, value)
    return hooks


def attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def events_named(span: ReadableSpan, name: str) -> list[dict[str, Any]]:
    return [dict(e.attributes or {}) for e in span.events if e.name == name]


async def hang() -> None:
    await asyncio.Event().wait()


# -- a fan-out into a first-k merge ---------------------------------------------------------


def first_k_graph(straggled: asyncio.Event, fired: asyncio.Event, tracer: Any) -> tr.Graph:
    """src -> a, b, slow -> join (first 2 of 3) -> sink; slow finishes late, after straggling."""
    g = tr.Graph("fan")

    @g.task()
    async def src(x: Any) -> Any:
        return x

    @g.task()
    async def a(x: Any) -> str:
        with tracer.start_as_current_span("llm"):
            return "a"

    @g.task()
    async def b(x: Any) -> str:
        return "b"

    @g.task()
    async def slow(x: Any) -> str:
        await straggled.wait()
        await fired.wait()
        return "slow"

    @g.aggregate(required=2)
    async def join(xs: list[Any]) -> list[Any]:
        fired.set()
        return xs

    @g.task()
    async def sink(xs: list[Any]) -> list[Any]:
        return xs

    for branch in ("a", "b", "slow"):
        g.chain("src", branch, "join")
    g.chain("join", "sink")
    return g


async def test_first_k_fan_out_span_tree(traces: Traces, engine_store: Any) -> None:
    straggled, fired = asyncio.Event(), asyncio.Event()
    engine = tr.Engine(store=engine_store, tail=trained(slow=FAST))
    engine.bus.subscribe(lambda e: straggled.set(), tr.EventType.NODE_STRAGGLER)
    instrument(engine, tracer_provider=traces.provider)
    async with asyncio.timeout(GUARD):
        result = await engine.run(first_k_graph(straggled, fired, traces.tracer), 1, run_id="r1")

    assert result.status == "completed" and result.output == ["a", "b"]
    assert traces.left_open() == []
    root = traces.one("tailrace.run fan")
    assert root.parent is None
    assert attrs(root) == {
        "tailrace.run_id": "r1",
        "tailrace.graph": "fan",
        "tailrace.outcome": "completed",
    }
    attempts = {attrs(s)["tailrace.node"]: s for s in traces.children(root)}
    assert sorted(attempts) == ["a", "b", "join", "sink", "slow", "src"]
    for node, span in attempts.items():
        assert span.name == f"tailrace.node {node}"
        assert span.context.trace_id == root.context.trace_id
        assert attrs(span) == {
            "tailrace.run_id": "r1",
            "tailrace.node": node,
            "tailrace.visit": 1,
            "tailrace.attempt": 1,
            "tailrace.backup": False,
            "tailrace.hedged": False,
            "tailrace.straggler": node == "slow",
            "tailrace.executor": "local",
            "tailrace.outcome": "completed",
        }
    [flag] = events_named(attempts["slow"], "straggler")
    assert flag["factor"] == 3.0 and flag["estimate"] == pytest.approx(FAST)
    # The late input is on the run span, naming the merge and the input that missed it (E5).
    [late] = events_named(root, "late_input")
    assert (late["tailrace.node"], late["tailrace.source"], late["tailrace.visit"]) == (
        "join",
        "slow",
        1,
    )
    assert [f["tailrace.node"] for f in events_named(root, "aggregate_fired")] == ["join"]
    # The user's span inside handler a is a child of a's attempt span.
    llm = traces.one("llm")
    assert llm.parent is not None and llm.parent.span_id == attempts["a"].context.span_id


# -- retries, hedges, failures --------------------------------------------------------------


async def test_retry_has_one_span_per_try(traces: Traces, engine_store: Any) -> None:
    calls = 0

    async def flaky(x: Any) -> str:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise ConnectionError(f"try {calls} broke")
        return "ok"

    g = tr.Graph("retry")
    g.add_node("flaky", flaky, retry=tr.RetryPolicy(attempts=3))
    engine = tr.Engine(store=engine_store)
    instrument(engine, tracer_provider=traces.provider)
    async with asyncio.timeout(GUARD):
        result = await engine.run(g, 0)

    assert result.output == "ok"
    assert traces.left_open() == []
    root = traces.one("tailrace.run retry")
    tries = sorted(traces.children(root), key=lambda s: attrs(s)["tailrace.attempt"])
    assert [(attrs(s)["tailrace.attempt"], attrs(s)["tailrace.outcome"]) for s in tries] == [
        (1, "retrying"),
        (2, "retrying"),
        (3, "completed"),
    ]
    assert [s.status.status_code for s in tries] == [
        StatusCode.ERROR,
        StatusCode.ERROR,
        StatusCode.UNSET,
    ]
    for number, span in enumerate(tries[:2], start=1):
        [exc] = events_named(span, "exception")
        assert exc["exception.type"] == "ConnectionError"
        assert exc["exception.message"] == f"try {number} broke"
    assert all(attrs(s)["tailrace.visit"] == 1 for s in tries)


async def test_hedge_has_two_attempt_spans_and_the_loser_is_cancelled(
    traces: Traces, engine_store: Any
) -> None:
    calls = 0

    async def h(x: Any) -> str:
        nonlocal calls
        calls += 1
        if calls == 1:
            await hang()  # the primary straggles; its backup wins
        return f"attempt {calls}"

    g = tr.Graph("hedge")
    g.add_node("h", h, hedge=True)
    engine = tr.Engine(store=engine_store, tail=trained(h=FAST))
    instrument(engine, tracer_provider=traces.provider)
    async with asyncio.timeout(GUARD):
        result = await engine.run(g, 0)

    assert (result.output, result.hedges) == ("attempt 2", 1)
    assert traces.left_open() == []
    root = traces.one("tailrace.run hedge")
    spans = traces.children(root)
    assert len(spans) == 2
    [primary] = [s for s in spans if not attrs(s)["tailrace.backup"]]
    [backup] = [s for s in spans if attrs(s)["tailrace.backup"]]
    assert attrs(primary) == {
        "tailrace.run_id": result.run_id,
        "tailrace.node": "h",
        "tailrace.visit": 1,
        "tailrace.attempt": 1,
        "tailrace.backup": False,
        "tailrace.hedged": True,
        "tailrace.straggler": True,
        "tailrace.executor": "local",
        "tailrace.outcome": "cancelled",
    }
    assert attrs(backup)["tailrace.outcome"] == "completed"
    assert attrs(backup)["tailrace.hedged"] is True
    assert attrs(backup)["tailrace.straggler"] is False
    assert primary.status.status_code is StatusCode.UNSET  # cancelled on purpose, not an error
    assert (attrs(root)["tailrace.hedges"], attrs(root)["tailrace.hedges_refused"]) == (1, 0)
    assert "tailrace.hedge_budget" not in attrs(root)  # no hedge policy: unbudgeted


async def test_a_run_span_counts_the_backups_its_budget_allowed_and_refused(
    traces: Traces, engine_store: Any
) -> None:
    # One token, nothing refills it: "a" is backed up, "b" waits for a token until its
    # primary ends. The run span counts both; b's span says its backup was refused (T5).
    hooks = TailHooks(
        hedging=HedgePolicy(budget=0.0, burst=1.0, backup_after=1.0, slack=0.0, tolerance=9.0)
    )
    for _ in range(3):
        hooks.estimator("stall").observe(1.0, FAST)
    hedged = asyncio.Event()

    async def stall(x: Any) -> str:
        if not tr.current_node(required=True).backup:
            await hedged.wait()
        return "done"

    g = tr.Graph("budgeted")
    for name in ("a", "b"):
        g.add_node(name, stall, hedge=True, estimate_key="stall")
    engine = tr.Engine(store=engine_store, tail=hooks)
    engine.bus.subscribe(lambda e: hedged.set(), tr.EventType.NODE_HEDGED)
    instrument(engine, tracer_provider=traces.provider)
    async with asyncio.timeout(GUARD):
        result = await engine.run(g, 0)

    assert (result.hedges, result.hedges_refused) == (1, 1)
    assert traces.left_open() == []
    root = traces.one("tailrace.run budgeted")
    assert {k: v for k, v in attrs(root).items() if "hedge" in k} == {
        "tailrace.hedges": 1,
        "tailrace.hedges_refused": 1,
        "tailrace.hedge_budget": 0.0,
    }
    refused = [s for s in traces.children(root) if events_named(s, "hedge_refused")]
    assert len(refused) == 1 and not attrs(refused[0])["tailrace.backup"]


async def test_a_timed_out_try_is_retried_and_its_span_says_why(
    traces: Traces, engine_store: Any
) -> None:
    # The executor call is cancelled by the node's timeout; the run loop turns
    # that into a TimeoutError and a retry (E11): the span is a failed try.
    calls = 0

    async def slow_once(x: Any) -> str:
        nonlocal calls
        calls += 1
        if calls == 1:
            await hang()
        return "second try"

    g = tr.Graph("timeout")
    g.add_node("t", slow_once, timeout=0.01, retry=tr.RetryPolicy(attempts=2))
    engine = tr.Engine(store=engine_store)
    instrument(engine, tracer_provider=traces.provider)
    async with asyncio.timeout(GUARD):
        result = await engine.run(g, 0)

    assert result.output == "second try"
    assert traces.left_open() == []
    first, second = sorted(traces.named("tailrace.node t"), key=lambda s: s.start_time or 0)
    assert (attrs(first)["tailrace.attempt"], attrs(first)["tailrace.outcome"]) == (1, "retrying")
    assert first.status.status_code is StatusCode.ERROR
    assert (first.status.description or "").startswith("TimeoutError")
    assert (attrs(second)["tailrace.attempt"], attrs(second)["tailrace.outcome"]) == (
        2,
        "completed",
    )


async def test_handler_failure_marks_its_span_error_and_cancels_siblings(
    traces: Traces, engine_store: Any
) -> None:
    started = asyncio.Event()
    g = tr.Graph("fails")

    @g.task()
    async def sibling(x: Any) -> None:
        started.set()
        await hang()

    @g.task()
    async def broken(x: Any) -> None:
        await started.wait()
        raise ValueError("boom in broken")

    engine = tr.Engine(store=engine_store)
    instrument(engine, tracer_provider=traces.provider)
    with pytest.raises(ValueError, match="boom in broken"):
        async with asyncio.timeout(GUARD):
            await engine.run(g, 0)

    assert traces.left_open() == []
    root = traces.one("tailrace.run fails")
    assert attrs(root)["tailrace.outcome"] == "failed"
    assert root.status.status_code is StatusCode.ERROR
    assert events_named(root, "exception")[0]["exception.type"] == "ValueError"
    failed = traces.one("tailrace.node broken")
    assert attrs(failed)["tailrace.outcome"] == "failed"
    assert failed.status.status_code is StatusCode.ERROR
    assert failed.status.description == "ValueError: boom in broken"
    [exc] = events_named(failed, "exception")
    assert (exc["exception.type"], exc["exception.message"]) == ("ValueError", "boom in broken")
    assert "boom in broken" in exc["exception.stacktrace"]
    assert attrs(traces.one("tailrace.node sibling"))["tailrace.outcome"] == "cancelled"


async def test_result_the_store_refuses_fails_the_span_with_the_engines_reason(
    traces: Traces, tmp_path: Path
) -> None:
    # The handler returned; the run refused its result (D5). The executor saw
    # no exception, so the span's error comes from the NODE_FAILED event.
    g = tr.Graph("unencodable")
    g.add_node("odd", lambda x: {1, 2})
    async with SQLiteStore(tmp_path / "runs.db") as store:
        engine = tr.Engine(store=store)
        instrument(engine, tracer_provider=traces.provider)
        with pytest.raises(tr.EncodeError):
            await engine.run(g, 0)

    assert traces.left_open() == []
    span = traces.one("tailrace.node odd")
    assert attrs(span)["tailrace.outcome"] == "failed"
    assert span.status.status_code is StatusCode.ERROR
    assert "odd" in (span.status.description or "")


# -- the handler's own spans ------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["async", "sync"])
async def test_user_span_in_a_handler_is_a_child_of_its_attempt(traces: Traces, kind: str) -> None:
    tracer = traces.tracer

    def call_llm(x: int) -> int:
        with tracer.start_as_current_span("llm") as span:
            span.set_attribute("prompt", str(x))
            return x + 1

    async def async_handler(x: int) -> int:
        return call_llm(x)

    g = tr.Graph("user")
    g.add_node("first", lambda x: x)
    g.add_node("ask", async_handler if kind == "async" else call_llm)
    g.chain("first", "ask")
    engine = tr.Engine()
    # Event listeners run in the run's task: their spans nest under the run span.
    in_listener: list[trace.Span] = []
    engine.bus.subscribe(lambda e: in_listener.append(trace.get_current_span()))
    instrument(engine, tracer_provider=traces.provider)
    with tracer.start_as_current_span("request") as request:
        async with asyncio.timeout(GUARD):
            result = await engine.run(g, 41)

    assert result.output == 42
    assert traces.left_open() == []
    run = traces.one("tailrace.run user")
    assert run.parent is not None and run.parent.span_id == request.get_span_context().span_id
    ask = traces.one("tailrace.node ask")
    llm = traces.one("llm")
    assert llm.parent is not None and llm.parent.span_id == ask.context.span_id
    assert llm.context.trace_id == run.context.trace_id
    assert {s.get_span_context().span_id for s in in_listener} == {run.context.span_id}
    assert trace.get_current_span() is trace.INVALID_SPAN  # nothing leaked into the caller


# -- gates ------------------------------------------------------------------------------------


async def test_gate_events_on_the_run_and_resume_spans(traces: Traces, tmp_path: Path) -> None:
    g = tr.Graph("gated")

    @g.gate()
    async def review(x: Any) -> dict[str, Any]:
        return {"ask": "go?", "x": x}

    @g.task()
    async def after(answer: Any) -> str:
        return f"after {answer}"

    g.chain("review", "after")
    async with SQLiteStore(tmp_path / "runs.db") as store:
        engine = tr.Engine(store=store)
        instrument(engine, tracer_provider=traces.provider)
        async with asyncio.timeout(GUARD):
            suspended = await engine.run(g, 7)
            [question] = suspended.questions
            done = await engine.answer(question.question_id, "yes", by="alice")
            with pytest.raises(tr.NotResumable):  # completed: nothing to resume
                await engine.resume(suspended.run_id)

    assert done is not None and done.output == "after yes"
    assert traces.left_open() == []
    run = traces.one("tailrace.run gated")
    assert attrs(run)["tailrace.outcome"] == "suspended"
    [opened] = events_named(run, "question_opened")
    assert opened == {
        "tailrace.question_id": question.question_id,
        "tailrace.node": "review",
        "tailrace.visit": 1,
    }
    gate = traces.one("tailrace.node review")
    assert gate.parent is not None and gate.parent.span_id == run.context.span_id
    assert attrs(gate)["tailrace.outcome"] == "completed"
    assert events_named(gate, "question_opened") == [opened]
    resume = traces.one("tailrace.resume gated")
    assert attrs(resume)["tailrace.run_id"] == suspended.run_id
    assert attrs(resume)["tailrace.outcome"] == "completed"
    assert len(events_named(resume, "run_resumed")) == 1
    [answered] = events_named(resume, "question_answered")
    assert answered["tailrace.question_id"] == question.question_id
    refused = traces.one("tailrace.resume")  # it never learnt its graph: no RUN_RESUMED
    assert attrs(refused)["tailrace.outcome"] == "refused"
    assert refused.status.status_code is StatusCode.UNSET
    assert events_named(refused, "exception")[0]["exception.type"].endswith("NotResumable")
    downstream = traces.one("tailrace.node after")
    assert downstream.parent is not None
    assert downstream.parent.span_id == resume.context.span_id


# -- faults -------------------------------------------------------------------------------------


async def test_cancelling_the_run_ends_every_open_span(traces: Traces, engine_store: Any) -> None:
    running = {"a": asyncio.Event(), "b": asyncio.Event(), "h": asyncio.Event()}

    def waiter(name: str) -> Any:
        async def handler(x: Any) -> None:
            running[name].set()
            with traces.tracer.start_as_current_span(f"user {name}"):
                await hang()

        return handler

    g = tr.Graph("cut")
    g.add_node("src", lambda x: x)
    for name in running:
        g.add_node(name, waiter(name), hedge=name == "h")
        g.add_edge("src", name)
    engine = tr.Engine(store=engine_store, tail=trained(h=FAST))
    hedged = asyncio.Event()
    engine.bus.subscribe(lambda e: hedged.set(), tr.EventType.NODE_HEDGED)
    instrument(engine, tracer_provider=traces.provider)
    task = asyncio.create_task(engine.run(g, 0))
    async with asyncio.timeout(GUARD):
        for event in (*running.values(), hedged):
            await event.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    assert traces.left_open() == []
    run = traces.one("tailrace.run cut")
    assert attrs(run)["tailrace.outcome"] == "cancelled"
    assert run.status.status_code is StatusCode.UNSET
    outcomes = sorted(
        (attrs(s)["tailrace.node"], attrs(s)["tailrace.backup"], attrs(s)["tailrace.outcome"])
        for s in traces.children(run)
    )
    assert outcomes == [
        ("a", False, "cancelled"),
        ("b", False, "cancelled"),
        ("h", False, "cancelled"),
        ("h", True, "cancelled"),
        ("src", False, "completed"),
    ]
    assert sorted(s.name for s in traces.spans() if s.name.startswith("user")) == [
        "user a",
        "user b",
        "user h",
        "user h",
    ]


async def test_attempts_whose_handler_never_ran_still_get_ended_spans(traces: Traces) -> None:
    # Without a store, NODE_STARTED is published before the attempt's task runs.
    # A listener cancels both tasks then, so no executor call ever joins the
    # spans those events opened; the engine records the two as failed (E9: a
    # handler task that ended cancelled failed), and so do their spans.
    g = tr.Graph("never")
    g.add_node("src", lambda x: x)
    for name in ("a", "b"):
        g.add_node(name, lambda x: x)
        g.add_edge("src", name)
    engine = tr.Engine()
    instrument(engine, tracer_provider=traces.provider)

    def cut(event: tr.Event) -> None:
        if event.node_id == "b":
            for task in asyncio.all_tasks():
                if task.get_name() in ("a", "b"):  # the run loop names a task by its node
                    task.cancel()

    engine.bus.subscribe(cut, tr.EventType.NODE_STARTED)
    with pytest.raises(asyncio.CancelledError):
        async with asyncio.timeout(GUARD):
            await engine.run(g, 0)

    assert traces.left_open() == []
    never = [traces.one("tailrace.node a"), traces.one("tailrace.node b")]
    assert [attrs(s)["tailrace.outcome"] for s in never] == ["failed", "failed"]
    assert [s.status.status_code for s in never] == [StatusCode.ERROR, StatusCode.ERROR]
    assert all("tailrace.executor" not in attrs(s) for s in never)  # no executor call
    assert attrs(traces.one("tailrace.node src"))["tailrace.executor"] == "local"


# -- installing and removing ----------------------------------------------------------------------


async def test_uninstrument_restores_the_engine(traces: Traces) -> None:
    g = tr.Graph("plain")
    g.add_node("only", lambda x: x)
    engine = tr.Engine()
    table = engine._executors
    with instrument(engine, tracer_provider=traces.provider) as tracing:
        assert isinstance(tracing, Instrumentation)
        with pytest.raises(ValueError, match="instrumented already"):
            instrument(engine, tracer_provider=traces.provider)
        await engine.run(g, 1)
    assert len(traces.spans()) == 2
    assert engine._executors is table
    assert "run" not in vars(engine) and "resume" not in vars(engine)
    await engine.run(g, 2)
    assert len(traces.spans()) == 2  # nothing traced any more
    tracing.uninstrument()  # idempotent


async def test_named_executors_are_wrapped_and_named(traces: Traces) -> None:
    g = tr.Graph("named")
    g.add_node("here", lambda x: x)
    g.add_node("there", lambda x: x, executor="pool")
    g.chain("here", "there")
    engine = tr.Engine(executors={"pool": LocalExecutor()})
    tracing = instrument(engine, tracer_provider=traces.provider)
    await engine.run(g, 1)

    assert attrs(traces.one("tailrace.node here"))["tailrace.executor"] == "local"
    assert attrs(traces.one("tailrace.node there"))["tailrace.executor"] == "pool"
    wrapped = OtelExecutor(instrumentation=tracing)
    assert isinstance(wrapped.inner, LocalExecutor) and wrapped.name == "local"


async def test_a_fork_has_its_own_run_span(traces: Traces, tmp_path: Path) -> None:
    g = tr.Graph("forked")
    g.add_node("first", lambda x: x + 1)
    g.add_node("second", lambda x: 2 * x)
    g.chain("first", "second")
    async with SQLiteStore(tmp_path / "runs.db") as store:
        engine = tr.Engine(store=store)
        with instrument(engine, tracer_provider=traces.provider):
            await engine.run(g, 1, run_id="source")
            forked = await engine.fork("source", at="second", input=10, fork_id="copy")

    assert forked.output == 20
    assert traces.left_open() == []
    span = traces.one("tailrace.fork forked")
    assert attrs(span)["tailrace.run_id"] == "copy"
    assert attrs(span)["tailrace.outcome"] == "completed"
    [second] = [s for s in traces.children(span) if s.name == "tailrace.node second"]
    assert attrs(second)["tailrace.outcome"] == "completed"
