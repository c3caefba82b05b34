"""Pure topology of a graph: SCC edge classification (G2), entries, fan-in maps.

Everything here is computed once per graph in O(V+E) and indexed by the
node's definition position, so the run loop works on small ints and lists
rather than on hashed strings (which keeps E2 ordering independent of
``PYTHONHASHSEED``).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import textwrap
import tokenize
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import CodeType
from typing import TYPE_CHECKING, Any

from .._errors import GraphError
from ._node import NodeKind
from ._references import callable_reference, is_async_callable

if TYPE_CHECKING:
    from ._graph import Graph
    from ._node import Node


def strongly_connected_components(n: int, succ: Sequence[Sequence[int]]) -> list[int]:
    """Tarjan's algorithm, iterative; returns the component id of each vertex.

    >>> strongly_connected_components(3, [[1], [0], []])
    [0, 0, 1]
    """
    index = [-1] * n
    low = [0] * n
    on_stack = [False] * n
    comp = [-1] * n
    stack: list[int] = []
    counter = 0
    n_comp = 0
    for root in range(n):
        if index[root] != -1:
            continue
        work: list[tuple[int, int]] = [(root, 0)]
        while work:
            v, i = work[-1]
            if i == 0:
                index[v] = low[v] = counter
                counter += 1
                stack.append(v)
                on_stack[v] = True
            if i < len(succ[v]):
                work[-1] = (v, i + 1)
                w = succ[v][i]
                if index[w] == -1:
                    work.append((w, 0))
                elif on_stack[w]:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
            if low[v] == index[v]:
                while True:
                    w = stack.pop()
                    on_stack[w] = False
                    comp[w] = n_comp
                    if w == v:
                        break
                n_comp += 1
    return comp


@dataclass(frozen=True, slots=True)
class OutEdge:
    """An edge as the run loop sees it: target index, route, whether it is in-loop."""

    target: int
    route: str | None
    in_loop: bool


@dataclass(frozen=True, slots=True)
class Topology:
    """Validated, index-based view of a :class:`~tailrace.Graph` (G1, G2)."""

    graph: Graph
    ids: tuple[str, ...]
    index: dict[str, int]
    nodes: tuple[Node, ...]
    out_edges: tuple[tuple[OutEdge, ...], ...]
    in_sources: tuple[tuple[int, ...], ...]
    scc: tuple[int, ...]
    cyclic: tuple[bool, ...]
    required: tuple[int, ...]
    max_visits: tuple[int | None, ...]
    entries: tuple[int, ...]
    sinks: tuple[int, ...]
    is_async: tuple[bool, ...]
    has_gates: bool
    #: Gates, parking or parked items: the run needs a store, if only one in memory.
    needs_ledger: bool
    #: :func:`graph_shape` as compact JSON: what :attr:`fingerprint` hashes and a store keeps.
    shape_json: str
    fingerprint: str

    @classmethod
    def build(cls, graph: Graph) -> Topology:
        """Validate ``graph`` (G1) and classify its edges (G2)."""
        nodes = tuple(graph.nodes.values())
        ids = tuple(node.id for node in nodes)
        index = {node_id: i for i, node_id in enumerate(ids)}
        n = len(ids)
        succ: list[list[int]] = [[] for _ in range(n)]
        for edge in graph.edges:
            succ[index[edge.source]].append(index[edge.target])
        scc = strongly_connected_components(n, succ)
        self_loop = [False] * n
        comp_size: dict[int, int] = {}
        for c in scc:
            comp_size[c] = comp_size.get(c, 0) + 1
        out: list[list[OutEdge]] = [[] for _ in range(n)]
        in_sources: list[list[int]] = [[] for _ in range(n)]
        forward_in: list[int] = [0] * n
        outside_in: list[int] = [0] * n
        for edge in graph.edges:
            s, t = index[edge.source], index[edge.target]
            in_loop = scc[s] == scc[t]
            self_loop[s] = self_loop[s] or s == t
            out[s].append(OutEdge(t, edge.route, in_loop))
            in_sources[t].append(s)
            forward_in[t] += not in_loop
            outside_in[t] += s != t
        cyclic = tuple(comp_size[scc[i]] > 1 or self_loop[i] for i in range(n))
        required = _check_fan_in(nodes, in_sources, forward_in)
        entries = _entries(ids, scc, in_sources, outside_in)
        _check_switches(nodes, out)
        max_visits = tuple(
            node.max_visits if node.max_visits is not None else (None if cyclic[i] else 1)
            for i, node in enumerate(nodes)
        )
        shape = json.dumps(graph_shape(graph), separators=(",", ":"))
        return cls(
            graph=graph,
            ids=ids,
            index=index,
            nodes=nodes,
            out_edges=tuple(tuple(o) for o in out),
            in_sources=tuple(tuple(sorted(s)) for s in in_sources),
            scc=tuple(scc),
            cyclic=cyclic,
            required=required,
            max_visits=max_visits,
            entries=entries,
            sinks=tuple(i for i in range(n) if not out[i]),
            is_async=tuple(is_async_callable(node.handler) for node in nodes),
            has_gates=any(node.kind is NodeKind.GATE for node in nodes),
            needs_ledger=any(
                node.kind is NodeKind.GATE or node.late == "park" or node.resume_parked
                for node in nodes
            ),
            shape_json=shape,
            fingerprint=hashlib.sha256(shape.encode()).hexdigest()[:16],
        )

    def in_loop(self, source: str, target: str) -> bool:
        """Whether the edge ``source -> target`` lies inside a loop (G2)."""
        s, t = self.index[source], self.index[target]
        return any(o.target == t and o.in_loop for o in self.out_edges[s])


def _check_fan_in(
    nodes: Sequence[Node], in_sources: Sequence[Sequence[int]], forward_in: Sequence[int]
) -> tuple[int, ...]:
    required: list[int] = []
    for i, node in enumerate(nodes):
        fan_in = len(in_sources[i])
        if node.kind is NodeKind.AGGREGATE:
            _check_parked_inputs(nodes, node, in_sources[i])
            k = node.required if isinstance(node.required, int) else fan_in
            if not 1 <= k <= fan_in:
                raise GraphError(
                    f"aggregate {node.id!r}: required={k} is outside 1..{fan_in} (its fan-in)"
                )
            required.append(k)
            continue
        if forward_in[i] > 1 and not node.any_of:
            raise GraphError(
                f"node {node.id!r} has {forward_in[i]} incoming edges but is neither an "
                "aggregate nor any_of=True"
            )
        required.append(1)
    return tuple(required)


def _check_parked_inputs(nodes: Sequence[Node], node: Node, sources: Sequence[int]) -> None:
    """An aggregate that parks its late inputs (P3) parks each as one item of its source
    node; a map's stragglers are its items, so a map input is refused rather than parked
    as one list."""
    if node.late != "park":
        return
    for s in sources:
        if nodes[s].kind is NodeKind.MAP:
            raise GraphError(
                f"aggregate {node.id!r}: late='park' cannot park map {nodes[s].id!r} as one "
                f"item; give the map late='park' and required= to park its late items one by one"
            )


def _entries(
    ids: Sequence[str],
    scc: Sequence[int],
    in_sources: Sequence[Sequence[int]],
    outside_in: Sequence[int],
) -> tuple[int, ...]:
    if not ids:
        raise GraphError("graph has no nodes, hence no entry node")
    entries = tuple(i for i in range(len(ids)) if outside_in[i] == 0)
    if not entries:
        raise GraphError("graph has no entry node (every node has an incoming edge)")
    # A loop nothing leads into would never run: name it.
    fed: set[int] = set()
    for t, sources in enumerate(in_sources):
        for s in sources:
            if scc[s] != scc[t]:
                fed.add(scc[t])
    fed.update(scc[i] for i in entries)
    for i in range(len(ids)):
        if scc[i] not in fed:
            members = [ids[j] for j in range(len(ids)) if scc[j] == scc[i]]
            raise GraphError(f"loop {members!r} has no entry node and no edge into it")
    return entries


def _check_switches(nodes: Sequence[Node], out: Sequence[Sequence[OutEdge]]) -> None:
    for i, node in enumerate(nodes):
        if node.kind is NodeKind.SWITCH and not out[i]:
            raise GraphError(f"switch {node.id!r} has no outgoing edges")


def graph_shape(graph: Graph) -> dict[str, list[list[object]]]:
    """The structure a graph's fingerprint is taken over, as JSON-ready lists.

    ``nodes`` holds ``[id, kind, required, max_visits, any_of]`` per node, and
    a node that runs a child run (R1) adds ``[child graph's name, its
    fingerprint]``; ``edges`` holds ``[source, target, route]`` per edge, in
    definition order. A callable ``required`` is ``[its reference, a digest
    of its code]`` (see :func:`code_digest`). A store keeps the structure with
    a graph's runs, so a changed graph can be checked against what a run did
    without the old code (V1).
    """
    return {
        "nodes": [_node_shape(n) for n in graph.nodes.values()],
        "edges": [[e.source, e.target, e.route] for e in graph.edges],
    }


def shape_json(graph: Graph) -> str:
    """:func:`graph_shape` as compact JSON: the text a fingerprint hashes and a store keeps."""
    return str(graph.compile().shape_json)


def _node_shape(node: Node) -> list[object]:
    shape = [node.id, node.kind.value, _quorum_shape(node), node.max_visits, node.any_of]
    if node.child:  # compiled before its parent (G1), so its fingerprint is at hand
        child: Any = node.handler
        shape.append([child.name, child.compile().fingerprint])
    return shape


def _quorum_shape(node: Node) -> object:
    """A node's ``required`` as the fingerprint sees it: a count, or a map's function by name
    and code (two lambdas share a name, not what they compute)."""
    required = node.required
    if not callable(required):
        return required
    return [callable_reference(required, node.id), code_digest(required)]


def code_digest(fn: Callable[..., Any]) -> str | None:
    """A digest of what the function ``fn`` computes; None for one with no Python code.

    It hashes the source lines that define ``fn`` (dedented), so every process
    of one deploy agrees on it, whatever its Python version, and the plain
    values (numbers, strings, None) it closes over or has as defaults, so a
    factory's functions differ by what they were made with. Code whose source
    is not at hand (``exec``, a REPL) is hashed by its code object instead.
    """
    code = getattr(fn, "__code__", None)
    if not isinstance(code, CodeType):
        return None
    try:
        text = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError, SyntaxError, tokenize.TokenError):  # no source, or unreadable
        text = _code_text(code)
    cells = [_contents(cell) for cell in getattr(fn, "__closure__", None) or ()]
    values = [*cells, *(getattr(fn, "__defaults__", None) or ())]
    keywords = sorted((getattr(fn, "__kwdefaults__", None) or {}).items())
    parts = [text, *map(_plain, values), *(f"{k}={_plain(v)}" for k, v in keywords)]
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:16]


def _contents(cell: Any) -> object:
    try:
        return cell.cell_contents
    except ValueError:  # a cell not filled yet
        return None


def _code_text(code: CodeType) -> str:
    """A code object as text: its bytecode, names and constants, nested code included (a set's
    members sorted, so the text does not depend on the hash seed)."""
    consts = [
        _code_text(c)
        if isinstance(c, CodeType)
        else repr(sorted(map(repr, c)))
        if isinstance(c, frozenset)
        else repr(c)
        for c in code.co_consts
    ]
    return f"{code.co_code.hex()}|{code.co_names}|{consts}"


def _plain(value: object) -> str:
    """A value's text when it reads the same in every process; else only its type's name."""
    if value is None or isinstance(value, bool | int | float | str):
        return repr(value)
    return type(value).__qualname__
