"""What a run returns: its :class:`RunResult`, with a :class:`NodeReport` per node."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ..stores import RunStatus
from ._state import LateInput, NodeStatus, RunState


class NodeReport(NamedTuple):
    """Per-node outcome in a :class:`RunResult`: status, visits, attempts, seconds spent.

    ``status`` is a :class:`~tailrace.NodeStatus` (a ``str`` enum, so it also
    compares equal to its value).
    """

    status: NodeStatus
    visits: int
    attempts: int
    duration: float


@dataclass(frozen=True, slots=True, kw_only=True)
class RunResult:
    """What ``Engine.run`` returns.

    ``results`` maps each node that completed to its last result; ``visits``
    maps every node to how many times it was activated; ``output`` is the
    result of the graph's sink node (a dict by node when several sinks
    completed, None when none did); ``late_inputs`` lists
    inputs that arrived after their activation fired (E5); ``questions`` the
    open questions of a suspended run; ``status`` is a
    :class:`~tailrace.stores.RunStatus` (a ``str`` enum: ``result.status is
    RunStatus.COMPLETED``, and it still equals ``"completed"``); ``preempted`` is true when the run
    was suspended by ``Engine.preempt`` at a turn boundary. ``stragglers`` counts
    the attempts that ran past their hedge delay (T3), ``hedges`` the backups and
    clones started, and ``hedges_refused`` the stragglers whose backup the hedge
    budget refused (they ended while waiting for a token, T5).
    """

    run_id: str
    status: RunStatus
    results: dict[str, Any]
    visits: dict[str, int]
    nodes: dict[str, NodeReport] = field(default_factory=dict)
    late_inputs: tuple[LateInput, ...] = ()
    stragglers: int = 0
    hedges: int = 0
    hedges_refused: int = 0
    questions: tuple[Any, ...] = ()
    duration: float = 0.0
    output: Any = None
    preempted: bool = False
    #: The run whose node ran this one as a child run (R1), or None.
    parent_run_id: str | None = None
    #: The child runs a run suspended on is waiting for (R4).
    waiting_on: tuple[str, ...] = ()


def result_of(
    run_id: str,
    status: RunStatus,
    state: RunState,
    durations: list[float],
    *,
    stragglers: int,
    hedges: int,
    hedges_refused: int,
    duration: float,
    parent_run_id: str | None,
) -> RunResult:
    """The :class:`RunResult` of run ``run_id`` from its ``state``: results, visits, a report
    per node (with the seconds in ``durations``), late inputs and output."""
    results: dict[str, Any] = {}
    visits: dict[str, int] = {}
    reports: dict[str, NodeReport] = {}
    for i, (node_id, ns) in enumerate(zip(state.topo.ids, state.nodes, strict=True)):
        if ns.has_result:
            results[node_id] = ns.result
        visits[node_id] = ns.visits
        reports[node_id] = NodeReport(ns.status, ns.visits, ns.attempts, durations[i])
    return RunResult(
        run_id=run_id, status=status, results=results, visits=visits, nodes=reports,
        late_inputs=tuple(state.late), stragglers=stragglers, hedges=hedges,
        hedges_refused=hedges_refused, duration=duration, output=state.output(), parent_run_id=parent_run_id,
    )  # fmt: skip
