"""The resume worker: applies answers exactly once, for tailrace runs and external graphs (Q3, Q4, Q6).

It needs only a small structural protocol from what it drives
(:class:`Resumable`): ``get_state(key)`` says which question a run waits on,
``invoke(key, question, value)`` resumes it. Single flight across threads and
processes comes from the store's run lease (the same fencing that guards
durable runs); the turn guard from comparing what the target waits on with
the question; idempotence from the store's compare-and-set on ``applied``.

An answer the worker cannot apply (its graph does not load, its rows do not
decode, its resume raised before the answer took effect) is *deferred*: the
store records the reason and a retry time that doubles on every failure, the
sweep passes over it until then, and the reason is logged once, so a few
broken runs never starve the answers behind them (Q4).
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from .._codec import DEFAULT_CODEC
from .._errors import (
    AlreadyAnswered,
    CorruptRecord,
    GraphError,
    GraphMismatch,
    LeaseHeld,
    LeaseLost,
    NotResumable,
    RunNotFound,
    UnsupportedFormat,
)
from ..core import Engine
from ..stores import QuestionRow, QuestionStatus, RunRecord, RunStore

logger = logging.getLogger("tailrace.gates")

#: Why a run cannot be resumed at all, however often one tries: its graph does not
#: load or changed shape, or its stored rows cannot be read (D4).
UNRESUMABLE: tuple[type[Exception], ...] = (
    GraphError,
    GraphMismatch,
    CorruptRecord,
    UnsupportedFormat,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class WaitState:
    """What a run waits on now: the open question ids (empty when it waits on none)."""

    questions: frozenset[str]
    turn: int = 0


@runtime_checkable
class Resumable(Protocol):
    """What the worker drives: a tailrace engine, or a LangGraph graph behind a driver.

    A target may also define ``handles(run: RunRecord) -> bool``; the worker
    then routes a question only to a target that handles its run, so several
    kinds of targets share one store, and it leaves the questions of runs no
    target handles alone (not its to apply, so not deferred either). A target
    may define ``async adopt(key: str) -> None`` too: serve calls it for a run
    of the target whose owner died (its lease expired while it ran, D6).
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
    """What one resume attempt did.

    ``failed``: the run consumed the answer and then failed (a handler error,
    Q6). ``deferred``: the answer could not be applied (it stays answered and
    is retried with backoff; the store keeps the reason).
    """

    APPLIED = "applied"
    SUPERSEDED = "superseded"
    BUSY = "busy"
    NOOP = "noop"
    FAILED = "failed"
    DEFERRED = "deferred"


#: The most answers of runs driven elsewhere a resume worker remembers to skip.
MAX_SKIPPED = 10_000


class EngineTarget:
    """:class:`Resumable` over a tailrace :class:`~tailrace.Engine` with a store."""

    def __init__(self, engine: Engine) -> None:
        if engine.store is None:
            raise ValueError("EngineTarget needs an engine with a store")
        self.engine = engine

    def handles(self, run: RunRecord) -> bool:
        """Runs of tailrace graphs this engine can find again (by reference or because it ran them)."""
        return run.graph_ref is not None or self.engine.knows_graph(run.fingerprint, run.graph_name)

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
                try:
                    question = codec.decode(row.data_json).get("question")
                except (ValueError, AttributeError) as exc:
                    raise CorruptRecord(
                        f"run {key!r}: node {row.node_id!r} row does not decode: {exc}"
                    ) from exc
                if question:
                    waiting.add(str(question))
        return WaitState(questions=frozenset(waiting))

    async def invoke(self, key: str, question: QuestionRow, value: Any) -> bool:
        """Resume run ``key``: the engine applies the stored answer in its first harvest."""
        await self.engine.resume(key)
        return True

    async def adopt(self, key: str) -> None:
        """Take over run ``key``, whose owner died, by resuming it (D6).

        A run that can never be resumed (:data:`UNRESUMABLE`: its graph does
        not load or changed shape, its rows do not decode) is marked failed
        with the reason, and the error is re-raised.
        """
        try:
            await self.engine.resume(key)
        except UNRESUMABLE as exc:
            await self.engine.fail_run(key, f"cannot be resumed: {describe(exc)}")
            raise


