"""Graph definition: nodes, edges, builders, validation (G1) and JSON form (G3).

>>> g = Graph("hello")
>>> @g.task()
... def greet(name):
...     return f"hello {name}"
>>> g.to_dict()["nodes"][0]["id"]
'greet'
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .._errors import GraphError
from ._checks import _json_copy
from ._codec import GRAPH_FORMAT, graph_from_dict
from ._node import (
    MAX_PARKS,
    NODE_OPTIONS,
    Edge,
    Handler,
    Node,
    NodeKind,
    Required,
    RetryPolicy,
    _check_option_types,
)
from ._references import is_generator_callable
from ._topology import Topology

F = TypeVar("F", bound=Callable[..., Any])

#: The longest node id: stores key node rows on it with a run id of up to 512 characters.
MAX_NODE_ID_CHARS = 200


@dataclass(slots=True)
class Graph:
    """A workflow graph. Nodes keep their definition order, which breaks ties (E2).

    ``name`` identifies the graph in stores and the CLI.
    """

    name: str
    nodes: dict[str, Node] = field(default_factory=dict)
    edges: list[Edge] = field(default_factory=list)
    _compiled: Any = field(default=None, repr=False, compare=False)
    _pairs: set[tuple[str, str]] = field(default_factory=set, repr=False, compare=False)

    def __post_init__(self) -> None:
        # G1: a nameless graph is refused here, not later by a store's NOT NULL.
        if not isinstance(self.name, str) or not self.name:
            raise GraphError(f"graph name must be a non-empty string, got {self.name!r}")

    # -- building ---------------------------------------------------------

    def add_node(
        self,
        name: str,
        handler: Handler,
        kind: NodeKind | str = NodeKind.TASK,
        *,
        required: Required | None = None,
        max_visits: int | None = None,
        priority: int = 0,
        any_of: bool = False,
        retry: RetryPolicy | None = None,
        timeout: float | None = None,
        cost: float | Callable[[Any], float] | None = None,
        estimate_key: str | None = None,
        hedge: bool = False,
        poller: str | None = None,
        deadline: float | None = None,
        executor: str | None = None,
        resources: Mapping[str, float] | None = None,
        runtime_env: Mapping[str, Any] | None = None,
        late: str = "record",
        errors: str = "fail",
        max_items: int | None = None,
        resume_parked: bool = False,
        max_parks: int = MAX_PARKS,
        queue: str | None = None,
    ) -> Node:
        """Add a node and return it.

        ``name`` must be unique; ``handler`` is a sync or async callable of one
        payload; ``kind`` is a :class:`NodeKind` or its value. ``required`` is an
        aggregate's quorum k (default: its fan-in); ``max_visits`` bounds loop
        re-activations (default 1 outside loops, unbounded inside); ``priority``
        orders queued nodes under priority admission (higher first); ``any_of``
        lets a non-aggregate node fire on the first of several inputs;
        ``retry`` and ``timeout`` (seconds per attempt) apply per attempt (E11);
        ``cost`` (a number or a function of the input) feeds duration estimates,
        keyed by ``estimate_key`` (default the node id); ``hedge`` races a backup
        attempt when the first straggles (T3, idempotent handlers only). A
        gate's handler returns the question's prompt (Q1); ``poller`` names the
        registered poller of a machine gate and ``deadline`` is the seconds
        after which an unanswered gate is answered with a ``GateTimeout`` (Q5).
        ``executor`` names where attempts run, one of the engine's
        ``executors`` (default: the engine's ``executor``; an unknown name
        fails the run at its start); ``resources`` (``num_cpus``,
        ``num_gpus``, ``memory`` in bytes, or custom resource names, each a
        number >= 0) and ``runtime_env`` (a JSON object) are passed to that
        executor, e.g. Ray's task options (see ``tailrace.executors``).
        ``late`` says what an aggregate does with inputs still running once it
        has fired: ``"record"`` (the default) lets them finish and records them
        as late inputs (E5); ``"cancel"`` cancels a running input once every
        consumer it feeds has fired without it, recording it as a late,
        cancelled input, so a run returns as soon as its output is decided.

        A ``map`` node runs its handler once per item of its input list
        (M1-M7): ``required`` is its k, an integer or a function of the item
        count (default: every item); ``late`` applies to items still running
        or queued at the decision; ``errors`` is ``"fail"`` (an item's final
        error fails the node) or ``"skip"`` (failed items are recorded and
        skipped); ``max_items`` bounds the list (default 10,000). ``retry``,
        ``timeout``, ``cost`` (of one item) and ``hedge`` apply per item.
        ``late="park"`` (maps and aggregates) cancels the stragglers and stores
        them as parked items (P3); a map with ``resume_parked`` takes the parked
        items of its graph name and node first, and runs them from their last
        checkpoint (P4); an item it takes that has been parked ``max_parks``
        times (default 3) runs to completion: the decision waits for it and it
        is among the winners, so no item starves (P5).

        A ``handler`` that is a :class:`Graph` runs as a child run (R1): a task
        runs one, a map one per item (first-k over the children, late ones
        cancelled); its output is the node's result. ``queue`` submits the
        child runs to that queue for any worker to drive (R4); without it they
        run in this process. A child node takes none of the per-attempt
        options (``retry``, ``timeout``, ``hedge``, ``executor``, ...): the
        child graph's own nodes carry them.
        """
        if not isinstance(name, str) or not name:
            raise GraphError(f"node name must be a non-empty string, got {name!r}")
        if len(name) > MAX_NODE_ID_CHARS:
            raise GraphError(
                f"node {name[:40]!r}... is {len(name)} characters long; a node id holds at most "
                f"{MAX_NODE_ID_CHARS} (every store keys its rows on it, with the run's id)"
            )
        try:
            node_kind = NodeKind(kind)
        except ValueError:
            raise GraphError(f"node {name!r}: unknown kind {kind!r}") from None
        if name in self.nodes:
            raise GraphError(f"duplicate node id {name!r}")
        child = isinstance(handler, Graph)
        if not child and not callable(handler):
            raise GraphError(f"node {name!r}: handler {handler!r} is not callable")
        if not child and is_generator_callable(handler):
            raise GraphError(
                f"node {name!r}: handler {getattr(handler, '__qualname__', handler)!r} is a "
                "generator function; a handler returns its result (for a list of items, "
                "return list(...) of the generator)"
            )
        options: dict[str, Any] = {
            "required": required,
            "max_visits": max_visits,
            "priority": priority,
            "any_of": any_of,
            "retry": retry,
            "timeout": timeout,
            "cost": cost,
            "estimate_key": estimate_key,
            "hedge": hedge,
            "poller": poller,
            "deadline": deadline,
            "executor": executor,
            "resources": resources,
            "runtime_env": runtime_env,
            "late": late,
            "errors": errors,
            "max_items": max_items,
            "resume_parked": resume_parked,
            "max_parks": max_parks,
            "queue": queue,
        }
        _check_option_types(name, **options)
        _check_kind_options(name, node_kind, options)
        if child:
            _check_child_options(self, name, node_kind, handler, options)  # type: ignore[arg-type]
        elif queue is not None:
            raise GraphError(f"node {name!r}: queue= applies to nodes whose handler is a Graph")
        if node_kind is NodeKind.MAP and late == "park" and required is None:
            # Without required= every item is awaited: no item is ever late, so none parks.
            raise GraphError(
                f"map {name!r}: late='park' parks the items still running at the decision, "
                "and a map without required= waits for every item; give it required="
            )
        if any_of and node_kind is NodeKind.AGGREGATE:
            raise GraphError(f"node {name!r}: an aggregate cannot be any_of")
        if (poller is not None or deadline is not None) and node_kind is not NodeKind.GATE:
            raise GraphError(f"node {name!r}: poller= and deadline= apply to gates only")
        # Copies, so later changes to the caller's mappings do not leak into the graph.
        options["resources"] = None if resources is None else dict(resources)
        options["runtime_env"] = None if runtime_env is None else _json_copy(runtime_env)
        node = Node(id=name, handler=handler, kind=node_kind, child=child, **options)
        self.nodes[name] = node
        self._compiled = None
        return node

    def add_edge(self, source: str, target: str, *, route: str | None = None) -> Edge:
        """Add an edge from ``source`` to ``target``; ``route`` labels a switch's edge."""
        for value, label in ((source, "source"), (target, "target"), (route, "route")):
            if not isinstance(value, str) and not (label == "route" and value is None):
                raise GraphError(f"edge {source!r} -> {target!r}: {label} must be a string")
        for end, label in ((source, "source"), (target, "target")):
            if end not in self.nodes:
                raise GraphError(f"edge {source!r} -> {target!r}: unknown {label} node {end!r}")
        if (source, target) in self._pairs:
            raise GraphError(f"duplicate edge {source!r} -> {target!r}")
        src = self.nodes[source]
        if src.kind is NodeKind.SWITCH:
            if route is None:
                raise GraphError(
                    f"edge {source!r} -> {target!r} leaves switch {source!r} without a route"
                )
            if source == target:
                raise GraphError(f"switch {source!r} has a self-loop")
        elif route is not None:
            raise GraphError(
                f"edge {source!r} -> {target!r}: route= applies to edges leaving a switch"
            )
        edge = Edge(source=source, target=target, route=route)
        self.edges.append(edge)
        self._pairs.add((source, target))
        self._compiled = None
        return edge

    def _decorator(self, kind: NodeKind, options: dict[str, Any]) -> Callable[[F], F]:
        def register(fn: F) -> F:
            name = options.pop("name", None) or fn.__name__
            unknown = sorted(set(options) - NODE_OPTIONS)
            if unknown:
                raise GraphError(f"node {name!r}: unknown option {unknown[0]!r}")
            self.add_node(name, fn, kind, **options)
            return fn

        return register

    def task(self, name: str | None = None, **options: Any) -> Callable[[F], F]:
        """Decorator: add the function as a task node (``name`` defaults to its name; ``options`` as in :meth:`add_node`)."""
        return self._decorator(NodeKind.TASK, {"name": name, **options})

    def switch(self, name: str | None = None, **options: Any) -> Callable[[F], F]:
        """Decorator: add a switch; its handler returns a route (``name``/``options`` as in :meth:`task`)."""
        return self._decorator(NodeKind.SWITCH, {"name": name, **options})

    def aggregate(
        self, name: str | None = None, *, required: int | None = None, **options: Any
    ) -> Callable[[F], F]:
        """Decorator: add a fan-in firing on its ``required``-th input (``name``/``options`` as in :meth:`task`)."""
        return self._decorator(NodeKind.AGGREGATE, {"name": name, "required": required, **options})

    def map(
        self, name: str | None = None, *, required: Required | None = None, **options: Any
    ) -> Callable[[F], F]:
        """Decorator: add a map node; its handler runs once per item of its input list (M1).

        ``required`` is the k of first-k over the items (an integer or a
        function of the item count); ``name``/``options`` as in :meth:`task`
        (``late``, ``errors``, ``max_items`` among them).
        """
        return self._decorator(NodeKind.MAP, {"name": name, "required": required, **options})

    def gate(self, name: str | None = None, **options: Any) -> Callable[[F], F]:
        """Decorator: add a gate; its handler returns the question's prompt (``name``/``options`` as in :meth:`task`)."""
        return self._decorator(NodeKind.GATE, {"name": name, **options})

    def child_graphs(self) -> list[Graph]:
        """The graphs this graph's nodes run as child runs (R1), in node order, each once."""
        found: list[Graph] = []
        for node in self.nodes.values():
            child: Any = node.handler
            if node.child and not any(g is child for g in found):
                found.append(child)
        return found

    def chain(self, *names: str) -> None:
        """Add edges ``names[0] -> names[1] -> ...``."""
        for source, target in itertools.pairwise(names):
            self.add_edge(source, target)

    # -- checking and serialising -----------------------------------------

    def compile(self) -> Any:
        """Validate (G1) and return the cached :class:`~tailrace.graph._topology.Topology`."""
        if self._compiled is None:
            if any(g is self for g in _COMPILING):
                raise GraphError(
                    f"graph {self.name!r} runs itself as a child run (a cycle of graphs)"
                )
            _COMPILING.append(self)
            try:
                for node in self.nodes.values():
                    if node.child:
                        node.handler.compile()  # type: ignore[attr-defined]  # G1 of the child
                self._compiled = Topology.build(self)
            finally:
                _COMPILING.pop()
        return self._compiled

    def validate(self) -> None:
        """Raise :class:`GraphError` naming the culprit if the graph is invalid (G1)."""
        self.compile()

    def fingerprint(self) -> str:
        """Structural hash: node ids, kinds, quorums and edges; not handlers."""
        return str(self.compile().fingerprint)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form with handlers named by ``module:qualname`` (G3)."""
        self.validate()
        return {
            "format": GRAPH_FORMAT,
            "name": self.name,
            "nodes": [node.to_dict() for node in self.nodes.values()],
            "edges": [edge.to_dict() for edge in self.edges],
        }

    def structure(self) -> dict[str, Any]:
        """The graph's nodes and edges without handlers, as a run stores it to be drawn.

        ``{"nodes": [[id, kind], ...], "edges": [[source, target, route], ...]}``
        in definition order. A durable run stores it with its ``run_started``
        event, so tools draw the run's graph whole without importing its code.

        >>> g = Graph("g")
        >>> _ = g.add_node("a", lambda x: x)
        >>> _ = g.add_node("b", lambda x: x)
        >>> _ = g.add_edge("a", "b")
        >>> g.structure()
        {'nodes': [['a', 'task'], ['b', 'task']], 'edges': [['a', 'b', None]]}
        """
        structure: dict[str, Any] = {
            "nodes": [[node.id, node.kind.value] for node in self.nodes.values()],
            "edges": [[edge.source, edge.target, edge.route] for edge in self.edges],
        }
        children = {
            node.id: {"graph": node.handler.name, "queue": node.queue}  # type: ignore[attr-defined]
            for node in self.nodes.values()
            if node.child
        }
        if children:  # nodes that run a child run: which graph, on which queue (R1)
            structure["children"] = children
        return structure

    def to_json(self) -> str:
        """:meth:`to_dict` as canonical JSON text."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(
        cls,
        data: Mapping[str, Any],
        handlers: Mapping[str, Handler] | None = None,
        *,
        allow_files: bool = False,
    ) -> Graph:
        """Rebuild a graph from :meth:`to_dict` output (G3).

        ``data`` is the document; ``handlers`` maps a handler reference (or a
        node id) to a callable, overriding import by reference. References are
        importable modules (``package.module:attr``); a ``path/to/file.py:attr``
        reference is refused unless ``allow_files`` is true, because loading
        it executes the file (trust model: opt in only for files you trust).
        A malformed document raises :class:`GraphError` naming the field and
        the node (G1); a format version other than ours raises
        :class:`~tailrace.UnsupportedFormat` (D4).
        """
        return graph_from_dict(cls, data, handlers, allow_files=allow_files)


