"""A LangGraph graph's custom stream writes, as tailrace stream chunks of the thread's run (S1-S3).

A node that writes with LangGraph's ``get_stream_writer()`` (or takes a
``StreamWriter`` argument) writes to :class:`ThreadStream` while the driver
runs its graph step: the driver hands LangGraph a parent runtime whose
stream writer is :meth:`ThreadStream.write`, which runs in the writing task's
own context, so it knows the LangGraph task (its id, in the task's
``checkpoint_ns``) and so the node, visit and attempt, numbered like the
thread's events (:mod:`._langgraph_events`). Each write is encoded at the
call (S4), tagged (S1) and committed under the thread's lease as soon as the
store is free, one commit in flight at a time, the rows written meanwhile in
the next one; readers anywhere read them with ``Engine.stream(thread_id)`` or
``tailrace tail``.

Marks (S2): when LangGraph reports a task's result, its stream ends
``accepted`` (LangGraph has its writes) or ``discarded`` (it failed, or
stopped on an ``interrupt()``: the node runs again, as the next attempt,
once answered). A step that raises discards what is still open. A driver
killed mid-step writes no mark: the next one to drive the thread marks every
stream it finds open ``discarded`` before anything runs, numbers its rows
after the stored ones, and counts the re-run of a cut task as one attempt
more.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from .._codec import DEFAULT_CODEC
from ..core import MAX_STREAM_CHUNKS, StreamBound, StreamCursor, StreamTags
from ..stores import ChunkRow, Harvest, RunRecord, RunStore, StreamHead
from ._langgraph_support import state_of

if TYPE_CHECKING:
    from ._langgraph_events import StepLog

logger = logging.getLogger("tailrace.integrations.langgraph")

#: Separates a nested graph's namespace parts in LangGraph's ``checkpoint_ns``.
_NS_SEP = "|"


def writer_config(write: Callable[[Any], None]) -> dict[str, Any] | None:
    """``configurable`` entries that make ``write`` the stream writer of every task of a step.

    LangGraph builds each task's runtime from its parent's (``Runtime.merge``)
    and, for a graph run inside another's task, uses the parent runtime's
    stream writer. The driver runs the graph as such a child: its
    ``configurable`` carries a runtime with ``write`` and an outer stream that
    takes no mode, so nothing else changes. None when this LangGraph has no
    such keys (custom writes are then not forwarded).
    """
    try:
        from langgraph._internal._constants import CONFIG_KEY_RUNTIME, CONFIG_KEY_STREAM
        from langgraph.pregel.protocol import StreamProtocol
        from langgraph.runtime import DEFAULT_RUNTIME
    except ImportError:  # pragma: no cover - depends on the LangGraph release
        return None
    runtime = dataclasses.replace(DEFAULT_RUNTIME, stream_writer=write)
    return {CONFIG_KEY_STREAM: StreamProtocol(_ignore, set()), CONFIG_KEY_RUNTIME: runtime}


def _ignore(_chunk: Any) -> None:
    """The outer stream of :func:`writer_config`: it takes no mode, so it is never called."""


def _writing_task() -> tuple[str, str] | None:
    """``(node, task id)`` of the LangGraph task of the thread's own graph writing now, or None.

    A write from a nested graph belongs to the outer task that runs it (the
    first part of the namespace).
    """
    from langgraph.config import get_config

    try:
        config = get_config()
    except RuntimeError:  # not inside a LangGraph task
        return None
    ns = (config.get("configurable") or {}).get("checkpoint_ns")
    if not isinstance(ns, str) or not ns:
        return None
    node, sep, task = ns.split(_NS_SEP, 1)[0].partition(":")
    return (node, task) if sep and task else None


@dataclasses.dataclass(slots=True)
class _Task:
    """One LangGraph task of the step that streams: its tags and its stream's first seq."""

    node: str
    visit: int | None = None
    attempt: int | None = None
    stream: int | None = None
    ended: bool = False
    #: Chunks written before the task's start was seen: (text, ts), tagged once it is.
    early: list[tuple[str, float]] = dataclasses.field(default_factory=list)


