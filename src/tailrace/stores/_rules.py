r"""The store rules every backend shares: plain functions over values read from a backend.

Fencing, lease grants, status transitions, format checks, the question
compare-and-sets and the checks on names all live here, so the memory, SQLite
and Postgres stores apply the very same decisions inside their own
transactions and give the same error messages. The SQL stores phrase the
question rules as ``WHERE`` clauses (see ``_sql``); these functions are the
reference the memory store applies.

>>> grant_lease("r1", "b", now=10.0, holder="a", expires=40.0, lease_token=3, steal_from="a")
4
>>> check_name("run_id", "r\x001")
Traceback (most recent call last):
...
ValueError: run_id 'r\x001' contains a NUL character (\x00), which no store can keep
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Iterable, Sequence
from itertools import chain

from .._errors import (
    AlreadyAnswered,
    CorruptRecord,
    GraphMismatch,
    LeaseHeld,
    LeaseLost,
    NotResumable,
    QuestionNotFound,
    StoreError,
    UnsupportedFormat,
)
from .._values import checked_cursor
from ._records import (
    FORMAT_VERSION,
    QUESTION_TRANSITIONS,
    RUN_TRANSITIONS,
    TERMINAL_STATUSES,
    ChunkRow,
    Harvest,
    NewRun,
    QuestionRow,
    QuestionStatus,
    RunRecord,
    RunStatus,
    StreamTail,
    Submission,
)

#: ``state_json`` of a run that has not committed a harvest yet.
EMPTY_STATE_JSON = "{}"

# --- rules shared by every backend -------------------------------------------


def check_ttl(ttl: float) -> None:
    """Raise ``ValueError`` unless ``ttl`` is a positive, finite number of seconds."""
    if not ttl > 0 or ttl == float("inf"):
        raise ValueError(f"lease ttl must be a positive number of seconds, got {ttl!r}")


def check_new_format(run: NewRun) -> None:
    """Raise :class:`UnsupportedFormat` if ``run`` is in a format this code cannot read back (D4)."""
    if run.format_version > FORMAT_VERSION:
        raise UnsupportedFormat(
            f"run {run.run_id!r}: cannot create a run in format {run.format_version}; "
            f"this tailrace writes format {FORMAT_VERSION}"
        )


def check_readable(run_id: str, format_version: int) -> None:
    """Raise :class:`UnsupportedFormat` naming ``run_id`` if ``format_version`` is newer than ours (D4)."""
    if format_version > FORMAT_VERSION:
        raise UnsupportedFormat(
            f"run {run_id!r} is stored in format {format_version}, newer than this "
            f"tailrace supports ({FORMAT_VERSION}); upgrade tailrace to read it"
        )


def parse_status(run_id: str, text: str) -> RunStatus:
    """Decode the stored status ``text`` of run ``run_id``; :class:`CorruptRecord` if unknown."""
    try:
        return RunStatus(text)
    except ValueError:
        raise CorruptRecord(f"run {run_id!r} has unknown status {text!r}") from None


def check_commit(
    run_id: str,
    *,
    current: RunStatus,
    format_version: int,
    lease_token: int,
    token: int,
    new: RunStatus,
) -> None:
    """Decide whether a harvest may be written to run ``run_id``.

    Checks, in order: the row's ``format_version`` (D4); that ``token`` equals
    the row's ``lease_token`` (fencing, D6, else :class:`LeaseLost`); that the
    ``current`` status may become ``new`` (else :class:`StoreError`).
    """
    check_readable(run_id, format_version)
    if token != lease_token:
        raise LeaseLost(
            f"run {run_id!r}: lease token {token} is stale (current token {lease_token}); "
            "another engine took the run over, nothing was written"
        )
    if new not in RUN_TRANSITIONS[current]:
        raise StoreError(
            f"run {run_id!r}: illegal status transition {current.value} -> {new.value}"
        )


def grant_lease(
    run_id: str,
    owner: str,
    *,
    now: float,
    holder: str | None,
    expires: float | None,
    lease_token: int,
    steal_from: str | None = None,
) -> int:
    """Return the fencing token ``owner`` gets on run ``run_id`` at ``now`` (D6).

    ``holder``, ``expires`` and ``lease_token`` describe the current lease. A
    live lease of the same owner keeps its token; a live lease held by exactly
    ``steal_from`` is taken over (a compare-and-set on the holder) with the
    next, larger token, which fences the old holder out; a live lease of any
    other owner raises :class:`LeaseHeld` carrying the holder and its expiry.
    Any fresh grant (no lease, an expired or a released one) gets the next token.
    """
    live = holder is not None and expires is not None and expires > now
    if not live:
        return lease_token + 1
    if holder == owner:
        return lease_token
    if steal_from is not None and holder == steal_from:
        return lease_token + 1
    assert holder is not None and expires is not None
    raise lease_held(run_id, holder, expires, now)


def is_recovery(status: str, holder: str | None, owner: str, *, new_grant: bool) -> bool:
    """Whether a lease grant takes a running run over from another owner that still held it (W3).

    A crash leaves the lease held (until it expires, or the owner is proved
    dead); a drain or a cancelled claim releases it, which is no recovery.
    """
    return new_grant and status == "running" and holder is not None and holder != owner


def lease_held(run_id: str, holder: str, expires: float, now: float) -> LeaseHeld:
    """The error for run ``run_id`` leased by ``holder`` until ``expires``, seen at ``now``."""
    return LeaseHeld(
        f"run {run_id!r} is leased by {holder!r} for another {max(expires - now, 0.0):.1f} s. "
        "Wait that long for the lease to expire, then try again; if that owner's process "
        "is gone, the lease is taken over at once by an engine on its host.",
        owner=holder,
        expires_at=expires,
    )


def check_holder(
    run_id: str, owner: str, token: int, *, holder: str | None, lease_token: int
) -> None:
    """Raise :class:`LeaseLost` unless ``owner`` still holds run ``run_id`` with ``token``.

    ``holder`` and ``lease_token`` describe the current lease.
    """
    if holder != owner or lease_token != token:
        raise LeaseLost(
            f"run {run_id!r}: lease of {owner!r} with token {token} was lost "
            f"(holder {holder!r}, token {lease_token})"
        )


def check_move(
    run_id: str,
    owner: str,
    token: int,
    *,
    status: RunStatus,
    fingerprint: str,
    holder: str | None,
    lease_token: int,
    expected: str,
) -> None:
    """Decide whether run ``run_id`` may be moved onto another version of its graph (V2).

    The run must be ``running`` or ``suspended`` (else :class:`NotResumable`:
    a finished run holds no lease, its end let go of it); ``owner`` must hold
    its lease with ``token`` (else :class:`LeaseLost`, D6); its fingerprint
    must still be ``expected`` (else :class:`GraphMismatch`: it was moved
    meanwhile).
    """
    if status not in (RunStatus.RUNNING, RunStatus.SUSPENDED):
        raise NotResumable(f"run {run_id!r} is {status.value}: only a live run moves to a version")
    check_holder(run_id, owner, token, holder=holder, lease_token=lease_token)
    if fingerprint != expected:
        raise GraphMismatch(
            f"run {run_id!r} is on graph version {fingerprint} now, not {expected}: "
            "it was moved meanwhile; nothing was written"
        )


def duplicate_in_harvest(run_id: str, harvest: Harvest) -> str | None:
    """Describe a row ``harvest`` of run ``run_id`` repeats itself (result, frozen input, event)."""
    checks: tuple[tuple[str, Iterable[object]], ...] = (
        ("result", ((r.node_id, r.visit) for r in harvest.results)),
        ("frozen input", ((f.node_id, f.activation) for f in harvest.frozen)),
        ("map item", ((r.node_id, r.visit, r.item) for r in harvest.items)),
        ("event", (e.seq for e in harvest.events)),
        ("question", (q.question_id for q in harvest.questions)),
    )
    for kind, keys in checks:
        seen: set[object] = set()
        for key in keys:
            if key in seen:
                return f"run {run_id!r}: harvest repeats {kind} {key!r}"
            seen.add(key)
    return None


# --- run rows: what the SQL stores' statements write, as values ---------------------


def new_run_record(run: NewRun, q: Submission | None) -> RunRecord:
    """The row of ``run`` as created (``INSERT_RUN``), or queued with ``q`` (``INSERT_QUEUED_RUN``)."""
    return RunRecord(
        run_id=run.run_id, graph_name=run.graph_name, graph_ref=run.graph_ref,
        fingerprint=run.fingerprint,
        status=RunStatus.RUNNING if q is None else RunStatus.QUEUED,
        input_json=run.input_json, state_json=EMPTY_STATE_JSON, error=None,
        created_at=run.created_at, updated_at=run.created_at, finished_at=None, nodes_done=0,
        lease_owner=None, lease_expires=None, lease_token=0, format_version=run.format_version,
        queue_name=run.queue_name if q is None else q.queue,
        priority=0 if q is None else q.priority,
        partition_key=None if q is None else q.partition,
        dedup_key=None if q is None else q.dedup_key, cost=None if q is None else q.cost,
        estimate=None if q is None else q.estimate,
        queued_at=None if q is None else run.created_at, forked_from=run.forked_from,
        forked_at=run.forked_at, not_before=None if q is None else q.not_before,
        parent_run_id=run.parent_run_id, deadline=run.deadline,
    )  # fmt: skip


def committed_record(record: RunRecord, harvest: Harvest, now: float) -> RunRecord:
    """``record`` once ``harvest`` is committed at ``now`` (``UPDATE_RUN``): a harvest that
    ends the run lets go of its lease."""
    ends = harvest.status in TERMINAL_STATUSES
    return dataclasses.replace(
        record, state_json=harvest.state_json, status=harvest.status,
        error=None if harvest.error is None else printable_text(harvest.error), updated_at=now,
        finished_at=record.finished_at if harvest.finished_at is None else harvest.finished_at,
        nodes_done=record.nodes_done + harvest.nodes_done_delta,
        lease_owner=None if ends else record.lease_owner,
        lease_expires=None if ends else record.lease_expires,
    )  # fmt: skip


def lease_lapsed(run: RunRecord, now: float) -> bool:
    """Whether running ``run`` has no live lease at ``now``: an orphan to adopt (``EXPIRED_LEASES``)."""
    return run.status is RunStatus.RUNNING and (
        run.lease_owner is None or run.lease_expires is None or run.lease_expires < now
    )


def can_wake(run: RunRecord, now: float) -> bool:
    """Whether suspended ``run`` is queued again now (``WAKE_SUSPENDED``, R4): it is on a
    queue and nobody holds it."""
    held = run.lease_owner is not None and (run.lease_expires or 0.0) >= now
    return run.status is RunStatus.SUSPENDED and run.queue_name is not None and not held


def children_left(wake_after: int | None, ended: Sequence[RunStatus]) -> int | None:
    """How many child completions a run suspending on its children still waits for, given
    the ends of those that ended before (R4); None: it wakes now (one failed or was
    cancelled, or enough completed)."""
    completed = sum(status is RunStatus.COMPLETED for status in ended)
    left = None if wake_after is None else wake_after - completed
    if completed < len(ended) or left is None or left <= 0:
        return None
    return left


# --- question rules (Q2-Q5), shared by every backend -----------------------------
# The SQL stores phrase the same conditions as WHERE clauses (see ``_sql``) so
# that the compare-and-set is one atomic UPDATE; these functions are the
# reference the memory store applies and the error messages all stores give.


def answer_status(question_id: str, status: QuestionStatus) -> QuestionStatus:
    """``status`` as the status an answer to ``question_id`` sets; ``ValueError`` unless ``answered`` or ``expired``."""
    if status not in (QuestionStatus.ANSWERED, QuestionStatus.EXPIRED):
        raise ValueError(
            f"question {question_id!r}: an answer sets status 'answered' or 'expired', "
            f"not {str(status)!r}"
        )
    return QuestionStatus(status)


def check_new_questions(run_id: str, harvest: Harvest) -> None:
    """Raise ``ValueError`` unless every question ``harvest`` of run ``run_id`` opens is open and unanswered."""
    for q in harvest.questions:
        answered = (q.answer_json, q.answered_by, q.answered_at, q.applied_at) != (None,) * 4
        deferred = (q.apply_error, q.apply_attempts, q.retry_at) != (None, 0, None)
        if q.status is not QuestionStatus.OPEN or answered or deferred:
            raise ValueError(
                f"run {run_id!r}: question {q.question_id!r} must be inserted open and "
                f"unanswered (got status {str(q.status)!r}); nothing of this harvest was written"
            )


def parse_question_status(question_id: str, text: str) -> QuestionStatus:
    """Decode the stored status ``text`` of question ``question_id``; :class:`CorruptRecord` if unknown."""
    try:
        return QuestionStatus(text)
    except ValueError:
        raise CorruptRecord(f"question {question_id!r} has unknown status {text!r}") from None


def applied_status(status: QuestionStatus) -> QuestionStatus:
    """The status a question in ``status`` has once its answer is applied (``expired`` stays)."""
    return QuestionStatus.APPLIED if status is QuestionStatus.ANSWERED else status


def can_apply(status: QuestionStatus, applied_at: float | None) -> bool:
    """Whether the answer of a question in ``status``, applied at ``applied_at``, may be applied now (Q3)."""
    return applied_at is None and applied_status(status) in QUESTION_TRANSITIONS[status]


def can_supersede(status: QuestionStatus, applied_at: float | None) -> bool:
    """Whether a question in ``status``, applied at ``applied_at``, may still become ``superseded``."""
    return applied_at is None and QuestionStatus.SUPERSEDED in QUESTION_TRANSITIONS[status]


def question_not_found(question_id: str) -> QuestionNotFound:
    """The error for an unknown ``question_id``."""
    return QuestionNotFound(f"no question {question_id!r} in the store")


def not_open(
    question_id: str, status: QuestionStatus, run: tuple[str, RunStatus] | None = None
) -> AlreadyAnswered:
    """The error for answering question ``question_id`` that is in ``status``, not ``open`` (Q2).

    ``run`` is the question's run and its status, when known. A superseded
    question was withdrawn: its run was cancelled, or went on without it
    (Q3, Q7); the message says which rather than that an answer won.
    """
    if status is QuestionStatus.SUPERSEDED and run is not None and run[1] is RunStatus.CANCELLED:
        return AlreadyAnswered(
            f"question {question_id!r} is superseded: its run {run[0]!r} was cancelled, so "
            "nothing waits for an answer; nothing was changed"
        )
    if status is QuestionStatus.SUPERSEDED:
        return AlreadyAnswered(
            f"question {question_id!r} is superseded: it was withdrawn because its run no "
            "longer waits for it (its consumers went on without it); nothing was changed"
        )
    return AlreadyAnswered(
        f"question {question_id!r} is already {status.value}, not open: "
        "the first answer won and nothing was changed"
    )


def not_applicable(
    question_id: str, status: QuestionStatus, applied_at: float | None, *, run_id: str | None
) -> AlreadyAnswered:
    """The error for applying question ``question_id`` in ``status`` (applied at ``applied_at``).

    ``run_id`` names the run whose harvest was refused, or None outside a harvest.
    """
    already = applied_at is not None and status is not QuestionStatus.APPLIED
    state = f"{status.value} and already applied" if already else status.value
    where = f"run {run_id!r}: " if run_id is not None else ""
    tail = "; nothing of this harvest was written" if run_id is not None else ""
    return AlreadyAnswered(
        f"{where}question {question_id!r} is {state}, so its answer cannot be applied{tail}"
    )


def check_apply_deferral(question_id: str, error: str, retry_at: float) -> str:
    """Validate a ``defer_answer`` of ``question_id`` and return ``error`` as it is stored.

    ``retry_at`` must be a finite number (a NaN would read back as no time at
    all); ``error`` must be text, stored through :func:`printable_text` and cut
    to :data:`MAX_APPLY_ERROR` characters.
    """
    if not isinstance(error, str):
        raise ValueError(f"question {question_id!r}: error must be text, got {error!r}")
    is_number = isinstance(retry_at, int | float) and not isinstance(retry_at, bool)
    if not is_number or not math.isfinite(retry_at):
        raise ValueError(
            f"question {question_id!r}: retry_at must be a finite wall-clock time, got {retry_at!r}"
        )
    text = printable_text(error)
    if len(text) > MAX_APPLY_ERROR:
        text = text[: MAX_APPLY_ERROR - 1] + "\u2026"
    return text


def due(retry_at: float | None, now: float) -> bool:
    """Whether an unapplied answer whose apply was deferred to ``retry_at`` is due at ``now``."""
    return retry_at is None or retry_at <= now


def due_order(q: QuestionRow) -> tuple[bool, float, str]:
    """Sort key of ``unapplied_answers``: fresh answers by ``answered_at``, then deferred ones by ``retry_at``."""
    if q.retry_at is None:
        return False, q.answered_at or 0.0, q.question_id
    return True, q.retry_at, q.question_id


# --- names and text (NUL, lone surrogates) -------------------------------------------
# SQLite keeps a NUL inside text but its SQL functions stop at it, Postgres
# refuses it, and a lone surrogate is not UTF-8 at all (the SQLite driver
# raises ``UnicodeEncodeError``). Names are refused up front, naming the field;
# free-text error messages are escaped instead, so any failure can be recorded.

#: Most characters of an apply error a question keeps (a traceback can be long).
MAX_APPLY_ERROR = 4000


def _text_problem(value: str) -> str | None:
    if "\x00" in value:
        return "contains a NUL character (\\x00)"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"contains a lone surrogate {value[exc.start]!r}, which is not valid Unicode"
    return None


def check_name(field: str, value: str | None, *, context: str = "") -> None:
    """Raise ``ValueError`` naming ``field`` if ``value`` holds a NUL or a lone surrogate.

    ``context`` prefixes the message (e.g. ``"run 'r1': "``). None passes.
    """
    if value is None or ("\x00" not in value and value.isascii()):
        return  # the fast path: plain ASCII
    problem = _text_problem(value)
    if problem is not None:
        raise ValueError(f"{context}{field} {value!r} {problem}, which no store can keep")


def check_names(context: str = "", **fields: str | None) -> None:
    """:func:`check_name` on every keyword argument (the field name is the keyword)."""
    for field, value in fields.items():
        check_name(field, value, context=context)


def _check_each(field: str, values: Iterable[str | None], context: str) -> None:
    for value in values:
        check_name(field, value, context=context)


def check_harvest(run_id: str, harvest: Harvest) -> None:
    """Everything a store checks of ``harvest`` for run ``run_id`` before writing any of it.

    The names in it (node ids, statuses, event types, question ids, pollers)
    carry no NUL or lone surrogate, and the questions it opens are open and
    unanswered (:func:`check_new_questions`). ``ValueError`` otherwise.
    """
    if not _plain_ascii(_harvest_names(run_id, harvest)):  # rare: find and name the culprit
        check_name("run_id", run_id)
        where = f"run {run_id!r}: "
        _check_each("node_id", (n.node_id for n in harvest.nodes), where)
        _check_each("node status", (n.status for n in harvest.nodes), where)
        _check_each("node_id", (r.node_id for r in harvest.results), where)
        _check_each("node_id", (f.node_id for f in harvest.frozen), where)
        _check_each("node_id", (e.node_id for e in harvest.events), where)
        _check_each("event type", (e.type for e in harvest.events), where)
        for q in harvest.questions:
            check_names(where, question_id=q.question_id, run_id=q.run_id, node_id=q.node_id)
            check_name("poller", q.poller, context=where)
        _check_each("question_id", harvest.applied, where)
        _check_each("question_id", harvest.superseded, where)
        _check_each("node_id", (c.node_id for c in harvest.chunks), where)
    check_new_questions(run_id, harvest)


#: Fields of the row tuples that are names: node id and status; type and node id.
_NODE_NAMES = operator.itemgetter(0, 1)
_EVENT_NAMES = operator.itemgetter(1, 2)
_FIRST = operator.itemgetter(0)
_CHUNK_NODE = operator.itemgetter(2)


def check_cursor(after: object, limit: object) -> None:
    """Refuse a stream cursor out of range (see ``checked_cursor``), or a ``limit`` not >= 1."""
    checked_cursor(after)
    if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= 100_000:
        raise ValueError(f"limit must be an integer within 1..100000, got {limit!r}")


def _harvest_names(run_id: str, harvest: Harvest) -> list[str]:
    # This runs on every commit: the rows' fields are gathered in C (map, itemgetter).
    names = [run_id]
    names += chain.from_iterable(map(_NODE_NAMES, harvest.nodes))
    names += map(_FIRST, harvest.results)
    for f in harvest.frozen:
        names.append(f.node_id)
    names += filter(None, chain.from_iterable(map(_EVENT_NAMES, harvest.events)))
    for q in harvest.questions:
        names += (q.question_id, q.run_id, q.node_id, q.poller or "")
    if harvest.applied or harvest.superseded:
        names += harvest.applied
        names += harvest.superseded
    if harvest.chunks:
        names += map(_CHUNK_NODE, harvest.chunks)
    return names


def _plain_ascii(names: list[str]) -> bool:
    """Whether every name is ASCII without NUL: one pass in C over them all (the common case)."""
    text = "".join(names)
    return text.isascii() and "\x00" not in text


def printable_text(text: str) -> str:
    """``text`` with NUL as ``\\x00`` and lone surrogates as ``\\udXXX``: storable everywhere."""
    if "\x00" not in text and text.isascii():
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8").replace("\x00", "\\x00")


# --- read-only stores ------------------------------------------------------------------


def read_only_refusal(where: str, context: str) -> StoreError:
    """The error for a write (``context``) to a store ``where`` that was opened read-only."""
    return StoreError(
        f"{context}: {where} was opened read-only; nothing was written "
        "(open it without read_only to change it)"
    )


def stream_tails(rows: Sequence[ChunkRow], chars: int, limit: int) -> list[StreamTail]:
    """Each of the first ``limit`` streams of ``rows`` (a run's, in ``seq`` order) as its
    tail: its last rows, the fewest whose ``data_json`` hold more than ``chars``
    characters together (all if it holds no more), and how many chunks it holds.

    The SQL stores make the same choice in :data:`SELECT_STREAM_TAILS`.
    """
    streams: dict[int, list[ChunkRow]] = {}
    for row in rows:
        if row.stream in streams or len(streams) < limit:
            streams.setdefault(row.stream, []).append(row)
    tails = []
    for stream_rows in streams.values():
        later, start = 0, len(stream_rows)
        while start > 0 and later <= chars:  # a row is kept while what follows it fits
            start -= 1
            later += len(stream_rows[start].data_json or "")
        chunks = sum(1 for r in stream_rows if r.kind == "chunk")
        tails.append(StreamTail(rows=tuple(stream_rows[start:]), chunks=chunks))
    return tails
