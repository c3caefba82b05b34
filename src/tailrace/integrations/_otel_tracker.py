"""The span bookkeeping behind :mod:`tailrace.integrations.otel`: one span per run, one per attempt.

Three sources tell a :class:`SpanTracker` about a run, in no fixed order:

- the engine's call that drives the run (``run``, ``resume``, ``fork``,
  ``start_claimed``, through the instrument's ``drive`` hook) opens and closes the
  run span (:meth:`SpanTracker.open_run`, :meth:`SpanTracker.close_run`): it is
  the one place that sees every ending, a failure, a stall or a cancellation
  included, of which the event log records only some;
- the run's events (:meth:`SpanTracker.on_event`), published after each
  commit, decide an attempt's outcome (completed, failed, cancelled,
  retrying) and flag stragglers and hedges (T3), late inputs (E5) and gates
  (Q1), and count the backups a run started and those its budget refused (T5);
- the tracing executor (:meth:`SpanTracker.begin_attempt`,
  :meth:`SpanTracker.finish_attempt`) runs inside the attempt's task, so it
  knows the attempt's exact start and end, the exception it raised, and makes
  its span current for the handler.

An attempt's span is started by whichever of its ``NODE_STARTED`` event or
its executor call comes first, and the other joins it, so each attempt has
one span. It ends once its outcome is decided *and* its executor call (if
any) returned, at the executor's end time when there was one, so a span's
duration is the handler's even though the deciding event is published later.
Whatever is still open when the run's call returns is ended then (an
abandoned hedge loser, attempts cut by a cancellation), so no span is left
open. All of this runs on the engine's event loop, so no lock is needed.

Tracing never changes an outcome: every call into the OpenTelemetry SDK goes
through a :class:`GuardedSpan` (or :meth:`SpanTracker.start_span`), so a span
processor or exporter that raises (on start, on end, anywhere) costs that
span, is logged once per tracker, and the run goes on as if untraced.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, Span, SpanContext, Status, StatusCode, Tracer
from opentelemetry.util.types import Attributes, AttributeValue

from .._events import Event, EventType

# Attribute names, documented in the ``otel`` module's docstring.
RUN_ID = "tailrace.run_id"
GRAPH = "tailrace.graph"
NODE = "tailrace.node"
VISIT = "tailrace.visit"
ATTEMPT = "tailrace.attempt"
#: The item index of a map item's attempt (M2); absent on a node's own spans.
ITEM = "tailrace.item"
OUTCOME = "tailrace.outcome"
STRAGGLER = "tailrace.straggler"
HEDGED = "tailrace.hedged"
BACKUP = "tailrace.backup"
#: On a run span: the backups it started, those its budget refused, and the budget (T5).
HEDGES = "tailrace.hedges"
HEDGES_REFUSED = "tailrace.hedges_refused"
HEDGE_BUDGET = "tailrace.hedge_budget"
EXECUTOR = "tailrace.executor"
QUESTION_ID = "tailrace.question_id"

COMPLETED = "completed"
FAILED = "failed"
CANCELLED = "cancelled"
RETRYING = "retrying"
#: A run call the engine would not drive (``LeaseHeld``, ``NotResumable``).
REFUSED = "refused"

logger = logging.getLogger("tailrace.otel")

T = TypeVar("T")


class SdkGuard:
    """Runs calls into the OpenTelemetry SDK so that their failures never reach the run."""

    def __init__(self) -> None:
        #: How many SDK calls raised (the first is logged with its traceback).
        self.failures = 0

    def call(self, what: str, fn: Callable[[], T], fallback: T) -> T:
        """``fn()``, or ``fallback`` if it raises (logged once per guard)."""
        try:
            return fn()
        except Exception as exc:
            self.failures += 1
            if self.failures == 1:
                logger.warning(
                    "tracing failed (%s); runs go on, untraced where the tracer fails "
                    "(logged once)",
                    what,
                    exc_info=exc,
                )
            return fallback


class GuardedSpan(Span):
    """A span whose every call is guarded (a raising span processor costs the span, not the run)."""

    def __init__(self, inner: Span, guard: SdkGuard) -> None:
        self.inner = inner
        self.guard = guard

    def end(self, end_time: int | None = None) -> None:
        self.guard.call("span end", lambda: self.inner.end(end_time), None)

    def get_span_context(self) -> SpanContext:
        return self.inner.get_span_context()

    def set_attributes(self, attributes: Mapping[str, AttributeValue]) -> None:
        self.guard.call("span attributes", lambda: self.inner.set_attributes(attributes), None)

    def set_attribute(self, key: str, value: AttributeValue) -> None:
        self.guard.call("span attribute", lambda: self.inner.set_attribute(key, value), None)

    def add_event(
        self, name: str, attributes: Attributes = None, timestamp: int | None = None
    ) -> None:
        self.guard.call(
            "span event", lambda: self.inner.add_event(name, attributes, timestamp), None
        )

    def add_link(self, context: SpanContext, attributes: Attributes = None) -> None:
        self.guard.call("span link", lambda: self.inner.add_link(context, attributes), None)

    def update_name(self, name: str) -> None:
        self.guard.call("span name", lambda: self.inner.update_name(name), None)

    def is_recording(self) -> bool:
        return self.guard.call("span recording", self.inner.is_recording, False)

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        self.guard.call("span status", lambda: self.inner.set_status(status, description), None)

    def record_exception(
        self,
        exception: BaseException,
        attributes: Attributes = None,
        timestamp: int | None = None,
        escaped: bool = False,
    ) -> None:
        self.guard.call(
            "span exception",
            lambda: self.inner.record_exception(exception, attributes, timestamp, escaped),
            None,
        )


def _ns(seconds: float) -> int:
    return int(seconds * 1_000_000_000)


#: What a visit's attempts race for: (node, visit, item); the item None for a node's own.
Slot = tuple[str, int, int | None]


@dataclass(slots=True, eq=False)
class AttemptSpan:
    """One attempt (one try, or one hedge backup) of a node visit, and what is known of its end."""

    run_id: str
    node: str
    visit: int
    tries: int
    hedge: bool
    span: Span
    #: The item of a map item's attempt (M2), None for a node's.
    item: int | None = None
    #: An executor call ran (or runs) this attempt.
    claimed: bool = False
    #: The executor call has not returned yet: the span may not end.
    running: bool = False
    #: What the executor saw: ``completed``, ``failed`` or ``cancelled``.
    seen: str | None = None
    #: When the executor call returned (ns since the epoch).
    returned_at: int | None = None
    #: The outcome decided by the run's events, and when it was decided.
    outcome: str | None = None
    decided_at: int | None = None
    #: A failure the executor did not see raised (a result that cannot be encoded, E8's bad route).
    error: str | None = None


@dataclass(slots=True, eq=False)
class RunSpan:
    """The run span of one ``run``/``resume`` call and the attempt spans under it."""

    run_id: str
    span: Span
    context: Context
    #: ``tailrace.run`` or ``tailrace.resume``: the span's name, less the graph's.
    verb: str
    #: The span's name holds its graph (a resume learns it from RUN_RESUMED).
    named: bool
    attempts: dict[Slot, list[AttemptSpan]] = field(default_factory=dict)
    #: Backups started, backups the budget refused, and the budget's share (T5).
    hedges: int = 0
    refused: int = 0
    budget: float | None = None

    def open_attempts(self) -> Iterator[AttemptSpan]:
        """Every attempt span not ended yet."""
        for attempts in self.attempts.values():
            yield from attempts


class SpanTracker:
    """Builds run and attempt spans from engine calls, events and executor calls (see module docstring).

    ``tracer`` makes the spans.
    """

    def __init__(self, tracer: Tracer) -> None:
        self.tracer = tracer
        self.runs: dict[str, RunSpan] = {}
        self.guard = SdkGuard()

    def start_span(
        self,
        name: str,
        *,
        attributes: Mapping[str, AttributeValue],
        context: Context | None = None,
        start_time: int | None = None,
        links: Sequence[Link] = (),
    ) -> GuardedSpan:
        """A new span from the tracer, guarded; a non-recording one if the tracer raises."""
        invalid: Span = trace.INVALID_SPAN
        span = self.guard.call(
            "span start",
            lambda: self.tracer.start_span(
                name, context=context, attributes=attributes, start_time=start_time, links=links
            ),
            invalid,
        )
        return GuardedSpan(span, self.guard)

    # -- runs ------------------------------------------------------------------

    def open_run(self, run_id: str, verb: str, graph: str | None) -> RunSpan | None:
        """Start the span of a ``verb`` (run, resume, fork, start) call of ``run_id`` under the current context.

        ``graph`` is the graph's name when the call knows it. Returns None when
        that run has a span open already (the engine refuses a second driver).
        """
        if run_id in self.runs:
            return None
        name, attributes = (verb, {}) if graph is None else (f"{verb} {graph}", {GRAPH: graph})
        span = self.start_span(name, attributes={RUN_ID: run_id, **attributes})
        run = RunSpan(
            run_id=run_id,
            span=span,
            context=trace.set_span_in_context(span),
            verb=verb,
            named=graph is not None,
        )
        self.runs[run_id] = run
        return run

    def close_run(self, run: RunSpan, outcome: str, exc: BaseException | None = None) -> None:
        """End every span of ``run`` still open, then the run span with ``outcome``."""
        if self.runs.get(run.run_id) is run:
            del self.runs[run.run_id]
        now = time.time_ns()
        for attempt in list(run.open_attempts()):
            if attempt.outcome is None:
                attempt.outcome = FAILED if attempt.seen == FAILED else CANCELLED
                attempt.decided_at = now
            attempt.running = False  # the run is over: nothing may keep its span open
            self._end(run, attempt)
        run.span.set_attribute(OUTCOME, outcome)
        if run.hedges or run.refused:
            run.span.set_attribute(HEDGES, run.hedges)
            run.span.set_attribute(HEDGES_REFUSED, run.refused)
            if run.budget is not None:
                run.span.set_attribute(HEDGE_BUDGET, run.budget)
        if exc is not None and outcome == FAILED:
            run.span.record_exception(exc)
            run.span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        run.span.end()

    # -- the executor's view ---------------------------------------------------

    def begin_attempt(
        self,
        run_id: str,
        node_id: str,
        visit: int,
        tries: int,
        hedge: bool,
        executor: str,
        item: int | None = None,
    ) -> AttemptSpan | None:
        """The executor starts an attempt: its span (joined or new), or None for a run not traced.

        ``hedge`` marks a backup attempt (T3); ``executor`` names where it runs;
        ``item`` is the item of a map item's attempt (M2).
        """
        run = self.runs.get(run_id)
        if run is None:
            return None
        slot = (node_id, visit, item)
        attempts = run.attempts.setdefault(slot, [])
        attempt = _unclaimed(attempts, tries, hedge)
        if attempt is None:
            attempt = self._start(run, slot, tries, hedge, time.time_ns())
        attempt.claimed = attempt.running = True
        attempt.span.set_attribute(EXECUTOR, executor)
        return attempt

    def finish_attempt(self, attempt: AttemptSpan, seen: str, exc: BaseException | None) -> None:
        """The executor call of ``attempt`` returned (``seen``: completed, failed or cancelled)."""
        attempt.running = False
        run = self.runs.get(attempt.run_id)
        if run is None or attempt not in run.attempts.get(_slot_of(attempt), ()):
            return  # the run's end closed it already
        attempt.seen = seen
        attempt.returned_at = time.time_ns()
        if exc is not None:
            attempt.span.record_exception(exc)
            attempt.span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        self._end(run, attempt)

    # -- events ----------------------------------------------------------------

    def on_event(self, event: Event) -> None:
        """Apply one published event of a traced run (events of other runs are ignored)."""
        run = self.runs.get(event.run_id)
        if run is None:
            return
        handler = _HANDLERS.get(event.type)
        if handler is not None:
            handler(self, run, event)

    def _run_started(self, run: RunSpan, event: Event) -> None:
        if event.type is EventType.RUN_RESUMED:  # also when a run() call resumes its own run (Q3)
            run.span.add_event("run_resumed", timestamp=_ns(event.ts))
        if not run.named:
            graph = str(event.data.get("graph", ""))
            run.span.set_attribute(GRAPH, graph)
            run.span.update_name(f"{run.verb} {graph}")
            run.named = True

    def _node_started(self, run: RunSpan, event: Event) -> None:
        slot, tries = _where(event)
        hedge = bool(event.data.get("hedge", False))
        attempts = run.attempts.setdefault(slot, [])
        if _find(attempts, tries, hedge) is None:  # else its executor call came first
            self._start(run, slot, tries, hedge, _ns(event.ts))

    def _straggler(self, run: RunSpan, event: Event) -> None:
        primary = self._primary(run, event)
        if primary is not None:
            primary.span.set_attribute(STRAGGLER, True)
            primary.span.add_event(
                "straggler",
                {k: float(event.data[k]) for k in ("elapsed", "estimate", "factor")},
                timestamp=_ns(event.ts),
            )

    def _hedged(self, run: RunSpan, event: Event) -> None:
        run.hedges += 1
        self._budget(run, event)
        primary = self._primary(run, event)
        if primary is not None:
            primary.span.set_attribute(HEDGED, True)

    def _hedge_refused(self, run: RunSpan, event: Event) -> None:
        run.refused += 1
        self._budget(run, event)
        primary = self._primary(run, event)
        if primary is not None:  # the straggler that waited for a token until it ended
            primary.span.add_event("hedge_refused", timestamp=_ns(event.ts))

    @staticmethod
    def _budget(run: RunSpan, event: Event) -> None:
        share = event.data.get("budget")
        if isinstance(share, int | float) and not isinstance(share, bool):
            run.budget = float(share)

    def _retrying(self, run: RunSpan, event: Event) -> None:
        slot, tries = _where(event)
        attempts = run.attempts.setdefault(slot, [])
        failed = [
            a for a in attempts if a.outcome is None and a.seen == FAILED and a.tries == tries
        ]
        attempt = failed[0] if failed else self._lazy(run, event, hedge=False)
        attempt.error = str(event.data.get("error", ""))
        self._decide(run, attempt, RETRYING, event)

    def _completed(self, run: RunSpan, event: Event) -> None:
        winner = self._lazy(run, event, hedge=bool(event.data.get("hedge", False)))
        self._settle_visit(run, event, winner, COMPLETED)

    def _failed(self, run: RunSpan, event: Event) -> None:
        slot, _ = _where(event)
        attempts = run.attempts.get(slot, [])
        # The attempt that failed is the one its executor saw end (raised, or
        # returned a result the run could not take); without an executor, the primary.
        culprits = [a for a in attempts if a.outcome is None and a.seen in (FAILED, COMPLETED)]
        culprit = culprits[0] if culprits else self._lazy(run, event, hedge=False)
        culprit.error = str(event.data.get("error", ""))
        self._settle_visit(run, event, culprit, FAILED)

    def _cancelled(self, run: RunSpan, event: Event) -> None:
        slot, _ = _where(event)
        for attempt in list(run.attempts.get(slot, [])):
            if attempt.outcome is None:
                self._decide(run, attempt, CANCELLED, event)

    def _question_opened(self, run: RunSpan, event: Event) -> None:
        question = _question(event)
        run.span.add_event("question_opened", question, timestamp=_ns(event.ts))
        # A gate's handler returned its prompt: the attempt completed, the node waits (Q1).
        gate = self._lazy(run, event, hedge=False)
        gate.span.add_event("question_opened", question, timestamp=_ns(event.ts))
        self._settle_visit(run, event, gate, COMPLETED)

    def _question_answered(self, run: RunSpan, event: Event) -> None:
        run.span.add_event("question_answered", _question(event), timestamp=_ns(event.ts))

    def _late_input(self, run: RunSpan, event: Event) -> None:
        (node, visit, item), _ = _where(event)
        late: dict[str, AttributeValue] = {
            NODE: node,
            VISIT: visit,
            "tailrace.source": str(event.data.get("source", "")),
            "tailrace.reason": str(event.data.get("reason", "")),
        }
        if item is not None:
            late[ITEM] = item
        run.span.add_event("late_input", late, timestamp=_ns(event.ts))

    def _aggregate_fired(self, run: RunSpan, event: Event) -> None:
        (node, visit, _), _ = _where(event)
        fired: dict[str, AttributeValue] = {NODE: node, VISIT: visit}
        run.span.add_event("aggregate_fired", fired, timestamp=_ns(event.ts))

    # -- attempts --------------------------------------------------------------

    def _start(self, run: RunSpan, slot: Slot, tries: int, hedge: bool, at: int) -> AttemptSpan:
        node, visit, item = slot
        attributes: dict[str, AttributeValue] = {
            RUN_ID: run.run_id,
            NODE: node,
            VISIT: visit,
            ATTEMPT: tries,
            BACKUP: hedge,
            HEDGED: hedge,
            STRAGGLER: False,
        }
        if item is not None:  # one span per item attempt of a map (M2)
            attributes[ITEM] = item
        span = self.start_span(
            f"tailrace.node {node}", context=run.context, start_time=at, attributes=attributes
        )
        attempt = AttemptSpan(
            run_id=run.run_id, node=node, visit=visit, tries=tries, hedge=hedge, span=span,
            item=item,
        )  # fmt: skip
        run.attempts.setdefault(slot, []).append(attempt)
        return attempt

    def _lazy(self, run: RunSpan, event: Event, *, hedge: bool) -> AttemptSpan:
        """The open attempt an event speaks of.

        Its executor call or its ``NODE_STARTED`` opened it; should neither
        have, a span starts at the event, so the outcome is still recorded.
        """
        slot, tries = _where(event)
        found = _find(run.attempts.setdefault(slot, []), tries, hedge)
        if found is not None:
            return found
        return self._start(run, slot, tries, hedge, _ns(event.ts))

    def _primary(self, run: RunSpan, event: Event) -> AttemptSpan | None:
        slot, _ = _where(event)
        open_primaries = [
            a for a in run.attempts.get(slot, []) if a.outcome is None and not a.hedge
        ]
        return open_primaries[-1] if open_primaries else None

    def _settle_visit(self, run: RunSpan, event: Event, chosen: AttemptSpan, outcome: str) -> None:
        """``chosen`` ended the visit with ``outcome``; its rivals failed or are cancelled (T3)."""
        slot, _ = _where(event)
        for attempt in list(run.attempts.get(slot, [])):
            if attempt is chosen:
                self._decide(run, attempt, outcome, event)
            elif attempt.outcome is None:
                rival = FAILED if attempt.seen == FAILED else CANCELLED
                self._decide(run, attempt, rival, event)

    def _decide(self, run: RunSpan, attempt: AttemptSpan, outcome: str, event: Event) -> None:
        attempt.outcome = outcome
        attempt.decided_at = _ns(event.ts)
        self._end(run, attempt)

    def _end(self, run: RunSpan, attempt: AttemptSpan) -> None:
        """End ``attempt``'s span once its outcome is known and its executor call returned."""
        if attempt.outcome is None or attempt.running:
            return
        attempts = run.attempts.get(_slot_of(attempt), [])
        if attempt not in attempts:
            return  # ended already
        attempts.remove(attempt)
        if not attempts:
            del run.attempts[_slot_of(attempt)]
        span = attempt.span
        span.set_attribute(OUTCOME, attempt.outcome)
        if attempt.outcome in (FAILED, RETRYING) and attempt.seen != FAILED:
            # The executor saw no exception (no executor, or a result the run refused).
            span.set_status(Status(StatusCode.ERROR, attempt.error or attempt.outcome))
        end = attempt.returned_at if attempt.returned_at is not None else attempt.decided_at
        span.end(end_time=end)


