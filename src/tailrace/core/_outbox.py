"""What a run has to say since its last write: events, and the ledger rows that go with them.

The run loop holds one :class:`Outbox`. Events are buffered as plain tuples
(an :class:`~tailrace.Event` is built only for listeners, a store row only
for the store); answers applied, questions superseded and stragglers parked
wait beside them. Each stage of the loop takes all of it in one
:class:`~tailrace.core._writer.Stage` (D1), and the events are published
once that stage is durable, or at once when the run has no store.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from .._events import Event, EventType
from ..stores import ParkedRow

#: A buffered event: (seq, type, node index or None, visit, attempt, ts, data or None).
EventTuple = tuple[
    int, EventType, int | None, int | None, int | None, float, Mapping[str, Any] | None
]


class Outbox:
    """The events and ledger rows of one run not yet staged, and those staged but not published.

    ``ids`` are the run's node ids by index; ``publish`` hands an event to
    in-process listeners (None: nobody listens); ``record`` is False when
    nothing would read the events (no listener, no store), so none are built.
    """

    __slots__ = (
        "_publish",
        "applied",
        "events",
        "ids",
        "parked",
        "record",
        "run_id",
        "seq",
        "superseded",
        "unpublished",
    )

    def __init__(
        self,
        run_id: str,
        ids: tuple[str, ...],
        publish: Callable[[Event], None] | None,
        *,
        record: bool,
        seq: int = 0,
    ) -> None:
        self.run_id = run_id
        self.ids = ids
        self._publish = publish
        self.record = record
        #: The last event's sequence number (stored with the run's state).
        self.seq = seq
        self.events: list[EventTuple] = []
        #: Staged events that wait for their write to be durable.
        self.unpublished: list[EventTuple] = []
        #: Answers applied, questions superseded and stragglers parked since the last stage.
        self.applied: list[str] = []
        self.superseded: list[str] = []
        self.parked: list[ParkedRow] = []

    def repark(self, row: ParkedRow) -> None:
        """Park ``row`` again: its attempt saved a checkpoint on its way out (P3). It replaces
        the row of the same park id still unstaged; a staged one is updated by the store."""
        for n, staged in enumerate(self.parked):
            if staged.park_id == row.park_id:
                self.parked[n] = row
                return
        self.parked.append(row)

    def emit(
        self,
        type: EventType,
        node: int | None = None,
        visit: int | None = None,
        attempt: int | None = None,
        **data: Any,
    ) -> None:
        """Buffer an event; it is committed with the harvest and then published."""
        if self.record:
            self.seq += 1
            self.events.append((self.seq, type, node, visit, attempt, time.time(), data))

    def put(
        self,
        type: EventType,
        node: int,
        visit: int,
        attempt: int,
        data: Mapping[str, Any] | None,
    ) -> None:
        """:meth:`emit` with its data as one mapping (the per-attempt events: no keyword packing)."""
        if self.record:
            self.seq += 1
            self.events.append((self.seq, type, node, visit, attempt, time.time(), data))

    def take(self) -> list[EventTuple]:
        """The events buffered since the last call."""
        events, self.events = self.events, []
        return events

    def event(self, item: EventTuple) -> Event:
        """The :class:`Event` of a buffered event tuple."""
        seq, type, node, visit, attempt, ts, data = item
        return Event(
            run_id=self.run_id,
            seq=seq,
            type=type,
            ts=ts,
            node_id=None if node is None else self.ids[node],
            visit=visit,
            attempt=attempt,
            data=data if isinstance(data, dict) else dict(data or {}),
        )

    def publish(self, events: list[EventTuple]) -> None:
        """Hand ``events`` to the in-process listeners, in order."""
        publish = self._publish
        if publish is not None:
            for item in events:
                publish(self.event(item))

    def publish_waiting(self) -> None:
        """Publish the staged events that waited for their write to be durable."""
        events, self.unpublished = self.unpublished, []
        self.publish(events)
