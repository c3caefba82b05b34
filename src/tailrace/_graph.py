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
import math
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
        if not _is_int(self.attempts) or self.attempts < 1:
            raise GraphError(f"RetryPolicy.attempts must be an integer >= 1, got {self.attempts!r}")
        for field_name in ("backoff", "multiplier", "max_backoff"):
            value = getattr(self, field_name)
            if not _is_number(value) or value < 0 or (field_name == "multiplier" and value < 1):
                raise GraphError(
                    f"RetryPolicy.{field_name} must be a finite number "
                    f"{'>= 1' if field_name == 'multiplier' else '>= 0'}, got {value!r}"
                )
        if not isinstance(self.retry_on, tuple | list):
            raise GraphError(
                f"RetryPolicy.retry_on must be a tuple of exception classes, got {self.retry_on!r}"
            )
        for entry in self.retry_on:
            if not (isinstance(entry, type) and issubclass(entry, BaseException)):
                raise GraphError(f"RetryPolicy.retry_on: {entry!r} is not an exception class")
        object.__setattr__(self, "retry_on", tuple(self.retry_on))

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
    def from_dict(cls, data: Mapping[str, Any], *, allow_files: bool = False) -> RetryPolicy:
        """Rebuild a policy from ``data``, the output of :meth:`to_dict`.

        Every ``retry_on`` entry must name a subclass of ``BaseException``;
        ``allow_files`` lets entries name ``path/to/file.py:Class`` (executing
        that file), see :func:`resolve_reference`. Malformed input raises
        :class:`GraphError` naming the field.
        """
        from ._graph_codec import retry_policy_from_dict

        return retry_policy_from_dict(cls, data, allow_files=allow_files)


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
    executor: str | None = None
    # Mappings, so left out of the hash (a Node stays hashable); equality still compares them.
    resources: Mapping[str, float] | None = field(default=None, hash=False)
    runtime_env: Mapping[str, Any] | None = field(default=None, hash=False)
    late: str = "record"

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
            "executor": self.executor,
            "resources": dict(self.resources) if self.resources is not None else None,
            "runtime_env": _json_copy(self.runtime_env) if self.runtime_env is not None else None,
            "late": None if self.late == "record" else self.late,
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
        executor: str | None = None,
        resources: Mapping[str, float] | None = None,
        runtime_env: Mapping[str, Any] | None = None,
        late: str = "record",
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
        """
        if not isinstance(name, str) or not name:
            raise GraphError(f"node name must be a non-empty string, got {name!r}")
        try:
            node_kind = NodeKind(kind)
        except ValueError:
            raise GraphError(f"node {name!r}: unknown kind {kind!r}") from None
        if name in self.nodes:
            raise GraphError(f"duplicate node id {name!r}")
        if not callable(handler):
            raise GraphError(f"node {name!r}: handler {handler!r} is not callable")
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
        }
        _check_option_types(name, **options)
        if late != "record" and node_kind is not NodeKind.AGGREGATE:
            raise GraphError(f"node {name!r}: late= applies to aggregates only")
        if required is not None and node_kind is not NodeKind.AGGREGATE:
            raise GraphError(f"node {name!r}: required= applies to aggregates only")
        if any_of and node_kind is NodeKind.AGGREGATE:
            raise GraphError(f"node {name!r}: an aggregate cannot be any_of")
        if (poller is not None or deadline is not None) and node_kind is not NodeKind.GATE:
            raise GraphError(f"node {name!r}: poller= and deadline= apply to gates only")
        # Copies, so later changes to the caller's mappings do not leak into the graph.
        options["resources"] = None if resources is None else dict(resources)
        options["runtime_env"] = None if runtime_env is None else _json_copy(runtime_env)
        node = Node(id=name, handler=handler, kind=node_kind, **options)
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
        from ._graph_codec import graph_from_dict

        return graph_from_dict(cls, data, handlers, allow_files=allow_files)


#: The keyword options of :meth:`Graph.add_node` (for the decorators and the codec).
NODE_OPTIONS = frozenset(
    {
        "required",
        "max_visits",
        "priority",
        "any_of",
        "retry",
        "timeout",
        "cost",
        "estimate_key",
        "hedge",
        "poller",
        "deadline",
        "executor",
        "resources",
        "runtime_env",
        "late",
    }
)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    """A finite int or float: NaN would break orderings, infinities are not JSON."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _optional(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: value is None or check(value)


def _is_resources(value: Any) -> bool:
    return isinstance(value, Mapping) and all(
        isinstance(k, str) and k != "" and _is_number(v) and v >= 0 for k, v in value.items()
    )