class ThreadStream:
    """One graph step's stream rows for thread ``record.run_id``, committed under ``token``.

    Built on the driver's event loop; :meth:`write` and :meth:`task_event`
    may be called from any thread.
    """

    def __init__(
        self,
        store: RunStore,
        record: RunRecord,
        token: int,
        head: StreamHead,
        log: StepLog,
        *,
        max_chunks: int = MAX_STREAM_CHUNKS,
    ) -> None:
        self._store = store
        self._record = record
        self._token = token
        self._log = log
        self._state = state_of(record)
        self.run_id = record.run_id
        #: Numbers and tags the rows; refuses what does not encode or passes the bound,
        #: which counts every row of the thread (the stored ones too).
        self.cursor = StreamCursor(
            self.run_id,
            DEFAULT_CODEC,
            owner="thread",
            max_chunks=max_chunks,
            bound=StreamBound.ROWS,
            attempts="LangGraph task {}",
        )
        self._tasks: dict[str, _Task] = {}
        self._rows: list[ChunkRow] = []
        self._flusher: asyncio.Task[None] | None = None
        self._failed = False
        for mark in self.cursor.reopen(head):  # a driver died mid-step: discarded (S2)
            self._append(mark)
            log.cut(self.run_id, mark.node_id, mark.visit, mark.attempt)

    # -- the writing task's side -------------------------------------------------

    def write(self, chunk: Any) -> None:
        """A node's custom stream write: encoded now (S4), published for its task (S1)."""
        where = _writing_task()
        if where is None:
            return  # not from a task of this step's graph: nowhere to put it
        node, task = where
        text = self.cursor.encode(chunk, node, task)
        self.cursor.on_loop(self._chunk, node, task, text, time.time())

    def _chunk(self, node: str, task_id: str, text: str, ts: float) -> None:
        task = self._tasks.get(task_id)
        if task is None:  # written before the driver saw the task start: tagged when it does
            task = self._tasks[task_id] = _Task(node)
        if task.ended:
            return  # after its stream's mark (a thread the task left behind): dropped
        if task.visit is None:
            task.early.append((text, ts))
            return
        self._chunk_row(task, text, ts)

    # -- the driver's side ---------------------------------------------------------

    def task_event(self, chunk: Any) -> None:
        """One chunk of LangGraph's ``tasks`` stream (after the step log saw it); any thread."""
        self.cursor.on_loop(self._task_event, chunk)

    def _task_event(self, chunk: Any) -> None:
        if not isinstance(chunk, Mapping) or not isinstance(chunk.get("name"), str):
            return
        task_id = chunk.get("id")
        if not isinstance(task_id, str):
            return
        if "triggers" in chunk and "result" not in chunk:  # started: its tags are known now
            visit, attempt = self._log.tags(self.run_id, self._state, task_id)
            if visit is None:
                return  # not a node of the graph's author (LangGraph's own endpoints)
            task = self._tasks.setdefault(task_id, _Task(chunk["name"]))
            task.visit, task.attempt, task.ended = visit, attempt, False
            task.stream = None
            early, task.early = task.early, []
            for text, ts in early:
                self._chunk_row(task, text, ts)
            return
        ending = self._tasks.get(task_id)
        if ending is None or ending.ended:
            return
        accepted = chunk.get("error") is None and not chunk.get("interrupts")
        self._end(ending, accepted=accepted)

    def _end(self, task: _Task, *, accepted: bool) -> None:
        task.ended = True
        if task.stream is None:
            return  # it never streamed: no mark
        self._append(self.cursor.mark(task.stream, self._tags(task), accepted=accepted))

    async def close(self) -> None:
        """The step ended: discard the streams still open, and wait until every row is committed."""
        for task in self._tasks.values():
            if task.early and task.visit is None:  # its start never came: tag it now
                task.visit, task.attempt = self._log.tags(
                    self.run_id, self._state, None, node=task.node
                )
                early, task.early = task.early, []
                for text, ts in early:
                    self._chunk_row(task, text, ts)
            if not task.ended:
                self._end(task, accepted=False)
        while self._flusher is not None:
            await asyncio.shield(self._flusher)

    # -- rows ------------------------------------------------------------------------

    def _chunk_row(self, task: _Task, text: str, ts: float) -> None:
        row = self.cursor.chunk(task.stream, self._tags(task), text, ts)
        task.stream = row.stream
        self._append(row)

    @staticmethod
    def _tags(task: _Task) -> StreamTags:
        """A task's tags: no map items or hedges in a LangGraph graph."""
        assert task.visit is not None and task.attempt is not None
        return (task.node, task.visit, None, task.attempt, False)

    def _append(self, row: ChunkRow) -> None:
        if self._failed:
            return
        self._rows.append(row)
        if self._flusher is None:
            self._flusher = asyncio.ensure_future(self._flush())

    async def _flush(self) -> None:
        """Commit the rows gathered, one commit at a time, until none is left."""
        record = self._record
        try:
            while self._rows:
                rows, self._rows = self._rows, []
                harvest = Harvest(state_json=record.state_json, status=record.status,
                                  error=record.error, chunks=rows)  # fmt: skip
                await self._store.commit(self.run_id, self._token, harvest)
        except Exception:
            # The lease is lost or the store failed: the step's own bookkeeping
            # commit reports it; the rows of this step go no further.
            logger.exception("thread %s: committing stream rows failed", self.run_id)
            self._failed = True
            self._rows = []
        finally:
            self._flusher = None
