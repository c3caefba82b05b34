"""Human-in-the-loop for real LangGraph graphs: interrupts become tailrace questions.

:class:`LangGraphDriver` puts a compiled LangGraph graph (one with a
checkpointer) behind the question ledger of a tailrace :class:`~tailrace.stores.RunStore`.
Each LangGraph thread is one tailrace run (``run_id`` = ``thread_id``); each
pending ``interrupt(...)`` is one question, first-answer-wins (Q2), applied
exactly once by a :class:`~tailrace.gates.ResumeWorker` (Q3, Q4)::

    driver = LangGraphDriver(graph, store)
    [question] = await driver.start("thread-1", {"topic": "tides"})
    await driver.answer(question.question_id, "yes")   # resumes the graph once

LangGraph is imported only when a driver is built, so ``import tailrace``
never needs it (``pip install 'tailrace[langgraph]'``).

Streams (S1-S3): a node's custom stream writes (``get_stream_writer()``)
are stream chunks of the thread's run, tagged with the node's task (visit
and attempt as in the thread's events) and ended ``accepted`` or
``discarded``; ``Engine.stream(thread_id)`` reads them from any process
(:mod:`._langgraph_streams`).

Machine gates (Q5): an interrupt whose value is a dict naming a ``"poller"``
and/or a ``"deadline"`` in seconds (build it with :func:`machine_gate`) is
recorded with that poller and an absolute deadline, so a
:class:`~tailrace.gates.Server` that has the driver among its targets polls
it and answers it, or answers it with a :class:`~tailrace.gates.GateTimeout`
once the deadline passed (route on :func:`as_gate_timeout`). Everything the
daemon needs is in the ledger and LangGraph's checkpoint, so a restarted
daemon carries on: open questions are polled again, answered ones swept,
and threads whose driver died mid-step are taken over (:meth:`LangGraphDriver.adopt`)::

    def verify(state):  # a LangGraph node
        verdict = interrupt(machine_gate({"check": "ci"}, poller="ci", deadline=3600))
        return {"ci": verdict}   # as_gate_timeout(verdict) after an hour without CI

    server = Server(Engine(store=store), targets=[driver], pollers={"ci": ci_status})

Why a resume never applies twice, although LangGraph's checkpoint and
tailrace's ledger cannot be written in one transaction:

- *Single flight.* Every resume runs under the thread's run lease: the worker
  takes it before :meth:`LangGraphDriver.invoke`, which keeps it alive while
  the graph runs, so no second driver (thread, process) resumes the thread
  at the same time (D6).
- *Whoever holds the lease applies every answer.* An answer that finds the
  thread busy was recorded before it tried the lease. The holder resumes all
  answered interrupts of the thread at once (one ``Command(resume={id:
  value, ...})``), again after each step for answers that arrived while it
  ran, and the driver's worker looks at the ledger once more after letting
  go (:class:`~tailrace.integrations._langgraph_worker.SettlingWorker`), so
  a ``busy`` answer is never left behind.
- *Turn guard on LangGraph's own record.* A question id names exactly one
  interrupt (:meth:`LangGraphDriver.question_id`). Once the step a resume
  ran is committed to the thread's checkpoint, LangGraph no longer reports
  that interrupt as pending, whatever the ledger says. The worker and
  ``invoke`` both check "still pending" under the lease before resuming;
  when LangGraph offers strict resumes, it checks again itself and refuses,
  before writing anything, a resume naming a consumed interrupt.
- *The crash window.* The answers a step applied are marked ``applied`` in
  the step's bookkeeping commit, under the lease, right after LangGraph
  committed the step (a step that ends the thread lets go of the lease in
  that commit, so nothing may be left to mark after it). A crash between the
  two commits leaves a question ``answered``; the restart sweep (Q4)
  re-drives it, finds the interrupt no longer pending and marks it
  ``superseded``: the answer was applied once, and the ledger does not
  claim it twice.
- *A failed step* (the node raised after ``interrupt`` returned, Q6) commits
  nothing in LangGraph: the worker defers the answer (it stays ``answered``
  and is retried with backoff), the run row records the error, and the retry
  re-runs the step, which LangGraph feeds the answer it recorded the first
  time. Code inside a node may run again on such a retry (LangGraph's own
  at-least-once node semantics); a committed step never does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

from .._codec import DEFAULT_CODEC
from .._errors import NotResumable, RunError, RunExists, RunNotFound
from ..gates import Outcome, WaitState
from ..stores import (
    TERMINAL_STATUSES,
    EventRow,
    Harvest,
    NewRun,
    QuestionRow,
    QuestionStatus,
    RunRecord,
    RunStatus,
    RunStore,
)
from . import _langgraph_support as lg
from ._langgraph_events import StepLog, structure_of
from ._langgraph_leases import Lease, ThreadLeases
from ._langgraph_streams import ThreadStream, writer_config
from ._langgraph_support import Pending, as_gate_timeout, machine_gate
from ._langgraph_worker import SettlingWorker

logger = logging.getLogger("tailrace.integrations.langgraph")

__all__ = ["CheckpointMissing", "LangGraphDriver", "as_gate_timeout", "machine_gate", "open_driver"]

#: ``graph_name`` of the run rows this driver creates is this prefix plus its name.
GRAPH_NAME_PREFIX = "langgraph:"
#: ``fingerprint`` of those rows: LangGraph, not tailrace, knows the graph's shape.
FINGERPRINT = "langgraph"

#: Answers one graph step applies: question id -> (interrupt id, value).
_Batch = dict[str, tuple[str, Any]]


class CheckpointMissing(RunError):
    """LangGraph's checkpointer has nothing for a thread the ledger saw stop on an interrupt.

    The driver's graph does not share the checkpointer that ran the thread (an
    ``InMemorySaver`` lives inside one process; a file or database another
    driver does not open). Nothing can be judged applied or superseded from
    such a checkpointer, so the answer stays ``answered``, deferred with this
    message, for a driver on the right checkpointer to apply.
    """


class LangGraphDriver:
    """Drives a compiled LangGraph graph's interrupts through tailrace's question ledger.

    It is :class:`~tailrace.gates.Resumable`, so a
    :class:`~tailrace.gates.ResumeWorker` applies answers to it exactly once,
    and a :class:`~tailrace.gates.Server` given it as a target serves its
    threads (sweep, machine gates, adoption).

    Args:
        graph: a compiled LangGraph graph with a checkpointer (``graph.compile(checkpointer=...)``).
        store: the tailrace store holding the question ledger and the run leases;
            it must be open.
        name: names the graph in the run rows (``graph_name = "langgraph:" + name``);
            default ``graph.name``. Give different graphs on one store different names.
        owner: this driver's name in leases; default a fresh unique one. Give
            each driver instance its own: two instances sharing an owner would
            share leases too.
        lease_ttl: seconds a lease lasts; it is renewed every third of that
            while a graph step runs.
        config: a base LangGraph ``RunnableConfig`` (``recursion_limit``, ...)
            merged under the per-thread ``configurable.thread_id``.
        use_async: call ``ainvoke``/``aget_state`` (True) or run ``invoke``/
            ``get_state`` in a worker thread (False); default: async unless the
            checkpointer has no async API (LangGraph's sync ``SqliteSaver``).

    One instance belongs to one event loop; threads and processes each build
    their own, on the same files.
    """

    def __init__(
        self,
        graph: Any,
        store: RunStore,
        *,
        name: str | None = None,
        owner: str | None = None,
        lease_ttl: float = 30.0,
        config: Mapping[str, Any] | None = None,
        use_async: bool | None = None,
    ) -> None:
        checkpointer = getattr(graph, "checkpointer", None)
        if checkpointer is None or isinstance(checkpointer, bool):
            raise ValueError(
                "LangGraphDriver needs a graph compiled with a checkpointer: "
                "graph.compile(checkpointer=...)"
            )
        if not lease_ttl > 0:
            raise ValueError(f"lease_ttl must be a positive number of seconds, got {lease_ttl!r}")
        self._command = lg.command_class()
        self.graph = graph
        self.store = store
        self.name = name or str(getattr(graph, "name", None) or "graph")
        self.owner = owner or f"langgraph:{self.name}:{uuid.uuid4().hex[:12]}"
        self.lease_ttl = lease_ttl
        self.use_async = lg.has_async_api(checkpointer) if use_async is None else use_async
        self._base_config = dict(config or {})
        #: The worker :meth:`answer` resumes with; its own owner, so it never shares our leases.
        self.worker = SettlingWorker(
            store=store, target=self, owner=f"{self.owner}/resume", lease_ttl=lease_ttl
        )
        self._leases = ThreadLeases(store, self.owner, lease_ttl)
        #: What graph steps did, stored as the thread's events with the next bookkeeping commit.
        self._log = StepLog()

    # -- naming -------------------------------------------------------------------

    @staticmethod
    def question_id(thread_id: str, interrupt_id: str) -> str:
        """The tailrace question id of interrupt ``interrupt_id`` in thread ``thread_id``.

        Deterministic, so re-running the bookkeeping never opens a duplicate;
        LangGraph's interrupt ids are fixed-length hex, so the pair is
        recoverable from the id.

        >>> LangGraphDriver.question_id("t1", "0123abcd")
        't1/0123abcd'
        """
        return f"{thread_id}/{interrupt_id}"

    # -- the Resumable protocol (used by ResumeWorker) ---------------------------

    async def get_state(self, key: str) -> WaitState:
        """What thread ``key`` waits on: the question ids of its pending interrupts, and its turn.

        ``key`` is the LangGraph ``thread_id``. The questions come from
        LangGraph's checkpoint, not from the ledger, so an interrupt that was
        resumed is absent even when a crash kept the ledger from saying so.
        A pending interrupt the ledger has no question for (that crash cut the
        bookkeeping of the step that raised it) is asked first: the ledger is
        brought up to LangGraph's checkpoint under the thread's lease (the
        caller's, as the sweep holds it, or one of the driver's own), so a
        sweep that supersedes the stale answer leaves the new question open.
        """
        try:
            record = await self.store.get_run(key)
        except RunNotFound:
            record = None
        if record is not None and not self._drives(record):
            # Not a thread of this driver (an engine run, another graph's thread):
            # it cannot judge what that run waits on, so it reports every
            # unapplied question of the run as waiting and never gets one
            # superseded; invoke then refuses (NotResumable: the worker's NOOP).
            unapplied = await self.store.list_questions(run_id=key)
            waiting = {q.question_id for q in unapplied if q.applied_at is None}
            return WaitState(questions=frozenset(waiting), turn=lg.turn_of(record))
        pending = lg.pending_interrupts(await self._checkpoint(key, record))
        pending_ids = frozenset(self.question_id(key, i) for i in pending)
        if record is not None and record.status not in TERMINAL_STATUSES:
            asked = {q.question_id for q in await self.store.list_questions(run_id=key)}
            if not pending_ids <= asked:
                # A crash between a graph step and its bookkeeping left LangGraph waiting on
                # interrupts the ledger never asked: ask them now, from the thread's state.
                async with self._leases.for_step(key) as lease:
                    await self._record(key, lease.token)
                record = await self.store.get_run(key)
        turn = 0 if record is None else lg.turn_of(record)
        return WaitState(questions=pending_ids, turn=turn)

    async def invoke(self, key: str, question: QuestionRow, value: Any) -> bool:
        """Resume thread ``key``: ``value`` answers ``question``, with every other answered interrupt.

        Run it under the thread's lease, as :class:`~tailrace.gates.ResumeWorker`
        does; with no live lease the driver takes one itself. It checks that
        ``question``'s interrupt is still pending (else
        :class:`~tailrace.NotResumable`, and nothing runs), marks the run
        ``running``, and resumes that interrupt together with every other
        pending interrupt the ledger has an answer for, in one
        ``Command(resume={interrupt_id: value, ...})``. It records new
        interrupts as questions (the turn advances) and marks ``question``
        and the other answers applied in the same commit; then it applies,
        step by step, answers that arrived while the graph ran, until none
        is left (a failure there is logged and left to a sweep: ``question``
        was applied). Returns True: ``question`` is marked applied already
        (see the module docstring for why that cannot double-apply). A run that
        is not a thread of this driver's graph raises
        :class:`~tailrace.NotResumable` too.
        """
        record = await self.store.get_run(key)
        if not self._drives(record):
            raise NotResumable(f"run {key!r} is not a thread of {GRAPH_NAME_PREFIX + self.name!r}")
        async with self._leases.for_step(key) as lease:
            pending = lg.pending_interrupts(await self._checkpoint(key, record))
            match = [i for i in pending if self.question_id(key, i) == question.question_id]
            if not match:
                raise NotResumable(
                    f"thread {key!r} no longer waits on question {question.question_id!r}"
                )
            batch = await self._answered(key, pending)
            batch[question.question_id] = (match[0], value)
            await self._resume_step(key, lease, batch)
            await self._apply_late_answers(key, lease)
        return True

    # -- starting, answering, taking over -----------------------------------------

    async def start(self, thread_id: str, input: Any) -> list[QuestionRow]:
        """Run thread ``thread_id`` on ``input`` until it finishes or interrupts; return its questions.

        Creates the thread's run row (kept if it exists) so leases can fence
        it, runs the graph under the thread's lease, and opens one question
        per pending interrupt, with the interrupt's value (JSON) as prompt
        (and its poller and deadline, see :func:`machine_gate`). Idempotent: a
        thread LangGraph already has a checkpoint for is not run again, only
        its bookkeeping is redone (no duplicate questions). Raises
        :class:`~tailrace.LeaseHeld` while another driver works on the thread.
        """
        with contextlib.suppress(RunExists):  # a re-run, or a thread started before
            await self.store.create_run(
                NewRun(
                    run_id=thread_id,
                    graph_name=GRAPH_NAME_PREFIX + self.name,
                    graph_ref=None,
                    fingerprint=FINGERPRINT,
                    input_json=lg.encode(input),
                    created_at=time.time(),
                )
            )
        async with self._leases.own(thread_id) as lease:
            if not lg.has_checkpoint(await self._snapshot(thread_id)):
                self._log.run_started(thread_id, GRAPH_NAME_PREFIX + self.name,
                                      structure_of(self.graph))  # fmt: skip
                await self._step_or_record_failure(thread_id, input, lease)
            questions = await self._record(thread_id, lease.token)
        await self.worker.settle(thread_id)  # answers that found the thread busy meanwhile
        return questions

    async def sync(self, thread_id: str) -> list[QuestionRow]:
        """Redo the bookkeeping of thread ``thread_id`` from LangGraph's checkpoint; return its questions.

        Opens questions for pending interrupts the ledger lacks (after a crash
        between a graph step and its bookkeeping), supersedes open questions
        whose interrupt is gone, and updates the run's status. Idempotent;
        raises :class:`~tailrace.LeaseHeld` while another driver works on the thread.
        """
        async with self._leases.own(thread_id) as lease:
            questions = await self._record(thread_id, lease.token)
        await self.worker.settle(thread_id)
        return questions

    async def adopt(self, thread_id: str) -> None:
        """Take over thread ``thread_id``, whose driver died mid-step (D6): serve calls it for orphans.

        For runs the store reports with an expired lease (``expired_leases``).
        Under the thread's lease it redoes the bookkeeping from LangGraph's
        checkpoint (questions for interrupts the dead driver never recorded,
        machine gates included), continues a graph step the crash cut off
        (LangGraph re-runs that step's nodes), and applies answers that were
        waiting. A thread stopped by a failed step is left to the sweep that
        retries its answer; one with no answer left to retry it, or that died
        before LangGraph saved anything, is marked failed with the reason.
        Raises :class:`~tailrace.NotResumable` when there is nothing to take
        over (not this driver's thread, not ``running``, just created, a
        failed step waiting for its retry), :class:`~tailrace.LeaseHeld`
        while a live driver holds it.
        """
        self._check_orphan(await self.store.get_run(thread_id))
        async with self._leases.own(thread_id) as lease:
            record = await self.store.get_run(thread_id)
            self._check_orphan(record)
            await self._take_over(record, lease)
        await self.worker.settle(thread_id)

    async def resume(self, thread_id: str) -> RunStatus:
        """Apply the answers waiting for thread ``thread_id``, as a dashboard's resume does (Q3).

        A thread whose driver died mid-step (``running``, its lease expired)
        is taken over first (:meth:`adopt`); then each answered interrupt
        nobody applied is applied through the driver's resume worker, which
        defers one it cannot apply with the reason (a failed step, a
        checkpointer without the thread: :class:`CheckpointMissing`) on the
        question, for a sweep to retry. Returns the thread's status
        afterwards. Raises :class:`~tailrace.NotResumable` for a run that is
        not a thread of this graph or that finished, and
        :class:`~tailrace.LeaseHeld` while another driver takes it over.
        """
        record = await self.store.get_run(thread_id)
        if not self._drives(record):
            raise NotResumable(
                f"run {thread_id!r} is not a thread of {GRAPH_NAME_PREFIX + self.name!r}"
            )
        if record.status in TERMINAL_STATUSES:
            raise NotResumable(f"thread {thread_id!r} is {record.status}: nothing to resume")
        orphaned = record.lease_expires is None or record.lease_expires < self.store.clock()
        if record.status is RunStatus.RUNNING and orphaned:
            await self.adopt(thread_id)  # it settles the thread's answers too
        else:
            await self.worker.settle(thread_id)
        return (await self.store.get_run(thread_id)).status

    async def answer(self, question_id: str, value: Any, by: str | None = None) -> Outcome:
        """Answer ``question_id`` with ``value`` (first answer wins, Q2), then resume its thread.

        ``by`` names who answered. Raises :class:`~tailrace.AlreadyAnswered`
        when another answer won, ``ValueError`` for a question of a run this
        driver does not drive. Returns what the resume did: ``applied``, or
        ``busy`` when another worker holds the thread: that worker applies
        this answer before it lets the thread go (Q3).
        """
        question = await self.store.get_question(question_id)
        if not self._drives(await self.store.get_run(question.run_id)):
            raise ValueError(
                f"question {question_id!r} belongs to run {question.run_id!r}, "
                f"which is not a thread of {GRAPH_NAME_PREFIX + self.name!r}"
            )
        await self.store.answer(question_id, DEFAULT_CODEC.encode(value), by=by)
        return await self.worker.resume(question_id)

    def handles(self, run: RunRecord) -> bool:
        """Whether ``run`` is a thread of this driver's graph (workers and daemons skip others)."""
        return run.graph_name == GRAPH_NAME_PREFIX + self.name

    _drives = handles

    def _check_orphan(self, record: RunRecord) -> None:
        """Raise NotResumable unless ``record`` is a thread of ours that a dead driver left running."""
        if not self._drives(record):
            raise NotResumable(
                f"run {record.run_id!r} is not a thread of {GRAPH_NAME_PREFIX + self.name!r}"
            )
        if record.status is not RunStatus.RUNNING:
            raise NotResumable(f"thread {record.run_id!r} is {record.status}: nothing to take over")
        if record.lease_owner is None and self.store.clock() - record.created_at < self.lease_ttl:
            raise NotResumable(f"thread {record.run_id!r} was just created; its starter leases it")

    async def _take_over(self, record: RunRecord, lease: Lease) -> None:
        thread_id = record.run_id
        snapshot = await self._snapshot(thread_id)
        if record.error is not None:
            if await self._answered(thread_id, lg.pending_interrupts(snapshot)):
                raise NotResumable(
                    f"thread {thread_id!r} stopped on a failed step; "
                    "the sweep retries it with its answer"
                )
            await self._fail(
                record, lease, f"its step failed, with no answer to retry it: {record.error}"
            )
        elif not lg.has_checkpoint(snapshot):
            self._check_checkpoint(record, snapshot)  # a thread that once suspended had one
            await self._fail(record, lease, "its driver died before LangGraph saved a checkpoint")
        else:
            if not lg.pending_interrupts(snapshot) and lg.stopped_mid_graph(snapshot):
                await self._step_or_record_failure(thread_id, None, lease)  # the cut-off step
            await self._record(thread_id, lease.token)

    async def _fail(self, record: RunRecord, lease: Lease, reason: str) -> None:
        logger.warning("thread %s is marked failed: %s", record.run_id, reason)
        await self._commit(record, lease.token, lg.failed_harvest(record, reason))

    # -- graph steps ----------------------------------------------------------------

    async def _resume_step(self, key: str, lease: Lease, batch: _Batch) -> None:
        """Resume the interrupts of ``batch`` in one graph step; record it, marking the answers applied."""
        await self._mark_running(key, lease.token)
        nodes = {q.question_id: q.node_id for q in await self.store.list_questions(run_id=key)}
        self._log.resumed(key, [(qid, nodes.get(qid, "")) for qid in batch])
        command = self._command(resume={iid: value for iid, value in batch.values()})
        try:
            await self._drive(key, command, lease, strict=True)
        except lg.unknown_interrupt_error() as exc:
            await self._record_after_failure(key, lease.token, None)
            raise NotResumable(
                f"thread {key!r}: LangGraph refused the resume of {sorted(batch)}: {exc}"
            ) from exc
        except Exception as exc:
            await self._record_after_failure(key, lease.token, exc)
            raise
        await self._record(key, lease.token, applied=list(batch))

    async def _apply_late_answers(self, key: str, lease: Lease) -> None:
        """Apply answers that arrived while the last step ran, until none is left (Q3)."""
        while batch := await self._answered(key, await self._pending(key)):
            try:
                await self._resume_step(key, lease, batch)
            except Exception:
                # The caller's own answer is applied; these stay answered for a sweep.
                logger.exception("thread %s: applying answers %s failed", key, sorted(batch))
                return

    async def _answered(self, key: str, pending: Mapping[str, Pending]) -> _Batch:
        """Answers in the ledger, not applied yet, for interrupts of ``key`` that are pending."""
        interrupts = {self.question_id(key, iid): iid for iid in pending}
        return {
            q.question_id: (interrupts[q.question_id], DEFAULT_CODEC.decode(q.answer_json))
            for q in await self.store.list_questions(run_id=key)
            if q.question_id in interrupts and lg.unapplied(q) and q.answer_json is not None
        }

    async def _step_or_record_failure(self, thread_id: str, graph_input: Any, lease: Lease) -> None:
        try:
            await self._drive(thread_id, graph_input, lease, strict=False)
        except Exception as exc:
            await self._record_after_failure(thread_id, lease.token, exc)
            raise

    # -- bookkeeping --------------------------------------------------------------

    async def _record(
        self,
        thread_id: str,
        token: int,
        *,
        error: str | None = None,
        applied: list[str] | None = None,
    ) -> list[QuestionRow]:
        """Make the ledger match LangGraph's checkpoint of ``thread_id``, in one commit.

        ``applied`` names answers the step just applied; they are marked in the same commit.
        """
        record = await self.store.get_run(thread_id)
        snapshot = await self._checkpoint(thread_id, record)
        pending = lg.pending_interrupts(snapshot)
        ledger = {q.question_id: q for q in await self.store.list_questions(run_id=thread_id)}
        ids = {self.question_id(thread_id, i): p for i, p in pending.items()}
        turn = lg.turn_of(record)
        fresh = [qid for qid in ids if qid not in ledger]
        if fresh:
            turn += 1  # the thread suspended on new interrupts
        now = time.time()
        rows = {
            qid: lg.question_row(qid, thread_id, ids[qid], snapshot, turn, now) for qid in fresh
        }
        stale = [
            q.question_id
            for q in ledger.values()
            if q.status is QuestionStatus.OPEN and q.question_id not in ids
        ]
        status = lg.status_of(snapshot, pending)
        events, counters = await self._events(record, list(rows.values()), status, error)
        harvest = Harvest(
            state_json=lg.state_json(turn, counters),
            status=status,
            error=error,
            events=events,
            questions=list(rows.values()),
            applied=applied or (),
            superseded=stale,
            finished_at=now if status is RunStatus.COMPLETED else None,
        )
        await self._commit(record, token, harvest)
        self._log.committed(thread_id)
        return [rows.get(qid) or ledger[qid] for qid in ids]

    async def _events(
        self, record: RunRecord, opened: list[QuestionRow], status: RunStatus, error: str | None
    ) -> tuple[list[EventRow], dict[str, Any]]:
        """The events a bookkeeping commit stores, numbered after any the store already holds."""
        state = lg.state_of(record)
        known = StepLog.stored_seq(state)
        later = await self.store.events(record.run_id, after_seq=known)  # written by others
        last = later[-1].seq if later else known
        return self._log.rows(
            record, state, opened=opened, status=status, last_seq=last, error=error
        )

    async def _record_after_failure(
        self, thread_id: str, token: int, exc: Exception | None
    ) -> None:
        """Best-effort bookkeeping after a failed graph step; never hides the step's own error."""
        error = None if exc is None else f"{type(exc).__name__}: {exc}"
        try:
            await self._record(thread_id, token, error=error)
        except Exception:
            logger.exception("thread %s: bookkeeping after a failed step failed", thread_id)

    async def _mark_running(self, thread_id: str, token: int) -> None:
        """Record that a step began (and leave ``suspended``, so the next suspension is legal)."""
        record = await self.store.get_run(thread_id)
        if record.status is RunStatus.SUSPENDED:
            await self.store.commit(thread_id, token, Harvest(state_json=record.state_json))

    async def _commit(self, record: RunRecord, token: int, harvest: Harvest) -> None:
        if record.status in TERMINAL_STATUSES:
            return  # a finished thread's row is final; LangGraph has nothing pending either
        unchanged = (
            not harvest.events
            and not harvest.questions
            and not harvest.superseded
            and not harvest.applied
            and harvest.error is None
            and harvest.status is record.status
            and harvest.state_json == record.state_json
        )
        if unchanged:
            return
        if record.status is RunStatus.SUSPENDED and harvest.status is RunStatus.SUSPENDED:
            # suspended -> suspended is not a transition; pass through running.
            await self.store.commit(record.run_id, token, Harvest(state_json=record.state_json))
        await self.store.commit(record.run_id, token, harvest)

    # -- LangGraph calls ----------------------------------------------------------

    def _config(self, thread_id: str, *, strict: bool = False) -> dict[str, Any]:
        config = dict(self._base_config)
        configurable = dict(config.get("configurable") or {})
        configurable["thread_id"] = thread_id
        strict_key = lg.strict_resume_key() if strict else None
        if strict_key is not None:
            configurable[strict_key] = True
        config["configurable"] = configurable
        return config

    async def _snapshot(self, thread_id: str) -> Any:
        config = self._config(thread_id)
        if self.use_async:
            return await self.graph.aget_state(config)
        return await asyncio.to_thread(self.graph.get_state, config)

    async def _checkpoint(self, thread_id: str, record: RunRecord | None) -> Any:
        """LangGraph's latest snapshot of ``thread_id``, checked against what the ledger recorded."""
        snapshot = await self._snapshot(thread_id)
        if record is not None:
            self._check_checkpoint(record, snapshot)
        return snapshot

    def _check_checkpoint(self, record: RunRecord, snapshot: Any) -> None:
        """Raise CheckpointMissing when ``record``'s thread suspended once but ``snapshot`` is empty."""
        if lg.turn_of(record) > 0 and not lg.has_checkpoint(snapshot):
            raise CheckpointMissing(
                f"thread {record.run_id!r} stopped on an interrupt (turn {lg.turn_of(record)}), "
                f"but the checkpointer of {GRAPH_NAME_PREFIX + self.name!r} has no checkpoint "
                "of it: this graph does not share the checkpointer that ran the thread (an "
                "InMemorySaver lives inside one process); give every driver a checkpointer "
                "on one shared database"
            )

    async def _pending(self, thread_id: str) -> dict[str, Pending]:
        return lg.pending_interrupts(await self._snapshot(thread_id))

    async def _drive(self, thread_id: str, graph_input: Any, lease: Lease, *, strict: bool) -> None:
        """Run one graph invocation of ``thread_id`` on ``graph_input`` while renewing ``lease``.

        The nodes' custom stream writes go to the thread's streams meanwhile
        (:mod:`._langgraph_streams`), committed under ``lease``.
        """
        config = self._config(thread_id, strict=strict)
        record = await self.store.get_run(thread_id)
        head = await self.store.stream_head(thread_id)
        streams = ThreadStream(self.store, record, lease.token, head, self._log)
        forwarding = writer_config(streams.write)
        if forwarding is not None:
            config["configurable"] = {**config["configurable"], **forwarding}
        # One owned task, cancelled and awaited here (a TaskGroup would wrap the
        # graph's own exception in an ExceptionGroup).
        renewal = asyncio.create_task(self._leases.keep_alive(thread_id, lease))
        try:
            if self.use_async:
                async for chunk in self.graph.astream(graph_input, config, stream_mode="tasks"):
                    self._log.task_chunk(thread_id, chunk)
                    streams.task_event(chunk)
            else:
                await asyncio.to_thread(
                    self._stream_in_thread, thread_id, graph_input, config, streams
                )
        except BaseException as exc:
            self._log.step_failed(thread_id, exc)
            raise
        finally:
            renewal.cancel()
            await asyncio.wait([renewal])
            await streams.close()  # before the step's bookkeeping, which numbers nothing of it

    def _stream_in_thread(
        self, thread_id: str, graph_input: Any, config: dict[str, Any], streams: ThreadStream
    ) -> None:
        """One graph invocation on LangGraph's sync API, its task chunks logged as they come."""
        for chunk in self.graph.stream(graph_input, config, stream_mode="tasks"):
            self._log.task_chunk(thread_id, chunk)
            streams.task_event(chunk)


@contextlib.asynccontextmanager
async def open_driver(
    source: Any, store: RunStore, *, name: str | None = None, lease_ttl: float = 30.0
) -> AsyncIterator[LangGraphDriver]:
    """A :class:`LangGraphDriver` over what a daemon was told to serve; closes what it opened.

    For ``tailrace serve`` and other daemons that load the graph by
    reference: ``source`` is a compiled graph with a checkpointer, or what
    makes one: a callable (sync or async) returning it, or a (sync or async)
    context manager yielding it, e.g. one that opens an ``AsyncSqliteSaver``.

    Args:
        source: the compiled graph, or its factory as above.
        store: the open tailrace store the driver uses.
        name: the driver's graph name (see :class:`LangGraphDriver`).
        lease_ttl: the driver's lease time in seconds.
    """
    async with contextlib.AsyncExitStack() as stack:
        graph = await lg.resolve_graph(source, stack)
        yield LangGraphDriver(graph, store, name=name, lease_ttl=lease_ttl)
