"""How a run ends: failed (E9), cancelled, suspended, completed or stalled (E10).

:class:`RunEndings` is a part of :class:`~tailrace.core._loop.RunLoop`: the
ways out of its loop, the cancellation of what is still in flight, and the
:class:`~tailrace.RunResult` it returns. Each ending is one final write.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import TYPE_CHECKING, Any

from .._errors import StallError
from .._events import EventType
from ._inflight import Attempt, describe
from ._outcome import NodeReport, RunResult
from ._state import NodeStatus

if TYPE_CHECKING:
    from ..graph import Topology
    from ._admission import Ticket
    from ._state import RunState
    from ._writer import Persister


class RunEndings:
    """The ways a run loop ends, and what it returns."""

    if TYPE_CHECKING:  # the run loop's own; declared for the type checker only
        run_id: str
        state: RunState
        topo: Topology
        turn: int
        hedges: int
        stragglers: int
        started_at: float
        cancel_requested: bool
        _persister: Persister | None
        _tickets: dict[int, Ticket]
        _in_flight: dict[Attempt, None]
        _done: list[Attempt]
        _failing: Attempt | None
        _durations: list[float]

        def emit(
            self,
            type: EventType,
            node: int | None = None,
            visit: int | None = None,
            attempt: int | None = None,
            **data: Any,
        ) -> None: ...

        def poke(self) -> None: ...

        async def _commit(self, status: str = "running", error: str | None = None) -> None: ...

        def _release_slot(self) -> None: ...

        def _release_extra(self, attempt: Attempt) -> None: ...

        def _close_tail(self) -> None: ...

    async def _fail(self, i: int, exc: BaseException) -> None:
        """E9: cancel and await siblings, one final write, NODE_FAILED last, re-raise."""
        await self._cancel_in_flight(record=True)
        self._release_slot()  # the failed node's; no queued sibling can take it now
        if self._failing is not None:
            self._release_extra(self._failing)
        self._supersede_waiting()
        ns = self.state.nodes[i]
        if ns.status is not NodeStatus.FAILED:
            self.state.fail(i)
        self.emit(EventType.NODE_FAILED, i, ns.visits, ns.attempts, error=describe(exc))
        await self._commit("failed", describe(exc))
        raise exc

    def _supersede_waiting(self) -> None:
        """The run ends without its gates' answers: cancel them, supersede their questions (Q3)."""
        for question_id, g in sorted(self.state.waiting_questions().items(), key=lambda kv: kv[1]):
            gs = self.state.nodes[g]
            gs.question = None
            self.state.cancel(g)
            self.emit(EventType.NODE_CANCELLED, g, gs.visits, gs.attempts)
            if self._persister is not None:
                self._persister.superseded.append(question_id)

    async def _cancel_in_flight(self, *, record: bool) -> None:
        self._close_tail()  # first: no hedge may start while we wind down
        tickets, self._tickets = self._tickets, {}
        for ticket in tickets.values():
            ticket.cancel()
        attempts = list(self._in_flight)
        for attempt in attempts:
            assert attempt.task is not None
            attempt.task.cancel()
        if attempts:
            await asyncio.gather(*(a.task for a in attempts if a.task), return_exceptions=True)
        self._in_flight.clear()
        for attempt in (*attempts, *self._done):
            self._release_extra(attempt)  # clones and backups hold their own
        # Abandoned attempts (hedge losers, cancelled dead inputs) hold no node slot.
        holding = {a.index for a in attempts if not a.abandoned} | {
            a.index for a in self._done if not a.abandoned
        }
        for _ in holding:  # one slot per node visit, however many attempts raced
            self._release_slot()
        stopped = holding | set(tickets)
        self._done = []
        if not record:
            return
        for i in sorted(stopped):
            ns = self.state.nodes[i]
            if ns.status in (NodeStatus.RUNNING, NodeStatus.QUEUED, NodeStatus.WAITING):
                self.state.cancel(i)
                self.emit(EventType.NODE_CANCELLED, i, ns.visits, ns.attempts)

    def preempt(self) -> None:
        """Stop the run at its next turn boundaries (in-loop edges) and suspend it (partial rollouts)."""
        self.state.preempting = True
        self.poke()

    def request_cancel(self) -> None:
        """End the run ``cancelled`` at its next wake-up (``Engine.cancel``).

        In-flight attempts are cancelled and awaited, what the wake-up brought
        is dropped, running nodes are recorded cancelled and open questions
        superseded, in one final write; nothing is committed after it.
        """
        self.cancel_requested = True
        self.poke()

    async def _cancel(self) -> RunResult:
        await self._cancel_in_flight(record=True)
        self._supersede_waiting()
        self.emit(EventType.RUN_CANCELLED)
        await self._commit("cancelled")
        return self.result("cancelled")

    async def _finish(self) -> RunResult:
        if self.state.parked:  # preempted: suspend with the turns parked, no question
            self.emit(EventType.RUN_SUSPENDED, reason="preempted", parked=len(self.state.parked))
            await self._commit("suspended")
            return dataclasses.replace(self.result("suspended"), preempted=True)
        questions = self.state.waiting_questions()
        if questions:  # E10: an open gate is a suspension, never a stall
            self.turn += 1
            self.emit(EventType.RUN_SUSPENDED, questions=sorted(questions), turn=self.turn)
            await self._commit("suspended")
            return self.result("suspended")
        waiting = self.state.waiting_aggregates()
        if waiting:
            message = f"run {self.run_id!r} stalled: aggregate " + "; ".join(waiting)
            await self._commit("failed", message)
            raise StallError(message)
        self.emit(EventType.RUN_COMPLETED)
        await self._commit("completed")
        return self.result("completed")

    def result(self, status: str) -> RunResult:
        """Build the :class:`RunResult` from the current state."""
        results: dict[str, Any] = {}
        visits: dict[str, int] = {}
        reports: dict[str, NodeReport] = {}
        durations = self._durations
        for i, (node_id, ns) in enumerate(zip(self.topo.ids, self.state.nodes, strict=True)):
            if ns.has_result:
                results[node_id] = ns.result
            visits[node_id] = ns.visits
            reports[node_id] = NodeReport(ns.status._value_, ns.visits, ns.attempts, durations[i])
        return RunResult(
            run_id=self.run_id,
            status=status,
            results=results,
            visits=visits,
            nodes=reports,
            late_inputs=tuple(self.state.late),
            stragglers=self.stragglers,
            hedges=self.hedges,
            duration=time.monotonic() - self.started_at,
            output=self._output(),
        )

    def _output(self) -> Any:
        done = [i for i in self.topo.sinks if self.state.nodes[i].has_result]
        if len(done) == 1:
            return self.state.nodes[done[0]].result
        return {self.topo.ids[i]: self.state.nodes[i].result for i in done} or None
