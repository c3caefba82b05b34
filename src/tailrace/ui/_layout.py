"""A run's graph as a picture: its shape (full, or what the store shows) and a layered layout.

The store keeps a run's graph as a reference, a fingerprint and, with its
``run_started`` event, the graph's structure (``Graph.structure``: nodes and
edges, no code). The shape comes from one of three places:

- :func:`shape_of_graph`: the graph itself, registered with ``--graphs`` or
  imported by its module reference (never a stored file reference: trust
  model), with every node and edge;
- :func:`shape_from_store` with a stored structure: every node and edge as
  the run stored them when it started (a LangGraph thread's driver stores
  its graph's the same way), plus any node the records name that it lacks;
- :func:`shape_from_store` without one (runs stored before the structure
  was): what the node rows and events show: every node that ran or was
  reached, and the edges the run's decisions name (an aggregate's sources,
  late inputs, stored inputs). Edges between plain tasks are not stored
  there, so this shape can be partial; it says so.

:func:`layout` places nodes left to right in layers (longest path over the
edges that are not back edges of a depth-first walk in definition order, E2)
and orders each layer by the mean position of its predecessors. A node whose
handler is a graph (a child run, R1) carries the child graph's name and queue
(``Graph.structure``'s ``children``), drawn framed. Pure: no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from .._attempts import event_data
from ..graph import Graph
from ..stores import EventRow, NodeRow
from ._format import shorten

NODE_H = 46
H_GAP = 56
V_GAP = 22
MARGIN = 16
LABEL_CHARS = 22


@dataclass(frozen=True, slots=True, kw_only=True)
class ShapeNode:
    """A node of the drawn shape: its id and kind (``task``, ``gate``, ...; ``?`` if unknown)."""

    id: str
    kind: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ShapeEdge:
    """A directed edge of the drawn shape; ``route`` labels a switch's edge."""

    source: str
    target: str
    route: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ChildGraph:
    """What a node that runs a child run runs (R1): the child graph's name, and its queue."""

    graph: str
    queue: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Shape:
    """Nodes in definition order and edges; ``complete`` when it is the whole graph.

    ``children`` names, for each node whose handler is a graph, the graph it
    runs as a child run and the queue it submits it to (``Graph.structure``'s
    ``children``).
    """

    nodes: tuple[ShapeNode, ...]
    edges: tuple[ShapeEdge, ...]
    complete: bool
    children: Mapping[str, ChildGraph] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class PlacedNode:
    """A node with its box (SVG user units), its status and visits from the store."""

    id: str
    label: str
    kind: str
    status: str
    visits: int
    meta: str
    x: float
    y: float
    w: float
    h: float
    #: The graph this node runs as a child run, and where, if it does (R1).
    child: ChildGraph | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class PlacedEdge:
    """An edge as an SVG path; ``back`` for an edge that closes a loop (E7)."""

    source: str
    target: str
    path: str
    back: bool
    label: str | None
    label_x: float
    label_y: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Drawing:
    """A laid-out shape, ready for the template to draw."""

    width: float
    height: float
    nodes: tuple[PlacedNode, ...]
    edges: tuple[PlacedEdge, ...]
    complete: bool


def shape_of_graph(graph: Graph) -> Shape:
    """The whole shape of ``graph``: every node (definition order) and edge."""
    nodes = tuple(ShapeNode(id=n.id, kind=n.kind.value) for n in graph.nodes.values())
    edges = tuple(ShapeEdge(source=e.source, target=e.target, route=e.route) for e in graph.edges)
    children = _children(graph.structure().get("children"), {n.id for n in nodes})
    return Shape(nodes=nodes, edges=edges, complete=True, children=children)


def shape_from_store(rows: Mapping[str, NodeRow], events: Sequence[EventRow]) -> Shape:
    """What the store shows of a run's graph: its stored structure, else what its records name.

    Args:
        rows: the run's node rows (``StoredRun.nodes``).
        events: the run's events.
    """
    stored = stored_structure(events)
    if stored is not None:
        known = {n.id for n in stored.nodes}
        named = [n for n in _shape_from_records(rows, events).nodes if n.id not in known]
        return Shape(
            nodes=stored.nodes + tuple(named), edges=stored.edges, complete=True,
            children=stored.children,
        )  # fmt: skip
    return _shape_from_records(rows, events)


