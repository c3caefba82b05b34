"""In-memory run store, and the store rules every backend shares.

The rules (fencing, lease grants, status transitions, format checks) are plain
functions over values read from the backend, so the memory, SQLite and
Postgres stores apply the very same decisions inside their own transactions.

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
from collections.abc import Callable, Iterable, Iterator

from .._errors import (
    AlreadyAnswered,
    CorruptRecord,
    LeaseHeld,
    LeaseLost,
    QuestionNotFound,
    RunExists,
    RunNotFound,
    StoreError,
    UnsupportedFormat,
)
from ._artifacts import ArtifactLedger
from ._base import (
    FORMAT_VERSION,
    QUESTION_TRANSITIONS,
    RUN_TRANSITIONS,
    ArtifactVersion,
    EventRow,
    FrozenInput,
    Harvest,
    NewRun,
    NodeRow,
    QuestionRow,
    QuestionStatus,
    ResultRow,
    RunRecord,
    RunStatus,
    RunStore,
    StoredRun,
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
) -> int:
    """Return the fencing token ``owner`` gets on run ``run_id`` at ``now`` (D6).

    ``holder``, ``expires`` and ``lease_token`` describe the current lease. A
    live lease of the same owner keeps its token; a live lease of another
    owner raises :class:`LeaseHeld`; any fresh grant (no lease, an expired or
    a released one) gets the next, larger token.
    """
    live = holder is not None and expires is not None and expires > now
    if live and holder == owner:
        return lease_token
    if live:
        assert expires is not None
        raise LeaseHeld(f"run {run_id!r} is leased by {holder!r} for another {expires - now:.3f}s")
    return lease_token + 1


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


def duplicate_in_harvest(run_id: str, harvest: Harvest) -> str | None:
    """Describe a row ``harvest`` of run ``run_id`` repeats itself (result, frozen input, event)."""
    checks: tuple[tuple[str, Iterable[object]], ...] = (
        ("result", ((r.node_id, r.visit) for r in harvest.results)),
        ("frozen input", ((f.node_id, f.activation) for f in harvest.frozen)),
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
        if q.status is not QuestionStatus.OPEN or answered:
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


def not_open(question_id: str, status: QuestionStatus) -> AlreadyAnswered:
    """The error for answering question ``question_id`` that is in ``status``, not ``open`` (Q2)."""
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
        self._results: dict[str, dict[tuple[str, int], ResultRow]] = {}
        self._frozen: dict[str, dict[tuple[str, int], FrozenInput]] = {}
        self._events: dict[str, dict[int, EventRow]] = {}
        self._questions: dict[str, QuestionRow] = {}
        self._artifacts = ArtifactLedger(clock)

    async def open(self) -> None:
        """Nothing to connect; kept for the contract. Idempotent."""

    async def close(self) -> None:
        """Nothing to flush; data is kept for a later ``open``. Idempotent."""

    def _run(self, run_id: str) -> RunRecord:
        try:
            return self._runs[run_id]
        except KeyError:
            raise RunNotFound(f"no run {run_id!r} in the store") from None

    async def create_run(self, run: NewRun) -> None:
        """Store a new run with status ``running``; ``RunExists`` if ``run.run_id`` is taken."""
        check_new_format(run)
        with self._lock:
            if run.run_id in self._runs:
                raise RunExists(f"run {run.run_id!r} already exists")
            self._runs[run.run_id] = RunRecord(
                run_id=run.run_id,
                graph_name=run.graph_name,
                graph_ref=run.graph_ref,
                fingerprint=run.fingerprint,
                status=RunStatus.RUNNING,
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
            )
            self._nodes[run.run_id] = {}
            self._results[run.run_id] = {}
            self._frozen[run.run_id] = {}
            self._events[run.run_id] = {}

    async def commit(self, run_id: str, token: int, harvest: Harvest) -> None:
        """Apply ``harvest`` to ``run_id`` atomically if ``token`` is current (D1, D6, Q3)."""
        check_new_questions(run_id, harvest)
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
                error=harvest.error,
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
        self, *, status: RunStatus | None = None, limit: int | None = None
    ) -> list[RunRecord]:
        """Runs newest first (``created_at``, then ``run_id``), only ``status`` ones if given, at most ``limit``."""
        with self._lock:
            runs = [r for r in self._runs.values() if status is None or r.status == status]
        runs.sort(key=lambda r: (r.created_at, r.run_id), reverse=True)
        return runs if limit is None else runs[: max(limit, 0)]

    async def results(self, run_id: str, node_id: str | None = None) -> list[ResultRow]:
        """Result rows of ``run_id`` (only ``node_id``'s if given), by node then visit."""
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

    async def acquire_lease(self, run_id: str, owner: str, ttl: float) -> int:
        """Lease ``run_id`` to ``owner`` for ``ttl`` seconds; return the fencing token (D6)."""
        check_ttl(ttl)
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
            )
            self._runs[run_id] = dataclasses.replace(
                record, lease_owner=owner, lease_expires=now + ttl, lease_token=token
            )
            return token

    async def heartbeat(self, run_id: str, owner: str, token: int, ttl: float) -> None:
        """Extend ``owner``'s lease on ``run_id`` to ``ttl`` from now; ``LeaseLost`` if ``token`` is stale."""
        check_ttl(ttl)
        with self._lock:
            record = self._run(run_id)
            check_holder(
                run_id, owner, token, holder=record.lease_owner, lease_token=record.lease_token
            )
            self._runs[run_id] = dataclasses.replace(record, lease_expires=self._clock() + ttl)

    async def release_lease(self, run_id: str, owner: str, token: int) -> None:
        """Drop ``owner``'s lease on ``run_id`` if still held with ``token``; else do nothing."""
        with self._lock:
            record = self._runs.get(run_id)
            if record and record.lease_owner == owner and record.lease_token == token:
                self._runs[run_id] = dataclasses.replace(
                    record, lease_owner=None, lease_expires=None
                )

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
        with self._lock:
            row = self._question(question_id)
            if row.status is not QuestionStatus.OPEN:
                raise not_open(question_id, row.status)
            row = dataclasses.replace(
                row, status=status, answer_json=answer_json, answered_by=by,
                answered_at=self._clock(),
            )  # fmt: skip
            self._questions[question_id] = row
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
        with self._lock:
            rows = [
                q
                for q in self._questions.values()
                if status in (None, q.status) and run_id in (None, q.run_id)
            ]
        rows.sort(key=lambda q: (q.created_at, q.question_id))
        return rows if limit is None else rows[: max(limit, 0)]

    async def unapplied_answers(self, *, limit: int = 100) -> list[QuestionRow]:
        """Answered or expired questions not applied yet, oldest ``answered_at`` first, at most ``limit`` (Q4)."""
        with self._lock:
            rows = [q for q in self._questions.values() if can_apply(q.status, q.applied_at)]
        rows.sort(key=lambda q: (q.answered_at or 0.0, q.question_id))
        return rows[: max(limit, 0)]

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
