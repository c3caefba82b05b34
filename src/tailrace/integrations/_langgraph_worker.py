"""The driver's resume worker: after letting go of a thread, it applies answers that lost the race (Q3).

An answerer records its answer *before* it tries the thread (the worker's
per-run lock, then the run lease), and reports ``busy`` when someone else
holds it. The holder applies every answered interrupt it can see while it
holds the lease; this worker closes the remaining window by looking at the
ledger again *after* it let go: an answer that found the thread busy was
recorded before the holder let go, so it is visible then. Applying it needs
the lease again; if someone else took it, that one re-checks in turn (the
same argument as ``Engine._settle``).
"""

from __future__ import annotations

from ..gates import Outcome, ResumeWorker
from ._langgraph_support import unapplied


class SettlingWorker(ResumeWorker):
    """A :class:`~tailrace.gates.ResumeWorker` that settles the thread after each resume it ran.

    Constructed like its base class (``store=``, ``target=``, ``owner=``,
    ``lease_ttl=``).
    """

    async def resume(self, question_id: str) -> Outcome:
        """Apply ``question_id``'s answer if due (Q3), then any answer of its thread that lost the race.

        Returns what happened to ``question_id``: when it was answered only
        after the first look (``noop``) and the settling applied it, ``applied``.
        """
        outcome = await super().resume(question_id)
        if outcome is Outcome.BUSY:
            return outcome  # the holder settles when it lets go
        question = await self.store.get_question(question_id)
        if outcome is not Outcome.NOOP:  # tried: a failed step is not retried at once
            await self._settle(question.run_id, {question_id: outcome})
            return outcome
        # Not due when we looked: it may have been answered since, and applied by us now.
        later = (await self._settle(question.run_id, {})).get(question_id)
        return later if later in (Outcome.APPLIED, Outcome.SUPERSEDED) else outcome

    async def settle(self, run_id: str) -> dict[Outcome, int]:
        """Apply the answered questions of ``run_id`` that nobody applied; counts what each resume did.

        Each question is tried once per call, so an answer whose step fails is
        left to a later sweep rather than retried in a loop.
        """
        counts: dict[Outcome, int] = {}
        for outcome in (await self._settle(run_id, {})).values():
            counts[outcome] = counts.get(outcome, 0) + 1
        return counts

    async def _settle(self, run_id: str, tried: dict[str, Outcome]) -> dict[str, Outcome]:
        """Resume each unapplied question of ``run_id`` not in ``tried`` once; their outcomes."""
        outcomes = dict(tried)
        while True:
            waiting = [
                q.question_id
                for q in await self.store.list_questions(run_id=run_id)
                if unapplied(q) and q.question_id not in outcomes
            ]
            if not waiting:
                return outcomes
            for question_id in waiting:
                outcome = outcomes[question_id] = await super().resume(question_id)
                if outcome is Outcome.BUSY:
                    return outcomes  # its holder re-checks after letting go
