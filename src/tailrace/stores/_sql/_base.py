"""The SQL stores' one base: every operation whose SQL is the same, written once.

:class:`SQLStore` implements the contract's primitives over the shared
transaction bodies (``_transactions``) and statements. A backend subclasses
it and says how a body runs, in two hooks:

- :meth:`SQLStore._read_tx` runs a body in a read (SQLite: on a reader
  thread; Postgres: autocommit statements on a pooled connection, or one
  ``REPEATABLE READ`` transaction when the read must see one moment);
- :meth:`SQLStore._write_tx` runs a body in one write transaction (SQLite:
  a savepoint in the writer thread's group; Postgres: a transaction re-run
  after a transient failure, settled by ``landed`` when the answer to its
  ``COMMIT`` was lost, its refused ``texts`` named).

A backend keeps its connections, its dialect (``Tx``, :attr:`SQLStore._no_limit`)
and what only its locking can do: claims (SKIP LOCKED and advisory locks on
Postgres, the writer's ``BEGIN IMMEDIATE`` on SQLite) and batched submits.
Driver errors are mapped where a backend runs a body, in one place per backend.

Clock: a body reads ``now`` when it runs (on SQLite's writer thread; at each
Postgres attempt), unless what a write returns carries it (an artifact
version), which fixes it once per call.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Coroutine, Iterable, Iterator, Sequence
from typing import Any, ClassVar, TypeVar

from .._changes import ChangeHub
from .._contract import ChangeFeed, Presence, RunStore
from .._presence import Sessions
from .._queue_rules import (
    STALE_REGISTRATION,
    graph_from_row,
    queue_rows,
    schedule_from_row,
    worker_params,
    worker_rows,
)
from .._records import (
    ArtifactVersion,
    ChunkRow,
    Claim,
    EventRow,
    FrozenInput,
    GraphRow,
    Harvest,
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
)
from .._rules import read_only_refusal
from . import _transactions as bodies
from . import _worker_graphs as fleet
from ._queues import (
    ANSWER_CANDIDATES,
    ANY_QUEUED,
    CANCEL_REQUESTS,
    DELETE_SCHEDULE,
    DELETE_WORKER,
    LEASED_BY,
    RUN_COUNTS,
    RUN_DURATIONS,
    SELECT_GRAPHS_NAMED,
    SELECT_QUEUES,
    SELECT_SCHEDULES,
    SELECT_WORKERS,
    TOP_LEVEL_RUN_COUNTS,
    UPSERT_WORKER,
    list_runs_query,
    run_counts_from_rows,
)
from ._statements import (
    APPLY_QUESTION,
    DEFER_ANSWER,
    DUE_ANSWERS,
    EXPIRED_LEASES,
    QUESTION_COUNTS,
    SELECT_ARTIFACT_HEAD,
    SELECT_ARTIFACT_HISTORY,
    SUPERSEDE_QUESTION,
    artifact_from_row,
    list_questions_query,
    question_counts_from,
    question_from_row,
    record_from_row,
)
from ._transactions import Params, Row, Tx

T = TypeVar("T")
R = TypeVar("R")

#: What a call does in one transaction: a shared body bound to its arguments.
Body = Callable[[Tx], Coroutine[Any, Any, T]]
#: The texts a write stores, by name, so that a backend can name one its database refuses.
Texts = Callable[[], Iterable[tuple[str, str | None]]]
#: The write that undoes what a cancelled (or failed) call did, from what its body
#: recorded as it ran (None: nothing to undo).
Undo = Callable[[], Body[None] | None]


def harvest_texts(harvest: Harvest) -> Iterator[tuple[str, str | None]]:
    """The payload texts ``harvest`` stores, each named by what it belongs to."""
    yield "state_json", harvest.state_json
    for n in harvest.nodes:
        yield f"data_json of node {n.node_id!r}", n.data_json
    for r in harvest.results:
        yield f"result of node {r.node_id!r} visit {r.visit}", r.value_json
    for f in harvest.frozen:
        yield f"frozen input of node {f.node_id!r} activation {f.activation}", f.payload_json
    for e in harvest.events:
        yield f"data_json of event seq {e.seq}", e.data_json
    for q in harvest.questions:
        yield f"prompt_json of question {q.question_id!r}", q.prompt_json


def selected(sql: str, params: Params, into: Callable[[list[Row]], R]) -> Body[R]:
    """A read of the rows ``sql`` selects, made a result by ``into``."""

    async def read(tx: Tx) -> R:
        return into(await tx.all(sql, params))

    return read


def each(sql: str, params: Params, row_to: Callable[[Row], R]) -> Body[list[R]]:
    """A read of every row ``sql`` selects, each made a record by ``row_to``."""

    async def read(tx: Tx) -> list[R]:
        return [row_to(r) for r in await tx.all(sql, params)]

    return read


def _any_queued(queue: str) -> Body[bool]:
    async def look(tx: Tx) -> bool:
        return await tx.one(ANY_QUEUED, (queue,)) is not None

    return look


def _first(row: Row) -> Any:
    return row[0]


async def _nothing(tx: Tx) -> None:
    """What a write that returns nothing returns once its lost COMMIT turns out to have landed."""


async def _changed(tx: Tx) -> bool:
    """A compare-and-set whose lost COMMIT turns out to have landed: it changed the row."""
    return True


async def _no_cancel_known(tx: Tx) -> bool:
    return False  # a harvest whose COMMIT landed unseen: the lease heartbeat hears a cancel


def _releasing(run_ids: list[str], owner: str) -> Undo:
    """The undo of a claim: let go of the leases on ``run_ids`` (filled by the claim as it
    runs), so those runs are adopted at once instead of after their ttl."""

    def undo() -> Body[None] | None:
        if not run_ids:
            return None
        ids = list(run_ids)
        return lambda tx: bodies.release_claimed(tx, ids, owner)

    return undo


class SQLStore(RunStore):
    """The contract's primitives over shared SQL; a backend runs the bodies (see the module)."""

    _clock: Callable[[], float]
    _hub: ChangeHub
    #: This store object's session in the fleet (W7), with the backend's tokens.
    _sessions: Sessions
    #: The ``LIMIT`` value that means no limit: SQLite's ``-1``, Postgres's ``NULL``.
    _no_limit: ClassVar[int | None]
    #: Queues whose last claim here got all it asked for, whose next claim skips the
    #: look for a queued run (a busy fleet's queue: the look only spares an idle queue
    #: a write); None: every claim looks first.
    _full_queues: set[str] | None = None

    # -- what a backend implements ----------------------------------------------------

    @abc.abstractmethod
    async def _read_tx(self, context: str, body: Body[T], *, snapshot: bool = False) -> T:
        """Run ``body`` as a read; with ``snapshot``, all its statements see one moment."""

    @abc.abstractmethod
    async def _write_tx(
        self,
        context: str,
        body: Body[T],
        *,
        landed: Body[T] | None = None,
        texts: Texts | None = None,
        undo: Undo | None = None,
    ) -> T:
        """Run ``body`` in one write transaction; refused by a read-only store.

        ``landed`` gives the result when a ``COMMIT`` whose answer was lost
        turns out to have landed (the body records the transaction first, by
        a ``Tx.lock`` or ``Tx.change``); without it a body must be harmless to
        run again. ``texts`` name what the write stores, for an error. With
        ``undo``, a call cancelled (or failing) once the body ran commits the
        write ``undo()`` gives before the error propagates.
        """

    def changes(self) -> contextlib.AbstractAsyncContextManager[ChangeFeed]:
        """Wake-ups from the backend's watcher (see :meth:`RunStore.changes`)."""
        return self._hub.subscribe()

    # -- runs -------------------------------------------------------------------------

    async def _create_run(self, run: NewRun) -> None:
        await self._write_tx(
            f"run {run.run_id!r}", lambda tx: bodies.create_run(tx, run), landed=_nothing,
            texts=lambda: [("input_json", run.input_json)],
        )  # fmt: skip

    async def _commit(self, run_id: str, token: int, harvest: Harvest) -> bool:
        return await self._write_tx(
            f"run {run_id!r}",
            lambda tx: bodies.commit_harvest(tx, run_id, token, harvest, self._clock()),
            landed=_no_cancel_known, texts=lambda: harvest_texts(harvest),
        )  # fmt: skip

    async def _load_run(self, run_id: str) -> StoredRun:
        return await self._read_tx(f"run {run_id!r}", lambda tx: bodies.load_run(tx, run_id))

    async def _snapshot(self, run_id: str) -> RunSnapshot:
        no_limit = self._no_limit
        return await self._read_tx(
            f"run {run_id!r}", lambda tx: bodies.snapshot(tx, run_id, no_limit), snapshot=True
        )

    async def _get_run(self, run_id: str) -> RunRecord:
        return await self._read_tx(f"run {run_id!r}", lambda tx: bodies.get_run(tx, run_id))

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
        value = None if status is None else status.value
        sql, params = list_runs_query(value, queue, graph, parent, top_level=top_level)
        params += (self._no_limit if limit is None else max(limit, 0), max(offset, 0))
        return await self._read_tx("listing runs", each(sql, params, record_from_row))

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
        now = self._clock()

        def move(tx: Tx) -> Coroutine[Any, Any, None]:
            return bodies.move_run(
                tx, run_id, owner, token, fingerprint=fingerprint, graph_ref=graph_ref,
                expected=expected, now=now,
            )  # fmt: skip

        await self._write_tx(f"run {run_id!r}", move, landed=_nothing)

    async def _frontiers(self, graph_name: str) -> dict[str, tuple[str, ...]]:
        return await self._read_tx(
            f"graph {graph_name!r}", lambda tx: bodies.frontiers(tx, graph_name)
        )

    async def _graph_shape(self, graph_name: str, fingerprint: str) -> str | None:
        return await self._read_tx(
            f"graph {graph_name!r}", lambda tx: bodies.graph_shape(tx, graph_name, fingerprint)
        )

    async def _wake_suspended(self, run_id: str) -> bool:
        now = self._clock()
        return await self._write_tx(
            f"run {run_id!r}", lambda tx: bodies.wake_suspended(tx, run_id, now)
        )

    async def _overdue_runs(self, now: float, *, limit: int) -> list[str]:
        return await self._read_tx(
            "finding overdue runs", lambda tx: bodies.overdue_runs(tx, now, limit)
        )

    async def _run_counts(self, *, top_level: bool = False) -> list[RunCount]:
        sql = TOP_LEVEL_RUN_COUNTS if top_level else RUN_COUNTS
        return await self._read_tx("counting runs", selected(sql, (), run_counts_from_rows))

    async def _results(self, run_id: str, node_id: str | None = None) -> list[ResultRow]:
        return await self._read_tx(
            f"run {run_id!r}", lambda tx: bodies.results(tx, run_id, node_id)
        )

    async def _outputs(self, run_ids: list[str]) -> dict[str, str]:
        return await self._read_tx(
            f"outputs of {len(run_ids)} runs", lambda tx: bodies.outputs(tx, run_ids)
        )

    async def _frozen_inputs(self, run_id: str) -> list[FrozenInput]:
        return await self._read_tx(f"run {run_id!r}", lambda tx: bodies.frozen_inputs(tx, run_id))

    async def _events(self, run_id: str, *, after_seq: int = 0) -> list[EventRow]:
        return await self._read_tx(
            f"run {run_id!r}", lambda tx: bodies.events(tx, run_id, after_seq)
        )

    async def _chunks(self, run_id: str, *, after: int, limit: int) -> list[ChunkRow]:
        return await self._read_tx(
            f"run {run_id!r}", lambda tx: bodies.chunks(tx, run_id, after, limit)
        )

    async def _stream_tails(self, run_id: str, *, chars: int, limit: int) -> list[StreamTail]:
        return await self._read_tx(
            f"run {run_id!r}", lambda tx: bodies.stream_tails(tx, run_id, chars, limit)
        )

    async def _stream_head(self, run_id: str) -> StreamHead:
        return await self._read_tx(f"run {run_id!r}", lambda tx: bodies.stream_head(tx, run_id))

    async def _prune_streams(self, finished_before: float) -> int:
        return await self._write_tx(
            "pruning streams", lambda tx: bodies.prune_streams(tx, finished_before)
        )

    # -- leases (D6) --------------------------------------------------------------------

    async def _acquire_lease(
        self, run_id: str, owner: str, ttl: float, *, steal_from: str | None = None
    ) -> int:
        # A call cancelled (or failing) after granting a new lease releases it
        # before the error propagates; a renewal is left alone (the caller held
        # that lease before). A re-run after a lost COMMIT finds the lease its own.
        granted: list[int] = []  # new tokens this call wrote

        async def take(tx: Tx) -> int:
            token, new = await bodies.take_lease(tx, run_id, owner, ttl, steal_from, self._clock)
            if new:
                granted.append(token)
            return token

        def undo() -> Body[None] | None:
            if not granted:
                return None
            token = granted[-1]
            return lambda tx: bodies.release_lease(tx, run_id, owner, token)

        return await self._write_tx(f"run {run_id!r}", take, undo=undo)

    async def _heartbeat(self, run_id: str, owner: str, token: int, ttl: float) -> None:
        await self._write_tx(
            f"run {run_id!r}",
            lambda tx: bodies.extend_lease(tx, run_id, owner, token, ttl, self._clock),
        )

    async def _release_lease(self, run_id: str, owner: str, token: int) -> None:
        await self._write_tx(
            f"run {run_id!r}", lambda tx: bodies.release_lease(tx, run_id, owner, token)
        )

    async def _expired_leases(self, now: float, *, limit: int = 100) -> list[str]:
        return await self._read_tx(
            "finding expired leases", each(EXPIRED_LEASES, (now, max(limit, 0)), _first)
        )

    # -- the question ledger (Q2-Q5) ---------------------------------------------------

    async def _answer(
        self,
        question_id: str,
        answer_json: str,
        *,
        by: str | None = None,
        status: QuestionStatus = QuestionStatus.ANSWERED,
    ) -> QuestionRow:
        now = self._clock()
        return await self._write_tx(
            f"question {question_id!r}",
            lambda tx: bodies.answer(tx, question_id, answer_json, by, status, now),
            landed=lambda tx: bodies.get_question(tx, question_id),
            texts=lambda: [("answer_json", answer_json)],
        )

    async def _get_question(self, question_id: str) -> QuestionRow:
        return await self._read_tx(
            f"question {question_id!r}", lambda tx: bodies.get_question(tx, question_id)
        )

    async def _list_questions(
        self,
        *,
        status: QuestionStatus | None = None,
        run_id: str | None = None,
        limit: int | None = None,
        offset: int = 0,
    ) -> list[QuestionRow]:
        query, params = list_questions_query(status, run_id)
        params += (self._no_limit if limit is None else max(limit, 0), offset)
        return await self._read_tx("listing questions", each(query, params, question_from_row))

    async def _question_counts(self) -> dict[QuestionStatus, int]:
        counts = selected(QUESTION_COUNTS, (), question_counts_from)
        return await self._read_tx("counting questions", counts)

    async def _unapplied_answers(
        self, *, limit: int = 100, now: float | None = None
    ) -> list[QuestionRow]:
        params = (self._clock() if now is None else now, max(limit, 0))
        return await self._read_tx(
            "listing unapplied answers", each(DUE_ANSWERS, params, question_from_row)
        )

    async def _question_cas(
        self, question_id: str, update: str, values: Callable[[], Params]
    ) -> bool:
        """Run a question compare-and-set (``values`` taken in the transaction)."""
        return await self._write_tx(
            f"question {question_id!r}",
            lambda tx: bodies.question_cas(tx, update, values(), question_id),
            landed=_changed,
        )

    async def _defer_answer(self, question_id: str, *, error: str, retry_at: float) -> None:
        await self._question_cas(question_id, DEFER_ANSWER, lambda: (error, retry_at, question_id))

    async def _mark_applied(self, question_id: str) -> bool:
        return await self._question_cas(
            question_id, APPLY_QUESTION, lambda: (self._clock(), question_id)
        )

    async def _supersede(self, question_id: str) -> bool:
        return await self._question_cas(question_id, SUPERSEDE_QUESTION, lambda: (question_id,))

    # -- parked items (P3, P4) ---------------------------------------------------------

    async def _list_parked(
        self,
        *,
        graph_name: str | None,
        node_id: str | None,
        status: ParkedStatus | None,
        claimed_by: str | None,
        run_id: str | None,
    ) -> list[ParkedRow]:
        return await self._read_tx(
            "listing parked items",
            lambda tx: bodies.list_parked(tx, graph_name, node_id, status, claimed_by, run_id),
        )

    async def _claim_parked(
        self, graph_name: str, node_id: str, claimant: str, limit: int
    ) -> list[ParkedRow]:
        # Idempotent (a claimant gets back what it holds): a lost COMMIT is re-run.
        now = self._clock()
        return await self._write_tx(
            f"claiming parked items of {node_id!r}",
            lambda tx: bodies.claim_parked(tx, graph_name, node_id, claimant, limit, now),
        )

    async def _unclaim_parked(self, pairs: Sequence[tuple[str, str]]) -> int:
        # Idempotent (a row no longer claimed by its claimant is left): a lost COMMIT is re-run.
        return await self._write_tx(
            "giving back claimed parked items", lambda tx: bodies.unclaim_parked(tx, pairs)
        )

    async def _drop_parked(self, park_id: str) -> bool:
        return await self._write_tx(
            f"parked item {park_id!r}", lambda tx: bodies.drop_parked(tx, park_id)
        )

    # -- the evolve ledger -------------------------------------------------------------

    async def _artifact_head(self, artifact_id: str) -> ArtifactVersion | None:
        rows = await self._read_tx(
            f"artifact {artifact_id!r}",
            each(SELECT_ARTIFACT_HEAD, (artifact_id,), artifact_from_row),
        )
        return rows[0] if rows else None

    async def _commit_artifact(
        self, artifact_id: str, expected: int, entries_json: str, meta_json: str = "{}"
    ) -> ArtifactVersion:
        version = ArtifactVersion(
            artifact_id=artifact_id, version=expected + 1, entries_json=entries_json,
            meta_json=meta_json, created_at=self._clock(),
        )  # fmt: skip

        async def landed(tx: Tx) -> ArtifactVersion:
            return version

        return await self._write_tx(
            f"artifact {artifact_id!r}", lambda tx: bodies.commit_artifact(tx, version),
            landed=landed,
            texts=lambda: [("entries_json", entries_json), ("meta_json", meta_json)],
        )  # fmt: skip

    async def _artifact_history(self, artifact_id: str) -> list[ArtifactVersion]:
        return await self._read_tx(
            f"artifact {artifact_id!r}",
            each(SELECT_ARTIFACT_HISTORY, (artifact_id,), artifact_from_row),
        )

    # -- queues, schedules, workers (W1-W5) ---------------------------------------------

    async def _submit_run(self, run: NewRun, submission: Submission) -> str:
        async def landed(tx: Tx) -> str:
            return run.run_id  # the insert landed: the run is the one submitted

        return await self._write_tx(
            f"run {run.run_id!r}", lambda tx: bodies.submit_run(tx, run, submission),
            landed=landed, texts=lambda: [("input_json", run.input_json)],
        )  # fmt: skip

    async def _submit_runs(
        self,
        runs: Sequence[tuple[NewRun, Submission]],
        claim: Claim | None,
        skip: tuple[str, ...],
    ) -> tuple[list[str], list[str]]:
        claimed: list[str] = []

        async def submit(tx: Tx) -> tuple[list[str], list[str]]:
            claimed.clear()
            stored = await tx.insert_queued(runs, wake=claim is None)
            if claim is not None:
                claimed.extend(await tx.claim(claim, None, skip, self._clock))
                if set(stored) - set(claimed):
                    await tx.signal("submit")
            return stored, list(claimed)

        async def landed(tx: Tx) -> tuple[list[str], list[str]]:
            # The lost COMMIT stored what it inserted, and leased what it claimed.
            return [run.run_id for run, _ in runs], list(claimed)

        return await self._write_tx(
            f"{len(runs)} runs from {runs[0][0].run_id!r}", submit, landed=landed,
            texts=lambda: [("input_json", run.input_json) for run, _ in runs],
            undo=None if claim is None else _releasing(claimed, claim.owner),
        )  # fmt: skip

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
        full = self._full_queues
        look = full is None or queue not in full
        if look and not await self._read_tx(f"queue {queue!r}", _any_queued(queue)):
            return []
        claimed: list[str] = []
        wanted = Claim(queue=queue, owner=owner, ttl=ttl, limit=limit)

        async def claim(tx: Tx) -> list[str]:
            claimed.clear()
            claimed[:] = await tx.claim(wanted, graphs, skip, self._clock)
            return list(claimed)

        async def landed(tx: Tx) -> list[str]:
            return list(claimed)  # known before the COMMIT whose answer was lost

        ids = await self._write_tx(
            f"queue {queue!r}", claim, landed=landed, undo=_releasing(claimed, owner)
        )
        if full is not None:
            (full.add if len(ids) >= limit else full.discard)(queue)
        return ids

    async def _claim_answers(self, owner: str, ttl: float, *, limit: int) -> list[QuestionRow]:
        now = self._clock()
        any_due = await self._read_tx(
            "claiming answers", lambda tx: tx.one(ANSWER_CANDIDATES, (now, now, 1))
        )
        if any_due is None:
            return []
        taken: list[QuestionRow] = []
        leased: list[str] = []  # the runs of ``taken``

        async def lease(tx: Tx) -> list[QuestionRow]:
            taken.clear()
            leased.clear()
            ids = await tx.lease_answers(owner, ttl, limit, self._clock)
            taken[:] = [await bodies.get_question(tx, q) for q in ids]
            leased[:] = [q.run_id for q in taken]
            return list(taken)

        async def landed(tx: Tx) -> list[QuestionRow]:
            return list(taken)

        return await self._write_tx(
            "claiming answers", lease, landed=landed, undo=_releasing(leased, owner)
        )

    async def _return_claim(self, run_id: str, owner: str) -> bool:
        return await self._write_tx(
            f"run {run_id!r}", lambda tx: bodies.return_claim(tx, run_id, owner, self._clock())
        )

    async def _request_cancel(self, run_id: str) -> RunStatus:
        # A re-run after a lost COMMIT changes nothing more.
        return await self._write_tx(
            f"run {run_id!r}", lambda tx: bodies.request_cancel(tx, run_id, self._clock())
        )

    async def _reopen_cancelled(
        self, run_id: str, owner: str, ttl: float, nodes: tuple[str, ...]
    ) -> bool:
        # A re-run after a lost COMMIT finds the run running: False, and the caller's
        # resume then finds its own lease.
        return await self._write_tx(
            f"run {run_id!r}",
            lambda tx: bodies.reopen_cancelled(tx, run_id, owner, ttl, nodes, self._clock()),
        )

    async def _cancel_requests(self, owner: str) -> list[str]:
        return await self._read_tx(
            "listing cancel requests", each(CANCEL_REQUESTS, (owner,), _first)
        )

    async def _runs_leased_by(self, owner: str, *, limit: int = 100) -> list[str]:
        return await self._read_tx(
            "listing leased runs", each(LEASED_BY, (owner, max(limit, 0)), _first)
        )

    async def _declare_queue(self, queue: Queue) -> None:
        await self._write_tx(
            f"queue {queue.name!r}", lambda tx: bodies.declare_queue(tx, queue, self._clock())
        )

    async def _queues(self) -> list[Queue]:
        return await self._read_tx("listing queues", selected(SELECT_QUEUES, (), queue_rows))

    async def _pause_queue(self, name: str) -> None:
        await self._write_tx(
            f"queue {name!r}", lambda tx: bodies.pause_queue(tx, name, self._clock())
        )

    async def _resume_queue(self, name: str) -> bool:
        return await self._write_tx(f"queue {name!r}", lambda tx: bodies.resume_queue(tx, name))

    async def _delete_queue(self, name: str) -> bool:
        return await self._write_tx(f"queue {name!r}", lambda tx: bodies.delete_queue(tx, name))

    async def _queue_stats(self, now: float, *, window: float = 60.0) -> list[QueueStats]:
        return await self._read_tx(
            "queue statistics", lambda tx: bodies.queue_stats(tx, now, window), snapshot=True
        )

    async def _register_graph(self, row: GraphRow) -> None:
        await self._write_tx(f"graph {row.name!r}", lambda tx: bodies.register_graph(tx, row))

    async def _register_worker_graphs(self, worker_id: str, graphs: list[tuple[str, str]]) -> None:
        now = self._clock()
        await self._write_tx(
            f"worker {worker_id!r}",
            lambda tx: fleet.register_worker_graphs(
                tx, worker_id, graphs, now, now - STALE_REGISTRATION
            ),
        )

    async def _worker_graphs(self, worker_ids: list[str]) -> dict[str, frozenset[tuple[str, str]]]:
        return await self._read_tx("worker graphs", lambda tx: fleet.worker_graphs(tx, worker_ids))

    async def _graphs_named(self, name: str) -> list[GraphRow]:
        return await self._read_tx(
            f"graph {name!r}", each(SELECT_GRAPHS_NAMED, (name,), graph_from_row)
        )

    async def _declare_schedule(self, row: ScheduleRow) -> None:
        await self._write_tx(f"schedule {row.name!r}", lambda tx: bodies.declare_schedule(tx, row))

    async def _schedules(self) -> list[ScheduleRow]:
        return await self._read_tx(
            "listing schedules", each(SELECT_SCHEDULES, (), schedule_from_row)
        )

    async def _now(self) -> float:
        return self._clock()

    def _read_clock(self) -> float:
        return self._clock()

    async def _fire_schedule(self, name: str, tick: float) -> str | None:
        now = await self._now()  # the store's clock (Postgres: the server's) judges the tick
        fired: list[str | None] = [None]

        async def fire(tx: Tx) -> str | None:
            fired[0] = await bodies.fire_schedule(tx, name, tick, now, self._clock())
            return fired[0]

        async def landed(tx: Tx) -> str | None:
            return fired[0]  # its COMMIT landed: the run it stored is the tick's

        return await self._write_tx(f"schedule {name!r}", fire, landed=landed)

    async def _delete_schedule(self, name: str) -> bool:
        async def delete(tx: Tx) -> bool:
            return await tx.change_all(DELETE_SCHEDULE, (name,)) == 1

        return await self._write_tx(f"schedule {name!r}", delete)

    async def _worker_seen(self, worker: WorkerRow) -> None:
        params = worker_params(worker)
        await self._write_tx(
            f"worker {worker.worker_id!r}", lambda tx: tx.change_all(UPSERT_WORKER, params)
        )

    async def _pulse(self, worker: WorkerRow) -> Pulse:
        # A re-run after a lost COMMIT reports the same.
        return await self._write_tx(
            f"worker {worker.worker_id!r}", lambda tx: bodies.pulse(tx, worker, self._clock())
        )

    async def _workers(self) -> list[WorkerRow]:
        return await self._read_tx("listing workers", selected(SELECT_WORKERS, (), worker_rows))

    async def _forget_worker(self, worker_id: str) -> None:
        await self._write_tx(
            f"worker {worker_id!r}", lambda tx: tx.change_all(DELETE_WORKER, (worker_id,))
        )

    def _presence(self, worker: WorkerRow) -> contextlib.AbstractAsyncContextManager[Presence]:
        if self.read_only:
            raise read_only_refusal(type(self).__name__, f"worker {worker.worker_id!r}")
        return self._sessions.present(worker)

    async def _join_session(
        self, session: str, workers: list[WorkerRow], *, again: bool
    ) -> frozenset[str]:
        return await self._write_tx(
            f"store session {session!r}",
            lambda tx: bodies.join_session(tx, session, workers, self._clock(), again=again),
        )

    async def _bury_session(self, session: str) -> int:
        return await self._write_tx(
            f"store session {session!r}",
            lambda tx: bodies.bury_session(tx, session),
        )

    async def _ring_next(self, session: str) -> str | None:
        return await self._read_tx(
            f"store session {session!r}",
            lambda tx: bodies.ring_neighbour_of(tx, session, after=True),
        )

    async def _run_durations(
        self, fingerprint: str, *, limit: int = 200
    ) -> list[tuple[float, float]]:
        return await self._read_tx(
            "run durations",
            each(RUN_DURATIONS, (fingerprint, max(limit, 0)), lambda r: (float(r[0]), float(r[1]))),
        )
