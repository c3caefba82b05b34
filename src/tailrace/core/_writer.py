"""RunWriter: one run's writes to the store: encoding, the group window, pipelined fenced commits.

The engine side of the store seam (D1-D6). Each harvest becomes one
:class:`~tailrace.stores.Harvest`. Commits are *pipelined*: the run loop goes
on while the store writes, but every harvest of a run is handed to the store
in order, so a node's completion is never committed after one that depends on
it (D2); ``flush`` waits for all of them before the run returns. A handler may
therefore start before its upstream's completion is durable; after a crash
both are simply re-run, and no completion that was committed ever runs again
(D1, D3).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

from .._codec import Codec, JsonCodec
from .._errors import EncodeError
from .._events import EventType
from ..graph import Graph, Topology, shape_json
from ..stores import (
    FORMAT_VERSION,
    TERMINAL_STATUSES,
    CheckpointRow,
    ChunkRow,
    EventRow,
    FrozenInput,
    Harvest,
    ItemRow,
    NewRun,
    NodeRow,
    ParkedRow,
    QuestionRow,
    QuestionStatus,
    ResultRow,
    RunRecord,
    RunStatus,
    RunStore,
)
from ._checkpoints import Checkpoints
from ._inflight import BULK, paused_gc
from ._lease import Lease, run_to_end
from ._outbox import EventTuple
from ._state import MapItems, NodeState, RunState
from ._streams import Streams

logger = logging.getLogger("tailrace.persist")

#: Seconds the run loop lets running harvests gather before it stages them as
#: one (a final status, a failure, a cancellation or a "sync" step stages at once). Built
#: once per window, a node that starts and completes within it costs one row and
#: a harvest costs a flag check; larger writes also mean fewer hand-overs of the
#: GIL between the loop and the writer thread. "async" durability promises no
#: bound on this lag anyway.
GROUP_WINDOW = 0.005

#: How many harvests of one run may wait for the store before the loop waits too.
MAX_QUEUED = 256

#: Encoded results at least this long are stored once, in their result row;
#: node rows refer to them (a 50 MB result is not written three times).
REF_MIN_CHARS = 1024


@dataclasses.dataclass(slots=True, kw_only=True)
class Stage:
    """What a run loop hands its writer at a stage: the harvests since the last one (D1).

    The writer reads the state's dirty rows and first-k decisions, takes the
    checkpoints and stream chunks saved since, and writes them with
    ``events`` and the ledger rows in one transaction; ``status`` and
    ``error`` are the run's after it. A suspension on child runs carries the
    completions it waits for (``wake_after``) and the children awaited
    (``waiting_on``, R4); ``output`` gives a completing run's output.
    """

    state: RunState
    status: RunStatus
    error: str | None
    events: list[EventTuple]
    event_seq: int
    turn: int
    checkpoints: Checkpoints
    streams: Streams
    applied: list[str]
    superseded: list[str]
    parked: list[ParkedRow]
    unclaimed: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    wake_after: int | None = None
    waiting_on: tuple[str, ...] = ()
    output: Callable[[], Any]


class RunWriter:
    """Writes one run's harvests to ``store`` under its lease, encoded with ``codec``.

    ``topo`` is the run's compiled graph and ``record`` its stored run.
    """

    def __init__(
        self, store: RunStore, codec: Codec, run_id: str, topo: Topology, record: RunRecord
    ) -> None:
        self.store = store
        self.codec = codec
        self.run_id = run_id
        self.topo = topo
        self.record = record
        self.token = 0
        self._results: list[ResultRow] = []
        self._encoded: dict[int, str] = {}
        self._questions: list[QuestionRow] = []
        #: First-k decisions and map items copied from a fork's source run, for the next commit.
        self._carried: list[FrozenInput] = []
        self._carried_items: list[ItemRow] = []
        #: Stream rows copied from a fork's source run, for the next commit.
        self._carried_chunks: list[ChunkRow] = []
        self._queued: list[_Pending] = []
        #: Harvests staged since the last write began (the store's backlog).
        self._staged = 0
        self._writer: asyncio.Future[None] | None = None
        #: The group window's timer while running harvests gather (see :meth:`defer`).
        self._window: asyncio.TimerHandle | None = None
        #: Set when the window ended: the next harvest is staged.
        self._window_ended = False
        #: The write in flight that wakes the loop when it ends (stream rows wait for it).
        self._hurry_on: asyncio.Future[None] | None = None
        #: The lease the writes are fenced by (see :meth:`leased`).
        self.lease: Lease | None = None
        #: The first write that failed; nothing after it is written (D2).
        self.failure: BaseException | None = None
        #: Called once when a write fails, so the run loop wakes at once.
        self.on_failure: Callable[[], None] | None = None
        #: node index -> (visit, value) of its latest large result, stored once.
        self._big: dict[int, tuple[int, Any]] = {}
        #: node index -> (value, its JSON) of its latest small result, so node rows
        #: reuse the text instead of encoding the value again.
        self._texts: dict[int, tuple[Any, str]] = {}
        #: The run's input and its JSON, for the entry nodes' rows.
        self._input: tuple[Any, str] | None = None
        #: The run's durability mode, stored with its state so a resume keeps it
        #: (set by the run loop).
        self.durability = "async"
        #: Scalars read back from strict JSON as they went in: no decode needed.
        self._plain = isinstance(self.codec, JsonCodec)

    # -- creation -----------------------------------------------------------

    @classmethod
    async def create(
        cls,
        store: RunStore,
        codec: Codec,
        run_id: str,
        graph: Graph,
        topo: Topology,
        input: Any,
        graph_ref: str | None,
        origin: tuple[str, str] | None = None,
        *,
        parent: str | None = None,
        deadline: float | None = None,
        queue: str | None = None,
    ) -> RunWriter:
        """Store a new run (its input encoded, D5) and return its writer.

        ``origin`` is a fork's (source run id, node it re-runs from), stored
        with the run (V4); ``parent`` the run it is a child run of (R1);
        ``deadline`` when it is cancelled if unfinished (R6); ``queue`` the
        queue an inline child of a run on a queue is on (R4).
        """
        try:
            input_json = codec.encode(input)
        except (TypeError, ValueError) as exc:
            raise EncodeError(f"run {run_id!r}: input is not encodable: {exc}") from exc
        now = store.clock()  # orphan sweeps judge a fresh run by it
        new = NewRun(
            run_id=run_id,
            graph_name=graph.name,
            graph_ref=graph_ref,
            fingerprint=topo.fingerprint,
            input_json=input_json,
            created_at=now,
            shape_json=shape_json(graph),
            forked_from=None if origin is None else origin[0],
            forked_at=None if origin is None else origin[1],
            parent_run_id=parent,
            deadline=deadline,
            queue_name=queue,
        )
        await store.create_run(new)
        writer = cls(store, codec, run_id, topo, await store.get_run(run_id))
        writer._input = (input, input_json)
        return writer

    def carry(
        self,
        results: Sequence[ResultRow],
        frozen: Sequence[FrozenInput],
        items: Sequence[ItemRow] = (),
        chunks: Sequence[ChunkRow] = (),
    ) -> None:
        """Write ``results``, ``frozen`` decisions, map ``items`` and stream ``chunks``, copied
        from the run a fork reuses, with the next commit (V4): stored as they were, not
        encoded again. ``chunks`` are numbered already, before any row the run publishes."""
        self._results.extend(results)
        self._carried.extend(frozen)
        self._carried_items.extend(items)
        self._carried_chunks.extend(chunks)

    def reread(self, topo: Topology, record: RunRecord) -> None:
        """Write for the run as read again under the lease, before anything was written here:
        on ``topo``, the graph of the version that read records (a migration may have moved
        the run since this writer was made)."""
        assert self._writer is None and not self._queued, "reread after a write"
        self.topo, self.record = topo, record

    def refer(self, big: dict[int, tuple[int, Any]]) -> None:
        """Take the large results a restore read back (:func:`~._restore.restore_run`), so
        node rows keep referring to their stored copy instead of repeating them."""
        self._big.update(big)

    # -- lease ----------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def leased(self, lease: Lease) -> AsyncIterator[None]:
        """Hold ``lease`` (D6) while the body writes; flush commits on success.

        The way out always runs to its end, shielded from cancellation: what was
        harvested is written before the lease is released, even when the caller
        is cancelled (a ``wait_for`` around ``engine.run``), then the
        cancellation goes on (or becomes :class:`~tailrace.LeaseLost`).
        """
        async with lease:
            self.lease = lease
            self.token = lease.token
            try:
                yield
                await self.flush()
            finally:
                await run_to_end(self._let_go())

    async def _let_go(self) -> None:
        self._close_window()
        await self._drain_quietly()

    # -- per harvest ----------------------------------------------------------

    def canonical(self, node_id: str, visit: int, result: Any) -> Any:
        """Encode ``result`` now (a bad one fails its node before any commit, D5) and
        return it as it reads back, so a run sees the same values whether or not it
        was resumed in between (JSON has no tuples and only string keys)."""
        value, text = self._canonical(result, f"node {node_id!r} (visit {visit})")
        self._encoded[self.topo.index[node_id]] = text
        return value

    def canonical_item(self, node_id: str, visit: int, item: int, result: Any) -> tuple[Any, str]:
        """Like :meth:`canonical`, for item ``item`` of a map's visit: (value, its JSON)."""
        return self._canonical(result, f"map {node_id!r} (visit {visit}, item {item})")

    def _canonical(self, result: Any, what: str) -> tuple[Any, str]:
        try:
            if self._plain and type(result) in _SCALARS:
                return result, _scalar_json(self.codec, result)
            text = self.codec.encode(result)
            return self.codec.decode(text), text
        except (TypeError, ValueError, RecursionError) as exc:
            raise EncodeError(
                f"run {self.run_id!r}: result of {what} cannot be encoded: {exc}"
            ) from exc

    async def unapplied_answers(self) -> list[tuple[str, Any]]:
        """(question id, decoded answer) of this run's answers not yet applied, oldest first."""
        rows = await self.store.list_questions(run_id=self.run_id)
        rows.sort(key=lambda r: (r.answered_at or 0.0, r.question_id))
        return [
            (r.question_id, self.codec.decode(r.answer_json))
            for r in rows
            if r.answer_json is not None
            and (
                r.status is QuestionStatus.ANSWERED
                or (r.status is QuestionStatus.EXPIRED and r.applied_at is None)
            )
        ]

    def question_opened(
        self,
        *,
        question_id: str,
        node_id: str,
        visit: int,
        turn: int,
        prompt: Any,
        poller: str | None,
        deadline: float | None,
    ) -> None:
        """Queue a new open question (its prompt already checked encodable) for the next commit."""
        text = self._encoded.pop(self.topo.index[node_id], None) or self.codec.encode(prompt)
        self._questions.append(
            QuestionRow(
                question_id=question_id,
                run_id=self.run_id,
                node_id=node_id,
                visit=visit,
                turn=turn,
                prompt_json=text,
                poller=poller,
                deadline=deadline,
                created_at=time.time(),
            )
        )

    def result_completed(self, i: int, visit: int, result: Any, *, text: str | None = None) -> None:
        """Queue the result row of node ``i``'s ``visit`` for the next commit (``text``: its
        JSON when the caller has it, as a map has from its items' texts)."""
        if text is None:
            text = self._encoded.pop(i, None)
        if text is None:
            text = self.codec.encode(result)
        if len(text) >= REF_MIN_CHARS:
            self._big[i] = (visit, result)
            self._texts.pop(i, None)
        else:
            self._big.pop(i, None)
            self._texts[i] = (result, text)
        self._results.append(_make_result_row(self.topo.ids[i], visit, text))

    def defer(self, wake: Callable[[], None], *, hurry: bool = False) -> bool:
        """Whether a running harvest may wait for the group window instead of being staged now.

        The first harvest after a stage opens the window; when it ends (after
        :data:`GROUP_WINDOW`) ``wake`` (the run loop's poke) brings the loop
        back to stage everything gathered meanwhile in one go, at a harvest
        boundary like any stage.

        ``hurry``: stream rows wait for this stage (readers in other processes
        see them once committed). They go at once when no write is in flight;
        otherwise they gather until the write in flight ends, and ``wake``
        brings the loop back then (or at the window's end, if sooner): a
        commit starts as soon as the store is free, never later.
        """
        if self._window_ended:
            return False
        if hurry:
            writer = self._writer
            if writer is None or writer.done():
                return False
            if self._hurry_on is not writer:  # one wake-up per write in flight
                self._hurry_on = writer
                writer.add_done_callback(lambda _write: wake())
        if self._window is None:
            self._window = asyncio.get_running_loop().call_later(
                GROUP_WINDOW, self._end_window, wake
            )
        return True

    def _end_window(self, wake: Callable[[], None]) -> None:
        self._window_ended = True
        wake()

    def _close_window(self) -> None:
        if self._window is not None:
            self._window.cancel()
            self._window = None
        self._window_ended = False

    def stage(self, stage: Stage) -> bool:
        """Queue one ``stage`` of harvests for the store; True if the caller must flush.

        One write per run is in flight at a time; harvests produced meanwhile
        are merged, in order, into the next write (run-level group commit). The
        caller flushes on a final ``status``, or when the store falls behind.
        """
        self.raise_failure()
        self._close_window()
        queued = self._queued
        run_status = stage.status
        if not queued or queued[-1].status is not run_status:
            queued.append(_Pending(run_status))  # a status change is its own write
        if run_status is RunStatus.SUSPENDED:
            queued[-1].wake_after = stage.wake_after
            queued[-1].waiting_on = stage.waiting_on
        if len(stage.state.dirty) + len(stage.events) < BULK:
            self._add_harvest(queued[-1], stage)
        else:
            with paused_gc():  # thousands of rows at once (see paused_gc)
                self._add_harvest(queued[-1], stage)
        self._staged += 1
        if self._writer is None or self._writer.done():
            self._writer = asyncio.ensure_future(self._drain())
        return run_status is not RunStatus.RUNNING or self._staged > MAX_QUEUED

    async def _drain(self) -> None:
        try:
            while self._queued:
                # Harvests staged while a write is in flight join the next one.
                batch, self._queued = self._queued, []
                self._staged = 0
                for pending in batch:
                    if self.lease is not None and self.lease.released:
                        # A suspension's commit let go of the run (R4): what a driver
                        # stopped meanwhile staged on its way out is not its to write.
                        self._queued = []
                        return
                    if len(pending.nodes) + len(pending.events) + len(pending.items) < BULK:
                        harvest = pending.harvest(self.topo.ids)
                    else:
                        with paused_gc():
                            harvest = pending.harvest(self.topo.ids)
                    lease = self.lease
                    # A suspension on children releases the lease in its commit (R4),
                    # as does the run's end (RunStore.commit): nothing to release after.
                    lets_go = harvest.waiting_on or harvest.status in TERMINAL_STATUSES
                    with (
                        lease.letting_go()
                        if lets_go and lease is not None
                        else contextlib.nullcontext()
                    ):
                        cancel = await self.store.commit(self.run_id, self.token, harvest)
                    if cancel and self.lease is not None:
                        self.lease.cancel_requested()  # asked from elsewhere: end at the next harvest
        except Exception as exc:
            # Nothing harvested after a failed write may be written (D2); the run
            # loop is woken to stop dispatching, cancel its attempts and re-raise.
            self._queued = []
            if self.failure is None:
                self.failure = exc
                if self.on_failure is not None:
                    self.on_failure()

    def writable(self) -> bool:
        """Whether writes may still go out: none failed and the lease is held (not lost, not
        let go by a suspension's commit)."""
        lease = self.lease
        return self.failure is None and (
            lease is None or (lease.lost is None and not lease.released)
        )

    def raise_failure(self) -> None:
        """Raise the lease loss or the store failure that stopped this run's writes, if any."""
        if self.lease is not None and self.lease.lost is not None:
            raise self.lease.lost
        if self.failure is not None:
            raise self.failure

    async def flush(self) -> None:
        """Wait until every harvest so far is committed; raise the first failure."""
        while self._writer is not None:
            writer = self._writer
            # Shielded: cancelling the run must not cut a write in half (a driver
            # cancelled mid-query can leave its connection stuck); the way out
            # waits for it instead.
            await asyncio.shield(writer)
            if self._writer is writer:
                if not self._queued:
                    self._writer = None
                else:
                    self._writer = asyncio.ensure_future(self._drain())
        self.raise_failure()

    async def _drain_quietly(self) -> None:
        """On the way out (a stop, an error): write what was harvested, ignoring failures.

        Harvests are whole, so writing them is always consistent; a fenced-out
        owner's writes are refused by the store anyway (D6).
        """
        with contextlib.suppress(Exception):
            await self.flush()
        writer, self._writer = self._writer, None
        self._queued = []
        if writer is not None:
            await asyncio.gather(writer, return_exceptions=True)

    def _add_harvest(self, pending: _Pending, stage: Stage) -> None:
        """Fold one stage into the write being gathered: rows as they stand now (D1, D2)."""
        state = stage.state
        events = stage.events
        ids = self.topo.ids
        # Encoded first, folded in after: a value that fails to encode leaves the
        # write being gathered as it was (harvests are whole, D1).
        dirty = state.take_dirty()
        rows = [self._node_row(i, state.nodes[i]) for i in dirty]
        frozen = []
        if state.frozen:
            frozen = [
                FrozenInput(
                    node_id=ids[t],
                    activation=activation,
                    payload_json=self._encode(payload, t, "first-k payload"),
                )
                for t, activation, payload, _sources in state.frozen
            ]
            state.frozen.clear()
        items: list[tuple[tuple[str, int, int], ItemRow]] = []
        if state.dirty_items:
            for visit_items in state.take_dirty_items():
                items.extend(self._item_rows(visit_items))
        nodes = pending.nodes
        for i, row in zip(dirty, rows, strict=True):
            nodes[i] = row  # the latest row of a node wins
        if self._carried_items:  # before this harvest's own rows, which win
            pending.items.update(((r.node_id, r.visit, r.item), r) for r in self._carried_items)
            self._carried_items = []
        pending.items.update(items)  # and of an item
        if stage.checkpoints.pending:  # and the latest checkpoint of a visit (P1)
            for cp in stage.checkpoints.take_pending():
                pending.checkpoints[(cp.node_id, cp.visit, cp.item)] = cp
        if self._carried:
            pending.frozen.extend(self._carried)
            self._carried = []
        pending.frozen.extend(frozen)
        if self._results:
            pending.results.extend(self._results)
            self._results = []
        if self._questions:
            pending.questions.extend(self._questions)
            self._questions = []
        if stage.applied:
            pending.applied.extend(stage.applied)
        if stage.superseded:
            pending.superseded.extend(stage.superseded)
        if stage.parked:
            pending.parked.extend(stage.parked)
        if stage.unclaimed:
            pending.unclaimed.extend(stage.unclaimed)
        if events:
            ids, data_json, new = self.topo.ids, self._event_data_json, tuple.__new__
            pending.events += [  # the most numerous rows: built inline, as named tuples
                new(
                    EventRow,
                    (
                        seq,
                        type._value_,
                        None if node is None else ids[node],
                        visit,
                        attempt,
                        ts,
                        data_json(type, data) if data else "{}",
                    ),
                )
                for seq, type, node, visit, attempt, ts, data in events
            ]
        if self._carried_chunks:  # numbered before the run's own rows
            pending.chunks += self._carried_chunks
            self._carried_chunks = []
        if stage.streams.seq:  # the run streams: its rows go with this harvest (S3)
            pending.chunks += stage.streams.take()
        pending.error = stage.error
        if not state.parked and not state.edge_gen:  # the common case: three counters
            pending.state = (state.seq, stage.event_seq, stage.turn, self.durability)
        else:
            pending.state = self._state_json(stage)
        status = pending.status
        if status is not RunStatus.RUNNING and status is not RunStatus.SUSPENDED:
            pending.finished_at = time.time()
        if status is RunStatus.COMPLETED and self.record.parent_run_id is not None:
            pending.output_json = self._output_json(stage)

    def _output_json(self, stage: Stage) -> str | None:
        """A completing child run's output, encoded for its parent (R1); None if it does not
        encode (its parent then reads it off the node rows, and the error there)."""
        try:
            return self.codec.encode(stage.output())
        except (TypeError, ValueError, RecursionError):
            return None

    def _event_data_json(self, type: EventType, data: Mapping[str, Any]) -> str:
        if type is EventType.NODE_COMPLETED and len(data) == 2:
            # The most common event, written by hand (engine data: a float and a bool).
            duration, hedge = data["duration"], data["hedge"]
            return f'{{"duration":{duration!r},"hedge":{"true" if hedge else "false"}}}'
        if len(data) <= 3 and "item" in data:  # a map item's start or end, by hand too
            if type is EventType.NODE_STARTED and len(data) == 1:
                return f'{{"item":{data["item"]:d}}}'
            if type is EventType.NODE_COMPLETED and len(data) == 3:
                duration, hedge, item = data["duration"], data["hedge"], data["item"]
                hedged = "true" if hedge else "false"
                return f'{{"duration":{duration!r},"hedge":{hedged},"item":{item:d}}}'
        return self.codec.encode(data if isinstance(data, dict) else dict(data))

    def _state_json(self, stage: Stage) -> str:
        """The run's own counters; written by hand in the common case (no loops, nothing parked)."""
        state = stage.state
        if not state.parked and not state.edge_gen:
            return state_text(state.seq, stage.event_seq, stage.turn, self.durability)
        ids = self.topo.ids
        return self.codec.encode(
            {
                "v": FORMAT_VERSION,
                "seq": state.seq,
                "events": stage.event_seq,
                "turn": stage.turn,
                "durability": self.durability,
                "parked": [
                    [ids[src], ids[dst], value, _pairs(f, ids)]
                    for src, dst, value, f in state.parked
                ],
                "edge_gen": [[ids[s], ids[t], g] for (s, t), g in state.edge_gen.items()],
            }
        )

    def _encode(self, value: Any, i: int, what: str) -> str:
        try:
            return self.codec.encode(value)
        except (TypeError, ValueError) as exc:
            raise EncodeError(
                f"run {self.run_id!r}: {what} of node {self.topo.ids[i]!r} cannot be encoded: {exc}"
            ) from exc

    def _item_rows(self, items: MapItems) -> list[tuple[tuple[str, int, int], ItemRow]]:
        """The stored rows of the items of ``items`` changed since the last write (M6)."""
        node_id = self.topo.ids[items.node]
        visit = items.visit
        rows = []
        for j in items.dirty:
            status = items.status[j]
            text = items.texts[j] if status.value in _RESULT_ITEMS else None
            row = _new_tuple(
                ItemRow,
                (
                    node_id,
                    visit,
                    j,
                    status.value,
                    items.seq[j],
                    items.attempts[j],
                    text,
                    items.errors.get(j),
                    items.retry_due.get(j),
                ),
            )
            rows.append(((node_id, visit, j), row))
        items.dirty.clear()
        return rows

    def _node_row(self, i: int, ns: NodeState) -> NodeRow | PlainRow:
        if (
            ns.frontier is None
            and ns.inputs is None
            and ns.pending is None
            and ns.question is None
            and ns.retry_due is None
            and ns.items is None
        ):
            row = self._plain_row(i, ns)
            if row is not None:
                return row
        ids = self.topo.ids
        data: dict[str, Any] = {
            "v": NODE_ROW_VERSION,
            "fired": ns.fired,
            "visits": ns.visits,
            "attempts": ns.attempts,
            "payload": ns.payload,
            "result": ns.result,
            "has_result": ns.has_result,
            "frontier": _pairs(ns.frontier, ids),
            "inputs": (
                None
                if ns.inputs is None
                else [
                    self._input_entry(s, seq, value, f) for s, (seq, value, f) in ns.inputs.items()
                ]
            ),
            "pending": (
                None if ns.pending is None else [ns.pending[0], _pairs(ns.pending[1], ids)]
            ),
            "question": ns.question,
        }
        if ns.retry_due is not None:
            data["retry_due"] = ns.retry_due
        if ns.items is not None:  # a map's k and, once decided, its winners (M3)
            items = ns.items
            winners = None if items.winners is None else list(items.winners)
            data["map"] = {"count": len(items), "k": items.k, "winners": winners}
            if items.parked:  # the parked items it took first (P4)
                data["map"]["parked"] = items.parked
        self._refer_big_values(i, ns, data)
        return NodeRow(
            node_id=ids[i],
            status=ns.status.value,
            visits=ns.visits,
            data_json=self._encode(data, i, "state"),
        )

    def _plain_row(self, i: int, ns: NodeState) -> PlainRow | None:
        """The row of a node outside loops and merges, from texts already encoded.

        The same JSON :meth:`_node_row` writes, from the texts its payload and
        result were stored with; None when a text is not at hand. It is kept as
        a snapshot and composed only if it is still the node's latest row when
        the write goes out (a node that starts and completes within one write
        costs one row, not two).
        """
        payload = self._known_text(i, ns.payload)
        if payload is None:
            return None
        if ns.has_result:
            entry = self._texts.get(i)
            if entry is None or entry[0] is not ns.result:
                return None
            result, has_result = entry[1], "true"
        elif ns.result is None:
            result, has_result = "null", "false"
        else:
            return None
        return (ns.status._value_, ns.fired, ns.visits, ns.attempts, payload, result, has_result)

    def _known_text(self, i: int, payload: Any) -> str | None:
        """The JSON of node ``i``'s payload when it is the run input or an input's result."""
        if payload is None:
            return "null"
        if self._input is not None and payload is self._input[0]:
            return self._input[1]
        sources = self.topo.in_sources[i]
        if len(sources) > 8:  # an aggregate's payload is a new list anyway
            return None
        texts = self._texts
        for s in sources:
            entry = texts.get(s)
            if entry is not None and entry[0] is payload:
                return entry[1]
        return None

    def _big_ref(self, source: int, value: Any) -> int | None:
        """The visit whose stored result ``value`` is, when it is a large one."""
        big = self._big.get(source)
        return big[0] if big is not None and big[1] is value else None

    def _input_entry(
        self, s: int, seq: int, value: Any, frontier: dict[int, int] | None
    ) -> list[Any]:
        ids = self.topo.ids
        visit = self._big_ref(s, value)
        if visit is None:
            return [ids[s], seq, value, _pairs(frontier, ids)]
        return [ids[s], seq, None, _pairs(frontier, ids), visit]

    def _refer_big_values(self, i: int, ns: NodeState, data: dict[str, Any]) -> None:
        """Point at result rows instead of repeating large values in node rows."""
        if ns.has_result:
            visit = self._big_ref(i, ns.result)
            if visit is not None:
                data["result"] = None
                data["result_ref"] = visit
        if ns.payload is None:
            return
        for s in self.topo.in_sources[i]:
            visit = self._big_ref(s, ns.payload)
            if visit is not None:
                data["payload"] = None
                data["payload_ref"] = [self.topo.ids[s], visit]
                return