def _where(event: Event) -> tuple[Slot, int]:
    """The slot an event speaks of (node, visit, item), and its try number."""
    item = event.data.get("item")
    slot = (event.node_id or "", event.visit or 0, item if isinstance(item, int) else None)
    return slot, event.attempt or 1


def _slot_of(attempt: AttemptSpan) -> Slot:
    return attempt.node, attempt.visit, attempt.item


def _question(event: Event) -> dict[str, AttributeValue]:
    """The attributes of a gate's span events: question id, gate node, visit (Q1-Q3)."""
    (node, visit, _), _ = _where(event)
    return {QUESTION_ID: str(event.data.get("question_id", "")), NODE: node, VISIT: visit}


def _find(attempts: list[AttemptSpan], tries: int, hedge: bool) -> AttemptSpan | None:
    """The open attempt with this hedge flag, of try ``tries`` if there is one."""
    candidates = [a for a in attempts if a.outcome is None and a.hedge == hedge]
    for attempt in candidates:
        if attempt.tries == tries:
            return attempt
    return candidates[-1] if candidates else None


def _unclaimed(attempts: list[AttemptSpan], tries: int, hedge: bool) -> AttemptSpan | None:
    """An event-born span of this try that no executor call has joined yet."""
    for attempt in attempts:
        joinable = not attempt.claimed and attempt.outcome is None
        if joinable and attempt.tries == tries and attempt.hedge == hedge:
            return attempt
    return None


_HANDLERS: dict[EventType, Any] = {
    EventType.RUN_STARTED: SpanTracker._run_started,
    EventType.RUN_RESUMED: SpanTracker._run_started,
    EventType.NODE_STARTED: SpanTracker._node_started,
    EventType.NODE_STRAGGLER: SpanTracker._straggler,
    EventType.NODE_HEDGED: SpanTracker._hedged,
    EventType.NODE_HEDGE_REFUSED: SpanTracker._hedge_refused,
    EventType.NODE_RETRYING: SpanTracker._retrying,
    EventType.NODE_COMPLETED: SpanTracker._completed,
    EventType.NODE_FAILED: SpanTracker._failed,
    EventType.NODE_CANCELLED: SpanTracker._cancelled,
    EventType.QUESTION_OPENED: SpanTracker._question_opened,
    EventType.QUESTION_ANSWERED: SpanTracker._question_answered,
    EventType.NODE_LATE_INPUT: SpanTracker._late_input,
    EventType.AGGREGATE_FIRED: SpanTracker._aggregate_fired,
}
