"""The run page's Gantt: a row per node visit (and per hedge), a bar per attempt, try and wait.

The attempts come from ``tailrace._attempts`` (shared with ``tailrace show``);
this module only places them on an SVG canvas of fixed user units, so the
browser scales the picture and no inline style is needed (the page's CSP
forbids them). Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .._attempts import Attempt, Outcome
from ._format import seconds, shorten

LABEL_W = 200.0
TRACK_W = 820.0
ROW_H = 22.0
BAR_H = 14.0
AXIS_H = 26.0
LABEL_CHARS = 26
#: Room right of the track for the last tick's label and end marks.
RIGHT_PAD = 40.0

_SAYS = {
    Outcome.COMPLETED: "completed",
    Outcome.FAILED: "failed",
    Outcome.RETRIED: "failed, retried",
    Outcome.CANCELLED: "cancelled",
    Outcome.LOST: "lost the hedge race, cancelled",
    Outcome.CUT: "cut by a crash or stop (re-run on resume)",
    Outcome.RUNNING: "running",
    Outcome.ASKED: "asked a question",
    Outcome.WAITING: "waiting for an answer",
    Outcome.SUSPENDED: "suspended for its child runs (the run held no slot while they ran)",
    Outcome.CHILDREN: "waiting for its child runs, the run suspended",
    Outcome.PARKED: "parked with its last checkpoint (a later run can continue it)",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Bar:
    """One attempt on the canvas; ``straggler_x`` is where it became a straggler."""

    x: float
    y: float
    w: float
    outcome: str
    hedge: bool
    late: bool
    straggler_x: float | None
    title: str
    #: Where the attempt's last committed checkpoint was saved (P1), if it was in it.
    checkpoint_x: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Row:
    """A node visit's row (a hedge gets its own, under its node's)."""

    label: str
    full_label: str
    y: float
    hedge: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class Gantt:
    """Rows, bars and the time axis; ``span`` is the seconds the track covers."""

    width: float
    height: float
    rows: tuple[Row, ...]
    bars: tuple[Bar, ...]
    ticks: tuple[tuple[float, str], ...]
    span: float
    counts: dict[str, int]


def gantt(
    attempts: Sequence[Attempt],
    checkpoints: Mapping[tuple[str, int | None, int | None], float] | None = None,
) -> Gantt:
    """Lay ``attempts`` out: a row per node visit in order of first start (its hedge just under it),
    x scaled to the run's span. ``checkpoints`` maps (node, visit, item) to when its last
    committed checkpoint was saved: the attempt running then gets a checkpoint mark."""
    if not attempts:
        return Gantt(width=LABEL_W + TRACK_W + RIGHT_PAD, height=AXIS_H, rows=(), bars=(), ticks=(),
                     span=0.0, counts={})  # fmt: skip
    t0 = min(a.start for a in attempts)
    span = max(max(a.end for a in attempts) - t0, 1e-3)
    scale = TRACK_W / span
    rows = _rows(attempts)
    y_of = {(r.full_label.removesuffix(" hedge"), r.hedge): r.y for r in rows}
    bars: list[Bar] = []
    counts: dict[str, int] = {}
    saved = checkpoints or {}
    for a in attempts:
        straggler = None if a.straggler_at is None else LABEL_W + (a.straggler_at - t0) * scale
        at = saved.get((a.node_id, a.visit, a.item))
        mark = None if at is None or not a.start <= at <= a.end else LABEL_W + (at - t0) * scale
        bars.append(
            Bar(x=LABEL_W + (a.start - t0) * scale, y=y_of[(a.label, a.hedge)] + (ROW_H - BAR_H) / 2,
                w=max((a.end - a.start) * scale, 2.0), outcome=a.outcome.value, hedge=a.hedge,
                late=a.late, straggler_x=straggler, title=_title(a, t0), checkpoint_x=mark)
        )  # fmt: skip
        counts[a.outcome.value] = counts.get(a.outcome.value, 0) + 1
        counts["straggler"] = counts.get("straggler", 0) + (a.straggler_at is not None)
        counts["hedge"] = counts.get("hedge", 0) + a.hedge
    return Gantt(
        width=LABEL_W + TRACK_W + RIGHT_PAD,
        height=AXIS_H + len(rows) * ROW_H + 6,
        rows=tuple(rows),
        bars=tuple(bars),
        ticks=tuple((LABEL_W + t * scale, seconds(t) if t else "0") for t in _ticks(span)),
        span=span,
        counts={k: v for k, v in counts.items() if v},
    )


def _rows(attempts: Sequence[Attempt]) -> list[Row]:
    """One row per node visit in order of first start; a visit's hedges get a row just under it."""
    order: dict[str, None] = {}
    hedged: set[str] = set()
    for a in attempts:
        order.setdefault(a.label, None)
        if a.hedge:
            hedged.add(a.label)
    keys = [
        (label, hedge)
        for label in order
        for hedge in ((False, True) if label in hedged else (False,))
    ]
    rows = []
    for n, (label, hedge) in enumerate(keys):
        full = f"{label} hedge" if hedge else label
        rows.append(
            Row(
                label=shorten(full, LABEL_CHARS), full_label=full, y=AXIS_H + n * ROW_H, hedge=hedge
            )
        )
    return rows


def _title(a: Attempt, t0: float) -> str:
    """The bar's tooltip: what, how it ended, when, how long, and why."""
    who = a.label + (" (hedge)" if a.hedge else "")
    tried = f" try {a.attempt}" if a.attempt is not None else ""
    parts = [
        f"{who}{tried}: {_SAYS[a.outcome]}",
        f"from {seconds(a.start - t0)} for {seconds(a.duration)}",
    ]
    if a.straggler_at is not None:
        parts.append(f"straggler after {seconds(a.straggler_at - a.start)}")
    if a.late:
        parts.append("completed after its aggregate fired (late input)")
    if a.error:
        parts.append(a.error)
    return "\n".join(parts)


def _ticks(span: float) -> list[float]:
    """About six round tick values (1, 2 or 5 times a power of ten) from 0 to ``span``."""
    raw = span / 6
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    count = int(span / step + 1e-9)
    return [n * step for n in range(count + 1)]