# -- rows: the stored form of a run's state, built cheaply --------------------

#: Version of the node rows' ``data_json``. Version 2 may refer to a result row
#: instead of repeating a large value (``result_ref``, ``payload_ref``).
NODE_ROW_VERSION = 2


def _pairs(frontier: dict[int, int] | None, ids: tuple[str, ...]) -> list[list[Any]] | None:
    return None if frontier is None else [[ids[k], v] for k, v in sorted(frontier.items())]


def _unpairs(pairs: list[list[Any]] | None, index: dict[str, int]) -> dict[int, int] | None:
    return None if pairs is None else {index[k]: int(v) for k, v in pairs}


#: Item statuses whose stored row carries the item's result.
_RESULT_ITEMS = frozenset({"completed", "late"})

#: Types whose values strict JSON reads back unchanged (exact types: no subclasses).
_SCALARS = frozenset({type(None), bool, int, float, str})


def _scalar_json(codec: Codec, value: Any) -> str:
    """JSON of a scalar, as :class:`JsonCodec` writes it (floats must be finite)."""
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if type(value) is int:
        return int.__repr__(value)
    return codec.encode(value)  # str and float: the encoder's checks (surrogates, NaN)


_new_tuple = tuple.__new__


def _make_node_row(node_id: str, status: str, visits: int, data_json: str) -> NodeRow:
    # Rows are named tuples: built with tuple.__new__, not their keyword __new__.
    return _new_tuple(NodeRow, (node_id, status, visits, data_json))


