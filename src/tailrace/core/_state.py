"""Run state and the pure decisions over it: readiness, routing, first-k (E4-E8).

The run loop owns the I/O; this module owns the semantics. :class:`RunState`
is mutated only through :meth:`RunState.activate_entries`,
:meth:`RunState.complete` and :meth:`RunState.start`, each of which records
what changed (``dirty`` nodes, late inputs, first-k decisions) so that the
loop can persist exactly the delta of one harvest (D1).

Activation bookkeeping. ``fired`` counts an aggregate's (or any node's)
activation *decisions*; ``visits`` counts those started. A delivery on edge
``s -> t`` belongs to activation ``gen = max(last gen on that edge + 1,
frontier_s[t])``, where a visit's *frontier* records, for every node of its
loop, how many activations of that node causally precede it. A delivery with
``gen < fired`` is late: it belongs to an activation that already fired
(E5, E7). The frontier is what keeps a straggler behind a first-k merge, or a
branch a switch skipped, from re-firing a loop.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .._errors import RouteError
from ..graph import EXIT, NodeKind, OutEdge, Topology


class NodeStatus(enum.StrEnum):
    """Lifecycle of one node within a run; legal moves are in ``NODE_TRANSITIONS``."""

    PENDING = "pending"
    QUEUED = "queued"
    RUNNING = "running"
    WAITING = "waiting"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


NODE_TRANSITIONS: dict[NodeStatus, frozenset[NodeStatus]] = {
    NodeStatus.PENDING: frozenset({NodeStatus.QUEUED, NodeStatus.CANCELLED}),
    NodeStatus.QUEUED: frozenset({NodeStatus.RUNNING, NodeStatus.CANCELLED}),
    NodeStatus.RUNNING: frozenset(
        {NodeStatus.COMPLETED, NodeStatus.FAILED, NodeStatus.CANCELLED, NodeStatus.WAITING}
    ),
    NodeStatus.WAITING: frozenset({NodeStatus.COMPLETED, NodeStatus.FAILED, NodeStatus.CANCELLED}),
    NodeStatus.COMPLETED: frozenset({NodeStatus.QUEUED}),
    NodeStatus.FAILED: frozenset(),
    NodeStatus.CANCELLED: frozenset({NodeStatus.QUEUED}),
}

BUSY = frozenset({NodeStatus.QUEUED, NodeStatus.RUNNING, NodeStatus.WAITING})

# The common moves are checked with ``is`` first (the hot path of every node);
# anything else goes through ``NodeState.move`` and its table.
_PENDING, _QUEUED, _RUNNING = NodeStatus.PENDING, NodeStatus.QUEUED, NodeStatus.RUNNING
_WAITING, _COMPLETED = NodeStatus.WAITING, NodeStatus.COMPLETED


class IllegalTransition(RuntimeError):
    """A bug guard: the engine tried a status change the state machine forbids."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LateInput:
    """An input that arrived for an activation that had already fired (E5), or past max_visits.

    ``activation`` is 1-based, like visits; ``reason`` is ``"fired"``,
    ``"max_visits"`` or ``"duplicate"``.
    """

    node_id: str
    source_id: str
    activation: int
    reason: str


class NodeState:
    """Mutable per-node state. ``inputs`` maps a source index to (seq, value, frontier)."""

    __slots__ = (
        "attempts",
        "fired",
        "frontier",
        "has_result",
        "inputs",
        "payload",
        "pending",
        "question",
        "result",
        "retry_due",
        "started_at",
        "status",
        "visits",
    )

    def __init__(self) -> None:
        self.status = NodeStatus.PENDING
        self.fired = 0
        self.visits = 0
        self.attempts = 0
        self.payload: Any = None
        self.frontier: dict[int, int] | None = None
        self.result: Any = None
        self.has_result = False
        self.inputs: dict[int, tuple[int, Any, dict[int, int] | None]] | None = None
        self.pending: tuple[Any, dict[int, int] | None] | None = None
        #: Id of the question a gate in WAITING waits on (Q1).
        self.question: str | None = None
        self.started_at = 0.0
        #: Wall-clock time the next attempt is due while backing off between retries (E11).
        self.retry_due: float | None = None

    def move(self, to: NodeStatus, node_id: str) -> None:
        """Change status, refusing moves ``NODE_TRANSITIONS`` does not allow."""
        if to not in NODE_TRANSITIONS[self.status]:
            raise IllegalTransition(
                f"node {node_id!r}: illegal status change {self.status} -> {to}"
            )
        self.status = to


