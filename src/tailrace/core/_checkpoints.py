"""Checkpoints inside a node (P1, P2): what running attempts save, and what a later attempt resumes from.

The run loop holds one :class:`Checkpoints` per run. A handler calls
``current_node().checkpoint(value)``; the value is encoded at once (a value
the codec refuses raises there, naming node and attempt), kept as the
attempt's latest, and handed to the next write, where it replaces the
stored one: a checkpoint costs one row per commit, however often it is
saved (P1). An attempt that starts again after a crash or an adoption (the
stored checkpoint), after a retry with ``RetryPolicy(resume=True)`` (the
latest one), or unparked (its parked checkpoint) sees it as
``current_node().resumed_from`` (P2).

Parking lives here too (P3, P4): a straggler cancelled with ``late="park"``
is kept as a :class:`~tailrace.stores.ParkedRow` holding what it ran on and
its latest checkpoint, and a map that takes parked items back resumes each
from that checkpoint.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from .._codec import Codec
from .._context import Checkpoint
from .._errors import EncodeError
from ..stores import CheckpointRow, ParkedRow


class AttemptHandle(Protocol):
    """What checkpoints read of the attempt saving one (the run loop's ``Attempt``)."""

    @property
    def tries(self) -> int:
        """The attempt's current try (1-based)."""

    @property
    def finished(self) -> bool:
        """Whether the attempt ended and was handed to the run loop."""

    @property
    def hedge(self) -> bool:
        """Whether the attempt is a hedge (backup) of another one (T3)."""

    @property
    def abandoned(self) -> bool:
        """Whether the engine is cancelling it on purpose (a loser, a late item, a park)."""

    #: How far its checkpoints got: those it saved, plus the progress it resumed from.
    progress: float


#: A checkpoint's key: node id, visit, and the item of a map's item (-1 for a node).
Key = tuple[str, int, int]


def key_of(node_id: str, visit: int, item: int | None) -> Key:
    return (node_id, visit, -1 if item is None else item)


def parked_checkpoint(row: ParkedRow, value: Any) -> Checkpoint:
    """The checkpoint a parked item resumes from (P2, P4): where it was saved, its value."""
    return Checkpoint(
        value=value, run_id=row.run_id, node_id=row.node_id, visit=row.visit,
        item=None if row.item < 0 else row.item, saved_at=row.parked_at,
    )  # fmt: skip


class Checkpoints:
    """The checkpoints of one run: committed ones read back, and those saved since (P1, P2).

    ``committed`` is what the store held when the run was restored; ``wake``
    asks the run loop for a write. ``save`` may be called from a worker
    thread (a sync handler): the wake-up then goes through ``loop``.
    ``durable``: the run has a store, so stragglers can be parked.
    """

    __slots__ = (
        "_flush",
        "_held",
        "_loop",
        "_parking",
        "_repark",
        "_saved",
        "_staged",
        "_staging",
        "_thread",
        "codec",
        "committed",
        "durable",
        "latest",
        "pending",
        "run_id",
        "wake",
    )

    def __init__(
        self,
        run_id: str,
        codec: Codec,
        committed: dict[Key, Checkpoint],
        wake: Callable[[], None],
        loop: asyncio.AbstractEventLoop,
        *,
        durable: bool = False,
        repark: Callable[[ParkedRow], None] | None = None,
        flush: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.run_id = run_id
        self.codec = codec
        self.durable = durable
        self.committed = committed
        self.wake = wake
        self._loop = loop
        self._thread = threading.get_ident()
        #: Saved in this process, the newest per key, as encoded: decoded only when an
        #: attempt resumes from it (a generation saves many, and resumes from few).
        self.latest: dict[Key, CheckpointRow] = {}
        #: Saved since the last write: the rows it will upsert.
        self.pending: dict[Key, CheckpointRow] = {}
        #: Per key saved here: the attempt whose checkpoint the visit holds, and its progress.
        self._held: dict[Key, tuple[AttemptHandle, float]] = {}
        #: Rows parked while their attempt may still be on its way out, and where a row
        #: goes when that attempt saves a checkpoint on its way (it is parked again).
        self._parking: dict[Key, ParkedRow] = {}
        self._repark = repark
        #: Waits until every write staged so far is committed (None: no store).
        self._flush = flush
        #: Saves kept so far, and how many of them the writer has taken (:meth:`take_pending`).
        self._saved = 0
        self._staged = 0
        #: Set when the writer takes the pending rows (wakes :meth:`wait_committed`).
        self._staging: asyncio.Event | None = None

    def save(
        self,
        node_id: str,
        visit: int,
        item: int | None,
        attempt: int,
        value: Any,
        handle: AttemptHandle | None = None,
    ) -> int:
        """Encode ``value`` now and make it try ``attempt``'s latest checkpoint (P1); any thread.
        The save's ticket for :meth:`wait_committed` (0: dropped, nothing to wait for).

        ``handle`` is the engine's handle on the attempt. A try that is no longer
        current (a ``def`` handler's thread runs on after its timeout, its retry or
        its attempt's end: the engine cannot stop it) has its checkpoints dropped,
        as its stream chunks are.
        """
        key = key_of(node_id, visit, item)
        if handle is not None:
            if attempt != handle.tries or handle.finished:
                return 0
            handle.progress += 1
            if not self._leads(key, handle):
                return 0
            self._held[key] = (handle, handle.progress)
        where = f"node {node_id!r} (visit {visit}" + (f", item {item}" if item is not None else "")
        try:
            text = self.codec.encode(value)
        except (TypeError, ValueError, RecursionError) as exc:
            raise EncodeError(
                f"run {self.run_id!r}: checkpoint of {where}, attempt {attempt}) cannot be "
                f"encoded: {exc}"
            ) from exc
        self.latest[key] = self.pending[key] = CheckpointRow(
            node_id, visit, key[2], attempt, text, time.time()
        )
        on_loop = threading.get_ident() == self._thread
        if handle is not None and handle.abandoned and key in self._parking:
            self._parked_again(key, text, on_loop)
        if on_loop:
            self.wake()
        else:
            self._loop.call_soon_threadsafe(self.wake)
        self._saved += 1
        return self._saved

    async def wait_committed(self, ticket: int) -> None:
        """Return once the save of ``ticket`` is committed to the store (at once: no store, or
        a save that was dropped); on the event loop's thread."""
        if self._flush is None or ticket <= 0:
            return
        while self._staged < ticket:  # the loop, woken by the save, stages it at its next harvest
            if self._staging is None:
                self._staging = asyncio.Event()
            await self._staging.wait()
        await self._flush()

    def _parked_again(self, key: Key, text: str, on_loop: bool) -> None:
        """An attempt parked at its cut saved ``text`` on its way out: its parked row carries it."""
        row = self._parking[key] = self._parking[key]._replace(checkpoint_json=text)
        if self._repark is not None:
            if on_loop:
                self._repark(row)
            else:
                self._loop.call_soon_threadsafe(self._repark, row)

    def _leads(self, key: Key, handle: AttemptHandle) -> bool:
        """Whether a save by ``handle`` becomes the visit's checkpoint: the furthest progress.

        Progress is how many checkpoints an attempt saved since it started afresh
        (an attempt that resumed counts from the checkpoint it resumed from). The
        visit keeps the checkpoint of the attempt that got furthest: the attempt
        holding it always replaces its own, another one (a hedge and its primary)
        only once it got further; on a tie the primary keeps it. A checkpoint
        committed before this process took the run counts as furthest: an
        attempt resumed from it holds it, and a backup, which starts afresh,
        never replaces it.
        """
        held = self._held.get(key)
        if held is None:
            if key not in self.committed:
                return True
            holder, progress = None, math.inf
        else:
            holder, progress = held
        if holder is handle:
            return True
        return handle.progress > progress or (handle.progress == progress and not handle.hedge)

    def resumed(
        self, node_id: str, visit: int, item: int | None, handle: AttemptHandle | None = None
    ) -> Checkpoint | None:
        """The checkpoint an attempt of ``(node, visit, item)`` continues from, if any (P2);
        ``handle``, the attempt starting from it, counts its progress from there."""
        if not self.latest and not self.committed:
            return None
        key = key_of(node_id, visit, item)
        row = self.latest.get(key)
        checkpoint = self.committed.get(key) if row is None else self._read(row)
        if handle is not None and checkpoint is not None:
            held = self._held.get(key)
            handle.progress = math.inf if held is None else held[1]
        return checkpoint

    def _read(self, row: CheckpointRow) -> Checkpoint:
        """A checkpoint saved here, as it reads back from the store."""
        return Checkpoint(
            value=self.codec.decode(row.value_json), run_id=self.run_id, node_id=row.node_id,
            visit=row.visit, item=None if row.item < 0 else row.item, saved_at=row.saved_at,
        )  # fmt: skip

    def take_pending(self) -> list[CheckpointRow]:
        """The rows saved since the last call (the next write's), one per key."""
        rows = list(self.pending.values())
        self.pending.clear()
        self._staged = self._saved
        if self._staging is not None:
            self._staging.set()
            self._staging = None
        return rows

    # -- parking (P3, P4) ----------------------------------------------------------

    def park(
        self,
        graph_name: str,
        node_id: str,
        visit: int,
        item: int | None,
        value: Any,
        *,
        origin: tuple[int, float] | None = None,
    ) -> ParkedRow | None:
        """A straggler of ``node_id`` as it is parked (P3): what it runs on and its checkpoint;
        None when it cannot be kept (no store, or a value the codec refuses: it is cancelled).
        ``origin`` is the parked row's it continued, as (parks, first parked at): it is
        parked once more and keeps its place in claim order (P5).

        Its attempt, cancelled at the park, may save a checkpoint on its way out (in an
        ``except CancelledError``): the row is then parked again with it (``repark``).
        """
        if not self.durable:
            return None
        key = key_of(node_id, visit, item)
        saved, committed = self.latest.get(key), self.committed.get(key)
        try:
            value_json = self.codec.encode(value)
            if saved is not None:
                checkpoint_json: str | None = saved.value_json
            else:
                checkpoint_json = None if committed is None else self.codec.encode(committed.value)
        except (TypeError, ValueError):
            return None
        row = self._parking[key] = ParkedRow(
            park_id=uuid.uuid4().hex, graph_name=graph_name, node_id=node_id,
            run_id=self.run_id, visit=visit, item=-1 if item is None else item,
            value_json=value_json, checkpoint_json=checkpoint_json,
            parked_at=time.time() if origin is None else origin[1],
            parks=1 if origin is None else origin[0] + 1,
        )  # fmt: skip
        return row

    def unpark(self, node_id: str, visit: int, parked: list[ParkedRow]) -> None:
        """The parked items a map's ``visit`` took as its first items continue from their
        checkpoints (P4): item ``j`` from ``parked[j]``'s."""
        for j, row in enumerate(parked):
            if row.checkpoint_json is not None:
                self.committed[(node_id, visit, j)] = parked_checkpoint(
                    row, self.codec.decode(row.checkpoint_json)
                )
