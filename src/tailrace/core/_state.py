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

from .._context import Checkpoint
from .._errors import GraphError, MapError, RouteError
from ..graph import EXIT, MAX_ITEMS, Node, NodeKind, OutEdge, Topology
from ..stores import ParkedRow


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


@dataclass(frozen=True, slots=True, kw_only=True, repr=False)
class LateInput:
    """An input that arrived for an activation that had already fired (E5), or past max_visits.

    ``activation`` is 1-based, like visits; ``reason`` is ``"fired"``,
    ``"max_visits"``, ``"duplicate"`` or ``"cancelled"``. A late *item* of a
    map (M5) has ``source_id`` = ``node_id`` = the map and its ``item`` index;
    ``item`` is None for an input of an aggregate.
    """

    node_id: str
    source_id: str
    activation: int
    reason: str
    item: int | None = None

    def __repr__(self) -> str:
        item = "" if self.item is None else f", item={self.item!r}"
        return (
            f"LateInput(node_id={self.node_id!r}, source_id={self.source_id!r}, "
            f"activation={self.activation!r}, reason={self.reason!r}{item})"
        )


class NodeState:
    """Mutable per-node state. ``inputs`` maps a source index to (seq, value, frontier)."""

    __slots__ = (
        "attempts",
        "fired",
        "frontier",
        "has_result",
        "inputs",
        "items",
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
        #: A map node's items of its current visit, once expanded (M1).
        self.items: MapItems | None = None

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
        "checkpoints",
        "dirty",
        "dirty_items",
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
        #: Map visits with items touched since the last ``take_dirty_items``.
        self.dirty_items: dict[MapItems, None] = {}
        #: Checkpoints the store held when the run was restored (P2), by
        #: (node id, visit, item or -1).
        self.checkpoints: dict[tuple[str, int, int], Checkpoint] = {}
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
        ns.items = None  # a map expands its new visit's items when it is dispatched
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

    # -- map items (M1-M6) --------------------------------------------------

    def expand(self, i: int, values: list[Any], k: int | None, now: float) -> MapItems:
        """Start map ``i``'s visit over ``values`` with quorum ``k`` (see :func:`map_plan`)."""
        self.start(i, now)
        ns = self.nodes[i]
        items = ns.items = MapItems(i, ns.visits, values, k)
        return items

    def item_succeeded(self, items: MapItems, j: int, value: Any) -> bool:
        """Item ``j`` of ``items`` returned ``value``; True if that decides the map (M3).

        An item that succeeds after the decision is late (M5): recorded with
        reason ``fired``, never in the output.
        """
        self.seq += 1
        self.dirty_items[items] = None
        if not items.succeed(j, value, self.seq):
            self._late_item(items, j, "fired")
            return False
        return items.decidable()

    def item_failed(self, items: MapItems, j: int, error: str) -> bool:
        """Item ``j`` failed for good; True if the map can be decided now (M4, errors="skip")."""
        items.fail(j, error)
        self.dirty_items[items] = None
        return items.winners is None and items.decidable()

    def item_cancelled(self, items: MapItems, j: int, *, parked: bool = False) -> None:
        """Item ``j``, still running or queued at the decision, is cancelled as late (M5), or
        parked (P3)."""
        items.cancel(j, parked=parked)
        self.dirty_items[items] = None
        self._late_item(items, j, "parked" if parked else "cancelled")

    def decide_map(self, items: MapItems) -> list[Any]:
        """Decide map ``items`` (M3) and complete its node with the output, routing it on.

        The output is the winners' results in item order. Returns it.
        """
        output = items.decide()
        self.dirty_items[items] = None
        i = items.node
        ns = self.nodes[i]
        if ns.items is items and ns.status is NodeStatus.RUNNING:
            self.complete(i, output)
        return output

    def _late_item(self, items: MapItems, j: int, reason: str) -> None:
        node_id = self.topo.ids[items.node]
        self.late.append(
            LateInput(
                node_id=node_id, source_id=node_id, activation=items.visit, reason=reason, item=j
            )
        )

    def take_dirty_items(self) -> list[MapItems]:
        """Map visits whose items changed since the last call."""
        dirty = list(self.dirty_items)
        self.dirty_items.clear()
        return dirty

    def ends_that_wake(self, waiting: dict[int, tuple[int, MapItems | None]]) -> int:
        """How many ends of the children awaited let the run move on (R4); ``waiting`` maps
        each node with attempts waiting on a child to (how many, its map visit's items).

        A map before its decision needs k minus its successes (of the items
        still waiting), after it every item still running. A task node's child
        lets the run move on when its result starts a node: a task successor
        at once, an aggregate only once it has its quorum, so children that
        all feed one join wake their parent once, at the last of them, not at
        each. A child whose result starts nothing moves the run on only when
        every child awaited has ended. The run wakes at the least of these, or
        at once when a child fails or is cancelled. Each figure is a bound from
        below (an input that comes late, E7, only makes the wake early), so a
        parent never sleeps past the end that lets it go on.
        """
        total = sum(count for count, _ in waiting.values())
        needed = [total]
        for i, (count, items) in waiting.items():
            if items is None:
                needed.append(self._child_unlocks(i, total))
            elif items.winners is not None:
                needed.append(count)
            else:
                k = len(items) if items.k is None else items.k
                needed.append(min(max(k - items.succeeded, 1), count))
        return max(min(needed), 1)

    def _child_unlocks(self, i: int, total: int) -> int:
        """The least number of children's ends after which node ``i``'s result starts a node."""
        topo, nodes = self.topo, self.nodes
        if nodes[i].pending is not None or topo.nodes[i].kind is not NodeKind.TASK:
            return 1  # its end starts its next visit (E7), or a route decides
        least = total
        for edge in topo.out_edges[i]:
            t = edge.target
            if topo.nodes[t].kind is not NodeKind.AGGREGATE:
                return 1
            inputs = nodes[t].inputs
            least = min(least, topo.required[t] - (len(inputs) if inputs else 0))
        return max(least, 1)

    def output(self) -> Any:
        """The run's output now: its one finished sink's result, or each finished sink's by id."""
        done = [i for i in self.topo.sinks if self.nodes[i].has_result]
        if len(done) == 1:
            return self.nodes[done[0]].result
        return {self.topo.ids[i]: self.nodes[i].result for i in done} or None


class ItemStatus(enum.StrEnum):
    """Lifecycle of one item of a map visit (M2-M5)."""

    PENDING = "pending"
    RUNNING = "running"
    COMPLETED = "completed"
    LATE = "late"
    FAILED = "failed"
    CANCELLED = "cancelled"
    PARKED = "parked"


#: Items that have not ended: they hold the map open (or run on, late).
OPEN_ITEMS = frozenset({ItemStatus.PENDING, ItemStatus.RUNNING})

_ITEM_PENDING, _ITEM_RUNNING = ItemStatus.PENDING, ItemStatus.RUNNING
_ITEM_COMPLETED, _ITEM_LATE = ItemStatus.COMPLETED, ItemStatus.LATE


class MapItems:
    """The items of one visit of a map node and the first-k decision over them (M1-M6).

    ``k`` is the quorum, or None for "every item that succeeds" (``errors="skip"``
    with no ``required``): the map is then decided once no item is open.
    ``seq`` holds each item's completion sequence (0: none), shared with the
    run's, so "the k earliest" is the run's own completion order (M3, M7).
    ``dirty`` lists the items whose stored row must be written.
    """

    __slots__ = (
        "attempts",
        "dirty",
        "errors",
        "failed",
        "k",
        "node",
        "open",
        "parked",
        "parks",
        "pinned",
        "results",
        "retry_due",
        "seq",
        "status",
        "succeeded",
        "texts",
        "values",
        "visit",
        "winners",
    )

    def __init__(self, node: int, visit: int, values: list[Any], k: int | None) -> None:
        n = len(values)
        self.node = node
        self.visit = visit
        self.values = values
        self.k = k
        self.status = [_ITEM_PENDING] * n
        self.seq = [0] * n
        self.results: list[Any] = [None] * n
        #: Each result's JSON once encoded (its stored row, and the output's text).
        self.texts: list[str | None] = [None] * n
        self.errors: dict[int, str] = {}
        self.attempts = [0] * n
        self.retry_due: dict[int, float] = {}
        self.succeeded = 0
        self.failed = 0
        self.open = n
        #: The items whose results make the output, in item order, once decided.
        self.winners: tuple[int, ...] | None = None
        self.dirty: dict[int, None] = {}
        #: The parked items this visit took first (P4): their ids, in item order.
        self.parked: list[str] = []
        #: Each of those: how often it was parked, and when first (P5).
        self.parks: list[tuple[int, float]] = []
        #: Items that run to completion: parked ``max_parks`` times (P5). The
        #: decision waits for them and they are among the winners.
        self.pinned: frozenset[int] = frozenset()

    def __len__(self) -> int:
        return len(self.values)

    def took_parked(self, rows: Sequence[ParkedRow], max_parks: int) -> None:
        """Its first items are the parked ``rows`` (P4), in order; those parked ``max_parks``
        times or more run to completion (P5)."""
        self.parked = [row.park_id for row in rows]
        self.parks = [(row.parks, row.parked_at) for row in rows]
        self.pinned = frozenset(j for j, row in enumerate(rows) if row.parks >= max_parks)

    def start(self, j: int) -> None:
        """Item ``j`` is admitted: its attempt starts now."""
        if self.status[j] is _ITEM_PENDING:
            self.status[j] = _ITEM_RUNNING
        if self.attempts[j] < 1:
            self.attempts[j] = 1

    def succeed(self, j: int, value: Any, seq: int) -> bool:
        """Record item ``j``'s result; False if it came after the decision (late)."""
        self.open -= 1
        self.results[j] = value
        self.seq[j] = seq
        self.dirty[j] = None
        self.retry_due.pop(j, None)
        if self.winners is not None:
            self.status[j] = _ITEM_LATE
            return False
        self.status[j] = _ITEM_COMPLETED
        self.succeeded += 1
        return True

    def fail(self, j: int, error: str) -> None:
        """Record item ``j``'s final error."""
        self.open -= 1
        self.status[j] = ItemStatus.FAILED
        self.errors[j] = error
        self.failed += 1
        self.dirty[j] = None
        self.retry_due.pop(j, None)

    def cancel(self, j: int, *, parked: bool = False) -> None:
        """Item ``j`` is cancelled as late (``late="cancel"``), or parked (``late="park"``)."""
        self.open -= 1
        self.status[j] = ItemStatus.PARKED if parked else ItemStatus.CANCELLED
        self.dirty[j] = None
        self.retry_due.pop(j, None)

    def restore_row(
        self,
        j: int,
        status: ItemStatus,
        *,
        seq: int,
        attempts: int,
        result: Any = None,
        text: str | None = None,
        error: str | None = None,
        retry_due: float | None = None,
    ) -> None:
        """Take back item ``j`` as its stored row left it (M6); a running item runs again."""
        self.attempts[j] = attempts
        if status is _ITEM_RUNNING:  # it was backing off between tries: it runs again
            if retry_due is not None:
                self.retry_due[j] = retry_due
            return
        self.status[j] = status
        self.seq[j] = seq
        self.open -= 1
        if status is _ITEM_COMPLETED or status is _ITEM_LATE:
            self.results[j] = result
            self.texts[j] = text
            self.succeeded += status is _ITEM_COMPLETED
        elif status is ItemStatus.FAILED:
            self.errors[j] = error or ""
            self.failed += 1

    def decidable(self) -> bool:
        """Whether the decision can be made: k successes and no pinned item open (P5), or
        (k None) nothing open."""
        if self.winners is not None:
            return False
        if self.k is None:
            return self.open == 0 and self.succeeded > 0
        if self.pinned and any(self.status[j] in OPEN_ITEMS for j in self.pinned):
            return False
        return self.succeeded >= self.k

    def hopeless(self) -> bool:
        """Whether fewer than k items can still succeed (M4): the map fails."""
        if self.winners is not None:
            return False
        if self.k is None:
            return self.open == 0 and self.succeeded == 0
        return self.succeeded + self.open < self.k

    def decide(self) -> list[Any]:
        """Freeze the winners: the k earliest to succeed, listed in item order (M3); pinned
        items that succeeded are among them, before the earliest others (P5)."""
        done = [j for j, st in enumerate(self.status) if st is _ITEM_COMPLETED]
        k = len(done) if self.k is None else self.k
        if len(done) > k:
            pinned = self.pinned
            done.sort(key=lambda j: (j not in pinned, self.seq[j]))
            done = sorted(done[: max(k, len(pinned.intersection(done)))])
        self.winners = tuple(done)
        return [self.results[j] for j in done]

    def output(self) -> list[Any]:
        """The decided output: the winners' results in item order."""
        assert self.winners is not None
        return [self.results[j] for j in self.winners]

    def unfinished(self) -> list[int]:
        """Items not ended yet (pending or running), in item order."""
        status = self.status
        return [j for j in range(len(status)) if status[j] in OPEN_ITEMS]

    def pending(self) -> list[int]:
        """Items not started yet, in item order."""
        status = self.status
        return [j for j in range(len(status)) if status[j] is _ITEM_PENDING]


def map_plan(node: Node, payload: Any) -> tuple[list[Any], int | None]:
    """The items of map ``node`` for ``payload`` and its quorum k (M1, M3), or :class:`MapError`.

    ``payload`` must be a list (a tuple in memory) of at most ``max_items``
    items; k comes from ``required`` (a count or a function of the count) and
    must lie in 1..count. k is None for ``errors="skip"`` without
    ``required``: every item that succeeds. An empty list has no k.

    >>> from tailrace.graph import Node, NodeKind
    >>> map_plan(Node(id="m", handler=print, kind=NodeKind.MAP, required=2), ["a", "b", "c"])
    (['a', 'b', 'c'], 2)
    """
    if not isinstance(payload, list | tuple):
        raise MapError(f"map {node.id!r}: its input must be a list, got {type(payload).__name__}")
    values = list(payload)
    return values, _quorum_of(node, len(values))


def _quorum_of(node: Node, count: int) -> int | None:
    """Map ``node``'s k for ``count`` items (M1, M3), or :class:`MapError`."""
    limit = node.max_items if node.max_items is not None else MAX_ITEMS
    if count > limit:
        raise MapError(f"map {node.id!r}: {count} items exceed its max_items={limit}")
    if not count:
        return 0
    if node.required is None and node.errors == "skip":
        return None
    try:
        k = node.quorum(count)
    except GraphError as exc:
        raise MapError(str(exc)) from None
    except Exception as exc:  # the user's function of the count raised
        raise MapError(
            f"map {node.id!r}: required({count}) raised {type(exc).__name__}: {exc}"
        ) from exc
    if not 1 <= k <= count:
        raise MapError(f"map {node.id!r}: required={k} is outside 1..{count} (its item count)")
    return k


def parked_room(node: Node, payload: Any) -> int:
    """How many parked items map ``node`` may claim before ``payload``'s own (P4): its
    ``max_items`` less its own items; none when its input is no list.

    >>> from tailrace.graph import Node, NodeKind
    >>> parked_room(Node(id="m", handler=print, kind=NodeKind.MAP, max_items=5), [1, 2])
    3
    """
    if not isinstance(payload, list | tuple):
        return 0
    limit = node.max_items if node.max_items is not None else MAX_ITEMS
    return max(0, limit - len(payload))


def parked_fit(node: Node, payload: Any, claimed: int) -> int:
    """How many of ``claimed`` parked items map ``node`` keeps before ``payload``'s own (P4):
    the most with which its plan holds (M1, M3), and none when no count of them does.

    >>> from tailrace.graph import Node, NodeKind
    >>> grows = Node(id="m", handler=print, kind=NodeKind.MAP, required=lambda n: max(3, n - 1))
    >>> parked_fit(grows, [1], 9)  # k=9 of 10 items holds
    9
    >>> parked_fit(Node(id="m", handler=print, kind=NodeKind.MAP, max_items=4), [1], 9)
    3
    """
    if not isinstance(payload, list | tuple):
        return 0
    own = len(payload)
    for n in range(min(claimed, parked_room(node, payload)), 0, -1):
        try:
            _quorum_of(node, own + n)
        except MapError:
            continue
        return n
    return 0


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
