"""Opening a run's loop, for each way an engine takes a run up (D3, D6, V1, V4, W1).

An engine drives a run four ways: it starts a new one, resumes a stored one,
forks one, or starts one its owner claimed from a queue. Each way reads what
it must, takes the run's lease and makes the run's :class:`RunLoop`; the
loop then drives under that lease. :class:`RunOpener` holds what that needs
from its engine as values (store, codec, owner, lease settings, admission,
executors, the graphs it knows) and callbacks (who runs child runs, who
cancels a run asked from elsewhere); it never receives the engine. After a
drive it settles a suspended run (answers and child ends that raced its
suspension, Q3 and R4).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from .._codec import Codec
from .._errors import GraphError, GraphMismatch, LeaseHeld, NotResumable, TailraceError
from .._events import EventBus, EventType
from .._lineage import own_run_id
from .._values import checked_run_id
from ..executors._base import ExecutorTable
from ..executors._threads import HandlerThreads
from ..graph import Graph, Topology, guess_reference
from ..stores import (
    TERMINAL_STATUSES,
    MemoryStore,
    RunRecord,
    RunStatus,
    RunStore,
    StoredRun,
    StreamHead,
)
from ..tail import TailHooks
from ._admission import AdmissionPolicy, SlotQueue
from ._children import (
    Children,
    ChildRunner,
    QueuedRuns,
    awaited_ended,
    wakes_here,
    with_questions,
)
from ._driving import Drivers
from ._instruments import Instruments, RunCall
from ._lease import Lease
from ._loop import LoopSettings, RunLoop
from ._outcome import RunResult
from ._queued import Queueing, cancel_unstarted, stored_result, to_apply
from ._restore import Graphs, late_inputs, restore_run
from ._state import RunState
from ._streams import StreamHub
from ._versions import check_stored, move_leased, plan_fork, require_compatible, stored_shape
from ._writer import RunWriter

logger = logging.getLogger("tailrace.children")


@dataclasses.dataclass(frozen=True, slots=True)
class _Version:
    """The graph a stored run is driven on, compiled, and whether resuming moves the run onto
    it (its fingerprint is not the one the run is recorded on, and the move is not forced off)."""

    graph: Graph
    topo: Topology
    moving: bool


@dataclasses.dataclass(frozen=True, slots=True)
class AsStored:
    """A run's result as stored, nothing driven: returned as it is (nothing settled or woken)."""

    result: RunResult


