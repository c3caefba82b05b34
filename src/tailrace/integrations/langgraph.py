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

Why a resume never applies twice, although LangGraph's checkpoint and
tailrace's ledger cannot be written in one transaction:

- *Single flight.* Every resume runs under the thread's run lease: the worker
  takes it before :meth:`LangGraphDriver.invoke`, which keeps it alive while
  the graph runs, so no second driver (thread, process) resumes the thread
  at the same time (D6).
- *Turn guard on LangGraph's own record.* A question id names exactly one
  interrupt (:meth:`LangGraphDriver.question_id`). Once the step a resume
  ran is committed to the thread's checkpoint, LangGraph no longer reports
  that interrupt as pending, whatever the ledger says. The worker and
  ``invoke`` both check "still pending" under the lease before resuming;
  when LangGraph offers strict resumes, it checks again itself and refuses,
  before writing anything, a resume naming a consumed interrupt.
- *The crash window.* ``invoke`` returns False and the worker marks the
  question applied afterwards. A crash in between leaves it ``answered``;
  the restart sweep (Q4) re-drives it, finds the interrupt no longer pending
  and marks it ``superseded``: the answer was applied once, and the ledger
  does not claim it twice.
- *A failed step* (the node raised after ``interrupt`` returned, Q6) commits
  nothing in LangGraph: the worker reports ``failed``, the question stays
  ``answered``, the run row records the error, and a later sweep retries the
  step, which LangGraph re-runs with the answer it recorded the first time.
  Code inside a node may run again on such a retry (LangGraph's own
  at-least-once node semantics); a committed step never does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from .._codec import DEFAULT_CODEC
from .._errors import LeaseHeld, LeaseLost, NotResumable, RunExists, RunNotFound
from ..gates import Outcome, ResumeWorker, WaitState
from ..stores import (
    TERMINAL_STATUSES,
    Harvest,
    NewRun,
    QuestionRow,
    QuestionStatus,
    RunRecord,
    RunStatus,
    RunStore,
)

logger = logging.getLogger("tailrace.integrations.langgraph")

__all__ = ["LangGraphDriver"]

#: ``graph_name`` of the run rows this driver creates is this prefix plus its name.
GRAPH_NAME_PREFIX = "langgraph:"
#: ``fingerprint`` of those rows: LangGraph, not tailrace, knows the graph's shape.
FINGERPRINT = "langgraph"


@dataclass(frozen=True, slots=True)
class _Pending:
    """One interrupt the thread waits on, as LangGraph reports it."""

    interrupt_id: str
    node: str
    value: Any


@dataclass(frozen=True, slots=True)
class _Lease:
    """The run lease a graph step runs under; ``own`` when this driver took it (and releases it)."""

    owner: str
    token: int
    own: bool


