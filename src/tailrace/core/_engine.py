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
import datetime
import functools
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import Any

from .._codec import DEFAULT_CODEC, Codec
from .._errors import EncodeError, LeaseHeld, NotResumable
from .._events import EventBus
from .._lineage import own_run_id
from .._values import checked_cursor, checked_run_id
from ..executors import Executor
from ..executors._base import ExecutorTable
from ..executors._threads import HandlerThreads
from ..graph import Graph
from ..stores import (
    ParkedRow,
    ParkedStatus,
    RunRecord,
    RunStatus,
    RunStore,
)
from ..tail import TailHooks
from ._admission import AdmissionPolicy, SlotQueue, resolve_policy
from ._children import (
    ChildClaims,
    ChildRunner,
    ChildSubmit,
    QueuedRuns,
    checked_deadline,
    decoded_outputs,
)
from ._driving import Drivers
from ._instruments import Instrument, Instruments, RunCall
from ._lease import make_owner, mark_failed
from ._opening import RunOpener
from ._outcome import RunResult
from ._queued import (
    Queueing,
    cancel_run,
    reopen_cancelled,
    store_needed,
    stored_result,
    submit_children,
    submit_run,
    wait_for,
)
from ._queued import cancel_undriven as cancel_undriven_run
from ._restore import Graphs
from ._streams import MAX_STREAM_CHUNKS, READ_BATCH, Chunk, StreamHub, chunk_of, read_stream
from ._versions import (
    Compatibility,
    MigrationReport,
    check_stored,
    migrate_runs,
)


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

    ``handler_threads`` sizes the engine's own thread pool for ``def``
    handlers (default: ``capacity`` plus 32), made when the first one runs.
    A ``def`` handler cannot be interrupted: when its attempt is cut (a late
    item cancelled, a timeout, a hedge that lost, a cancelled run) its
    result, checkpoints and chunks are dropped, but its thread stays busy
    until the function returns; the threads beyond ``capacity`` absorb such
    handlers so that they do not delay other runs' handlers.

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
        handler_threads: int | None = None,
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
        self.bus = bus if bus is not None else EventBus()
        self.codec = codec
        self.owner = owner or make_owner()
        self.lease_ttl = lease_ttl
        self.straggler_factor = straggler_factor
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
        #: Opens and drives the loops of the runs driven here, under their leases.
        self._opener = RunOpener(
            store=store, codec=self._codec, owner=self.owner, lease_ttl=lease_ttl,
            durability=self.durability, bus=self.bus, slots=self.slots,
            run_capacity=run_capacity, policy=self.policy, tail=tail,
            straggler_factor=straggler_factor, executors=self._executors,
            threads=HandlerThreads.for_capacity(capacity, handler_threads),
            instruments=self.instruments, graphs=self._graphs, drivers=self._drivers,
            queued=self._queued, stream_hub=self.stream_hub,
            max_stream_chunks=max_stream_chunks, child_runner=self._child_runner,
            queueing=self._queueing,
        )  # fmt: skip

    @property
    def store(self) -> RunStore | None:
        """The store that makes runs durable (None: in memory only, until a graph with gates
        or parked items needs a ledger and gets one in memory)."""
        return self._opener.store

    @store.setter
    def store(self, store: RunStore | None) -> None:
        self._opener.store = store

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

        ``run_id`` names the run (default: a fresh uuid; an id that ends as a child
        run's does, ``/node/1``, is kept for child runs and refused); ``graph_ref``
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
            checked = own_run_id(run_id)
            when = checked_deadline(deadline, time.time if self.store is None else self.store.clock)
            if durability is not None:
                self._drivers.durability[checked] = _checked_durability(durability)
            return await self._opener.start(graph, input, checked, None, when, graph_ref)

        return await self.instruments.drive(RunCall(kind="run", run_id=run_id, graph=graph), call)

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
        more are marked superseded. ``graph`` defaults to the version the run
        is recorded on as read under its lease (a registered graph of that
        version, else its ``module:attribute`` reference). A graph whose structural
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
                    self._opener.require_store("resume"), run_id, self.owner, self.lease_ttl
                )
            if durability is not None:
                self._drivers.durability[run_id] = durability
            return await self._opener.resume(run_id, graph, force, patch)

        async def call() -> RunResult:
            nonlocal durability
            if durability is not None:
                durability = _checked_durability(durability)
            return await self._opener.drive(run_id, graph, begin, force=force)

        return await self.instruments.drive(
            RunCall(kind="resume", run_id=run_id, graph=graph), call
        )

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
        store = self._opener.require_store("check")
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
        store = self._opener.require_store("migrate")
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
            fork_id: the fork's run id (default: a fresh uuid; one shaped like a child
                run's id is refused, as by :meth:`run`).

        Every node not downstream of ``at`` keeps its result, visits and
        first-k decisions; one that was running, waiting or failed runs
        again. The fork records its origin (``RunRecord.forked_from``,
        ``forked_at``) and is a run like any other (resumable, listed).
        """
        fork_id = uuid.uuid4().hex if fork_id is None else fork_id
        call = functools.partial(self._opener.fork, run_id, at, graph, input, fork_id)
        return await self.instruments.drive(RunCall(kind="fork", run_id=fork_id, graph=graph), call)

    async def fail_run(self, run_id: str, reason: str) -> None:
        """Record the durable run ``run_id`` as failed with ``reason``, without loading its graph.

        For a run that can never be resumed (its graph does not load any more,
        its stored rows do not decode): a daemon says so once, in the store,
        instead of retrying it. Its open questions are superseded. A run that
        already finished is left as it is; a live owner's lease is respected
        (:class:`LeaseHeld`).
        """
        store = self._opener.require_store("fail_run")
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
        store = self._opener.require_store("read stored chunks")
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
        store = self._opener.require_store("answer")
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

    # -- child runs (the work is done in _children) -------------------------------

    def _child_runner(self) -> ChildRunner:
        return ChildRunner(
            store=self.store,
            start=self._opener.start_child,
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
        return await decoded_outputs(
            self._opener.require_store("read child runs"), self._codec, run_ids
        )

    # -- parked items (P3, P4) ----------------------------------------------------

    async def parked(
        self, graph: Graph | str, node: str | None = None, *, every: bool = False
    ) -> list[ParkedRow]:
        """The items parked by ``late="park"`` for ``graph`` (a graph or its name) and ``node``
        (every node when None), oldest first (P4); ``every`` lists claimed and dropped ones too.

        Parked items never expire: each waits until a map with
        ``resume_parked=True`` claims it, or :meth:`drop_parked` drops it.
        """
        store = self._opener.require_store("parked")
        name = graph.name if isinstance(graph, Graph) else graph
        status = None if every else ParkedStatus.PARKED
        return await store.list_parked(graph_name=name, node_id=node, status=status)

    async def drop_parked(self, park_id: str) -> bool:
        """Drop parked item ``park_id``: True if it was parked, False if it was claimed or
        dropped already (P4)."""
        return await self._opener.require_store("drop_parked").drop_parked(park_id)

    def _queueing(self, what: str) -> Queueing:
        """What queued-run code needs from this engine (``what`` needs a store)."""
        return Queueing(
            store=store_needed(self.store, what), codec=self._codec, owner=self.owner,
            lease_ttl=self.lease_ttl, known=self.graph_for, register=self.register,
            guard=self._drivers.driving, request_cancel=self.request_cancel, cancel=self.cancel,
        )  # fmt: skip

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
            run_id: names the run (default: a fresh uuid; one shaped like a child run's
                id is refused, as by :meth:`run`).
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
        queueing = self._queueing("submit")
        return await submit_run(
            queueing, graph, input, queue=queue, run_id=run_id, priority=priority,
            partition=partition, dedup_key=dedup_key, on_duplicate=on_duplicate, cost=cost,
            estimate=estimate, graph_ref=graph_ref, not_before=not_before,
            deadline=checked_deadline(deadline, queueing.store.clock),
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
            self._opener.require_store("start a claimed run")
            await self._drivers.let_go(run_id, self.lease_ttl)
            begin = functools.partial(self._opener.begin_claimed, run_id, graph, cancel_first)
            return await self._opener.drive(run_id, graph, begin)

        return await self.instruments.drive(RunCall(kind="start", run_id=run_id, graph=graph), call)


async def cancel_undriven(engine: Engine, run_id: str) -> RunStatus:
    """End ``run_id``, which nobody drives, as ``cancelled`` under its lease; return its status.

    :func:`~._queued.cancel_undriven` with ``engine``'s store, lease settings and guard.
    """
    return await cancel_undriven_run(engine._queueing("cancel"), run_id)


def _checked_durability(durability: Any) -> str:
    if durability not in ("async", "sync"):
        raise ValueError(f"durability must be 'async' or 'sync', got {durability!r}")
    return str(durability)


def run(graph: Graph, input: Any = None, **engine_options: Any) -> RunResult:
    """Run ``graph`` on ``input`` synchronously with ``Engine(**engine_options)``.

    A convenience for scripts; inside async code, use ``await Engine().run(...)``.
    """
    return asyncio.run(Engine(**engine_options).run(graph, input))
