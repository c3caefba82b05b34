"""What a LangGraph thread's steps did, as tailrace events, so every tool shows a thread like a run.

The driver runs each graph step with LangGraph's ``tasks`` stream and hands
every chunk to a :class:`StepLog` with the time it arrived. The log keeps
them until the step's bookkeeping commit, where :meth:`StepLog.rows` turns
them into the store's event rows (``node_started``, ``node_completed``,
``node_failed``, ``question_opened``, ``question_answered`` and the run's own
``run_*`` events) in the same transaction as the ledger's changes (D1). The
dashboard then draws the thread's attempts, waits and event log from the
store, as it does for a run of the engine.

A node's *visit* counts the LangGraph tasks of that node in the thread; a
task LangGraph runs again with the same task id (the node that called
``interrupt()`` re-runs once it is answered, or a failed step is retried)
is the same visit, one attempt more. The counters and the next ``seq`` live
in the run row's state, so a driver in another process carries on the
numbering.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._codec import DEFAULT_CODEC
from .._events import EventType
from ..stores import EventRow, QuestionRow, RunRecord, RunStatus

#: LangGraph's own entry and exit nodes: not steps of the graph's author.
_ENDPOINTS = frozenset({"__start__", "__end__"})
#: What a run's stored status adds to the log when a commit reaches it.
_RUN_ENDING = {
    RunStatus.COMPLETED: EventType.RUN_COMPLETED,
    RunStatus.SUSPENDED: EventType.RUN_SUSPENDED,
    RunStatus.FAILED: EventType.RUN_FAILED,
}


@dataclass(frozen=True, slots=True)
class _Seen:
    """One thing a step did, as it happened: ``kind`` is an event type, ``data`` its fields."""

    kind: EventType
    node: str | None
    task: str | None
    ts: float
    data: dict[str, Any]


@dataclass(slots=True)
class _Counters:
    """A thread's event numbering as stored in its run row: next seq, visits per node."""

    seq: int = 0
    visits: dict[str, int] = field(default_factory=dict)
    tasks: dict[str, str] = field(default_factory=dict)  # node -> its last task id
    attempts: dict[str, int] = field(default_factory=dict)  # node -> attempts of that visit
    #: node -> (visit, attempt) of a stream a dead driver left open: its re-run is one more.
    cuts: dict[str, tuple[int, int]] = field(default_factory=dict)

    @classmethod
    def of(cls, state: Mapping[str, Any]) -> _Counters:
        stored = state.get("events")
        if not isinstance(stored, Mapping):
            return cls()
        seq = stored.get("seq")
        return cls(
            seq=seq if isinstance(seq, int) and seq >= 0 else 0,
            visits=_ints(stored.get("visits")),
            tasks={k: v for k, v in _items(stored.get("tasks")) if isinstance(v, str)},
            attempts=_ints(stored.get("attempts")),
        )

    def stored(self) -> dict[str, Any]:
        return {"seq": self.seq, "visits": self.visits, "tasks": self.tasks,
                "attempts": self.attempts}  # fmt: skip

    def start(self, node: str, task: str | None) -> tuple[int, int]:
        """The visit and attempt of ``node``'s task ``task`` starting now."""
        if task is not None and self.tasks.get(node) == task:
            self.attempts[node] = self.attempts.get(node, 1) + 1
        else:
            self.visits[node] = self.visits.get(node, 0) + 1
            self.attempts[node] = 1
            if task is not None:
                self.tasks[node] = task
        cut = self.cuts.get(node)
        if cut is not None and cut[0] == self.visits[node] and self.attempts[node] <= cut[1]:
            self.attempts[node] = cut[1] + 1  # the cut attempt's re-run
        return self.visits[node], self.attempts[node]

    def current(self, node: str) -> tuple[int | None, int | None]:
        """The visit and attempt ``node`` is at (None before it ever started)."""
        if node not in self.visits:
            return None, None
        return self.visits[node], self.attempts.get(node, 1)


