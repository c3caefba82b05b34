"""The store contract: one small abstract class, many backends (huey-style).

A store persists runs as *deltas*: the engine commits one :class:`Harvest`
per wake-up (D1), fenced by the run's lease token (D6). Every payload crosses
this seam already encoded as text, so stores never see Python objects and a
result that cannot be encoded fails before anything is written (D5).

Stores map their driver's exceptions to :class:`~tailrace.StoreError` (and
its subclasses) at this seam; the engine never imports a driver. The rules
every backend applies live in ``_rules`` and the SQL both SQL backends share,
migrations included, in ``_sql``.
"""

from __future__ import annotations

import abc
import contextlib
import enum
import math
from collections.abc import AsyncIterator, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import NamedTuple

#: Version of the rows this code writes (D4). Bumped on incompatible change.
FORMAT_VERSION = 1


class RunStatus(enum.StrEnum):
    """Lifecycle of a run. Legal transitions live in ``RUN_TRANSITIONS``.

    ``queued``: submitted to a queue and not claimed by a worker yet.
    """

    QUEUED = "queued"
    RUNNING = "running"
    SUSPENDED = "suspended"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


RUN_TRANSITIONS: dict[RunStatus, frozenset[RunStatus]] = {
    RunStatus.QUEUED: frozenset({RunStatus.RUNNING, RunStatus.FAILED, RunStatus.CANCELLED}),
    RunStatus.RUNNING: frozenset(
        {
            RunStatus.RUNNING,
            RunStatus.SUSPENDED,
            RunStatus.COMPLETED,
            RunStatus.FAILED,
            RunStatus.CANCELLED,
        }
    ),
    RunStatus.SUSPENDED: frozenset({RunStatus.RUNNING, RunStatus.FAILED, RunStatus.CANCELLED}),
    RunStatus.COMPLETED: frozenset(),
    RunStatus.FAILED: frozenset(),
    RunStatus.CANCELLED: frozenset(),
}

TERMINAL_STATUSES = frozenset({RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED})
#: Statuses of a run that has not finished: a dedup key is live while its run is in one.
LIVE_STATUSES = frozenset({RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.SUSPENDED})


class QuestionStatus(enum.StrEnum):
    """Lifecycle of a question (Q2-Q5); legal moves are in ``QUESTION_TRANSITIONS``.

    ``answered`` and ``expired`` questions carry an answer that has not been
    applied yet when ``applied_at`` is None; applying moves ``answered`` to
    ``applied`` and stamps ``applied_at`` on both.
    """

    OPEN = "open"
    ANSWERED = "answered"
    APPLIED = "applied"
    SUPERSEDED = "superseded"
    EXPIRED = "expired"


QUESTION_TRANSITIONS: dict[QuestionStatus, frozenset[QuestionStatus]] = {
    QuestionStatus.OPEN: frozenset(
        {QuestionStatus.ANSWERED, QuestionStatus.EXPIRED, QuestionStatus.SUPERSEDED}
    ),
    QuestionStatus.ANSWERED: frozenset({QuestionStatus.APPLIED, QuestionStatus.SUPERSEDED}),
    QuestionStatus.EXPIRED: frozenset({QuestionStatus.EXPIRED, QuestionStatus.SUPERSEDED}),
    QuestionStatus.APPLIED: frozenset(),
    QuestionStatus.SUPERSEDED: frozenset(),
}


