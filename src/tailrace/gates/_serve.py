"""The serve loop: resume answered runs, poll machine gates, adopt orphaned runs (Q4-Q6).

Shaped like huey's consumer: each iteration does what work there is; the
wait between iterations doubles while idle and resets when work arrives;
an iteration's error is logged and survived; ``stop`` ends it gracefully.
Several serve loops on one database cooperate: leases make resumes
single-flight and the ledger's compare-and-set makes answers first-wins.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .._codec import DEFAULT_CODEC
from .._errors import AlreadyAnswered, LeaseHeld, NotResumable, RunNotFound
from ._timeout import GateTimeout
from ._worker import Outcome, ResumeWorker

if TYPE_CHECKING:
    from .._engine import Engine
    from ..stores import QuestionRow

logger = logging.getLogger("tailrace.serve")

#: A machine gate's poller: given the question's prompt, return its answer, or None while pending.
Poller = Callable[[Any], Any]
Hook = Callable[[], Awaitable[None] | None]


@dataclass(slots=True)
class ServeStats:
    """What a serve loop did so far."""

    iterations: int = 0
    applied: int = 0
    superseded: int = 0
    polled: int = 0
    expired: int = 0
    adopted: int = 0
    errors: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)


class Server:
    """One serve loop over ``engine`` (which must have a store).

    ``pollers`` maps the names machine gates declare (``poller=``) to
    callables; ``interval`` is the first wait when idle, doubling up to
    ``max_interval``; ``on_startup``/``on_shutdown`` run around the loop.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        pollers: Mapping[str, Poller] | None = None,
        interval: float = 0.05,
        max_interval: float = 2.0,
        on_startup: Hook | None = None,
        on_shutdown: Hook | None = None,
    ) -> None:
        if engine.store is None:
            raise ValueError("serve needs an engine with a store")
        self.engine = engine
        self.store = engine.store
        self.pollers = dict(pollers or {})
        self.interval = interval
        self.max_interval = max_interval
        self.on_startup = on_startup
        self.on_shutdown = on_shutdown
        self.worker = ResumeWorker(engine=engine)
        self.stats = ServeStats()
        self._missing: set[str] = set()

    async def run(self, stop: asyncio.Event) -> ServeStats:
        """Serve until ``stop`` is set; returns the stats."""
        await _call_hook(self.on_startup)
        wait = self.interval
        try:
            while not stop.is_set():
                try:
                    work = await self.once()
                except Exception:
                    self.stats.errors += 1
                    logger.exception("serve iteration failed; going on")
                    work = 0
                wait = self.interval if work else min(wait * 2, self.max_interval)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), wait)
        finally:
            await _call_hook(self.on_shutdown)
        return self.stats

    async def once(self) -> int:
        """One iteration: re-drive answers, poll machine gates, adopt orphans; returns work done."""
        self.stats.iterations += 1
        work = self._count(await self.worker.sweep())
        work += await self._poll_gates()
        work += await self._adopt_orphans()
        return work

    def _count(self, outcomes: Mapping[Outcome, int]) -> int:
        for outcome, n in outcomes.items():
            self.stats.outcomes[outcome.value] = self.stats.outcomes.get(outcome.value, 0) + n
        self.stats.applied += outcomes.get(Outcome.APPLIED, 0)
        self.stats.superseded += outcomes.get(Outcome.SUPERSEDED, 0)
        return outcomes.get(Outcome.APPLIED, 0) + outcomes.get(Outcome.SUPERSEDED, 0)

    async def _poll_gates(self) -> int:
        from ..stores import QuestionStatus

        work = 0
        for question in await self.store.list_questions(status=QuestionStatus.OPEN):
            try:
                work += await self._poll_one(question)
            except Exception:
                self.stats.errors += 1
                logger.exception("polling question %s failed", question.question_id)
        return work

    async def _poll_one(self, question: QuestionRow) -> int:
        from ..stores import QuestionStatus

        codec = self.engine.codec or DEFAULT_CODEC
        if question.deadline is not None and time.time() >= question.deadline:
            value = GateTimeout(question_id=question.question_id, deadline=question.deadline)
            by, status = "deadline", QuestionStatus.EXPIRED
            self.stats.expired += 1
        elif question.poller is not None:
            poller = self.pollers.get(question.poller)
            if poller is None:
                if question.poller not in self._missing:
                    self._missing.add(question.poller)
                    logger.warning("no poller named %r is registered", question.poller)
                return 0
            self.stats.polled += 1
            value = await _call_poller(poller, codec.decode(question.prompt_json))
            if value is None:
                return 0
            by, status = f"poller:{question.poller}", QuestionStatus.ANSWERED
        else:
            return 0
        try:
            await self.store.answer(question.question_id, codec.encode(value), by=by, status=status)
        except AlreadyAnswered:
            return 0  # another serve (or a person) was first
        self._count({await self.worker.resume(question.question_id): 1})
        return 1

    async def _adopt_orphans(self) -> int:
        """Resume runs whose owner's lease expired (it crashed) (D6)."""
        now = time.time()
        adopted = 0
        for run_id in await self.store.expired_leases(now):
            record = await self.store.get_run(run_id)
            if record.graph_ref is None:
                continue  # nothing to import it by (an external graph's thread, a __main__ graph)
            if record.lease_owner is None and now - record.created_at < self.engine.lease_ttl:
                continue  # just created; its engine is about to lease it
            try:
                await self.engine.resume(run_id)
            except (LeaseHeld, NotResumable, RunNotFound):
                continue
            except Exception:
                self.stats.errors += 1
                logger.exception("adopting run %s failed; it is marked failed", run_id)
                continue
            adopted += 1
            self.stats.adopted += 1
        return adopted


async def serve(
    engine: Engine,
    stop: asyncio.Event,
    *,
    pollers: Mapping[str, Poller] | None = None,
    interval: float = 0.05,
    max_interval: float = 2.0,
) -> ServeStats:
    """Run a :class:`Server` over ``engine`` until ``stop`` is set.

    ``pollers``, ``interval`` and ``max_interval`` are as in :class:`Server`.
    """
    server = Server(engine, pollers=pollers, interval=interval, max_interval=max_interval)
    return await server.run(stop)


async def _call_poller(poller: Poller, prompt: Any) -> Any:
    if inspect.iscoroutinefunction(poller):
        return await poller(prompt)
    result = await asyncio.to_thread(poller, prompt)
    if inspect.isawaitable(result):
        return await result
    return result


async def _call_hook(hook: Hook | None) -> None:
    if hook is None:
        return
    result = hook()
    if inspect.isawaitable(result):
        await result
