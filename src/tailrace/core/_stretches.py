"""Who drove a run: its stretches, read from its events (W6).

Every engine that starts or resumes a run records its owner name in the
``run_started`` or ``run_resumed`` event that opens its stretch (one
commit it makes anyway). A stretch runs from that event to the last event
before the next one opens; a run adopted after its worker died shows the
dead worker's stretch, then the adopter's. A stretch whose driver died
before its first commit became durable left nothing, so it is not listed.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

from .._events import EventType
from ..stores import EventRow

_OPENERS = {EventType.RUN_STARTED.value: "started", EventType.RUN_RESUMED.value: "resumed"}


@dataclass(frozen=True, slots=True, kw_only=True)
class Stretch:
    """One stretch of a run driven by one owner.

    ``owner`` is the engine's or worker's lease owner name (``host:pid:...``;
    None for events written before owners were recorded); ``how`` is
    ``"started"`` or ``"resumed"``; ``started_at`` and ``ended_at`` are the
    times of its first and last events; ``events`` counts them.
    """

    owner: str | None
    how: str
    started_at: float
    ended_at: float
    events: int


def stretches_of(events: Iterable[EventRow]) -> list[Stretch]:
    """The stretches of a run from its events in ``seq`` order (events before the first opener,
    if any, form a stretch of their own, its owner unknown)."""
    out: list[Stretch] = []
    for event in events:
        how = _OPENERS.get(event.type)
        if how is not None or not out:
            out.append(
                Stretch(
                    owner=_owner(event.data_json), how=how or "started",
                    started_at=event.ts, ended_at=event.ts, events=1,
                )
            )  # fmt: skip
            continue
        last = out[-1]
        out[-1] = Stretch(
            owner=last.owner, how=last.how, started_at=last.started_at,
            ended_at=max(last.ended_at, event.ts), events=last.events + 1,
        )  # fmt: skip
    return out


def _owner(data_json: str) -> str | None:
    try:
        data = json.loads(data_json)
    except ValueError:
        return None
    owner = data.get("owner") if isinstance(data, dict) else None
    return owner if isinstance(owner, str) else None
