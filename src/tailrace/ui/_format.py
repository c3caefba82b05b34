"""How values read back from the store are shown: times, durations, JSON previews.

Everything here returns plain text; the templates escape it (Jinja2
autoescape), so a stored ``<script>`` is shown as those characters.
"""

from __future__ import annotations

import datetime
import json
from typing import Any

#: Stored JSON longer than this is cut in tables (the full text is on the detail pages).
PREVIEW_CHARS = 160


def clock(ts: float | None) -> str:
    """A wall-clock time as local ``YYYY-MM-DD HH:MM:SS``; an em dash for None."""
    if ts is None:
        return "—"
    return datetime.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def seconds(value: float | None) -> str:
    """A duration for people: ``850 ms``, ``12.3 s``, ``4 min 5 s``, ``2 h 3 min``."""
    if value is None:
        return "—"
    value = max(value, 0.0)
    if value < 1:
        return f"{value * 1000:.1f} ms" if value < 0.1 else f"{value * 1000:.0f} ms"
    if value < 60:
        return f"{value:.1f} s" if value < 10 else f"{value:.0f} s"
    minutes, secs = divmod(int(value), 60)
    if minutes < 60:
        return f"{minutes} min {secs} s" if secs else f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min"


def decode(text: str | None) -> Any:
    """Stored JSON text as a value; text that is not JSON is returned as it is."""
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return text


def pretty(text: str | None) -> str:
    """Stored JSON for reading: a string as its own text, anything else indented."""
    value = decode(text)
    if isinstance(value, str):
        return value
    return json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True)


def preview(text: str | None, limit: int = PREVIEW_CHARS) -> str:
    """Stored JSON on one line, cut to ``limit`` characters with an ellipsis."""
    if text is None:
        return ""
    value = decode(text)
    flat = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    flat = " ".join(flat.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def event_text(text: str, limit: int = 200) -> str:
    """An event's data on one line, floats to four significant digits (durations, estimates)."""
    value = decode(text)
    if isinstance(value, dict):
        value = {k: float(f"{v:.4g}") if isinstance(v, float) else v for k, v in value.items()}
    return preview(json.dumps(value, ensure_ascii=False), limit) if value else ""


def shorten(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters with an ellipsis."""
    return text if len(text) <= limit else text[: max(limit - 1, 1)] + "…"
