"""Engine: runs and resumes runs; owns the store, admission, event bus and leases.

>>> g = Graph("double")
>>> @g.task()
... async def double(x):
...     return 2 * x
>>> run(g, 21).results["double"]
42
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import functools
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from typing import Any

from .._codec import DEFAULT_CODEC, Codec
from .._errors import EncodeError, GraphError, GraphMismatch, LeaseHeld, NotResumable, TailraceError
from .._events import EventBus, EventType
from .._values import checked_cursor, checked_run_id
from ..executors import Executor
from ..executors._base import ExecutorTable
from ..graph import Graph, Topology, guess_reference
from ..stores import (
    TERMINAL_STATUSES,
    MemoryStore,
    ParkedRow,
    ParkedStatus,
    RunRecord,
    RunStatus,
    RunStore,
    StoredRun,
)
from ..tail import TailHooks
from ._admission import AdmissionPolicy, SlotQueue, resolve_policy
from ._children import (
    ChildClaims,
    Children,
    ChildRunner,
    ChildSubmit,
    QueuedRuns,
    awaited_ended,
    checked_deadline,
    decoded_outputs,
    wakes_here,
    with_questions,
)
from ._driving import Drivers
from ._instruments import Instrument, Instruments, RunCall
from ._lease import Lease, make_owner, mark_failed
from ._loop import RunLoop
from ._outcome import RunResult
from ._queued import (
    Queueing,
    cancel_run,
    cancel_unstarted,
    reopen_cancelled,
    store_needed,
    stored_result,
    submit_children,
    submit_run,
    to_apply,
    wait_for,
)
from ._queued import cancel_undriven as cancel_undriven_run
from ._restore import Graphs, late_inputs, restore_run
from ._state import RunState
from ._streams import MAX_STREAM_CHUNKS, READ_BATCH, Chunk, StreamHub, chunk_of, read_stream
from ._versions import (
    Compatibility,
    MigrationReport,
    check_stored,
    migrate_runs,
    move_leased,
    plan_fork,
    require_compatible,
    stored_shape,
)
from ._writer import RunWriter

logger = logging.getLogger("tailrace.children")


class Engine:
    """Runs graphs: concurrent, eager, optionally durable.

    ``capacity`` bounds handlers in flight across all runs of this engine and
    ``run_capacity`` within one run (None: unbounded; E3); ``admission``
    orders queued nodes (``"fifo"``, ``"priority"``, ``"lpt"`` or a policy
    object); ``store`` makes runs durable (None keeps them in memory only);
    ``bus`` receives events; ``codec`` encodes payloads for the store
    (default strict JSON); ``owner`` names this engine in leases; ``lease_ttl``
    is the lease lifetime in seconds, renewed at a third of it;
    ``straggler_factor`` flags attempts running past that many times their
    estimate (T3); ``tail`` supplies duration estimators and hedging (default:
    built when a node declares a cost or hedges, or admission is ``"lpt"``).

    ``durability`` says when a completion must be durable (with a store).
    ``"async"``, the default, pipelines commits: a successor may start while
    its upstream's completion is still being written, so after a crash both
    re-run (a committed visit never does; D1). ``"sync"`` starts a node's
    successors only once its completion is committed, so a step with side
    effects never runs on an upstream value that a crash could lose; the
    completions of one wake-up share one write (group commit). The default is
    ``"async"`` because it costs no latency per step and agent steps are
    mostly idempotent; choose ``"sync"`` for runs whose steps act on the
    world (LangGraph's ``durability="sync"``, DBOS's checkpoint-before-return).
    A run can override it: ``run(..., durability=...)``.

    ``executor`` is where attempts of nodes that name no executor run (None,
    the default, or a :class:`~tailrace.executors.LocalExecutor`: in this
    process); ``executors`` maps the names that nodes' ``executor=`` options
    use to executors, e.g. ``{"ray": RayExecutor()}``. A node naming an
    executor the engine does not have fails its run at the start, before
    anything is written (:class:`GraphError`). The engine never closes them:
    whoever made them does (see :mod:`tailrace.executors`).

    ``max_stream_chunks`` bounds the chunks one run may publish with
    ``current_node().stream`` (S1); the call past it raises
    :class:`~tailrace.StreamLimit`. Read a run's streams with :meth:`stream`.

    ``instruments`` hook tracing and live views into the engine
    (:class:`~tailrace.Instrument`: around each drive of a run and each
    attempt); add or remove them later through ``engine.instruments``.
    """

    def __init__(
        self,
        *,
        capacity: int | None = None,
        run_capacity: int | None = None,
        admission: str | AdmissionPolicy = "fifo",
        store: RunStore | None = None,
        bus: EventBus | None = None,
        codec: Codec | None = None,
        owner: str | None = None,
        lease_ttl: float = 30.0,
        straggler_factor: float = 3.0,
        tail: TailHooks | None = None,
        durability: str = "async",
        executor: Executor | None = None,
        executors: Mapping[str, Executor] | None = None,
        max_stream_chunks: int = MAX_STREAM_CHUNKS,
        instruments: Iterable[Instrument] = (),
    ) -> None:
        if not isinstance(max_stream_chunks, int) or max_stream_chunks < 1:
            raise ValueError(
                f"max_stream_chunks must be an integer >= 1, got {max_stream_chunks!r}"
            )
        if run_capacity is not None and run_capacity < 1:
            raise ValueError(f"run_capacity must be >= 1 or None, got {run_capacity}")
        if not 0 < lease_ttl < float("inf"):
            raise ValueError(f"lease_ttl must be a positive number of seconds, got {lease_ttl}")
        if straggler_factor <= 1.0:
            raise ValueError(f"straggler_factor must be > 1, got {straggler_factor}")
        self.durability = _checked_durability(durability)
        self.policy = resolve_policy(admission)
        self.slots = SlotQueue(capacity) if capacity is not None else None
        self.run_capacity = run_capacity
        self.store = store
        self.bus = bus if bus is not None else EventBus()
        self.codec = codec
        self.owner = owner or make_owner()
        self.lease_ttl = lease_ttl
        self.straggler_factor = straggler_factor
        self._tail = tail
        self._executors = ExecutorTable(executor, executors)
        self._graphs = Graphs()
        self.max_stream_chunks = max_stream_chunks
        #: In-process listeners of the chunks of the runs driven here (S3).
        self.stream_hub = StreamHub()
        #: Runs this engine drives now: one driver per run even within one owner (D6).
        self._drivers = Drivers(self.stream_hub)
        #: Free slots lent to the queued child runs this engine's runs submit, which then
        #: start here from the write that submits them (a Worker lends its own; R4).
        self.child_claims: ChildClaims | None = None
        #: Runs known to be on a queue: a child's end then wakes nothing here (R4).
        self._queued = QueuedRuns()
        #: Hooks for tracing and live views around each drive and attempt.
        self.instruments = Instruments(instruments)

    # -- driving runs: one path (_drive), through the instruments --------------

    async def run(
        self,
        graph: Graph,
        input: Any = None,
        *,
        run_id: str | None = None,
        graph_ref: str | None = None,
        durability: str | None = None,
        deadline: float | datetime.datetime | datetime.timedelta | None = None,
    ) -> RunResult:
        """Run ``graph`` on ``input`` and return its :class:`RunResult`.

        ``run_id`` names the run (default: a fresh uuid); ``graph_ref``
        (``module:attribute``) tells another process where to find the graph
        to resume it; ``durability`` overrides the engine's for this run
        (``"async"`` or ``"sync"``). A handler's exception is re-raised
        unwrapped (E9). ``deadline`` (seconds since the epoch, an aware
        ``datetime`` or a ``timedelta`` from now) cancels the run, with its
        child runs, if it has not finished by then; it is stored with the run
        and holds across resumes (R6).
        """
        run_id = uuid.uuid4().hex if run_id is None else run_id

        async def call() -> RunResult:
            checked = checked_run_id(run_id)
            when = checked_deadline(deadline)
            if durability is not None:
                self._drivers.durability[checked] = _checked_durability(durability)
            return await self._start(graph, input, checked, None, when, graph_ref)

        return await self.instruments.drive(RunCall(kind="run", run_id=run_id, graph=graph), call)

    async def _start(
        self,
        graph: Graph,
        input: Any,
        run_id: str,
        parent: str | None,
        deadline: float | None,
        graph_ref: str | None = None,
    ) -> RunResult:
        """Run a new run (a child of ``parent`` when given) to its end or suspension."""
        topo = graph.compile()
        self._executors.plan(topo)  # an unknown executor name fails here, before any write
        if self.store is None and any(n.queue is not None for n in topo.nodes):
            raise GraphError(
                f"graph {graph.name!r}: child runs on a queue (queue=) need an engine with a store"
            )
        self._graphs.add(graph, topo.fingerprint)
        begin = functools.partial(
            self._begin_new, graph, topo, input, run_id, graph_ref, parent, deadline
        )
        return await self._drive(run_id, graph, begin)

    async def _drive(
        self,
        run_id: str,
        graph: Graph | None,
        begin: Callable[[], Awaitable[RunResult | _AsStored]],
        *,
        force: bool = False,
        wake: bool = True,
    ) -> RunResult:
        """The one path every way of driving a run takes: ``begin()`` takes ``run_id`` to its end
        or suspension while this engine holds it (D6); answers that raced its suspension are
        applied (:meth:`_settle`); once let go of, the ancestors its end lets go on are resumed
        (``wake``)."""
        with self._drivers.driving(run_id):
            begun = await begin()
            if isinstance(begun, _AsStored):
                return begun.result
            result = await self._settle(begun, graph, force)
        if wake:
            await self._wake_ancestors(result)
        return result

    async def _begin_new(
        self,
        graph: Graph,
        topo: Topology,
        input: Any,
        run_id: str,
        graph_ref: str | None,
        parent: str | None,
        deadline: float | None,
    ) -> RunResult:
        state = RunState(topo)
        state.activate_entries(input)
        if self.store is None and topo.needs_ledger:
            self.store = MemoryStore()  # gates and parked items need a ledger; keep one here
            await self.store.open()
        if self.store is None:
            loop = self._loop_for(run_id, state, None, deadline=deadline, parent=parent)
            loop.emit(EventType.RUN_STARTED, graph=graph.name, owner=self.owner)
            return await loop.drive()
        writer = await RunWriter.create(
            self.store, self._codec, run_id, graph, topo, input,
            graph_ref or guess_reference(graph), parent=parent, deadline=deadline,
        )  # fmt: skip

        async def open_loop() -> RunLoop:
            loop = self._loop_for(run_id, state, writer, deadline=deadline, parent=parent)
            self._announce(loop, graph)
            return loop

        return await self._under_lease(writer, self._lease(run_id), open_loop)

    async def _under_lease(
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

    async def resume(
        self,
        run_id: str,
        graph: Graph | None = None,
        *,
        force: bool = False,
        patch: Any = None,
        durability: str | None = None,
        cancelled: bool = False,
    ) -> RunResult:
        """Resume the durable run ``run_id`` where it stopped (D3, Q3).

        Nodes that were running are re-run; completed results and first-k
        decisions are reused; answers that arrived for waiting gates are
        applied exactly once, and answers to questions no gate waits on any
        more are marked superseded. ``graph`` defaults to the one the run
        recorded (by ``module:attribute`` reference). A graph whose structural
        fingerprint differs is checked against what the run did (V1): a
        compatible one takes the run over (the move is recorded in the store,
        fenced by the lease), an incompatible one is refused with
        :class:`GraphMismatch` listing each node and why; ``force`` skips the
        check and the move. A preempted run continues from its parked turn
        boundaries, their values passed through ``patch`` (a mapping merged
        into dict values, or a function), e.g. to render a newer artifact. A
        suspended run with nothing new to do is returned as it is, without a
        write. The run keeps the durability it was started with (stored with
        its state) unless ``durability`` says otherwise; a run that committed
        nothing yet takes the engine's.

        A cancelled run is refused (:class:`NotResumable`) unless
        ``cancelled`` is true (W5): it then continues where it stopped, the
        nodes its cancellation stopped running again and everything it
        committed reused; a run cancelled before it started is refused still
        (submit it again).
        """

        async def begin() -> RunResult:
            if cancelled:
                await reopen_cancelled(
                    self._require_store("resume"), run_id, self.owner, self.lease_ttl
                )
            if durability is not None:
                self._drivers.durability[run_id] = durability
            return await self._resume(run_id, graph, force, patch)

        async def call() -> RunResult:
            nonlocal durability
            if durability is not None:
                durability = _checked_durability(durability)
            return await self._drive(run_id, graph, begin, force=force)

        return await self.instruments.drive(
            RunCall(kind="resume", run_id=run_id, graph=graph), call
        )

    async def _settle(self, result: RunResult, graph: Graph | None, force: bool) -> RunResult:
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
                    on_queue = await self._queued.on_queue(store, result.run_id)
                ended = not on_queue and await awaited_ended(store, result)
            if not pending - seen and not ended:
                return result
            seen |= pending
            try:
                result = await self._resume(result.run_id, graph, force, None)
            except LeaseHeld:
                return result  # its holder re-checks in turn
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
            if not await wakes_here(store, parent, self._queued, self.is_driving):
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
        begin = functools.partial(self._resume, run_id, None, False, None)
        return await self._drive(run_id, None, begin, wake=False)

    async def _resume(
        self,
        run_id: str,
        graph: Graph | None,
        force: bool,
        patch: Any,
        claimed: StoredRun | None = None,
    ) -> RunResult:
        """Resume ``run_id``; ``claimed``: as read under the lease a claim of this engine's
        owner took (not read again, nor leased again)."""
        store = self._require_store("resume")
        stored = await store.load_run(run_id) if claimed is None else claimed
        self._queued.note(stored.run)
        _check_resumable(stored.run)
        graph = self._graphs.of(stored.run, graph)
        topo = graph.compile()
        moving = topo.fingerprint != stored.run.fingerprint and not force
        if moving:  # V1: continue on a changed graph only if it fits what the run did
            known = self.graph_for(stored.run)
            require_compatible(await check_stored(store, stored, graph, known))
        self._executors.plan(topo)  # an unknown executor name fails here, before any write
        lease = self._lease(run_id)
        if claimed is not None:
            lease = lease.held(claimed.run)
        if not lease.continues_claim:  # D4: refuse unreadable rows before writing anything
            await restore_run(store, self._codec, topo, stored, [])
        writer = RunWriter(store, self._codec, run_id, topo, stored.run)

        async def reopen() -> RunLoop | RunResult:
            nonlocal stored
            if not lease.continues_claim:
                stored = await store.load_run(run_id)  # re-read under the lease
                _check_resumable(stored.run)
            if moving:  # re-checked as it stands under the lease, then moved (V2, D6)
                known = self.graph_for(stored.run)
                await move_leased(store, stored, graph, self.owner, writer.token, known)
            late = await late_inputs(store, self._codec, run_id)
            restored = await restore_run(store, self._codec, topo, stored, late)
            writer.refer(restored.big)
            if restored.durability is not None:
                self._drivers.durability.setdefault(run_id, restored.durability)
            loop = self._loop_for(
                run_id, restored.state, writer, restored.event_seq, restored.turn, record=stored.run
            )
            return await self._reopened(loop, restored.state, stored.run, graph, patch)

        return await self._under_lease(writer, lease, reopen)

    async def _reopened(
        self, loop: RunLoop, state: RunState, record: RunRecord, graph: Graph, patch: Any
    ) -> RunLoop | RunResult:
        """A resumed run's loop with its answers applied and its parked boundaries replayed,
        its resume announced; a suspended run with nothing new to do, as it is."""
        # S2: number after the stored rows; streams cut by a crash end discarded.
        loop.streams.reopen(await self._require_store("resume").stream_head(record.run_id))
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

    def register(self, *graphs: Graph) -> None:
        """Let this engine resume runs of ``graphs`` without importing them.

        A run is matched by its graph's name and structural fingerprint: two
        graphs of one shape with different names are different graphs. This is how a
        daemon is told about graphs defined in files: stored references are
        only ever imported as modules, never executed as files (trust model).
        Several versions of one graph (one name, several fingerprints) can be
        registered at once: each run continues on the version it is on (V3).
        """
        self._graphs.register(*graphs)  # with the graphs its nodes run as child runs (R1)

    # -- versions and forks (the work is done in _versions) ----------------------

    async def check(self, run_id: str, graph: Graph) -> Compatibility:
        """Whether the durable run ``run_id`` can continue on ``graph`` (V1); writes nothing (V2).

        Args:
            run_id: the run.
            graph: the changed graph (same name; usually a newer version).

        The report lists each node that ran or holds state and that ``graph``
        changed incompatibly, with the reason (``Compatibility.incompatible``).
        """
        store = self._require_store("check")
        stored = await store.load_run(run_id)
        return await check_stored(store, stored, graph, self.graph_for(stored.run))

    async def migrate(self, graph: Graph, *, apply: bool = False) -> MigrationReport:
        """Check every live (running or suspended) run of ``graph``'s name against its version (V2).

        Args:
            graph: the new version.
            apply: move each compatible run onto it (default: a dry run that
                writes nothing). A move leases the run and is fenced (D6): a run
                another engine drives is left alone (``held``).

        ``graph`` is registered with this engine, so it can drive the runs it moved.
        """
        store = self._require_store("migrate")
        self.register(graph)
        return await migrate_runs(
            store, graph, owner=self.owner, ttl=self.lease_ttl, apply=apply,
            known=self.graph_for, guard=self._drivers.driving,
        )  # fmt: skip

    async def fork(
        self,
        run_id: str,
        *,
        at: str,
        graph: Graph | None = None,
        input: Any = None,
        fork_id: str | None = None,
    ) -> RunResult:
        """Run a new run that reuses run ``run_id``'s committed results up to node ``at`` (V4).

        Args:
            run_id: the source run; it is only read, and may still be running.
            at: the node the fork runs again, with everything downstream of it.
            graph: the graph the fork runs (default: the source's version); a
                changed one is checked against the reused part (V1).
            input: the payload ``at`` runs with (None: the one its latest visit
                in the source ran with).
            fork_id: the fork's run id (default: a fresh uuid).

        Every node not downstream of ``at`` keeps its result, visits and
        first-k decisions; one that was running, waiting or failed runs
        again. The fork records its origin (``RunRecord.forked_from``,
        ``forked_at``) and is a run like any other (resumable, listed).
        """
        fork_id = uuid.uuid4().hex if fork_id is None else fork_id
        call = functools.partial(self._fork, run_id, at, graph, input, fork_id)
        return await self.instruments.drive(RunCall(kind="fork", run_id=fork_id, graph=graph), call)

    async def _fork(
        self, run_id: str, at: str, graph: Graph | None, input: Any, fork_id: str
    ) -> RunResult:
        store = self._require_store("fork")
        source = await store.load_run(checked_run_id(run_id))
        known = self.graph_for(source.run)
        forked = self._graphs.of(source.run, graph)
        old = await stored_shape(store, source.run, known)
        plan = await plan_fork(store, self._codec, source, forked, at, input, old)
        topo = forked.compile()
        self._executors.plan(topo)
        self._graphs.add(forked, topo.fingerprint)
        fork_id = checked_run_id(fork_id)
        ref = guess_reference(forked) or source.run.graph_ref

        async def open_loop(writer: RunWriter) -> RunLoop:
            writer.refer(plan.big)
            writer.carry(plan.results, plan.frozen, plan.items)
            loop = self._loop_for(fork_id, plan.state, writer)
            loop.emit(
                EventType.RUN_STARTED, graph=forked.name, forked_from=run_id, at=at,
                owner=self.owner,
            )  # fmt: skip
            await loop.checkpoint()  # the reused part is durable before anything runs
            return loop

        async def begin() -> RunResult:
            writer = await RunWriter.create(
                store, self._codec, fork_id, forked, topo, plan.input, ref, origin=(run_id, at)
            )
            opened = functools.partial(open_loop, writer)
            return await self._under_lease(writer, self._lease(fork_id), opened)

        return await self._drive(fork_id, forked, begin)

    async def fail_run(self, run_id: str, reason: str) -> None:
        """Record the durable run ``run_id`` as failed with ``reason``, without loading its graph.

        For a run that can never be resumed (its graph does not load any more,
        its stored rows do not decode): a daemon says so once, in the store,
        instead of retrying it. Its open questions are superseded. A run that
        already finished is left as it is; a live owner's lease is respected
        (:class:`LeaseHeld`).
        """
        store = self._require_store("fail_run")
        with self._drivers.driving(run_id):
            await mark_failed(store, run_id, self.owner, self.lease_ttl, reason)

    def is_driving(self, run_id: str) -> bool:
        """Whether this engine is running or resuming ``run_id`` right now."""
        return run_id in self._drivers

    def graph_for(self, record: RunRecord) -> Graph | None:
        """The graph this engine ran, submitted or was given for the stored run ``record``, if any.

        Matched by the run's graph name and fingerprint both.
        """
        return self._graphs.get(record)

    def knows_graph(self, fingerprint: str, name: str | None = None) -> bool:
        """Whether this engine has a graph with this structural ``fingerprint`` (so it can resume it).

        ``name``, when given, must be the graph's name too (a run is never
        driven by a graph of another name).
        """
        return self._graphs.knows(fingerprint, name)

    def preempt(self, run_id: str) -> bool:
        """Ask run ``run_id``, driven by this engine, to stop at its next turn boundaries.

        Attempts in flight finish; what they would feed back into a loop is
        parked, and the run is then stored ``suspended`` (``RunResult.preempted``)
        until :meth:`resume` replays it, possibly against newer inputs
        (partial rollouts). Returns False when this engine is not driving that
        run. Needs a store to resume from.
        """
        if self.store is None:
            raise NotResumable(f"run {run_id!r}: preempting needs a store to resume from")
        return self._drivers.preempt(run_id)

    def stream(self, run_id: str, *, after: int = 0) -> AsyncIterator[Chunk]:
        """The stream rows of run ``run_id`` with a cursor past ``after``, in order, until it ends (S3).

        Yields :class:`~tailrace.Chunk`: each chunk a handler published with
        ``current_node().stream``, tagged by node, visit, item, attempt and
        hedge, and each attempt's terminal mark (``accepted`` or
        ``discarded``, S2). Works from any process that opens the store:
        while this engine drives the run, chunks arrive as they are published
        (before they are durable); otherwise as they are committed, woken by
        the store's change feed. The iterator ends once the run is completed,
        failed or cancelled and every row it committed was yielded (a
        suspended run is waited on). A reader that stops can go on with
        ``after=`` the last ``seq`` it saw: no row is missed or repeated.

        Args:
            run_id: the run to read.
            after: the cursor: only rows with a larger ``seq`` (0: from the start).
        """
        return read_stream(
            self.store, self._codec, self.stream_hub, checked_run_id(run_id), checked_cursor(after)
        )

    def on_chunk(
        self, run_id: str, callback: Callable[[Chunk], object]
    ) -> contextlib.AbstractContextManager[None]:
        """Call ``callback(chunk)`` for each stream row of ``run_id`` this engine publishes
        while the ``with`` block runs: at once, inside the handler's ``stream`` call (S3).

        The in-process listener with no delay: it runs on the event loop's
        thread before the row is durable, so it must be quick and must not
        block (hand the chunk to a queue for slow work). A callback that raises
        is logged once and removed; the run goes on. Rows published by
        another process reach this one through :meth:`stream` only.

        Args:
            run_id: the run to listen to (driven by this engine now or later).
            callback: called with each :class:`~tailrace.Chunk` (chunks and marks).
        """
        return self.stream_hub.on_chunk(checked_run_id(run_id), callback)

    async def stored_chunks(
        self, run_id: str, *, after: int = 0, limit: int = READ_BATCH
    ) -> list[Chunk]:
        """The stream rows of ``run_id`` committed now past cursor ``after``, at most ``limit``.

        One read of the store, without waiting for more (:meth:`stream` follows the run).

        Args:
            run_id: the run to read.
            after: the cursor: only rows with a larger ``seq``.
            limit: at most this many rows.
        """
        store = self._require_store("read stored chunks")
        rows = await store.chunks(checked_run_id(run_id), after=after, limit=limit)
        return [chunk_of(run_id, row, self._codec) for row in rows]

    async def answer(
        self, question_id: str, value: Any, *, by: str | None = None, resume: bool = True
    ) -> RunResult | None:
        """Answer ``question_id`` with ``value``: first answer wins (Q2).

        ``by`` records who answered. A question that was answered before
        raises :class:`~tailrace.AlreadyAnswered` and changes nothing. With
        ``resume`` (the default) the run is then resumed here and its result
        returned; None when another engine holds the run (it, or a resume
        worker's sweep, applies the answer: Q3, Q4).
        """
        store = self._require_store("answer")
        try:
            text = self._codec.encode(value)
        except (TypeError, ValueError) as exc:
            raise EncodeError(f"question {question_id!r}: answer is not encodable: {exc}") from exc
        row = await store.answer(question_id, text, by=by)
        if not resume:
            return None
        try:
            return await self.resume(row.run_id)
        except (LeaseHeld, NotResumable):
            return None  # another engine holds the run, or already applied the answer

    # -- internals ------------------------------------------------------------

    @property
    def _codec(self) -> Codec:
        return self.codec or DEFAULT_CODEC

    def _lease(self, run_id: str) -> Lease:
        """The lease this engine holds run ``run_id`` by while it drives it (D6)."""
        assert self.store is not None
        return Lease(
            self.store,
            run_id,
            self.owner,
            self.lease_ttl,
            on_cancel_request=lambda: self.request_cancel(run_id),
        )

    # -- child runs (the work is done in _children) -------------------------------

    def _child_runner(self) -> ChildRunner:
        return ChildRunner(
            store=self.store,
            start=self._start,
            submit=self._submit_children,
            resume=self._resume_child,
            cancel=self.cancel,
            result=self._child_result,
            outputs=self._child_outputs,
        )

    async def _submit_children(self, children: list[ChildSubmit]) -> list[Exception | None]:
        return await submit_children(self._queueing("submit"), children, self.child_claims)

    async def _resume_child(self, run_id: str, graph: Graph) -> RunResult:
        self.register(graph)
        return await self.resume(run_id, graph)

    async def _child_result(self, record: RunRecord, graph: Graph) -> RunResult:
        self.register(graph)
        return await stored_result(self._queueing("read a child run"), record, graph)

    async def _child_outputs(self, run_ids: list[str]) -> dict[str, Any]:
        return await decoded_outputs(self._require_store("read child runs"), self._codec, run_ids)

    def _loop_for(
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
    ) -> RunLoop:
        if record is not None:  # a stored run: its deadline and parent are stored with it
            deadline, parent = record.deadline, record.parent_run_id
        loop = RunLoop(
            run_id=run_id,
            state=state,
            publish=self.bus.publish if self.bus.active else None,
            writer=writer,
            engine_slots=self.slots,
            run_capacity=self.run_capacity,
            policy=self.policy,
            tail=self._tail_for(state.topo),
            event_seq=event_seq,
            turn=turn,
            durability=self._drivers.durability.get(run_id, self.durability),
            executors=self.instruments.executors(self._executors).plan(state.topo),
            codec=self._codec,
            stream_hub=self.stream_hub,
            max_stream_chunks=self.max_stream_chunks,
            deadline=deadline,
            parent_run_id=parent,
        )
        if any(n.child for n in state.topo.nodes):
            loop.children = Children(
                self._child_runner(), run_id,
                queued=record is not None and record.queue_name is not None,
                deadline=deadline, poke=loop.poke,
            )  # fmt: skip
        self._drivers.attach(run_id, loop)
        return loop

    def _tail_for(self, topo: Topology) -> TailHooks | None:
        if self._tail is not None:
            return self._tail
        needs = self.policy.name == "lpt" or any(n.cost is not None or n.hedge for n in topo.nodes)
        if not needs:
            return None
        self._tail = TailHooks(factor=self.straggler_factor)
        return self._tail

    # -- parked items (P3, P4) ----------------------------------------------------

    async def parked(
        self, graph: Graph | str, node: str | None = None, *, every: bool = False
    ) -> list[ParkedRow]:
        """The items parked by ``late="park"`` for ``graph`` (a graph or its name) and ``node``
        (every node when None), oldest first (P4); ``every`` lists claimed and dropped ones too.

        Parked items never expire: each waits until a map with
        ``resume_parked=True`` claims it, or :meth:`drop_parked` drops it.
        """
        store = self._require_store("parked")
        name = graph.name if isinstance(graph, Graph) else graph
        status = None if every else ParkedStatus.PARKED
        return await store.list_parked(graph_name=name, node_id=node, status=status)

    async def drop_parked(self, park_id: str) -> bool:
        """Drop parked item ``park_id``: True if it was parked, False if it was claimed or
        dropped already (P4)."""
        return await self._require_store("drop_parked").drop_parked(park_id)

    def _queueing(self, what: str) -> Queueing:
        """What queued-run code needs from this engine (``what`` needs a store)."""
        return Queueing(
            store=store_needed(self.store, what), codec=self._codec, owner=self.owner,
            lease_ttl=self.lease_ttl, known=self.graph_for, register=self.register,
            guard=self._drivers.driving, request_cancel=self.request_cancel, cancel=self.cancel,
        )  # fmt: skip

    def _require_store(self, what: str) -> RunStore:
        if self.store is None:
            raise NotResumable(f"{what} needs a durable store: Engine(store=SQLiteStore(...))")
        return self.store

    # -- queued runs (the work is done in _queued) ------------------------------

    async def submit(
        self,
        graph: Graph | str,
        input: Any = None,
        *,
        queue: str = "default",
        run_id: str | None = None,
        priority: int = 0,
        partition: str | None = None,
        dedup_key: str | None = None,
        on_duplicate: str = "return",
        cost: float | None = None,
        estimate: float | None = None,
        graph_ref: str | None = None,
        not_before: float | datetime.datetime | None = None,
        deadline: float | datetime.datetime | datetime.timedelta | None = None,
    ) -> str:
        """Store a run of ``graph`` on ``input`` as ``queued`` in ``queue``; return its id at once.

        A :class:`~tailrace.Worker` serving the queue runs it (see
        ``docs/scale-out.md``); :meth:`wait` returns its result.

        Args:
            graph: the graph to run, or its name: the newest version a worker
                registered in the store (``Worker(graphs=...)`` registers
                them), so the submitter needs no graph code; workers find it
                by ``graph_ref`` or because they were given it.
            input: the run's input (encoded now: a bad one fails here).
            queue: the queue's name.
            run_id: names the run (default: a fresh uuid).
            priority: a ``priority`` queue hands out higher values first.
            partition: runs with the same key start one at a time, in submit order.
            dedup_key: while a run of this queue with this key is live
                (queued, running or suspended), submitting again stores
                nothing and returns that run's id, or raises
                :class:`~tailrace.workers.DuplicateRun` (``on_duplicate``).
            on_duplicate: ``"return"`` (the default) or ``"raise"``.
            cost: what the duration estimator takes (e.g. the input's size).
            estimate: the run's expected seconds, for ``lpt`` queues; default:
                the estimator fitted on this graph's completed queued runs
                (``seconds ~ b + m * cost``).
            graph_ref: ``module:attribute`` of the graph (default: guessed).
            not_before: the earliest time a worker may start it (W4): seconds
                since the epoch, or a timezone-aware ``datetime``; until then
                it waits ``queued`` and takes no turn of its partition.
            deadline: cancel the run, with its child runs, if it has not
                finished by then (R6): seconds since the epoch, an aware
                ``datetime``, or a ``timedelta`` from now; stored with the run.
        """
        return await submit_run(
            self._queueing("submit"), graph, input, queue=queue, run_id=run_id, priority=priority,
            partition=partition, dedup_key=dedup_key, on_duplicate=on_duplicate, cost=cost,
            estimate=estimate, graph_ref=graph_ref, not_before=not_before,
            deadline=checked_deadline(deadline),
        )  # fmt: skip

    async def wait(
        self,
        run_id: str,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 (the issue's API; DBOS's get_result too)
        graph: Graph | None = None,
    ) -> RunResult:
        """The :class:`RunResult` of run ``run_id`` from the store, once it finished or suspended.

        Whichever process ran it. A failed run raises
        :class:`~tailrace.workers.RunFailed` with the stored error and result.

        Args:
            run_id: the run to wait for.
            timeout: seconds to wait at most; then :class:`TimeoutError`.
            graph: the run's graph, to compute ``output`` (default: one this
                engine ran, submitted or was given, by fingerprint).
        """
        return await wait_for(self._queueing("wait"), run_id, timeout=timeout, graph=graph)

    async def cancel(self, run_id: str) -> str:
        """Cancel run ``run_id``; return its status now.

        A queued run is cancelled at once. A running one ends ``cancelled`` at
        its next harvest (in-flight handlers cancelled, nothing committed
        after), here if this engine drives it, else by its worker; one nobody
        drives (suspended, or its owner dead) is cancelled at once.

        Args:
            run_id: the run to cancel.
        """
        return await cancel_run(self._queueing("cancel"), run_id)

    def request_cancel(self, run_id: str) -> bool:
        """Ask run ``run_id``, if this engine drives it, to end cancelled at its next harvest.

        Returns False when this engine does not drive it (see :meth:`cancel`).

        Args:
            run_id: the run.
        """
        return self._drivers.request_cancel(run_id)

    async def start_claimed(
        self, run_id: str, graph: Graph | None = None, *, cancel_first: bool = False
    ) -> RunResult:
        """Drive a run this engine's owner claimed from a queue (``RUN_STARTED``), or resume it.

        The claim leased it to this engine's owner, so the lease (and its
        fencing token) is kept. A run that committed anything before (its
        first claimant died) is resumed instead (D3).

        Args:
            run_id: the claimed run.
            graph: its graph (default: registered, or imported by reference).
            cancel_first: a run whose cancel was requested before this call is
                cancelled without being driven (no ``RUN_STARTED``), and its
                stored result returned; else it starts and hears the request
                at once (W5).
        """

        async def call() -> RunResult:
            store = self._require_store("start a claimed run")
            await self._drivers.let_go(run_id, self.lease_ttl)
            begin = functools.partial(self._begin_claimed, store, run_id, graph, cancel_first)
            return await self._drive(run_id, graph, begin)

        return await self.instruments.drive(RunCall(kind="start", run_id=run_id, graph=graph), call)

    async def _begin_claimed(
        self, store: RunStore, run_id: str, graph: Graph | None, cancel_first: bool
    ) -> RunResult | _AsStored:
        stored = await store.load_run(run_id)
        self._queued.note(stored.run)
        if cancel_first and stored.run.cancel_requested_at is not None:
            queueing = self._queueing("start a claimed run")
            await cancel_unstarted(queueing, run_id)
            return _AsStored(await stored_result(queueing, await store.get_run(run_id), graph))
        if stored.nodes or stored.run.status is not RunStatus.RUNNING:
            # It committed before (a parent woken by its children, or its first
            # claimant died): resumed under this claim's lease, as read (D3).
            return await self._resume(run_id, graph, False, None, claimed=stored)
        found = self._graphs.of(stored.run, graph)
        topo = found.compile()
        if topo.fingerprint != stored.run.fingerprint:
            raise GraphMismatch(
                f"run {run_id!r} was submitted with graph fingerprint "
                f"{stored.run.fingerprint}, but {found.name!r} now has {topo.fingerprint}"
            )
        self._executors.plan(topo)
        writer = RunWriter(store, self._codec, run_id, topo, stored.run)

        async def open_loop() -> RunLoop:
            restored = await restore_run(store, self._codec, topo, stored, [])
            writer.refer(restored.big)
            loop = self._loop_for(
                run_id, restored.state, writer, restored.event_seq, restored.turn,
                record=stored.run,
            )  # fmt: skip
            if stored.run.cancel_requested_at is not None:
                loop.request_cancel()  # asked between the claim and this start
            self._announce(loop, found)
            return loop

        return await self._under_lease(writer, self._lease(run_id).held(stored.run), open_loop)


async def cancel_undriven(engine: Engine, run_id: str) -> RunStatus:
    """End ``run_id``, which nobody drives, as ``cancelled`` under its lease; return its status.

    :func:`~._queued.cancel_undriven` with ``engine``'s store, lease settings and guard.
    """
    return await cancel_undriven_run(engine._queueing("cancel"), run_id)


@dataclasses.dataclass(frozen=True, slots=True)
class _AsStored:
    """A run's result as stored, nothing driven: returned as it is (nothing settled or woken)."""

    result: RunResult


def _checked_durability(durability: Any) -> str:
    if durability not in ("async", "sync"):
        raise ValueError(f"durability must be 'async' or 'sync', got {durability!r}")
    return str(durability)


def _check_resumable(record: RunRecord) -> None:
    """Refuse, before anything runs, a run that resuming cannot continue (W5)."""
    if record.status in (RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED):
        raise NotResumable(f"run {record.run_id!r} is {record.status}; nothing to resume")
    if record.status is RunStatus.QUEUED:
        raise NotResumable(
            f"run {record.run_id!r} is queued: a worker serving queue "
            f"{record.queue_name!r} starts it (tailrace worker --queue ...); it cannot be resumed"
        )


def run(graph: Graph, input: Any = None, **engine_options: Any) -> RunResult:
    """Run ``graph`` on ``input`` synchronously with ``Engine(**engine_options)``.

    A convenience for scripts; inside async code, use ``await Engine().run(...)``.
    """
    return asyncio.run(Engine(**engine_options).run(graph, input))