class RunState:
    """All state of one run: node states, completion sequence, late inputs, decisions."""

    __slots__ = (
        "_aggregate",
        "_switch",
        "dirty",
        "edge_gen",
        "frozen",
        "late",
        "nodes",
        "parked",
        "preempting",
        "ready",
        "seq",
        "topo",
    )

    def __init__(self, topo: Topology) -> None:
        self.topo = topo
        self.nodes = [NodeState() for _ in topo.ids]
        self._aggregate = tuple(n.kind is NodeKind.AGGREGATE for n in topo.nodes)
        self._switch = tuple(n.kind is NodeKind.SWITCH for n in topo.nodes)
        self.seq = 0
        self.late: list[LateInput] = []
        self.edge_gen: dict[tuple[int, int], int] = {}
        #: Nodes touched since the last ``take_dirty`` (for per-harvest deltas).
        self.dirty: dict[int, None] = {}
        #: First-k decisions made since the last harvest: (node, activation, payload).
        #: First-k decisions not yet written: (aggregate, activation, payload, the
        #: sources whose inputs it holds, in definition order) (E4).
        self.frozen: list[tuple[int, int, list[Any], tuple[int, ...]]] = []
        #: Nodes activated and waiting for dispatch, in activation order.
        self.ready: list[int] = []
        #: Set by a preemption: in-loop deliveries (turn boundaries) are parked.
        self.preempting = False
        #: Parked deliveries: (source, target, value, frontier), replayed on resume.
        self.parked: list[tuple[int, int, Any, dict[int, int] | None]] = []

    # -- transitions --------------------------------------------------------

    def activate_entries(self, payload: Any) -> None:
        """Fire every entry node with the run input."""
        for i in self.topo.entries:
            self._fire(i, payload, None)

    def activate(self, i: int, payload: Any) -> None:
        """Fire node ``i`` with ``payload`` as if its inputs had arrived (a fork's first node, V4)."""
        self._fire(i, payload, None)

    def redeliver(self, s: int, t: int, value: Any) -> None:
        """Deliver ``value`` from the completed node ``s`` to ``t`` again (a fork's reused input, V4)."""
        self._deliver(s, t, value, self.nodes[s].frontier)

    def start(self, i: int, now: float) -> None:
        """Mark node ``i`` admitted (E3): its attempt starts now."""
        ns = self.nodes[i]
        if ns.status is _QUEUED:
            ns.status = _RUNNING
        else:
            ns.move(_RUNNING, self.topo.ids[i])
        if ns.attempts < 1:
            ns.attempts = 1  # a resumed node continues its attempts (E11)
        ns.started_at = now
        self.dirty[i] = None

    def complete(self, i: int, result: Any) -> Sequence[OutEdge]:
        """Record node ``i``'s result, route it (E6-E8) and return the edges taken.

        The returned edges have already been delivered; newly activated nodes
        are appended to :attr:`ready`.
        """
        ns = self.nodes[i]
        taken: Sequence[OutEdge]
        if self._switch[i]:
            taken = switch_edges(self.topo, i, result)  # may raise before any change
            value = ns.payload
        else:
            taken = self.topo.out_edges[i]
            value = result
        if ns.status is _RUNNING:
            ns.status = _COMPLETED
        else:
            ns.move(_COMPLETED, self.topo.ids[i])
        self.seq += 1
        ns.result = result
        ns.has_result = True
        self.dirty[i] = None
        for edge in taken:
            if self.preempting and edge.in_loop:  # a turn boundary: stop here for now
                self.parked.append((i, edge.target, value, ns.frontier))
            else:
                self._deliver(i, edge.target, value, ns.frontier)
        if ns.pending is not None:
            payload, frontier = ns.pending
            ns.pending = None
            self._begin(i, payload, frontier)
            self._decide_first_k(i)
        return taken

    def wait(self, i: int, question_id: str) -> None:
        """Gate ``i`` opened ``question_id`` and waits for its answer (Q1)."""
        ns = self.nodes[i]
        ns.move(NodeStatus.WAITING, self.topo.ids[i])
        ns.question = question_id
        self.dirty[i] = None

    def answer(self, i: int, value: Any) -> Sequence[OutEdge]:
        """Complete waiting gate ``i`` with ``value`` and route it like a task."""
        self.nodes[i].question = None
        return self.complete(i, value)

    def unpark(self, patch: Any = None) -> int:
        """Replay parked deliveries (a preempted run resumes), values passed through ``patch``.

        ``patch`` is None, a mapping merged into dict values, or a function of
        the value. Returns how many deliveries were replayed.
        """
        parked, self.parked = self.parked, []
        self.preempting = False
        for s, t, value, frontier in parked:
            self._deliver(s, t, apply_patch(value, patch), frontier)
        return len(parked)

    def waiting_questions(self) -> dict[str, int]:
        """Question id -> gate index, for every gate waiting on an answer."""
        return {ns.question: i for i, ns in enumerate(self.nodes) if ns.question is not None}

    def fail(self, i: int) -> None:
        """Mark node ``i`` failed (E9)."""
        self.nodes[i].move(NodeStatus.FAILED, self.topo.ids[i])
        self.dirty[i] = None

    def cancel(self, i: int) -> None:
        """Mark a queued or running node cancelled (siblings of a failure, E9)."""
        self.nodes[i].move(NodeStatus.CANCELLED, self.topo.ids[i])
        self.nodes[i].pending = None
        self.dirty[i] = None

    # -- delivery and firing ------------------------------------------------

    def _deliver(self, s: int, t: int, value: Any, frontier: dict[int, int] | None) -> None:
        topo = self.topo
        ns = self.nodes[t]
        aggregate = self._aggregate[t]
        if topo.cyclic[t]:
            gen = max(self.edge_gen.get((s, t), -1) + 1, frontier.get(t, 0) if frontier else 0)
            self.edge_gen[(s, t)] = gen
        else:
            gen = 0
        # With a decision parked behind a running attempt (E7), a newer trigger of a
        # plain node replaces it; an aggregate collects for the activation after it.
        floor = ns.fired - 1 if ns.pending is not None and not aggregate else ns.fired
        if gen < floor:
            self._late(t, s, gen, "fired")
            return
        limit = topo.max_visits[t]
        if limit is not None and ns.fired >= limit and (aggregate or ns.pending is None):
            self._late(t, s, ns.fired, "max_visits")
            return
        if aggregate:
            self._collect(s, t, value, frontier)
        elif ns.pending is not None:
            ns.pending = (value, _own_frontier(topo, t, frontier, ns.fired))
        else:
            self._fire(t, value, frontier)

    def _collect(self, s: int, t: int, value: Any, frontier: dict[int, int] | None) -> None:
        ns = self.nodes[t]
        if ns.inputs is None:
            ns.inputs = {}
        if s in ns.inputs:
            self._late(t, s, ns.fired, "duplicate")
            return
        self.seq += 1
        ns.inputs[s] = (self.seq, value, frontier)
        self.dirty[t] = None
        if len(ns.inputs) >= self.topo.required[t]:
            self._decide_first_k(t)

    def _decide_first_k(self, t: int) -> None:
        """Fire aggregate ``t`` if its open activation reached quorum (E4)."""
        ns = self.nodes[t]
        if ns.inputs is None or len(ns.inputs) < self.topo.required[t] or ns.pending is not None:
            return
        sources = first_k_sources(ns.inputs, self.topo.required[t])
        winners = [ns.inputs[s] for s in sources]
        payload = [value for _, value, _ in winners]
        merged: dict[int, int] | None = None
        for _, _, f in winners:
            merged = _merge(merged, f)
        ns.inputs = None
        self.frozen.append((t, ns.fired + 1, payload, sources))  # 1-based, like visits
        self._fire(t, payload, merged)

    def _fire(self, t: int, payload: Any, frontier: dict[int, int] | None) -> None:
        ns = self.nodes[t]
        ns.fired += 1
        own = _own_frontier(self.topo, t, frontier, ns.fired) if self.topo.cyclic[t] else None
        self.dirty[t] = None
        status = ns.status
        if status is _QUEUED or status is _RUNNING or status is _WAITING:
            ns.pending = (payload, own)  # E7: wait for the previous attempt to finish
            return
        self._begin(t, payload, own)

    def _begin(self, t: int, payload: Any, frontier: dict[int, int] | None) -> None:
        ns = self.nodes[t]
        if ns.status is _PENDING:
            ns.status = _QUEUED
        else:
            ns.move(_QUEUED, self.topo.ids[t])
        ns.visits += 1
        ns.payload = payload
        ns.frontier = frontier
        ns.attempts = 0
        ns.retry_due = None
        self.dirty[t] = None
        self.ready.append(t)

    def _late(self, t: int, s: int, gen: int, reason: str) -> None:
        ids = self.topo.ids
        self.late.append(
            LateInput(node_id=ids[t], source_id=ids[s], activation=gen + 1, reason=reason)
        )

    # -- queries ----------------------------------------------------------

    def waiting_aggregates(self) -> list[str]:
        """Aggregates holding some but not all inputs of an open activation (E10)."""
        out = []
        for i, ns in enumerate(self.nodes):
            if ns.inputs:
                have = [self.topo.ids[s] for s in sorted(ns.inputs)]
                need = self.topo.required[i]
                out.append(f"{self.topo.ids[i]!r} has {have} but requires {need}")
        return out

    def take_dirty(self) -> list[int]:
        """Indices of nodes changed since the last call, in definition order."""
        dirty = sorted(self.dirty)
        self.dirty.clear()
        return dirty


