"""A Gantt-style timeline of every node attempt of a run."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rich.text import Text

from ..stores import EventRow
from ._render import visible

_ENDS = {"node_completed": "green", "node_failed": "red", "node_cancelled": "yellow"}


@dataclass(frozen=True, slots=True)
class Bar:
    """One node attempt on the timeline."""

    label: str
    start: float
    end: float
    style: str


def attempt_bars(events: Sequence[EventRow]) -> list[Bar]:
    """Pair each NODE_STARTED with the event that ended that attempt.

    An attempt still open when the run was resumed was interrupted by a crash
    (or a stop): its bar ends at the resume, in grey. A hedge's rival that
    lost ends when the winner completed.
    """
    open_at: dict[tuple[str, int | None], list[float]] = {}
    bars: list[Bar] = []
    last = max((e.ts for e in events), default=0.0)
    for e in events:
        if e.type == "run_resumed":
            for (node_id, visit), starts in open_at.items():
                bars.extend(Bar(f"{node_id}#{visit}", t, e.ts, "grey50") for t in starts)
            open_at.clear()
        if e.node_id is None:
            continue
        key = (e.node_id, e.visit)
        if e.type == "node_started":
            open_at.setdefault(key, []).append(e.ts)
        elif e.type in _ENDS and key in open_at:
            starts = open_at.pop(key)
            label = f"{e.node_id}#{e.visit}"
            bars.append(Bar(label, starts[0], e.ts, _ENDS[e.type]))
            bars.extend(Bar(f"{label} hedge", t, e.ts, "grey50") for t in starts[1:])
    for (node_id, visit), starts in open_at.items():
        bars.extend(Bar(f"{node_id}#{visit}", t, last, "blue") for t in starts)
    return sorted(bars, key=lambda b: (b.start, b.label))


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
