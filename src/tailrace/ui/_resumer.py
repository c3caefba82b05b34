"""Resumes and forks started from the page, run in the background and owned by the app's lifespan.

Answering a question records the answer at once (first answer wins, Q2) and
returns; the run is then resumed here, by this process's engine, when the
dashboard can load its graph (``--graphs``, or an importable module), or by
the driver of the run's LangGraph thread (``--langgraph``: any
:class:`ThreadDriver`). The single-flight, turn-guarded resume (Q3) and the
run lease (D6) make this safe next to ``tailrace serve`` and other engines:
whoever holds the run applies the answer, the others step aside. What
happened is kept as a note the run page shows.

A fork started from a run's page ("fork from here") is driven here the same
way, under the fork's own id, which the page chose before it started.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from .._errors import GraphError, LeaseHeld, NotResumable
from ..core import Engine
from ..graph import Graph
from ..stores import QuestionStatus, RunRecord, RunStatus

logger = logging.getLogger("tailrace.ui")

#: ``graph_name`` prefix of a LangGraph thread's run row (a stored format the driver writes).
LANGGRAPH_PREFIX = "langgraph:"


@dataclass(frozen=True, slots=True, kw_only=True)
class ResumeNote:
    """The latest word on a resume this dashboard started: ``state`` and a sentence."""

    run_id: str
    state: str  # resuming, forking, completed, suspended, failed, elsewhere, unloadable, deferred
    message: str
    at: float


class ThreadDriver(Protocol):
    """What drives runs the engine does not: a LangGraph graph's driver (``--langgraph``)."""

    name: str

    def handles(self, run: RunRecord) -> bool:
        """Whether ``run`` is one of this driver's threads."""
        ...

    async def resume(self, thread_id: str) -> RunStatus:
        """Apply the answers waiting for the thread (taking it over if its driver died)."""
        ...