@dataclass(frozen=True, slots=True, kw_only=True)
class QuestionRow:
    """An open gate as stored: who asks what, and what was answered (Q1-Q5).

    ``turn`` is the run's turn when the question opened; ``deadline`` an
    absolute wall-clock time or None; ``poller`` names a machine gate's
    poller. ``run_id`` may name a LangGraph thread driven by tailrace.

    ``apply_error``, ``apply_attempts`` and ``retry_at`` record answers a
    daemon could not apply (see :meth:`RunStore.defer_answer`): the last
    reason, how many times applying failed, and when to try again. They stay
    as history once the question is applied or superseded.
    """

    question_id: str
    run_id: str
    node_id: str
    visit: int
    turn: int
    prompt_json: str
    poller: str | None = None
    deadline: float | None = None
    status: QuestionStatus = QuestionStatus.OPEN
    answer_json: str | None = None
    answered_by: str | None = None
    created_at: float = 0.0
    answered_at: float | None = None
    applied_at: float | None = None
    apply_error: str | None = None
    apply_attempts: int = 0
    retry_at: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ArtifactVersion:
    """One version of an evolving artifact (prompts, skills, rules) in the evolve ledger.

    ``version`` counts from 1; ``entries_json`` holds the artifact's keyed text
    entries; ``meta_json`` what produced it (the edit, scores, who merged it).
    """

    artifact_id: str
    version: int
    entries_json: str
    meta_json: str = "{}"
    created_at: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class NewRun:
    """What ``create_run`` stores for a new run."""

    run_id: str
    graph_name: str
    graph_ref: str | None
    fingerprint: str
    input_json: str
    created_at: float
    format_version: int = FORMAT_VERSION


@dataclass(frozen=True, slots=True, kw_only=True)
class RunRecord:
    """A run as stored (without its node rows)."""

    run_id: str
    graph_name: str
    graph_ref: str | None
    fingerprint: str
    status: RunStatus
    input_json: str
    state_json: str
    error: str | None
    created_at: float
    updated_at: float
    finished_at: float | None
    nodes_done: int
    lease_owner: str | None
    lease_expires: float | None
    lease_token: int
    format_version: int
    #: The queue the run was submitted to (None: started directly), and how it
    #: was submitted (see :class:`Submission`).
    queue_name: str | None = None
    priority: int = 0
    partition_key: str | None = None
    dedup_key: str | None = None
    cost: float | None = None
    estimate: float | None = None
    #: When it was submitted, and when a worker claimed it (None until then).
    queued_at: float | None = None
    started_at: float | None = None
    #: When someone asked to cancel it while it ran (its driver stops at its next harvest).
    cancel_requested_at: float | None = None


class NodeRow(NamedTuple):
    """The latest state of one node, encoded by the engine (``data_json``).

    Rows are named tuples, fields in column order: a harvest carries
    thousands, and a store binds them without a pass per field.
    """

    node_id: str
    status: str
    visits: int
    data_json: str


class ResultRow(NamedTuple):
    """The result of one node visit (append-only; never rewritten)."""

    node_id: str
    visit: int
    value_json: str


@dataclass(frozen=True, slots=True, kw_only=True)
class FrozenInput:
    """A first-k decision: the payload an aggregate activation fired with (E4)."""

    node_id: str
    activation: int
    payload_json: str


class EventRow(NamedTuple):
    """A durable event record; ``seq`` is unique and increasing per run."""

    seq: int
    type: str
    node_id: str | None
    visit: int | None
    attempt: int | None
    ts: float
    data_json: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Harvest:
    """Everything one harvest produces, committed atomically (D1)."""

    state_json: str
    status: RunStatus = RunStatus.RUNNING
    error: str | None = None
    nodes: Sequence[NodeRow] = ()
    results: Sequence[ResultRow] = ()
    frozen: Sequence[FrozenInput] = ()
    events: Sequence[EventRow] = ()
    nodes_done_delta: int = 0
    finished_at: float | None = None
    #: Questions opened by this harvest (status ``open``), inserted.
    questions: Sequence[QuestionRow] = ()
    #: Question ids whose answer this harvest applies: each must be ``answered``
    #: (becomes ``applied``) or ``expired`` with no ``applied_at``, else the whole
    #: harvest is refused with :class:`~tailrace.AlreadyAnswered` (Q3).
    applied: Sequence[str] = ()
    #: Question ids this harvest supersedes (``open``/``answered``/``expired`` -> ``superseded``).
    superseded: Sequence[str] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class StoredRun:
    """A run and all its node rows, as ``load_run`` returns it."""

    run: RunRecord
    nodes: dict[str, NodeRow] = field(default_factory=dict)


# --- queues and workers (scale-out: the store is the coordinator) -----------------

#: How a queue orders the runs it hands out: by submit time, by ``priority``
#: (higher first, then submit time), or longest estimated run first (``lpt``).
QUEUE_ORDERS = ("fifo", "priority", "lpt")


