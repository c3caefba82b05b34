"""Child runs (R1-R6): a node whose handler is a :class:`~tailrace.Graph` runs it as a run of its own.

A child run's id is deterministic, ``{parent}/{node}/{visit}`` (plus
``/{item}`` for a map's item, the node id escaped: ``_lineage.child_run_id``),
so the attempt that runs it is idempotent: it
starts the child when no run has that id, and otherwise re-attaches to it
where it is (R2). Without ``queue=`` the child runs in this process, driven
by the same engine; with ``queue=`` it is submitted to that queue and any
worker drives it (R4).

While a child runs, the node's attempt holds no admission slot (its child's
nodes take their own). An attempt that only waits for its child to end says
so (:attr:`Attempt.waiting`); a run whose attempts all wait so suspends when
it is on a queue, holding no worker slot, and the child's final commit queues
it again (the store's ``wake_suspended``). An inline child of a run on a
queue is stored on that queue too (never claimed: it starts here), so it
suspends on its own children as its parent does, its parent then suspends on
it, and any worker of the queue continues it once its children end: a slot
never waits on queued work, however deep (R4). A run not on a queue waits
here, woken by the store's change feed, unless its children wait on people:
then it suspends too, and the engine that ends the child resumes it.

A cancellation of the attempt on purpose (the run cancelled or failing, a
first-k loser) cancels the child; one that only stops this process driving
the run (a suspension, a lost lease, a shutdown) leaves it running, to be
re-attached to.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from .._errors import LeaseHeld, RunFailed, RunNotFound
from .._lineage import child_run_id
from ..stores import (
    TERMINAL_STATUSES,
    Claim,
    QuestionRow,
    QuestionStatus,
    RunRecord,
    RunStatus,
    RunStore,
)
from ._lease import owner_is_dead
from ._outcome import RunResult

if TYPE_CHECKING:
    from .._codec import Codec
    from ..graph import Graph, Node
    from ._inflight import Attempt

logger = logging.getLogger("tailrace.children")

T = TypeVar("T")

#: Seconds between two looks at the children with no wake-up from the store.
FALLBACK = 1.0

#: How many runs known to be on a queue an engine remembers (see :class:`QueuedRuns`).
QUEUED_RUNS_KEPT = 4096

#: :attr:`Attempt.waiting` values: not waiting, waiting on a live child, on a
#: child that is itself suspended (waiting on people).
NOT_WAITING, ON_CHILD, ON_SUSPENDED_CHILD = 0, 1, 2


def checked_deadline(
    value: float | datetime.datetime | datetime.timedelta | None,
    clock: Callable[[], float] = time.time,
) -> float | None:
    """A run deadline as seconds since the epoch (R6): a number (seconds since the
    epoch), an aware ``datetime``, or a ``timedelta`` from now by ``clock`` (the
    store's: the workers judge the deadline by it)."""
    if value is None:
        return None
    if isinstance(value, datetime.timedelta):
        return clock() + value.total_seconds()
    if isinstance(value, datetime.datetime):
        if value.tzinfo is None:
            raise ValueError(f"deadline must be timezone-aware, got naive {value!r}")
        return value.timestamp()
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    raise ValueError(
        f"deadline must be seconds since the epoch, an aware datetime or a timedelta, got {value!r}"
    )


@dataclass(frozen=True, slots=True)
class ChildSubmit:
    """One child run to submit to a queue: many are submitted in one write."""

    graph: Graph
    input: Any
    run_id: str
    queue: str
    parent: str
    deadline: float | None
    priority: int


class ChildClaims(Protocol):
    """Free slots of the process driving a run, lent to the child runs it submits (R4).

    A :class:`~tailrace.Worker` serving the children's queue lends them: the
    children are claimed in the write that submits them and start here at
    once, with no wake-up and no claim round (as Temporal's eager
    activities); what does not fit goes to the fleet.
    """

    def reserve(self, queue: str) -> Claim | None:
        """A claim for the slots free here on ``queue``, held until :meth:`settle`; None: none."""

    def settle(self, claim: Claim, claimed: list[str]) -> None:
        """Drive the runs ``claim`` got (``claimed``), and give back the slots it left."""


@dataclass(frozen=True, slots=True)
class ChildRunner:
    """What the engine lends child runs: how to start, submit, resume, cancel and read one."""

    store: RunStore | None
    #: start(graph, input, run_id, parent, deadline, queue): run it here to its end or
    #: suspension, stored on ``queue`` (its parent's) when given (R4).
    start: Callable[[Graph, Any, str, str, float | None, str | None], Awaitable[RunResult]]
    #: submit(children): store them queued in one write; per child the error that kept it out.
    submit: Callable[[list[ChildSubmit]], Awaitable[list[Exception | None]]]
    #: resume(run_id, graph): drive a child that exists here (LeaseHeld if held).
    resume: Callable[[str, Graph], Awaitable[RunResult]]
    #: cancel(run_id): cancel a child (and its own children).
    cancel: Callable[[str], Awaitable[str]]
    #: result(record, graph): a finished child's RunResult; RunFailed if it failed.
    result: Callable[[RunRecord, Graph], Awaitable[RunResult]]
    #: outputs(run_ids): the decoded outputs the completed ones among them stored, by id.
    outputs: Callable[[list[str]], Awaitable[dict[str, Any]]]


class Children:
    """The child runs of one run while it is driven: started, re-attached, awaited (R1-R5).

    ``queue`` is the queue the run is on, if any: it then suspends while it
    only waits on children, and its inline children are stored on it too
    (R4); ``deadline`` is the run's, which its children inherit.
    """

    def __init__(
        self,
        runner: ChildRunner,
        run_id: str,
        *,
        queue: str | None,
        deadline: float | None,
        poke: Callable[[], None],
    ) -> None:
        self.runner = runner
        self.run_id = run_id
        self.queue = queue
        self.queued = queue is not None
        self.deadline = deadline
        self._poke = poke
        #: Set while the run suspends: its attempts stop, their children run on.
        self.suspending = False
        #: Set while the run ends cancelled or failed: its attempts cancel their children.
        self.ending = False
        #: The children known from the store, by id: one read when the first attempt starts.
        self._known: dict[str, RunRecord] | None = None
        self._known_read: asyncio.Future[list[RunRecord]] | None = None
        #: Children awaited now: id -> (future of its final record, the waiting attempt).
        self._awaited: dict[str, tuple[asyncio.Future[RunRecord], Attempt]] = {}
        self._watcher: asyncio.Task[None] | None = None
        #: Submits gathered this turn of the event loop, sent in one write; by child id,
        #: each one's future until it is stored.
        self._submits: list[tuple[ChildSubmit, asyncio.Future[None]]] = []
        self._sending: dict[str, asyncio.Future[None]] = {}
        self._senders: set[asyncio.Task[None]] = set()
        #: Completed children whose outputs are read this turn of the loop, in one read.
        self._reading: tuple[list[str], asyncio.Future[dict[str, Any]]] | None = None

    # -- one attempt ------------------------------------------------------------------

    def child_id(self, node_id: str, visit: int, item: int | None) -> str | None:
        """The id of the child run of ``node_id``'s visit (and item) in this run (R1); None when
        it would be no run id (too long): the attempt fails saying so (:meth:`run`)."""
        try:
            return child_run_id(self.run_id, node_id, visit, item)
        except ValueError:
            return None

    async def run(self, node: Node, payload: Any, attempt: Attempt) -> Any:
        """The attempt of child node ``node`` on ``payload``: its child's output (R1, R3)."""
        item = None if attempt.item < 0 else attempt.item
        child_id = child_run_id(self.run_id, node.id, attempt.visit, item)
        graph: Graph = node.handler  # type: ignore[assignment]
        try:
            if node.queue is None:
                return await self._inline(graph, payload, child_id, attempt)
            return await self._queued(graph, payload, child_id, node.queue, attempt)
        except asyncio.CancelledError:
            if attempt.abandoned or self.ending:  # on purpose: the child is not needed (R3)
                status = await _finish(self._cancel(child_id))
                if status == RunStatus.COMPLETED and not self.ending:
                    # It completed before its cancel arrived, and stays so: its late
                    # item or input gets its output (M5, E5).
                    return await self._completed(child_id, graph)
            raise

    async def _inline(self, graph: Graph, payload: Any, child_id: str, attempt: Attempt) -> Any:
        record = await self._record(child_id)
        result: RunResult | None
        if record is None:
            result = await self.runner.start(
                graph, payload, child_id, self.run_id, self.deadline, self.queue
            )
        elif record.status in TERMINAL_STATUSES:
            return await self._ended(record, graph)
        elif record.queue_name is not None:
            # It suspended on its own children: the workers of its queue continue it (R4).
            return await self._wait(child_id, graph, attempt)
        else:
            result = await self._attach(child_id, graph)
        if result is None:
            return await self._wait(child_id, graph, attempt)
        if result.status is RunStatus.SUSPENDED:
            return await self._wait(child_id, graph, attempt)  # it waits on people (R5)
        return await self._ended(result, graph)

    async def _queued(
        self, graph: Graph, payload: Any, child_id: str, queue: str, attempt: Attempt
    ) -> Any:
        record = await self._record(child_id)
        if record is None:
            child = ChildSubmit(
                graph, payload, child_id, queue, self.run_id, self.deadline, _priority(attempt)
            )
            await self._submit(child)
        elif record.status in TERMINAL_STATUSES:
            return await self._ended(record, graph)
        return await self._wait(child_id, graph, attempt)

    async def _submit(self, child: ChildSubmit) -> None:
        """Submit ``child`` with the others submitted in this turn of the loop, in one write."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        if not self._submits:
            loop.call_soon(self._send_submits)
        self._submits.append((child, future))
        self._sending[child.run_id] = future
        await asyncio.shield(future)  # a cancelled attempt's child is still stored (or not) whole

    def _send_submits(self) -> None:
        batch, self._submits = self._submits, []
        task = asyncio.get_running_loop().create_task(self._send(batch))
        self._senders.add(task)
        task.add_done_callback(self._senders.discard)

    async def _send(self, batch: list[tuple[ChildSubmit, asyncio.Future[None]]]) -> None:
        try:
            errors = await self.runner.submit([child for child, _ in batch])
        except Exception as exc:  # the write failed: every attempt of the batch fails with it
            errors = [exc] * len(batch)
        for (child, future), error in zip(batch, errors, strict=True):
            self._sending.pop(child.run_id, None)
            if future.done():
                continue
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)

    async def _attach(self, child_id: str, graph: Graph) -> RunResult | None:
        """Drive the existing child here (R2); None when another live engine holds it."""
        try:
            return await self.runner.resume(child_id, graph)
        except LeaseHeld:
            return None

    async def _ended(self, ended: RunRecord | RunResult, graph: Graph) -> Any:
        """The finished child's output; its failure or cancellation fails the node (R3)."""
        if isinstance(ended, RunRecord):
            if ended.status is RunStatus.CANCELLED:
                raise _cancelled(ended.run_id, ended.error)
            if ended.status is RunStatus.COMPLETED:
                return await self._output(ended, graph)
            return (await self.runner.result(ended, graph)).output  # RunFailed: it failed
        if ended.status is RunStatus.CANCELLED:
            raise _cancelled(ended.run_id, None)
        return ended.output

    async def _output(self, record: RunRecord, graph: Graph) -> Any:
        """A completed child's output: as its final commit stored it, read with the others
        read in this turn of the event loop in one query; else rebuilt off its rows."""
        loop = asyncio.get_running_loop()
        if self._reading is None:
            self._reading = ([], loop.create_future())
            loop.call_soon(self._read_outputs)
        ids, future = self._reading
        ids.append(record.run_id)
        found = await asyncio.shield(future)
        if record.run_id in found:
            return found[record.run_id]
        return (await self.runner.result(record, graph)).output

    def _read_outputs(self) -> None:
        reading, self._reading = self._reading, None
        assert reading is not None
        task = asyncio.get_running_loop().create_task(self._read(*reading))
        self._senders.add(task)
        task.add_done_callback(self._senders.discard)

    async def _read(self, ids: list[str], future: asyncio.Future[dict[str, Any]]) -> None:
        # On an error or a cancellation each child is read off its rows instead (an
        # error is met there); whoever waits on ``future`` is never left waiting.
        found: dict[str, Any] = {}
        try:
            with contextlib.suppress(Exception):
                found = await self.runner.outputs(ids)
        finally:
            if not future.done():
                future.set_result(found)

    async def _wait(self, child_id: str, graph: Graph, attempt: Attempt) -> Any:
        """Wait for the child to end, holding nothing but this task (R4)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[RunRecord] = loop.create_future()
        self._awaited[child_id] = (future, attempt)
        attempt.waiting = ON_CHILD
        self._poke()  # the run may now wait on children only: it may suspend
        if self._watcher is None or self._watcher.done():
            self._watcher = loop.create_task(self._watch(), name=f"children of {self.run_id}")
        try:
            record = await future
        finally:
            attempt.waiting = NOT_WAITING
            if self._awaited.get(child_id, (None, None))[0] is future:
                del self._awaited[child_id]
        if record.status is RunStatus.RUNNING:  # its driver is gone: take it over here
            result = await self._attach(child_id, graph)
            if result is None or result.status is RunStatus.SUSPENDED:
                return await self._wait(child_id, graph, attempt)
            return await self._ended(result, graph)
        return await self._ended(record, graph)

    async def _watch(self) -> None:
        """Resolve the awaited children as they end: one query of the run's children per wake-up."""
        store = self.runner.store
        assert store is not None
        try:
            async with store.changes() as feed:
                while self._awaited:
                    now = time.time()
                    rows = {r.run_id: r for r in await store.list_runs(parent=self.run_id)}
                    for child_id, (future, attempt) in list(self._awaited.items()):
                        record = rows.get(child_id)
                        if record is None or future.done():
                            continue
                        if record.status in TERMINAL_STATUSES or _orphaned(record, now):
                            future.set_result(record)
                        elif record.status is RunStatus.SUSPENDED and record.lease_owner is None:
                            if attempt.waiting != ON_SUSPENDED_CHILD:
                                attempt.waiting = ON_SUSPENDED_CHILD
                                self._poke()
                        elif attempt.waiting == ON_SUSPENDED_CHILD:
                            attempt.waiting = ON_CHILD  # it was resumed
                    await feed.wait(FALLBACK)
        except Exception as exc:  # a store that fails: the attempts waiting fail with it
            for future, _ in self._awaited.values():
                if not future.done():
                    future.set_exception(exc)

    async def _record(self, child_id: str) -> RunRecord | None:
        """The stored child ``child_id``, or None; the run's children are read once, and every
        attempt waiting for that read goes on in the same turn of the loop (so their
        submits share one write)."""
        store = self.runner.store
        if store is None:
            return None
        if self._known is None:
            if self._known_read is None:
                self._known_read = asyncio.ensure_future(store.list_runs(parent=self.run_id))
            rows = await asyncio.shield(self._known_read)
            if self._known is None:
                self._known = {r.run_id: r for r in rows}
        return self._known.get(child_id)  # as of this drive's start: a later change wakes _wait

    async def _completed(self, child_id: str, graph: Graph) -> Any:
        """The output of child ``child_id``, which completed."""
        store = self.runner.store
        assert store is not None
        return await self._output(await store.get_run(child_id), graph)

    async def _cancel(self, child_id: str) -> str | None:
        """Cancel child ``child_id``; its status then, or None when unknown."""
        if self.runner.store is None:
            return None  # an in-memory child ends with its attempt
        sending = self._sending.get(child_id)
        if sending is not None:  # stored or refused first, so the cancel finds it
            with contextlib.suppress(Exception):
                await sending
        try:
            return await self.runner.cancel(child_id)
        except RunNotFound:
            return None  # never started
        except Exception as exc:  # the store failed: the deadline sweep or a later cancel retries
            logger.warning("child run %s: cancel failed: %s", child_id, exc)
            return None

    # -- the run ----------------------------------------------------------------------

    def waiting_only(self, in_flight: dict[Attempt, None]) -> bool:
        """Whether every attempt in flight waits on a child, and the run may suspend for it (R4)."""
        if not in_flight:
            return False
        suspended_only = True
        for attempt in in_flight:
            if attempt.waiting == NOT_WAITING or attempt.abandoned:
                return False  # it runs, or it is cancelling its child: the run is busy
            if attempt.waiting != ON_SUSPENDED_CHILD:
                suspended_only = False
        return self.queued or suspended_only

    def awaited(self) -> tuple[str, ...]:
        """The ids of the children awaited now, sorted."""
        return tuple(sorted(self._awaited))

    async def close(self) -> None:
        """Stop watching (the run ends or suspends); submits and reads under way are finished."""
        if self._senders:
            await asyncio.gather(*self._senders, return_exceptions=True)
        reading = self._known_read
        if reading is not None and not reading.done():
            reading.cancel()
            with contextlib.suppress(BaseException):
                await reading
        watcher, self._watcher = self._watcher, None
        if watcher is not None and not watcher.done():
            watcher.cancel()
            with contextlib.suppress(BaseException):
                await watcher


async def _finish(work: Awaitable[T]) -> T:
    """Await ``work`` to its end even if the awaiting task is cancelled again meanwhile
    (a cancelled parent returns only once its child's cancel is recorded)."""
    task = asyncio.ensure_future(work)
    while not task.done():
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(task)
    return task.result()


def _priority(attempt: Attempt) -> int:
    """A queued child's priority: the items a first-k map needs go before its extras.

    Of a map with ``required=k`` the first k items get priority 1 and the
    rest 0, so a fleet runs every parent's needed children before anyone's
    speculative ones (which then use idle workers only, like hedges, E3).
    """
    items = attempt.items
    if items is None or items.k is None:
        return 1
    return 1 if attempt.item < items.k else 0


def _orphaned(record: RunRecord, now: float) -> bool:
    """A running inline child whose driver is gone (its lease expired or its process died)."""
    if record.status is not RunStatus.RUNNING or record.queue_name is not None:
        return False
    expired = record.lease_expires is None or record.lease_expires < now
    return expired or owner_is_dead(record.lease_owner)


def _cancelled(child_id: str, error: str | None) -> RunFailed:
    reason = f": {error}" if error else ""
    return RunFailed(
        f"child run {child_id!r} was cancelled{reason}",
        run_id=child_id, error=error or "cancelled", result=None,
    )  # fmt: skip


#: The statuses of a child run that may have a question open.
_MAY_ASK = frozenset({RunStatus.RUNNING, RunStatus.SUSPENDED})


async def tree_questions(
    store: RunStore, run_id: str, status: QuestionStatus | None = QuestionStatus.OPEN
) -> list[QuestionRow]:
    """The questions (open ones by default) of ``run_id`` and of its child runs, at any depth
    (R5). For open ones only live children that started are looked at (running or
    suspended: a child asks while other nodes of it still run); a queued child has asked
    nothing yet, and an ended one waits on nothing."""
    questions = await store.list_questions(run_id=run_id, status=status)
    todo = [run_id]
    while todo:
        parent = todo.pop()
        for child in await store.list_runs(parent=parent):
            if status is QuestionStatus.OPEN and child.status not in _MAY_ASK:
                continue
            questions += await store.list_questions(run_id=child.run_id, status=status)
            todo.append(child.run_id)
    return questions


async def cancel_children(
    store: RunStore, run_id: str, cancel: Callable[[str], Awaitable[Any]]
) -> None:
    """Cancel every live child run of ``run_id`` with ``cancel`` (which cascades further) (R3)."""
    for child in await store.list_runs(parent=run_id):
        if child.status not in TERMINAL_STATUSES:
            try:
                await cancel(child.run_id)
            except RunNotFound:
                continue


# -- what an engine does around its runs' child runs -------------------------------------------


class QueuedRuns:
    """The runs an engine knows to be on a queue (a run's queue never changes), most recent
    last: a child's end then wakes nothing here, its commit queued the parent (R4)."""

    __slots__ = ("_known",)

    def __init__(self) -> None:
        self._known: dict[str, None] = {}

    def __contains__(self, run_id: object) -> bool:
        return run_id in self._known

    def note(self, record: RunRecord) -> bool:
        """Remember that ``record``'s run is on a queue, if it is (the last 4096 such runs)."""
        if record.queue_name is None:
            return False
        known = self._known
        known.pop(record.run_id, None)
        known[record.run_id] = None
        if len(known) > QUEUED_RUNS_KEPT:
            del known[next(iter(known))]
        return True

    async def on_queue(self, store: RunStore, run_id: str) -> bool:
        """Whether run ``run_id`` is on a queue (read once per run, then remembered)."""
        return run_id in self._known or self.note(await store.get_run(run_id))


async def awaited_ended(store: RunStore, result: RunResult) -> bool:
    """Whether a child run that suspended ``result`` waits for has ended (R4)."""
    if not result.waiting_on:
        return False
    awaited = set(result.waiting_on)
    children = await store.list_runs(parent=result.run_id)
    return any(c.run_id in awaited and c.status in TERMINAL_STATUSES for c in children)


async def wakes_here(
    store: RunStore, run_id: str, queued: QueuedRuns, driving: Callable[[str], bool]
) -> bool:
    """Whether run ``run_id``, one of whose children ended, is resumed by the engine that
    ended it: suspended, and neither driven there (``driving``) nor on a queue (the child's
    final commit queued it again, or counted down what it waits for)."""
    if run_id in queued:
        return False
    record = await store.get_run(run_id)
    queued.note(record)
    return (
        record.status is RunStatus.SUSPENDED and not driving(run_id) and record.queue_name is None
    )


async def with_questions(store: RunStore | None, result: RunResult) -> RunResult:
    """``result`` with the open questions of a suspended run and of its child runs (R5)."""
    if result.status is not RunStatus.SUSPENDED or store is None:
        return result
    rows = await tree_questions(store, result.run_id)
    return dataclasses.replace(result, questions=tuple(rows))


async def decoded_outputs(store: RunStore, codec: Codec, run_ids: list[str]) -> dict[str, Any]:
    """The outputs the completed runs among ``run_ids`` stored, decoded, by run id."""
    found: dict[str, Any] = {}
    for run_id, text in (await store.outputs(run_ids)).items():
        try:
            found[run_id] = codec.decode(text)
        except (TypeError, ValueError) as exc:  # read off its node rows instead
            logger.warning("child run %s: its stored output does not decode: %s", run_id, exc)
    return found
