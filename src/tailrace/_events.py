"""Events: what happened in a run, in order, for listeners and the store.

Listeners subscribe to all event types or some. A listener that raises never
breaks the run: its exception goes to the bus's ``on_error`` hook, or is
logged at WARNING when there is none.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("tailrace.events")


class EventType(enum.StrEnum):
    """Kinds of events. Node events carry ``node_id``, ``visit`` and ``attempt``."""

    RUN_STARTED = "run_started"
    RUN_RESUMED = "run_resumed"
    RUN_COMPLETED = "run_completed"
    RUN_SUSPENDED = "run_suspended"
    RUN_CANCELLED = "run_cancelled"
    RUN_FAILED = "run_failed"
    NODE_STARTED = "node_started"
    NODE_COMPLETED = "node_completed"
    NODE_FAILED = "node_failed"
    NODE_RETRYING = "node_retrying"
    NODE_CANCELLED = "node_cancelled"
    NODE_LATE_INPUT = "node_late_input"
    NODE_STRAGGLER = "node_straggler"
    NODE_HEDGED = "node_hedged"
    NODE_HEDGE_REFUSED = "node_hedge_refused"
    AGGREGATE_FIRED = "aggregate_fired"
    QUESTION_OPENED = "question_opened"
    QUESTION_ANSWERED = "question_answered"


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """One event. ``seq`` increases by one per event within a run."""

    run_id: str
    seq: int
    type: EventType
    ts: float
    node_id: str | None = None
    visit: int | None = None
    attempt: int | None = None
    data: dict[str, Any] = field(default_factory=dict)


Listener = Callable[[Event], object]
ErrorHook = Callable[[Event, Listener, BaseException], object]


class EventBus:
    """In-process publish/subscribe of :class:`Event`.

    ``on_error(event, listener, exc)`` receives listener failures; without it
    they are logged at WARNING with the traceback.

    >>> bus = EventBus()
    >>> seen = []
    >>> unsubscribe = bus.subscribe(seen.append, EventType.RUN_STARTED)
    >>> bus.publish(Event(run_id="r", seq=1, type=EventType.RUN_STARTED, ts=0.0))
    >>> [e.type.value for e in seen]
    ['run_started']
    """

    __slots__ = ("_all", "_by_type", "on_error")

    def __init__(self, *, on_error: ErrorHook | None = None) -> None:
        self._all: list[Listener] = []
        self._by_type: dict[EventType, list[Listener]] = {}
        self.on_error = on_error

    def subscribe(
        self, listener: Listener, *types: EventType | Iterable[EventType]
    ) -> Callable[[], None]:
        """Call ``listener`` for events of ``types`` (all types when none); returns an unsubscribe function."""
        flat: list[EventType] = []
        for t in types:
            flat.extend([t] if isinstance(t, EventType) else t)
        if not flat:
            self._all.append(listener)
            return lambda: self._all.remove(listener)
        for t in flat:
            self._by_type.setdefault(t, []).append(listener)

        def unsubscribe() -> None:
            for t in flat:
                self._by_type[t].remove(listener)

        return unsubscribe

    @property
    def active(self) -> bool:
        """Whether anyone listens (the run loop skips building events otherwise)."""
        return bool(self._all) or any(self._by_type.values())

    def publish(self, event: Event) -> None:
        """Deliver ``event`` to its listeners, isolating their failures."""
        for listener in (*self._all, *self._by_type.get(event.type, ())):
            try:
                listener(event)
            except Exception as exc:
                self._report(event, listener, exc)

    def _report(self, event: Event, listener: Listener, exc: Exception) -> None:
        if self.on_error is None:
            logger.warning(
                "event listener %r failed on %s of run %s",
                listener,
                event.type.value,
                event.run_id,
                exc_info=exc,
            )
            return
        try:
            self.on_error(event, listener, exc)
        except Exception:
            logger.exception(
                "event error hook failed on %s of run %s", event.type.value, event.run_id
            )
