"""The store contract: one small abstract class, many backends (huey-style).

A store persists runs as *deltas*: the engine commits one :class:`Harvest`
per wake-up (D1), fenced by the run's lease token (D6). Every payload crosses
this seam already encoded as text, so stores never see Python objects and a
result that cannot be encoded fails before anything is written (D5).

:class:`RunStore` is documented here once. Its public methods check their
arguments (the rules in ``_rules``) and then call a backend's primitive of
the same name with a leading underscore, so a backend receives only checked
arguments and documents only what differs: its locking and its SQL. Stores
map their driver's exceptions to :class:`~tailrace.StoreError` (and its
subclasses) at this seam, in one place per backend; the engine never imports
a driver. The SQL both SQL backends share, migrations included, is in
``_sql``.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
from collections.abc import AsyncIterator

from ._records import (
    CHANGE_KINDS,
    ArtifactVersion,
    EventRow,
    FrozenInput,
    Harvest,
    NewRun,
    QuestionRow,
    QuestionStatus,
    Queue,
    QueueStats,
    ResultRow,
    RunCount,
    RunRecord,
    RunStatus,
    StoredRun,
    Submission,
    WorkerRow,
)


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
