"""A Gantt-style timeline of every node attempt of a run."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from rich.table import Table
from rich.text import Text

from .._attempts import (
    Attempt,
    MapSummary,
    Outcome,
    SeenKey,
    attempts_from_events,
    fold_items,
    map_summaries,
)
from ..stores import EventRow
from ._render import table_of, visible

#: Item rows drawn per map visit: its slowest items; the others fold into one row.
ITEM_ROWS = 12

#: Colour per outcome; attempts cut by a crash and hedges that lost are grey.
_STYLES = {
    Outcome.COMPLETED: "green",
    Outcome.FAILED: "red",
    Outcome.RETRIED: "dark_orange",
    Outcome.CANCELLED: "yellow",
    Outcome.LOST: "grey50",
    Outcome.CUT: "grey50",
    Outcome.RUNNING: "blue",
    Outcome.ASKED: "magenta",
    Outcome.WAITING: "grey70",
    Outcome.SUSPENDED: "magenta",
    Outcome.CHILDREN: "grey70",
    Outcome.PARKED: "cyan",
}


@dataclass(frozen=True, slots=True)
class Bar:
    """One node attempt on the timeline."""

    label: str
    start: float
    end: float
    style: str
    #: Whether a crash or a stop cut the attempt (it ends at the last thing known of it).
    cut: bool = False


def _bar(attempt: Attempt) -> Bar:
    label = attempt.label
    if attempt.attempt is not None and attempt.attempt > 1:  # a retry or a re-run after a cut
        label = f"{label} try {attempt.attempt}"
    label = f"{label} hedge" if attempt.hedge else label
    cut = attempt.outcome is Outcome.CUT
    return Bar(label, attempt.start, attempt.end, _STYLES[attempt.outcome], cut)


def attempt_bars(
    events: Sequence[EventRow], seen: Mapping[SeenKey, float] | None = None
) -> list[Bar]:
    """A bar per attempt, try and gate wait (``tailrace._attempts`` decides how each ended).

    An attempt still open when the run was resumed was interrupted by a crash
    (or a stop): its bar ends at the last thing known of it (its last event,
    or its last checkpoint or stream chunk in ``seen``, from
    ``tailrace._attempts.last_known``), in grey, marked cut. A hedge's rival
    that lost ends when the winner completed. A map visit draws its
    :data:`ITEM_ROWS` slowest items; the rest fold into one bar.
    """
    attempts = attempts_from_events(events, seen=seen)
    return [_bar(a) for a in fold_items(attempts, keep=ITEM_ROWS)]


def timeline(
    events: Sequence[EventRow], *, width: int = 60, seen: Mapping[SeenKey, float] | None = None
) -> Text:
    """A bar per node attempt, scaled to ``width`` columns; colour says how it ended.

    ``seen`` is the latest time known of each attempt besides its events
    (``tailrace._attempts.last_known``): a cut attempt is drawn up to it.
    """
    bars = attempt_bars(events, seen)
    if not bars:
        return Text("(no node attempts recorded)")
    t0 = min(b.start for b in bars)
    span = max(max(b.end for b in bars) - t0, 1e-9)
    label_width = min(max(len(visible(b.label)) for b in bars), 24)
    out = Text()
    for bar in bars:
        left = int((bar.start - t0) / span * width)
        length = max(1, int((bar.end - bar.start) / span * width))
        out.append(f"{visible(bar.label)[:label_width]:<{label_width}} ")  # node ids are data
        out.append(" " * left)
        out.append("█" * length, style=bar.style)
        out.append(f" {(bar.end - bar.start) * 1000:.1f} ms{' cut' if bar.cut else ''}\n")
    out.append(f"{'':<{label_width}} 0{'':>{max(width - 8, 1)}}{span:.3f}s")
    return out


#: Winners listed per map before the rest is counted.
WINNERS_SHOWN = 8


def map_table(
    events: Sequence[EventRow], seen: Mapping[SeenKey, float] | None = None
) -> Table | None:
    """A row per map visit: its items by outcome, its k and winners, its slowest items (M2-M5).

    ``seen`` is as for :func:`timeline` (a cut item's time runs to the last thing known of it).
    """
    maps = map_summaries(events, attempts_from_events(events, seen=seen))
    if not maps:
        return None
    headers = (
        "map",
        "items",
        "k",
        "completed",
        "late",
        "failed",
        "cancelled",
        "parked",
        "winners",
        "slowest",
    )
    return table_of(headers, (_map_row(m) for m in maps), title="map items")


def _map_row(m: MapSummary) -> tuple[str, ...]:
    if m.winners is None:
        winners = "undecided" + (f", {m.running} running" if m.running else "")
    else:
        shown = ", ".join(str(w) for w in m.winners[:WINNERS_SHOWN])
        more = len(m.winners) - WINNERS_SHOWN
        winners = shown + (f" (+{more})" if more > 0 else "")
    slowest = ", ".join(f"#{j} {seconds * 1000:.0f} ms" for j, seconds in m.slowest)
    return (
        f"{m.node_id}#{m.visit}",
        str(m.items),
        "-" if m.k is None else str(m.k),
        str(m.completed),
        str(m.late),
        str(m.failed),
        str(m.cancelled),
        str(m.parked),
        winners,
        slowest,
    )