class LangGraphDriver:
    """Drives a compiled LangGraph graph's interrupts through tailrace's question ledger.

    It is :class:`~tailrace.gates.Resumable`, so a
    :class:`~tailrace.gates.ResumeWorker` applies answers to it exactly once.

    Args:
        graph: a compiled LangGraph graph with a checkpointer (``graph.compile(checkpointer=...)``).
        store: the tailrace store holding the question ledger and the run leases;
            it must be open.
        name: names the graph in the run rows (``graph_name = "langgraph:" + name``);
            default ``graph.name``.
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
        self._command = _command_class()
        self.graph = graph
        self.store = store
        self.name = name or str(getattr(graph, "name", None) or "graph")
        self.owner = owner or f"langgraph:{self.name}:{uuid.uuid4().hex[:12]}"
        self.lease_ttl = lease_ttl
        self.use_async = _has_async_api(checkpointer) if use_async is None else use_async
        self._base_config = dict(config or {})
        #: The worker :meth:`answer` resumes with; its own owner, so it never shares our leases.
        self.worker = ResumeWorker(
            store=store, target=self, owner=f"{self.owner}/resume", lease_ttl=lease_ttl
        )
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()

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
            return WaitState(questions=frozenset(waiting), turn=_turn_of(record))
        pending = _pending_interrupts(await self._snapshot(key))
        turn = 0 if record is None else _turn_of(record)
        return WaitState(questions=frozenset(self.question_id(key, i) for i in pending), turn=turn)

    async def invoke(self, key: str, question: QuestionRow, value: Any) -> bool:
        """Resume thread ``key`` with ``Command(resume=...)``: ``value`` answers ``question``.

        Run it under the thread's lease, as :class:`~tailrace.gates.ResumeWorker`
        does; with no live lease the driver takes one itself. It checks that
        ``question``'s interrupt is still pending (else
        :class:`~tailrace.NotResumable`, and nothing runs), marks the run
        ``running``, resumes exactly that interrupt, then records any new
        interrupts as questions (the turn advances). Returns False: the
        caller marks ``question`` applied (see the module docstring for why
        that cannot double-apply). A run that is not a thread of this
        driver's graph raises :class:`~tailrace.NotResumable` too.
        """
        if not self._drives(await self.store.get_run(key)):
            raise NotResumable(f"run {key!r} is not a thread of {GRAPH_NAME_PREFIX + self.name!r}")
        async with self._thread_lock(key), self._lease_for(key) as lease:
            pending = _pending_interrupts(await self._snapshot(key))
            match = [i for i in pending if self.question_id(key, i) == question.question_id]
            if not match:
                raise NotResumable(
                    f"thread {key!r} no longer waits on question {question.question_id!r}"
                )
            await self._mark_running(key, lease.token)
            command = self._command(resume={match[0]: value})
            try:
                await self._drive(key, command, lease, strict=True)
            except _unknown_interrupt_error() as exc:
                await self._record_after_failure(key, lease.token, None)
                raise NotResumable(
                    f"thread {key!r}: LangGraph refused the resume of "
                    f"{question.question_id!r}: {exc}"
                ) from exc
            except Exception as exc:
                await self._record_after_failure(key, lease.token, exc)
                raise
            await self._record(key, lease.token)
        return False

    # -- starting and answering -------------------------------------------------

    async def start(self, thread_id: str, input: Any) -> list[QuestionRow]:
        """Run thread ``thread_id`` on ``input`` until it finishes or interrupts; return its questions.

        Creates the thread's run row (kept if it exists) so leases can fence
        it, runs the graph under the thread's lease, and opens one question
        per pending interrupt, with the interrupt's value (JSON) as prompt.
        Idempotent: a thread LangGraph already has a checkpoint for is not run
        again, only its bookkeeping is redone (no duplicate questions). Raises
        :class:`~tailrace.LeaseHeld` while another driver works on the thread.
        """
        with contextlib.suppress(RunExists):  # a re-run, or a thread started before
            await self.store.create_run(
                NewRun(
                    run_id=thread_id,
                    graph_name=GRAPH_NAME_PREFIX + self.name,
                    graph_ref=None,
                    fingerprint=FINGERPRINT,
                    input_json=_encode(input),
                    created_at=time.time(),
                )
            )
        async with self._thread_lock(thread_id), self._own_lease(thread_id) as lease:
            if not _has_checkpoint(await self._snapshot(thread_id)):
                try:
                    await self._drive(thread_id, input, lease, strict=False)
                except Exception as exc:
                    await self._record_after_failure(thread_id, lease.token, exc)
                    raise
            return await self._record(thread_id, lease.token)

    async def sync(self, thread_id: str) -> list[QuestionRow]:
        """Redo the bookkeeping of thread ``thread_id`` from LangGraph's checkpoint; return its questions.

        Opens questions for pending interrupts the ledger lacks (after a crash
        between a graph step and its bookkeeping), supersedes open questions
        whose interrupt is gone, and updates the run's status. Idempotent;
        raises :class:`~tailrace.LeaseHeld` while another driver works on the thread.
        """
        async with self._thread_lock(thread_id), self._own_lease(thread_id) as lease:
            return await self._record(thread_id, lease.token)

    async def answer(self, question_id: str, value: Any, by: str | None = None) -> Outcome:
        """Answer ``question_id`` with ``value`` (first answer wins, Q2), then resume its thread.

        ``by`` names who answered. Raises :class:`~tailrace.AlreadyAnswered`
        when another answer won, ``ValueError`` for a question of a run this
        driver does not drive. Returns what the resume did: ``applied``, or
        ``busy`` when another worker holds the thread and applies it (Q3).
        """
        question = await self.store.get_question(question_id)
        if not self._drives(await self.store.get_run(question.run_id)):
            raise ValueError(
                f"question {question_id!r} belongs to run {question.run_id!r}, "
                f"which is not a thread of {GRAPH_NAME_PREFIX + self.name!r}"
            )
        await self.store.answer(question_id, DEFAULT_CODEC.encode(value), by=by)
        return await self.worker.resume(question_id)

    # -- bookkeeping --------------------------------------------------------------

    def handles(self, run: RunRecord) -> bool:
        """Whether ``run`` is a thread of this driver's graph (the worker skips others)."""
        return run.graph_name == GRAPH_NAME_PREFIX + self.name

    _drives = handles

    async def _record(
        self, thread_id: str, token: int, *, error: str | None = None
    ) -> list[QuestionRow]:
        """Make the ledger match LangGraph's checkpoint of ``thread_id``, in one commit."""
        snapshot = await self._snapshot(thread_id)
        pending = _pending_interrupts(snapshot)
        record = await self.store.get_run(thread_id)
        ledger = {q.question_id: q for q in await self.store.list_questions(run_id=thread_id)}
        ids = {self.question_id(thread_id, i): p for i, p in pending.items()}
        turn = _turn_of(record)
        fresh = [qid for qid in ids if qid not in ledger]
        if fresh:
            turn += 1  # the thread suspended on new interrupts
        now = time.time()
        rows = {
            qid: QuestionRow(
                question_id=qid,
                run_id=thread_id,
                node_id=ids[qid].node,
                visit=_step_of(snapshot),
                turn=turn,
                prompt_json=_encode(ids[qid].value),
                created_at=now,
            )
            for qid in fresh
        }
        stale = [
            q.question_id
            for q in ledger.values()
            if q.status is QuestionStatus.OPEN and q.question_id not in ids
        ]
        status = _status_of(snapshot, pending)
        harvest = Harvest(
            state_json=DEFAULT_CODEC.encode({"driver": "langgraph", "turn": turn}),
            status=status,
            error=error,
            questions=list(rows.values()),
            superseded=stale,
            finished_at=now if status is RunStatus.COMPLETED else None,
        )
        await self._commit(record, token, harvest)
        return [rows.get(qid) or ledger[qid] for qid in ids]

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
        """Record that a resume began (and leave ``suspended``, so the next suspension is legal)."""
        record = await self.store.get_run(thread_id)
        if record.status is RunStatus.SUSPENDED:
            state = DEFAULT_CODEC.encode({"driver": "langgraph", "turn": _turn_of(record)})
            await self.store.commit(thread_id, token, Harvest(state_json=state))

    async def _commit(self, record: RunRecord, token: int, harvest: Harvest) -> None:
        if record.status in TERMINAL_STATUSES:
            return  # a finished thread's row is final; LangGraph has nothing pending either
        unchanged = (
            not harvest.questions
            and not harvest.superseded
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

    # -- leases -------------------------------------------------------------------

    def _thread_lock(self, thread_id: str) -> asyncio.Lock:
        """This driver's lock for ``thread_id``: its own coroutines never share a lease."""
        lock = self._locks.get(thread_id)
        if lock is None:
            lock = self._locks[thread_id] = asyncio.Lock()
        return lock

    @contextlib.asynccontextmanager
    async def _own_lease(self, thread_id: str) -> AsyncIterator[_Lease]:
        token = await self.store.acquire_lease(thread_id, self.owner, self.lease_ttl)
        try:
            yield _Lease(self.owner, token, own=True)
        finally:
            await self.store.release_lease(thread_id, self.owner, token)

    @contextlib.asynccontextmanager
    async def _lease_for(self, thread_id: str) -> AsyncIterator[_Lease]:
        """The caller's live lease on ``thread_id`` (a worker's), else one of our own."""
        lease = await self._take_or_adopt(thread_id)
        try:
            yield lease
        finally:
            if lease.own:
                await self.store.release_lease(thread_id, lease.owner, lease.token)

    async def _take_or_adopt(self, thread_id: str) -> _Lease:
        for _ in range(3):
            try:
                token = await self.store.acquire_lease(thread_id, self.owner, self.lease_ttl)
                return _Lease(self.owner, token, own=True)
            except LeaseHeld:
                record = await self.store.get_run(thread_id)
            if record.lease_owner is not None:
                # invoke runs under its caller's lease: write with that token, so a
                # takeover of the caller's lease fences our writes too (D6).
                return _Lease(record.lease_owner, record.lease_token, own=False)
            # released meanwhile: try to take it
        raise LeaseHeld(f"thread {thread_id!r}: its lease keeps changing hands")

    async def _keep_alive(self, thread_id: str, lease: _Lease) -> None:
        """Renew ``lease`` while a graph step runs, so nobody takes the thread over mid-step."""
        while True:
            await asyncio.sleep(self.lease_ttl / 3)
            try:
                await self.store.heartbeat(thread_id, lease.owner, lease.token, self.lease_ttl)
            except LeaseLost:
                logger.warning("thread %s: lease lost while its graph step ran", thread_id)
                return
            except Exception:  # a store hiccup: the next renewal may succeed
                logger.exception("thread %s: renewing the lease failed", thread_id)

    # -- LangGraph calls ----------------------------------------------------------

    def _config(self, thread_id: str, *, strict: bool = False) -> dict[str, Any]:
        config = dict(self._base_config)
        configurable = dict(config.get("configurable") or {})
        configurable["thread_id"] = thread_id
        strict_key = _strict_resume_key() if strict else None
        if strict_key is not None:
            configurable[strict_key] = True
        config["configurable"] = configurable
        return config

    async def _snapshot(self, thread_id: str) -> Any:
        config = self._config(thread_id)
        if self.use_async:
            return await self.graph.aget_state(config)
        return await asyncio.to_thread(self.graph.get_state, config)

    async def _drive(
        self, thread_id: str, graph_input: Any, lease: _Lease, *, strict: bool
    ) -> None:
        """Run one graph invocation of ``thread_id`` on ``graph_input`` while renewing ``lease``."""
        config = self._config(thread_id, strict=strict)
        # One owned task, cancelled and awaited here (a TaskGroup would wrap the
        # graph's own exception in an ExceptionGroup).
        renewal = asyncio.create_task(self._keep_alive(thread_id, lease))
        try:
            if self.use_async:
                await self.graph.ainvoke(graph_input, config)
            else:
                await asyncio.to_thread(self.graph.invoke, graph_input, config)
        finally:
            renewal.cancel()
            await asyncio.wait([renewal])


# --- helpers over LangGraph's objects ------------------------------------------


def _command_class() -> Any:
    try:
        from langgraph.types import Command
    except ImportError as exc:  # pragma: no cover - exercised without the extra
        raise ImportError(
            "LangGraphDriver needs LangGraph: pip install 'tailrace[langgraph]'"
        ) from exc
    return Command


def _strict_resume_key() -> str | None:
    """LangGraph's config key for strict resumes (refuse a consumed interrupt), if it has one."""
    try:
        from langgraph._internal._constants import CONFIG_KEY_STRICT_RESUME
    except ImportError:
        return None
    return str(CONFIG_KEY_STRICT_RESUME)


def _unknown_interrupt_error() -> type[Exception]:
    try:
        from langgraph.errors import UnknownInterruptError
    except ImportError:
        return _NeverRaised
    return UnknownInterruptError


class _NeverRaised(Exception):
    """Stands in for an error class this LangGraph version lacks."""


def _has_async_api(checkpointer: Any) -> bool:
    """Whether ``checkpointer`` implements LangGraph's async checkpoint API."""
    try:
        from langgraph.checkpoint.sqlite import SqliteSaver
    except ImportError:
        pass
    else:
        if isinstance(checkpointer, SqliteSaver):
            return False  # it defines the async methods only to raise NotImplementedError
    from langgraph.checkpoint.base import BaseCheckpointSaver

    return type(checkpointer).aget_tuple is not BaseCheckpointSaver.aget_tuple


def _pending_interrupts(snapshot: Any) -> dict[str, _Pending]:
    """Interrupts still waiting for an answer in ``snapshot`` (the latest state), by id, in order."""
    nodes: dict[str, str] = {}
    everything: list[Any] = []
    for task in getattr(snapshot, "tasks", ()) or ():
        for interrupt in getattr(task, "interrupts", ()) or ():
            nodes.setdefault(str(interrupt.id), str(task.name))
            everything.append(interrupt)
    waiting = getattr(snapshot, "interrupts", None)
    pending: dict[str, _Pending] = {}
    for interrupt in everything if waiting is None else waiting:
        iid = str(interrupt.id)
        if iid not in pending:
            pending[iid] = _Pending(iid, nodes.get(iid, ""), interrupt.value)
    return pending


def _has_checkpoint(snapshot: Any) -> bool:
    return getattr(snapshot, "created_at", None) is not None or bool(
        getattr(snapshot, "metadata", None)
    )


def _step_of(snapshot: Any) -> int:
    metadata = getattr(snapshot, "metadata", None) or {}
    step = metadata.get("step", 0) if isinstance(metadata, Mapping) else 0
    return int(step) if isinstance(step, int) else 0


def _status_of(snapshot: Any, pending: Mapping[str, _Pending]) -> RunStatus:
    if pending:
        return RunStatus.SUSPENDED
    if getattr(snapshot, "next", ()):
        return RunStatus.RUNNING  # stopped mid-graph (a failed step): not finished
    return RunStatus.COMPLETED


def _encode(value: Any) -> str:
    """``value`` as JSON; what JSON cannot carry (LangChain messages, ...) as its ``repr``."""
    try:
        return DEFAULT_CODEC.encode(value)
    except (TypeError, ValueError):
        return DEFAULT_CODEC.encode(repr(value))


def _turn_of(record: RunRecord) -> int:
    try:
        state = DEFAULT_CODEC.decode(record.state_json)
    except ValueError:
        return 0
    turn = state.get("turn", 0) if isinstance(state, dict) else 0
    return turn if isinstance(turn, int) else 0
