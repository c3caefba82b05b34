"""One run: dispatch, harvest, route, first-k, commit per harvest (E1-E11, D1-D3).

The loop wakes on the first completion, harvests every attempt that finished
by then, processes them in definition order (E2), lets :mod:`._state` decide
routing and first-k, dispatches what became ready (E1), and commits the whole
harvest as one delta (D1). Completions are collected by done-callbacks rather
than ``asyncio.wait`` so that a wake-up costs O(batch), not O(in flight).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import time
import uuid
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from .._codec import DEFAULT_CODEC, Codec
from .._context import Checkpoint, Where, set_current
from .._errors import EncodeError, MapError, RunError, StallError
from .._events import Event, EventType
from ..executors._base import AttemptContext
from ..graph import Node, NodeKind
from ..stores import ParkedRow, RunStatus
from ..tail import TailHooks
from ._admission import AdmissionPolicy, SlotQueue, Ticket
from ._checkpoints import Checkpoints, parked_checkpoint
from ._children import Children
from ._hedger import Hedger
from ._inflight import BULK, Attempt, describe, harvest_order, paused_gc, traceback_text
from ._outcome import NodeReport, RunResult
from ._state import ItemStatus, LateInput, MapItems, NodeStatus, RunState, map_plan
from ._streams import MAX_STREAM_CHUNKS, StreamHub, Streams

if TYPE_CHECKING:
    from ..executors import Executor
    from ._writer import RunWriter


#: A buffered event: (seq, type, node index or None, visit, attempt, ts, data or None).
EventTuple = tuple[
    int, EventType, int | None, int | None, int | None, float, Mapping[str, Any] | None
]

#: The data of a hedge's NODE_STARTED (shared: every Event gets its own copy).
_HEDGE_DATA: Mapping[str, Any] = MappingProxyType({"hedge": True})

#: Inputs a ``late="cancel"`` merge cancels once it fired without them (E5, Q7).
_CANCELLABLE = frozenset({NodeStatus.RUNNING, NodeStatus.QUEUED, NodeStatus.WAITING})

#: What admission queues: (node index, item index), the item -1 for a node's own attempt.
Unit = tuple[int, int]


class RunLoop:
    """Drives one run to completion, suspension or failure.

    It holds its collaborators as fields: the admission tickets and the
    in-flight attempts, the buffered events, the :class:`Hedger` (stragglers
    and hedges) and the writer that makes harvests durable.
    """

    def __init__(
        self,
        *,
        run_id: str,
        state: RunState,
        publish: Callable[[Event], None] | None,
        writer: RunWriter | None,
        engine_slots: SlotQueue | None,
        run_capacity: int | None,
        policy: AdmissionPolicy,
        tail: TailHooks | None = None,
        event_seq: int = 0,
        turn: int = 0,
        durability: str = "async",
        executors: list[Executor | None] | None = None,
        codec: Codec | None = None,
        stream_hub: StreamHub | None = None,
        max_stream_chunks: int = MAX_STREAM_CHUNKS,
        deadline: float | None = None,
        parent_run_id: str | None = None,
    ) -> None:
        self.run_id = run_id
        #: When the run is cancelled if it has not finished (R6), and the run it is a child of.
        self.deadline = deadline
        self.parent_run_id = parent_run_id
        self._deadline_timer: asyncio.TimerHandle | None = None
        #: Why the run is cancelled: "deadline" when its deadline passed (R6).
        self.cancel_reason: str | None = None
        #: The child runs of its nodes whose handler is a graph (R1-R5); set by the engine.
        self.children: Children | None = None
        #: Per node: the executor its attempts go to, None inline (executors/).
        self._executors = executors
        #: "sync": successors start only once their upstream's completion is durable.
        self._sync = durability == "sync" and writer is not None
        self.state = state
        self.topo = state.topo
        self._publish = publish
        self._writer = writer
        if writer is not None:
            writer.on_failure = self.poke  # a failed write stops the run at once
            writer.durability = durability
        self._record = publish is not None or writer is not None
        #: Buffered events as plain tuples (see :meth:`emit`): an :class:`Event`
        #: is built only for listeners, a store row only for the store.
        self._events: list[EventTuple] = []
        self._unpublished: list[EventTuple] = []
        self.event_seq = event_seq
        #: Advances each time the run suspends on its gates (Q2).
        self.turn = turn
        self._engine_slots = engine_slots
        self._run_slots = SlotQueue(run_capacity) if run_capacity is not None else None
        self._policy = policy
        self._tail = tail
        self._tickets: dict[Unit, Ticket] = {}
        #: Attempts running now, in start order (a dict: ordered, O(1) removal).
        self._in_flight: dict[Attempt, None] = {}
        self._done: list[Attempt] = []
        self._wake: asyncio.Future[None] | None = None
        #: Set by :meth:`poke`; the loop harvests once more before it waits again.
        self._poked = False
        self.loop = asyncio.get_running_loop()
        self._async = self.topo.is_async
        if executors is not None:  # nodes sent to an executor take the _invoke path
            self._async = tuple(
                a and e is None for a, e in zip(self._async, executors, strict=True)
            )
        #: Per node: an async handler with no retry, timeout or executor, which
        #: its attempt awaits directly (the common case, kept short).
        self._direct = tuple(
            a and n.retry is None and n.timeout is None
            for a, n in zip(self._async, self.topo.nodes, strict=True)
        )
        #: Per node: whether its handler is a graph run as a child run (R1).
        self._child = tuple(n.child for n in self.topo.nodes)
        self._durations = [0.0] * len(self.topo.ids)
        self._late_seen = len(state.late)
        #: Aggregates with ``late="cancel"`` that fired in the current harvest.
        self._fired_cancel: list[int] = []
        self.started_at = time.monotonic()
        #: Stragglers and hedges of this run, when the engine has tail hooks (T3).
        self.hedger = Hedger(self, tail) if tail is not None else None
        #: The attempt whose failure is failing the run (E9), until its slots are freed.
        self._failing: Attempt | None = None
        # One bound method and one context for every task's done-callback: not a
        # method object and a context copy per attempt.
        self._unreported_cb = self._unreported
        self._cb_context = contextvars.Context()
        self._gate = tuple(n.kind is NodeKind.GATE for n in self.topo.nodes)
        #: Map nodes run their handler per item (M1); ``_has_maps`` keeps the rest fast.
        self._map = tuple(n.kind is NodeKind.MAP for n in self.topo.nodes)
        self._has_maps = any(self._map)
        #: Whether finished attempts free admission slots (E3).
        self._bounded = engine_slots is not None or run_capacity is not None
        #: Set by :meth:`request_cancel`: the run ends ``cancelled`` at its next wake-up.
        self.cancel_requested = False
        #: Maps waiting to claim parked items before their items start (P4).
        self._claims: list[int] = []
        #: What attempts save with ``current_node().checkpoint`` and resume from (P1, P2).
        self.checkpoints = Checkpoints(
            run_id,
            writer.codec if writer is not None else codec or DEFAULT_CODEC,
            state.checkpoints,
            self.poke,
            self.loop,
        )
        #: The run's stream chunks and their terminal marks (S1-S4).
        self.streams = Streams(
            run_id,
            self.topo.ids,
            writer.codec if writer is not None else codec or DEFAULT_CODEC,
            stream_hub,
            durable=writer is not None,
            poke=self.poke,
            max_chunks=max_stream_chunks,
        )

    # -- events ---------------------------------------------------------------

    def emit(
        self,
        type: EventType,
        node: int | None = None,
        visit: int | None = None,
        attempt: int | None = None,
        **data: Any,
    ) -> None:
        """Buffer an event; it is committed with the harvest and then published."""
        if not self._record:
            return
        self.event_seq += 1
        self._events.append((self.event_seq, type, node, visit, attempt, time.time(), data))

    def event(self, item: EventTuple) -> Event:
        """The :class:`Event` of a buffered event tuple."""
        seq, type, node, visit, attempt, ts, data = item
        return Event(
            run_id=self.run_id,
            seq=seq,
            type=type,
            ts=ts,
            node_id=None if node is None else self.topo.ids[node],
            visit=visit,
            attempt=attempt,
            data=data if isinstance(data, dict) else dict(data or {}),
        )

    # -- the loop -------------------------------------------------------------

    async def drive(self) -> RunResult:
        """Run until nothing is ready or in flight; return the result or raise (E9, E10)."""
        try:
            if self.deadline is not None:
                self._arm_deadline()
            if self.cancel_requested:  # asked before anything was dispatched
                return await self._cancel()
            self._dispatch_ready()
            if self._claims:
                await self.take_parked()
            await self._gather()
            while True:
                while self._in_flight or self._done or self._queued():
                    if not self._done and not self._poked:
                        children = self.children
                        if (
                            children is not None
                            and not self._queued()
                            and children.waiting_only(self._in_flight)
                        ):
                            return await self._suspend_on_children(children)
                        self._wake = self.loop.create_future()
                        await self._wake
                        self._wake = None
                    self._poked = False
                    if self._writer is not None:
                        # A write failed: dispatch nothing more; the handler below
                        # cancels and awaits what runs, and re-raises (E9, D1).
                        self._writer.raise_failure()
                    if self.cancel_requested:
                        return await self._cancel()
                    batch, self._done = self._done, []
                    failure = self._harvest(batch)
                    if failure is not None:
                        await self._fail(*failure)
                    if self._sync and (self.state.ready or self.checkpoints.pending):
                        # Durability "sync": what this harvest completed is durable
                        # before anything that consumes it starts; completions that
                        # arrive meanwhile join the next write (group commit).
                        await self.checkpoint()
                    self._dispatch_ready()
                    if self._claims:
                        await self.take_parked()
                    if self.hedger is not None and self.hedger.backup_candidates:
                        self.hedger.back_up()  # a slot may have been freed
                    if self._stage(defer=True):  # a plain call: no coroutine per wake-up
                        await self._durable()  # the store fell behind: wait for it
                # Answers that came in while other branches ran: take them now
                # rather than suspend (Q1).
                if not await self.absorb_answers():
                    return await self._finish()
                self._dispatch_ready()
                if self._claims:
                    await self.take_parked()
                await self._gather()
        except BaseException:
            self._discard_streams((*self._in_flight, *self._done))
            self._stage_on_the_way_out()
            await self._cancel_in_flight(record=False)
            raise
        finally:
            if self._deadline_timer is not None:
                self._deadline_timer.cancel()
            if self.children is not None:
                await self.children.close()

    def _arm_deadline(self) -> None:
        """Cancel the run at its deadline (R6); at once when it passed already."""
        assert self.deadline is not None
        left = self.deadline - time.time()
        if left <= 0:
            self._deadline_passed()
        else:
            self._deadline_timer = self.loop.call_later(left, self._deadline_passed)

    def _deadline_passed(self) -> None:
        self.cancel_reason = "deadline"
        self.request_cancel()

    def _completions_needed(self) -> int:
        """How many of the children awaited must end before the run can move on (R4).

        A map before its decision needs k minus its successes (of the items
        still waiting), after it every item still running. A task node's child
        lets the run move on when its result starts a node: a task successor
        at once, an aggregate only once it has its quorum, so children that
        all feed one join wake their parent once, at the last of them, not at
        each. A child whose result starts nothing moves the run on only when
        every child awaited has ended. The run wakes at the least of these, or
        at once when a child fails or is cancelled. Each figure is a bound from
        below (an input that comes late, E7, only makes the wake early), so a
        parent never sleeps past the end that lets it go on.
        """
        waiting: dict[int, list[Attempt]] = {}
        for attempt in self._in_flight:
            waiting.setdefault(attempt.index, []).append(attempt)
        total = sum(len(attempts) for attempts in waiting.values())
        needed = [total]
        for i, attempts in waiting.items():
            items = attempts[0].items
            if items is None:
                needed.append(self._task_child_unlocks(i, total))
            elif items.winners is not None:
                needed.append(len(attempts))
            else:
                k = len(items) if items.k is None else items.k
                needed.append(min(max(k - items.succeeded, 1), len(attempts)))
        return max(min(needed), 1)

    def _task_child_unlocks(self, i: int, total: int) -> int:
        """The least number of children's ends after which node ``i``'s result starts a node."""
        topo, nodes = self.topo, self.state.nodes
        if nodes[i].pending is not None or topo.nodes[i].kind is not NodeKind.TASK:
            return 1  # its end starts its next visit (E7), or a route decides
        least = total
        for edge in topo.out_edges[i]:
            t = edge.target
            if topo.nodes[t].kind is not NodeKind.AGGREGATE:
                return 1
            inputs = nodes[t].inputs
            least = min(least, topo.required[t] - (len(inputs) if inputs else 0))
        return max(least, 1)

    async def _suspend_on_children(self, children: Children) -> RunResult:
        """Every attempt in flight only waits on a child run: suspend, holding nothing (R4).

        The attempts stop without cancelling their children and stay
        ``running`` in the stored state, so the run's next driver starts them
        again and they re-attach to their children where they are (R2).
        """
        awaited = children.awaited()
        if self._writer is not None:
            self._writer.wake_after = self._completions_needed()
            self._writer.waiting_on = awaited
        children.suspending = True
        try:
            await self._cancel_in_flight(record=False)
        finally:
            children.suspending = False
        questions = self.state.waiting_questions()
        if questions:
            self.turn += 1
        self.emit(
            EventType.RUN_SUSPENDED, reason="children", children=list(awaited),
            questions=sorted(questions), turn=self.turn,
        )  # fmt: skip
        await self._commit(RunStatus.SUSPENDED)
        return dataclasses.replace(self.result(RunStatus.SUSPENDED), waiting_on=awaited)

    def _discard_streams(self, attempts: tuple[Attempt, ...] | list[Attempt]) -> None:
        """Mark the open streams of ``attempts`` discarded: they end with no committed result (S2)."""
        streams = self.streams
        if streams.open:
            for attempt in attempts:
                streams.end(attempt, accepted=False)

    def _stage_on_the_way_out(self) -> None:
        """Stage what the window gathered, so the writer's way out writes it.

        A run stopped by a cancellation (a worker letting go, ``wait_for``)
        keeps every completion it harvested, as when each harvest was staged
        at once. Nothing is staged after a failed write or a lost lease, and
        a value that fails to encode now is left to the resume (the run's
        own exception is what propagates).
        """
        writer = self._writer
        if writer is None or not writer.writable():
            return
        with contextlib.suppress(Exception):
            self._stage()

    def _queued(self) -> bool:
        return bool(self._tickets) or bool(self.state.ready)

    async def checkpoint(self) -> None:
        """Commit what is pending now and wait until it is durable."""
        await self._commit()
        if self._writer is not None:
            await self._writer.flush()

    async def _gather(self) -> None:
        """Stage a running harvest with the window's others (see :meth:`_stage`)."""
        if self._stage(defer=True):
            await self._durable()

    async def _commit(
        self, status: RunStatus = RunStatus.RUNNING, error: str | None = None
    ) -> None:
        if self._stage(status, error):
            await self._durable()

    def _stage(
        self,
        status: RunStatus = RunStatus.RUNNING,
        error: str | None = None,
        *,
        defer: bool = False,
    ) -> bool:
        """Hand the harvests so far to the store (D1) and publish their events.

        True when the write must be durable first (a final status, or the store
        falling behind): the events then wait for :meth:`_durable`. ``defer``:
        a running harvest may wait for the writer's group window, and is
        staged with the ones that follow when it ends (its events wait too).
        """
        writer = self._writer
        if writer is None:
            if not self._events:
                return False
        elif defer and writer.defer(self.poke, hurry=self.streams.waiting):
            return False
        events, self._events = self._events, []
        if writer is not None and writer.stage(self, events, status, error):
            self._unpublished.extend(events)
            return True
        self._publish_all(events)
        return False

    async def _durable(self) -> None:
        """Wait until every staged write is durable, then publish what waited for it."""
        assert self._writer is not None
        await self._writer.flush()
        events, self._unpublished = self._unpublished, []
        self._publish_all(events)

    def _publish_all(self, events: list[EventTuple]) -> None:
        publish = self._publish
        if publish is not None:
            for item in events:
                publish(self.event(item))

    # -- dispatch -------------------------------------------------------------

    def _dispatch_ready(self) -> None:
        ready = self.state.ready
        if not ready:
            return
        if len(ready) < BULK:
            self._dispatch(ready)
            return
        with paused_gc():
            self._dispatch(ready)

    def _dispatch(self, ready: list[int]) -> None:
        if len(ready) > 1:
            ready.sort()  # E2: simultaneously ready nodes go in definition order
        self.state.ready = []
        units: list[Unit] | None = None
        if self._has_maps:  # a map's items are units of their own (M2), in item order
            units = []
            for i in ready:
                if self._map[i]:
                    units.extend([(i, j) for j in self._expand(i)])
                else:
                    units.append((i, -1))
        if units is None and self._engine_slots is None and self._run_slots is None:
            for i in ready:
                self.start_attempt(i)
            if self.hedger is not None and len(ready) > 1:
                self.hedger.launched([(i, -1) for i in ready])
            return
        self._dispatch_units(units if units is not None else [(i, -1) for i in ready])

    def _dispatch_units(self, units: list[Unit]) -> None:
        """Start or admit ``units`` (nodes and map items), in order (E2, E3, M2)."""
        if self._engine_slots is None and self._run_slots is None:
            for i, j in units:
                self._start_unit(i, j)
        else:
            keyed = sorted((self._admission_key(u), n, u) for n, u in enumerate(units))
            for key, _, unit in keyed:  # the policy orders a ready batch too (E3, T2)
                self._admit(unit, key)
        if self.hedger is not None and len(units) > 1:
            self.hedger.launched(units)

    def _start_unit(self, i: int, j: int) -> None:
        if j < 0:
            self.start_attempt(i)
        else:
            self.start_item(i, j)

    def payload_of(self, i: int, j: int, items: MapItems | None = None) -> Any:
        """What unit ``(i, j)`` runs on: item ``j`` of the map's visit, or the node's payload."""
        if j < 0:
            return self.state.nodes[i].payload
        items = items or self.state.nodes[i].items
        assert items is not None
        return items.values[j]

    def _admission_key(self, unit: Unit) -> tuple[float, ...]:
        i, j = unit
        payload = self.payload_of(i, j)
        node = self.topo.nodes[i]
        estimate = None
        if self._tail is not None:
            estimate = self._tail.estimate(i, payload, node)
            if estimate is None and j >= 0 and node.cost is not None:
                # Before any observation, a map's items keep the order of their cost
                # (any fit b + m * cost with m > 0 ranks them alike, T2).
                estimate = self._tail.cost_of(node, payload)
        return self._policy.key(node, payload, estimate)

    def _admit(self, unit: Unit, key: tuple[float, ...]) -> None:
        engine_slots = self._engine_slots
        i, j = unit

        def granted_by_engine() -> None:
            self._tickets.pop(unit, None)
            self._start_unit(i, j)
            self.poke()  # granted from another run's harvest: publish NODE_STARTED now (E3)

        def granted_by_run() -> None:
            if engine_slots is None:
                granted_by_engine()
                return
            ticket = Ticket(granted_by_engine)
            self._tickets[unit] = ticket
            engine_slots.submit(key, ticket)

        if self._run_slots is None:
            granted_by_run()
            return
        ticket = Ticket(granted_by_run)
        self._tickets[unit] = ticket
        self._run_slots.submit(key, ticket)

    # -- map nodes (M1-M6) ----------------------------------------------------

    def _expand(self, i: int, parked: list[ParkedRow] | None = None) -> list[int]:
        """Start map ``i``'s visit (M1); the items to dispatch now, in item order.

        A bad input fails the node (E9) and an empty list completes it with
        ``[]``, both through the next harvest. A visit restored mid-way (D3,
        M6) dispatches only the items that had not ended. A map with
        ``resume_parked`` first claims the parked items of its node (see
        :meth:`take_parked`); they become its first items (P4).
        """
        state = self.state
        ns = state.nodes[i]
        items = ns.items
        now = time.monotonic()
        node = self.topo.nodes[i]
        if items is None and parked is None and node.resume_parked and self._writer is not None:
            self._claims.append(i)  # claimed from the store before its items start
            return []
        if items is None:
            payload = ns.payload
            if parked and isinstance(payload, list | tuple):
                payload = [self._decode(row.value_json) for row in parked] + list(payload)
            try:
                values, k = map_plan(node, payload)
            except MapError as exc:
                state.start(i, now)
                self._settled(i, error=exc)
                return []
            items = state.expand(i, values, k, now)
            if parked:
                self._resume_parked(i, items, parked)
            self.emit(EventType.NODE_STARTED, i, ns.visits, ns.attempts, items=len(values))
            if not values:
                self._settled(i, value=[])
                return []
        elif ns.status is NodeStatus.QUEUED:  # restored with some items ended
            state.start(i, now)
            self.emit(
                EventType.NODE_STARTED, i, ns.visits, ns.attempts, items=len(items), resumed=True
            )
        return items.pending()

    async def take_parked(self) -> None:
        """Claim, for each map waiting on it, the parked items of its node (P4), then start
        its items: each parked item is claimed by exactly one map visit across processes."""
        claims, self._claims = self._claims, []
        assert self._writer is not None
        units: list[Unit] = []
        for i in claims:
            node_id, visit = self.topo.ids[i], self.state.nodes[i].visits
            rows = await self._writer.store.claim_parked(
                self.topo.graph.name, node_id, f"{self.run_id}/{node_id}/{visit}"
            )
            units.extend((i, j) for j in self._expand(i, rows))
        if units:
            self._dispatch_units(units)

    def _resume_parked(self, i: int, items: MapItems, parked: list[ParkedRow]) -> None:
        """The parked items ``items`` took first: named in its row, run from their checkpoint."""
        items.parked = [row.park_id for row in parked]
        node_id = self.topo.ids[i]
        for j, row in enumerate(parked):
            if row.checkpoint_json is not None:
                self.state.checkpoints[(node_id, items.visit, j)] = parked_checkpoint(
                    row, self._decode(row.checkpoint_json)
                )
        self.state.dirty[i] = None

    def _decode(self, text: str) -> Any:
        return (self._writer.codec if self._writer is not None else DEFAULT_CODEC).decode(text)

    def _parked_row(self, i: int, visit: int, item: int | None, value: Any) -> ParkedRow | None:
        """A straggler of node ``i`` as it is parked (P3): what it runs on and its checkpoint;
        None when it cannot be kept (no store, or a value the codec refuses: it is cancelled)."""
        writer = self._writer
        if writer is None:
            return None
        node_id = self.topo.ids[i]
        checkpoint = self.checkpoints.resumed(node_id, visit, item)
        try:
            value_json = writer.codec.encode(value)
            checkpoint_json = None if checkpoint is None else writer.codec.encode(checkpoint.value)
        except (TypeError, ValueError):
            return None
        return ParkedRow(
            park_id=uuid.uuid4().hex, graph_name=self.topo.graph.name, node_id=node_id,
            run_id=self.run_id, visit=visit, item=-1 if item is None else item,
            value_json=value_json, checkpoint_json=checkpoint_json, parked_at=time.time(),
        )  # fmt: skip

    def _settled(self, i: int, *, value: Any = None, error: BaseException | None = None) -> None:
        """Map ``i``'s own outcome, known at its dispatch: harvested like an attempt's end."""
        ns = self.state.nodes[i]
        attempt = Attempt(i, ns.visits, time.monotonic(), False, ns.attempts or 1)
        attempt.value = value
        attempt.error = error
        attempt.finished = True
        self._done.append(attempt)

    def _holds_slot(self, attempt: Attempt) -> bool:
        """Whether ``attempt`` holds an admission slot: a map's own outcome holds none, nor a
        child run's attempt once it started."""
        return (attempt.item >= 0 or not self._map[attempt.index]) and not attempt.released

    def start_item(
        self,
        i: int,
        j: int,
        *,
        hedge: bool = False,
        extra_slot: bool = False,
        items: MapItems | None = None,
    ) -> None:
        """Start an attempt of item ``j`` of map ``i`` (of ``items``, default its current visit)."""
        items = items or self.state.nodes[i].items
        assert items is not None
        if not hedge:
            items.start(j)
            if self.hedger is not None:
                self.hedger.first_attempts += 1
        attempt = Attempt(i, items.visit, time.monotonic(), hedge, items.attempts[j] or 1, j, items)
        if extra_slot:
            attempt.extra_slot = True
        data = {"item": j, "hedge": True} if hedge else {"item": j}
        self._launch(attempt, items.values[j], data)

    def _release_slot(self) -> None:
        if self._engine_slots is not None:
            self._engine_slots.release()
        if self._run_slots is not None:
            self._run_slots.release()

    def take_idle_slot(self) -> bool:
        """Take a slot of the engine and of the run if both have one nobody waits for.

        For clones and backups (hedge policy): they use idle capacity only,
        so they never delay a first attempt (E3 still bounds what runs).
        """
        engine_slots, run_slots = self._engine_slots, self._run_slots
        if engine_slots is not None and not engine_slots.try_acquire():
            return False
        if run_slots is not None and not run_slots.try_acquire():
            if engine_slots is not None:
                engine_slots.release()
            return False
        return True

    def _close_tail(self) -> None:
        """Stop the hedger's timers and hedges for this run (it is winding down)."""
        if self.hedger is not None:
            self.hedger.close()

    def _release_extra(self, attempt: Attempt) -> None:
        if attempt.extra_slot:
            attempt.extra_slot = False
            self._release_slot()

    def start_attempt(self, i: int, *, hedge: bool = False, extra_slot: bool = False) -> None:
        """Start an attempt of node ``i`` now (admission already granted, or a hedge).

        ``extra_slot``: the attempt holds a slot of its own (taken with
        :meth:`take_idle_slot`), released when it ends.
        """
        ns = self.state.nodes[i]
        now = time.monotonic()
        if not hedge:
            self.state.start(i, now)
            if self.hedger is not None:
                self.hedger.first_attempts += 1
        attempt = Attempt(i, ns.visits, now, hedge, ns.attempts or 1)
        if extra_slot:
            attempt.extra_slot = True
        self._launch(attempt, ns.payload, _HEDGE_DATA if hedge else None)

    def restart(self, attempt: Attempt, *, extra_slot: bool = False) -> None:
        """Start a hedge of ``attempt``'s node or item (T3, per item for maps, M2)."""
        if attempt.item < 0:
            self.start_attempt(attempt.index, hedge=True, extra_slot=extra_slot)
        else:
            self.start_item(
                attempt.index, attempt.item, hedge=True, extra_slot=extra_slot, items=attempt.items
            )

    def _launch(self, attempt: Attempt, payload: Any, data: Mapping[str, Any] | None) -> None:
        """Run ``attempt`` on ``payload`` as a task; its NODE_STARTED carries ``data``."""
        i = attempt.index
        node = self.topo.nodes[i]
        if self._direct[i]:
            coro = self._run_direct(node, payload, attempt)
        elif self._child[i]:
            coro = self._run_child(node, payload, attempt)
            if self.children is not None:
                item = None if attempt.item < 0 else attempt.item
                data = {
                    **(data or {}),
                    "child": self.children.child_id(node.id, attempt.visit, item),
                }
        else:
            coro = self._run_attempt(node, self._async[i], payload, attempt)
        task = self.loop.create_task(coro, name=node.id)
        # Removed when the attempt reports its end: it fires only for a task
        # cancelled before its first step (whose coroutine never ran).
        task.add_done_callback(self._unreported_cb, context=self._cb_context)
        attempt.task = task
        self._in_flight[attempt] = None
        if self._record:
            self.event_seq += 1
            self._events.append(
                (
                    self.event_seq,
                    EventType.NODE_STARTED,
                    i,
                    attempt.visit,
                    attempt.tries,
                    time.time(),
                    data,
                )
            )
        if self.hedger is not None:
            self.hedger.watch(attempt)

    def poke(self) -> None:
        """Wake the loop for an empty harvest, so buffered events are committed and published now.

        A poke while the loop is busy elsewhere (a flush) is kept: the loop
        then makes that harvest before it waits again.
        """
        self._poked = True
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    async def _run_direct(self, node: Node, payload: Any, attempt: Attempt) -> None:
        """An attempt of an async handler with no retry, timeout or executor (the short path)."""
        cps = self.checkpoints
        item = None if attempt.item < 0 else attempt.item
        # Written out: this is every plain node's path; a run without checkpoints skips the lookup.
        resumed = None
        if (cps.latest or cps.committed) and not attempt.hedge:
            resumed = cps.resumed(node.id, attempt.visit, item)
        set_current(
            (self.run_id, node.id, attempt.visit, attempt.tries, item, cps, resumed,
             self.streams, attempt)
        )  # fmt: skip
        try:
            attempt.value = await node.handler(payload)
        except BaseException as exc:
            if self._ended(attempt, exc):
                raise
            return
        self._finished(attempt)

    async def _run_child(self, node: Node, payload: Any, attempt: Attempt) -> None:
        """An attempt of a node whose handler is a graph: its child run (R1); it holds no slot."""
        if self._bounded and self._holds_slot(attempt):
            attempt.released = True
            self._release_slot()  # the child's own nodes take slots (no nested deadlock)
        try:
            if self.children is None:
                raise RunError(f"node {node.id!r}: child runs need an engine to run them")
            attempt.value = await self.children.run(node, payload, attempt)
        except BaseException as exc:
            if self._ended(attempt, exc):
                raise
            return
        self._finished(attempt)

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
        self._finished(attempt)

    def _where(self, node: Node, attempt: Attempt, tries: int, resumed: Checkpoint | None) -> Where:
        """What ``current_node()`` reads in the attempt: where it runs, its checkpoint sink, the
        checkpoint it resumes from, and the stream sink with its handle on the attempt."""
        item = None if attempt.item < 0 else attempt.item
        return (
            self.run_id, node.id, attempt.visit, tries, item, self.checkpoints, resumed,
            self.streams, attempt,
        )  # fmt: skip

    def _resumed(self, node: Node, attempt: Attempt) -> Checkpoint | None:
        """The checkpoint a new attempt continues from (P2); a hedge starts afresh."""
        if attempt.hedge:
            return None
        item = None if attempt.item < 0 else attempt.item
        return self.checkpoints.resumed(node.id, attempt.visit, item)

    def _ended(self, attempt: Attempt, exc: BaseException) -> bool:
        """The attempt raised ``exc``: record it; True if it must propagate (a cancellation).

        A handler's error is the attempt's outcome, read by the harvest; a
        cancellation (of a hedge loser, or a handler cancelling itself, E9) is
        recorded too, and re-raised so the task ends cancelled.
        """
        attempt.error = exc
        self._finished(attempt)
        return not isinstance(exc, Exception)

    def _finished(self, attempt: Attempt) -> None:
        """Hand a finished attempt to the run loop and wake it (once per attempt)."""
        if attempt.finished:
            return
        attempt.finished = True
        if attempt.task is not None:
            attempt.task.remove_done_callback(self._unreported_cb)
            # The task's context refers to the attempt (current_node's handle): letting go
            # of the task here leaves no cycle, so both are freed by reference counting.
            attempt.task = None
        try:
            del self._in_flight[attempt]
        except KeyError:
            return  # the run is winding down and no longer harvests it
        self._done.append(attempt)
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    def _unreported(self, task: asyncio.Task[Any]) -> None:
        """A task ended without its attempt reporting: it was cancelled before it ran."""
        for attempt in self._in_flight:
            if attempt.task is task:
                attempt.error = asyncio.CancelledError()  # E9: a cancelled handler failed
                self._finished(attempt)
                return

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
            due = self.state.nodes[attempt.index].retry_due
        else:
            due = items.retry_due.get(attempt.item)
        if due is not None and retry is not None and not attempt.hedge:
            # Resumed while backing off: wait out what is left of that backoff.
            await asyncio.sleep(min(max(0.0, due - time.time()), retry.delay(max(tries - 1, 1))))
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
                delay = retry.delay(tries)
                self._retrying(attempt, tries, exc, delay)
                await asyncio.sleep(delay)
                tries += 1
                attempt.tries = tries
                # The next try starts over, or from the latest checkpoint (P2).
                resumed = self._resumed(node, attempt) if retry.resume else None
                # The next try is no longer due.
                if items is None:
                    self.state.nodes[attempt.index].retry_due = None
                else:
                    items.retry_due.pop(attempt.item, None)

    def _retrying(self, attempt: Attempt, tries: int, exc: BaseException, delay: float) -> None:
        """Try ``tries`` failed and another follows after ``delay``: make it durable and live now."""
        self.streams.end(attempt, accepted=False, tries=tries)  # the next try streams afresh (S2)
        i = attempt.index
        ns = self.state.nodes[i]
        items, j = attempt.items, attempt.item
        if items is not None:
            if items.status[j] is ItemStatus.RUNNING:
                items.attempts[j] = tries + 1
                items.retry_due[j] = time.time() + delay
                items.dirty[j] = None
                self.state.dirty_items[items] = None
        elif ns.visits == attempt.visit and ns.status is NodeStatus.RUNNING:
            ns.attempts = tries + 1
            ns.retry_due = time.time() + delay
            self.state.dirty[i] = None
        extra = {} if items is None else {"item": j}
        self.emit(
            EventType.NODE_RETRYING,
            i,
            attempt.visit,
            tries,
            error=describe(exc),
            delay=delay,
            traceback=traceback_text(exc),
            **extra,
        )
        self.poke()  # an empty harvest commits and publishes it now (E11)

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
                    hedge=attempt.hedge,
                )
                return await executor.invoke(node, payload, where)
        if is_async:
            return await node.handler(payload)
        context = contextvars.copy_context()
        result = await self.loop.run_in_executor(None, context.run, node.handler, payload)
        if asyncio.iscoroutine(result):
            result = await result
        return result

    # -- harvest --------------------------------------------------------------

    def _harvest(self, batch: list[Attempt]) -> tuple[int, BaseException] | None:
        """Process a batch of finished attempts in definition order (E2); return the first failure."""
        if len(batch) < BULK:
            return self._harvest_batch(batch)
        with paused_gc():
            return self._harvest_batch(batch)

    def _harvest_batch(self, batch: list[Attempt]) -> tuple[int, BaseException] | None:
        if len(batch) > 1:
            batch.sort(key=harvest_order)
        failure: tuple[int, BaseException] | None = None
        state = self.state
        hedger = self.hedger
        now = time.monotonic()
        for attempt in batch:
            i = attempt.index
            if attempt.timer is not None:
                attempt.timer.cancel()
            if attempt.backup_timer is not None:
                attempt.backup_timer.cancel()
            if attempt.abandoned:
                self._release_extra(attempt)
                continue  # a hedge loser; the winner holds the node's slot
            if hedger is not None and not hedger.settle(attempt):
                self._release_extra(attempt)
                continue
            if attempt.item >= 0:
                exc = self._harvest_item(attempt, now)  # recorded there, failed or not
                if exc is not None and failure is None:
                    failure = (i, exc)
                    self._failing = attempt
                    continue  # its slot is freed after the queue is cancelled (E9)
            else:
                self._durations[i] += now - attempt.started
                # A handler that raised CancelledError itself failed (E9).
                exc = attempt.error
                if exc is None:
                    exc = self._complete(i, attempt.value, attempt, now)
                    if exc is None and attempt.stream is not None:
                        self.streams.end(attempt, accepted=True)  # committed with this harvest (S2)
                if exc is not None and failure is None:
                    failure = (i, exc)
                    self._failing = attempt
                    continue  # its slot is freed after the queue is cancelled (E9)
                if exc is not None:
                    state.fail(i)
                    self.emit(
                        EventType.NODE_FAILED,
                        i,
                        attempt.visit,
                        attempt.tries,
                        error=describe(exc),
                        traceback=traceback_text(exc),
                    )
            # Freed only now, so the event log never shows more than capacity in flight (E3).
            if self._bounded and self._holds_slot(attempt):
                self._release_slot()
                self._release_extra(attempt)
        if self.streams.open:  # whatever streamed and was not accepted above (S2)
            self._discard_streams(batch)
        if self._fired_cancel and failure is None:
            self._cancel_dead_inputs()
        self._emit_late()
        return failure

    def _cancel_dead_inputs(self) -> None:
        """Cancel inputs nobody will read: every consumer fired without them (``late="cancel"``).

        A gate waiting on its answer is withdrawn: its question is superseded (Q7).
        """
        fired, self._fired_cancel = self._fired_cancel, []
        for t in fired:
            for s in self.topo.in_sources[t]:
                status = self.state.nodes[s].status
                if status in _CANCELLABLE and self._unread(s):
                    self._cancel_dead(s, t)

    def _unread(self, s: int) -> bool:
        """Whether node ``s``'s result could only arrive late: each consumer is an
        aggregate with ``late="cancel"`` outside any loop with ``s`` that already fired."""
        for edge in self.topo.out_edges[s]:
            node = self.topo.nodes[edge.target]
            if edge.in_loop or node.kind is not NodeKind.AGGREGATE or node.late == "record":
                return False
            if self.state.nodes[edge.target].fired < 1 or (node.max_visits or 1) != 1:
                return False
        return bool(self.topo.out_edges[s])

    def _cancel_dead(self, s: int, t: int) -> None:
        ns = self.state.nodes[s]
        # Its queued tickets first, so that no slot freed below goes to one of them.
        for unit in [u for u in self._tickets if u[0] == s]:
            self._tickets.pop(unit).cancel()
        running = [a for a in self._in_flight if a.index == s and not a.abandoned]
        for attempt in running:
            attempt.abandon()  # its end is no failure; its slot is freed here
        for _ in {a.item for a in running if not a.released}:  # one slot per node, or item
            self._release_slot()
        if s in self.state.ready:
            self.state.ready.remove(s)
        if self.hedger is not None:
            self.hedger.forget(s)
        row = None
        if ns.question is not None:  # a gate nobody needs an answer from any more (Q7)
            if self._writer is not None:
                self._writer.superseded.append(ns.question)
            ns.question = None
        elif self.topo.nodes[t].late == "park":  # a straggler kept for later (P3)
            row = self._parked_row(s, ns.visits, None, ns.payload)
            if row is not None:
                assert self._writer is not None
                self._writer.parked.append(row)
        self.state.cancel(s)
        self.state.late.append(
            LateInput(
                node_id=self.topo.ids[t],
                source_id=self.topo.ids[s],
                activation=self.state.nodes[t].fired,
                reason="parked" if row is not None else "cancelled",
            )
        )
        reason = "parked" if row is not None else "late"
        self.emit(EventType.NODE_CANCELLED, s, ns.visits, ns.attempts, reason=reason)

    def _complete(self, i: int, result: Any, attempt: Attempt, now: float) -> BaseException | None:
        state = self.state
        ns = state.nodes[i]
        if self._writer is not None:
            try:
                result = self._writer.canonical(self.topo.ids[i], attempt.visit, result)
            except EncodeError as exc:
                return exc
        if self._gate[i]:
            self._open_question(i, result, attempt)
            return None
        frozen_before = len(state.frozen)
        try:
            state.complete(i, result)  # a switch may raise; nothing was changed then
        except RunError as exc:  # a switch's bad route (E8); nothing was changed
            return exc
        if self._tail is not None and not self._map[i]:  # a map's items are observed instead
            self._tail.observe(
                self.topo.nodes[i], ns.payload, now - attempt.started, attempt.straggled
            )
        if self._record:
            self.event_seq += 1
            self._events.append(
                (
                    self.event_seq,
                    EventType.NODE_COMPLETED,
                    i,
                    attempt.visit,
                    attempt.tries,
                    time.time(),
                    {"duration": now - attempt.started, "hedge": attempt.hedge},
                )
            )
        if self._writer is not None:
            self._writer.result_completed(i, attempt.visit, result)
        if len(state.frozen) != frozen_before:
            self._aggregates_fired(frozen_before)
        return None

    def _aggregates_fired(self, frozen_before: int) -> None:
        """Emit AGGREGATE_FIRED for the first-k decisions a completion just made (E4)."""
        for t, activation, _payload, fired_by in self.state.frozen[frozen_before:]:
            # The k inputs that fired it (E4), not every edge into it.
            sources = [self.topo.ids[s] for s in fired_by]
            self.emit(EventType.AGGREGATE_FIRED, t, activation, None, sources=sources)
            if self.topo.nodes[t].late != "record":
                self._fired_cancel.append(t)

    # -- map items: harvest, decision, late items (M2-M5) ------------------------

    def _harvest_item(self, attempt: Attempt, now: float) -> BaseException | None:
        """Record a finished item attempt; the error that fails its map, if it does (M4)."""
        items, j = attempt.items, attempt.item
        assert items is not None
        if items.status[j] is not ItemStatus.RUNNING:
            return None  # ended already (cancelled as late while it finished)
        i = attempt.index
        failing = self._failing
        if failing is not None and failing.index == i:
            return None  # its map fails in this harvest: nothing after that decides it (E9)
        exc = attempt.error
        value = attempt.value
        text = None
        if exc is None and self._writer is not None:
            try:
                value, text = self._writer.canonical_item(self.topo.ids[i], items.visit, j, value)
            except EncodeError as error:
                exc = error
        if exc is not None:
            return self._item_failed(attempt, exc)
        node = self.topo.nodes[i]
        if self._tail is not None:
            self._tail.observe(node, items.values[j], now - attempt.started, attempt.straggled)
        items.texts[j] = text
        decides = self.state.item_succeeded(items, j, value)
        if attempt.stream is not None:
            self.streams.end(attempt, accepted=True)  # committed with this harvest (S2)
        if self._record:
            self.event_seq += 1
            self._events.append(
                (
                    self.event_seq,
                    EventType.NODE_COMPLETED,
                    i,
                    attempt.visit,
                    attempt.tries,
                    time.time(),
                    {"duration": now - attempt.started, "hedge": attempt.hedge, "item": j},
                )
            )
        if decides:
            self._decide(items, now)
        return None

    def _item_failed(self, attempt: Attempt, exc: BaseException) -> BaseException | None:
        """Item ``attempt.item`` failed for good: record it; what fails the map, if anything (M4)."""
        items, j, i = attempt.items, attempt.item, attempt.index
        assert items is not None
        decided = items.winners is not None
        decidable = self.state.item_failed(items, j, describe(exc))
        self.emit(
            EventType.NODE_FAILED,
            i,
            attempt.visit,
            attempt.tries,
            item=j,
            error=describe(exc),
            traceback=traceback_text(exc),
        )
        if decided:
            return None  # a late item: its failure changes nothing
        node = self.topo.nodes[i]
        if node.errors == "fail":
            return exc  # E9: the item's own exception fails the node and the run
        if items.hopeless():
            k = "every item" if items.k is None else f"k={items.k}"
            return MapError(
                f"map {node.id!r}: {items.failed} of {len(items)} items failed, so fewer "
                f"than {k} can still succeed; errors: "
                + "; ".join(f"item {e}: {text}" for e, text in sorted(items.errors.items())),
                errors=items.errors,
            )
        if decidable:
            self._decide(items, time.monotonic())
        return None

    def _decide(self, items: MapItems, now: float) -> None:
        """Decide map ``items`` (M3): complete its node with the output; cancel late items (M5)."""
        i = items.node
        ns = self.state.nodes[i]
        frozen_before = len(self.state.frozen)
        output = self.state.decide_map(items)
        winners = list(items.winners or ())
        self._durations[i] += now - ns.started_at  # a map's time: expansion to decision
        self.emit(
            EventType.NODE_COMPLETED,
            i,
            items.visit,
            ns.attempts,
            duration=now - ns.started_at,
            hedge=False,
            items=len(items),
            k=len(winners),
            winners=winners,
        )
        if self._writer is not None:
            texts = [items.texts[w] for w in winners]
            text = None if None in texts else "[" + ",".join(t for t in texts if t) + "]"
            self._writer.result_completed(i, items.visit, output, text=text)
        if len(self.state.frozen) != frozen_before:
            self._aggregates_fired(frozen_before)
        late = self.topo.nodes[i].late
        if late != "record":
            self._cancel_items(items, items.unfinished(), park=late == "park")

    def _cancel_items(self, items: MapItems, late: list[int], *, park: bool = False) -> None:
        """Cancel the items of ``items`` still queued or running at its decision (M5); with
        ``park``, keep each as a parked item (P3)."""
        if not late:
            return
        i = items.node
        for j in late:  # first, so that no slot freed below goes to a late item
            ticket = self._tickets.pop((i, j), None)
            if ticket is not None:
                ticket.cancel()
        wanted = set(late)
        running: dict[int, list[Attempt]] = {}
        for attempt in self._in_flight:
            if attempt.items is items and attempt.item in wanted and not attempt.abandoned:
                running.setdefault(attempt.item, []).append(attempt)
        for j in late:
            attempts = running.get(j)
            if attempts:
                for attempt in attempts:
                    attempt.abandon()  # its end is no failure
                if not all(a.released for a in attempts):
                    self._release_slot()  # the item's; a hedge's is freed at its harvest
            if self.hedger is not None:
                self.hedger.live.pop((i, j), None)
            row = self._parked_row(i, items.visit, j, items.values[j]) if park else None
            if row is not None:
                assert self._writer is not None
                self._writer.parked.append(row)
            self.state.item_cancelled(items, j, parked=row is not None)
            self.emit(
                EventType.NODE_CANCELLED,
                i,
                items.visit,
                items.attempts[j] or None,
                item=j,
                reason="parked" if row is not None else "late",
            )

    def _open_question(self, i: int, prompt: Any, attempt: Attempt) -> None:
        """A gate's handler returned its prompt: open the question and wait (Q1)."""
        assert self._writer is not None, "gates run only with a store"
        node = self.topo.nodes[i]
        question_id = uuid.uuid4().hex
        self.state.wait(i, question_id)
        self._writer.question_opened(
            question_id=question_id,
            node_id=node.id,
            visit=attempt.visit,
            turn=self.turn,
            prompt=prompt,
            poller=node.poller,
            deadline=None if node.deadline is None else time.time() + node.deadline,
        )
        self.emit(
            EventType.QUESTION_OPENED,
            i,
            attempt.visit,
            attempt.tries,
            question_id=question_id,
            turn=self.turn,
        )

    def apply_answer(self, question_id: str, value: Any) -> bool:
        """Complete the gate waiting on ``question_id`` with ``value``; False if none waits (Q3)."""
        i = self.state.waiting_questions().get(question_id)
        if i is None:
            return False
        ns = self.state.nodes[i]
        frozen_before = len(self.state.frozen)
        self.state.answer(i, value)
        self.emit(EventType.QUESTION_ANSWERED, i, ns.visits, None, question_id=question_id)
        if self._writer is not None:
            self._writer.result_completed(i, ns.visits, value)
        if len(self.state.frozen) != frozen_before:
            self._aggregates_fired(frozen_before)
            if self._fired_cancel:  # M-of-N: the answers still awaited are withdrawn (Q7)
                self._cancel_dead_inputs()
        return True

    async def absorb_answers(self) -> list[str]:
        """Apply the stored answers to gates that wait on them; supersede the others (Q3).

        The ids applied are committed with the next harvest, whose store-side
        compare-and-set refuses a second application across processes.
        """
        writer = self._writer
        if writer is None or not self.state.waiting_questions():
            return []
        applied: list[str] = []
        for question_id, value in await writer.unapplied_answers():
            if self.apply_answer(question_id, value):
                writer.applied.append(question_id)
                applied.append(question_id)
            else:
                writer.superseded.append(question_id)
        return applied

    def _emit_late(self) -> None:
        late = self.state.late
        for item in late[self._late_seen :]:
            t = self.topo.index[item.node_id]
            extra = {} if item.item is None else {"item": item.item}
            self.emit(
                EventType.NODE_LATE_INPUT,
                t,
                item.activation,
                None,
                source=item.source_id,
                reason=item.reason,
                **extra,
            )
        self._late_seen = len(late)

    # -- endings: failed (E9), cancelled, suspended, completed or stalled (E10) --

    async def _fail(self, i: int, exc: BaseException) -> None:
        """E9: cancel and await siblings, one final write, NODE_FAILED last, re-raise."""
        await self._cancel_in_flight(record=True, keep=i)
        if self._failing is None or self._holds_slot(self._failing):
            self._release_slot()  # the failed node's; no queued sibling can take it now
        if self._failing is not None:
            self._release_extra(self._failing)
        self._supersede_waiting()
        ns = self.state.nodes[i]
        if ns.status is not NodeStatus.FAILED:
            self.state.fail(i)
        self.emit(
            EventType.NODE_FAILED,
            i,
            ns.visits,
            ns.attempts,
            error=describe(exc),
            traceback=traceback_text(exc),
        )
        await self._commit(RunStatus.FAILED, describe(exc))
        raise exc

    def _supersede_waiting(self) -> None:
        """The run ends without its gates' answers: cancel them, supersede their questions (Q3)."""
        for question_id, g in sorted(self.state.waiting_questions().items(), key=lambda kv: kv[1]):
            gs = self.state.nodes[g]
            gs.question = None
            self.state.cancel(g)
            self.emit(EventType.NODE_CANCELLED, g, gs.visits, gs.attempts)
            if self._writer is not None:
                self._writer.superseded.append(question_id)

    async def _cancel_in_flight(self, *, record: bool, keep: int | None = None) -> None:
        """Cancel and await what is in flight and queued; with ``record``, mark those nodes
        cancelled (all but ``keep``, the node whose failure ends the run)."""
        self._close_tail()  # first: no hedge may start while we wind down
        if record and self.children is not None:
            self.children.ending = True  # the run ends: its children are not needed (R3)
        tickets, self._tickets = self._tickets, {}
        for ticket in tickets.values():
            ticket.cancel()
        attempts = list(self._in_flight)
        for attempt in attempts:
            assert attempt.task is not None
            attempt.task.cancel()
        if attempts:
            await asyncio.gather(*(a.task for a in attempts if a.task), return_exceptions=True)
        self._in_flight.clear()
        self._discard_streams((*attempts, *self._done))
        for attempt in (*attempts, *self._done):
            self._release_extra(attempt)  # clones and backups hold their own
        # Abandoned attempts (hedge losers, cancelled dead inputs) hold no node slot.
        holding = {(a.index, a.item) for a in attempts if not a.abandoned and not a.released} | {
            (a.index, a.item) for a in self._done if not a.abandoned and self._holds_slot(a)
        }
        for _ in holding:  # one slot per node visit or item, however many attempts raced
            self._release_slot()
        stopped = {i for i, _ in holding} | {i for i, _ in tickets}
        stopped.discard(-1 if keep is None else keep)
        self._done = []
        if not record:
            return
        for i in sorted(stopped):
            ns = self.state.nodes[i]
            if ns.status in (NodeStatus.RUNNING, NodeStatus.QUEUED, NodeStatus.WAITING):
                self.state.cancel(i)
                self.emit(EventType.NODE_CANCELLED, i, ns.visits, ns.attempts)

    def preempt(self) -> None:
        """Stop the run at its next turn boundaries (in-loop edges) and suspend it (partial rollouts)."""
        self.state.preempting = True
        self.poke()

    def request_cancel(self) -> None:
        """End the run ``cancelled`` at its next wake-up (``Engine.cancel``).

        In-flight attempts are cancelled and awaited, what the wake-up brought
        is dropped, running nodes are recorded cancelled and open questions
        superseded, in one final write; nothing is committed after it.
        """
        self.cancel_requested = True
        self.poke()

    async def _cancel(self) -> RunResult:
        await self._cancel_in_flight(record=True)
        self._supersede_waiting()
        if self.cancel_reason == "deadline":  # R6: said in the event and the run's error
            self.emit(EventType.RUN_CANCELLED, reason="deadline", deadline=self.deadline)
            await self._commit(RunStatus.CANCELLED, f"deadline passed ({self.deadline:.3f})")
        else:
            self.emit(EventType.RUN_CANCELLED)
            await self._commit(RunStatus.CANCELLED)
        return self.result(RunStatus.CANCELLED)

    async def _finish(self) -> RunResult:
        if self.state.parked:  # preempted: suspend with the turns parked, no question
            self.emit(EventType.RUN_SUSPENDED, reason="preempted", parked=len(self.state.parked))
            await self._commit(RunStatus.SUSPENDED)
            return dataclasses.replace(self.result(RunStatus.SUSPENDED), preempted=True)
        questions = self.state.waiting_questions()
        if questions:  # E10: an open gate is a suspension, never a stall
            self.turn += 1
            self.emit(EventType.RUN_SUSPENDED, questions=sorted(questions), turn=self.turn)
            await self._commit(RunStatus.SUSPENDED)
            return self.result(RunStatus.SUSPENDED)
        waiting = self.state.waiting_aggregates()
        if waiting:
            message = f"run {self.run_id!r} stalled: aggregate " + "; ".join(waiting)
            await self._commit(RunStatus.FAILED, message)
            raise StallError(message)
        self.emit(EventType.RUN_COMPLETED)
        await self._commit(RunStatus.COMPLETED)
        return self.result(RunStatus.COMPLETED)

    def result(self, status: RunStatus) -> RunResult:
        """Build the :class:`RunResult` from the current state."""
        results: dict[str, Any] = {}
        visits: dict[str, int] = {}
        reports: dict[str, NodeReport] = {}
        durations = self._durations
        for i, (node_id, ns) in enumerate(zip(self.topo.ids, self.state.nodes, strict=True)):
            if ns.has_result:
                results[node_id] = ns.result
            visits[node_id] = ns.visits
            reports[node_id] = NodeReport(ns.status, ns.visits, ns.attempts, durations[i])
        return RunResult(
            run_id=self.run_id,
            status=status,
            results=results,
            visits=visits,
            nodes=reports,
            late_inputs=tuple(self.state.late),
            stragglers=0 if self.hedger is None else self.hedger.stragglers,
            hedges=0 if self.hedger is None else self.hedger.hedges,
            duration=time.monotonic() - self.started_at,
            output=self.output(),
            parent_run_id=self.parent_run_id,
        )

    def output(self) -> Any:
        """The run's output now: its one finished sink's result, or each finished sink's by id."""
        done = [i for i in self.topo.sinks if self.state.nodes[i].has_result]
        if len(done) == 1:
            return self.state.nodes[done[0]].result
        return {self.topo.ids[i]: self.state.nodes[i].result for i in done} or None
