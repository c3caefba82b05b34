"""Reading a serialised graph back (G3), refusing malformed input with ``GraphError`` (G1).

A graph document is data that may come from anywhere (a file, a store, a
request), so every field is checked before it reaches :meth:`Graph.add_node`:
a missing key, a wrong type or an unknown option raises :class:`GraphError`
naming the field and the node, never a ``KeyError``/``TypeError``. References
(handlers, cost functions, ``retry_on`` classes) resolve as importable modules
only; a file reference is loaded only when the caller passed
``allow_files=True`` (trust model, ``docs/trust.md``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .._errors import GraphError, UnsupportedFormat
from ._checks import _field, _object, _present, _refuse_unknown, _resolve, _show
from ._node import NODE_OPTIONS, Handler, RetryPolicy

if TYPE_CHECKING:
    from ._graph import Graph

#: Version of the ``to_dict`` document (D4).
GRAPH_FORMAT = 1

_GRAPH_FIELDS = frozenset({"format", "name", "nodes", "edges"})
_NODE_FIELDS = frozenset({"id", "kind", "handler"}) | NODE_OPTIONS
_EDGE_FIELDS = frozenset({"source", "target", "route"})
_COST_FIELDS = frozenset({"ref"})


def graph_from_dict(
    cls: type[Graph],
    data: Any,
    handlers: Mapping[str, Handler] | None,
    *,
    allow_files: bool,
) -> Graph:
    """Build a ``cls`` from ``data`` (see :meth:`Graph.from_dict`)."""
    doc = _object(data, "graph document")
    _check_format(doc)
    _refuse_unknown(doc, _GRAPH_FIELDS, "graph document")
    graph = cls(_field(doc, "name", str, "graph document"))
    where = f"graph {graph.name!r}"
    resolver = _Resolver(handlers, allow_files, cls)
    for index, raw in enumerate(_field(doc, "nodes", list, where)):
        _add_node(graph, raw, f"{where}: nodes[{index}]", resolver)
    for index, raw in enumerate(_field(doc, "edges", list, where)):
        _add_edge(graph, raw, f"{where}: edges[{index}]")
    graph.validate()
    return graph


def _add_node(graph: Graph, raw: Any, where: str, resolver: _Resolver) -> None:
    node = _object(raw, where)
    node_id = _field(node, "id", str, where)
    where = f"graph {graph.name!r}: node {node_id!r}"
    kind = _field(node, "kind", str, where)
    ref = _field(node, "handler", str, where)
    _refuse_unknown(node, _NODE_FIELDS, where)
    # to_dict leaves out options at their default, so an explicit null means the same.
    options = {k: v for k, v in node.items() if k in NODE_OPTIONS and v is not None}
    if "retry" in options:
        try:
            options["retry"] = RetryPolicy.from_dict(
                options["retry"], allow_files=resolver.allow_files
            )
        except GraphError as exc:
            raise GraphError(f"{where}: field 'retry': {exc}") from exc
    for name in ("cost", "required"):  # a cost function, a map's k of the item count
        if isinstance(options.get(name), Mapping):
            options[name] = resolver.function(options[name], f"{where}: field {name!r}")
    handler = resolver.handler(ref, node_id, f"{where}: field 'handler'")
    graph.add_node(node_id, handler, kind, **options)


def _add_edge(graph: Graph, raw: Any, where: str) -> None:
    edge = _object(raw, where)
    source = _field(edge, "source", str, where)
    target = _field(edge, "target", str, where)
    where = f"graph {graph.name!r}: edge {source!r} -> {target!r}"
    _refuse_unknown(edge, _EDGE_FIELDS, where)
    route = edge.get("route")
    if route is not None and not isinstance(route, str):
        raise GraphError(f"{where}: field 'route' must be a string, got {_show(route)}")
    graph.add_edge(source, target, route=route)


class _Resolver:
    """Finds the callables a document names: the caller's mapping first, then by reference."""

    def __init__(
        self, handlers: Mapping[str, Handler] | None, allow_files: bool, graphs: type[Graph]
    ) -> None:
        #: A handler that is one of these is a child run's graph (R1).
        self.graphs = graphs
        if handlers is not None and not isinstance(handlers, Mapping):
            raise GraphError(f"handlers must be a mapping, got {_show(handlers)}")
        self.handlers = dict(handlers or {})
        self.allow_files = allow_files

    def handler(self, ref: str, node_id: str, where: str) -> Handler:
        """The node's handler: mapped by node id, else by reference, else imported."""
        if node_id in self.handlers:
            found = self.handlers[node_id]
        elif ref in self.handlers:
            found = self.handlers[ref]
        else:
            found = _resolve(ref, self.allow_files, where)
        if isinstance(found, self.graphs):
            return found  # a child run's graph (R1)
        return _callable(found, where, repr(ref))

    def function(self, raw: Mapping[str, Any], where: str) -> Handler:
        """A function named ``{"ref": "module:attr"}`` (a cost, a map's ``required``; by reference only)."""
        _refuse_unknown(raw, _COST_FIELDS, where)
        return self._by_reference(_field(raw, "ref", str, where), where)

    def _by_reference(self, ref: str, where: str) -> Handler:
        if ref in self.handlers:
            return _callable(self.handlers[ref], where, f"handlers[{ref!r}]")
        return _callable(_resolve(ref, self.allow_files, where), where, repr(ref))


def _callable(found: Any, where: str, what: str) -> Handler:
    if not callable(found):
        raise GraphError(f"{where}: {what} is not callable (it is {_show(found)})")
    return found  # type: ignore[no-any-return]


def _check_format(doc: Mapping[str, Any]) -> None:
    version = _present(doc, "format", "graph document")
    if not isinstance(version, int) or isinstance(version, bool):
        raise GraphError(f"graph document: field 'format' must be an integer, got {_show(version)}")
    if version != GRAPH_FORMAT:  # D4: a newer writer's document is not guessed at
        raise UnsupportedFormat(
            f"graph {_show(doc.get('name'))}: unsupported graph format {version!r}"
        )