def _items(value: Any) -> Iterable[tuple[str, Any]]:
    return ((str(k), v) for k, v in value.items()) if isinstance(value, Mapping) else ()


def _ints(value: Any) -> dict[str, int]:
    return {k: v for k, v in _items(value) if isinstance(v, int) and not isinstance(v, bool)}


class StepLog:
    """Chunks of a thread's graph steps, kept until the commit that stores them as events."""

    def __init__(self) -> None:
        self._seen: dict[str, list[_Seen]] = {}
        self._cuts: dict[str, dict[str, tuple[int, int]]] = {}

    def cut(self, thread_id: str, node: str, visit: int, attempt: int) -> None:
        """A dead driver left ``node``'s stream of ``visit`` and ``attempt`` open: a re-run of
        that visit is a later attempt (in the events and the streams alike)."""
        cuts = self._cuts.setdefault(thread_id, {})
        if cuts.get(node, (0, 0)) < (visit, attempt):
            cuts[node] = (visit, attempt)

    def tags(
        self,
        thread_id: str,
        state: Mapping[str, Any],
        task: str | None,
        *,
        node: str | None = None,
    ) -> tuple[int | None, int | None]:
        """The visit and attempt the events give LangGraph task ``task`` of this step (seen
        starting already); with no task, those ``node`` is at. (None, None): not known."""
        counters = self._counters(thread_id, state)
        found: tuple[int | None, int | None] = (None, None)
        for seen in list(self._seen.get(thread_id, ())):
            if seen.kind is EventType.NODE_STARTED and seen.node is not None:
                tags = counters.start(seen.node, seen.task)
                if task is not None and seen.task == task:
                    found = tags
        if task is None and node is not None:
            visit, attempt = counters.current(node)
            return visit or 1, attempt or 1
        return found

    def _counters(self, thread_id: str, state: Mapping[str, Any]) -> _Counters:
        counters = _Counters.of(state)
        counters.cuts = dict(self._cuts.get(thread_id, {}))
        return counters

    def run_started(self, thread_id: str, graph_name: str, structure: Mapping[str, Any]) -> None:
        """The thread's first step begins: ``structure`` is its graph's nodes and edges."""
        self._add(thread_id, EventType.RUN_STARTED, None, None,
                  {"graph": graph_name, "structure": dict(structure)})  # fmt: skip

    def resumed(self, thread_id: str, answered: Sequence[tuple[str, str]]) -> None:
        """A step begins that resumes the interrupts of ``answered``: (question id, node) pairs."""
        self._add(thread_id, EventType.RUN_RESUMED, None, None, {"applied": len(answered)})
        for question_id, node in answered:
            self._add(thread_id, EventType.QUESTION_ANSWERED, node or None, None,
                      {"question_id": question_id})  # fmt: skip

    def task_chunk(self, thread_id: str, chunk: Any) -> None:
        """One chunk of LangGraph's ``tasks`` stream: a task started, or its result."""
        if not isinstance(chunk, Mapping) or not isinstance(chunk.get("name"), str):
            return
        node, task = chunk["name"], chunk.get("id")
        task = task if isinstance(task, str) else None
        if node in _ENDPOINTS:
            return
        if "triggers" in chunk and "result" not in chunk:
            self._add(thread_id, EventType.NODE_STARTED, node, task, {})
        elif chunk.get("error") is not None:
            error = chunk["error"]
            text = f"{type(error).__name__}: {error}" if isinstance(error, BaseException) else error
            self._add(thread_id, EventType.NODE_FAILED, node, task, {"error": str(text)})
        elif not chunk.get("interrupts"):  # an interrupted task ends in its question_opened
            self._add(thread_id, EventType.NODE_COMPLETED, node, task, {})

    def step_failed(self, thread_id: str, exc: BaseException) -> None:
        """The step raised ``exc``: every task still open failed with it."""
        open_tasks: dict[str, str | None] = {}
        for seen in self._seen.get(thread_id, ()):
            if seen.node is None:
                continue
            if seen.kind is EventType.NODE_STARTED:
                open_tasks[seen.node] = seen.task
            elif seen.kind in (EventType.NODE_COMPLETED, EventType.NODE_FAILED):
                open_tasks.pop(seen.node, None)
        error = f"{type(exc).__name__}: {exc}"
        for node, task in open_tasks.items():
            self._add(thread_id, EventType.NODE_FAILED, node, task, {"error": error})

    def rows(
        self,
        record: RunRecord,
        state: Mapping[str, Any],
        *,
        opened: Sequence[QuestionRow],
        status: RunStatus,
        last_seq: int,
        error: str | None = None,
    ) -> tuple[list[EventRow], dict[str, Any]]:
        """The event rows this commit stores, and the counters to store in the run's state.

        Args:
            record: the thread's run row before the commit.
            state: the run row's decoded state (its counters).
            opened: questions this commit opens (one ``question_opened`` each).
            status: the run's status after the commit.
            last_seq: the highest ``seq`` the store holds for the thread.
            error: the failed step's error, when the commit records one.
        """
        counters = self._counters(record.run_id, state)
        counters.seq = max(counters.seq, last_seq)
        now = time.time()
        seen = list(self._seen.get(record.run_id, ()))
        seen += [_Seen(EventType.QUESTION_OPENED, q.node_id, None, now,
                       {"question_id": q.question_id, "turn": q.turn}) for q in opened]  # fmt: skip
        ending = _RUN_ENDING.get(status)
        if ending is not None and status is not record.status:
            data = {"error": error} if status is RunStatus.FAILED and error else {}
            seen.append(_Seen(ending, None, None, now, data))
        rows = [self._row(counters, s) for s in seen]
        return rows, counters.stored()

    @staticmethod
    def stored_seq(state: Mapping[str, Any]) -> int:
        """The last ``seq`` the driver stored, from the run row's decoded ``state``."""
        return _Counters.of(state).seq

    def committed(self, thread_id: str) -> None:
        """The rows of ``thread_id`` are stored: forget them."""
        self._seen.pop(thread_id, None)
        self._cuts.pop(thread_id, None)

    def _row(self, counters: _Counters, seen: _Seen) -> EventRow:
        visit: int | None = None
        attempt: int | None = None
        if seen.node is not None:
            if seen.kind is EventType.NODE_STARTED:
                visit, attempt = counters.start(seen.node, seen.task)
            else:
                visit, attempt = counters.current(seen.node)
        counters.seq += 1
        return EventRow(
            seq=counters.seq,
            type=seen.kind.value,
            node_id=seen.node,
            visit=visit,
            attempt=attempt,
            ts=seen.ts,
            data_json=DEFAULT_CODEC.encode(seen.data),
        )

    def _add(self, thread_id: str, kind: EventType, node: str | None, task: str | None,
             data: dict[str, Any]) -> None:  # fmt: skip
        self._seen.setdefault(thread_id, []).append(_Seen(kind, node, task, time.time(), data))


def structure_of(graph: Any) -> dict[str, Any]:
    """A compiled LangGraph graph's nodes and edges, LangGraph's endpoints left out.

    In the form the engine stores with ``run_started`` (``nodes``: ``[id, kind]``
    pairs; ``edges``: ``[source, target, route]``), so the dashboard draws a
    thread's graph whole without importing it. A graph LangGraph cannot draw
    gives an empty structure.
    """
    try:
        drawn = graph.get_graph()
    except Exception:  # a graph LangGraph cannot draw is still driven; it is drawn from its steps
        return {"nodes": [], "edges": []}
    nodes = [[str(n), "task"] for n in drawn.nodes if str(n) not in _ENDPOINTS]
    edges = [
        [str(e.source), str(e.target), None]
        for e in drawn.edges
        if str(e.source) not in _ENDPOINTS and str(e.target) not in _ENDPOINTS
    ]
    return {"nodes": nodes, "edges": edges}
