"""In-memory run store.

It applies the rules every backend shares (``_rules``) under one lock.

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

import dataclasses
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator

from ..._errors import RunExists, RunNotFound, StoreError
from .._artifacts import ArtifactLedger
from .._changes import ChangeHub
from .._contract import RunStore
from .._records import (
    ArtifactVersion,
    EventRow,
    FrozenInput,
    Harvest,
    NewRun,
    NodeRow,
    QuestionRow,
    QuestionStatus,
    Queue,
    ResultRow,
    RunCount,
    RunRecord,
    RunStatus,
    StoredRun,
    Submission,
    WorkerRow,
)
from .._rules import (
    EMPTY_STATE_JSON,
    answer_status,
    applied_status,
    can_apply,
    can_supersede,
    check_apply_deferral,
    check_commit,
    check_harvest,
    check_holder,
    check_name,
    check_names,
    check_new_format,
    check_readable,
    check_ttl,
    due,
    due_order,
    duplicate_in_harvest,
    grant_lease,
    not_applicable,
    not_open,
    printable_text,
    question_not_found,
)
from .._sql._queues import run_count_order
from ._queues import MemoryQueues

# --- the store ---------------------------------------------------------------


class MemoryStore(MemoryQueues, RunStore):
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
        self._results: dict[str, dict[tuple[str, int], ResultRow]] = {}
        self._frozen: dict[str, dict[tuple[str, int], FrozenInput]] = {}
        self._events: dict[str, dict[int, EventRow]] = {}
        self._questions: dict[str, QuestionRow] = {}
        self._artifacts = ArtifactLedger(clock)
        self._queues: dict[str, Queue] = {}
        self._workers: dict[str, WorkerRow] = {}
        self._hub = ChangeHub()

    async def open(self) -> None:
        """Nothing to connect; kept for the contract. Idempotent."""

    async def close(self) -> None:
        """Nothing to flush; data is kept for a later ``open``. Idempotent."""

    def _run(self, run_id: str) -> RunRecord:
        check_name("run_id", run_id)
        try:
            return self._runs[run_id]
        except KeyError:
            raise RunNotFound(f"no run {run_id!r} in the store") from None

    async def create_run(self, run: NewRun) -> None:
        """Store a new run with status ``running``; ``RunExists`` if ``run.run_id`` is taken."""
        check_new_format(run)
        check_names(
            run_id=run.run_id, graph_name=run.graph_name, graph_ref=run.graph_ref,
            fingerprint=run.fingerprint,
        )  # fmt: skip
        with self._lock:
            if run.run_id in self._runs:
                raise RunExists(f"run {run.run_id!r} already exists")
            self._insert_run(run, None)

    def _insert_run(self, run: NewRun, submission: Submission | None) -> None:
        """Add the rows of a new run (``queued`` with a ``submission``); the caller holds the lock."""
        q = submission
        self._runs[run.run_id] = RunRecord(
            run_id=run.run_id,
            graph_name=run.graph_name,
            graph_ref=run.graph_ref,
            fingerprint=run.fingerprint,
            status=RunStatus.RUNNING if q is None else RunStatus.QUEUED,
            input_json=run.input_json,
            state_json=EMPTY_STATE_JSON,
            error=None,
            created_at=run.created_at,
            updated_at=run.created_at,
            finished_at=None,
            nodes_done=0,
            lease_owner=None,
            lease_expires=None,
            lease_token=0,
            format_version=run.format_version,
            queue_name=None if q is None else q.queue,
            priority=0 if q is None else q.priority,
            partition_key=None if q is None else q.partition,
            dedup_key=None if q is None else q.dedup_key,
            cost=None if q is None else q.cost,
            estimate=None if q is None else q.estimate,
            queued_at=None if q is None else run.created_at,
        )
        self._nodes[run.run_id] = {}
        self._results[run.run_id] = {}
        self._frozen[run.run_id] = {}
        self._events[run.run_id] = {}

    async def commit(self, run_id: str, token: int, harvest: Harvest) -> None:
        """Apply ``harvest`` to ``run_id`` atomically if ``token`` is current (D1, D6, Q3)."""
        check_harvest(run_id, harvest)
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
            self._results[run_id].update(((r.node_id, r.visit), r) for r in harvest.results)
            self._frozen[run_id].update(((f.node_id, f.activation), f) for f in harvest.frozen)
            self._events[run_id].update((e.seq, e) for e in harvest.events)
            self._runs[run_id] = dataclasses.replace(
                record,
                state_json=harvest.state_json,
                status=harvest.status,
                error=None if harvest.error is None else printable_text(harvest.error),
                updated_at=now,
                finished_at=harvest.finished_at
                if harvest.finished_at is not None
                else record.finished_at,
                nodes_done=record.nodes_done + harvest.nodes_done_delta,
            )

    def _check_no_rewrite(self, run_id: str, harvest: Harvest) -> None:
        """Nothing already committed is rewritten: refuse the harvest before applying any of it."""
        problem = duplicate_in_harvest(run_id, harvest) or next(
            self._rewrites(run_id, harvest), None
        )
        if problem is not None:
            raise StoreError(problem + "; nothing of this harvest was written")

    def _rewrites(self, run_id: str, harvest: Harvest) -> Iterator[str]:
        results, frozen, events = self._results[run_id], self._frozen[run_id], self._events[run_id]
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

    async def load_run(self, run_id: str) -> StoredRun:
        """Return run ``run_id`` with its node rows; ``UnsupportedFormat`` if written by a newer tailrace."""
        with self._lock:
            record = self._run(run_id)
            check_readable(run_id, record.format_version)
            return StoredRun(run=record, nodes=dict(self._nodes[run_id]))

    async def get_run(self, run_id: str) -> RunRecord:
        """Return the record of run ``run_id``; ``RunNotFound`` if absent."""
        with self._lock:
            return self._run(run_id)

    async def list_runs(
        self,
        *,
        status: RunStatus | None = None,
        limit: int | None = None,
        queue: str | None = None,
        graph: str | None = None,
        offset: int = 0,
    ) -> list[RunRecord]:
        """Runs newest first (``created_at``, then ``run_id``), filtered, ``offset`` skipped, at most ``limit``."""
        check_names(queue=queue, graph=graph)
        with self._lock:
            runs = [
                r
                for r in self._runs.values()
                if status in (None, r.status)
                and queue in (None, r.queue_name)
                and graph in (None, r.graph_name)
            ]
        runs.sort(key=lambda r: (r.created_at, r.run_id), reverse=True)
        runs = runs[max(offset, 0) :]
        return runs if limit is None else runs[: max(limit, 0)]

    async def run_counts(self) -> list[RunCount]:
        """How many runs there are per graph name, queue and status."""
        with self._lock:
            grouped = Counter((r.graph_name, r.queue_name, r.status) for r in self._runs.values())
        counts = [
            RunCount(graph_name=g, queue_name=q, status=s, count=n)
            for (g, q, s), n in grouped.items()
        ]
        return sorted(counts, key=run_count_order)

    async def results(self, run_id: str, node_id: str | None = None) -> list[ResultRow]:
        """Result rows of ``run_id`` (only ``node_id``'s if given), by node then visit."""
        check_name("node_id", node_id)
        with self._lock:
            self._run(run_id)
            rows = [r for r in self._results[run_id].values() if node_id in (None, r.node_id)]
        return sorted(rows, key=lambda r: (r.node_id, r.visit))

    async def frozen_inputs(self, run_id: str) -> list[FrozenInput]:
        """First-k decisions of ``run_id``, by node then activation (E4)."""
        with self._lock:
            self._run(run_id)
            rows = list(self._frozen[run_id].values())
        return sorted(rows, key=lambda f: (f.node_id, f.activation))

    async def events(self, run_id: str, *, after_seq: int = 0) -> list[EventRow]:
        """Events of ``run_id`` with ``seq > after_seq``, in seq order."""
        with self._lock:
            self._run(run_id)
            rows = [e for seq, e in self._events[run_id].items() if seq > after_seq]
        return sorted(rows, key=lambda e: e.seq)

    async def acquire_lease(
        self, run_id: str, owner: str, ttl: float, *, steal_from: str | None = None
    ) -> int:
        """Lease ``run_id`` to ``owner`` for ``ttl`` seconds, from ``steal_from`` if it holds it; return the token (D6)."""
        check_ttl(ttl)
        check_names(run_id=run_id, owner=owner, steal_from=steal_from)
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
            self._runs[run_id] = dataclasses.replace(
                record, lease_owner=owner, lease_expires=now + ttl, lease_token=token
            )
            return token

    async def heartbeat(self, run_id: str, owner: str, token: int, ttl: float) -> None:
        """Extend ``owner``'s lease on ``run_id`` to ``ttl`` from now; ``LeaseLost`` if ``token`` is stale."""
        check_ttl(ttl)
        check_name("owner", owner)
        with self._lock:
            record = self._run(run_id)
            check_holder(
                run_id, owner, token, holder=record.lease_owner, lease_token=record.lease_token
            )
            self._runs[run_id] = dataclasses.replace(record, lease_expires=self._clock() + ttl)

    async def release_lease(self, run_id: str, owner: str, token: int) -> None:
        """Drop ``owner``'s lease on ``run_id`` if still held with ``token``; else do nothing."""
        check_names(run_id=run_id, owner=owner)
        with self._lock:
            record = self._runs.get(run_id)
            if not (record and record.lease_owner == owner and record.lease_token == token):
                return
            self._runs[run_id] = dataclasses.replace(record, lease_owner=None, lease_expires=None)
        self._hub.deliver(frozenset({"release"}))

    async def expired_leases(self, now: float, *, limit: int = 100) -> list[str]:
        """Ids of ``running`` runs with no lease or one that expired before ``now``, at most ``limit``."""
        with self._lock:
            orphans = [
                r
                for r in self._runs.values()
                if r.status == RunStatus.RUNNING
                and (r.lease_owner is None or r.lease_expires is None or r.lease_expires < now)
            ]
        orphans.sort(key=lambda r: (r.lease_expires or 0.0, r.run_id))
        return [r.run_id for r in orphans[: max(limit, 0)]]

    # -- the question ledger (Q2-Q5) ---------------------------------------------

    def _question(self, question_id: str) -> QuestionRow:
        check_name("question_id", question_id)
        try:
            return self._questions[question_id]
        except KeyError:
            raise question_not_found(question_id) from None

    async def answer(
        self,
        question_id: str,
        answer_json: str,
        *,
        by: str | None = None,
        status: QuestionStatus = QuestionStatus.ANSWERED,
    ) -> QuestionRow:
        """First answer wins: compare-and-set ``open -> status`` and return the new row (Q2).

        Args:
            question_id: the question to answer.
            answer_json: the encoded answer.
            by: who answered (a person, a poller), stored as ``answered_by``.
            status: ``answered``, or ``expired`` when the deadline passed (Q5).

        ``AlreadyAnswered`` if the question is not ``open`` (nothing changes),
        ``QuestionNotFound`` if unknown, ``ValueError`` for another ``status``.
        """
        status = answer_status(question_id, status)
        check_name("by", by, context=f"question {question_id!r}: ")
        with self._lock:
            row = self._question(question_id)
            if row.status is not QuestionStatus.OPEN:
                raise not_open(question_id, row.status)
            row = dataclasses.replace(
                row, status=status, answer_json=answer_json, answered_by=by,
                answered_at=self._clock(),
            )  # fmt: skip
            self._questions[question_id] = row
        self._hub.deliver(frozenset({"answer"}))
        return row

    async def get_question(self, question_id: str) -> QuestionRow:
        """Return question ``question_id``; ``QuestionNotFound`` if absent."""
        with self._lock:
            return self._question(question_id)

    async def list_questions(
        self,
        *,
        status: QuestionStatus | None = None,
        run_id: str | None = None,
        limit: int | None = None,
    ) -> list[QuestionRow]:
        """Questions oldest first (``created_at``, then id), only those in ``status`` and of ``run_id`` if given, at most ``limit``."""
        check_name("run_id", run_id)
        with self._lock:
            rows = [
                q
                for q in self._questions.values()
                if status in (None, q.status) and run_id in (None, q.run_id)
            ]
        rows.sort(key=lambda q: (q.created_at, q.question_id))
        return rows if limit is None else rows[: max(limit, 0)]

    async def unapplied_answers(
        self, *, limit: int = 100, now: float | None = None
    ) -> list[QuestionRow]:
        """Unapplied answers due at ``now`` (default: the clock): fresh ones, then deferred ones (Q4)."""
        at = self._clock() if now is None else now
        with self._lock:
            rows = [
                q
                for q in self._questions.values()
                if can_apply(q.status, q.applied_at) and due(q.retry_at, at)
            ]
        rows.sort(key=due_order)
        return rows[: max(limit, 0)]

    async def defer_answer(self, question_id: str, *, error: str, retry_at: float) -> None:
        """Record a failed apply of ``question_id``'s answer: ``error``, one more attempt, ``retry_at``.

        Only while the answer is unapplied; ``QuestionNotFound`` if absent.
        """
        text = check_apply_deferral(question_id, error, retry_at)
        with self._lock:
            row = self._question(question_id)
            if can_apply(row.status, row.applied_at):
                self._questions[question_id] = dataclasses.replace(
                    row, apply_error=text, apply_attempts=row.apply_attempts + 1,
                    retry_at=float(retry_at),
                )  # fmt: skip

    async def mark_applied(self, question_id: str) -> bool:
        """Apply question ``question_id``'s answer outside a harvest; False if it cannot be (Q3).

        ``answered`` becomes ``applied``; ``expired`` stays so; both get
        ``applied_at``. ``QuestionNotFound`` if absent.
        """
        with self._lock:
            row = self._question(question_id)
            if not can_apply(row.status, row.applied_at):
                return False
            self._questions[question_id] = dataclasses.replace(
                row, status=applied_status(row.status), applied_at=self._clock()
            )
            return True

    async def supersede(self, question_id: str) -> bool:
        """Mark question ``question_id`` ``superseded``; False if already applied or superseded.

        ``QuestionNotFound`` if absent.
        """
        with self._lock:
            row = self._question(question_id)
            if not can_supersede(row.status, row.applied_at):
                return False
            self._questions[question_id] = dataclasses.replace(
                row, status=QuestionStatus.SUPERSEDED
            )
            return True

    # -- the evolve ledger --------------------------------------------------------

    async def artifact_head(self, artifact_id: str) -> ArtifactVersion | None:
        """The newest version of ``artifact_id``, or None if it has none."""
        return self._artifacts.head(artifact_id)

    async def commit_artifact(
        self, artifact_id: str, expected: int, entries_json: str, meta_json: str = "{}"
    ) -> ArtifactVersion:
        """Store version ``expected + 1`` of ``artifact_id`` if its head is ``expected`` (0: none).

        ``entries_json``/``meta_json`` are stored as given; a stale ``expected``
        raises ``StaleVersion`` and writes nothing.
        """
        return self._artifacts.commit(artifact_id, expected, entries_json, meta_json)

    async def artifact_history(self, artifact_id: str) -> list[ArtifactVersion]:
        """Every version of ``artifact_id``, oldest first."""
        return self._artifacts.history(artifact_id)