class Resumer:
    """Starts one background resume (or fork) per run and cancels them all on exit (structured).

    Args:
        engine: the engine that resumes runs; it holds the graphs named with
            ``--graphs`` (``Engine.register``).
        drivers: drivers of LangGraph threads (``--langgraph``); a run one of
            them handles is resumed by it, never by the engine.

    Use as ``async with Resumer(engine) as resumer:``; leaving the block cancels
    resumes and forks still running (their leases are released; the runs stay
    resumable).
    """

    def __init__(self, engine: Engine, drivers: Sequence[ThreadDriver] = ()) -> None:
        self.engine = engine
        self.drivers = tuple(drivers)
        self.notes: dict[str, ResumeNote] = {}
        #: Forks started here: fork id -> (source run id, node it starts from).
        self.forks: dict[str, tuple[str, str]] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}

    async def __aenter__(self) -> Resumer:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()

    def start(self, run_id: str) -> ResumeNote:
        """Resume ``run_id`` in the background unless this dashboard already is resuming it."""
        if run_id not in self._tasks:
            self._note(run_id, "resuming", "resuming the run in the dashboard's process")
            self._tasks[run_id] = asyncio.get_running_loop().create_task(
                self._resume(run_id), name=f"tailrace-ui-resume-{run_id}"
            )
        return self.notes[run_id]

    def fork(self, run_id: str, *, at: str, fork_id: str, graph: Graph) -> ResumeNote:
        """Fork ``run_id`` at node ``at`` as run ``fork_id`` on ``graph``, in the background (V4).

        The fork is driven here to its end (or its first gate), like a resume;
        its note is kept under ``fork_id``, so the fork's page shows it before
        the fork's first row is written, and after.
        """
        if fork_id not in self._tasks:
            self.forks[fork_id] = (run_id, at)
            self._note(fork_id, "forking", f"forking run {run_id!r} at node {at!r}")
            self._tasks[fork_id] = asyncio.get_running_loop().create_task(
                self._fork(run_id, at, fork_id, graph), name=f"tailrace-ui-fork-{fork_id}"
            )
        return self.notes[fork_id]

    def running(self, run_id: str) -> bool:
        """Whether a resume or fork of ``run_id`` started here is still running."""
        return run_id in self._tasks

    async def wait(self, run_id: str) -> None:
        """Wait until the resume (or fork) of ``run_id`` started here ends (tests, shutdown)."""
        task = self._tasks.get(run_id)
        if task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(task)

    async def _resume(self, run_id: str) -> None:
        try:
            assert self.engine.store is not None
            record = await self.engine.store.get_run(run_id)
            driver = next((d for d in self.drivers if d.handles(record)), None)
            if driver is not None:
                await self._resume_thread(driver, run_id)
            elif record.graph_name.startswith(LANGGRAPH_PREFIX):
                name = record.graph_name.removeprefix(LANGGRAPH_PREFIX)
                self._note(
                    run_id, "unloadable",
                    f"the answer is recorded; run {run_id!r} is a LangGraph thread, which this "
                    f"dashboard has no driver for: `tailrace ui --langgraph {name}=MODULE_OR_FILE:ATTR` "
                    "(or `tailrace serve` with the same option) applies it",
                )  # fmt: skip
            else:
                await self._resume_run(run_id)
        except Exception as exc:  # reading the run failed (the store): say so on the page
            self._note(run_id, "failed", f"the resume did not start: {type(exc).__name__}: {exc}")
            logger.info("resume of run %r from the dashboard failed", run_id, exc_info=exc)
        finally:
            self._tasks.pop(run_id, None)

    async def _resume_run(self, run_id: str) -> None:
        try:
            result = await self.engine.resume(run_id)
        except LeaseHeld:
            self._note(run_id, "elsewhere", "another process holds the run; it applies the answer")
        except NotResumable as exc:
            self._note(run_id, "elsewhere", str(exc))
        except GraphError as exc:
            self._note(
                run_id,
                "unloadable",
                f"the answer is recorded, but this dashboard cannot load the run's graph: {exc}. "
                "`tailrace serve --graphs FILE` (or `tailrace resume`) applies it",
            )
        except Exception as exc:  # a handler failed the run (E9): the store says so too
            self._note(run_id, "failed", f"the resumed run failed: {type(exc).__name__}: {exc}")
            logger.info("resume of run %r from the dashboard failed", run_id, exc_info=exc)
        else:
            self._note(run_id, result.status, f"resumed here: the run is {result.status}")

    async def _fork(self, run_id: str, at: str, fork_id: str, graph: Graph) -> None:
        origin = f"forked here from run {run_id!r} at node {at!r}"
        try:
            result = await self.engine.fork(run_id, at=at, graph=graph, fork_id=fork_id)
        except Exception as exc:  # plan (a changed graph, no payload), the store, a handler (E9)
            self._note(fork_id, "failed", f"the fork of run {run_id!r} at node {at!r} failed: "
                       f"{type(exc).__name__}: {exc}")  # fmt: skip
            logger.info(
                "fork %r of run %r from the dashboard failed", fork_id, run_id, exc_info=exc
            )
        else:
            self._note(fork_id, result.status, f"{origin}: the run is {result.status}")
        finally:
            self._tasks.pop(fork_id, None)

    async def _resume_thread(self, driver: ThreadDriver, run_id: str) -> None:
        try:
            status = await driver.resume(run_id)
        except LeaseHeld:
            self._note(
                run_id, "elsewhere", "another process holds the thread; it applies the answer"
            )
        except NotResumable as exc:
            self._note(run_id, "elsewhere", str(exc))
        except Exception as exc:  # a failed step (Q6), or a checkpointer without the thread
            self._note(
                run_id,
                "failed",
                f"the LangGraph thread was not resumed: {type(exc).__name__}: {exc}",
            )
            logger.info("resume of thread %r from the dashboard failed", run_id, exc_info=exc)
        else:
            assert self.engine.store is not None
            stuck = [
                q.apply_error
                for q in await self.engine.store.list_questions(run_id=run_id)
                if q.status is QuestionStatus.ANSWERED and q.apply_error is not None
            ]
            if stuck:
                self._note(run_id, "deferred", f"the answer is recorded, not applied: {stuck[0]}")
                return
            self._note(
                run_id, status.value,
                f"resumed here by the LangGraph driver {driver.name!r}: the thread is {status}",
            )  # fmt: skip

    def _note(self, run_id: str, state: str, message: str) -> None:
        self.notes[run_id] = ResumeNote(run_id=run_id, state=state, message=message, at=time.time())