@dataclass(frozen=True, slots=True)
class Queue:
    """A named queue of runs and the limits every worker claiming from it keeps.

    Args:
        name: the queue's name (what ``submit(queue=...)`` names).
        concurrency: most runs of this queue running at once across all
            workers (None: no limit). A run holds its slot from its claim
            until it finishes or suspends on a gate; a run whose worker died
            keeps it until another worker, having adopted it, finishes it.
        worker_concurrency: most runs of this queue one worker process drives
            at once (None: only the worker's own ``concurrency``).
        limit: most runs started (claimed) per ``period`` seconds across all
            workers, a sliding window (None: no rate limit).
        period: the rate limit's window in seconds.
        order: ``"fifo"`` (submit order), ``"priority"`` (higher ``priority``
            first, then submit order) or ``"lpt"`` (longest estimated run
            first, then submit order; see ``Engine.submit``'s ``estimate``).

    Runs submitted with a ``partition`` key start one at a time per key, in
    submit order: the next one starts once the previous one finished.

    >>> Queue("emails", concurrency=10, limit=100, period=60.0)
    Queue(name='emails', concurrency=10, worker_concurrency=None, limit=100, period=60.0, order='fifo')
    """

    name: str
    _: KW_ONLY
    concurrency: int | None = None
    worker_concurrency: int | None = None
    limit: int | None = None
    period: float = 1.0
    order: str = "fifo"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"queue name must be a non-empty string, got {self.name!r}")
        for what in ("concurrency", "worker_concurrency", "limit"):
            value = getattr(self, what)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"queue {self.name!r}: {what} must be None or >= 1, got {value!r}")
        if (
            self.concurrency is not None
            and self.worker_concurrency is not None
            and self.worker_concurrency > self.concurrency
        ):
            raise ValueError(
                f"queue {self.name!r}: worker_concurrency {self.worker_concurrency} exceeds "
                f"concurrency {self.concurrency}"
            )
        if not (isinstance(self.period, int | float) and 0 < self.period < math.inf):
            raise ValueError(
                f"queue {self.name!r}: period must be a positive number of seconds, got {self.period!r}"
            )
        if self.order not in QUEUE_ORDERS:
            raise ValueError(
                f"queue {self.name!r}: order must be one of {', '.join(QUEUE_ORDERS)}, got {self.order!r}"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class Submission:
    """How a run is submitted to a queue (``submit_run``).

    ``queue`` names it; ``priority`` orders a ``priority`` queue (higher
    first); ``partition`` makes runs with the same key start one at a time in
    submit order; ``dedup_key`` makes a second submit with that key, while a
    run holding it is live (queued, running or suspended), return that run;
    ``cost`` is what the duration estimator was given and ``estimate`` the
    seconds it predicted (an ``lpt`` queue hands out the largest first).
    """

    queue: str
    priority: int = 0
    partition: str | None = None
    dedup_key: str | None = None
    cost: float | None = None
    estimate: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class RunCount:
    """How many runs of one graph, in one queue (None: submitted to none), have one status."""

    graph_name: str
    queue_name: str | None
    status: RunStatus
    count: int


@dataclass(frozen=True, slots=True, kw_only=True)
class QueueStats:
    """One queue as ``queue_stats`` sees it: declared limits and what its runs do now.

    ``queued``/``running``/``suspended`` count its runs in each status;
    ``started`` those claimed within the last ``window`` seconds; ``workers``
    the live workers that serve it; ``oldest_queued_at`` the submit time of
    the longest-waiting queued run (None when none waits).
    """

    name: str
    queue: Queue | None
    queued: int
    running: int
    suspended: int
    started: int
    window: float
    workers: int
    oldest_queued_at: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerRow:
    """A worker process as it last reported itself (``worker_seen``).

    ``worker_id`` is its lease owner name (``host:pid:start:nonce``);
    ``queues`` the queues it claims from; ``running`` how many runs it drove
    at ``seen_at``.
    """

    worker_id: str
    queues: tuple[str, ...]
    concurrency: int
    started_at: float
    seen_at: float
    running: int = 0


#: What a change feed reports: a run was submitted, a question answered, a
#: lease released (a run finished, suspended, or let go), a cancel requested.
CHANGE_KINDS = frozenset({"submit", "answer", "release", "cancel"})


class ChangeFeed(abc.ABC):
    """Wake-ups from the store (see :meth:`RunStore.changes`)."""

    @abc.abstractmethod
    async def wait(self, seconds: float) -> frozenset[str]:
        """The kinds of change (:data:`CHANGE_KINDS`) seen since the last call; empty after ``seconds`` with none.

        A kind may be reported when nothing of it changed (a fallback that
        polls reports them all); a change made after the feed opened is never
        missed.
        """


class PollingFeed(ChangeFeed):
    """The fallback feed: every ``interval`` seconds, it reports every kind."""

    def __init__(self, interval: float) -> None:
        self.interval = interval

    async def wait(self, seconds: float) -> frozenset[str]:
        """Sleep ``min(seconds, interval)``, then report every kind (or none if ``seconds`` was shorter)."""
        import asyncio

        await asyncio.sleep(max(0.0, min(seconds, self.interval)))
        return CHANGE_KINDS if seconds >= self.interval else frozenset()


class RunStore(abc.ABC):
    """Abstract run store. All methods are coroutines and safe to call concurrently.

    Leases (D6): ``acquire_lease`` grants a lease when none is live, returning a
    fencing token that increases on every change of owner; ``commit`` and
    ``heartbeat`` with a stale token raise :class:`~tailrace.LeaseLost`.

    Cancellation: every method is cancellation-safe. A cancelled call either
    did not happen or happened completely (never half a transaction), and a
    cancelled ``acquire_lease`` leaves no lease behind: a lease it granted is
    released before ``CancelledError`` propagates.

    Names: ids and names passed in (``run_id``, ``node_id``, question and
    artifact ids, ``owner``, ``steal_from``, ``by``, the names in a
    :class:`NewRun` or a :class:`Harvest`) must not contain NUL or a lone
    surrogate, which no database keeps as text: every store raises
    ``ValueError`` naming the field, before touching the database. Free-text
    error messages (``Harvest.error``, ``defer_answer``'s ``error``) are
    stored with those characters escaped instead (``\\x00``, ``\\udXXX``).
    JSON payloads are the codec's to keep clean (D5).

    Read-only stores: a backend constructed with ``read_only=True`` (see
    :func:`~tailrace.stores.open_store`) reads an existing database and never
    writes to it: ``open`` applies no migrations (a schema older than this
    code's is a clear :class:`~tailrace.StoreError`, a newer one
    :class:`~tailrace.UnsupportedFormat`, a missing database an error naming
    it), and every write method raises :class:`~tailrace.StoreError` with
    nothing written. Reading works next to a writer in another process.
    """

    @property
    def read_only(self) -> bool:
        """Whether this store was opened read-only (it then refuses every write)."""
        return False

    async def __aenter__(self) -> RunStore:
        await self.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    @abc.abstractmethod
    async def open(self) -> None:
        """Connect and apply pending numbered migrations (none when read-only). Idempotent.

        Opening a database that is already at this code's schema version takes
        no write lock: the version is read first, and only a database that
        needs migrating is migrated.
        """

    @abc.abstractmethod
    async def close(self) -> None:
        """Flush pending writes and release connections. Idempotent."""

    @abc.abstractmethod
    async def create_run(self, run: NewRun) -> None:
        """Store a new run with status ``running``; :class:`~tailrace.RunExists` if the id is taken."""

    @abc.abstractmethod
    async def commit(self, run_id: str, token: int, harvest: Harvest) -> None:
        """Apply ``harvest`` atomically if ``token`` is the run's current lease token.

        Raises :class:`~tailrace.LeaseLost` (nothing written) when fenced out,
        :class:`~tailrace.RunNotFound` for an unknown run.
        """

    @abc.abstractmethod
    async def load_run(self, run_id: str) -> StoredRun:
        """Return the run and its node rows; :class:`~tailrace.RunNotFound` if absent."""

    @abc.abstractmethod
    async def get_run(self, run_id: str) -> RunRecord:
        """Return the run record alone; :class:`~tailrace.RunNotFound` if absent."""

    @abc.abstractmethod
    async def list_runs(
        self,
        *,
        status: RunStatus | None = None,
        limit: int | None = None,
        queue: str | None = None,
        graph: str | None = None,
        offset: int = 0,
    ) -> list[RunRecord]:
        """Runs newest first (``created_at``, then ``run_id``): a page of them, for listings.

        Args:
            status: only runs with this status.
            limit: at most this many (None: all).
            queue: only runs submitted to this queue.
            graph: only runs of this graph name.
            offset: skip this many of the matching runs first.
        """

    @abc.abstractmethod
    async def run_counts(self) -> list[RunCount]:
        """How many runs there are per graph name, queue and status (one query: for dashboards)."""

    @abc.abstractmethod
    async def results(self, run_id: str, node_id: str | None = None) -> list[ResultRow]:
        """Result rows of a run (of one node if given), by node then visit."""

    @abc.abstractmethod
    async def frozen_inputs(self, run_id: str) -> list[FrozenInput]:
        """First-k decisions of a run, by node then activation."""

    @abc.abstractmethod
    async def events(self, run_id: str, *, after_seq: int = 0) -> list[EventRow]:
        """Events of a run with ``seq > after_seq``, in seq order."""

    @abc.abstractmethod
    async def acquire_lease(
        self, run_id: str, owner: str, ttl: float, *, steal_from: str | None = None
    ) -> int:
        """Lease the run to ``owner`` for ``ttl`` seconds and return the fencing token (D6).

        Args:
            run_id: the run to lease.
            owner: who takes the lease.
            ttl: seconds until the lease expires unless extended by ``heartbeat``.
            steal_from: take over a live lease held by exactly this owner (a
                compare-and-set on the holder): the caller proved it dead.

        Re-acquiring a live lease one already owns keeps its token. A live lease
        held by ``steal_from``, or an expired one, is taken over with a new,
        larger token, so the old holder's writes are fenced out. A live lease
        of any other owner raises :class:`~tailrace.LeaseHeld`, whose ``owner``
        and ``expires_at`` name the holder and when its lease ends, and whose
        message says what the user can do. :class:`~tailrace.RunNotFound` for
        an unknown run.
        """

    @abc.abstractmethod
    async def heartbeat(self, run_id: str, owner: str, token: int, ttl: float) -> None:
        """Extend the lease; :class:`~tailrace.LeaseLost` if ``token`` is no longer current."""

    @abc.abstractmethod
    async def release_lease(self, run_id: str, owner: str, token: int) -> None:
        """Drop the lease if still held with ``token``; otherwise do nothing."""

    # -- the question ledger (Q2-Q5) ---------------------------------------------

    @abc.abstractmethod
    async def answer(
        self,
        question_id: str,
        answer_json: str,
        *,
        by: str | None = None,
        status: QuestionStatus = QuestionStatus.ANSWERED,
    ) -> QuestionRow:
        """First answer wins: compare-and-set ``open -> status`` (Q2) and return the new row.

        ``status`` is ``answered`` (a person or poller) or ``expired`` (the
        deadline passed). A question that is not ``open`` raises
        :class:`~tailrace.AlreadyAnswered` and changes nothing; an unknown one
        :class:`~tailrace.QuestionNotFound`.
        """

    @abc.abstractmethod
    async def get_question(self, question_id: str) -> QuestionRow:
        """The question; :class:`~tailrace.QuestionNotFound` if absent."""

    @abc.abstractmethod
    async def list_questions(
        self,
        *,
        status: QuestionStatus | None = None,
        run_id: str | None = None,
        limit: int | None = None,
    ) -> list[QuestionRow]:
        """Questions, oldest first, filtered by ``status`` and ``run_id``, at most ``limit``."""

    @abc.abstractmethod
    async def unapplied_answers(
        self, *, limit: int = 100, now: float | None = None
    ) -> list[QuestionRow]:
        """Answered (or expired) questions whose answer is due to be applied (Q4).

        Args:
            limit: the most rows returned.
            now: wall-clock time deciding which deferred answers are due
                (default: the store's clock).

        Only answers not applied yet whose ``retry_at`` is None or at most
        ``now``. Fresh answers (``retry_at`` None) come first, oldest
        ``answered_at`` first; then deferred ones, earliest ``retry_at`` first
        (ties by question id). So answers a daemon cannot apply, once
        deferred, never hide one it can: however many are stuck, a new answer
        is at the head of the list.
        """

    @abc.abstractmethod
    async def defer_answer(self, question_id: str, *, error: str, retry_at: float) -> None:
        """Record that applying ``question_id``'s answer failed, and when to try again.

        Args:
            question_id: the question whose answer could not be applied.
            error: why; stored as ``apply_error`` (escaped, see above, and
                cut to 4000 characters).
            retry_at: wall-clock time before which ``unapplied_answers`` leaves
                the answer out; a finite number, else ``ValueError``.

        Increments ``apply_attempts``. Only a question whose answer is still
        unapplied (``answered``, or ``expired`` with no ``applied_at``) is
        changed, in one atomic update; on any other it does nothing.
        :class:`~tailrace.QuestionNotFound` if the question is unknown.
        """

    @abc.abstractmethod
    async def mark_applied(self, question_id: str) -> bool:
        """Outside a harvest (drivers of external graphs): apply-CAS; False if already applied or superseded.

        ``apply_error``/``apply_attempts``/``retry_at`` are kept as history.
        """

    @abc.abstractmethod
    async def supersede(self, question_id: str) -> bool:
        """Mark a question ``superseded`` unless applied; False if it already was final.

        ``apply_error``/``apply_attempts``/``retry_at`` are kept as history.
        """

    @abc.abstractmethod
    async def expired_leases(self, now: float, *, limit: int = 100) -> list[str]:
        """Ids of runs in status ``running`` whose lease expired before ``now`` (orphans)."""

    # -- the evolve ledger ----------------------------------------------------------

    @abc.abstractmethod
    async def artifact_head(self, artifact_id: str) -> ArtifactVersion | None:
        """The newest version of ``artifact_id``, or None if it has none."""

    @abc.abstractmethod
    async def commit_artifact(
        self, artifact_id: str, expected: int, entries_json: str, meta_json: str = "{}"
    ) -> ArtifactVersion:
        """Compare-and-set: store version ``expected + 1`` if the head is ``expected``.

        ``expected`` is 0 for the first version. A stale ``expected`` (someone
        committed first) raises :class:`~tailrace.StaleVersion` and writes
        nothing. ``entries_json``/``meta_json`` are stored as given.
        """

    @abc.abstractmethod
    async def artifact_history(self, artifact_id: str) -> list[ArtifactVersion]:
        """Every version of ``artifact_id``, oldest first."""

    # -- queues, claims and workers (scale-out) ----------------------------------
    #
    # The store is the coordinator: a run submitted to a queue is stored
    # ``queued``; a worker *claims* runs, which atomically checks the queue's
    # limits (declared with ``declare_queue``), marks them ``running`` and
    # leases them to the worker, so no two workers ever get the same run.
    # Postgres claims with ``FOR UPDATE SKIP LOCKED`` (and a per-queue
    # advisory lock while a limit needs counting); SQLite in one ``BEGIN
    # IMMEDIATE`` transaction; memory under its lock.

    @abc.abstractmethod
    async def submit_run(self, run: NewRun, submission: Submission) -> str:
        """Store ``run`` as ``queued`` in ``submission.queue`` and return its id.

        If ``submission.dedup_key`` is held by a live run of that queue
        (queued, running or suspended), nothing is stored and that run's id
        is returned instead. :class:`~tailrace.RunExists` if ``run.run_id`` is
        taken. Wakes workers waiting on the queue (a ``submit`` change).
        """

    @abc.abstractmethod
    async def claim_runs(self, queue: str, owner: str, ttl: float, *, limit: int) -> list[str]:
        """Claim up to ``limit`` queued runs of ``queue`` for ``owner`` and return their ids, in queue order.

        Args:
            queue: the queue to claim from; its declared :class:`Queue` (or
                the defaults, if never declared) gives the order and limits.
            owner: the worker claiming (its lease owner name).
            ttl: seconds the leases last unless renewed.
            limit: the most runs to claim.

        Atomically: the queue's ``concurrency`` is never exceeded (counting
        its runs ``running``, and ``suspended`` ones whose lease is live),
        nor its rate ``limit`` (runs with ``started_at`` within ``period``),
        runs with a partition key start one at a time in submit order, and
        each claimed run becomes ``running``, gets ``started_at``, and is
        leased to ``owner`` with a new fencing token (D6). A run is claimed
        by one caller only, across processes and hosts.
        """

    @abc.abstractmethod
    async def claim_answers(self, owner: str, ttl: float, *, limit: int) -> list[QuestionRow]:
        """Lease up to ``limit`` suspended runs that have an answer due, to ``owner``; one due question per run.

        Args:
            owner: the worker claiming.
            ttl: seconds the leases last.
            limit: the most runs.

        Only runs with no live lease are taken (so a run is resumed by one
        worker, Q3), answers in :meth:`unapplied_answers` order. A run of a
        queue with a ``concurrency`` limit is taken only while the queue has
        a free slot (its lease then holds the slot). The caller applies the
        answer and releases the lease.
        """

    @abc.abstractmethod
    async def request_cancel(self, run_id: str) -> RunStatus:
        """Cancel a queued run now, or ask its driver to cancel a running or suspended one; return the status now.

        A ``queued`` run becomes ``cancelled`` atomically (no worker can
        claim it any more). A ``running`` or ``suspended`` run gets
        ``cancel_requested_at`` (kept if already set) and stays as it is: its
        driver (or whoever takes its lease) ends it. A finished run is left
        as it is. Wakes workers (a ``cancel`` change).
        :class:`~tailrace.RunNotFound` if absent.
        """

    @abc.abstractmethod
    async def cancel_requests(self, owner: str) -> list[str]:
        """Ids of ``running`` runs leased to ``owner`` with a cancel request."""

    @abc.abstractmethod
    async def runs_leased_by(self, owner: str, *, limit: int = 100) -> list[str]:
        """Ids of ``running`` runs whose lease ``owner`` holds (live or not), at most ``limit``."""

    @abc.abstractmethod
    async def declare_queue(self, queue: Queue) -> None:
        """Store ``queue``'s limits (replacing an earlier declaration); every claim from it keeps them."""

    @abc.abstractmethod
    async def queues(self) -> list[Queue]:
        """Every declared queue, by name."""

    @abc.abstractmethod
    async def queue_stats(self, now: float, *, window: float = 60.0) -> list[QueueStats]:
        """Declared queues and queues that have runs, by name, with their counts at ``now``.

        ``started`` counts runs claimed within ``window`` seconds before
        ``now``; ``workers`` the workers seen within ``window`` that serve
        the queue.
        """

    @abc.abstractmethod
    async def worker_seen(self, worker: WorkerRow) -> None:
        """Record (insert or replace) ``worker``'s report of itself."""

    @abc.abstractmethod
    async def workers(self) -> list[WorkerRow]:
        """Every worker that reported itself and was not forgotten, by id."""

    @abc.abstractmethod
    async def forget_worker(self, worker_id: str) -> None:
        """Drop ``worker_id``'s report (it stopped, or died and its runs were adopted)."""

    @abc.abstractmethod
    async def run_durations(
        self, fingerprint: str, *, limit: int = 200
    ) -> list[tuple[float, float]]:
        """``(cost, seconds)`` of the latest completed queued runs of the graph ``fingerprint``, newest first.

        ``seconds`` runs from the claim to the finish; a run submitted with no
        cost has cost 0. For the duration estimator an ``lpt`` queue orders by.
        """

    def changes(self) -> contextlib.AbstractAsyncContextManager[ChangeFeed]:
        """A feed of wake-ups: ``async with store.changes() as feed: kinds = await feed.wait(1.0)``.

        Postgres delivers ``LISTEN/NOTIFY`` notifications sent by
        ``submit_run``, ``answer``, ``release_lease`` and ``request_cancel``
        (falling back to polling while its listening connection is down);
        SQLite checks ``PRAGMA data_version`` every few milliseconds and reads
        which kind changed from a small ``signals`` table those writes bump;
        memory delivers them as they happen. This default polls (a
        :class:`PollingFeed` of 50 ms), for stores that have nothing better.
        """
        return _polling_changes()


@contextlib.asynccontextmanager
async def _polling_changes() -> AsyncIterator[ChangeFeed]:
    yield PollingFeed(0.05)
