"""An artifact's versions from the evolve ledger, and held-out reward per version as a curve.

Every version's ``meta_json`` says what produced it (``tailrace.evolve``'s
merger records ``held_out``, the acceptance ``probability`` and
``threshold``, the ``sweep``, the audit ``route``, the ``edit`` and its
``base_version``, and ``rebased_onto`` when another writer committed first).
Version 1 is the template (``initial``); the ledger keeps no score for it.
Pure: no I/O.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..stores import ArtifactVersion
from ._format import clock

CURVE_W = 760.0
CURVE_H = 240.0
PAD_L = 52.0
PAD_R = 18.0
PAD_T = 16.0
PAD_B = 34.0


@dataclass(frozen=True, slots=True, kw_only=True)
class VersionRow:
    """One ledger version as the page shows it."""

    version: int
    created: str
    initial: bool
    held_out: float | None
    probability: float | None
    threshold: float | None
    sweep: int | None
    route: str | None
    base_version: int | None
    rebased_onto: int | None
    note: str | None
    set_keys: tuple[str, ...]
    removed_keys: tuple[str, ...]
    entries: dict[str, str]
    meta_text: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Point:
    """A scored version on the curve."""

    x: float
    y: float
    version: int
    value: float
    rebased: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class Curve:
    """The held-out reward curve: points, the line through them and both axes' ticks."""

    width: float
    height: float
    points: tuple[Point, ...]
    path: str
    y_ticks: tuple[tuple[float, str], ...]
    x_ticks: tuple[tuple[float, str], ...]


def version_rows(history: Sequence[ArtifactVersion]) -> list[VersionRow]:
    """Decode every version's entries and meta; undecodable text is shown as it is."""
    return [_row(v) for v in history]


def _row(v: ArtifactVersion) -> VersionRow:
    meta = _object(v.meta_json)
    entries = _object(v.entries_json)
    edit = meta.get("edit") if isinstance(meta.get("edit"), dict) else {}
    assert isinstance(edit, dict)
    return VersionRow(
        version=v.version,
        created=clock(v.created_at),
        initial=bool(meta.get("initial")),
        held_out=_number(meta.get("held_out")),
        probability=_number(meta.get("probability")),
        threshold=_number(meta.get("threshold")),
        sweep=_int(meta.get("sweep")),
        route=None if meta.get("route") is None else str(meta["route"]),
        base_version=_int(meta.get("base_version")),
        rebased_onto=_int(meta.get("rebased_onto")),
        note=None if edit.get("note") in (None, "") else str(edit["note"]),
        set_keys=tuple(sorted(str(k) for k in edit.get("set", {}) or {})),
        removed_keys=tuple(str(k) for k in edit.get("remove", ()) or ()),
        entries={str(k): str(val) for k, val in entries.items()},
        meta_text=json.dumps(meta, indent=2, ensure_ascii=False, sort_keys=True),
    )


def reward_curve(rows: Sequence[VersionRow]) -> Curve | None:
    """Held-out reward against version; None when no version carries a score."""
    scored = [r for r in rows if r.held_out is not None]
    if not scored:
        return None
    values = [r.held_out for r in scored if r.held_out is not None]
    low, high = min(values), max(values)
    if high - low < 1e-9:
        low, high = low - 0.05, high + 0.05
    pad = (high - low) * 0.1
    low, high = low - pad, high + pad
    first, last = rows[0].version, max(rows[-1].version, rows[0].version + 1)
    inner_w, inner_h = CURVE_W - PAD_L - PAD_R, CURVE_H - PAD_T - PAD_B

    def x_of(version: float) -> float:
        return PAD_L + (version - first) / (last - first) * inner_w

    def y_of(value: float) -> float:
        return PAD_T + (high - value) / (high - low) * inner_h

    points = tuple(
        Point(x=x_of(r.version), y=y_of(r.held_out), version=r.version, value=r.held_out,
              rebased=r.rebased_onto is not None)
        for r in scored
        if r.held_out is not None
    )  # fmt: skip
    path = " ".join(f"{'M' if n == 0 else 'L'}{p.x:.1f},{p.y:.1f}" for n, p in enumerate(points))
    y_ticks = tuple((y_of(v), f"{v:.3g}") for v in _nice(low, high))
    step = max(1, math.ceil((last - first) / 10))
    x_ticks = tuple((x_of(v), f"v{v}") for v in range(first, last + 1, step))
    return Curve(width=CURVE_W, height=CURVE_H, points=points, path=path, y_ticks=y_ticks,
                 x_ticks=x_ticks)  # fmt: skip


def _nice(low: float, high: float) -> list[float]:
    """About five round values between ``low`` and ``high``."""
    raw = (high - low) / 5
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    start = math.ceil(low / step) * step
    return [start + n * step for n in range(int((high - start) / step + 1e-9) + 1)]


def _object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
