"""A Gantt-style timeline of every node attempt of a run."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rich.text import Text

from .._attempts import Attempt, Outcome, attempts_from_events
from ..stores import EventRow
from ._render import visible

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
}


@dataclass(frozen=True, slots=True)
class Bar:
    """One node attempt on the timeline."""

    label: str
    start: float
    end: float
    style: str


def _bar(attempt: Attempt) -> Bar:
    label = f"{attempt.label} hedge" if attempt.hedge else attempt.label
    return Bar(label, attempt.start, attempt.end, _STYLES[attempt.outcome])


def attempt_bars(events: Sequence[EventRow]) -> list[Bar]:
    """A bar per attempt, try and gate wait (``tailrace._attempts`` decides how each ended).

    An attempt still open when the run was resumed was interrupted by a crash
    (or a stop): its bar ends at the resume, in grey. A hedge's rival that
    lost ends when the winner completed.
    """
    return [_bar(a) for a in attempts_from_events(events)]


def timeline(events: Sequence[EventRow], *, width: int = 60) -> Text:
    """A bar per node attempt, scaled to ``width`` columns; colour says how it ended."""
    bars = attempt_bars(events)
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
        out.append(f" {(bar.end - bar.start) * 1000:.1f} ms\n")
    out.append(f"{'':<{label_width}} 0{'':>{max(width - 8, 1)}}{span:.3f}s")
    return out
