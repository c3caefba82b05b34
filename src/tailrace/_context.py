"""The handler's view of where it runs: ``current_node()`` inside a handler.

Outside a handler there is no current node: ``current_node()`` returns None
(code that runs both inside and outside handlers checks for it), and
``current_node(required=True)`` raises ``RuntimeError`` saying so.

>>> current_node() is None
True
>>> current_node(required=True)
Traceback (most recent call last):
  ...
RuntimeError: current_node(required=True) was called outside a handler: only a handler that a tailrace engine runs has a current node
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, cast, overload


@dataclass(frozen=True, slots=True, kw_only=True)
class Checkpoint:
    """A checkpoint an attempt saved (P1), as a later attempt sees it (P2).

    ``value`` is the JSON value the handler passed to
    :meth:`NodeContext.checkpoint`; ``item`` is the map item it belongs to
    (None for a node); ``saved_at`` is the wall-clock time it was saved.
    """

    value: Any
    run_id: str
    node_id: str
    visit: int
    item: int | None
    saved_at: float


class CheckpointSink(Protocol):
    """Where :meth:`NodeContext.checkpoint` sends a value: the run loop driving the attempt."""

    def save(
        self, node_id: str, visit: int, item: int | None, attempt: int, value: Any, handle: Any
    ) -> int:
        """Record ``value`` as the latest checkpoint of try ``attempt`` (encoded now, or refused);
        ``handle`` is the engine's handle on the attempt. A ticket for :meth:`wait_committed`."""

    async def wait_committed(self, ticket: int) -> None:
        """Return once the save that returned ``ticket`` is committed."""


class StreamSink(Protocol):
    """Where ``NodeContext.stream`` hands a chunk: the run's stream buffer (S1)."""

    def publish(self, attempt: Any, tries: int, chunk: Any) -> None:
        """Publish ``chunk`` for try ``tries`` of ``attempt`` (the engine's handle on it)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeContext:
    """Run id, node id, visit (1-based) and attempt (1-based) of the running handler.

    ``item`` is the index of the item a map node's handler runs on (M2), None
    for any other node. ``resumed_from`` is the checkpoint this attempt
    continues from (P2): set when it starts again after a crash, an adoption,
    a retry with ``RetryPolicy(resume=True)`` or an unpark; None otherwise.
    ``backup_of`` is, for a hedge's backup or clone (T3, T5), the attempt
    of the primary it races (the backup keeps that number, as its stream
    chunks and events do); None for a primary. A backup can take another
    replica, another seed or a cheaper path than its primary.
    """

    run_id: str
    node_id: str
    visit: int
    attempt: int
    item: int | None = None
    resumed_from: Checkpoint | None = None
    backup_of: int | None = None
    _sink: CheckpointSink | None = field(default=None, repr=False, compare=False)
    _streams: StreamSink | None = field(default=None, repr=False, compare=False)
    _handle: Any = field(default=None, repr=False, compare=False)

    @property
    def backup(self) -> bool:
        """Whether this attempt is a hedge's backup (or clone) of attempt :attr:`backup_of`."""
        return self.backup_of is not None

    def checkpoint(self, value: Any) -> None:
        """Save ``value`` (JSON) as this attempt's latest checkpoint (P1).

        It replaces the previous one and is committed with the run's next
        write (at once with ``durability="sync"``), without waiting for it:
        :meth:`checkpoint_durable` returns once it is committed. A value the
        run's codec cannot encode raises :class:`~tailrace.EncodeError` here,
        naming the node and the attempt.

        Args:
            value: the checkpoint, a JSON value.
        """
        if self._sink is None:
            raise RuntimeError(
                f"node {self.node_id!r}: checkpoint() needs an attempt run by a tailrace engine"
            )
        self._sink.save(self.node_id, self.visit, self.item, self.attempt, value, self._handle)

    async def checkpoint_durable(self, value: Any) -> None:
        """Save ``value`` like :meth:`checkpoint`, then return once it is committed (P1).

        :meth:`checkpoint` returns at once: its value is committed with the
        run's next write (within the group window with ``durability="async"``,
        at the loop's next step with ``"sync"``), so a process killed right
        after the call may resume from the checkpoint before. This form waits
        for that commit: once it returns, a crash resumes from ``value`` or
        later. Use it before a step that must not be repeated, or where losing
        progress is expensive. It is for ``async def`` handlers (a ``def``
        handler's thread cannot await). Without a store, and for a save that
        is dropped (a try no longer current, a hedge behind its primary), it
        returns at once.

        Args:
            value: the checkpoint, a JSON value (a value the codec refuses raises
                :class:`~tailrace.EncodeError` here).
        """
        if self._sink is None:
            raise RuntimeError(
                f"node {self.node_id!r}: checkpoint_durable() needs an attempt run by a "
                "tailrace engine"
            )
        ticket = self._sink.save(
            self.node_id, self.visit, self.item, self.attempt, value, self._handle
        )
        await self._sink.wait_committed(ticket)

    def stream(self, chunk: Any) -> None:
        """Publish ``chunk``, a JSON value, as partial output of this attempt (S1-S4).

        Chunks are tagged with run, node, visit, item, attempt and whether the
        attempt is a hedge or backup, and keep their order within the attempt.
        The run's codec encodes the chunk here: one it cannot encode raises
        :class:`~tailrace.EncodeError` naming node and attempt, and nothing is
        published. When the attempt ends, its stream gets one terminal mark,
        ``accepted`` or ``discarded`` (S2). Past the run's bound
        (``Engine(max_stream_chunks=)``) the call raises
        :class:`~tailrace.StreamLimit`. Readers: ``Engine.stream``.

        A handler the engine does not run in this process (a remote executor)
        has nowhere to stream to: the call raises ``RuntimeError``.
        """
        if self._streams is None:
            raise RuntimeError(
                f"node {self.node_id!r} (attempt {self.attempt}): current_node().stream "
                "works in handlers the engine runs in its own process"
            )
        self._streams.publish(self._handle, self.attempt, chunk)


