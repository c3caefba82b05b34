"""The records a store keeps and returns, their statuses, and the format version.

Every payload is already encoded as text by the engine (D5); these records
carry it across the store seam unchanged. Statuses are enums whose legal
moves are written here once (``RUN_TRANSITIONS``, ``QUESTION_TRANSITIONS``).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
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
    # A suspended run that waits on child runs is queued again when one ends (R4).
    RunStatus.SUSPENDED: frozenset(
        {RunStatus.RUNNING, RunStatus.QUEUED, RunStatus.FAILED, RunStatus.CANCELLED}
    ),
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
    #: The graph's structure (``graph_shape`` as JSON), kept once per graph name
    #: and fingerprint so a changed graph can be checked against the run (V1).
    shape_json: str | None = None
    #: A fork's origin: the run it was forked from and the node it re-runs from (V4).
    forked_from: str | None = None
    forked_at: str | None = None
    #: The run whose node runs this one as a child run (R1), and the time the run
    #: is cancelled at if it has not finished (R6), seconds since the epoch.
    parent_run_id: str | None = None
    deadline: float | None = None
    #: The queue a run created ``running`` is on: an inline child of a run on a queue
    #: is on its parent's, so it suspends on its own children as its parent does (R4).
    queue_name: str | None = None


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
    #: A fork's origin: the run it was forked from and the node it re-ran from (V4).
    forked_from: str | None = None
    forked_at: str | None = None
    #: How many times it was taken over, running, from an owner that held its lease
    #: (the owner died or its lease expired; a released lease does not count) (W3).
    recoveries: int = 0
    #: The earliest time a worker may claim it (None: at once) (W4).
    not_before: float | None = None
    #: The run whose node runs this one as a child run (R1).
    parent_run_id: str | None = None
    #: When the run is cancelled if it has not finished (R6).
    deadline: float | None = None


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


class ItemRow(NamedTuple):
    """The latest state of one item of a map node's visit (M6), fields in column order.

    ``status`` is ``running`` (a retry is due: ``attempts``, ``retry_due``),
    ``completed`` or ``late`` (with ``value_json``), ``failed`` (with
    ``error``) or ``cancelled``; ``seq`` is its completion in the run's order.
    """

    node_id: str
    visit: int
    item: int
    status: str
    seq: int
    attempts: int
    value_json: str | None
    error: str | None
    retry_due: float | None


class CheckpointRow(NamedTuple):
    """The latest checkpoint of one node visit (or map item) of a run (P1), in column order.

    ``item`` is -1 for a node's own; ``value_json`` is the checkpoint as encoded.
    """

    node_id: str
    visit: int
    item: int
    attempt: int
    value_json: str
    saved_at: float


class ParkedStatus(enum.StrEnum):
    """Lifecycle of a parked item (P3, P4): parked, then claimed by one map or dropped."""

    PARKED = "parked"
    CLAIMED = "claimed"
    DROPPED = "dropped"


class ParkedRow(NamedTuple):
    """A straggler parked by ``late="park"`` (P3), in column order.

    ``node_id`` is the map (or the aggregate's input node) it belongs to and
    ``item`` its item index there (-1 for a node); ``value_json`` is what it
    runs on and ``checkpoint_json`` its last checkpoint (None if it saved
    none). ``claimed_by`` names the map visit that took it (P4). ``parks``
    counts the times the item has been parked, this one included; ``parked_at``
    is when it was first parked, its place in claim order (P5).
    """

    park_id: str
    graph_name: str
    node_id: str
    run_id: str
    visit: int
    item: int
    value_json: str
    checkpoint_json: str | None
    parked_at: float
    status: str = "parked"
    claimed_by: str | None = None
    claimed_at: float | None = None
    parks: int = 1


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


class ChunkRow(NamedTuple):
    """A stored stream row (S1-S3): a chunk of an attempt's stream, or its terminal mark.

    ``seq`` is unique and increasing per run (a reader's cursor); ``stream``
    is the ``seq`` of the attempt's first chunk, shared by every row of that
    attempt's stream. ``item`` is None outside map items, ``hedge`` 1 for a
    hedge or backup attempt. ``kind`` is one of :data:`CHUNK_KINDS`;
    ``data_json`` is the chunk as the codec encoded it (None for a mark).
    """

    seq: int
    stream: int
    node_id: str
    visit: int
    item: int | None
    attempt: int
    hedge: int
    kind: str
    data_json: str | None
    ts: float


#: What a stream row is: a chunk, or the terminal mark of its attempt (S2).
CHUNK_KINDS = ("chunk", "accepted", "discarded")


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamHead:
    """Where a run's streams stand in the store (``RunStore.stream_head``).

    ``last_seq`` is the largest stream row ``seq`` of the run (0: none);
    ``open`` holds the first chunk of each stream with no terminal mark yet
    (an attempt cut by a crash, say), in ``seq`` order.
    """

    last_seq: int = 0
    open: tuple[ChunkRow, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamTail:
    """One attempt's stream as its last rows (``RunStore.stream_tails``).

    ``rows`` are the stream's last rows in ``seq`` order, its terminal mark
    included: the fewest that hold more than the characters asked for (in
    ``data_json``), or all of them. ``chunks`` counts the chunks the stream
    holds in all. ``whole`` says whether ``rows`` begin at the stream's first.
    """

    rows: tuple[ChunkRow, ...]
    chunks: int

    @property
    def whole(self) -> bool:
        return self.rows[0].seq == self.rows[0].stream


@dataclass(frozen=True, slots=True, kw_only=True)
class Harvest:
    """Everything one harvest produces, committed atomically (D1)."""

    state_json: str
    status: RunStatus = RunStatus.RUNNING
    error: str | None = None
    nodes: Sequence[NodeRow] = ()
    results: Sequence[ResultRow] = ()
    frozen: Sequence[FrozenInput] = ()
    #: Rows of map items, upserted: the latest row of an item wins (M6).
    items: Sequence[ItemRow] = ()
    #: Checkpoints saved since the last write, upserted: the latest per visit wins (P1).
    checkpoints: Sequence[CheckpointRow] = ()
    #: Stragglers parked by this harvest (P3), inserted.
    parked: Sequence[ParkedRow] = ()
    #: Claimed parked items that go back to ``parked`` (P4), as ``(claimant, park_id)``:
    #: what a map visit claimed and will not finish. A row another claimant holds, or
    #: one no longer claimed, is left as it is.
    unclaimed: Sequence[tuple[str, str]] = ()
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
    #: Stream rows (chunks and terminal marks), inserted; their ``seq`` must be new (S3).
    chunks: Sequence[ChunkRow] = ()
    #: A run suspending on its child runs: how many of them must complete before it
    #: can move on (None: the first end wakes it) (R4). A failed or cancelled child
    #: wakes it at once.
    wake_after: int | None = None
    #: A run suspending on its child runs: the ones it waits for (R4). The commit
    #: also lets go of its lease, and queues it again at once (on a queue) when
    #: enough of them ended before it (their ends found it still running).
    waiting_on: Sequence[str] = ()
    #: A child run completing: its output, encoded, for its parent to read (R1;
    #: :meth:`~tailrace.stores.RunStore.outputs`). Any other harvest clears it.
    output_json: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class StoredRun:
    """A run, all its node rows and its map items' rows, as ``load_run`` returns it."""

    run: RunRecord
    nodes: dict[str, NodeRow] = field(default_factory=dict)
    #: Every map item row of the run, ordered by node id, visit and item.
    items: list[ItemRow] = field(default_factory=list)
    #: The latest checkpoint of each node visit (or item) that saved one (P1).
    checkpoints: list[CheckpointRow] = field(default_factory=list)


@dataclass(frozen=True, slots=True, kw_only=True)
class RunSnapshot:
    """A run as of one moment, as ``snapshot`` returns it: what ``load_run`` returns with
    the run's result rows (by node, then visit), first-k decisions (by node, then
    activation) and stream rows (by seq), none written after another was read."""

    stored: StoredRun
    results: list[ResultRow] = field(default_factory=list)
    frozen: list[FrozenInput] = field(default_factory=list)
    chunks: list[ChunkRow] = field(default_factory=list)


# --- queues and workers (scale-out: the store is the coordinator) -----------------

#: The largest count a limit may hold: every store keeps limits as 32-bit integers.
MAX_LIMIT = 2**31 - 1
#: The longest queue name (every store indexes it).
MAX_NAME_CHARS = 200


def check_limit(what: str, value: object, *, optional: bool = False) -> None:
    """Refuse a limit that is not a whole count within 1..:data:`MAX_LIMIT` (None if
    ``optional``), naming it (``what``) and the accepted range, the same on every store."""
    if value is None and optional:
        return
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_LIMIT:
        accepted = f"an integer within 1..{MAX_LIMIT}" + (" or None" if optional else "")
        raise ValueError(f"{what} must be {accepted}, got {value!r}")


#: How a queue orders the runs it hands out among runs of equal ``priority``
#: (a higher priority goes first in every queue): by submit time (``fifo``, and
#: ``priority``, its name for queues that mean to use priorities), or longest
#: estimated run first (``lpt``).
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
        order: how runs of equal ``priority`` are handed out (a higher
            ``priority`` goes first in every queue): ``"fifo"`` (submit
            order; ``"priority"`` is the same, for queues that mean to use
            priorities) or ``"lpt"`` (longest estimated run first, then submit
            order; see ``Engine.submit``'s ``estimate``).
        partition_concurrency: most runs of one partition key running (or
            suspended) at once across all workers; the default 1 starts a
            partition's runs one at a time, each once the previous one finished.
        partition_limit: most runs of one partition key started per
            ``period`` seconds across all workers (None: no such limit).

    Runs submitted with a ``partition`` key start in submit order within their
    key, and partitions are served fairly (W2): among runs of equal priority a
    claim takes each partition's first queued run before any partition's
    second, and among those of one turn the partition served longest ago (or
    never) first; runs with no key take turns as one partition of their own.
    A partition with one queued run so waits behind at most one run of each
    other partition.

    >>> Queue("emails", concurrency=10, limit=100, period=60.0)
    Queue(name='emails', concurrency=10, worker_concurrency=None, limit=100, period=60.0, order='fifo', partition_concurrency=1, partition_limit=None)
    """

    name: str
    _: KW_ONLY
    concurrency: int | None = None
    worker_concurrency: int | None = None
    limit: int | None = None
    period: float = 1.0
    order: str = "fifo"
    partition_concurrency: int = 1
    partition_limit: int | None = None

    def __post_init__(self) -> None:
        if (
            not isinstance(self.name, str)
            or not self.name
            or len(self.name) > MAX_NAME_CHARS
            or "\x00" in self.name
        ):
            shown = repr(self.name) if len(repr(self.name)) <= 60 else repr(self.name)[:57] + "..."
            raise ValueError(
                f"queue name must be a non-empty string of at most {MAX_NAME_CHARS} "
                f"characters (no NUL), got {shown}"
            )
        for what in ("concurrency", "worker_concurrency", "limit", "partition_limit"):
            check_limit(f"queue {self.name!r}: {what}", getattr(self, what), optional=True)
        check_limit(f"queue {self.name!r}: partition_concurrency", self.partition_concurrency)
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

    ``queue`` names it; ``priority`` orders its queue (higher first, whatever
    the queue's order); ``partition`` makes runs with the same key start one at a time in
    submit order; ``dedup_key`` makes a second submit with that key, while a
    run holding it is live (queued, running or suspended), return that run;
    ``cost`` is what the duration estimator was given and ``estimate`` the
    seconds it predicted (an ``lpt`` queue hands out the largest first);
    ``not_before`` the earliest time (seconds since the epoch) it may be
    claimed: until then it is not handed out and takes no turn of its
    partition (W4).
    """

    queue: str
    priority: int = 0
    partition: str | None = None
    dedup_key: str | None = None
    cost: float | None = None
    estimate: float | None = None
    not_before: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Claim:
    """A claim made in a submit's own transaction (``submit_and_claim``).

    Up to ``limit`` runs of ``queue`` are claimed for ``owner``, leased for
    ``ttl`` seconds, none of the ``skip`` graphs (``(name, fingerprint)``
    pairs): what :meth:`~tailrace.stores.RunStore.claim_runs` would hand out
    once the submitted runs are in, in the queue's order and within its limits.
    """

    queue: str
    owner: str
    ttl: float
    limit: int
    skip: tuple[tuple[str, str], ...] = ()


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
    the longest-waiting queued run (None when none waits); ``paused`` whether
    it is paused (``pause_queue``: it hands out no queued run until resumed).
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
    paused: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerRow:
    """A worker process as it last reported itself (``worker_seen``, ``pulse``).

    ``worker_id`` is its lease owner name (``host:pid:start:nonce``);
    ``queues`` the queues it claims from; ``running`` how many runs it drove
    at ``seen_at``; ``dead_after`` the seconds after ``seen_at`` from which a
    row that holds no session counts as left behind (it is removed as a
    worker joins). ``session`` is the store session the worker is present in
    (``RunStore.presence``, W7): the worker is alive while that session is;
    None for a row written without one.
    """

    worker_id: str
    queues: tuple[str, ...]
    concurrency: int
    started_at: float
    seen_at: float
    running: int = 0
    dead_after: float = 60.0
    session: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Pulse:
    """What one worker heartbeat (``RunStore.pulse``) found, in one transaction.

    ``kinds`` are the change kinds worth a look (``submit``: a queued run in
    one of the worker's queues; ``answer``: an answer due; ``release``: a
    running run whose lease expired; ``cancel``: a cancel request for a run
    the worker drives); ``gates`` whether an open question has a poller or
    a deadline; ``overdue`` whether a queued or suspended run is past its
    deadline (R6); ``due_at`` the earliest time after the pulse at which
    something no change announces comes due (a running run's lease expires,
    a delayed run of the worker's queues may start, a waiting run's deadline
    passes), None when nothing will.
    """

    kinds: frozenset[str] = frozenset()
    gates: bool = False
    overdue: bool = False
    due_at: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Lapse:
    """A store session of workers that ended while they were present, and was taken back (W7).

    ``reason`` says how it ended (the driver's words); ``seconds`` how long
    the workers were without it; ``buried`` whether the fleet found the
    session gone meanwhile: its workers' leases were then expired (and
    fenced: their writes are refused, D6) so that other workers adopt their
    runs, and what they still drive must stop.
    """

    reason: str
    seconds: float
    buried: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduleRow:
    """A schedule as stored (``declare_schedule``): a run submitted once per cron tick (W4).

    ``name`` identifies it; ``cron`` is its expression (UTC, see
    :class:`~tailrace.tail.Cron`); the run is of the graph ``graph_name``
    (``graph_ref``, ``fingerprint``) on ``input_json``, submitted to
    ``queue``; ``last_tick`` is the latest tick submitted (or, before the
    first, the latest tick before the declaration: earlier ones are not due).
    """

    name: str
    cron: str
    graph_name: str
    graph_ref: str | None
    fingerprint: str
    input_json: str
    queue: str = "default"
    declared_at: float = 0.0
    last_tick: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class GraphRow:
    """A graph a worker can drive, as it registered it (``register_graph``): what a run
    submitted by the graph's name alone is stored with (``name``, ``fingerprint``,
    ``graph_ref``); ``registered_at`` is when that version was first registered (its
    deploy), never before the versions of its name registered earlier."""

    name: str
    fingerprint: str
    graph_ref: str | None
    registered_at: float


#: What a change feed reports: a run was submitted, a question answered, a
#: lease released (a run finished, suspended, or let go), a cancel requested, a
#: queue or schedule declared, paused, resumed or deleted (``config``), stream rows
#: committed (``stream``), a store session joined the fleet's ring of watchers (``ring``,
#: W7; on Postgres, addressed to the session that should look: ``ring:<session>``).
CHANGE_KINDS = frozenset({"submit", "answer", "release", "cancel", "config", "stream", "ring"})