def stored_structure(events: Sequence[EventRow]) -> Shape | None:
    """The structure the run stored with its first ``run_started`` event, if it did and it reads.

    A structure that does not read as ``Graph.structure`` writes it (ids and
    kinds strings, edges between its nodes) is not drawn at all: the page
    falls back to what the records name rather than draw a wrong graph.
    """
    started = next((e for e in events if e.type == "run_started"), None)
    raw = event_data(started).get("structure") if started is not None else None
    if not isinstance(raw, dict):
        return None
    nodes, edges = raw.get("nodes"), raw.get("edges")
    if not isinstance(nodes, list) or not isinstance(edges, list):
        return None
    shaped = [ShapeNode(id=n[0], kind=n[1]) for n in nodes if _pair_of_text(n)]
    ids = {n.id for n in shaped}
    if len(shaped) != len(nodes) or len(ids) != len(shaped):
        return None
    lines = [ShapeEdge(source=e[0], target=e[1], route=e[2]) for e in edges if _stored_edge(e, ids)]
    if len(lines) != len(edges):
        return None
    children = _children(raw.get("children"), ids)
    return Shape(nodes=tuple(shaped), edges=tuple(lines), complete=True, children=children)


def _children(raw: object, ids: set[str]) -> dict[str, ChildGraph]:
    """The child graphs a structure names, by node; entries that do not read are left out."""
    if not isinstance(raw, dict):
        return {}
    found = {}
    for node_id, entry in raw.items():
        if node_id not in ids or not isinstance(entry, dict):
            continue
        graph, queue = entry.get("graph"), entry.get("queue")
        if isinstance(graph, str) and (queue is None or isinstance(queue, str)):
            found[node_id] = ChildGraph(graph=graph, queue=queue)
    return found


def _pair_of_text(raw: object) -> bool:
    return isinstance(raw, list) and len(raw) == 2 and all(isinstance(x, str) for x in raw)


def _stored_edge(raw: object, ids: set[str]) -> bool:
    return (
        isinstance(raw, list)
        and len(raw) == 3
        and raw[0] in ids
        and raw[1] in ids
        and (raw[2] is None or isinstance(raw[2], str))
    )


def nodes_from_events(events: Sequence[EventRow]) -> dict[str, NodeRow]:
    """Node rows as a run's events show them, for runs that store events but no node rows.

    A LangGraph thread's driver stores what each step did as events only:
    each node's status is what its last event says, its visits the highest
    visit an event names.
    """
    rows: dict[str, NodeRow] = {}
    for e in events:
        status = _EVENT_STATUS.get(e.type)
        if e.node_id is None or status is None:
            continue
        before = rows.get(e.node_id)
        visits = max(e.visit or 0, before.visits if before is not None else 0)
        rows[e.node_id] = NodeRow(node_id=e.node_id, status=status, visits=visits, data_json="{}")
    return rows


#: What a node's last event says of it (``nodes_from_events``).
_EVENT_STATUS = {
    "node_started": "running",
    "node_completed": "completed",
    "node_failed": "failed",
    "node_cancelled": "cancelled",
    "question_opened": "waiting",
    "question_answered": "running",
}


def _shape_from_records(rows: Mapping[str, NodeRow], events: Sequence[EventRow]) -> Shape:
    """Nodes in the order they first started, and the edges the run's decisions name."""
    order: dict[str, None] = {}
    kinds: dict[str, str] = {}
    for e in events:
        if e.node_id is not None and e.type in ("node_started", "question_opened"):
            order.setdefault(e.node_id, None)
        if e.node_id is not None and e.type == "question_opened":
            kinds[e.node_id] = "gate"
        if e.node_id is not None and e.type == "aggregate_fired":
            kinds[e.node_id] = "aggregate"
    for node_id in rows:
        order.setdefault(node_id, None)
    edges = dict.fromkeys(_stored_edges(rows, events))
    for source, target in edges:
        order.setdefault(source, None)
        order.setdefault(target, None)
    nodes = tuple(ShapeNode(id=n, kind=kinds.get(n, "?")) for n in order)
    return Shape(
        nodes=nodes,
        edges=tuple(ShapeEdge(source=s, target=t) for s, t in edges),
        complete=False,
    )