class ResumeWorker:
    """Applies answered questions to the runs that wait on them, exactly once.

    ``store`` holds the question ledger and the leases; ``target`` is what to
    resume (default: an :class:`EngineTarget` over ``engine``) and
    ``targets`` more of them (a :class:`~tailrace.integrations.langgraph.LangGraphDriver`,
    say): a question goes to the first of ``target, *targets`` that handles
    its run. ``engine`` supplies the store, owner and lease time when given;
    ``owner`` and ``lease_ttl`` name this worker in leases otherwise. An
    answer that cannot be applied is deferred for ``retry_base`` seconds,
    doubling on each failure up to ``retry_max``.
    """

    def __init__(
        self,
        *,
        engine: Engine | None = None,
        store: RunStore | None = None,
        target: Resumable | None = None,
        targets: Sequence[Resumable] = (),
        owner: str | None = None,
        lease_ttl: float = 30.0,
        retry_base: float = 1.0,
        retry_max: float = 300.0,
    ) -> None:
        store = store or (engine.store if engine is not None else None)
        if store is None:
            raise ValueError("ResumeWorker needs a store (or an engine with one)")
        if target is None:
            if engine is None:
                raise ValueError("ResumeWorker needs a target or an engine")
            target = EngineTarget(engine)
        if not 0 < retry_base <= retry_max:
            raise ValueError(
                f"need 0 < retry_base <= retry_max, got retry_base={retry_base}, "
                f"retry_max={retry_max}"
            )
        self.store = store
        self.target = target
        self.targets: tuple[Resumable, ...] = (target, *targets)
        engine = engine or (target.engine if isinstance(target, EngineTarget) else None)
        self.owner = owner or (engine.owner if engine is not None else f"worker:{id(self):x}")
        self.lease_ttl = engine.lease_ttl if engine is not None else lease_ttl
        self.retry_base = retry_base
        self.retry_max = retry_max
        self._locks: dict[str, asyncio.Lock] = {}
        #: Answered questions of runs no target here drives: skipped from now on, and
        #: the store is asked for that many more, so they never hide the others.
        self._foreign: set[str] = set()

    def target_for(self, run: RunRecord) -> Resumable | None:
        """The first target that handles ``run`` (one without ``handles`` takes any); None if none does."""
        for target in self.targets:
            handles = getattr(target, "handles", None)
            if handles is None or handles(run):
                return target
        return None

    async def resume(self, question_id: str) -> Outcome:
        """Apply ``question_id``'s answer now if it is due: single-flight, turn-guarded (Q3).

        An answer deferred after a failure is tried at once all the same. A
        handler failure during the resume fails that run and is logged; it
        never escapes the worker (Q6).
        """
        question = await self.store.get_question(question_id)
        target = await self._route(question) if _unapplied(question) else None
        if target is None:
            return Outcome.NOOP
        return await self._resume(question, target, due_only=False)

    async def sweep(self, *, limit: int = 100) -> dict[Outcome, int]:
        """Re-drive answered-but-unapplied questions of runs this worker's targets drive (Q4); idempotent.

        Reads at most ``limit`` answers that are due (fresh ones first; a
        deferred one only once its retry time passed); questions of runs no
        target handles are skipped and not counted.
        """
        counts: dict[Outcome, int] = {}
        wanted = min(limit + len(self._foreign), MAX_SKIPPED)
        rows = await self.store.unapplied_answers(limit=wanted, now=self.store.clock())
        if len(rows) < wanted:  # all of them were read: forget those applied elsewhere
            self._foreign.intersection_update(q.question_id for q in rows)
        taken = 0
        for question in rows:
            if taken >= limit:
                break
            if question.question_id in self._foreign:
                continue
            target = await self._route(question)
            if target is None:
                if len(self._foreign) < MAX_SKIPPED:
                    self._foreign.add(question.question_id)
                continue
            taken += 1
            outcome = await self._resume(question, target, due_only=True)
            counts[outcome] = counts.get(outcome, 0) + 1
        return counts

    async def _route(self, question: QuestionRow) -> Resumable | None:
        try:
            run = await self.store.get_run(question.run_id)
        except RunNotFound:
            return None
        return self.target_for(run)

    async def _resume(self, question: QuestionRow, target: Resumable, *, due_only: bool) -> Outcome:
        if isinstance(target, EngineTarget) and target.engine.is_driving(question.run_id):
            return Outcome.BUSY  # this engine drives the run: it absorbs the answer itself (Q1)
        lock = self._locks.setdefault(question.run_id, asyncio.Lock())
        if lock.locked():
            return Outcome.BUSY
        async with lock:
            try:
                return await self._resume_leased(question, target, due_only)
            finally:
                self._locks.pop(question.run_id, None)

    async def _resume_leased(
        self, question: QuestionRow, target: Resumable, due_only: bool
    ) -> Outcome:
        try:
            token = await self.store.acquire_lease(question.run_id, self.owner, self.lease_ttl)
        except LeaseHeld:
            return Outcome.BUSY
        try:
            # Re-read under the lease: another worker may have applied or deferred it meanwhile.
            question = await self.store.get_question(question.question_id)
            if not _unapplied(question) or question.answer_json is None:
                return Outcome.NOOP
            if (
                due_only
                and question.retry_at is not None
                and question.retry_at > self.store.clock()
            ):
                return Outcome.NOOP
            return await self._apply(question, target)
        finally:
            await self.store.release_lease(question.run_id, self.owner, token)

    async def _apply(self, question: QuestionRow, target: Resumable) -> Outcome:
        assert question.answer_json is not None
        try:
            state = await target.get_state(question.run_id)
            if question.question_id not in state.questions:
                await self.store.supersede(question.question_id)
                return Outcome.SUPERSEDED
            value = DEFAULT_CODEC.decode(question.answer_json)
            marked = await target.invoke(question.run_id, question, value)
        except AlreadyAnswered:
            return Outcome.NOOP
        except (LeaseHeld, LeaseLost):
            return Outcome.BUSY
        except Exception as exc:
            return await self._not_applied(question, target, exc)
        if not marked:
            await self.store.mark_applied(question.question_id)
        return Outcome.APPLIED

    async def _not_applied(
        self, question: QuestionRow, target: Resumable, exc: Exception
    ) -> Outcome:
        """The target raised: a run that consumed the answer failed (Q6); otherwise defer it."""
        current = await self.store.get_question(question.question_id)
        if not _unapplied(current):
            if isinstance(exc, NotResumable | RunNotFound):
                return Outcome.NOOP  # someone else applied or superseded it meanwhile
            logger.warning(
                "run %s failed after applying question %s: %s",
                question.run_id, question.question_id, describe(exc), exc_info=exc,
            )  # fmt: skip
            return Outcome.FAILED
        if isinstance(exc, NotResumable) and await self._moved_on(current, target):
            await self.store.supersede(current.question_id)
            return Outcome.SUPERSEDED  # the run finished or moved on while we looked (Q3)
        return await self._defer(current, exc)

    async def _moved_on(self, question: QuestionRow, target: Resumable) -> bool:
        try:
            state = await target.get_state(question.run_id)
        except Exception:
            return False
        return question.question_id not in state.questions

    async def _defer(self, question: QuestionRow, exc: Exception) -> Outcome:
        """Record why ``question`` cannot be applied and when to try again; log it once."""
        reason = describe(exc)
        delay = min(self.retry_base * 2 ** min(question.apply_attempts, 32), self.retry_max)
        await self.store.defer_answer(
            question.question_id, error=reason, retry_at=self.store.clock() + delay
        )
        first = question.apply_attempts == 0 or question.apply_error != reason
        logger.log(
            logging.WARNING if first else logging.DEBUG,
            "question %s of run %s cannot be applied (attempt %d, next in %.3g s): %s",
            question.question_id, question.run_id, question.apply_attempts + 1, delay, reason,
        )  # fmt: skip
        return Outcome.DEFERRED


def describe(exc: BaseException) -> str:
    """``exc`` as one line for logs and stored errors: its type and message."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _unapplied(question: QuestionRow) -> bool:
    return question.status is QuestionStatus.ANSWERED or (
        question.status is QuestionStatus.EXPIRED and question.applied_at is None
    )
