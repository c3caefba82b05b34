"""Resumes started from the page, run in the background and owned by the app's lifespan.

Answering a question records the answer at once (first answer wins, Q2) and
returns; the run is then resumed here, by this process's engine, when the
dashboard can load its graph (``--graphs``, or an importable module). The
engine's single-flight, turn-guarded resume (Q3) and the run lease (D6) make
this safe next to ``tailrace serve`` and other engines: whoever holds the run
applies the answer, the others step aside. What happened is kept as a note the
run page shows.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

from .._errors import GraphError, LeaseHeld, NotResumable
from ..core import Engine

logger = logging.getLogger("tailrace.ui")


@dataclass(frozen=True, slots=True, kw_only=True)
class ResumeNote:
    """The latest word on a resume this dashboard started: ``state`` and a sentence."""

    run_id: str
    state: str  # resuming, completed, suspended, failed, elsewhere, unloadable
    message: str
    at: float


class Resumer:
    """Starts one background resume per run and cancels them all on exit (structured).

    Args:
        engine: the engine that resumes runs; it holds the graphs named with
            ``--graphs`` (``Engine.register``).

    Use as ``async with Resumer(engine) as resumer:``; leaving the block cancels
    resumes still running (their leases are released; the runs stay resumable).
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.notes: dict[str, ResumeNote] = {}
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

    async def wait(self, run_id: str) -> None:
        """Wait until the resume of ``run_id`` started here ends (tests, shutdown)."""
        task = self._tasks.get(run_id)
        if task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(task)

    async def _resume(self, run_id: str) -> None:
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
        finally:
            self._tasks.pop(run_id, None)

    def _note(self, run_id: str, state: str, message: str) -> None:
        self.notes[run_id] = ResumeNote(run_id=run_id, state=state, message=message, at=time.time())
