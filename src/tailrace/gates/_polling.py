"""Machine gates for the serve loop: deadlines and pollers (Q5).

One slow or stuck poller must never hold up anything else, so:

- deadlines are checked on every tick, before and apart from any poller: a
  question whose deadline passed is answered with a :class:`GateTimeout` on
  that tick whatever its poller does;
- each poll runs as a task of its own under a time limit (``timeout``),
  concurrently with other polls and with the rest of the serve loop;
- a synchronous poller runs in a daemon thread of our own
  (:class:`DaemonThreads`), never in the loop's default executor: one stuck
  past its limit is abandoned, and neither ``asyncio.run`` nor the
  interpreter waits for it at exit;
- a question is not polled again while its previous poll still runs
  (an abandoned thread included).

A poller's answer is only recorded here (first answer wins, Q2); ``wake``
tells the serve loop, whose sweep applies it through the resume worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from .._codec import Codec
from .._errors import AlreadyAnswered, QuestionNotFound
from .._values import GateTimeout
from ..stores import QuestionRow, QuestionStatus, RunStore
from ._daemon import ErrorCount, Loop
from ._worker import describe

logger = logging.getLogger("tailrace.serve")

#: A machine gate's poller: given the question's prompt, return its answer, or None while pending.
Poller = Callable[[Any], Any]


class PollCounts(ErrorCount, Protocol):
    """Where gate polling counts its polls, their timeouts and failures, and the deadlines it fired."""

    polled: int
    poll_timeouts: int
    expired: int


class DaemonThreads:
    """Runs blocking callables each in a daemon thread, at most ``limit`` alive at once.

    Threads that outlive the caller's interest (abandoned after a timeout)
    still count against ``limit`` until they return, so stuck callables
    cannot pile up threads without bound.
    """

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"need at least one poll thread, got {limit}")
        self.limit = limit
        self._alive = 0
        self._lock = threading.Lock()

    @property
    def full(self) -> bool:
        """Whether ``limit`` threads are alive (a new call must wait for one to return)."""
        with self._lock:
            return self._alive >= self.limit

    def submit(self, fn: Callable[[Any], Any], arg: Any, *, name: str) -> asyncio.Future[Any]:
        """Call ``fn(arg)`` in a new daemon thread called ``name``; a future of the running loop settles with it."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()

        def settle(ok: bool, value: Any) -> None:
            if future.done():
                return  # abandoned: nobody waits for it any more
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)

        def work() -> None:
            try:
                ok, value = True, fn(arg)
            except Exception as exc:
                ok, value = False, exc
            except BaseException as exc:  # never let a thread's SystemExit reach the loop as such
                ok, value = False, RuntimeError(f"poller raised {exc!r}")
            finally:
                with self._lock:
                    self._alive -= 1
            # RuntimeError: the loop is closed; the daemon stopped while this call ran.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(settle, ok, value)

        with self._lock:
            self._alive += 1
        try:
            threading.Thread(target=work, name=name, daemon=True).start()
        except BaseException:
            with self._lock:
                self._alive -= 1
            raise
        return future


class PollTimeout(Exception):
    """A poll ran past its time limit (internal: counted and logged, never raised to users)."""