def _is_json_object(value: Any) -> bool:
    """A mapping with string keys that strict JSON can encode (G3: it round-trips)."""
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        return False
    try:
        json.dumps(dict(value), allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return False
    return True


def _json_copy(value: Mapping[str, Any]) -> dict[str, Any]:
    """A deep copy as JSON reads it back, so later changes to the caller's mapping do not leak in."""
    copied: dict[str, Any] = json.loads(json.dumps(dict(value), allow_nan=False))
    return copied


#: What each node option accepts, and how the error says so (G1: at build time,
#: not as a TypeError when the run loop first compares it).
_OPTION_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "required": (_optional(_is_int), "an integer"),
    "max_visits": (_optional(lambda v: _is_int(v) and v >= 1), "an integer >= 1"),
    "priority": (_is_number, "a finite number"),
    "any_of": (lambda v: isinstance(v, bool), "True or False"),
    "retry": (_optional(lambda v: isinstance(v, RetryPolicy)), "a RetryPolicy"),
    "timeout": (_optional(lambda v: _is_number(v) and v > 0), "a finite number of seconds > 0"),
    "cost": (
        _optional(lambda v: callable(v) or (_is_number(v) and v >= 0)),
        "a finite number >= 0 or a function of the input",
    ),
    "estimate_key": (_optional(lambda v: isinstance(v, str) and v != ""), "a non-empty string"),
    "hedge": (lambda v: isinstance(v, bool), "True or False"),
    "poller": (_optional(lambda v: isinstance(v, str) and v != ""), "a non-empty string"),
    "deadline": (_optional(lambda v: _is_number(v) and v > 0), "a finite number of seconds > 0"),
    "executor": (_optional(lambda v: isinstance(v, str) and v != ""), "a non-empty string"),
    "resources": (
        _optional(_is_resources),
        "a mapping of resource names to finite numbers >= 0",
    ),
    "runtime_env": (_optional(_is_json_object), "a JSON object (string keys)"),
    "late": (lambda v: v in ("record", "cancel"), "'record' or 'cancel'"),
}


def _check_option_types(node_id: str, **options: Any) -> None:
    for option, value in options.items():
        accepts, expected = _OPTION_RULES[option]
        if not accepts(value):
            raise GraphError(f"node {node_id!r}: {option} must be {expected}, got {value!r}")


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


def is_file_reference(ref: str) -> bool:
    """Whether ``ref`` names a Python file (``path/to/file.py:attr``) rather than a module."""
    module_name = ref.rpartition(":")[0]
    return module_name.endswith(".py") or "/" in module_name or "\\" in module_name


def resolve_reference(ref: str, *, allow_files: bool = False) -> Any:
    """Import ``package.module:attr.path`` and return the object.

    ``ref`` names an importable module (one on ``sys.path``) and an attribute
    path in it. A file reference, ``path/to/file.py:attr``, executes that file:
    it is loaded only when ``allow_files`` is true, which a caller sets only
    for a reference a trusted person gave it (the command line's
    ``tailrace run path.py:graph``), never for one read from a store (trust
    model, see ``docs/trust.md``). A malformed or refused reference raises
    :class:`GraphError` (a ``ValueError``); a missing module or attribute
    raises ``ImportError`` or ``AttributeError``.
    """
    if not isinstance(ref, str):
        raise GraphError(f"reference {ref!r} is not a string")
    module_name, sep, attr_path = ref.rpartition(":")
    if not sep or not attr_path or not module_name:
        raise GraphError(f"reference {ref!r} is not of the form 'module:attribute'")
    parts = attr_path.split(".")
    if "<locals>" in parts:
        raise GraphError(f"reference {ref!r} points into a function's locals")
    if not all(part.isidentifier() for part in parts):
        raise GraphError(f"reference {ref!r}: {attr_path!r} is not an attribute path")
    obj = _import_for(ref, module_name, allow_files)
    for part in parts:
        obj = getattr(obj, part)
    return obj


def _import_for(ref: str, module_name: str, allow_files: bool) -> Any:
    if is_file_reference(ref):
        if not allow_files:
            raise GraphError(
                f"reference {ref!r} names a file; loading it would execute it, so file "
                "references are loaded only when the caller opts in (allow_files=True)"
            )
        if module_name.endswith(".py"):
            return load_file_module(module_name)
    if not all(part.isidentifier() for part in module_name.split(".")):
        # Also refuses relative names ('.x'), which import_module meets with a TypeError.
        raise GraphError(f"reference {ref!r}: {module_name!r} is not an importable module name")
    return importlib.import_module(module_name)


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