def _stored_edges(
    rows: Mapping[str, NodeRow], events: Sequence[EventRow]
) -> Iterable[tuple[str, str]]:
    """Edges the run's records name: aggregate sources, late inputs, stored inputs."""
    for e in events:
        if e.node_id is None:
            continue
        data = event_data(e)
        if e.type == "aggregate_fired" and isinstance(data.get("sources"), list):
            yield from ((str(s), e.node_id) for s in data["sources"])
        elif e.type == "node_late_input" and data.get("source") is not None:
            yield (str(data["source"]), e.node_id)
    for node_id, row in rows.items():
        try:
            data = json.loads(row.data_json)
        except ValueError:
            continue
        inputs = data.get("inputs") if isinstance(data, dict) else None
        for entry in inputs if isinstance(inputs, list) else ():
            if isinstance(entry, list) and entry and isinstance(entry[0], str):
                yield (entry[0], node_id)


def layout(shape: Shape, rows: Mapping[str, NodeRow]) -> Drawing:
    """Place ``shape`` left to right; each node shows its status and visits from ``rows``."""
    ids = [n.id for n in shape.nodes]
    kinds = {n.id: n.kind for n in shape.nodes}
    edges = [e for e in shape.edges if e.source in kinds and e.target in kinds]
    back = _back_edges(ids, edges)
    layers = _layers(ids, [e for e in edges if (e.source, e.target) not in back])
    columns = _columns(ids, layers, edges, back)
    metas = {i: node_meta(kinds[i], rows.get(i), shape.children.get(i)) for i in ids}
    widths = [max(_box_width(i, metas[i]) for i in column) for column in columns]
    tallest = max((len(c) for c in columns), default=0)
    box: dict[str, tuple[float, float, float]] = {}
    placed: list[PlacedNode] = []
    x = float(MARGIN)
    for column, width in zip(columns, widths, strict=True):
        offset = (tallest - len(column)) * (NODE_H + V_GAP) / 2
        for pos, node_id in enumerate(column):
            y = MARGIN + offset + pos * (NODE_H + V_GAP)
            box[node_id] = (x, y, width)
            row = rows.get(node_id)
            placed.append(
                PlacedNode(
                    id=node_id, label=shorten(node_id, LABEL_CHARS), kind=kinds[node_id],
                    status=row.status if row is not None else "not-reached",
                    visits=row.visits if row is not None else 0, meta=metas[node_id],
                    x=x, y=y, w=width, h=NODE_H, child=shape.children.get(node_id),
                )
            )  # fmt: skip
        x += width + H_GAP
    loops_below = MARGIN + tallest * (NODE_H + V_GAP)
    drawn = [_edge(e, box, (e.source, e.target) in back, loops_below) for e in edges]
    return Drawing(
        width=x - H_GAP + MARGIN if columns else 2 * MARGIN,
        height=loops_below + MARGIN - V_GAP + (34 if back else 0) if columns else 2 * MARGIN,
        nodes=tuple(placed),
        edges=tuple(drawn),
        complete=shape.complete,
    )


def node_meta(kind: str, row: NodeRow | None, child: ChildGraph | None = None) -> str:
    """The line under a node's name: its status, its kind unless a task, its visits if
    several, and the graph it runs as a child run (``⤷ graph@queue``)."""
    parts = [row.status if row is not None else "not reached"]
    if kind not in ("task", "?"):
        parts.append(kind)
    if row is not None and row.visits > 1:
        parts.append(f"{row.visits} visits")
    if child is not None:
        where = "" if child.queue is None else f"@{shorten(child.queue, 16)}"
        parts.append(f"⤷ {shorten(child.graph, 18)}{where}")
    return " · ".join(parts)


def _box_width(node_id: str, meta: str) -> float:
    """Wide enough for the name (13 px monospace) and the line under it (11 px)."""
    chars = max(len(shorten(node_id, LABEL_CHARS)) * 8.0, len(meta) * 6.2)
    return min(max(chars + 30, 92.0), 240.0)