class RunOpener:
    """Opens and drives the loops of the runs one engine drives, under their leases.

    ``threads`` is the engine's pool for ``def`` handlers, which every loop
    made here runs them on. ``store`` may be None (runs in memory only) until a graph that needs a
    ledger (gates, parked items) makes one here. ``tail`` is built when a
    graph first needs estimates (a cost, a hedge, lpt admission).
    ``child_runner()`` lends a loop the engine's way to run child runs;
    ``queueing(what)`` is what queued-run code needs (``what`` needs a store).
    """

    def __init__(
        self,
        *,
        store: RunStore | None,
        codec: Codec,
        owner: str,
        lease_ttl: float,
        durability: str,
        bus: EventBus,
        slots: SlotQueue | None,
        run_capacity: int | None,
        policy: AdmissionPolicy,
        tail: TailHooks | None,
        straggler_factor: float,
        executors: ExecutorTable,
        threads: HandlerThreads,
        instruments: Instruments,
        graphs: Graphs,
        drivers: Drivers,
        queued: QueuedRuns,
        stream_hub: StreamHub,
        max_stream_chunks: int,
        child_runner: Callable[[], ChildRunner],
        queueing: Callable[[str], Queueing],
    ) -> None:
        self.store = store
        self.codec = codec
        self.owner = owner
        self.lease_ttl = lease_ttl
        self.durability = durability
        self.bus = bus
        self.slots = slots
        self.run_capacity = run_capacity
        self.policy = policy
        self.tail = tail
        self.straggler_factor = straggler_factor
        self.executors = executors
        self.threads = threads
        self.instruments = instruments
        self.graphs = graphs
        self.drivers = drivers
        self.queued = queued
        self.stream_hub = stream_hub
        self.max_stream_chunks = max_stream_chunks
        self._child_runner = child_runner
        self._queueing = queueing
        #: What every loop made here shares.
        self.loop_settings = LoopSettings(
            engine_slots=slots, run_capacity=run_capacity, policy=policy, codec=codec,
            stream_hub=stream_hub, max_stream_chunks=max_stream_chunks,
        )  # fmt: skip

    def require_store(self, what: str) -> RunStore:
        """The store, or :class:`NotResumable` saying that ``what`` needs one."""
        if self.store is None:
            raise NotResumable(f"{what} needs a durable store: Engine(store=SQLiteStore(...))")
        return self.store

    # -- the one drive path ------------------------------------------------------------

    async def start(
        self,
        graph: Graph,
        input: Any,
        run_id: str,
        parent: str | None,
        deadline: float | None,
        graph_ref: str | None = None,
        queue: str | None = None,
    ) -> RunResult:
        """Run a new run (a child of ``parent`` when given; on ``queue`` when given: an inline
        child of a run on a queue, R4) to its end or suspension."""
        topo = graph.compile()
        self.executors.plan(topo)  # an unknown executor name fails here, before any write
        if self.store is None and any(n.queue is not None for n in topo.nodes):
            raise GraphError(
                f"graph {graph.name!r}: child runs on a queue (queue=) need an engine with a store"
            )
        self.graphs.add(graph, topo.fingerprint)
        begin = functools.partial(
            self.begin_new, graph, topo, input, run_id, graph_ref, parent, deadline, queue
        )
        return await self.drive(run_id, graph, begin)

    async def start_child(
        self,
        graph: Graph,
        input: Any,
        run_id: str,
        parent: str,
        deadline: float | None,
        queue: str | None,
    ) -> RunResult:
        """Run a new inline child run of ``parent`` here (R1), on ``queue`` when its parent's
        drive suspends on children (R4): see :meth:`start`."""
        return await self.start(graph, input, run_id, parent, deadline, queue=queue)

    async def drive(
        self,
        run_id: str,
        graph: Graph | None,
        begin: Callable[[], Awaitable[RunResult | AsStored]],
        *,
        force: bool = False,
        wake: bool = True,
    ) -> RunResult:
        """The one path every way of driving a run takes: ``begin()`` takes ``run_id`` to its end
        or suspension while this engine holds it (D6); answers that raced its suspension are
        applied (:meth:`RunOpener.settle`); once let go of, the ancestors its end lets go on are resumed
        (``wake``)."""
        with self.drivers.driving(run_id):
            begun = await begin()
            if isinstance(begun, AsStored):
                return begun.result
            result = await self.settle(begun, graph, force)
        if wake:
            await self._wake_ancestors(result)
        return result

    async def _wake_ancestors(self, result: RunResult) -> None:
        """Resume here, one after another up the tree, each suspended ancestor that the end of
        ``result``'s run lets go on (R4): a loop over what to wake, each resumed on its own.

        A run on a queue is left to the store (its child's final commit queued
        it again); one driven here already takes up its child itself.
        """
        store = self.store
        while store is not None and result.status in TERMINAL_STATUSES and result.parent_run_id:
            parent = result.parent_run_id
            if not await wakes_here(store, parent, self.queued, self.drivers.drives):
                return
            try:
                result = await self.instruments.drive(
                    RunCall(kind="resume", run_id=parent),
                    functools.partial(self._resume_woken, parent),
                )
            except (LeaseHeld, NotResumable):
                return  # another engine has it, or it moved on
            except TailraceError as exc:  # its graph is not at hand here: `tailrace resume` it
                logger.warning(
                    "run %s: its child ended, but it cannot be resumed here: %s", parent, exc
                )
                return

    async def _resume_woken(self, run_id: str) -> RunResult:
        begin = functools.partial(self.resume, run_id, None, False, None)
        return await self.drive(run_id, None, begin, wake=False)

    async def fork(
        self, run_id: str, at: str, graph: Graph | None, input: Any, fork_id: str
    ) -> RunResult:
        store = self.require_store("fork")
        fork_id = own_run_id(fork_id)
        # One moment of the source, which may run on: nothing it commits later is copied.
        snapshot = await store.snapshot(checked_run_id(run_id))
        record = snapshot.stored.run
        forked = self.graphs.of(record, graph, fork_at=at)
        old = await stored_shape(store, record, self.graphs.get(record))
        plan = await plan_fork(store, self.codec, snapshot, forked, at, input, old, fork_id)
        topo = forked.compile()
        self.executors.plan(topo)
        self.graphs.add(forked, topo.fingerprint)
        ref = guess_reference(forked) or record.graph_ref

        async def open_loop(writer: RunWriter) -> RunLoop:
            writer.refer(plan.big)
            writer.carry(plan.results, plan.frozen, plan.items, plan.chunks)
            loop = self.loop_for(fork_id, plan.state, writer)
            # The carried stream rows come first: the fork's own are numbered after them,
            # and a reader here waits for their commit instead of for the fork's first chunk.
            loop.streams.reopen(StreamHead(last_seq=len(plan.chunks)))
            self.stream_hub.note(fork_id, len(plan.chunks))
            loop.emit(
                EventType.RUN_STARTED, graph=forked.name, forked_from=run_id, at=at,
                owner=self.owner,
            )  # fmt: skip
            await loop.checkpoint()  # the reused part is durable before anything runs
            return loop

        async def begin() -> RunResult:
            writer = await RunWriter.create(
                store, self.codec, fork_id, forked, topo, plan.input, ref, origin=(run_id, at)
            )
            opened = functools.partial(open_loop, writer)
            return await self.under_lease(writer, self.lease(fork_id), opened)

        return await self.drive(fork_id, forked, begin)

    # -- a new run ------------------------------------------------------------------

    async def begin_new(
        self,
        graph: Graph,
        topo: Topology,
        input: Any,
        run_id: str,
        graph_ref: str | None,
        parent: str | None,
        deadline: float | None,
        queue: str | None = None,
    ) -> RunResult:
        """Store and drive a new run of ``graph`` on ``input`` (in memory with no store)."""
        state = RunState(topo)
        state.activate_entries(input)
        if self.store is None and topo.needs_ledger:
            self.store = MemoryStore()  # gates and parked items need a ledger; keep one here
            await self.store.open()
        if self.store is None:
            loop = self.loop_for(run_id, state, None, deadline=deadline, parent=parent)
            loop.emit(EventType.RUN_STARTED, graph=graph.name, owner=self.owner)
            return await loop.drive()
        writer = await RunWriter.create(
            self.store, self.codec, run_id, graph, topo, input,
            graph_ref or guess_reference(graph), parent=parent, deadline=deadline, queue=queue,
        )  # fmt: skip

        async def open_loop() -> RunLoop:
            loop = self.loop_for(
                run_id, state, writer, deadline=deadline, parent=parent, queue=queue
            )
            self._announce(loop, graph)
            return loop

        return await self.under_lease(writer, self.lease(run_id), open_loop)

    async def under_lease(
        self,
        writer: RunWriter,
        lease: Lease,
        open_loop: Callable[[], Awaitable[RunLoop | RunResult]],
    ) -> RunResult:
        """Drive, holding ``lease``, the loop ``open_loop()`` makes (a result: nothing to drive);
        attach the open questions of a run that suspended."""
        async with writer.leased(lease):
            opened = await open_loop()
            result = opened if isinstance(opened, RunResult) else await opened.drive()
        return await with_questions(self.store, result)

    def _announce(self, loop: RunLoop, graph: Graph) -> None:
        """A new run starts: its ``run_started`` event, with the graph's structure."""
        loop.emit(
            EventType.RUN_STARTED, graph=graph.name, structure=graph.structure(), owner=self.owner
        )

    # -- a stored run ------------------------------------------------------------------

    async def resume(
        self,
        run_id: str,
        graph: Graph | None,
        force: bool,
        patch: Any,
        claimed: StoredRun | None = None,
        *,
        moves: bool = True,
    ) -> RunResult:
        """Resume ``run_id``; ``claimed``: as read under the lease a claim of this engine's
        owner took (not read again, nor leased again).

        The version is picked from the read made under the lease: a run continues on the
        version it is recorded on then (V3), or moves onto ``graph`` if that fits (V1). With
        ``moves`` false, ``graph`` is only the one to drive the run on while it is on that
        version: a drive's own continuation never moves a run back from where a migration put it.
        """
        store = self.require_store("resume")
        stored = await store.load_run(run_id) if claimed is None else claimed
        self.queued.note(stored.run)
        check_resumable(stored.run)
        version = self._version(stored.run, graph, force, moves)
        if version.moving:  # V1: refused before any write unless it fits what the run did
            known = self.graphs.get(stored.run)
            require_compatible(await check_stored(store, stored, version.graph, known))
        lease = self.lease(run_id)
        if claimed is not None:
            lease = lease.held(claimed.run)
        if not lease.continues_claim:  # D4: refuse unreadable rows before writing anything
            await restore_run(store, self.codec, version.topo, stored, [])
        writer = RunWriter(store, self.codec, run_id, version.topo, stored.run)

        async def reopen() -> RunLoop | RunResult:
            nonlocal stored, version
            if not lease.continues_claim:
                stored = await store.load_run(run_id)  # re-read under the lease
                check_resumable(stored.run)
                # Picked again from this read: a migration may have moved the run meanwhile.
                version = self._version(stored.run, graph, force, moves)
                writer.reread(version.topo, stored.run)
            if version.moving:  # re-checked as it stands under the lease, then moved (V2, D6)
                known = self.graphs.get(stored.run)
                await move_leased(store, stored, version.graph, self.owner, writer.token, known)
            late = await late_inputs(store, self.codec, run_id)
            restored = await restore_run(store, self.codec, version.topo, stored, late)
            writer.refer(restored.big)
            if restored.durability is not None:
                self.drivers.durability.setdefault(run_id, restored.durability)
            loop = self.loop_for(
                run_id, restored.state, writer, restored.event_seq, restored.turn, record=stored.run
            )
            return await self._reopened(loop, restored.state, stored.run, version.graph, patch)

        return await self.under_lease(writer, lease, reopen)

    def _version(
        self, record: RunRecord, graph: Graph | None, force: bool, moves: bool
    ) -> _Version:
        """The graph to drive the stored run ``record`` on, and whether resuming moves it (V1, V3)."""
        kept = moves or force or graph is None or graph.compile().fingerprint == record.fingerprint
        if not kept:
            graph = None  # the run was moved off this graph: it goes on on the version it is on
        found = self.graphs.of(record, graph)
        topo = found.compile()
        self.executors.plan(topo)  # an unknown executor name fails here, before any write
        return _Version(found, topo, topo.fingerprint != record.fingerprint and not force)

    async def _reopened(
        self, loop: RunLoop, state: RunState, record: RunRecord, graph: Graph, patch: Any
    ) -> RunLoop | RunResult:
        """A resumed run's loop with its answers applied and its parked boundaries replayed,
        its resume announced; a suspended run with nothing new to do, as it is."""
        # S2: number after the stored rows; streams cut by a crash end discarded.
        loop.streams.reopen(await self.require_store("resume").stream_head(record.run_id))
        if record.cancel_requested_at is not None:
            loop.request_cancel()  # asked before this engine took the run over
        applied = await loop.absorb_answers()
        unparked = state.unpark(patch)
        if record.status is RunStatus.SUSPENDED and not applied and not state.ready:
            return loop.result(RunStatus.SUSPENDED)
        loop.emit(
            EventType.RUN_RESUMED, graph=graph.name, applied=applied, unparked=unparked,
            owner=self.owner,
        )  # fmt: skip
        if applied or unparked or record.status is RunStatus.SUSPENDED:
            # The apply is durable before any handler runs; a suspended run is
            # running again before its children's results move it on (R4).
            await loop.checkpoint()
        return loop

    async def settle(self, result: RunResult, graph: Graph | None, force: bool) -> RunResult:
        """Before letting go of a suspended run, apply answers that lost the race for its lease
        (Q3), and take up children that ended meanwhile (R4).

        An answerer records its answer before it tries the lease; if it found the
        lease held, the answer landed before this engine released it, so it is
        visible now. A run on a queue needs nothing more: its suspension's
        commit counted the children that had ended and let go of the lease, so
        the store queues it when enough have. Another run whose child ended
        while it was suspending (the child found its lease held) is resumed here.
        """
        store = self.store
        seen: set[str] = set()
        on_queue: bool | None = None
        while result.status is RunStatus.SUSPENDED and store is not None:
            questions = await store.list_questions(run_id=result.run_id)
            pending = {q.question_id for q in questions if to_apply(q)}
            ended = False
            if result.waiting_on:
                if on_queue is None:
                    on_queue = await self.queued.on_queue(store, result.run_id)
                ended = not on_queue and await awaited_ended(store, result)
            if not pending - seen and not ended:
                return result
            seen |= pending
            try:
                result = await self.resume(result.run_id, graph, force, None, moves=False)
            except LeaseHeld:
                return result  # its holder re-checks in turn
        return result

    # -- a claimed run ------------------------------------------------------------------

    async def begin_claimed(
        self, run_id: str, graph: Graph | None, cancel_first: bool
    ) -> RunResult | AsStored:
        """Start the run this engine's owner claimed, under the claim's lease, or resume it."""
        store = self.require_store("start a claimed run")
        stored = await store.load_run(run_id)
        self.queued.note(stored.run)
        if cancel_first and stored.run.cancel_requested_at is not None:
            queueing = self._queueing("start a claimed run")
            await cancel_unstarted(queueing, run_id)
            return AsStored(await stored_result(queueing, await store.get_run(run_id), graph))
        if stored.nodes or stored.run.status is not RunStatus.RUNNING:
            # It committed before (a parent woken by its children, or its first
            # claimant died): resumed under this claim's lease, as read (D3).
            return await self.resume(run_id, graph, False, None, claimed=stored)
        found = self.graphs.of(stored.run, graph)
        topo = found.compile()
        if topo.fingerprint != stored.run.fingerprint:
            raise GraphMismatch(
                f"run {run_id!r} was submitted with graph fingerprint "
                f"{stored.run.fingerprint}, but {found.name!r} now has {topo.fingerprint}"
            )
        self.executors.plan(topo)
        writer = RunWriter(store, self.codec, run_id, topo, stored.run)

        async def open_loop() -> RunLoop:
            restored = await restore_run(store, self.codec, topo, stored, [])
            writer.refer(restored.big)
            loop = self.loop_for(
                run_id, restored.state, writer, restored.event_seq, restored.turn,
                record=stored.run,
            )  # fmt: skip
            if stored.run.cancel_requested_at is not None:
                loop.request_cancel()  # asked between the claim and this start
            self._announce(loop, found)
            return loop

        return await self.under_lease(writer, self.lease(run_id).held(stored.run), open_loop)

    # -- leases and loops ------------------------------------------------------------------

    def lease(self, run_id: str) -> Lease:
        """The lease this engine holds run ``run_id`` by while it drives it (D6)."""
        assert self.store is not None
        drivers = self.drivers
        return Lease(
            self.store,
            run_id,
            self.owner,
            self.lease_ttl,
            on_cancel_request=lambda: drivers.request_cancel(run_id),
        )

    def loop_for(
        self,
        run_id: str,
        state: RunState,
        writer: RunWriter | None,
        event_seq: int = 0,
        turn: int = 0,
        *,
        record: RunRecord | None = None,
        deadline: float | None = None,
        parent: str | None = None,
        queue: str | None = None,
    ) -> RunLoop:
        """The loop that drives ``run_id`` from ``state`` (``record``: the stored run's)."""
        if record is not None:  # a stored run: its deadline, parent and queue are stored with it
            deadline, parent, queue = record.deadline, record.parent_run_id, record.queue_name
        loop = RunLoop(
            run_id=run_id,
            state=state,
            publish=self.bus.publish if self.bus.active else None,
            writer=writer,
            settings=self.loop_settings,
            tail=self._tail_for(state.topo),
            event_seq=event_seq,
            turn=turn,
            durability=self.drivers.durability.get(run_id, self.durability),
            executors=self.instruments.executors(self.executors).plan(state.topo),
            deadline=deadline,
            parent_run_id=parent,
        )
        loop.runner.threads = self.threads
        if any(n.child for n in state.topo.nodes):
            loop.runner.children = Children(
                self._child_runner(), run_id, queue=queue, deadline=deadline, poke=loop.poke
            )
        self.drivers.attach(run_id, loop)
        return loop

    def _tail_for(self, topo: Topology) -> TailHooks | None:
        if self.tail is not None:
            return self.tail
        needs = self.policy.name == "lpt" or any(n.cost is not None or n.hedge for n in topo.nodes)
        if not needs:
            return None
        self.tail = TailHooks(factor=self.straggler_factor)
        return self.tail


def check_resumable(record: RunRecord) -> None:
    """Refuse, before anything runs, a run that resuming cannot continue (W5)."""
    if record.status in (RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED):
        raise NotResumable(f"run {record.run_id!r} is {record.status}; nothing to resume")
    if record.status is RunStatus.QUEUED:
        raise NotResumable(
            f"run {record.run_id!r} is queued: a worker serving queue "
            f"{record.queue_name!r} starts it (tailrace worker --queue ...); it cannot be resumed"
        )
