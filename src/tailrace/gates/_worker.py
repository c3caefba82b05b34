"""The resume worker: applies answers exactly once, for tailrace runs and external graphs (Q3, Q4, Q6).

It needs only a small structural protocol from what it drives
(:class:`Resumable`): ``get_state(key)`` says which question a run waits on,
``invoke(key, question, value)`` resumes it. Single flight across threads and
processes comes from the store's run lease (the same fencing that guards
durable runs); the turn guard from comparing what the target waits on with
the question; idempotence from the store's compare-and-set on ``applied``.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from .._codec import DEFAULT_CODEC
from .._errors import AlreadyAnswered, LeaseHeld, NotResumable, RunNotFound

if TYPE_CHECKING:
    from .._engine import Engine
    from ..stores import QuestionRow, RunRecord, RunStore

logger = logging.getLogger("tailrace.gates")


@dataclass(frozen=True, slots=True, kw_only=True)
class WaitState:
    """What a run waits on now: the open question ids (empty when it waits on none)."""

    questions: frozenset[str]
    turn: int = 0


@runtime_checkable
class Resumable(Protocol):
    """What the worker drives: a tailrace engine, or a LangGraph graph behind a driver.

    A target may also define ``handles(run: RunRecord) -> bool``; the worker
    then leaves questions of runs it does not handle alone, so several kinds
    of targets can share one store.
    """

    async def get_state(self, key: str) -> WaitState:
        """What run ``key`` waits on now."""
        ...

    async def invoke(self, key: str, question: QuestionRow, value: Any) -> bool:
        """Resume run ``key`` with ``value`` answering ``question``.

        Return True when this call made the application durable together with
        marking ``question`` applied (tailrace runs do, in one transaction);
        False to let the worker mark it applied afterwards.
        """
        ...


class Outcome(enum.StrEnum):
    """What one resume attempt did."""

    APPLIED = "applied"
    SUPERSEDED = "superseded"
    BUSY = "busy"
    NOOP = "noop"
    FAILED = "failed"


class EngineTarget:
    """:class:`Resumable` over a tailrace :class:`~tailrace.Engine` with a store."""

    def __init__(self, engine: Engine) -> None:
        if engine.store is None:
            raise ValueError("EngineTarget needs an engine with a store")
        self.engine = engine

    def handles(self, run: RunRecord) -> bool:
        """Runs of tailrace graphs this engine can find again (by reference or because it ran them)."""
        return run.graph_ref is not None or self.engine.knows_graph(run.fingerprint)

    async def get_state(self, key: str) -> WaitState:
        """Gates of run ``key`` that wait on a question (from the stored node rows)."""
        assert self.engine.store is not None
        stored = await self.engine.store.load_run(key)
        if stored.run.status.value in ("completed", "failed", "cancelled"):
            return WaitState(questions=frozenset())  # Q3: nothing waits on a finished run
        codec = self.engine.codec or DEFAULT_CODEC
        waiting = set()
        for row in stored.nodes.values():
            if row.status == "waiting":
                question = codec.decode(row.data_json).get("question")
                if question:
                    waiting.add(str(question))
        return WaitState(questions=frozenset(waiting))

    async def invoke(self, key: str, question: QuestionRow, value: Any) -> bool:
        """Resume run ``key``: the engine applies the stored answer in its first harvest."""
        await self.engine.resume(key)
        return True


class ResumeWorker:
    """Applies answered questions to the runs that wait on them, exactly once.

    ``store`` holds the question ledger and the leases; ``target`` is what to
    resume (default: an :class:`EngineTarget` over ``engine``); ``engine``
    supplies the store, owner and lease time when given; ``owner`` and
    ``lease_ttl`` name this worker in leases otherwise.
    """

    def __init__(
        self,
        *,
        engine: Engine | None = None,
        store: RunStore | None = None,
        target: Resumable | None = None,
        owner: str | None = None,
        lease_ttl: float = 30.0,
    ) -> None:
        store = store or (engine.store if engine is not None else None)
        if store is None:
            raise ValueError("ResumeWorker needs a store (or an engine with one)")
        if target is None:
            if engine is None:
                raise ValueError("ResumeWorker needs a target or an engine")
            target = EngineTarget(engine)
        self.store = store
        self.target = target
        engine = engine or (target.engine if isinstance(target, EngineTarget) else None)
        self.owner = owner or (engine.owner if engine is not None else f"worker:{id(self):x}")
        self.lease_ttl = engine.lease_ttl if engine is not None else lease_ttl
        self._locks: dict[str, asyncio.Lock] = {}

    async def resume(self, question_id: str) -> Outcome:
        """Apply ``question_id``'s answer if it is due: single-flight, turn-guarded (Q3).

        A handler failure during the resume fails that run and is logged; it
        never escapes the worker (Q6).
        """
        question = await self.store.get_question(question_id)
        if not _unapplied(question) or not await self._handles(question):
            return Outcome.NOOP
        target = self.target
        if isinstance(target, EngineTarget) and target.engine.is_driving(question.run_id):
            return Outcome.BUSY  # this engine drives the run: it absorbs the answer itself (Q1)
        lock = self._locks.setdefault(question.run_id, asyncio.Lock())
        if lock.locked():
            return Outcome.BUSY
        async with lock:
            try:
                return await self._resume_leased(question)
            finally:
                self._locks.pop(question.run_id, None)

    async def _resume_leased(self, question: QuestionRow) -> Outcome:
        try:
            token = await self.store.acquire_lease(question.run_id, self.owner, self.lease_ttl)
        except LeaseHeld:
            return Outcome.BUSY
        try:
            question = await self.store.get_question(question.question_id)
            if not _unapplied(question) or question.answer_json is None:
                return Outcome.NOOP
            state = await self.target.get_state(question.run_id)
            if question.question_id not in state.questions:
                await self.store.supersede(question.question_id)
                return Outcome.SUPERSEDED
            value = DEFAULT_CODEC.decode(question.answer_json)
            try:
                marked = await self.target.invoke(question.run_id, question, value)
            except (AlreadyAnswered, NotResumable, RunNotFound):
                return Outcome.NOOP
            except LeaseHeld:
                return Outcome.BUSY
            except Exception:
                logger.exception(
                    "resuming run %s for question %s failed", question.run_id, question.question_id
                )
                return Outcome.FAILED
            if not marked:
                await self.store.mark_applied(question.question_id)
            return Outcome.APPLIED
        finally:
            await self.store.release_lease(question.run_id, self.owner, token)

    async def _handles(self, question: QuestionRow) -> bool:
        handles = getattr(self.target, "handles", None)
        if handles is None:
            return True
        try:
            run = await self.store.get_run(question.run_id)
        except RunNotFound:
            return False
        return bool(handles(run))

    async def sweep(self, *, limit: int = 100) -> dict[Outcome, int]:
        """Re-drive answered-but-unapplied questions of runs this worker's target drives (Q4); idempotent."""
        counts: dict[Outcome, int] = {}
        for question in await self.store.unapplied_answers(limit=limit):
            if not await self._handles(question):
                continue
            outcome = await self.resume(question.question_id)
            counts[outcome] = counts.get(outcome, 0) + 1
        return counts


def _unapplied(question: QuestionRow) -> bool:
    from ..stores import QuestionStatus

    return question.status is QuestionStatus.ANSWERED or (
        question.status is QuestionStatus.EXPIRED and question.applied_at is None
    )