#: Kinds that decide on the first k of their inputs (an aggregate) or items (a map).
_FIRST_K = (NodeKind.AGGREGATE, NodeKind.MAP)


def _check_kind_options(name: str, kind: NodeKind, options: dict[str, Any]) -> None:
    """Refuse options that do not apply to a node of ``kind`` (G1), naming the node."""
    if options["late"] != "record" and kind not in _FIRST_K:
        raise GraphError(f"node {name!r}: late= applies to aggregates and maps only")
    required = options["required"]
    if required is not None and kind not in _FIRST_K:
        raise GraphError(f"node {name!r}: required= applies to aggregates and maps only")
    if callable(required) and kind is not NodeKind.MAP:
        raise GraphError(f"aggregate {name!r}: required= must be an integer")
    if kind is NodeKind.MAP and isinstance(required, int) and required < 1:
        raise GraphError(f"map {name!r}: required={required} must be >= 1")
    for option, default in (
        ("errors", "fail"), ("max_items", None), ("resume_parked", False), ("max_parks", MAX_PARKS)
    ):  # fmt: skip
        if options[option] != default and kind is not NodeKind.MAP:
            raise GraphError(f"node {name!r}: {option}= applies to maps only")
    if options["max_parks"] != MAX_PARKS and not options["resume_parked"]:
        raise GraphError(
            f"map {name!r}: max_parks= bounds the parked items it takes; it needs resume_parked=True"
        )
    if kind is NodeKind.MAP and options["any_of"]:
        raise GraphError(f"map {name!r}: a map takes one input list; it cannot be any_of")