def first_k_winners(
    inputs: dict[int, tuple[int, Any, dict[int, int] | None]], k: int
) -> list[tuple[int, Any, dict[int, int] | None]]:
    """The ``k`` earliest-completing inputs, listed in definition order of their sources (E4).

    ``inputs`` maps a source's definition index to (completion seq, value, frontier).

    >>> first_k_winners({0: (3, "A", None), 1: (4, "B", None), 2: (1, "C", None)}, 2)
    [(3, 'A', None), (1, 'C', None)]
    """
    return [inputs[s] for s in first_k_sources(inputs, k)]


def first_k_sources(
    inputs: dict[int, tuple[int, Any, dict[int, int] | None]], k: int
) -> tuple[int, ...]:
    """The sources of :func:`first_k_winners`: the ``k`` earliest to complete, in definition order.

    >>> first_k_sources({0: (3, "A", None), 1: (4, "B", None), 2: (1, "C", None)}, 2)
    (0, 2)
    """
    return tuple(sorted(sorted(inputs, key=lambda s: inputs[s][0])[:k]))


def switch_edges(topo: Topology, i: int, route: Any) -> list[OutEdge]:
    """The edges a switch takes for ``route`` (E8): all matching, else ``exit``, else an error."""
    node_id = topo.ids[i]
    if not isinstance(route, str):
        raise RouteError(f"switch {node_id!r} returned {route!r}, not a route string")
    edges = topo.out_edges[i]
    taken = [e for e in edges if e.route == route]
    if not taken:
        taken = [e for e in edges if e.route == EXIT]
    if not taken:
        routes = sorted({str(e.route) for e in edges})
        raise RouteError(f"switch {node_id!r} returned route {route!r}; its routes are {routes}")
    return taken


def apply_patch(value: Any, patch: Any) -> Any:
    """``value`` after ``patch``: None keeps it, a mapping updates a dict, a callable maps it.

    >>> apply_patch({"turn": 2, "head": 1}, {"head": 3})
    {'turn': 2, 'head': 3}
    """
    if patch is None:
        return value
    if callable(patch):
        return patch(value)
    if isinstance(value, dict):
        return {**value, **patch}
    raise TypeError(f"cannot patch a {type(value).__name__} with a mapping; pass a function")


def _merge(a: dict[int, int] | None, b: dict[int, int] | None) -> dict[int, int] | None:
    if a is None:
        return b
    if b is None:
        return a
    merged = dict(a)
    for k, v in b.items():
        if v > merged.get(k, 0):
            merged[k] = v
    return merged


def _own_frontier(
    topo: Topology, t: int, frontier: dict[int, int] | None, fired: int
) -> dict[int, int] | None:
    """The frontier of a new activation of ``t``: its inputs' history within its loop, plus itself."""
    if not topo.cyclic[t]:
        return None
    comp = topo.scc[t]
    own = {k: v for k, v in frontier.items() if topo.scc[k] == comp} if frontier else {}
    own[t] = fired
    return own
