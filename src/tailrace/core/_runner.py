"""How an attempt runs: as a task, on the direct path, with retries and a timeout, on an
executor, or as a child run (E11, R1); and what ``current_node()`` reads inside it.

The run loop holds one :class:`AttemptRunner` (as LangGraph's loop holds its
``PregelRunner``): the loop decides which attempts start, the runner starts
each as a task of the in-flight set, publishes its ``NODE_STARTED`` and
reports its end, with its value or error, back through the in-flight set.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Mapping
from typing import Any

from .._context import Checkpoint, Where, set_current
from .._errors import RunError
from .._events import EventType
from ..executors._base import AttemptContext, Executor
from ..executors._threads import HandlerThreads, current_threads, run_sync
from ..graph import Node, RetryPolicy, Topology
from ._admission import RunAdmission
from ._checkpoints import Checkpoints
from ._children import Children
from ._hedger import Hedger
from ._inflight import Attempt, InFlight, describe, traceback_text
from ._outbox import Outbox
from ._state import ItemStatus, NodeStatus, RunState
from ._streams import Streams


def retry_wait(retry: RetryPolicy, tries: int, exc: BaseException) -> float:
    """Seconds to wait after failed try ``tries``: the policy's backoff, or longer when
    ``exc`` carries a ``retry_after`` (the server asked to wait), at most ``max_backoff``.

    ``retry_after`` is read by name (duck-typed), so any client's error carries it
    without the engine importing the client; only a finite number >= 0 counts.
    """
    delay = retry.delay(tries)
    asked = getattr(exc, "retry_after", None)
    if isinstance(asked, bool) or not isinstance(asked, int | float):
        return delay
    if not math.isfinite(asked) or asked < 0:
        return delay
    return max(delay, min(float(asked), retry.max_backoff))


class AttemptRunner:
    """Starts and runs the attempts of one run.

    It is handed the run's values: its id, state, executors per node (None:
    every node inline), in-flight set, outbox, admission (a child run's
    attempt gives its slot back), checkpoints, streams and hedger.
    ``children`` runs the attempts of nodes whose handler is a graph; the
    engine sets it when the graph has such nodes, and ``threads``, its pool
    for ``def`` handlers.
    """

    def __init__(
        self,
        *,
        run_id: str,
        state: RunState,
        executors: list[Executor | None] | None,
        inflight: InFlight,
        outbox: Outbox,
        admission: RunAdmission,
        checkpoints: Checkpoints,
        streams: Streams,
        hedger: Hedger | None,
    ) -> None:
        self.run_id = run_id
        self._state = state
        self.topo = state.topo
        self._executors = executors
        self._inflight = inflight
        self._outbox = outbox
        self._admission = admission
        self.checkpoints = checkpoints
        self.streams = streams
        self._hedger = hedger
        self._loop = asyncio.get_running_loop()
        self.children: Children | None = None
        #: The engine's pool for ``def`` handlers (None: asyncio's default pool); the engine
        #: sets it, so that handlers cut while they run hold its threads, not the process's.
        self.threads: HandlerThreads | None = None
        self._plan_paths(self.topo, executors)

    def _plan_paths(self, topo: Topology, executors: list[Executor | None] | None) -> None:
        """Per node, the path its attempts take: direct, with retries/timeout/executor, a child."""
        self._async = topo.is_async
        if executors is not None:  # nodes sent to an executor take the _invoke path
            self._async = tuple(
                a and e is None for a, e in zip(self._async, executors, strict=True)
            )
        #: Per node: an async handler with no retry, timeout or executor, which
        #: its attempt awaits directly (the common case, kept short).
        self._direct = tuple(
            a and n.retry is None and n.timeout is None
            for a, n in zip(self._async, topo.nodes, strict=True)
        )
        #: Per node: whether its handler is a graph run as a child run (R1).
        self._child = tuple(n.child for n in topo.nodes)

    def launch(self, attempt: Attempt, payload: Any, data: Mapping[str, Any] | None) -> None:
        """Run ``attempt`` on ``payload`` as a task; its NODE_STARTED carries ``data``."""
        i = attempt.index
        node = self.topo.nodes[i]
        if self._direct[i]:
            coro = self._run_direct(node, payload, attempt)
        elif self._child[i]:
            coro = self._run_child(node, payload, attempt)
            if self.children is not None:
                item = None if attempt.item < 0 else attempt.item
                child = self.children.child_id(node.id, attempt.visit, item)
                if child is not None:
                    data = {**(data or {}), "child": child}
        else:
            coro = self._run_attempt(node, self._async[i], payload, attempt)
        # Written out (InFlight.add, Outbox.put): this is every attempt's start.
        inflight, outbox = self._inflight, self._outbox
        task = self._loop.create_task(coro, name=node.id)
        task.add_done_callback(inflight.unreported_cb, context=inflight.cb_context)
        attempt.task = task
        inflight.attempts[attempt] = None
        if outbox.record:
            outbox.seq += 1
            outbox.events.append(
                (outbox.seq, EventType.NODE_STARTED, i, attempt.visit, attempt.tries, time.time(),
                 data)
            )  # fmt: skip
        hedger = self._hedger
        if hedger is not None:
            hedger.watch(attempt)

    async def _run_direct(self, node: Node, payload: Any, attempt: Attempt) -> None:
        """An attempt of an async handler with no retry, timeout or executor (the short path)."""
        cps = self.checkpoints
        item = None if attempt.item < 0 else attempt.item
        # Written out: this is every plain node's path; a run without checkpoints skips the lookup.
        resumed = None
        if (cps.latest or cps.committed) and not attempt.hedge:
            resumed = cps.resumed(node.id, attempt.visit, item, attempt)
        set_current(
            (self.run_id, node.id, attempt.visit, attempt.tries, item, cps, resumed,
             self.streams, attempt, attempt.backup_of)
        )  # fmt: skip
        try:
            attempt.value = await node.handler(payload)
        except BaseException as exc:
            if self._ended(attempt, exc):
                raise
            return
        self._inflight.finished(attempt)

    async def _run_child(self, node: Node, payload: Any, attempt: Attempt) -> None:
        """An attempt of a node whose handler is a graph: its child run (R1); it holds no slot."""
        if self._admission.bounded and not attempt.released:
            attempt.released = True  # the child's own nodes take slots (no nested deadlock)
            self._admission.release_unit(attempt.index, attempt.visit, attempt.item)
        try:
            if self.children is None:
                raise RunError(f"node {node.id!r}: child runs need an engine to run them")
            attempt.value = await self.children.run(node, payload, attempt)
        except BaseException as exc:
            if self._ended(attempt, exc):
                raise
            return
        self._inflight.finished(attempt)

    async def _run_attempt(
        self, node: Node, is_async: bool, payload: Any, attempt: Attempt
    ) -> None:
        """An attempt with retries, a timeout or an executor (E11): run it, report its end."""
        try:
            attempt.value = await self._call(node, is_async, payload, attempt)
        except BaseException as exc:
            if self._ended(attempt, exc):
                raise
            return
        self._inflight.finished(attempt)

    def _where(self, node: Node, attempt: Attempt, tries: int, resumed: Checkpoint | None) -> Where:
        """What ``current_node()`` reads in the attempt: where it runs, its checkpoint sink, the
        checkpoint it resumes from, and the stream sink with its handle on the attempt."""
        item = None if attempt.item < 0 else attempt.item
        return (
            self.run_id, node.id, attempt.visit, tries, item, self.checkpoints, resumed,
            self.streams, attempt, attempt.backup_of,
        )  # fmt: skip

    def _resumed(self, node: Node, attempt: Attempt) -> Checkpoint | None:
        """The checkpoint a new attempt continues from (P2); a hedge starts afresh."""
        attempt.progress = 0.0
        if attempt.hedge:
            return None
        item = None if attempt.item < 0 else attempt.item
        return self.checkpoints.resumed(node.id, attempt.visit, item, attempt)

    def _ended(self, attempt: Attempt, exc: BaseException) -> bool:
        """The attempt raised ``exc``: record it; True if it must propagate (a cancellation).

        A handler's error is the attempt's outcome, read by the harvest; a
        cancellation (of a hedge loser, or a handler cancelling itself, E9) is
        recorded too, and re-raised so the task ends cancelled.
        """
        attempt.error = exc
        self._inflight.finished(attempt)
        return not isinstance(exc, Exception)

    async def _call(self, node: Node, is_async: bool, payload: Any, attempt: Attempt) -> Any:
        """Run the handler with retries and timeout (E11); every failed try is an event.

        Each retry is committed and published when it happens, with the
        attempt count and the due time of the next try, so a run resumed after
        a crash continues the policy where it stood.
        """
        retry = node.retry
        tries = attempt.tries
        items = attempt.items
        if items is None:
            due = self._state.nodes[attempt.index].retry_due
        else:
            due = items.retry_due.get(attempt.item)
        if due is not None and retry is not None and not attempt.hedge:
            # Resumed while backing off: wait out what is left of that backoff, at most the
            # policy's longest wait (a server's Retry-After may have made it longer than
            # the backoff alone; a skewed clock must not make it endless).
            await asyncio.sleep(min(max(0.0, due - time.time()), retry.max_backoff))
        resumed = self._resumed(node, attempt)
        while True:
            set_current(self._where(node, attempt, tries, resumed))
            try:
                if node.timeout is not None:
                    async with asyncio.timeout(node.timeout):
                        return await self._invoke(node, is_async, payload, attempt)
                if is_async:
                    return await node.handler(payload)
                return await self._invoke(node, is_async, payload, attempt)
            except Exception as exc:
                if retry is None or tries >= retry.attempts or not isinstance(exc, retry.retry_on):
                    raise
                delay = retry_wait(retry, tries, exc)
                self._retrying(attempt, tries, exc, delay)
                # The failed try is over now: what its thread (a ``def`` handler cut by its
                # timeout) still checkpoints or streams is dropped from here on.
                tries += 1
                attempt.tries = tries
                await asyncio.sleep(delay)
                # The next try starts over, or from the latest checkpoint (P2).
                if retry.resume:
                    resumed = self._resumed(node, attempt)
                else:
                    resumed, attempt.progress = None, 0.0
                # The next try is no longer due; its row says so with the next commit.
                if items is None:
                    self._state.nodes[attempt.index].retry_due = None
                    self._state.dirty[attempt.index] = None
                else:
                    items.retry_due.pop(attempt.item, None)
                    items.dirty[attempt.item] = None
                    self._state.dirty_items[items] = None

    def _retrying(self, attempt: Attempt, tries: int, exc: BaseException, delay: float) -> None:
        """Try ``tries`` failed and another follows after ``delay``: make it durable and live now."""
        self.streams.end(attempt, accepted=False, tries=tries)  # the next try streams afresh (S2)
        i = attempt.index
        ns = self._state.nodes[i]
        items, j = attempt.items, attempt.item
        if items is not None:
            if items.status[j] is ItemStatus.RUNNING:
                items.attempts[j] = tries + 1
                items.retry_due[j] = time.time() + delay
                items.dirty[j] = None
                self._state.dirty_items[items] = None
        elif ns.visits == attempt.visit and ns.status is NodeStatus.RUNNING:
            ns.attempts = tries + 1
            ns.retry_due = time.time() + delay
            self._state.dirty[i] = None
        extra = {} if items is None else {"item": j}
        self._outbox.emit(
            EventType.NODE_RETRYING,
            i,
            attempt.visit,
            tries,
            error=describe(exc),
            delay=delay,
            traceback=traceback_text(exc),
            **extra,
        )
        self._inflight.poke()  # an empty harvest commits and publishes it now (E11)

    async def _invoke(self, node: Node, is_async: bool, payload: Any, attempt: Attempt) -> Any:
        if self._executors is not None:
            executor = self._executors[attempt.index]
            if executor is not None:  # the node runs elsewhere; the loop keeps E11/T3 around it
                where = AttemptContext(
                    run_id=self.run_id,
                    node_id=node.id,
                    visit=attempt.visit,
                    attempt=attempt.tries,
                    item=None if attempt.item < 0 else attempt.item,
                    backup_of=attempt.backup_of,
                    hedge=attempt.hedge,
                )
                current_threads.set(self.threads)  # a LocalExecutor runs a def handler there
                return await executor.invoke(node, payload, where)
        if is_async:
            return await node.handler(payload)
        return await run_sync(self.threads, node.handler, payload)
