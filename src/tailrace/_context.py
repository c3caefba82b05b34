"""The handler's view of where it runs: ``current_node()`` inside a handler.

>>> current_node() is None
True
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeContext:
    """Run id, node id, visit (1-based) and attempt (1-based) of the running handler."""

    run_id: str
    node_id: str
    visit: int
    attempt: int


# The engine stores a plain tuple per attempt; NodeContext is built on demand,
# which keeps the per-node cost of the engine low.
_current: contextvars.ContextVar[tuple[str, str, int, int] | None] = contextvars.ContextVar(
    "tailrace_node", default=None
)


def current_node() -> NodeContext | None:
    """The :class:`NodeContext` of the handler calling this, or None outside handlers."""
    raw = _current.get()
    if raw is None:
        return None
    return NodeContext(run_id=raw[0], node_id=raw[1], visit=raw[2], attempt=raw[3])


def set_current(raw: tuple[str, str, int, int]) -> None:
    """Set (run id, node id, visit, attempt) for the current task; the engine does this per attempt."""
    _current.set(raw)
