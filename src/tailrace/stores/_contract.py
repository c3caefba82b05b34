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
from collections.abc import AsyncIterator, Collection, Sequence

from ._artifacts import check_expected
from ._queue_rules import check_claim, check_worker, first_schedule, graph_keys, utc_minute
from ._records import (
    CHANGE_KINDS,
    MAX_LIMIT,
    ArtifactVersion,
    ChunkRow,
    Claim,
    EventRow,
    FrozenInput,
    GraphRow,
    Harvest,
    Lapse,
    NewRun,
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
    check_limit,
)
from ._rules import (
    answer_status,
    check_apply_deferral,
    check_cursor,
    check_harvest,
    check_name,
    check_names,
    check_new_format,
    check_ttl,
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


class Presence(abc.ABC):
    """A worker's presence in the fleet (:meth:`RunStore.presence`, W7).

    ``session`` is the store session the worker is alive with: one per store
    object, held while any worker of it is present.
    """

    session: str

    @abc.abstractmethod
    async def lapse(self) -> Lapse:
        """Wait until the session ended while the worker was present and was taken back.

        The :class:`~tailrace.stores.Lapse` says whether the fleet buried the
        session meanwhile: then the worker's leases were expired and fenced,
        and what it still drives must stop (its runs are adopted elsewhere).
        """


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

    async def create_run(self, run: NewRun) -> None:
        """Store a new run with status ``running``; :class:`~tailrace.RunExists` if the id is taken.

        Its graph's structure (``run.shape_json``) is kept with it unless that
        version's is kept already; a fork's origin (``forked_from``,
        ``forked_at``) is stored with the run (V4); ``queue_name``, when
        given, puts it on that queue (never claimed: it is running), so once
        it suspends on its children, their ends queue it again (R4).
        """
        check_new_format(run)
        check_names(
            run_id=run.run_id, graph_name=run.graph_name, graph_ref=run.graph_ref,
            fingerprint=run.fingerprint, forked_from=run.forked_from, forked_at=run.forked_at,
            parent_run_id=run.parent_run_id, queue_name=run.queue_name,
        )  # fmt: skip
        await self._create_run(run)

    async def commit(self, run_id: str, token: int, harvest: Harvest) -> bool:
        """Apply ``harvest`` atomically if ``token`` is the run's current lease token.

        A harvest that ends the run (completed, failed, cancelled) lets go of
        its lease in the same write, with a ``release`` wake-up, as one that
        suspends it on its children does (R4): no :meth:`release_lease` of its
        own is needed after it (one is harmless: it finds nothing held).

        Returns whether a cancel of the run is requested (:meth:`request_cancel`),
        read in the same transaction: the process driving a run hears a cancel
        asked from any process at its next commit (W5). False when that cannot
        be known (a Postgres commit whose answer was lost and that turned out
        to have landed); the driver's lease heartbeat hears it then.

        Raises :class:`~tailrace.LeaseLost` (nothing written) when fenced out,
        :class:`~tailrace.RunNotFound` for an unknown run.
        """
        check_harvest(run_id, harvest)
        return await self._commit(run_id, token, harvest)

    async def load_run(self, run_id: str) -> StoredRun:
        """Return the run and its node rows; :class:`~tailrace.RunNotFound` if absent."""
        check_name("run_id", run_id)
        return await self._load_run(run_id)

    async def snapshot(self, run_id: str) -> RunSnapshot:
        """The run as of one moment (one read): its record, node rows and map items' rows,
        result rows, first-k decisions and stream rows, none written after another was
        read, while the run may still be running. A fork copies its source from it (V4).
        :class:`~tailrace.RunNotFound` if absent.
        """
        check_name("run_id", run_id)
        return await self._snapshot(run_id)

    async def get_run(self, run_id: str) -> RunRecord:
        """Return the run record alone; :class:`~tailrace.RunNotFound` if absent."""
        check_name("run_id", run_id)
        return await self._get_run(run_id)

    async def list_runs(
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
        """Runs newest first (``created_at``, then ``run_id``): a page of them, for listings.

        Args:
            status: only runs with this status.
            limit: at most this many (None: all).
            queue: only runs submitted to this queue.
            graph: only runs of this graph name.
            offset: skip this many of the matching runs first.
            parent: only the child runs of this run (R1).
            top_level: only runs that are no run's child (R1); not with ``parent``.
        """
        check_names(queue=queue, graph=graph, parent=parent)
        if top_level and parent is not None:
            raise ValueError(f"top_level lists no run's children, so not those of {parent!r}")
        return await self._list_runs(
            status=status, limit=limit, queue=queue, graph=graph, offset=offset, parent=parent,
            top_level=top_level,
        )  # fmt: skip

    async def wake_suspended(self, run_id: str) -> bool:
        """Queue ``run_id`` again if it is suspended on a queue and nobody holds it; True if it was.

        A run that suspended waiting on its child runs is queued again when
        one of them ends (R4): a child's final commit does this in its own
        transaction, and the parent calls it after it suspended, for a child
        that ended meanwhile. Workers are woken (a ``submit`` change).
        """
        check_name("run_id", run_id)
        return await self._wake_suspended(run_id)

    async def overdue_runs(self, now: float, *, limit: int = 100) -> list[str]:
        """Queued and suspended runs whose ``deadline`` is at or before ``now`` (R6), soonest first.

        Nobody drives them, so a worker's sweep cancels them; a running run's
        own driver cancels it at its deadline.
        """
        return await self._overdue_runs(now, limit=limit)

    async def run_counts(self, *, top_level: bool = False) -> list[RunCount]:
        """How many runs there are per graph name, queue and status (one query: for dashboards);
        with ``top_level``, of the runs that are no run's child only (R1)."""
        return await self._run_counts(top_level=top_level)

    async def results(self, run_id: str, node_id: str | None = None) -> list[ResultRow]:
        """Result rows of a run (of one node if given), by node then visit."""
        check_names(run_id=run_id, node_id=node_id)
        return await self._results(run_id, node_id)

    async def outputs(self, run_ids: Sequence[str]) -> dict[str, str]:
        """The encoded outputs of those of ``run_ids`` that completed with one stored, by id.

        A child run's final commit stores its output (R1), so its parent reads
        the outputs of many children in one query rather than each one's node
        and result rows; a run that stored none (not a child, not completed, or
        completed by an older tailrace) is left out.
        """
        for run_id in run_ids:
            check_name("run_id", run_id)
        if not run_ids:
            return {}
        return await self._outputs(sorted(set(run_ids)))

    async def frozen_inputs(self, run_id: str) -> list[FrozenInput]:
        """First-k decisions of a run, by node then activation."""
        check_name("run_id", run_id)
        return await self._frozen_inputs(run_id)

    async def events(self, run_id: str, *, after_seq: int = 0) -> list[EventRow]:
        """Events of a run with ``seq > after_seq``, in seq order."""
        check_name("run_id", run_id)
        return await self._events(run_id, after_seq=after_seq)

    async def chunks(self, run_id: str, *, after: int = 0, limit: int = 1000) -> list[ChunkRow]:
        """Stream rows of a run with ``seq > after``, in seq order, at most ``limit`` (S3).

        Stream rows are written by :meth:`commit` (``Harvest.chunks``), in the
        transaction of the harvest that produced them, and each commit that
        carries some sends a ``stream`` change (:meth:`changes`). A reader
        resumes from the last ``seq`` it saw, with no gap and no repeat.
        :class:`~tailrace.RunNotFound` for an unknown run.
        """
        check_name("run_id", run_id)
        check_cursor(after, limit)
        return await self._chunks(run_id, after=after, limit=limit)

    async def stream_tails(
        self, run_id: str, *, chars: int, limit: int = MAX_LIMIT
    ) -> list[StreamTail]:
        """Each stream of a run as its last rows only, in the order the streams began (S1-S3).

        Args:
            run_id: the run whose streams are read.
            chars: how much text each stream's tail holds: its last rows, the fewest
                whose ``data_json`` hold more than ``chars`` characters together (all
                of them if the stream holds no more), its terminal mark included.
            limit: at most this many streams, the first ones.

        A reader that shows the end of each attempt's stream reads what it shows,
        not every row streamed; :attr:`StreamTail.chunks` still counts them all.
        :class:`~tailrace.RunNotFound` for an unknown run.
        """
        check_name("run_id", run_id)
        if not isinstance(chars, int) or isinstance(chars, bool) or not 0 <= chars < 2**62:
            raise ValueError(f"chars must be an int from 0 below 2**62, got {chars!r}")
        check_limit("limit", limit)
        return await self._stream_tails(run_id, chars=chars, limit=limit)

    async def stream_head(self, run_id: str) -> StreamHead:
        """The run's last stream row ``seq`` and its streams left with no terminal mark (S2).

        An engine resuming or adopting a run reads it to number new rows after
        the stored ones and to mark each cut attempt's stream ``discarded``.
        """
        check_name("run_id", run_id)
        return await self._stream_head(run_id)

    async def prune_streams(self, *, finished_before: float) -> int:
        """Delete the stream rows of runs that ended (completed, failed, cancelled) before a time.

        The retention rule: stream rows are kept until pruned; nothing of a
        live or suspended run is deleted. Returns how many rows were deleted.
        """
        if not isinstance(finished_before, (int, float)) or isinstance(finished_before, bool):
            raise ValueError(f"finished_before must be a time in seconds, got {finished_before!r}")
        return await self._prune_streams(float(finished_before))

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
        check_ttl(ttl)
        check_names(run_id=run_id, owner=owner, steal_from=steal_from)
        return await self._acquire_lease(run_id, owner, ttl, steal_from=steal_from)

    async def heartbeat(self, run_id: str, owner: str, token: int, ttl: float) -> None:
        """Extend the lease; :class:`~tailrace.LeaseLost` if ``token`` is no longer current."""
        check_ttl(ttl)
        check_names(run_id=run_id, owner=owner)
        await self._heartbeat(run_id, owner, token, ttl)

    async def release_lease(self, run_id: str, owner: str, token: int) -> None:
        """Drop the lease if still held with ``token``; otherwise do nothing."""
        check_names(run_id=run_id, owner=owner)
        await self._release_lease(run_id, owner, token)

    # -- graph versions (V1-V3) ---------------------------------------------------

    async def move_run(
        self,
        run_id: str,
        owner: str,
        token: int,
        *,
        fingerprint: str,
        graph_ref: str | None,
        expected: str,
    ) -> None:
        """Move the live run ``run_id`` onto another version of its graph (V2), in one transaction.

        Args:
            run_id: the run (``running`` or ``suspended``, else
                :class:`~tailrace.NotResumable`).
            owner: who holds its lease; the move is fenced like a commit (D6):
                :class:`~tailrace.LeaseLost`, nothing written, unless ``owner``
                holds it with ``token``.
            token: the lease's fencing token.
            fingerprint: the version moved to; ``graph_ref`` the reference
                stored with it.
            graph_ref: ``module:attribute`` of the new version, or None.
            expected: the version the caller checked the run against: a run
                on another one by now raises :class:`~tailrace.GraphMismatch`.
        """
        check_names(
            run_id=run_id, owner=owner, fingerprint=fingerprint, graph_ref=graph_ref,
            expected=expected,
        )  # fmt: skip
        await self._move_run(
            run_id, owner, token, fingerprint=fingerprint, graph_ref=graph_ref, expected=expected
        )

    async def frontiers(self, graph_name: str) -> dict[str, tuple[str, ...]]:
        """Per live (``running`` or ``suspended``) run of graph ``graph_name``: the ids of its
        nodes that have a row (what it ran or holds state for, V1), in one query."""
        check_name("graph_name", graph_name)
        return await self._frontiers(graph_name)

    async def graph_shape(self, graph_name: str, fingerprint: str) -> str | None:
        """The structure (``graph_shape`` JSON) of a graph version runs were stored with, or None.

        Kept once per graph name and fingerprint by ``create_run`` and
        ``submit_run`` when the :class:`NewRun` carries it, so a changed graph
        can be checked against a run without the old code (V1).
        """
        check_names(graph_name=graph_name, fingerprint=fingerprint)
        return await self._graph_shape(graph_name, fingerprint)

    # -- the question ledger (Q2-Q5) ---------------------------------------------

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
        status = answer_status(question_id, status)
        check_name("question_id", question_id)
        check_name("by", by, context=f"question {question_id!r}: ")
        return await self._answer(question_id, answer_json, by=by, status=status)

    async def get_question(self, question_id: str) -> QuestionRow:
        """The question; :class:`~tailrace.QuestionNotFound` if absent."""
        check_name("question_id", question_id)
        return await self._get_question(question_id)

    async def list_questions(
        self,
        *,
        status: QuestionStatus | None = None,
        run_id: str | None = None,
        limit: int | None = None,
        offset: int = 0,
    ) -> list[QuestionRow]:
        """Questions, oldest first, filtered by ``status`` and ``run_id``, at most ``limit``,
        after skipping ``offset`` of them (a page)."""
        check_name("run_id", run_id)
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
            raise ValueError(f"offset must be an integer >= 0, got {offset!r}")
        return await self._list_questions(status=status, run_id=run_id, limit=limit, offset=offset)

    # -- parked items (P3, P4) --------------------------------------------------

    async def list_parked(
        self,
        *,
        graph_name: str | None = None,
        node_id: str | None = None,
        status: ParkedStatus | None = ParkedStatus.PARKED,
        claimed_by: str | None = None,
        run_id: str | None = None,
    ) -> list[ParkedRow]:
        """Parked items (P4), oldest first: of ``graph_name`` and ``node_id`` when given, in
        ``status`` (default ``parked``; None: every status), claimed by ``claimed_by``, parked
        by run ``run_id`` (an indexed read: a run's own items, not its graph's)."""
        for name, value in (("graph_name", graph_name), ("node_id", node_id),
                            ("claimed_by", claimed_by), ("run_id", run_id)):  # fmt: skip
            check_name(name, value)
        return await self._list_parked(
            graph_name=graph_name,
            node_id=node_id,
            status=None if status is None else ParkedStatus(status),
            claimed_by=claimed_by,
            run_id=run_id,
        )

    async def claim_parked(
        self, graph_name: str, node_id: str, claimant: str, *, limit: int = MAX_LIMIT
    ) -> list[ParkedRow]:
        """Claim parked items of ``graph_name``'s ``node_id`` for ``claimant`` (a map visit),
        oldest first, until it holds ``limit`` of them, each for exactly one claimant across
        processes (P4).

        Returns every item ``claimant`` holds, so a claimer that crashed and
        claims again gets the same items back (and no more than ``limit``).
        """
        for name, value in (("graph_name", graph_name), ("node_id", node_id),
                            ("claimant", claimant)):  # fmt: skip
            _check_text(name, value)
        check_limit("limit", limit)
        return await self._claim_parked(graph_name, node_id, claimant, limit)

    async def unclaim_parked(self, claimant: str, park_ids: Sequence[str]) -> int:
        """Give back to ``parked`` the items of ``park_ids`` that ``claimant`` holds (P4): how
        many went back.

        An item keeps its place in parked order (its ``parked_at``) and any map
        may claim it again. Items claimed by another claimant, dropped or
        parked are left as they are, so giving back twice changes nothing. A
        harvest gives back atomically with its other writes through
        ``Harvest.unclaimed``; this is the same change on its own.
        """
        _check_text("claimant", claimant)
        for park_id in park_ids:
            _check_text("park_id", park_id)
        return await self._unclaim_parked([(claimant, park_id) for park_id in park_ids])

    async def drop_parked(self, park_id: str) -> bool:
        """Drop parked item ``park_id`` (P4): whether it was still parked (claimed or dropped
        ones stay as they are)."""
        _check_text("park_id", park_id)
        return await self._drop_parked(park_id)

    async def question_counts(self) -> dict[QuestionStatus, int]:
        """How many questions there are in each status (one query: for dashboards' headers)."""
        return await self._question_counts()

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
        return await self._unapplied_answers(limit=limit, now=now)

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
        check_name("question_id", question_id)
        error = check_apply_deferral(question_id, error, retry_at)
        retry_at = float(retry_at)
        await self._defer_answer(question_id, error=error, retry_at=retry_at)

    async def mark_applied(self, question_id: str) -> bool:
        """Outside a harvest (drivers of external graphs): apply-CAS; False if already applied or superseded.

        ``apply_error``/``apply_attempts``/``retry_at`` are kept as history.
        """
        check_name("question_id", question_id)
        return await self._mark_applied(question_id)

    async def supersede(self, question_id: str) -> bool:
        """Mark a question ``superseded`` unless applied; False if it already was final.

        ``apply_error``/``apply_attempts``/``retry_at`` are kept as history.
        """
        check_name("question_id", question_id)
        return await self._supersede(question_id)

    async def expired_leases(self, now: float, *, limit: int = 100) -> list[str]:
        """Ids of runs in status ``running`` whose lease expired before ``now`` (orphans)."""
        return await self._expired_leases(now, limit=limit)

    # -- the evolve ledger ----------------------------------------------------------

    async def artifact_head(self, artifact_id: str) -> ArtifactVersion | None:
        """The newest version of ``artifact_id``, or None if it has none."""
        check_name("artifact_id", artifact_id)
        return await self._artifact_head(artifact_id)

    async def commit_artifact(
        self, artifact_id: str, expected: int, entries_json: str, meta_json: str = "{}"
    ) -> ArtifactVersion:
        """Compare-and-set: store version ``expected + 1`` if the head is ``expected``.

        ``expected`` is 0 for the first version. A stale ``expected`` (someone
        committed first) raises :class:`~tailrace.StaleVersion` and writes
        nothing. ``entries_json``/``meta_json`` are stored as given.
        """
        check_expected(artifact_id, expected)
        return await self._commit_artifact(artifact_id, expected, entries_json, meta_json)

    async def artifact_history(self, artifact_id: str) -> list[ArtifactVersion]:
        """Every version of ``artifact_id``, oldest first."""
        check_name("artifact_id", artifact_id)
        return await self._artifact_history(artifact_id)

    # -- queues, claims and workers (scale-out) ----------------------------------
    #
    # The store is the coordinator: a run submitted to a queue is stored
    # ``queued``; a worker *claims* runs, which atomically checks the queue's
    # limits (declared with ``declare_queue``), marks them ``running`` and
    # leases them to the worker, so no two workers ever get the same run.
    # Postgres claims with ``FOR UPDATE SKIP LOCKED`` (and a per-queue
    # advisory lock while a limit needs counting); SQLite in one ``BEGIN
    # IMMEDIATE`` transaction; memory under its lock.

    async def submit_run(self, run: NewRun, submission: Submission) -> str:
        """Store ``run`` as ``queued`` in ``submission.queue`` and return its id.

        If ``submission.dedup_key`` is held by a live run of that queue
        (queued, running or suspended), nothing is stored and that run's id
        is returned instead. :class:`~tailrace.RunExists` if ``run.run_id`` is
        taken. Wakes workers waiting on the queue (a ``submit`` change).
        """
        check_new_format(run)
        q = submission
        check_names(
            run_id=run.run_id, graph_name=run.graph_name, graph_ref=run.graph_ref,
            fingerprint=run.fingerprint, queue=q.queue, partition=q.partition,
            dedup_key=q.dedup_key,
        )  # fmt: skip
        return await self._submit_run(run, submission)

    async def submit_runs(self, runs: Sequence[tuple[NewRun, Submission]]) -> list[str]:
        """Store each ``(run, submission)`` as ``queued``, all in one transaction; return the
        ids it stored.

        For many runs submitted at once (a map's child runs): one write and one
        wake-up of the workers for all. A run whose id is taken is left as it
        is and skipped (a run submitted before, e.g. by an earlier attempt of
        the same node). Dedup keys are not taken here (``ValueError``): use
        :meth:`submit_run`.
        """
        _check_many(runs)
        if not runs:
            return []
        stored, _ = await self._submit_runs(runs, None, ())
        return stored

    async def submit_and_claim(
        self, runs: Sequence[tuple[NewRun, Submission]], claim: Claim
    ) -> tuple[list[str], list[str]]:
        """:meth:`submit_runs`, then :meth:`claim_runs` as ``claim`` says, in the same
        transaction; returns (the ids stored, the ids claimed).

        For a worker whose run submits child runs to a queue it serves while
        it has free slots: it drives them itself from this write on, with no
        wake-up and no claim round between (as Temporal's eager activities).
        The claim is the one :meth:`claim_runs` makes, with its order and
        limits, so runs queued before these still come first, and a paused or
        full queue hands out nothing. The workers are woken only when a run
        submitted here is left queued.
        """
        _check_many(runs)
        check_claim(claim.queue, claim.owner, claim.ttl, claim.limit)
        skip = graph_keys(claim.skip)
        if not runs:
            return [], []
        return await self._submit_runs(runs, claim if claim.limit > 0 else None, skip)

    async def claim_runs(
        self,
        queue: str,
        owner: str,
        ttl: float,
        *,
        limit: int,
        graphs: Collection[tuple[str, str]] | None = None,
        skip: Collection[tuple[str, str]] = (),
    ) -> list[str]:
        """Claim up to ``limit`` queued runs of ``queue`` for ``owner`` and return their ids, in queue order.

        Args:
            queue: the queue to claim from; its declared :class:`Queue` (or
                the defaults, if never declared) gives the order and limits.
            owner: the worker claiming (its lease owner name).
            ttl: seconds the leases last unless renewed.
            limit: the most runs to claim.
            graphs: when given, only runs of these graphs, each a (graph
                name, fingerprint) pair, are claimed: a worker claims only
                what it can drive, and leaves the rest to workers that can.
            skip: runs of these graphs (the same pairs) are not claimed: those
                a worker found it cannot drive (see :meth:`return_claim`).

        Atomically: the queue's ``concurrency`` is never exceeded (counting
        its runs ``running``, and ``suspended`` ones whose lease is live),
        nor its rate ``limit`` (runs with ``started_at`` within ``period``);
        runs with a partition key start in submit order within their key,
        within ``partition_concurrency`` and ``partition_limit``, and
        partitions take turns (the order of :class:`Queue`, W2); a paused
        queue hands out nothing; each claimed run becomes ``running``, gets
        ``started_at``, and is leased to ``owner`` with a new fencing token
        (D6). A run is claimed by one caller only, across processes and hosts.
        """
        check_claim(queue, owner, ttl, limit)
        keys = None if graphs is None else graph_keys(graphs)
        if limit <= 0 or keys == ():
            return []
        return await self._claim_runs(
            queue, owner, ttl, limit=limit, graphs=keys, skip=graph_keys(skip)
        )

    async def return_claim(self, run_id: str, owner: str) -> bool:
        """Give ``run_id``, claimed by ``owner`` and not started, back to its queue; True if it was.

        For a claimant that cannot drive the run (its graph or an executor it
        names is not at hand): the run is ``queued`` again, with no lease and
        no ``started_at``, so another worker claims it. Refused (False) when
        ``owner`` does not hold it, it is not ``running``, or it recorded any
        event (it started: it is resumed, never re-queued). Workers are woken.
        """
        check_name("run_id", run_id)
        check_name("owner", owner)
        return await self._return_claim(run_id, owner)

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
        check_name("owner", owner)
        check_ttl(ttl)
        if limit <= 0:
            return []
        return await self._claim_answers(owner, ttl, limit=limit)

    async def request_cancel(self, run_id: str) -> RunStatus:
        """Cancel a queued run now, or ask its driver to cancel a running or suspended one; return the status now.

        A ``queued`` run becomes ``cancelled`` atomically (no worker can
        claim it any more). A ``running`` or ``suspended`` run gets
        ``cancel_requested_at`` (kept if already set) and stays as it is: its
        driver (or whoever takes its lease) ends it. A finished run is left
        as it is. Wakes workers (a ``cancel`` change).
        :class:`~tailrace.RunNotFound` if absent.
        """
        check_name("run_id", run_id)
        return await self._request_cancel(run_id)

    async def reopen_cancelled(
        self, run_id: str, owner: str, ttl: float, *, nodes: Collection[str] = ()
    ) -> bool:
        """Make the cancelled run ``run_id`` running again, leased to ``owner`` (W5); True if it was cancelled.

        Atomically: the run becomes ``running`` (no ``finished_at``, no cancel
        request), leased to ``owner`` for ``ttl`` seconds with a new fencing
        token, and each of ``nodes`` recorded ``cancelled`` becomes
        ``queued``, so whoever restores the run next runs them again (D3).
        False (nothing changed) when the run is not cancelled;
        :class:`~tailrace.RunNotFound` if absent.
        """
        check_name("run_id", run_id)
        check_name("owner", owner)
        check_ttl(ttl)
        for node in nodes:
            check_name("node_id", node)
        return await self._reopen_cancelled(run_id, owner, ttl, tuple(nodes))

    async def cancel_requests(self, owner: str) -> list[str]:
        """Ids of ``running`` runs leased to ``owner`` with a cancel request."""
        check_name("owner", owner)
        return await self._cancel_requests(owner)

    async def runs_leased_by(self, owner: str, *, limit: int = 100) -> list[str]:
        """Ids of ``running`` runs whose lease ``owner`` holds (live or not), at most ``limit``."""
        check_name("owner", owner)
        return await self._runs_leased_by(owner, limit=limit)

    async def declare_queue(self, queue: Queue) -> None:
        """Store ``queue``'s limits (replacing an earlier declaration); every claim from it keeps them."""
        check_name("queue", queue.name)
        await self._declare_queue(queue)

    async def queues(self) -> list[Queue]:
        """Every declared queue, by name."""
        return await self._queues()

    async def pause_queue(self, name: str) -> None:
        """Pause queue ``name``: claims hand out none of its queued runs until :meth:`resume_queue` (W2).

        Submits are still stored, and runs already started go on (answers
        resume them). A queue never declared is declared with the defaults;
        a later :meth:`declare_queue` keeps the pause. Idempotent.
        """
        check_name("queue", name)
        await self._pause_queue(name)

    async def resume_queue(self, name: str) -> bool:
        """Lift the pause of queue ``name``; True if it was paused (workers are woken)."""
        check_name("queue", name)
        return await self._resume_queue(name)

    async def delete_queue(self, name: str) -> bool:
        """Drop the declaration of queue ``name`` (its limits, its pause); True if it had one.

        Refused with :class:`~tailrace.QueueNotEmpty` (nothing changed) while
        the queue holds a live run (queued, running or suspended). Finished
        runs keep their queue's name.
        """
        check_name("queue", name)
        return await self._delete_queue(name)

    async def register_graph(self, row: GraphRow) -> None:
        """Record that a worker can drive the graph version ``row`` names.

        A version registered before keeps the time of its first registration
        (its deploy) and takes ``row``'s reference: a worker of an earlier
        version that starts again never makes it the newest. A version new to
        the store is recorded at ``row.registered_at``, or just after the newest
        version of its name when that clock is behind, so it is the newest.
        """
        check_names(graph_name=row.name, fingerprint=row.fingerprint, graph_ref=row.graph_ref)
        await self._register_graph(row)

    async def register_worker_graphs(
        self, worker_id: str, graphs: Collection[tuple[str, str]]
    ) -> None:
        """Record the graph versions worker ``worker_id`` drives, ``(name, fingerprint)``
        pairs, replacing what it registered before.

        The fleet reads them (:meth:`worker_graphs`) to tell whether a live worker
        of a queue can drive a run: a child run its claimant cannot drive goes
        back to its queue while one can, and is failed otherwise (R3). The
        registrations of workers whose row is gone (:meth:`workers`) are dropped
        in the same write once they are an hour old (``STALE_REGISTRATION``).
        """
        check_name("worker_id", worker_id)
        for pair in graphs:
            if not (
                isinstance(pair, tuple)
                and len(pair) == 2
                and all(isinstance(part, str) and part for part in pair)
            ):
                raise ValueError(
                    f"worker graphs must be (graph name, fingerprint) pairs, got {pair!r}"
                )
            check_names(graph_name=pair[0], fingerprint=pair[1])
        await self._register_worker_graphs(worker_id, sorted(set(graphs)))

    async def worker_graphs(
        self, worker_ids: Collection[str]
    ) -> dict[str, frozenset[tuple[str, str]]]:
        """The graph versions each of ``worker_ids`` registered (:meth:`register_worker_graphs`),
        by worker; a worker that registered none is absent."""
        ids = sorted(set(worker_ids))
        for worker_id in ids:
            check_name("worker_id", worker_id)
        return await self._worker_graphs(ids) if ids else {}

    async def graphs_named(self, name: str) -> list[GraphRow]:
        """The registrations of graph ``name``, the version deployed last first (one per
        fingerprint); submitting a run by the graph's name takes the first."""
        check_name("graph_name", name)
        return await self._graphs_named(name)

    async def declare_schedule(self, row: ScheduleRow) -> None:
        """Store schedule ``row`` (replacing what an earlier declaration runs and when) (W4).

        Ticks before the first declaration are not due; a later declaration
        keeps the ticks already submitted. A bad cron expression or name is a
        ``ValueError`` naming it, and nothing is stored.
        """
        await self._declare_schedule(first_schedule(row))

    async def schedules(self) -> list[ScheduleRow]:
        """Every declared schedule, by name."""
        return await self._schedules()

    async def fire_schedule(self, name: str, tick: float) -> str | None:
        """Submit schedule ``name``'s run for ``tick`` unless that tick (or a later one) was (W4).

        Atomically: the schedule's ``last_tick`` moves to ``tick`` only if it
        was earlier (or later than the store's clock: see :func:`tick_is_due`),
        and the run (id ``{name}@{tick as YYYY-MM-DDTHH:MMZ}``, queued in the
        schedule's queue) is stored with it; across every worker, one caller
        gets the run's id, the others None. A tick later than the store's
        clock (:meth:`now`) is refused with ``ValueError`` and nothing changes:
        a caller whose own clock runs ahead cannot submit a tick early.
        """
        check_name("schedule", name)
        tick = float(tick)
        now = await self.now()
        if tick > now:
            raise ValueError(
                f"schedule {name!r}: tick {utc_minute(tick)} has not come by the store's clock "
                f"({utc_minute(now)}); nothing was submitted"
            )
        return await self._fire_schedule(name, tick)

    async def now(self) -> float:
        """The store's clock, in seconds since the epoch: the one clock schedules are judged by (W4).

        The memory and SQLite stores read the clock they were given (``clock=``,
        the host's by default), which every process on their one host shares;
        Postgres reads its server's, so workers on hosts whose clocks disagree
        agree on it.
        """
        return await self._now()

    def clock(self) -> float:
        """The clock this store stamps times by, read without a round trip (seconds since the epoch).

        Leases' expiry, delays (``not_before``), deadlines and workers'
        reports are written on it, so a caller judging such a time (is this
        lease expired? is this run due?) asks it, not its host's clock. The
        memory and SQLite stores read the clock they were given; Postgres
        follows its server's clock from here (within half a round trip plus
        the drift of ten minutes, see ``PostgresStore``), so hosts whose clocks
        disagree stamp and judge alike. :meth:`now` reads the server itself.
        """
        return self._read_clock()

    async def delete_schedule(self, name: str) -> bool:
        """Drop schedule ``name``; True if it was declared. Runs it submitted stay."""
        check_name("schedule", name)
        return await self._delete_schedule(name)

    async def queue_stats(self, now: float, *, window: float = 60.0) -> list[QueueStats]:
        """Declared queues and queues that have runs, by name, with their counts at ``now``.

        ``started`` counts runs claimed within ``window`` seconds before
        ``now``; ``workers`` the workers seen within ``window`` that serve
        the queue.
        """
        return await self._queue_stats(now, window=window)

    async def worker_seen(self, worker: WorkerRow) -> None:
        """Record (insert or replace) ``worker``'s report of itself."""
        check_worker(worker)
        await self._worker_seen(worker)

    async def pulse(self, worker: WorkerRow) -> Pulse:
        """One heartbeat of ``worker``: record its report and look at what is worth a look (W3).

        In one transaction, with one indexed probe for each thing, so an idle
        worker costs one commit and a few rows read per heartbeat however
        large the fleet: the report (as :meth:`worker_seen`; no index covers
        what it rewrites, so Postgres updates the row in place), then whether
        a run waits in one of its queues, an answer is due, a running run's
        lease expired, a run it drives was asked to cancel, an open question
        has a poller or a deadline. No pulse looks for dead workers: a worker
        is alive while its store session is, and the ring of sessions buries
        a dead one (W7, :meth:`presence`). See :class:`Pulse`.
        """
        check_worker(worker)
        return await self._pulse(worker)

    async def workers(self) -> list[WorkerRow]:
        """Every worker that reported itself and was not forgotten, by id."""
        return await self._workers()

    def presence(self, worker: WorkerRow) -> contextlib.AbstractAsyncContextManager[Presence]:
        """``worker`` present in the fleet while the ``async with`` lasts (W7).

        A worker is alive while its *store session* is: one per store object,
        held while any of its workers is present, whose token the database or
        the host gives up by itself when the process dies (Postgres: a
        session-level advisory lock on a connection of its own; SQLite: a
        lock file held with ``flock``; memory: the store object). Holding it
        costs no write and no read. Entering takes the session (on the first
        worker) and writes ``worker``'s row naming it; leaving removes the
        row (and gives the session up with the last worker).

        Each session watches the next one in the ring of sessions (ordered by
        id) and, the moment its token is free, *buries* it in one
        transaction: the leases of the running and suspended runs its workers
        hold expire at once with a new fencing token (their writes are
        refused from then on, D6; a takeover counts as a recovery, W3), its
        rows go, and the ``release`` change wakes the fleet to adopt the
        runs. A joining session is watched from its first commit on. A
        session lost while its process lives is taken back, and its workers
        learn whether it was buried meanwhile (:meth:`Presence.lapse`). A
        session cut off from the database keeps its token until the database
        sees it dead: leases are the fallback (D6). A read-only store refuses.
        """
        check_worker(worker)
        return self._presence(worker)

    async def forget_worker(self, worker_id: str) -> None:
        """Drop ``worker_id``'s report (it stopped, or died and its runs were adopted)."""
        check_name("worker_id", worker_id)
        await self._forget_worker(worker_id)

    async def run_durations(
        self, fingerprint: str, *, limit: int = 200
    ) -> list[tuple[float, float]]:
        """``(cost, seconds)`` of the latest completed queued runs of the graph ``fingerprint``, newest first.

        ``seconds`` runs from the claim to the finish; a run submitted with no
        cost has cost 0. For the duration estimator an ``lpt`` queue orders by.
        """
        check_name("fingerprint", fingerprint)
        return await self._run_durations(fingerprint, limit=limit)

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

    # -- what a backend implements ----------------------------------------------
    #
    # Each public method above checks its arguments, then calls its primitive
    # here; a backend implements these and documents only what differs.

    @abc.abstractmethod
    async def _create_run(self, run: NewRun) -> None:
        """:meth:`create_run`, called with checked arguments."""

    @abc.abstractmethod
    async def _commit(self, run_id: str, token: int, harvest: Harvest) -> bool:
        """:meth:`commit`, called with checked arguments."""

    @abc.abstractmethod
    async def _load_run(self, run_id: str) -> StoredRun:
        """:meth:`load_run`, called with checked arguments."""

    @abc.abstractmethod
    async def _snapshot(self, run_id: str) -> RunSnapshot:
        """:meth:`snapshot`, called with checked arguments."""

    @abc.abstractmethod
    async def _get_run(self, run_id: str) -> RunRecord:
        """:meth:`get_run`, called with checked arguments."""

    @abc.abstractmethod
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
        """:meth:`list_runs`, called with checked arguments."""

    @abc.abstractmethod
    async def _submit_runs(
        self,
        runs: Sequence[tuple[NewRun, Submission]],
        claim: Claim | None,
        skip: tuple[str, ...],
    ) -> tuple[list[str], list[str]]:
        """:meth:`submit_runs` and :meth:`submit_and_claim` (``claim``, its ``skip`` as
        keys), called with checked arguments: (the ids stored, the ids claimed)."""

    @abc.abstractmethod
    async def _wake_suspended(self, run_id: str) -> bool:
        """:meth:`wake_suspended`, called with checked arguments."""

    @abc.abstractmethod
    async def _overdue_runs(self, now: float, *, limit: int) -> list[str]:
        """:meth:`overdue_runs`, called with checked arguments."""

    @abc.abstractmethod
    async def _run_counts(self, *, top_level: bool = False) -> list[RunCount]:
        """:meth:`run_counts`, called with checked arguments."""

    @abc.abstractmethod
    async def _results(self, run_id: str, node_id: str | None = None) -> list[ResultRow]:
        """:meth:`results`, called with checked arguments."""

    @abc.abstractmethod
    async def _outputs(self, run_ids: list[str]) -> dict[str, str]:
        """:meth:`outputs`, called with checked, distinct, sorted ids (at least one)."""

    @abc.abstractmethod
    async def _frozen_inputs(self, run_id: str) -> list[FrozenInput]:
        """:meth:`frozen_inputs`, called with checked arguments."""

    @abc.abstractmethod
    async def _events(self, run_id: str, *, after_seq: int = 0) -> list[EventRow]:
        """:meth:`events`, called with checked arguments."""

    @abc.abstractmethod
    async def _chunks(self, run_id: str, *, after: int, limit: int) -> list[ChunkRow]:
        """:meth:`chunks`, called with checked arguments."""

    @abc.abstractmethod
    async def _stream_tails(self, run_id: str, *, chars: int, limit: int) -> list[StreamTail]:
        """:meth:`stream_tails`, called with checked arguments."""

    @abc.abstractmethod
    async def _stream_head(self, run_id: str) -> StreamHead:
        """:meth:`stream_head`, called with checked arguments."""

    @abc.abstractmethod
    async def _prune_streams(self, finished_before: float) -> int:
        """:meth:`prune_streams`, called with checked arguments."""

    @abc.abstractmethod
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
        """:meth:`move_run`, called with checked arguments."""

    @abc.abstractmethod
    async def _frontiers(self, graph_name: str) -> dict[str, tuple[str, ...]]:
        """:meth:`frontiers`, called with checked arguments."""

    @abc.abstractmethod
    async def _graph_shape(self, graph_name: str, fingerprint: str) -> str | None:
        """:meth:`graph_shape`, called with checked arguments."""

    @abc.abstractmethod
    async def _acquire_lease(
        self, run_id: str, owner: str, ttl: float, *, steal_from: str | None = None
    ) -> int:
        """:meth:`acquire_lease`, called with checked arguments."""

    @abc.abstractmethod
    async def _heartbeat(self, run_id: str, owner: str, token: int, ttl: float) -> None:
        """:meth:`heartbeat`, called with checked arguments."""

    @abc.abstractmethod
    async def _release_lease(self, run_id: str, owner: str, token: int) -> None:
        """:meth:`release_lease`, called with checked arguments."""

    @abc.abstractmethod
    async def _answer(
        self,
        question_id: str,
        answer_json: str,
        *,
        by: str | None = None,
        status: QuestionStatus = QuestionStatus.ANSWERED,
    ) -> QuestionRow:
        """:meth:`answer`, called with a legal ``status``."""

    @abc.abstractmethod
    async def _get_question(self, question_id: str) -> QuestionRow:
        """:meth:`get_question`, called with checked arguments."""

    @abc.abstractmethod
    async def _question_counts(self) -> dict[QuestionStatus, int]:
        """:meth:`question_counts`."""

    @abc.abstractmethod
    async def _list_parked(
        self,
        *,
        graph_name: str | None,
        node_id: str | None,
        status: ParkedStatus | None,
        claimed_by: str | None,
        run_id: str | None,
    ) -> list[ParkedRow]:
        """:meth:`list_parked`, called with checked arguments."""

    @abc.abstractmethod
    async def _claim_parked(
        self, graph_name: str, node_id: str, claimant: str, limit: int
    ) -> list[ParkedRow]:
        """:meth:`claim_parked`, called with checked arguments."""

    @abc.abstractmethod
    async def _unclaim_parked(self, pairs: Sequence[tuple[str, str]]) -> int:
        """:meth:`unclaim_parked`, with checked ``(claimant, park_id)`` pairs."""

    @abc.abstractmethod
    async def _drop_parked(self, park_id: str) -> bool:
        """:meth:`drop_parked`, called with a checked id."""

    @abc.abstractmethod
    async def _list_questions(
        self,
        *,
        status: QuestionStatus | None = None,
        run_id: str | None = None,
        limit: int | None = None,
        offset: int = 0,
    ) -> list[QuestionRow]:
        """:meth:`list_questions`, called with checked arguments."""

    @abc.abstractmethod
    async def _unapplied_answers(
        self, *, limit: int = 100, now: float | None = None
    ) -> list[QuestionRow]:
        """:meth:`unapplied_answers`, called with checked arguments."""

    @abc.abstractmethod
    async def _defer_answer(self, question_id: str, *, error: str, retry_at: float) -> None:
        """:meth:`defer_answer`, called with ``error`` already made printable and cut, ``retry_at`` a float."""

    @abc.abstractmethod
    async def _mark_applied(self, question_id: str) -> bool:
        """:meth:`mark_applied`, called with checked arguments."""

    @abc.abstractmethod
    async def _supersede(self, question_id: str) -> bool:
        """:meth:`supersede`, called with checked arguments."""

    @abc.abstractmethod
    async def _expired_leases(self, now: float, *, limit: int = 100) -> list[str]:
        """:meth:`expired_leases`, called with checked arguments."""

    @abc.abstractmethod
    async def _artifact_head(self, artifact_id: str) -> ArtifactVersion | None:
        """:meth:`artifact_head`, called with checked arguments."""

    @abc.abstractmethod
    async def _commit_artifact(
        self, artifact_id: str, expected: int, entries_json: str, meta_json: str = "{}"
    ) -> ArtifactVersion:
        """:meth:`commit_artifact`, called with checked arguments."""

    @abc.abstractmethod
    async def _artifact_history(self, artifact_id: str) -> list[ArtifactVersion]:
        """:meth:`artifact_history`, called with checked arguments."""

    @abc.abstractmethod
    async def _submit_run(self, run: NewRun, submission: Submission) -> str:
        """:meth:`submit_run`, called with checked arguments."""

    @abc.abstractmethod
    async def _return_claim(self, run_id: str, owner: str) -> bool:
        """:meth:`return_claim`."""

    @abc.abstractmethod
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
        """:meth:`claim_runs`, called with ``limit`` >= 1; :func:`graph_keys` made ``graphs``."""

    @abc.abstractmethod
    async def _claim_answers(self, owner: str, ttl: float, *, limit: int) -> list[QuestionRow]:
        """:meth:`claim_answers`, called with ``limit`` >= 1."""

    @abc.abstractmethod
    async def _request_cancel(self, run_id: str) -> RunStatus:
        """:meth:`request_cancel`, called with checked arguments."""

    @abc.abstractmethod
    async def _reopen_cancelled(
        self, run_id: str, owner: str, ttl: float, nodes: tuple[str, ...]
    ) -> bool:
        """:meth:`reopen_cancelled`, called with checked arguments."""

    @abc.abstractmethod
    async def _cancel_requests(self, owner: str) -> list[str]:
        """:meth:`cancel_requests`, called with checked arguments."""

    @abc.abstractmethod
    async def _runs_leased_by(self, owner: str, *, limit: int = 100) -> list[str]:
        """:meth:`runs_leased_by`, called with checked arguments."""

    @abc.abstractmethod
    async def _declare_queue(self, queue: Queue) -> None:
        """:meth:`declare_queue`, called with checked arguments."""

    @abc.abstractmethod
    async def _queues(self) -> list[Queue]:
        """:meth:`queues`, called with checked arguments."""

    @abc.abstractmethod
    async def _pause_queue(self, name: str) -> None:
        """:meth:`pause_queue`, called with checked arguments."""

    @abc.abstractmethod
    async def _resume_queue(self, name: str) -> bool:
        """:meth:`resume_queue`, called with checked arguments."""

    @abc.abstractmethod
    async def _delete_queue(self, name: str) -> bool:
        """:meth:`delete_queue`, called with checked arguments."""

    @abc.abstractmethod
    async def _register_graph(self, row: GraphRow) -> None:
        """:meth:`register_graph`, called with checked arguments."""

    @abc.abstractmethod
    async def _graphs_named(self, name: str) -> list[GraphRow]:
        """:meth:`graphs_named`, called with checked arguments."""

    @abc.abstractmethod
    async def _declare_schedule(self, row: ScheduleRow) -> None:
        """:meth:`declare_schedule`, with ``row`` checked and its first tick set."""

    @abc.abstractmethod
    async def _schedules(self) -> list[ScheduleRow]:
        """:meth:`schedules`."""

    @abc.abstractmethod
    async def _fire_schedule(self, name: str, tick: float) -> str | None:
        """:meth:`fire_schedule`, called with checked arguments (``tick`` has come by
        :meth:`now`, which the compare-and-set reads again: ``tick_is_due``)."""

    @abc.abstractmethod
    async def _now(self) -> float:
        """:meth:`now`."""

    @abc.abstractmethod
    def _read_clock(self) -> float:
        """:meth:`clock`."""

    @abc.abstractmethod
    async def _delete_schedule(self, name: str) -> bool:
        """:meth:`delete_schedule`, called with checked arguments."""

    @abc.abstractmethod
    async def _queue_stats(self, now: float, *, window: float = 60.0) -> list[QueueStats]:
        """:meth:`queue_stats`, called with checked arguments."""

    @abc.abstractmethod
    async def _worker_seen(self, worker: WorkerRow) -> None:
        """:meth:`worker_seen`, called with checked arguments."""

    @abc.abstractmethod
    async def _pulse(self, worker: WorkerRow) -> Pulse:
        """:meth:`pulse`, called with checked arguments."""

    @abc.abstractmethod
    async def _workers(self) -> list[WorkerRow]:
        """:meth:`workers`, called with checked arguments."""

    @abc.abstractmethod
    async def _forget_worker(self, worker_id: str) -> None:
        """:meth:`forget_worker`, called with checked arguments."""

    @abc.abstractmethod
    async def _register_worker_graphs(self, worker_id: str, graphs: list[tuple[str, str]]) -> None:
        """:meth:`register_worker_graphs`, called with checked, sorted, distinct pairs."""

    @abc.abstractmethod
    async def _worker_graphs(self, worker_ids: list[str]) -> dict[str, frozenset[tuple[str, str]]]:
        """:meth:`worker_graphs`, called with checked, sorted, distinct ids (at least one)."""

    @abc.abstractmethod
    def _presence(self, worker: WorkerRow) -> contextlib.AbstractAsyncContextManager[Presence]:
        """:meth:`presence`, called with a checked worker."""

    @abc.abstractmethod
    async def _join_session(
        self, session: str, workers: list[WorkerRow], *, again: bool
    ) -> frozenset[str]:
        """``workers`` join store session ``session`` in one transaction (W7): their rows name
        it, rows that hold no session and stopped reporting go, and the session before it
        in the ring is told (``ring:<session>``). Returns which of ``workers`` had a row
        naming the session before (``again``, after the session was lost: one whose row is
        gone and who did not leave was buried; at first, all of them)."""

    @abc.abstractmethod
    async def _bury_session(self, session: str) -> int:
        """Session ``session`` is gone (its token is free): in one transaction, the running and
        suspended runs its workers lease expire now with a new token, its rows go, and the
        fleet is woken (``release``, ``answer``); the number of runs whose leases expired."""

    @abc.abstractmethod
    async def _ring_next(self, session: str) -> str | None:
        """The session after ``session`` in the ring (by id, wrapping round; None alone)."""

    @abc.abstractmethod
    async def _run_durations(
        self, fingerprint: str, *, limit: int = 200
    ) -> list[tuple[float, float]]:
        """:meth:`run_durations`, called with checked arguments."""


@contextlib.asynccontextmanager
async def _polling_changes() -> AsyncIterator[ChangeFeed]:
    yield PollingFeed(0.05)


def _check_text(name: str, value: object) -> None:
    """Refuse an id or name that is not a non-empty string any store can keep, naming it."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string, got {value!r}")
    check_name(name, value)


def _check_many(runs: Sequence[tuple[NewRun, Submission]]) -> None:
    """Refuse a bad run of a ``submit_runs`` batch (naming it) before anything is stored."""
    for run, q in runs:
        check_new_format(run)
        if q.dedup_key is not None:
            raise ValueError(f"run {run.run_id!r}: submit_runs takes no dedup keys; use submit_run")
        check_names(
            run_id=run.run_id, graph_name=run.graph_name, graph_ref=run.graph_ref,
            fingerprint=run.fingerprint, queue=q.queue, partition=q.partition,
            parent_run_id=run.parent_run_id,
        )  # fmt: skip