def _back_edges(ids: list[str], edges: list[ShapeEdge]) -> set[tuple[str, str]]:
    """Edges that close a cycle in a depth-first walk taken in definition order."""
    succ: dict[str, list[str]] = {i: [] for i in ids}
    for e in edges:
        succ[e.source].append(e.target)
    state: dict[str, int] = {}  # 1: on the stack, 2: finished
    back: set[tuple[str, str]] = set()
    for root in ids:
        if root in state:
            continue
        stack = [(root, iter(succ[root]))]
        state[root] = 1
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                state[node] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                back.add((node, nxt))
            elif nxt not in state:
                state[nxt] = 1
                stack.append((nxt, iter(succ[nxt])))
    return back


def _layers(ids: list[str], forward: list[ShapeEdge]) -> dict[str, int]:
    """Longest-path layer of each node over the acyclic ``forward`` edges."""
    preds: dict[str, list[str]] = {i: [] for i in ids}
    for e in forward:
        preds[e.target].append(e.source)
    layer: dict[str, int] = {}

    def depth(node: str) -> int:
        pending = [node]
        while pending:
            top = pending[-1]
            missing = [p for p in preds[top] if p not in layer]
            if missing:
                pending.extend(missing)
                continue
            pending.pop()
            layer[top] = max((layer[p] + 1 for p in preds[top]), default=0)
        return layer[node]

    for node_id in ids:
        depth(node_id)
    return layer


def _columns(
    ids: list[str], layers: dict[str, int], edges: list[ShapeEdge], back: set[tuple[str, str]]
) -> list[list[str]]:
    """Nodes per layer, ordered by the mean position of their predecessors (ties: definition)."""
    count = max(layers.values(), default=-1) + 1
    columns: list[list[str]] = [[] for _ in range(count)]
    for node_id in ids:  # definition order first (E2)
        columns[layers[node_id]].append(node_id)
    preds: dict[str, list[str]] = {i: [] for i in ids}
    for e in edges:
        if (e.source, e.target) not in back and e.source != e.target:
            preds[e.target].append(e.source)
    position = {n: p for column in columns for p, n in enumerate(column)}
    for column in columns[1:]:
        column.sort(
            key=lambda n: (
                sum(position[p] for p in preds[n]) / len(preds[n]) if preds[n] else position[n]
            )
        )
        position.update({n: p for p, n in enumerate(column)})
    return columns


def _edge(
    e: ShapeEdge, box: dict[str, tuple[float, float, float]], back: bool, below: float
) -> PlacedEdge:
    (x1, y1, w1), (x2, y2, w2) = box[e.source], box[e.target]
    if e.source == e.target:  # a self-loop over the node's top right corner
        sx, sy = x1 + w1 - 18, y1
        path = f"M{sx:.1f},{sy:.1f} C{sx + 10:.1f},{sy - 30:.1f} {sx + 40:.1f},{sy - 8:.1f} {x1 + w1:.1f},{y1 + 10:.1f}"
        return PlacedEdge(
            source=e.source, target=e.target, path=path, back=True, label=e.route,
            label_x=sx + 24, label_y=sy - 20,
        )  # fmt: skip
    if back:  # a loop back: leave below the source, come back in below the target
        sx, sy = x1 + w1 / 2, y1 + NODE_H
        tx, ty = x2 + w2 / 2, y2 + NODE_H
        low = below + 6
        path = f"M{sx:.1f},{sy:.1f} C{sx:.1f},{low:.1f} {tx:.1f},{low:.1f} {tx:.1f},{ty + 2:.1f}"
        return PlacedEdge(
            source=e.source, target=e.target, path=path, back=True, label=e.route,
            label_x=(sx + tx) / 2, label_y=low - 4,
        )  # fmt: skip
    sx, sy = x1 + w1, y1 + NODE_H / 2
    tx, ty = x2 - 2, y2 + NODE_H / 2
    bend = max((tx - sx) / 2, 24)
    path = (
        f"M{sx:.1f},{sy:.1f} C{sx + bend:.1f},{sy:.1f} {tx - bend:.1f},{ty:.1f} {tx:.1f},{ty:.1f}"
    )
    return PlacedEdge(
        source=e.source, target=e.target, path=path, back=False, label=e.route,
        label_x=(sx + tx) / 2, label_y=(sy + ty) / 2 - 5,
    )  # fmt: skip
