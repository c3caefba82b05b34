"""Graph definition: nodes, edges, builders, validation (G1) and JSON form (G3).

>>> g = Graph("hello")
>>> @g.task()
... def greet(name):
...     return f"hello {name}"
>>> g.to_dict()["nodes"][0]["id"]
'greet'
"""

from __future__ import annotations

import enum
import importlib
import inspect
import itertools
import json
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ._errors import GraphError

#: Route of the edge a switch takes when no other route matches (E8).
EXIT = "exit"

#: Version of the ``to_dict`` document (D4).
GRAPH_FORMAT = 1

Handler = Callable[[Any], Any]
F = TypeVar("F", bound=Callable[..., Any])


class NodeKind(enum.StrEnum):
    """What a node does with its input."""

    TASK = "task"
    SWITCH = "switch"
    AGGREGATE = "aggregate"
    GATE = "gate"


@dataclass(frozen=True, slots=True, kw_only=True)
class RetryPolicy:
    """How a failing handler is retried (E11).

    ``attempts`` counts the first try; the n-th retry waits
    ``min(backoff * multiplier**(n-1), max_backoff)`` seconds. Only exceptions
    that are instances of ``retry_on`` are retried.
    """

    attempts: int = 3
    backoff: float = 0.0
    multiplier: float = 2.0
    max_backoff: float = 60.0
    retry_on: tuple[type[BaseException], ...] = (Exception,)

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"RetryPolicy.attempts must be >= 1, got {self.attempts}")
        if self.backoff < 0 or self.max_backoff < 0 or self.multiplier < 1:
            raise ValueError("RetryPolicy backoff values must be >= 0 and multiplier >= 1")

    def delay(self, retry: int) -> float:
        """Seconds to wait before retry number ``retry`` (1-based)."""
        return float(min(self.backoff * self.multiplier ** (retry - 1), self.max_backoff))

    def to_dict(self) -> dict[str, Any]:
        """JSON form; exception classes are named by ``module:qualname``."""
        return {
            "attempts": self.attempts,
            "backoff": self.backoff,
            "multiplier": self.multiplier,
            "max_backoff": self.max_backoff,
            "retry_on": [f"{t.__module__}:{t.__qualname__}" for t in self.retry_on],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RetryPolicy:
        """Rebuild a policy from ``data``, the output of :meth:`to_dict`."""
        return cls(
            attempts=data["attempts"],
            backoff=data["backoff"],
            multiplier=data["multiplier"],
            max_backoff=data["max_backoff"],
            retry_on=tuple(resolve_reference(ref) for ref in data["retry_on"]),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Node:
    """One node of a graph. Build nodes with :meth:`Graph.add_node` or its decorators."""

    id: str
    handler: Handler
    kind: NodeKind = NodeKind.TASK
    required: int | None = None
    max_visits: int | None = None
    priority: int = 0
    any_of: bool = False
    retry: RetryPolicy | None = None
    timeout: float | None = None
    cost: float | Callable[[Any], float] | None = None
    estimate_key: str | None = None
    hedge: bool = False
    poller: str | None = None
    deadline: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON form; the handler is named by reference."""
        data: dict[str, Any] = {
            "id": self.id,
            "kind": self.kind.value,
            "handler": callable_reference(self.handler, self.id),
        }
        optional: dict[str, Any] = {
            "required": self.required,
            "max_visits": self.max_visits,
            "priority": self.priority or None,
            "any_of": self.any_of or None,
            "retry": self.retry.to_dict() if self.retry else None,
            "timeout": self.timeout,
            "cost": (
                self.cost
                if self.cost is None or isinstance(self.cost, int | float)
                else {"ref": callable_reference(self.cost, self.id)}
            ),
            "estimate_key": self.estimate_key,
            "hedge": self.hedge or None,
            "poller": self.poller,
            "deadline": self.deadline,
        }
        data.update({k: v for k, v in optional.items() if v is not None})
        return data


@dataclass(frozen=True, slots=True, kw_only=True)
class Edge:
    """A directed edge; ``route`` is required on edges leaving a switch (E8)."""

    source: str
    target: str
    route: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        data: dict[str, Any] = {"source": self.source, "target": self.target}
        if self.route is not None:
            data["route"] = self.route
        return data


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

    # -- building ---------------------------------------------------------

    def add_node(
        self,
        name: str,
        handler: Handler,
        kind: NodeKind | str = NodeKind.TASK,
        *,
        required: int | None = None,
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
        """
        try:
            node_kind = NodeKind(kind)
        except ValueError:
            raise GraphError(f"node {name!r}: unknown kind {kind!r}") from None
        if not isinstance(name, str) or not name:
            raise GraphError(f"node name must be a non-empty string, got {name!r}")
        if name in self.nodes:
            raise GraphError(f"duplicate node id {name!r}")
        if not callable(handler):
            raise GraphError(f"node {name!r}: handler {handler!r} is not callable")
        if max_visits is not None and max_visits < 1:
            raise GraphError(f"node {name!r}: max_visits must be >= 1, got {max_visits}")
        if timeout is not None and timeout <= 0:
            raise GraphError(f"node {name!r}: timeout must be > 0, got {timeout}")
        if required is not None and node_kind is not NodeKind.AGGREGATE:
            raise GraphError(f"node {name!r}: required= applies to aggregates only")
        if any_of and node_kind is NodeKind.AGGREGATE:
            raise GraphError(f"node {name!r}: an aggregate cannot be any_of")
        if (poller is not None or deadline is not None) and node_kind is not NodeKind.GATE:
            raise GraphError(f"node {name!r}: poller= and deadline= apply to gates only")
        if deadline is not None and not deadline > 0:
            raise GraphError(f"node {name!r}: deadline must be > 0 seconds, got {deadline}")
        node = Node(
            id=name,
            handler=handler,
            kind=node_kind,
            required=required,
            max_visits=max_visits,
            priority=priority,
            any_of=any_of,
            retry=retry,
            timeout=timeout,
            cost=cost,
            estimate_key=estimate_key,
            hedge=hedge,
            poller=poller,
            deadline=deadline,
        )
        self.nodes[name] = node
        self._compiled = None
        return node

    def add_edge(self, source: str, target: str, *, route: str | None = None) -> Edge:
        """Add an edge from ``source`` to ``target``; ``route`` labels a switch's edge."""
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
            self.add_node(options.pop("name", None) or fn.__name__, fn, kind, **options)
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

    def gate(self, name: str | None = None, **options: Any) -> Callable[[F], F]:
        """Decorator: add a gate; its handler returns the question's prompt (``name``/``options`` as in :meth:`task`)."""
        return self._decorator(NodeKind.GATE, {"name": name, **options})

    def chain(self, *names: str) -> None:
        """Add edges ``names[0] -> names[1] -> ...``."""
        for source, target in itertools.pairwise(names):
            self.add_edge(source, target)

    # -- checking and serialising -----------------------------------------

    def compile(self) -> Any:
        """Validate (G1) and return the cached :class:`~tailrace._topology.Topology`."""
        if self._compiled is None:
            from ._topology import Topology

            self._compiled = Topology.build(self)
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

    def to_json(self) -> str:
        """:meth:`to_dict` as canonical JSON text."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(
        cls, data: Mapping[str, Any], handlers: Mapping[str, Handler] | None = None
    ) -> Graph:
        """Rebuild a graph from :meth:`to_dict` output (G3).

        ``data`` is the document; ``handlers`` maps a handler reference (or a
        node id) to a callable, overriding import by reference.
        """
        version = data.get("format")
        if version != GRAPH_FORMAT:
            from ._errors import UnsupportedFormat

            raise UnsupportedFormat(
                f"graph {data.get('name')!r}: unsupported graph format {version!r}"
            )
        handlers = dict(handlers or {})
        graph = cls(data["name"])
        for raw in data["nodes"]:
            options = {k: v for k, v in raw.items() if k not in ("id", "kind", "handler")}
            if "retry" in options:
                options["retry"] = RetryPolicy.from_dict(options["retry"])
            if isinstance(options.get("cost"), dict):
                options["cost"] = _lookup(options["cost"]["ref"], raw["id"], handlers)
            handler = _lookup(raw["handler"], raw["id"], handlers)
            graph.add_node(raw["id"], handler, raw["kind"], **options)
        for raw in data["edges"]:
            graph.add_edge(raw["source"], raw["target"], route=raw.get("route"))
        graph.validate()
        return graph


def _lookup(ref: str, node_id: str, handlers: Mapping[str, Handler]) -> Handler:
    if node_id in handlers:
        return handlers[node_id]
    if ref in handlers:
        return handlers[ref]
    try:
        found = resolve_reference(ref)
    except (ImportError, AttributeError, ValueError) as exc:
        raise GraphError(f"node {node_id!r}: cannot resolve handler {ref!r}: {exc}") from exc
    if not callable(found):
        raise GraphError(f"node {node_id!r}: {ref!r} is not callable")
    return found  # type: ignore[no-any-return]


def callable_reference(fn: Callable[..., Any], node_id: str = "?") -> str:
    """``module:qualname`` of a callable, for JSON forms."""
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if module is None or qualname is None:
        # A callable object: its class's name would rebuild the class, not it.
        raise GraphError(
            f"node {node_id!r}: handler {fn!r} has no importable name; use a function, "
            "or pass it to from_dict(handlers=...)"
        )
    return f"{module}:{qualname}"


def resolve_reference(ref: str) -> Any:
    """Import ``module:attr.path`` (or ``path/to/file.py:attr``) and return the object."""
    module_name, sep, attr_path = ref.rpartition(":")
    if not sep or not attr_path or not module_name:
        raise ValueError(f"reference {ref!r} is not of the form 'module:attribute'")
    obj: Any = (
        load_file_module(module_name)
        if module_name.endswith(".py")
        else importlib.import_module(module_name)
    )
    for part in attr_path.split("."):
        if part == "<locals>":
            raise ValueError(f"reference {ref!r} points into a function's locals")
        obj = getattr(obj, part)
    return obj


#: Importing a file publishes its module before running it: threads must take turns.
_FILE_IMPORT_LOCK = threading.RLock()


def load_file_module(path: str) -> Any:
    """Import a Python file as a module (once per resolved path) and return it."""
    with _FILE_IMPORT_LOCK:
        return _load_file_module(path)


def _load_file_module(path: str) -> Any:
    import importlib.util
    import sys
    from pathlib import Path

    resolved = Path(path).resolve()
    import hashlib

    name = "tailrace_file_" + hashlib.sha1(str(resolved).encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    if not resolved.is_file():
        raise ImportError(f"no such file: {path}")
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def is_async_callable(fn: Callable[..., Any]) -> bool:
    """True for ``async def`` functions and objects whose ``__call__`` is one."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - we want the bound __call__
    )


def iter_in_order(graph: Graph) -> Iterable[Node]:
    """Nodes in definition order."""
    return graph.nodes.values()
