"""OpenTelemetry tracing for an engine: a span per run, a span per node attempt.

``instrument(engine)`` traces every run, resume, fork and claimed start of that
engine (``pip install 'tailrace[otel]'``: the API and the SDK; bring your exporter). It
hooks in as one of the engine's instruments (:class:`~tailrace.Instrument`);
nothing of the engine is patched::

    from opentelemetry.sdk.trace import TracerProvider
    from tailrace.integrations.otel import instrument

    engine = Engine(store=SQLiteStore("runs.db"))
    tracing = instrument(engine, tracer_provider=TracerProvider())
    await engine.run(graph, question)      # one trace: the run, each attempt, your spans
    tracing.uninstrument()                 # or: with instrument(engine): ...

Spans, all carrying ``tailrace.run_id``:

- ``tailrace.run <graph>`` spans one ``Engine.run`` call, as a child of
  whatever span is current where it is called; ``tailrace.resume <graph>``
  one ``Engine.resume`` call (or the resume of a suspended parent that its
  child's end lets go on), ``tailrace.fork <graph>`` one ``Engine.fork`` and
  ``tailrace.start <graph>`` one ``Engine.start_claimed`` (a worker starting
  a run it claimed from a queue). ``tailrace.graph``; ``tailrace.outcome`` is
  ``completed``, ``suspended`` (open gates, or preempted), ``failed`` (status
  error, the exception recorded), ``cancelled`` (the caller cancelled it) or
  ``refused`` (the engine would not drive it: ``LeaseHeld``, ``NotResumable``).
  A run that raced backups (T3, T5) carries ``tailrace.hedges`` (backups
  and clones started), ``tailrace.hedges_refused`` (stragglers whose backup
  its hedge budget refused) and ``tailrace.hedge_budget`` (the budget's
  share of attempts started; absent for unbudgeted backups).
  Its events: ``question_opened`` and ``question_answered`` (gates, Q1-Q3, with
  ``tailrace.question_id``, ``tailrace.node``, ``tailrace.visit``),
  ``late_input`` (an input that arrived after its first-k aggregate fired, E5,
  with ``tailrace.source``), ``aggregate_fired`` and ``run_resumed`` (also
  when a ``run`` call resumes its own suspended run to apply a late answer).
- ``tailrace.node <node>`` spans one attempt: one try of one node visit (a
  retried node has one span per try, E11) or a hedge's backup (T3).
  ``tailrace.node``, ``tailrace.visit``, ``tailrace.attempt`` (the try),
  ``tailrace.executor`` (``local``, or the name a node's ``executor=`` uses),
  ``tailrace.straggler`` (it ran past its straggler threshold; a
  ``straggler`` event says when), ``tailrace.hedged`` (a backup raced it, or it
  is the backup; a ``hedge_refused`` event when the budget refused it one),
  ``tailrace.backup`` (it is the backup) and
  ``tailrace.outcome``: ``completed``, ``failed`` (status error, the handler's
  exception recorded), ``cancelled`` (a hedge loser, a sibling of a failure,
  a cancelled run) or ``retrying`` (it failed and another try follows; status
  error). A gate's attempt completes when its question opens.

While a handler runs, its attempt's span is the current span (for async
handlers, and for sync ones in their worker thread), so spans the handler
starts, an LLM call's say, are children of it. Every span is ended by the
time the run's call returns or raises, cancellation included.

>>> import asyncio
>>> from opentelemetry.sdk.trace import TracerProvider
>>> from opentelemetry.sdk.trace.export import SimpleSpanProcessor
>>> from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
>>> from tailrace import Engine, Graph
>>> exporter = InMemorySpanExporter()
>>> provider = TracerProvider()
>>> provider.add_span_processor(SimpleSpanProcessor(exporter))
>>> g = Graph("double")
>>> @g.task()
... async def double(x):
...     return 2 * x
>>> engine = Engine()
>>> with instrument(engine, tracer_provider=provider):
...     result = asyncio.run(engine.run(g, 21))
>>> sorted(span.name for span in exporter.get_finished_spans())
['tailrace.node double', 'tailrace.run double']
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

from opentelemetry import trace
from opentelemetry.trace import TracerProvider

from .. import __version__
from .._errors import LeaseHeld, NotResumable
from ..core import Instrument, RunCall
from ..executors import AttemptContext, Executor, LocalExecutor
from ._otel_tracker import CANCELLED, COMPLETED, FAILED, REFUSED, SpanTracker

if TYPE_CHECKING:
    from ..core import Engine, RunResult
    from ..graph import Node

__all__ = ["Instrumentation", "OtelExecutor", "instrument"]


class OtelExecutor:
    """Runs each attempt through ``inner`` with the attempt's span current; made by :func:`instrument`.

    ``inner`` is the executor that really runs the handler (None: a
    :class:`~tailrace.executors.LocalExecutor`); ``instrumentation`` is the
    :class:`Instrumentation` whose spans it joins; ``name`` is the
    ``tailrace.executor`` attribute of its attempts (default: derived from
    ``inner``'s class, ``local`` for a ``LocalExecutor``).
    """

    __slots__ = ("_tracker", "inner", "name")

    def __init__(
        self,
        inner: Executor | None = None,
        *,
        instrumentation: Instrumentation,
        name: str | None = None,
    ) -> None:
        self.inner: Executor = inner if inner is not None else LocalExecutor()
        self.name = name or _kind(self.inner)
        self._tracker = instrumentation.tracker

    async def invoke(self, node: Node, payload: Any, context: AttemptContext) -> Any:
        """Run ``node``'s handler on ``payload`` through ``inner`` inside the span of attempt ``context``."""
        tracker = self._tracker
        attempt = tracker.begin_attempt(
            context.run_id,
            context.node_id,
            context.visit,
            context.attempt,
            context.hedge,
            self.name,
            context.item,
        )
        if attempt is None:  # a run no traced call drives (a child run started inline)
            return await self.inner.invoke(node, payload, context)
        try:
            with trace.use_span(
                attempt.span, record_exception=False, set_status_on_exception=False
            ):
                result = await self.inner.invoke(node, payload, context)
        except asyncio.CancelledError:
            tracker.finish_attempt(attempt, CANCELLED, None)
            raise
        except BaseException as exc:
            tracker.finish_attempt(attempt, FAILED, exc)
            raise
        tracker.finish_attempt(attempt, COMPLETED, None)
        return result

    async def aclose(self) -> None:
        """Close ``inner``."""
        await self.inner.aclose()


class Instrumentation(Instrument):
    """The tracing that :func:`instrument` hooked into ``engine``; ``uninstrument()`` removes it.

    ``engine`` is the traced engine and ``tracker`` the span bookkeeping it
    feeds. It is one of the engine's instruments (``engine.instruments``):
    its ``drive`` hook spans each call that drives a run, with the span
    current while the run drives, and its ``wrap_executor`` hook runs each
    attempt through an :class:`OtelExecutor`. Use it as a context manager
    to uninstrument on exit.
    """

    def __init__(self, engine: Engine, tracker: SpanTracker) -> None:
        self.engine = engine
        self.tracker = tracker
        self._unsubscribe: Callable[[], None] | None = None

    def _install(self) -> None:
        engine = self.engine
        if any(isinstance(i, Instrumentation) for i in engine.instruments):
            raise ValueError(f"engine {engine.owner!r} is instrumented already")
        self._unsubscribe = engine.bus.subscribe(self.tracker.on_event)
        engine.instruments.add(self)

    def uninstrument(self) -> None:
        """Stop tracing the engine's runs (runs already started keep their spans); idempotent."""
        if self._unsubscribe is None:
            return
        self._unsubscribe()
        self._unsubscribe = None
        self.engine.instruments.remove(self)

    async def drive(self, call: RunCall, proceed: Callable[[], Awaitable[RunResult]]) -> RunResult:
        """Await ``proceed()`` inside the run span of ``call`` (``tailrace.<kind> <graph>``).

        Args:
            call: the engine's call that drives a run.
            proceed: drives it.
        """
        graph = None if call.graph is None else call.graph.name
        return await _within_run_span(
            self.tracker, call.run_id, f"tailrace.{call.kind}", graph, proceed
        )

    def wrap_executor(self, executor: Executor, name: str | None) -> Executor:
        """``executor`` in an :class:`OtelExecutor`, so each attempt's span is current in its handler.

        Args:
            executor: the engine's executor.
            name: its name (None: the default one, named by its kind, e.g. ``local``).
        """
        return OtelExecutor(executor, instrumentation=self, name=name)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.uninstrument()


def instrument(engine: Engine, *, tracer_provider: TracerProvider | None = None) -> Instrumentation:
    """Trace every run, resume, fork and claimed start of ``engine`` with OpenTelemetry (spans
    listed in the module docs).

    ``engine`` gets a listener on its event bus and an :class:`Instrumentation`
    among its instruments, which spans each call that drives a run and wraps
    its executors in :class:`OtelExecutor` (so each attempt's span is current
    in its handler). ``tracer_provider`` makes the tracer (default: the
    global one, ``opentelemetry.trace.get_tracer_provider()``).
    Instrumenting an engine twice raises ``ValueError``.
    """
    tracer = trace.get_tracer(__name__, __version__, tracer_provider)
    instrumentation = Instrumentation(engine, SpanTracker(tracer))
    instrumentation._install()
    return instrumentation


def _kind(executor: Executor) -> str:
    """``local`` for a LocalExecutor, ``ray`` for a RayExecutor: the class name, lower case, less ``Executor``."""
    name = type(executor).__name__
    return (name.removesuffix("Executor") or name).lower()


async def _within_run_span(
    tracker: SpanTracker,
    run_id: Any,
    verb: str,
    graph: str | None,
    call: Callable[[], Awaitable[RunResult]],
) -> RunResult:
    """Await ``call()`` inside the run span of ``run_id``; end it, and all under it, however it ends."""
    run = tracker.open_run(str(run_id), verb, graph)
    if run is None:  # this run is being driven already: the engine refuses the call
        return await call()
    try:
        with trace.use_span(run.span, record_exception=False, set_status_on_exception=False):
            result = await call()
    except asyncio.CancelledError:
        tracker.close_run(run, CANCELLED)
        raise
    except (LeaseHeld, NotResumable) as exc:
        run.span.record_exception(exc)
        tracker.close_run(run, REFUSED)
        raise
    except BaseException as exc:
        tracker.close_run(run, FAILED, exc)
        raise
    tracker.close_run(run, result.status)
    return result