#: What the engine stores per attempt: (run id, node id, visit, attempt), plus the
#: item index for an item of a map node and the attempt a backup races (None: it is
#: no backup), then the attempt's checkpoint sink, the checkpoint it resumes from,
#: the stream sink and the engine's handle on the attempt.
_Full = tuple[
    str, str, int, int, int | None, CheckpointSink, Checkpoint | None, StreamSink, Any, int | None
]
_Short = tuple[str, str, int, int, int | None, int | None]
Where = tuple[str, str, int, int] | tuple[str, str, int, int, int] | _Short | _Full

# The engine stores a plain tuple per attempt; NodeContext is built on demand,
# which keeps the per-node cost of the engine low.
_current: contextvars.ContextVar[Where | None] = contextvars.ContextVar(
    "tailrace_node", default=None
)


_OUTSIDE = (
    "current_node(required=True) was called outside a handler: only a handler that a "
    "tailrace engine runs has a current node"
)


@overload
def current_node(*, required: Literal[True]) -> NodeContext: ...


@overload
def current_node(*, required: bool = False) -> NodeContext | None: ...


def current_node(*, required: bool = False) -> NodeContext | None:
    """The :class:`NodeContext` of the handler calling this, or None outside handlers.

    ``current_node().checkpoint(...)`` outside a handler is therefore an
    ``AttributeError`` on None; code that only runs inside handlers asks
    ``current_node(required=True)``, which never returns None (and is typed
    so) and raises ``RuntimeError`` saying that it was called outside a handler.

    Args:
        required: raise ``RuntimeError`` instead of returning None outside a handler.
    """
    raw = _current.get()
    if raw is None:
        if required:
            raise RuntimeError(_OUTSIDE)
        return None
    if len(raw) == 10:
        full = cast("_Full", raw)
        run_id, node_id, visit, attempt, item, sink, resumed, streams, handle, backup_of = full
        return NodeContext(
            run_id=run_id, node_id=node_id, visit=visit, attempt=attempt, item=item,
            resumed_from=resumed, backup_of=backup_of, _sink=sink, _streams=streams,
            _handle=handle,
        )  # fmt: skip
    item = raw[4] if len(raw) >= 5 else None
    backup_of = raw[5] if len(raw) == 6 else None
    return NodeContext(
        run_id=raw[0], node_id=raw[1], visit=raw[2], attempt=raw[3], item=item,
        backup_of=backup_of,
    )  # fmt: skip


def set_current(raw: Where) -> None:
    """Set (run id, node id, visit, attempt[, item[, backup_of]]), or the engine's whole
    record of the attempt (with its sinks and handle), for the current task; the engine
    does this per attempt."""
    _current.set(raw)