class GatePolling:
    """Deadlines and pollers of open questions in ``store``, ticked by the serve loop.

    ``pollers`` maps poller names to callables; ``codec`` decodes prompts and
    encodes answers; ``timeout`` limits each poll (seconds); ``threads``
    bounds the threads of synchronous pollers; ``stats`` is updated; ``wake``
    is called when a poller answered a question.
    """

    def __init__(
        self,
        store: RunStore,
        codec: Codec,
        pollers: Mapping[str, Poller],
        *,
        timeout: float,
        threads: int,
        stats: PollCounts,
        wake: Callable[[], None],
    ) -> None:
        if not 0 < timeout < float("inf"):
            raise ValueError(f"poll_timeout must be a positive number of seconds, got {timeout}")
        self.store = store
        self.codec = codec
        self.pollers = dict(pollers)
        self.timeout = timeout
        self.threads = DaemonThreads(threads)
        self.stats = stats
        self.wake = wake
        #: The soonest deadline of an open question seen on the last tick.
        self.next_deadline: float | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}
        #: Sync polls given up on whose thread still runs, by question id.
        self._abandoned: dict[str, asyncio.Future[Any]] = {}
        self._answered = 0
        self._missing: set[str] = set()
        self._complained: set[str] = set()
        self._threads_full = False

    def polling(self, question_id: str) -> bool:
        """Whether a poll of ``question_id`` is still running (an abandoned thread counts)."""
        return question_id in self._tasks or question_id in self._abandoned

    async def tick(self) -> int:
        """Expire passed deadlines, start due polls; return how many questions were answered since the last tick."""
        now = self.store.clock()  # deadlines are stamped on the store's clock
        work, self._answered = self._answered, 0
        soonest: float | None = None
        questions = await self.store.list_questions(status=QuestionStatus.OPEN)
        self._complained &= {q.question_id for q in questions}
        for question in questions:
            if question.deadline is not None and now >= question.deadline:
                work += await self._expire(question)
                continue
            if question.deadline is not None:
                soonest = question.deadline if soonest is None else min(soonest, question.deadline)
            self._start(question)
        self.next_deadline = soonest
        return work

    def loop(self, name: str, *, interval: float = 0.05, max_interval: float = 2.0) -> Loop:
        """The gate loop: ticks, backing off while idle, woken for the next deadline (Q5).

        ``name`` names it in logs; ``interval`` and ``max_interval`` bound its
        idle wait, seconds. A tick that answered questions calls ``wake``, so
        the daemon applies them without waiting out its own nap.
        """
        return Loop(
            name, self.tick, interval=interval, max_interval=max_interval, stats=self.stats,
            logger=logger, due=self.until_deadline, on_work=self.wake,
        )  # fmt: skip

    def busy(self) -> bool:
        """Whether polls are in flight or a deadline is known (ticks still have work)."""
        return bool(self._tasks) or self.next_deadline is not None

    def until_deadline(self) -> float | None:
        """Seconds until the next known deadline (None: none)."""
        if self.next_deadline is None:
            return None
        return max(self.next_deadline - self.store.clock(), 0.001)

    async def aclose(self) -> None:
        """Cancel the polls in flight and wait for them (abandoned threads are left to die alone)."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _expire(self, question: QuestionRow) -> int:
        """The deadline passed: answer with a ``GateTimeout`` and mark the question expired (Q5)."""
        assert question.deadline is not None
        value = GateTimeout(question_id=question.question_id, deadline=question.deadline)
        try:
            await self.store.answer(
                question.question_id,
                self.codec.encode(value),
                by="deadline",
                status=QuestionStatus.EXPIRED,
            )
        except (AlreadyAnswered, QuestionNotFound):
            return 0  # another serve (or a person, or a poller) was first
        self.stats.expired += 1
        task = self._tasks.get(question.question_id)
        if task is not None:
            task.cancel()  # its answer could only lose now
        return 1

    def _start(self, question: QuestionRow) -> None:
        if question.poller is None or self.polling(question.question_id):
            return
        poller = self.pollers.get(question.poller)
        if poller is None:
            if question.poller not in self._missing:
                self._missing.add(question.poller)
                logger.warning("no poller named %r is registered", question.poller)
            return
        if not _is_async(poller) and self.threads.full:
            if not self._threads_full:
                logger.warning(
                    "all %d poll threads are busy (pollers past their time limit that have "
                    "not returned); sync polls wait for one to return",
                    self.threads.limit,
                )
            self._threads_full = True
            return
        self._threads_full = False
        qid = question.question_id
        task = asyncio.create_task(self._poll(question, poller), name=f"poll:{qid}")
        self._tasks[qid] = task
        task.add_done_callback(lambda _: self._tasks.pop(qid, None))

    async def _poll(self, question: QuestionRow, poller: Poller) -> None:
        assert question.poller is not None
        self.stats.polled += 1
        try:
            value = await self._call(question, poller)
            if value is None:
                return
            text = self.codec.encode(value)
        except PollTimeout:
            self.stats.poll_timeouts += 1
            self._complain(question, f"timed out after {self.timeout:g} s", None)
            return
        except Exception as exc:
            self.stats.errors += 1
            self._complain(question, f"failed: {describe(exc)}", exc)
            return
        try:
            await self.store.answer(question.question_id, text, by=f"poller:{question.poller}")
        except (AlreadyAnswered, QuestionNotFound):
            return
        self._answered += 1
        self.wake()

    async def _call(self, question: QuestionRow, poller: Poller) -> Any:
        """Call ``poller`` on the question's prompt under the time limit; PollTimeout past it."""
        prompt = self.codec.decode(question.prompt_json)
        if _is_async(poller):
            return await self._limited(poller(prompt))
        name = f"tailrace-poll:{question.poller}:{question.question_id}"
        future = self.threads.submit(poller, prompt, name=name)
        try:
            result = await self._limited(asyncio.shield(future))
        finally:
            if not future.done():
                self._abandon(question.question_id, future)
        if inspect.isawaitable(result):
            result = await self._limited(result)
        return result

    async def _limited(self, awaitable: Any) -> Any:
        try:
            async with asyncio.timeout(self.timeout) as limit:
                return await awaitable
        except TimeoutError:
            if limit.expired():
                raise PollTimeout from None
            raise  # the poller's own TimeoutError: a failure like any other

    def _abandon(self, question_id: str, future: asyncio.Future[Any]) -> None:
        """Keep ``question_id`` busy until the abandoned thread returns; drop what it returns."""
        self._abandoned[question_id] = future

        def returned(done: asyncio.Future[Any]) -> None:
            self._abandoned.pop(question_id, None)
            if not done.cancelled():
                done.exception()  # retrieved: a late failure is not "never retrieved"

        future.add_done_callback(returned)

    def _complain(self, question: QuestionRow, what: str, exc: Exception | None) -> None:
        """Log a poll's failure: a warning (with traceback) the first time per question, then debug."""
        first = question.question_id not in self._complained
        self._complained.add(question.question_id)
        logger.log(
            logging.WARNING if first else logging.DEBUG,
            "poller %r of question %s (run %s) %s",
            question.poller, question.question_id, question.run_id, what,
            exc_info=exc if first else None,
        )  # fmt: skip


def _is_async(poller: Poller) -> bool:
    return inspect.iscoroutinefunction(poller) or inspect.iscoroutinefunction(
        getattr(poller, "__call__", None)  # noqa: B004 - an object with an async __call__
    )
