"""Nodes and edges: what a node does (its kind), its options and how they are checked (G1).

>>> Node(id="n", handler=print).kind
<NodeKind.TASK: 'task'>
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .._errors import GraphError
from ._checks import (
    _exception_class,
    _field,
    _is_int,
    _is_json_object,
    _is_number,
    _is_resources,
    _json_copy,
    _object,
    _optional,
    _present,
    _refuse_unknown,
)
from ._references import callable_reference, graph_reference

#: Route of the edge a switch takes when no other route matches (E8).
EXIT = "exit"

Handler = Callable[[Any], Any]

_RETRY_FIELDS = ("attempts", "backoff", "multiplier", "max_backoff", "retry_on")
#: Fields a retry policy's JSON form may leave out (their default then holds).
_RETRY_OPTIONAL = ("resume",)


class NodeKind(enum.StrEnum):
    """What a node does with its input."""

    TASK = "task"
    SWITCH = "switch"
    AGGREGATE = "aggregate"
    GATE = "gate"
    MAP = "map"


#: What an aggregate or a map does with inputs (items) still running once it has
#: fired (its decision is made): let them run and record them, or cancel them.
LATE_POLICIES = ("record", "cancel", "park")

#: What a map does when one of its items fails for good (M4).
ITEM_ERRORS = ("fail", "skip")

#: A map's ``max_items`` unless the node sets its own (M1).
MAX_ITEMS = 10_000

#: How many times an item may be parked before the next map that takes it runs it to
#: completion (P5), unless the node sets its own ``max_parks``.
MAX_PARKS = 3

#: A map's ``required``: a count, or a function of the item count (M3).
Required = int | Callable[[int], int]


@dataclass(frozen=True, slots=True, kw_only=True)
class RetryPolicy:
    """How a failing handler is retried (E11).

    ``attempts`` counts the first try; the n-th retry waits
    ``min(backoff * multiplier**(n-1), max_backoff)`` seconds. Only exceptions
    that are instances of ``retry_on`` are retried. With ``resume`` a retry
    continues from the attempt's latest checkpoint (``current_node().resumed_from``,
    P2) instead of starting over.

    An exception with a ``retry_after`` attribute (seconds, a finite number >= 0:
    the server's ``Retry-After``, as on the OpenAI integration's
    ``CompletionError``) makes that retry wait ``max(backoff delay, retry_after)``,
    at most ``max_backoff`` (so a server cannot park a node longer than the policy
    allows). Other values of the attribute are ignored. The wait is the retry
    event's ``delay``.
    """

    attempts: int = 3
    backoff: float = 0.0
    multiplier: float = 2.0
    max_backoff: float = 60.0
    retry_on: tuple[type[BaseException], ...] = (Exception,)
    resume: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.resume, bool):
            raise GraphError(f"RetryPolicy.resume must be True or False, got {self.resume!r}")
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
            **({"resume": True} if self.resume else {}),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, allow_files: bool = False) -> RetryPolicy:
        """Rebuild a policy from ``data``, the output of :meth:`to_dict`.

        Every ``retry_on`` entry must name a subclass of ``BaseException``;
        ``allow_files`` lets entries name ``path/to/file.py:Class`` (executing
        that file), see :func:`resolve_reference`. Malformed input raises
        :class:`GraphError` naming the field.
        """
        doc = _object(data, "retry policy")
        _refuse_unknown(doc, frozenset(_RETRY_FIELDS + _RETRY_OPTIONAL), "retry policy")
        values = {name: _present(doc, name, "retry policy") for name in _RETRY_FIELDS}
        values.update({name: doc[name] for name in _RETRY_OPTIONAL if name in doc})
        refs = _field(doc, "retry_on", list, "retry policy")
        values["retry_on"] = tuple(_exception_class(ref, allow_files) for ref in refs)
        return cls(**values)  # __post_init__ checks the numbers' types and ranges


@dataclass(frozen=True, slots=True, kw_only=True)
class Node:
    """One node of a graph. Build nodes with :meth:`Graph.add_node` or its decorators."""

    id: str
    # Left out of the hash: a child run's graph (R1) is a mutable, unhashable handler.
    handler: Handler = field(hash=False)
    kind: NodeKind = NodeKind.TASK
    required: Required | None = None
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
    errors: str = "fail"
    max_items: int | None = None
    resume_parked: bool = False
    #: Parks after which a parked item taken by this map runs to completion (P5).
    max_parks: int = MAX_PARKS
    #: The queue a child run is submitted to (None: run in this process) (R4).
    queue: str | None = None
    #: Whether ``handler`` is a :class:`~tailrace.Graph` run as a child run (R1).
    child: bool = False

    def quorum(self, count: int) -> int:
        """A map's k for ``count`` items (M3): ``required`` (or its value for the count), else all.

        >>> Node(id="m", handler=print, kind=NodeKind.MAP, required=lambda n: n // 2).quorum(9)
        4
        """
        required = self.required
        if required is None:
            return count
        k = required(count) if callable(required) else required
        if not _is_int(k):
            raise GraphError(f"map {self.id!r}: required({count}) returned {k!r}, not an integer")
        return int(k)

    def to_dict(self) -> dict[str, Any]:
        """JSON form; the handler is named by reference."""
        data: dict[str, Any] = {
            "id": self.id,
            "kind": self.kind.value,
            "handler": (
                graph_reference(self.handler, self.id)
                if self.child
                else callable_reference(self.handler, self.id)
            ),
        }
        optional: dict[str, Any] = {
            "required": (
                {"ref": callable_reference(self.required, self.id)}
                if callable(self.required)
                else self.required
            ),
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
            "errors": None if self.errors == "fail" else self.errors,
            "max_items": self.max_items,
            "resume_parked": self.resume_parked or None,
            "max_parks": None if self.max_parks == MAX_PARKS else self.max_parks,
            "queue": self.queue,
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
        "errors",
        "max_items",
        "resume_parked",
        "max_parks",
        "queue",
    }
)


#: What each node option accepts, and how the error says so (G1: at build time,
#: not as a TypeError when the run loop first compares it).
_OPTION_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "required": (
        _optional(lambda v: _is_int(v) or callable(v)),
        "an integer (a map's may be a function of its item count)",
    ),
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
    "late": (lambda v: v in LATE_POLICIES, " or ".join(map(repr, LATE_POLICIES))),
    "errors": (lambda v: v in ITEM_ERRORS, " or ".join(map(repr, ITEM_ERRORS))),
    "max_items": (_optional(lambda v: _is_int(v) and v >= 1), "an integer >= 1"),
    "resume_parked": (lambda v: isinstance(v, bool), "True or False"),
    "max_parks": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "queue": (_optional(lambda v: isinstance(v, str) and 0 < len(v) <= 200), "a queue name"),
}


def _check_option_types(node_id: str, **options: Any) -> None:
    for option, value in options.items():
        accepts, expected = _OPTION_RULES[option]
        if not accepts(value):
            raise GraphError(f"node {node_id!r}: {option} must be {expected}, got {value!r}")
