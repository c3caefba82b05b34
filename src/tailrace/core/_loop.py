"""One run: dispatch, harvest, route, first-k, commit per harvest (E1-E11, D1-D3).

The loop wakes on the first completion, harvests every attempt that finished
by then, processes them in definition order (E2), lets :mod:`._state` decide
routing and first-k, dispatches what became ready (E1), and commits the whole
harvest as one delta (D1). Completions are collected by done-callbacks rather
than ``asyncio.wait`` so that a wake-up costs O(batch), not O(in flight).

The loop holds its collaborators as fields, each with its own state: the
run's admission (tickets and the slots its units hold, E3), the in-flight
set, the outbox (events and ledger rows until their stage), the checkpoints
and streams, the map nodes (M1-M6), the hedger (T3) and the writer (D1-D6).
They get values and callbacks from the loop, never the loop itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import time
import uuid
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from .._codec import DEFAULT_CODEC, Codec
from .._errors import EncodeError, RunError, StallError
from .._events import Event, EventType
from ..executors._base import Executor
from ..graph import NodeKind
from ..stores import RunStatus
from ..tail import TailHooks
from ._admission import AdmissionPolicy, RunAdmission, SlotQueue, Unit
from ._checkpoints import Checkpoints
from ._children import Children
from ._hedger import Hedger
from ._inflight import BULK, Attempt, InFlight, describe, harvest_order, paused_gc, traceback_text
from ._maps import MapNodes
from ._outbox import Outbox
from ._outcome import RunResult, result_of
from ._runner import AttemptRunner
from ._state import LateInput, MapItems, NodeStatus, RunState
from ._streams import MAX_STREAM_CHUNKS, StreamHub, Streams
from ._writer import RunWriter, Stage

#: The data of a hedge's NODE_STARTED (shared: every Event gets its own copy).
_HEDGE_DATA: Mapping[str, Any] = MappingProxyType({"hedge": True})

#: Inputs a ``late="cancel"`` merge cancels once it fired without them (E5, Q7).
_CANCELLABLE = frozenset({NodeStatus.RUNNING, NodeStatus.QUEUED, NodeStatus.WAITING})


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LoopSettings:
    """What every run one engine drives shares: its slots (None: unbounded), each run's
    capacity, the admission policy, the codec, the stream hub and the chunk bound (E3, S1)."""

    engine_slots: SlotQueue | None = None
    run_capacity: int | None = None
    policy: AdmissionPolicy
    codec: Codec = DEFAULT_CODEC
    stream_hub: StreamHub | None = None
    max_stream_chunks: int = MAX_STREAM_CHUNKS


class RunLoop:
    """Drives one run to completion, suspension or failure."""

    def __init__(
        self,
        *,
        run_id: str,
        state: RunState,
        publish: Callable[[Event], None] | None,
        writer: RunWriter | None,
        settings: LoopSettings,
        tail: TailHooks | None = None,
        event_seq: int = 0,
        turn: int = 0,
        durability: str = "async",
        executors: list[Executor | None] | None = None,
        deadline: float | None = None,
        parent_run_id: str | None = None,
    ) -> None:
        self.run_id = run_id
        self.deadline = deadline  # the run is cancelled then if it has not finished (R6)
        self.parent_run_id = parent_run_id
        self._deadline_timer: asyncio.TimerHandle | None = None
        self.cancel_reason: str | None = None  # "deadline" when its deadline passed (R6)
        self.cancel_requested = False  # by request_cancel: it ends at its next wake-up
        self.turn = turn  # advances each time the run suspends on its gates (Q2)
        self.state = state
        self.topo = topo = state.topo
        self.loop = asyncio.get_running_loop()
        self.started_at = time.monotonic()
        self.inflight = InFlight()
        self.poke: Callable[[], None] = self.inflight.poke  # an empty harvest, now
        self._writer = writer
        #: "sync": successors start only once their upstream's completion is durable.
        self._sync = durability == "sync" and writer is not None
        if writer is not None:
            writer.on_failure = self.poke  # a failed write stops the run at once
            writer.durability = durability
        self._tail = tail
        self.outbox = Outbox(
            run_id, topo.ids, publish, record=publish is not None or writer is not None,
            seq=event_seq,
        )  # fmt: skip
        #: Buffers an event; it is committed with the harvest and then published.
        self.emit = self.outbox.emit
        self.admission = RunAdmission(settings.engine_slots, settings.run_capacity, settings.policy)
        self._bounded = self.admission.bounded
        self._gate = tuple(n.kind is NodeKind.GATE for n in topo.nodes)
        self._map = tuple(n.kind is NodeKind.MAP for n in topo.nodes)  # a handler per item (M1)
        self._durations = [0.0] * len(topo.ids)
        self._late_seen = len(state.late)
        #: Aggregates with ``late="cancel"`` that fired in the current harvest.
        self._fired_cancel: list[int] = []
        #: Child run inputs cancelled as late whose abandoned attempts still end: source ->
        #: the aggregate that fired without it (see :meth:`_settle`).
        self._settling: dict[int, int] = {}
        #: The attempt whose failure is failing the run (E9), until its slots are freed.
        self._failing: Attempt | None = None
        codec = writer.codec if writer is not None else settings.codec
        #: What attempts save with ``current_node().checkpoint`` and resume from (P1, P2).
        self.checkpoints = Checkpoints(
            run_id, codec, state.checkpoints, self.poke, self.loop, durable=writer is not None,
            repark=self.outbox.repark, flush=None if writer is None else writer.flush,
        )  # fmt: skip
        #: The run's stream chunks and their terminal marks (S1-S4).
        self.streams = Streams(
            run_id, topo.ids, codec, settings.stream_hub, durable=writer is not None,
            poke=self.poke, max_chunks=settings.max_stream_chunks,
        )  # fmt: skip
        #: Stragglers and hedges of this run, when the engine has tail hooks (T3).
        self.hedger = None if tail is None else Hedger(
            tail, topo=topo, loop=self.loop, outbox=self.outbox, admission=self.admission,
            payload_of=self.payload_of, restart=self._restart, poke=self.poke,
        )  # fmt: skip
        #: Starts attempts as tasks and runs them (E11, R1).
        self.runner = AttemptRunner(
            run_id=run_id, state=state, executors=executors, inflight=self.inflight,
            outbox=self.outbox, admission=self.admission, checkpoints=self.checkpoints,
            streams=self.streams, hedger=self.hedger,
        )  # fmt: skip
        #: The map nodes' items (M1-M6), when the graph has map nodes.
        self.maps = None if not any(self._map) else MapNodes(
            run_id=run_id, state=state, outbox=self.outbox, admission=self.admission,
            inflight=self.inflight, checkpoints=self.checkpoints, streams=self.streams,
            writer=writer, tail=tail, hedger=self.hedger, durations=self._durations,
            launch=self.runner.launch, fired=self._aggregates_fired,
        )  # fmt: skip

    # -- the loop -------------------------------------------------------------

    async def drive(self) -> RunResult:
        """Run until nothing is ready or in flight; return the result or raise (E9, E10)."""
        inflight = self.inflight
        try:
            if self.deadline is not None:
                self._arm_deadline()
            if self.cancel_requested:  # asked before anything was dispatched
                return await self._cancel()
            self._dispatch_ready()
            if self.maps is not None and self.maps.claims:
                await self._take_parked()
            await self._gather()
            while True:
                while inflight.attempts or inflight.done or self._queued():
                    if not inflight.done and not inflight.poked:  # nothing to harvest: wait
                        children = self.runner.children
                        if (
                            children is not None
                            and not self._queued()
                            and children.waiting_only(inflight.attempts)
                        ):
                            return await self._suspend_on_children(children)
                        # A future, not a coroutine per wake-up (InFlight.finished sets it).
                        inflight.wake = wake = self.loop.create_future()
                        await wake
                    if self._writer is not None:
                        # A write failed: dispatch nothing more; the handler below
                        # cancels and awaits what runs, and re-raises (E9, D1).
                        self._writer.raise_failure()
                    if self.cancel_requested:
                        return await self._cancel()
                    inflight.poked = False
                    batch, inflight.done = inflight.done, []
                    failure = self._harvest(batch)
                    if failure is not None:
                        await self._fail(*failure)
                    if self._sync and (self.state.ready or self.checkpoints.pending):
                        # Durability "sync": what this harvest completed is durable
                        # before anything that consumes it starts; completions that
                        # arrive meanwhile join the next write (group commit).
                        await self.checkpoint()
                    self._dispatch_ready()
                    if self.maps is not None and self.maps.claims:
                        await self._take_parked()
                    if self.hedger is not None and self.hedger.backup_candidates:
                        self.hedger.back_up()  # a slot may have been freed
                    if self._stage(defer=True):  # a plain call: no coroutine per wake-up
                        await self._durable()  # the store fell behind: wait for it
                # Answers that came in while other branches ran: take them now
                # rather than suspend (Q1).
                if not await self.absorb_answers():
                    return await self._finish()
                self._dispatch_ready()
                if self.maps is not None and self.maps.claims:
                    await self._take_parked()
                await self._gather()
        except BaseException:
            self._discard_streams((*inflight.attempts, *inflight.done))
            self._stage_on_the_way_out()
            await self._cancel_in_flight(record=False)
            raise
        finally:
            if self._deadline_timer is not None:
                self._deadline_timer.cancel()
            if self.hedger is not None:
                self.hedger.close()  # no longer waits for the engine's hedge budget
            if self.runner.children is not None:
                await self.runner.children.close()

    def _arm_deadline(self) -> None:
        """Cancel the run at its deadline (R6); at once when it passed already."""
        assert self.deadline is not None
        # Stamped on the store's clock (a run without a store: this host's).
        now = time.time() if self._writer is None else self._writer.store.clock()
        left = self.deadline - now
        if left <= 0:
            self._deadline_passed()
        else:
            self._deadline_timer = self.loop.call_later(left, self._deadline_passed)

    def _deadline_passed(self) -> None:
        self.cancel_reason = "deadline"
        self.request_cancel()

    def _completions_needed(self) -> int:
        """How many of the children awaited must end before the run can move on (R4)."""
        waiting: dict[int, list[Attempt]] = {}
        for attempt in self.inflight.attempts:
            waiting.setdefault(attempt.index, []).append(attempt)
        return self.state.ends_that_wake(
            {i: (len(attempts), attempts[0].items) for i, attempts in waiting.items()}
        )

    async def _suspend_on_children(self, children: Children) -> RunResult:
        """Every attempt in flight only waits on a child run: suspend, holding nothing (R4).

        The attempts stop without cancelling their children and stay
        ``running`` in the stored state, so the run's next driver starts them
        again and they re-attach to their children where they are (R2).
        """
        awaited = children.awaited()
        wake_after = self._completions_needed()
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
        if self._stage(RunStatus.SUSPENDED, wake_after=wake_after, waiting_on=awaited):
            await self._durable()
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
        return bool(self.admission.tickets) or bool(self.state.ready)

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
        wake_after: int | None = None,
        waiting_on: tuple[str, ...] = (),
    ) -> bool:
        """Hand the harvests so far to the store (D1) and publish their events.

        True when the write must be durable first (a final status, or the store
        falling behind): the events then wait for :meth:`_durable`. ``defer``:
        a running harvest may wait for the writer's group window, and is
        staged with the ones that follow when it ends (its events wait too).
        A suspension on child runs says how many of their ends wake it
        (``wake_after``) and which it waits for (``waiting_on``, R4).
        """
        writer, outbox = self._writer, self.outbox
        if writer is None:
            if outbox.events:
                outbox.publish(outbox.take())
            return False
        if defer and writer.defer(self.poke, hurry=self.streams.waiting):
            return False
        events = outbox.take()
        must_flush = writer.stage(
            Stage(
                state=self.state, status=status, error=error, events=events,
                event_seq=outbox.seq, turn=self.turn, checkpoints=self.checkpoints,
                streams=self.streams, applied=outbox.applied, superseded=outbox.superseded,
                parked=outbox.parked, wake_after=wake_after, waiting_on=waiting_on,
                output=self.state.output, unclaimed=[] if self.maps is None else self.maps.unclaimed,
            )
        )  # fmt: skip
        outbox.applied, outbox.superseded, outbox.parked = [], [], []
        if self.maps is not None:
            self.maps.unclaimed = []
        if must_flush:
            outbox.unpublished.extend(events)
            return True
        outbox.publish(events)
        return False

    async def _durable(self) -> None:
        """Wait until every staged write is durable, then publish what waited for it."""
        assert self._writer is not None
        await self._writer.flush()
        self.outbox.publish_waiting()

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
        if self.maps is not None:  # a map's items are units of their own (M2), in item order
            units = []
            for i in ready:
                if self._map[i]:
                    units.extend([(i, j) for j in self.maps.expand(i)])
                else:
                    units.append((i, -1))
        if units is None and not self._bounded:
            for i in ready:
                self.start_attempt(i)
            if self.hedger is not None and len(ready) > 1:
                self.hedger.launched([(i, -1) for i in ready])
            return
        self._dispatch_units(units if units is not None else [(i, -1) for i in ready])

    def _dispatch_units(self, units: list[Unit]) -> None:
        """Start or admit ``units`` (nodes and map items), in order (E2, E3, M2)."""
        if self._tail is not None:
            units = self._with_usable_costs(units)
        if not self._bounded:
            for unit in units:
                self._start_unit(unit)
        else:
            keyed = sorted((self._admission_key(u), n, u) for n, u in enumerate(units))
            admit, granted = self.admission.admit, self._granted
            for key, _, unit in keyed:  # the policy orders a ready batch too (E3, T2)
                admit(unit, key, granted)
        if self.hedger is not None and len(units) > 1:
            self.hedger.launched(units)

    def _with_usable_costs(self, units: list[Unit]) -> list[Unit]:
        """``units`` but those whose declared cost is unusable (it raises, or is no finite
        number): each of those fails its node through the next harvest (E9) before it takes
        a slot, so nothing is admitted that no path would release."""
        tail = self._tail
        assert tail is not None
        usable: list[Unit] = []
        failed: set[int] = set()
        for i, j in units:
            node = self.topo.nodes[i]
            if i in failed:
                continue
            if callable(node.cost):
                try:
                    tail.cost_of(node, self.payload_of(i, j), item=None if j < 0 else j)
                except ValueError as exc:
                    failed.add(i)
                    self._fails_at_dispatch(i, exc)
                    continue
            usable.append((i, j))
        return usable if failed else units

    def _fails_at_dispatch(self, i: int, exc: BaseException) -> None:
        """Node ``i`` fails before any attempt of it starts: harvested like an attempt's end."""
        ns = self.state.nodes[i]
        now = time.monotonic()
        if ns.status is NodeStatus.QUEUED:
            self.state.start(i, now)
        attempt = Attempt(i, ns.visits, now, False, ns.attempts or 1)
        attempt.error = exc
        attempt.finished = True
        self.inflight.done.append(attempt)

    def _granted(self, unit: Unit) -> None:
        """Admission granted ``unit`` its slot: start it on that slot."""
        self.admission.hold(self._start_unit(unit))
        self.poke()  # granted from another run's harvest: publish NODE_STARTED now (E3)

    def _start_unit(self, unit: Unit) -> Attempt:
        i, j = unit
        if j < 0:
            return self.start_attempt(i)
        assert self.maps is not None
        return self.maps.start_item(i, j)

    async def _take_parked(self) -> None:
        """Start the maps that waited to claim parked items first (P4)."""
        assert self.maps is not None
        units = await self.maps.take_parked()
        if units:
            self._dispatch_units(units)

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
        return self.admission.policy.key(node, payload, estimate)

    def start_attempt(self, i: int, *, hedge: bool = False) -> Attempt:
        """Start an attempt of node ``i`` now (admission already granted, or a hedge)."""
        ns = self.state.nodes[i]
        now = time.monotonic()
        if not hedge:
            self.state.start(i, now)
        attempt = Attempt(i, ns.visits, now, hedge, ns.attempts or 1)
        self.runner.launch(attempt, ns.payload, _HEDGE_DATA if hedge else None)
        return attempt

    def _restart(self, attempt: Attempt, extra_slot: bool) -> None:
        """Start a hedge of ``attempt``'s node or item (T3, per item for maps, M2); with
        ``extra_slot`` it holds the slot admission gave the hedger for it (T5)."""
        if attempt.item < 0:
            hedge = self.start_attempt(attempt.index, hedge=True)
        else:
            assert self.maps is not None
            hedge = self.maps.start_item(
                attempt.index, attempt.item, hedge=True, items=attempt.items
            )
        if extra_slot:
            self.admission.hold_extra(hedge)

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
        admission = self.admission
        now = time.monotonic()
        for attempt in batch:
            i = attempt.index
            if attempt.timer is not None:
                attempt.timer.cancel()
            if attempt.backup_timer is not None:
                attempt.backup_timer.cancel()
            if attempt.abandoned:
                admission.release_extra(attempt)
                if attempt.item >= 0 and self.maps is not None and self.maps.settling:
                    self.maps.settle(attempt, now)  # a late child run's item (M5, R3)
                elif self._settling and attempt.index in self._settling:
                    exc = self._settle(attempt, now)  # a late child run input (E5, R3)
                    if exc is not None and failure is None:
                        failure = (i, exc)
                continue  # a hedge loser; the winner holds the node's slot
            if hedger is not None and not hedger.settle(attempt):
                admission.release_extra(attempt)
                continue
            if attempt.item >= 0:
                assert self.maps is not None  # recorded there, failed or not:
                exc = self.maps.harvest_item(attempt, now, self._failing)
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
            if self._bounded:
                admission.release(attempt)
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
                if status in _CANCELLABLE and s not in self._settling and self._unread(s):
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
        """Cancel input ``s`` of aggregate ``t``, which fired without it (E5, Q7).

        A child run's input whose attempt is ending is settled by that attempt
        instead (:meth:`_settle`): a child that completed before its cancel
        arrived stays completed, and the input is late with reason ``fired``,
        as under ``late="record"`` (R3).
        """
        ns = self.state.nodes[s]
        # Its queued tickets first, so that no slot freed below goes to one of them.
        self.admission.cancel_node(s)
        abandoned = [a for a in self.inflight.attempts if a.index == s and not a.abandoned]
        for attempt in abandoned:
            attempt.abandon()  # its end is no failure; its unit's slot is freed here
            self.admission.release_unit(s, attempt.visit, attempt.item)
        if s in self.state.ready:
            self.state.ready.remove(s)
        if self.hedger is not None:
            self.hedger.forget(s)
        if abandoned and self.topo.nodes[s].child and self.topo.nodes[t].late == "cancel":
            self._settling[s] = t  # its attempt tells how its child ended
            return
        row = None
        if ns.question is not None:  # a gate nobody needs an answer from any more (Q7)
            if self._writer is not None:
                self.outbox.superseded.append(ns.question)
            ns.question = None
        elif self.topo.nodes[t].late == "park":  # a straggler kept for later (P3)
            row = self.checkpoints.park(
                self.topo.graph.name, self.topo.ids[s], ns.visits, None, ns.payload
            )
            if row is not None:
                self.outbox.parked.append(row)
        self._cancelled_late(s, t, parked=row is not None)

    def _cancelled_late(self, s: int, t: int, *, parked: bool = False) -> None:
        """Record input ``s`` of aggregate ``t`` cancelled as late (E5), or parked (P3)."""
        ns = self.state.nodes[s]
        self.state.cancel(s)
        self.state.late.append(
            LateInput(
                node_id=self.topo.ids[t],
                source_id=self.topo.ids[s],
                activation=self.state.nodes[t].fired,
                reason="parked" if parked else "cancelled",
            )
        )
        reason = "parked" if parked else "late"
        self.emit(EventType.NODE_CANCELLED, s, ns.visits, ns.attempts, reason=reason)

    def _settle(self, attempt: Attempt, now: float) -> BaseException | None:
        """An abandoned attempt of a late child run input ended: record how (E5, R3).

        An attempt that returned its child's output (the child completed
        before its cancel arrived) completes the node, and routing records
        the input late with reason ``fired``; otherwise it is cancelled.
        Returns what failed its completion, if anything did.
        """
        s = attempt.index
        t = self._settling.pop(s)
        if attempt.error is not None:
            self._cancelled_late(s, t)
            return None
        self._durations[s] += now - attempt.started
        return self._complete(s, attempt.value, attempt, now)

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
        outbox = self.outbox
        if outbox.record:  # written out: every node's completion (Outbox.put)
            outbox.seq += 1
            outbox.events.append(
                (outbox.seq, EventType.NODE_COMPLETED, i, attempt.visit, attempt.tries,
                 time.time(), {"duration": now - attempt.started, "hedge": attempt.hedge})
            )  # fmt: skip
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
            deadline=None if node.deadline is None else self._writer.store.clock() + node.deadline,
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
                self.outbox.applied.append(question_id)
                applied.append(question_id)
            else:
                self.outbox.superseded.append(question_id)
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
        await self._cancel_in_flight(record=True, keep=i)  # frees the failed node's slot too
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
        if self.maps is not None:
            self.maps.give_back_unfinished()  # with the final write: a crash keeps them claimed
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
                self.outbox.superseded.append(question_id)

    async def _cancel_in_flight(self, *, record: bool, keep: int | None = None) -> None:
        """Cancel and await what is in flight and queued; with ``record``, mark those nodes
        cancelled (all but ``keep``, the node whose failure ends the run)."""
        if self.hedger is not None:
            self.hedger.close()  # first: no hedge may start while we wind down
        children = self.runner.children
        if record and children is not None:
            children.ending = True  # the run ends: its children are not needed (R3)
        queued = self.admission.cancel_all()
        attempts = await self.inflight.cancel_all()
        done, self.inflight.done = self.inflight.done, []
        self._discard_streams((*attempts, *done))
        self.admission.release_all()  # whatever its units and backups still hold (E3)
        if not record:
            return
        if self._settling:  # late child run inputs whose attempts were still ending
            settling, self._settling = self._settling, {}
            for s, t in sorted(settling.items()):
                if self.state.nodes[s].status is NodeStatus.RUNNING:
                    self._cancelled_late(s, t)
        # The nodes stopped here: those running (hedge losers and inputs cancelled as
        # dead were stopped before) or queued, but for ``keep``, whose failure ends the run.
        stopped = {a.index for a in attempts if not a.abandoned and not a.released}
        stopped |= {a.index for a in done if not a.abandoned and self._holds_slot(a)}
        stopped |= {i for i, _ in queued}
        stopped.discard(-1 if keep is None else keep)
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
            await self._commit(RunStatus.CANCELLED, f"deadline passed ({_utc(self.deadline)})")
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
            if self.maps is not None:
                self.maps.give_back_unfinished()
            await self._commit(RunStatus.FAILED, message)
            raise StallError(message)
        self.emit(EventType.RUN_COMPLETED)
        await self._commit(RunStatus.COMPLETED)
        return self.result(RunStatus.COMPLETED)

    def result(self, status: RunStatus) -> RunResult:
        """The :class:`RunResult` of the run as it stands, with ``status``."""
        hedger = self.hedger
        return result_of(
            self.run_id, status, self.state, self._durations,
            stragglers=0 if hedger is None else hedger.stragglers,
            hedges=0 if hedger is None else hedger.hedges,
            hedges_refused=0 if hedger is None else hedger.refused,
            duration=time.monotonic() - self.started_at, parent_run_id=self.parent_run_id,
        )  # fmt: skip

    def _holds_slot(self, attempt: Attempt) -> bool:
        """Whether ``attempt`` is a unit's that holds a slot: a map's own outcome is not, nor a
        child run's attempt once it started."""
        return (attempt.item >= 0 or not self._map[attempt.index]) and not attempt.released


def _utc(at: float | None) -> str:
    """``at`` (seconds since the epoch) as a person reads it: ``2026-12-04 21:47:17.935 UTC``."""
    if at is None:
        return "none"
    moment = datetime.datetime.fromtimestamp(at, datetime.UTC)
    return moment.isoformat(sep=" ", timespec="milliseconds").replace("+00:00", " UTC")