def _make_result_row(node_id: str, visit: int, value_json: str) -> ResultRow:
    return _new_tuple(ResultRow, (node_id, visit, value_json))


#: A plain node row before it is composed: status, fired, visits, attempts,
#: payload JSON, result JSON, has_result JSON (see ``RunWriter._plain_row``).
PlainRow = tuple[str, int, int, int, str, str, str]


def _compose(node_id: str, row: PlainRow) -> NodeRow:
    status, fired, visits, attempts, payload, result, has_result = row
    return _make_node_row(
        node_id,
        status,
        visits,
        f'{{"v":{NODE_ROW_VERSION},"fired":{fired},"visits":{visits},'
        f'"attempts":{attempts},"payload":{payload},"result":{result},'
        f'"has_result":{has_result},"frontier":null,"inputs":null,"pending":null,'
        '"question":null}',
    )


def state_text(seq: int, events: int, turn: int, durability: str) -> str:
    """A run's state JSON when nothing is parked and no loop edge has a generation."""
    return (
        f'{{"v":{FORMAT_VERSION},"seq":{seq},"events":{events},"turn":{turn},'
        f'"durability":"{durability}","parked":[],"edge_gen":[]}}'
    )


class _Pending:
    """Consecutive harvests of one run with one status, merged in order into one write (D2).

    The latest row of each node wins; results, first-k decisions and events
    are concatenated; the run's state, error and status are the last harvest's.
    """

    __slots__ = (
        "applied",
        "checkpoints",
        "chunks",
        "error",
        "events",
        "finished_at",
        "frozen",
        "items",
        "nodes",
        "output_json",
        "parked",
        "questions",
        "results",
        "state",
        "status",
        "superseded",
        "unclaimed",
        "waiting_on",
        "wake_after",
    )

    def __init__(self, status: RunStatus) -> None:
        self.status = status
        self.error: str | None = None
        self.wake_after: int | None = None
        self.waiting_on: tuple[str, ...] = ()
        #: The run's state JSON, or its counters (seq, events, turn) and durability
        #: to write it from.
        self.state: str | tuple[int, int, int, str] = ""
        self.finished_at: float | None = None
        #: A completing child run's output, encoded (R1).
        self.output_json: str | None = None
        #: node index -> its latest row, or the snapshot to compose it from.
        self.nodes: dict[int, NodeRow | PlainRow] = {}
        #: (node id, visit, item) -> the item's latest row (M6).
        self.items: dict[tuple[str, int, int], ItemRow] = {}
        #: (node id, visit, item or -1) -> the visit's latest checkpoint (P1).
        self.checkpoints: dict[tuple[str, int, int], CheckpointRow] = {}
        self.results: list[ResultRow] = []
        self.frozen: list[FrozenInput] = []
        self.events: list[EventRow] = []
        self.questions: list[QuestionRow] = []
        self.applied: list[str] = []
        self.superseded: list[str] = []
        self.parked: list[ParkedRow] = []
        self.unclaimed: list[tuple[str, str]] = []
        self.chunks: list[ChunkRow] = []

    def harvest(self, ids: tuple[str, ...]) -> Harvest:
        """The merged harvest, as the store takes it (``ids``: node ids by index)."""
        state = self.state
        if not isinstance(state, str):
            state = state_text(*state)
        return Harvest(
            state_json=state,
            status=self.status,
            error=self.error,
            nodes=[
                row if isinstance(row, NodeRow) else _compose(ids[i], row)
                for i, row in self.nodes.items()
            ],
            results=self.results,
            frozen=self.frozen,
            items=list(self.items.values()),
            checkpoints=list(self.checkpoints.values()),
            events=self.events,
            nodes_done_delta=len(self.results),
            finished_at=self.finished_at,
            questions=self.questions,
            applied=self.applied,
            chunks=self.chunks,
            superseded=self.superseded,
            parked=self.parked,
            unclaimed=self.unclaimed,
            wake_after=self.wake_after,
            waiting_on=self.waiting_on,
            output_json=self.output_json,
        )
