"""In-memory run store: the reference model of the contract.

It applies the rules every backend shares under one lock: each decision the
SQL stores phrase as a statement is a pure function in ``_rules`` or
``_queue_rules`` (``committed_record`` is ``UPDATE_RUN``, ``can_wake`` is
``WAKE_SUSPENDED``, ``claim_order`` is ``claim_candidates``, ...), which this
store applies to its dictionaries.

>>> import asyncio
>>> async def demo() -> int:
...     async with MemoryStore() as store:
...         await store.create_run(NewRun(run_id="r1", graph_name="g", graph_ref=None,
...                                       fingerprint="f", input_json="1", created_at=1.0))
...         return await store.acquire_lease("r1", "engine-a", ttl=30.0)
>>> asyncio.run(demo())
1
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence

from ..._errors import RunExists, RunNotFound, StoreError
from .._artifacts import ArtifactLedger
from .._changes import ChangeHub
from .._contract import ChangeFeed, Presence, RunStore
from .._presence import MemoryTokens, Sessions, ring_change
from .._queue_rules import (
    STALE_REGISTRATION,
    claim_order,
    dedup_holder,
    deployed_at,
    free_slots,
    holds_slot,
    left_behind,
    pulse_of,
    queue_not_empty,
    ring_neighbour,
    run_count_order,
    run_graph_key,
    scheduled_run,
    stats_of,
    tick_is_due,
)
from .._records import (
    LIVE_STATUSES,
    TERMINAL_STATUSES,
    ArtifactVersion,
    CheckpointRow,
    ChunkRow,
    Claim,
    EventRow,
    FrozenInput,
    GraphRow,
    Harvest,
    ItemRow,
    NewRun,
    NodeRow,
    ParkedRow,
    ParkedStatus,
    Pulse,
    QuestionRow,
    QuestionStatus,
    Queue,
    QueueStats,
    ResultRow,
    RunCount,
    RunRecord,
    RunSnapshot,
    RunStatus,
    ScheduleRow,
    StoredRun,
    StreamHead,
    StreamTail,
    Submission,
    WorkerRow,
)
from .._rules import (
    applied_status,
    can_apply,
    can_supersede,
    can_wake,
    check_commit,
    check_holder,
    check_move,
    check_name,
    check_readable,
    children_left,
    committed_record,
    due,
    due_order,
    duplicate_in_harvest,
    grant_lease,
    is_recovery,
    lease_lapsed,
    new_run_record,
    not_applicable,
    not_open,
    question_not_found,
    stream_tails,
)

# --- the store ---------------------------------------------------------------


class MemoryStore(RunStore):
    """A store in process memory: fast, thread-safe, gone when the process ends.

    Args:
        clock: wall clock used for lease expiry, in seconds since the epoch;
            tests pass a fake one.

    Data survives ``close()``/``open()`` on the same object, which lets tests
    simulate a restart. Every operation runs under one :class:`threading.Lock`
    and never awaits while holding it, so the store is safe across threads and
    event loops alike.
    """

    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._runs: dict[str, RunRecord] = {}
        self._nodes: dict[str, dict[str, NodeRow]] = {}
        self._result_rows: dict[str, dict[tuple[str, int], ResultRow]] = {}
        self._frozen: dict[str, dict[tuple[str, int], FrozenInput]] = {}
        self._items: dict[str, dict[tuple[str, int, int], ItemRow]] = {}
        self._checkpoints: dict[str, dict[tuple[str, int, int], CheckpointRow]] = {}
        self._parked: dict[str, ParkedRow] = {}
        self._event_rows: dict[str, dict[int, EventRow]] = {}
        #: run id -> its stream rows in seq order (S3).
        self._chunk_rows: dict[str, list[ChunkRow]] = {}
        #: run id -> the child completions a suspended run waits for (R4).
        self._wake_after: dict[str, int | None] = {}
        #: Completed child runs' outputs (R1).
        self._output_texts: dict[str, str] = {}
        self._questions: dict[str, QuestionRow] = {}
        #: (graph name, fingerprint) -> the graph version's structure JSON (V1).
        self._shapes: dict[tuple[str, str], str] = {}
        self._artifacts = ArtifactLedger(clock)
        self._queue_specs: dict[str, Queue] = {}
        self._paused: set[str] = set()
        self._schedule_rows: dict[str, ScheduleRow] = {}
        self._graph_rows: dict[tuple[str, str], GraphRow] = {}
        #: The graph versions each worker drives, and when it registered them.
        self._worker_graph_rows: dict[str, tuple[float, frozenset[tuple[str, str]]]] = {}
        self._worker_rows: dict[str, WorkerRow] = {}
        self._hub = ChangeHub()
        self._sessions = Sessions(self, MemoryTokens(), "memory store")

    async def open(self) -> None:
        """Nothing to connect; kept for the contract. Idempotent."""

    async def close(self) -> None:
        """Nothing to flush; data is kept for a later ``open``. Idempotent."""
        await self._sessions.close()

    def _run(self, run_id: str) -> RunRecord:
        check_name("run_id", run_id)
        try:
            return self._runs[run_id]
        except KeyError:
            raise RunNotFound(f"no run {run_id!r} in the store") from None

    async def _create_run(self, run: NewRun) -> None:
        with self._lock:
            if run.run_id in self._runs:
                raise RunExists(f"run {run.run_id!r} already exists")
            self._insert_run(run, None)

    def _insert_run(self, run: NewRun, submission: Submission | None) -> None:
        """Add the rows of a new run (``queued`` with a ``submission``); the caller holds the lock."""
        self._runs[run.run_id] = new_run_record(run, submission)
        if run.shape_json is not None:
            self._shapes.setdefault((run.graph_name, run.fingerprint), run.shape_json)
        self._nodes[run.run_id] = {}
        self._result_rows[run.run_id] = {}
        self._frozen[run.run_id] = {}
        self._items[run.run_id] = {}
        self._checkpoints[run.run_id] = {}
        self._event_rows[run.run_id] = {}
        self._chunk_rows[run.run_id] = []

    async def _commit(self, run_id: str, token: int, harvest: Harvest) -> bool:
        with self._lock:
            record = self._run(run_id)
            check_commit(
                run_id,
                current=record.status,
                format_version=record.format_version,
                lease_token=record.lease_token,
                token=token,
                new=harvest.status,
            )
            self._check_no_rewrite(run_id, harvest)
            now = self._clock()
            questions = self._question_changes(run_id, harvest, now)  # may refuse: nothing written
            self._questions.update(questions)
            self._nodes[run_id].update((n.node_id, n) for n in harvest.nodes)
            self._result_rows[run_id].update(((r.node_id, r.visit), r) for r in harvest.results)
            self._frozen[run_id].update(((f.node_id, f.activation), f) for f in harvest.frozen)
            if harvest.items:
                self._items[run_id].update(((r.node_id, r.visit, r.item), r) for r in harvest.items)
            for r in harvest.parked:  # parked again: the checkpoint is updated while unclaimed
                held = self._parked.get(r.park_id)
                if held is None or held.status == "parked":
                    self._parked[r.park_id] = (
                        r if held is None else held._replace(checkpoint_json=r.checkpoint_json)
                    )
            self._unclaim(harvest.unclaimed)
            if harvest.checkpoints:
                self._checkpoints[run_id].update(
                    ((r.node_id, r.visit, r.item), r) for r in harvest.checkpoints
                )
            self._event_rows[run_id].update((e.seq, e) for e in harvest.events)
            if harvest.chunks:
                chunks = self._chunk_rows[run_id]
                for c in harvest.chunks:
                    if chunks and c.seq < chunks[-1].seq:
                        bisect.insort(chunks, c)
                    else:
                        chunks.append(c)
            self._runs[run_id] = committed_record(record, harvest, now)
            ends = harvest.status in TERMINAL_STATUSES
            if harvest.output_json is None:
                self._output_texts.pop(run_id, None)
            else:
                self._output_texts[run_id] = harvest.output_json
            cancel = record.cancel_requested_at is not None
            if harvest.status is RunStatus.SUSPENDED:
                self._wake_after[run_id] = harvest.wake_after
            parent = record.parent_run_id
            woke = (
                parent is not None
                and harvest.status in TERMINAL_STATUSES
                and not (harvest.status is RunStatus.COMPLETED and self._count_down(parent))
                and self._wake_locked(parent, now)
            )
            if harvest.status is RunStatus.SUSPENDED and harvest.waiting_on:
                woke = self._suspend_on_children(run_id, harvest, now)
        if harvest.chunks:
            self._hub.deliver(frozenset({"stream"}))
        if ends or (harvest.status is RunStatus.SUSPENDED and harvest.waiting_on):
            self._hub.deliver(frozenset({"release"}))
        if woke:
            self._hub.deliver(frozenset({"submit"}))
        return cancel

    def _suspend_on_children(self, run_id: str, harvest: Harvest, now: float) -> bool:
        """As ``suspend_on_children`` (the SQL stores'): let go of the lease, count the
        children that ended before; True if that queued the run again."""
        self._runs[run_id] = dataclasses.replace(
            self._runs[run_id], lease_owner=None, lease_expires=None
        )
        ended = [
            self._runs[c].status
            for c in sorted(set(harvest.waiting_on))
            if c in self._runs and self._runs[c].status in TERMINAL_STATUSES
        ]
        if not ended:
            return False
        left = children_left(harvest.wake_after, ended)
        if left is None:
            return self._wake_locked(run_id, now)
        self._wake_after[run_id] = left
        return False

    def _count_down(self, run_id: str) -> bool:
        """One child of suspended ``run_id`` completed: True if it still waits for more (R4)."""
        run = self._runs.get(run_id)
        left = self._wake_after.get(run_id)
        if run is None or run.status is not RunStatus.SUSPENDED or left is None or left <= 1:
            return False
        self._wake_after[run_id] = left - 1
        return True

    def _wake_locked(self, run_id: str, now: float) -> bool:
        """Queue suspended ``run_id`` again (R4), as ``WAKE_SUSPENDED``; the caller holds the lock."""
        run = self._runs.get(run_id)
        if run is None or not can_wake(run, now):
            return False
        self._runs[run_id] = dataclasses.replace(
            run, status=RunStatus.QUEUED, lease_owner=None, lease_expires=None, updated_at=now
        )
        self._wake_after.pop(run_id, None)
        return True

    async def _wake_suspended(self, run_id: str) -> bool:
        with self._lock:
            woke = self._wake_locked(run_id, self._clock())
        if woke:
            self._hub.deliver(frozenset({"submit"}))
        return woke

    async def _overdue_runs(self, now: float, *, limit: int) -> list[str]:
        with self._lock:
            due = [
                r
                for r in self._runs.values()
                if r.deadline is not None
                and r.deadline <= now
                and r.status in (RunStatus.QUEUED, RunStatus.SUSPENDED)
            ]
        due.sort(key=lambda r: (r.deadline or 0.0, r.run_id))
        return [r.run_id for r in due[: max(limit, 0)]]

    def _check_no_rewrite(self, run_id: str, harvest: Harvest) -> None:
        """Nothing already committed is rewritten: refuse the harvest before applying any of it."""
        problem = duplicate_in_harvest(run_id, harvest) or next(
            self._rewrites(run_id, harvest), None
        )
        if problem is not None:
            raise StoreError(problem + "; nothing of this harvest was written")

    def _rewrites(self, run_id: str, harvest: Harvest) -> Iterator[str]:
        results, frozen, events = (
            self._result_rows[run_id],
            self._frozen[run_id],
            self._event_rows[run_id],
        )
        for r in harvest.results:
            if (r.node_id, r.visit) in results:
                yield f"run {run_id!r}: result of node {r.node_id!r} visit {r.visit} already committed"
        for f in harvest.frozen:
            if (f.node_id, f.activation) in frozen:
                yield (
                    f"run {run_id!r}: frozen input of node {f.node_id!r} "
                    f"activation {f.activation} already committed"
                )
        for e in harvest.events:
            if e.seq in events:
                yield f"run {run_id!r}: event seq {e.seq} already committed"
        for q in harvest.questions:
            if q.question_id in self._questions:
                yield f"run {run_id!r}: question {q.question_id!r} already committed"
        if harvest.chunks:
            stored = self._chunk_rows[run_id]
            low = min(c.seq for c in harvest.chunks)
            seqs = {c.seq for c in stored[bisect.bisect_left(stored, (low,)) :]}
            for c in harvest.chunks:
                if c.seq in seqs:
                    yield f"run {run_id!r}: stream row seq {c.seq} already committed"

    def _question_changes(
        self, run_id: str, harvest: Harvest, now: float
    ) -> dict[str, QuestionRow]:
        """The question rows ``harvest`` inserts or changes; :class:`AlreadyAnswered` refuses it all.

        In order: insert ``questions``, apply ``applied`` (each a compare-and-set,
        so an id listed twice is refused), supersede ``superseded``.
        """
        changed = {q.question_id: q for q in harvest.questions}

        def current(question_id: str) -> QuestionRow:
            row = changed.get(question_id) or self._questions.get(question_id)
            if row is None:
                raise question_not_found(question_id)
            return row

        for question_id in harvest.applied:
            row = current(question_id)
            if not can_apply(row.status, row.applied_at):
                raise not_applicable(question_id, row.status, row.applied_at, run_id=run_id)
            changed[question_id] = dataclasses.replace(
                row, status=applied_status(row.status), applied_at=now
            )
        for question_id in harvest.superseded:
            row = current(question_id)
            if can_supersede(row.status, row.applied_at):
                changed[question_id] = dataclasses.replace(row, status=QuestionStatus.SUPERSEDED)
        return changed

    async def _load_run(self, run_id: str) -> StoredRun:
        with self._lock:
            return self._stored(run_id)

    def _stored(self, run_id: str) -> StoredRun:
        """What :meth:`load_run` returns; under the lock."""
        record = self._run(run_id)
        check_readable(run_id, record.format_version)
        items = [row for _, row in sorted(self._items[run_id].items())]
        checkpoints = [row for _, row in sorted(self._checkpoints[run_id].items())]
        return StoredRun(
            run=record, nodes=dict(self._nodes[run_id]), items=items, checkpoints=checkpoints
        )

    async def _snapshot(self, run_id: str) -> RunSnapshot:
        with self._lock:  # one moment: no commit lands while the lock is held
            stored = self._stored(run_id)
            results = list(self._result_rows[run_id].values())
            frozen = list(self._frozen[run_id].values())
            chunks = list(self._chunk_rows[run_id])
        return RunSnapshot(
            stored=stored,
            results=sorted(results, key=lambda r: (r.node_id, r.visit)),
            frozen=sorted(frozen, key=lambda f: (f.node_id, f.activation)),
            chunks=chunks,
        )

    # -- parked items (P3, P4) ------------------------------------------------------

    async def _list_parked(
        self,
        *,
        graph_name: str | None,
        node_id: str | None,
        status: ParkedStatus | None,
        claimed_by: str | None,
        run_id: str | None,
    ) -> list[ParkedRow]:
        with self._lock:
            wanted = (("graph_name", graph_name), ("node_id", node_id), ("status", status),
                      ("claimed_by", claimed_by), ("run_id", run_id))  # fmt: skip
            rows = [
                r
                for r in self._parked.values()
                if all(v is None or getattr(r, k) == v for k, v in wanted)
            ]
        return sorted(rows, key=lambda r: (r.parked_at, r.park_id))

    async def _claim_parked(
        self, graph_name: str, node_id: str, claimant: str, limit: int
    ) -> list[ParkedRow]:
        with self._lock:
            held = sum(
                1
                for r in self._parked.values()
                if (r.claimed_by, r.status) == (claimant, "claimed")
            )
            free = sorted(
                (r for r in self._parked.values()
                 if (r.graph_name, r.node_id, r.status) == (graph_name, node_id, "parked")),
                key=lambda r: (r.parked_at, r.park_id),
            )[: max(0, limit - held)]  # fmt: skip
            now = self._clock()
            for r in free:
                self._parked[r.park_id] = r._replace(
                    status="claimed", claimed_by=claimant, claimed_at=now
                )
        return await self._list_parked(
            graph_name=None, node_id=None, status=None, claimed_by=claimant, run_id=None
        )

    async def _unclaim_parked(self, pairs: Sequence[tuple[str, str]]) -> int:
        with self._lock:
            return self._unclaim(pairs)

    def _unclaim(self, pairs: Sequence[tuple[str, str]]) -> int:
        """Give back each ``(claimant, park_id)`` its claimant still holds (P4); under the lock."""
        back = 0
        for claimant, park_id in pairs:
            row = self._parked.get(park_id)
            if row is not None and (row.claimed_by, row.status) == (claimant, "claimed"):
                self._parked[park_id] = row._replace(
                    status="parked", claimed_by=None, claimed_at=None
                )
                back += 1
        return back

    async def _drop_parked(self, park_id: str) -> bool:
        with self._lock:
            row = self._parked.get(park_id)
            if row is None or row.status != "parked":
                return False
            self._parked[park_id] = row._replace(status="dropped")
            return True

    async def _get_run(self, run_id: str) -> RunRecord:
        with self._lock:
            return self._run(run_id)

    async def _list_runs(
        self,
        *,
        status: RunStatus | None = None,
        limit: int | None = None,
        queue: str | None = None,
        graph: str | None = None,
        offset: int = 0,
        parent: str | None = None,
        top_level: bool = False,
    ) -> list[RunRecord]:
        with self._lock:
            runs = [
                r
                for r in self._runs.values()
                if status in (None, r.status)
                and queue in (None, r.queue_name)
                and graph in (None, r.graph_name)
                and parent in (None, r.parent_run_id)
                and not (top_level and r.parent_run_id is not None)
            ]
        runs.sort(key=lambda r: (r.created_at, r.run_id), reverse=True)
        runs = runs[max(offset, 0) :]
        return runs if limit is None else runs[: max(limit, 0)]

    async def _run_counts(self, *, top_level: bool = False) -> list[RunCount]:
        with self._lock:
            grouped = Counter(
                (r.graph_name, r.queue_name, r.status)
                for r in self._runs.values()
                if not (top_level and r.parent_run_id is not None)
            )
        counts = [
            RunCount(graph_name=g, queue_name=q, status=s, count=n)
            for (g, q, s), n in grouped.items()
        ]
        return sorted(counts, key=run_count_order)

    async def _results(self, run_id: str, node_id: str | None = None) -> list[ResultRow]:
        with self._lock:
            self._run(run_id)
            rows = [r for r in self._result_rows[run_id].values() if node_id in (None, r.node_id)]
        return sorted(rows, key=lambda r: (r.node_id, r.visit))

    async def _outputs(self, run_ids: list[str]) -> dict[str, str]:
        with self._lock:
            return {
                run_id: self._output_texts[run_id]
                for run_id in run_ids
                if run_id in self._output_texts and self._runs[run_id].status is RunStatus.COMPLETED
            }

    async def _frozen_inputs(self, run_id: str) -> list[FrozenInput]:
        with self._lock:
            self._run(run_id)
            rows = list(self._frozen[run_id].values())
        return sorted(rows, key=lambda f: (f.node_id, f.activation))

    async def _events(self, run_id: str, *, after_seq: int = 0) -> list[EventRow]:
        with self._lock:
            self._run(run_id)
            rows = [e for seq, e in self._event_rows[run_id].items() if seq > after_seq]
        return sorted(rows, key=lambda e: e.seq)

    async def _chunks(self, run_id: str, *, after: int, limit: int) -> list[ChunkRow]:
        with self._lock:
            self._run(run_id)
            rows = self._chunk_rows[run_id]
            start = bisect.bisect_right(rows, (after, float("inf")))
            return rows[start : start + limit]

    async def _stream_tails(self, run_id: str, *, chars: int, limit: int) -> list[StreamTail]:
        with self._lock:
            self._run(run_id)
            rows = list(self._chunk_rows[run_id])
        return stream_tails(rows, chars, limit)

    async def _stream_head(self, run_id: str) -> StreamHead:
        with self._lock:
            self._run(run_id)
            rows = list(self._chunk_rows[run_id])
        if not rows:
            return StreamHead()
        ended = {r.stream for r in rows if r.kind != "chunk"}
        heads = tuple(r for r in rows if r.seq == r.stream and r.stream not in ended)
        return StreamHead(last_seq=rows[-1].seq, open=heads)

    async def _prune_streams(self, finished_before: float) -> int:
        with self._lock:
            pruned = 0
            for run_id, record in self._runs.items():
                finished = record.finished_at
                if finished is None or record.status not in TERMINAL_STATUSES:
                    continue
                if finished < finished_before and self._chunk_rows.get(run_id):
                    pruned += len(self._chunk_rows[run_id])
                    self._chunk_rows[run_id] = []
            return pruned

    async def _acquire_lease(
        self, run_id: str, owner: str, ttl: float, *, steal_from: str | None = None
    ) -> int:
        with self._lock:
            record = self._run(run_id)
            now = self._clock()
            token = grant_lease(
                run_id,
                owner,
                now=now,
                holder=record.lease_owner,
                expires=record.lease_expires,
                lease_token=record.lease_token,
                steal_from=steal_from,
            )
            new = token != record.lease_token
            recovered = is_recovery(record.status, record.lease_owner, owner, new_grant=new)
            self._runs[run_id] = dataclasses.replace(
                record, lease_owner=owner, lease_expires=now + ttl, lease_token=token,
                recoveries=record.recoveries + recovered,
            )  # fmt: skip
            return token

    async def _move_run(
        self,
        run_id: str,
        owner: str,
        token: int,
        *,
        fingerprint: str,
        graph_ref: str | None,
        expected: str,
    ) -> None:
        with self._lock:
            record = self._run(run_id)
            check_move(
                run_id, owner, token, status=record.status, fingerprint=record.fingerprint,
                holder=record.lease_owner, lease_token=record.lease_token, expected=expected,
            )  # fmt: skip
            self._runs[run_id] = dataclasses.replace(
                record, fingerprint=fingerprint, graph_ref=graph_ref, updated_at=self._clock()
            )

    async def _frontiers(self, graph_name: str) -> dict[str, tuple[str, ...]]:
        with self._lock:
            return {
                run_id: tuple(self._nodes[run_id])
                for run_id, record in sorted(self._runs.items())
                if record.graph_name == graph_name
                and record.status in (RunStatus.RUNNING, RunStatus.SUSPENDED)
                and self._nodes[run_id]
            }

    async def _graph_shape(self, graph_name: str, fingerprint: str) -> str | None:
        with self._lock:
            return self._shapes.get((graph_name, fingerprint))

    async def _heartbeat(self, run_id: str, owner: str, token: int, ttl: float) -> None:
        with self._lock:
            record = self._run(run_id)
            check_holder(
                run_id, owner, token, holder=record.lease_owner, lease_token=record.lease_token
            )
            self._runs[run_id] = dataclasses.replace(record, lease_expires=self._clock() + ttl)

    async def _release_lease(self, run_id: str, owner: str, token: int) -> None:
        with self._lock:
            record = self._runs.get(run_id)
            if not (record and record.lease_owner == owner and record.lease_token == token):
                return
            self._runs[run_id] = dataclasses.replace(record, lease_owner=None, lease_expires=None)
        self._hub.deliver(frozenset({"release"}))

    async def _expired_leases(self, now: float, *, limit: int = 100) -> list[str]:
        with self._lock:
            orphans = [r for r in self._runs.values() if lease_lapsed(r, now)]
        orphans.sort(key=lambda r: (r.lease_expires or 0.0, r.run_id))
        return [r.run_id for r in orphans[: max(limit, 0)]]

    # -- the question ledger (Q2-Q5) ---------------------------------------------

    def _question(self, question_id: str) -> QuestionRow:
        check_name("question_id", question_id)
        try:
            return self._questions[question_id]
        except KeyError:
            raise question_not_found(question_id) from None

    async def _answer(
        self,
        question_id: str,
        answer_json: str,
        *,
        by: str | None = None,
        status: QuestionStatus = QuestionStatus.ANSWERED,
    ) -> QuestionRow:
        with self._lock:
            row = self._question(question_id)
            if row.status is not QuestionStatus.OPEN:
                run = self._runs.get(row.run_id)
                raise not_open(
                    question_id, row.status, None if run is None else (run.run_id, run.status)
                )
            row = dataclasses.replace(
                row, status=status, answer_json=answer_json, answered_by=by,
                answered_at=self._clock(),
            )  # fmt: skip
            self._questions[question_id] = row
        self._hub.deliver(frozenset({"answer"}))
        return row

    async def _get_question(self, question_id: str) -> QuestionRow:
        with self._lock:
            return self._question(question_id)

    async def _list_questions(
        self,
        *,
        status: QuestionStatus | None = None,
        run_id: str | None = None,
        limit: int | None = None,
        offset: int = 0,
    ) -> list[QuestionRow]:
        with self._lock:
            rows = [
                q
                for q in self._questions.values()
                if status in (None, q.status) and run_id in (None, q.run_id)
            ]
        rows.sort(key=lambda q: (q.created_at, q.question_id))
        rows = rows[offset:]
        return rows if limit is None else rows[: max(limit, 0)]

    async def _question_counts(self) -> dict[QuestionStatus, int]:
        with self._lock:
            counts: dict[QuestionStatus, int] = {}
            for q in self._questions.values():
                counts[q.status] = counts.get(q.status, 0) + 1
        return counts

    async def _unapplied_answers(
        self, *, limit: int = 100, now: float | None = None
    ) -> list[QuestionRow]:
        at = self._clock() if now is None else now
        with self._lock:
            rows = [
                q
                for q in self._questions.values()
                if can_apply(q.status, q.applied_at) and due(q.retry_at, at)
            ]
        rows.sort(key=due_order)
        return rows[: max(limit, 0)]

    async def _defer_answer(self, question_id: str, *, error: str, retry_at: float) -> None:
        with self._lock:
            row = self._question(question_id)
            if can_apply(row.status, row.applied_at):
                self._questions[question_id] = dataclasses.replace(
                    row, apply_error=error, apply_attempts=row.apply_attempts + 1,
                    retry_at=retry_at,
                )  # fmt: skip

    async def _mark_applied(self, question_id: str) -> bool:
        with self._lock:
            row = self._question(question_id)
            if not can_apply(row.status, row.applied_at):
                return False
            self._questions[question_id] = dataclasses.replace(
                row, status=applied_status(row.status), applied_at=self._clock()
            )
            return True

    async def _supersede(self, question_id: str) -> bool:
        with self._lock:
            row = self._question(question_id)
            if not can_supersede(row.status, row.applied_at):
                return False
            self._questions[question_id] = dataclasses.replace(
                row, status=QuestionStatus.SUPERSEDED
            )
            return True

    # -- the evolve ledger --------------------------------------------------------

    async def _artifact_head(self, artifact_id: str) -> ArtifactVersion | None:
        return self._artifacts.head(artifact_id)

    async def _commit_artifact(
        self, artifact_id: str, expected: int, entries_json: str, meta_json: str = "{}"
    ) -> ArtifactVersion:
        return self._artifacts.commit(artifact_id, expected, entries_json, meta_json)

    async def _artifact_history(self, artifact_id: str) -> list[ArtifactVersion]:
        return self._artifacts.history(artifact_id)

    def changes(self) -> contextlib.AbstractAsyncContextManager[ChangeFeed]:
        """Wake-ups delivered as the writes happen (see :meth:`RunStore.changes`)."""
        return self._hub.subscribe()

    def _declared(self, name: str) -> Queue:
        return self._queue_specs.get(name) or Queue(name)

    async def _submit_run(self, run: NewRun, submission: Submission) -> str:
        with self._lock:
            holder = dedup_holder(self._runs.values(), submission.queue, submission.dedup_key)
            if holder is not None:
                return holder.run_id
            if run.run_id in self._runs:
                raise RunExists(f"run {run.run_id!r} already exists")
            self._insert_run(run, submission)
        self._hub.deliver(frozenset({"submit"}))
        return run.run_id

    async def _submit_runs(
        self,
        runs: Sequence[tuple[NewRun, Submission]],
        claim: Claim | None,
        skip: tuple[str, ...],
    ) -> tuple[list[str], list[str]]:
        with self._lock:
            stored = []
            for run, submission in runs:
                if run.run_id not in self._runs:
                    self._insert_run(run, submission)
                    stored.append(run.run_id)
            claimed: list[str] = []
            if claim is not None:
                claimed = self._claim_locked(
                    claim.queue, claim.owner, claim.ttl, claim.limit, None, skip
                )
        if set(stored) - set(claimed):
            self._hub.deliver(frozenset({"submit"}))
        return stored, claimed

    async def _return_claim(self, run_id: str, owner: str) -> bool:
        with self._lock:
            run = self._runs.get(run_id)
            if (
                run is None
                or run.status is not RunStatus.RUNNING
                or run.lease_owner != owner
                or self._event_rows.get(run_id)
            ):
                return False
            self._runs[run_id] = dataclasses.replace(
                run, status=RunStatus.QUEUED, lease_owner=None, lease_expires=None,
                started_at=None, updated_at=self._clock(),
            )  # fmt: skip
        self._hub.deliver(frozenset({"submit"}))
        return True

    async def _claim_runs(
        self,
        queue: str,
        owner: str,
        ttl: float,
        *,
        limit: int,
        graphs: tuple[str, ...] | None,
        skip: tuple[str, ...],
    ) -> list[str]:
        with self._lock:
            return self._claim_locked(queue, owner, ttl, limit, graphs, skip)

    def _claim_locked(
        self,
        queue: str,
        owner: str,
        ttl: float,
        limit: int,
        graphs: tuple[str, ...] | None,
        skip: tuple[str, ...],
    ) -> list[str]:
        now = self._clock()
        spec = self._declared(queue)
        mine = [r for r in self._runs.values() if r.queue_name == queue]
        free = free_slots(
            spec,
            want=limit,
            active=sum(holds_slot(r, now) for r in mine),
            started_recently=sum(
                r.started_at is not None and r.started_at > now - spec.period for r in mine
            ),
        )
        if queue in self._paused or free <= 0:
            return []
        wanted, skipped = (None if graphs is None else set(graphs)), set(skip)

        def drivable(run: RunRecord) -> bool:
            key = run_graph_key(run)
            return (wanted is None or key in wanted) and key not in skipped

        claimed: list[str] = []
        for run in claim_order(spec, mine, now, window=free, drivable=drivable):
            if not drivable(run):
                continue
            self._runs[run.run_id] = dataclasses.replace(
                run, status=RunStatus.RUNNING, lease_owner=owner, lease_expires=now + ttl,
                lease_token=run.lease_token + 1, started_at=now, updated_at=now,
            )  # fmt: skip
            claimed.append(run.run_id)
            if len(claimed) >= free:
                break
        return claimed

    async def _claim_answers(self, owner: str, ttl: float, *, limit: int) -> list[QuestionRow]:
        with self._lock:
            now = self._clock()
            due_rows = sorted(
                (
                    q
                    for q in self._questions.values()
                    if can_apply(q.status, q.applied_at) and due(q.retry_at, now)
                ),
                key=due_order,
            )
            taken: dict[str, QuestionRow] = {}
            for question in due_rows:
                if len(taken) >= limit:
                    break
                run = self._runs.get(question.run_id)
                if run is None or question.run_id in taken or not self._free_for_answer(run, now):
                    continue
                self._runs[run.run_id] = dataclasses.replace(
                    run, lease_owner=owner, lease_expires=now + ttl, lease_token=run.lease_token + 1
                )
                taken[run.run_id] = question
            return list(taken.values())

    def _free_for_answer(self, run: RunRecord, now: float) -> bool:
        """Whether a worker may take ``run`` to apply an answer now (no live lease, a queue slot)."""
        if run.status is not RunStatus.SUSPENDED:
            return False
        if (
            run.lease_owner is not None
            and run.lease_expires is not None
            and run.lease_expires >= now
        ):
            return False
        if run.queue_name is None:
            return True
        spec = self._declared(run.queue_name)
        active = sum(
            holds_slot(r, now) for r in self._runs.values() if r.queue_name == run.queue_name
        )
        return free_slots(spec, want=1, active=active, started_recently=0) > 0

    async def _request_cancel(self, run_id: str) -> RunStatus:
        with self._lock:
            run = self._runs.get(run_id)
            if run is None:
                raise RunNotFound(f"no run {run_id!r} in the store")
            now = self._clock()
            if run.status is RunStatus.QUEUED:
                run = dataclasses.replace(
                    run, status=RunStatus.CANCELLED, finished_at=now, updated_at=now
                )
            elif run.status in (RunStatus.RUNNING, RunStatus.SUSPENDED):
                run = dataclasses.replace(run, cancel_requested_at=run.cancel_requested_at or now)
            self._runs[run_id] = run
        self._hub.deliver(frozenset({"cancel"}))
        return run.status

    async def _reopen_cancelled(
        self, run_id: str, owner: str, ttl: float, nodes: tuple[str, ...]
    ) -> bool:
        with self._lock:
            run = self._run(run_id)
            if run.status is not RunStatus.CANCELLED:
                return False
            now = self._clock()
            self._runs[run_id] = dataclasses.replace(
                run, status=RunStatus.RUNNING, finished_at=None, cancel_requested_at=None,
                lease_owner=owner, lease_expires=now + ttl, lease_token=run.lease_token + 1,
                updated_at=now,
            )  # fmt: skip
            rows = self._nodes[run_id]
            for node_id in nodes:
                row = rows.get(node_id)
                if row is not None and row.status == "cancelled":
                    rows[node_id] = row._replace(status="queued")
            return True

    async def _cancel_requests(self, owner: str) -> list[str]:
        with self._lock:
            return sorted(
                r.run_id
                for r in self._runs.values()
                if r.lease_owner == owner
                and r.status is RunStatus.RUNNING
                and r.cancel_requested_at is not None
            )

    async def _runs_leased_by(self, owner: str, *, limit: int = 100) -> list[str]:
        with self._lock:
            ids = sorted(
                r.run_id
                for r in self._runs.values()
                if r.lease_owner == owner and r.status is RunStatus.RUNNING
            )
        return ids[: max(limit, 0)]

    async def _declare_queue(self, queue: Queue) -> None:
        with self._lock:
            self._queue_specs[queue.name] = queue
        self._hub.deliver(frozenset({"submit", "config"}))  # new limits may let more runs start

    async def _queues(self) -> list[Queue]:
        with self._lock:
            return [self._queue_specs[name] for name in sorted(self._queue_specs)]

    async def _register_graph(self, row: GraphRow) -> None:
        with self._lock:
            key = (row.name, row.fingerprint)
            known = self._graph_rows.get(key)
            if known is not None:  # a version known already keeps when it was deployed
                self._graph_rows[key] = dataclasses.replace(known, graph_ref=row.graph_ref)
                return
            others = [r.registered_at for (n, _), r in self._graph_rows.items() if n == row.name]
            at = deployed_at(row.registered_at, max(others, default=None))
            self._graph_rows[key] = dataclasses.replace(row, registered_at=at)

    async def _register_worker_graphs(self, worker_id: str, graphs: list[tuple[str, str]]) -> None:
        with self._lock:
            now = self._clock()
            kept = self._worker_graph_rows
            for other, (at, _) in list(kept.items()):
                if at < now - STALE_REGISTRATION and other not in self._worker_rows:
                    del kept[other]
            kept[worker_id] = (now, frozenset(graphs))

    async def _worker_graphs(self, worker_ids: list[str]) -> dict[str, frozenset[tuple[str, str]]]:
        with self._lock:
            rows = self._worker_graph_rows
            return {w: rows[w][1] for w in worker_ids if w in rows and rows[w][1]}

    async def _graphs_named(self, name: str) -> list[GraphRow]:
        with self._lock:
            rows = [r for (n, _), r in self._graph_rows.items() if n == name]
        return sorted(rows, key=lambda r: (-r.registered_at, r.fingerprint))

    async def _declare_schedule(self, row: ScheduleRow) -> None:
        with self._lock:
            old = self._schedule_rows.get(row.name)
            kept = row.last_tick if old is None else old.last_tick
            self._schedule_rows[row.name] = dataclasses.replace(row, last_tick=kept)
        self._hub.deliver(frozenset({"config"}))

    async def _schedules(self) -> list[ScheduleRow]:
        with self._lock:
            return [self._schedule_rows[name] for name in sorted(self._schedule_rows)]

    async def _now(self) -> float:
        return self._clock()

    def _read_clock(self) -> float:
        return self._clock()

    async def _fire_schedule(self, name: str, tick: float) -> str | None:
        with self._lock:
            row = self._schedule_rows.get(name)
            if row is None or not tick_is_due(row.last_tick, tick, self._clock()):
                return None
            self._schedule_rows[name] = dataclasses.replace(row, last_tick=tick)
            run, submission = scheduled_run(row, tick, self._clock())
            if run.run_id in self._runs:
                return None
            self._insert_run(run, submission)
        self._hub.deliver(frozenset({"submit"}))
        return run.run_id

    async def _delete_schedule(self, name: str) -> bool:
        with self._lock:
            return self._schedule_rows.pop(name, None) is not None

    async def _pause_queue(self, name: str) -> None:
        with self._lock:
            self._queue_specs.setdefault(name, Queue(name))
            self._paused.add(name)
        self._hub.deliver(frozenset({"config"}))

    async def _resume_queue(self, name: str) -> bool:
        with self._lock:
            if name not in self._paused:
                return False
            self._paused.discard(name)
        self._hub.deliver(frozenset({"submit", "config"}))
        return True

    async def _delete_queue(self, name: str) -> bool:
        with self._lock:
            live = sum(
                r.queue_name == name and r.status in LIVE_STATUSES for r in self._runs.values()
            )
            if live:
                raise queue_not_empty(name, live)
            self._paused.discard(name)
            deleted = self._queue_specs.pop(name, None) is not None
        if deleted:
            self._hub.deliver(frozenset({"config"}))
        return deleted

    async def _queue_stats(self, now: float, *, window: float = 60.0) -> list[QueueStats]:
        with self._lock:
            runs = [r for r in self._runs.values() if r.queue_name is not None]
            declared, workers = dict(self._queue_specs), list(self._worker_rows.values())
            paused = set(self._paused)
        names = {r.queue_name for r in runs if r.queue_name is not None}
        return stats_of(names, declared, runs, workers, now, window, paused)

    async def _worker_seen(self, worker: WorkerRow) -> None:
        with self._lock:
            self._report(worker)

    def _report(self, worker: WorkerRow) -> None:
        """Keep ``worker``'s report; the session its row names stays (lock held)."""
        held = self._worker_rows.get(worker.worker_id)
        session = None if held is None else held.session
        self._worker_rows[worker.worker_id] = dataclasses.replace(worker, session=session)

    async def _pulse(self, worker: WorkerRow) -> Pulse:
        with self._lock:
            now = self._clock()
            self._report(worker)
            runs = list(self._runs.values())
            kinds: set[str] = set()
            mine = set(worker.queues)
            if any(r.status is RunStatus.QUEUED and r.queue_name in mine for r in runs):
                kinds.add("submit")
            if any(
                can_apply(q.status, q.applied_at) and due(q.retry_at, now)
                and self._runs.get(q.run_id) is not None
                and self._runs[q.run_id].status is RunStatus.SUSPENDED
                for q in self._questions.values()
            ):  # fmt: skip
                kinds.add("answer")
            if any(lease_lapsed(r, now) for r in runs):
                kinds.add("release")
            if any(
                r.lease_owner == worker.worker_id and r.status is RunStatus.RUNNING
                and r.cancel_requested_at is not None
                for r in runs
            ):  # fmt: skip
                kinds.add("cancel")
            gates = any(
                q.status is QuestionStatus.OPEN and (q.poller is not None or q.deadline is not None)
                for q in self._questions.values()
            )
        waiting = (RunStatus.QUEUED, RunStatus.SUSPENDED)
        deadlines = [r.deadline for r in runs if r.deadline is not None and r.status in waiting]
        due_at = [
            r.lease_expires for r in runs if r.status is RunStatus.RUNNING
            and r.lease_expires is not None and r.lease_expires >= now
        ] + [
            r.not_before for r in runs if r.status is RunStatus.QUEUED and r.queue_name in mine
            and r.not_before is not None
        ]  # fmt: skip
        return pulse_of(
            kinds, gates=gates, now=now, deadline=min(deadlines, default=None), due=due_at
        )

    async def _workers(self) -> list[WorkerRow]:
        with self._lock:
            return [self._worker_rows[w] for w in sorted(self._worker_rows)]

    async def _forget_worker(self, worker_id: str) -> None:
        with self._lock:
            self._worker_rows.pop(worker_id, None)

    # -- store sessions (W7): one per store object, never another one to watch ----------

    def _presence(self, worker: WorkerRow) -> contextlib.AbstractAsyncContextManager[Presence]:
        return self._sessions.present(worker)

    async def _join_session(
        self, session: str, workers: list[WorkerRow], *, again: bool
    ) -> frozenset[str]:
        listed = frozenset(w.worker_id for w in workers)
        with self._lock:
            now = self._clock()
            held = {w for w, row in self._worker_rows.items() if row.session == session}
            for worker_id, row in list(self._worker_rows.items()):
                if left_behind(row, now):
                    del self._worker_rows[worker_id]
            for worker in workers:
                self._worker_rows[worker.worker_id] = dataclasses.replace(worker, session=session)
            sessions = {w.session for w in self._worker_rows.values() if w.session is not None}
        before = ring_neighbour(sessions, session, after=False)
        if before is not None:
            self._hub.deliver(frozenset({ring_change(before)}))
        return frozenset(held & listed) if again else listed

    async def _bury_session(self, session: str) -> int:
        with self._lock:
            gone = {w for w, row in self._worker_rows.items() if row.session == session}
            expired = 0
            for run_id, record in list(self._runs.items()):
                if record.lease_owner in gone and record.status in (
                    RunStatus.RUNNING, RunStatus.SUSPENDED
                ):  # fmt: skip
                    self._runs[run_id] = dataclasses.replace(
                        record, lease_expires=0.0, lease_token=record.lease_token + 1
                    )
                    expired += 1
            for worker_id in gone:
                del self._worker_rows[worker_id]
        if expired:
            self._hub.deliver(frozenset({"release", "answer"}))
        return expired

    async def _ring_next(self, session: str) -> str | None:
        with self._lock:
            sessions = {w.session for w in self._worker_rows.values() if w.session is not None}
        return ring_neighbour(sessions, session, after=True)

    async def _run_durations(
        self, fingerprint: str, *, limit: int = 200
    ) -> list[tuple[float, float]]:
        with self._lock:
            done = [
                r
                for r in self._runs.values()
                if r.fingerprint == fingerprint
                and r.status is RunStatus.COMPLETED
                and r.started_at is not None
                and r.finished_at is not None
            ]
        done.sort(key=lambda r: r.finished_at or 0.0, reverse=True)
        return [
            (r.cost or 0.0, (r.finished_at or 0.0) - (r.started_at or 0.0))
            for r in done[: max(limit, 0)]
        ]