#: Graphs being compiled now (innermost last): a graph that reaches itself through
#: its child graphs is refused rather than recursed into.
_COMPILING: list[Graph] = []

#: Options a node that runs a child run refuses: the child's own nodes carry them.
_CHILD_REFUSED = (
    ("retry", None), ("timeout", None), ("hedge", False), ("executor", None),
    ("resources", None), ("runtime_env", None), ("resume_parked", False),
    ("max_parks", MAX_PARKS),
)  # fmt: skip


def _check_child_options(
    graph: Graph, name: str, kind: NodeKind, child: Graph, options: dict[str, Any]
) -> None:
    """A node whose handler is a graph (R1): a task or a map, with none of the per-attempt options."""
    if child is graph:
        raise GraphError(f"node {name!r}: graph {graph.name!r} cannot run itself as a child run")
    if kind not in (NodeKind.TASK, NodeKind.MAP):
        raise GraphError(
            f"node {name!r}: a {kind.value} cannot run a child run; only tasks and maps take a Graph"
        )
    for option, default in _CHILD_REFUSED:
        if options[option] != default:
            raise GraphError(
                f"node {name!r}: {option}= does not apply to a child run "
                f"(give the nodes of graph {child.name!r} their own)"
            )
    if options["late"] == "park":
        raise GraphError(
            f"map {name!r}: late='park' does not apply to child runs; use 'cancel' or 'record'"
        )


def iter_in_order(graph: Graph) -> Iterable[Node]:
    """Nodes in definition order."""
    return graph.nodes.values()


def max_parks_of(graph: Graph | None, node: str) -> int:
    """How many times an item of map ``node`` of ``graph`` may be parked (P5): the map's
    ``max_parks``, or :data:`MAX_PARKS` when the graph (or the node in it) is not known. A
    parked item that waited that many rounds runs to completion in the next round that takes
    it, so it is the tail's starvation bound too (X4).

    Args:
        graph: The graph the map belongs to, if known.
        node: The map node.
    """
    found = None if graph is None else graph.nodes.get(node)
    return MAX_PARKS if found is None else found.max_parks
