"""The handler's view of where it runs: ``current_node()`` inside a handler.

>>> current_node() is None
True
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeContext:
    """Run id, node id, visit (1-based) and attempt (1-based) of the running handler.

    ``item`` is the index of the item a map node's handler runs on (M2), None
    for any other node.
    """

    run_id: str
    node_id: str
    visit: int
    attempt: int
    item: int | None = None


#: What the engine stores per attempt: (run id, node id, visit, attempt), plus the
#: item index for an item of a map node.
Where = tuple[str, str, int, int] | tuple[str, str, int, int, int]

# The engine stores a plain tuple per attempt; NodeContext is built on demand,
# which keeps the per-node cost of the engine low.
_current: contextvars.ContextVar[Where | None] = contextvars.ContextVar(
    "tailrace_node", default=None
)


def current_node() -> NodeContext | None:
    """The :class:`NodeContext` of the handler calling this, or None outside handlers."""
    raw = _current.get()
    if raw is None:
        return None
    item = raw[4] if len(raw) > 4 else None
    return NodeContext(run_id=raw[0], node_id=raw[1], visit=raw[2], attempt=raw[3], item=item)


def set_current(raw: Where) -> None:
    """Set (run id, node id, visit, attempt[, item]) for the current task; the engine does this per attempt."""
    _current.set(raw)
