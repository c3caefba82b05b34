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


_current: contextvars.ContextVar[NodeContext | None] = contextvars.ContextVar(
    "tailrace_node", default=None
)


def current_node() -> NodeContext | None:
    """The :class:`NodeContext` of the handler calling this, or None outside handlers."""
    return _current.get()


def set_current(ctx: NodeContext) -> contextvars.Token[NodeContext | None]:
    """Set the context for the current task (the engine does this per attempt)."""
    return _current.set(ctx)
