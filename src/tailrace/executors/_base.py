"""The executor seam: where one handler attempt runs (DESIGN "Architecture", "Scale-out").

An :class:`Executor` runs a node's handler on one payload and hands back the
result, or raises. That is all it does. The run loop keeps everything else:
dispatch, first-k, retries, timeouts, hedging, straggler timers, cancellation
and commits stay where they are (E1-E11, T3), and the engine stays the only
writer of run state. The contract, for whoever writes an executor:

``async invoke(node, payload, context) -> result``
    Run ``node.handler(payload)`` once (one try of one attempt) and return its
    result, or raise the handler's own exception unwrapped (E9 re-raises it;
    ``RetryPolicy.retry_on`` matches on its class). Never retry: the run loop
    does, and records every try as an event (E11). ``context`` is an
    :class:`AttemptContext`: run id, node id, visit, try number and whether this
    is a hedged backup (T3). ``current_node()`` already returns it in the
    calling task; an executor that runs the handler in another process sets it
    there too.

Cancellation
    The run loop cancels the task awaiting ``invoke`` on failure teardown (E9),
    for a hedge loser (T3), on a node timeout (E11) and when the caller cancels
    the run. ``invoke`` then stops the work it started, waits (boundedly) until
    it has stopped, and re-raises ``CancelledError``; it never swallows it.

Lost workers
    When the place running the handler dies (a worker process, a cluster
    node), ``invoke`` raises :class:`~tailrace.ExecutorLost`, naming the node, so
    the node's retry policy applies like for any failed try.

Payloads
    ``payload`` is the value the engine holds (JSON-shaped for a durable run,
    Python objects in memory). An executor that ships it to another process
    encodes it with a codec and decodes the result the same way (D5): run state
    is never pickled.

``async aclose()``
    Release what the executor holds; idempotent. The engine never calls it:
    whoever made the executor closes it (``async with executor:``).

Wrapping
    An executor may wrap another, e.g. one that opens a tracing span per
    attempt: a context variable it sets before ``await inner.invoke(...)`` is
    seen by the handler under :class:`LocalExecutor` (an async handler runs in
    the calling task, a sync one in a copy of its context)::

        class Traced:
            def __init__(self, inner): self.inner = inner
            async def invoke(self, node, payload, context):
                with tracer.start_as_current_span(f"node {context.node_id}") as span:
                    span.set_attribute("tailrace.hedge", context.hedge)
                    return await self.inner.invoke(node, payload, context)
            async def aclose(self): await self.inner.aclose()

>>> import asyncio
>>> from tailrace import Graph
>>> g = Graph("g")
>>> node = g.add_node("double", lambda x: 2 * x)
>>> ctx = AttemptContext(run_id="r", node_id="double", visit=1, attempt=1)
>>> asyncio.run(LocalExecutor().invoke(node, 21, ctx))
42
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol, Self, runtime_checkable

from .._context import NodeContext
from .._errors import GraphError
from ..graph import is_async_callable
from ._threads import current_threads, run_sync

if TYPE_CHECKING:
    from ..graph import Node, Topology


@dataclass(frozen=True, slots=True, kw_only=True)
class AttemptContext(NodeContext):
    """One try of one attempt, as an executor sees it.

    ``run_id``, ``node_id``, ``visit`` (1-based) and ``attempt`` (the try,
    1-based) as in :class:`~tailrace.NodeContext`; ``hedge`` is true for a
    backup attempt started because the first one straggled (T3).
    """

    hedge: bool = False


@runtime_checkable
class Executor(Protocol):
    """Runs one handler attempt somewhere; see the module docstring for the contract."""

    async def invoke(self, node: Node, payload: Any, context: AttemptContext) -> Any:
        """Run ``node.handler(payload)`` once for the attempt ``context``; return or raise its outcome."""
        ...

    async def aclose(self) -> None:
        """Release what this executor holds; idempotent."""
        ...


class LocalExecutor:
    """Today's behaviour, in the driving process: the engine's default.

    An async handler runs on the event loop; a sync one in a thread of the
    engine's pool for ``def`` handlers (outside an engine, the loop's default
    pool), in a copy of the caller's context. Node ``resources`` and
    ``runtime_env`` are ignored. The engine runs nodes of the default
    ``LocalExecutor`` inline (this class is the same code, for wrapping).
    """

    __slots__ = ()

    async def invoke(self, node: Node, payload: Any, context: AttemptContext) -> Any:
        """Run ``node.handler(payload)`` here; ``context`` is already current (see :class:`Executor`)."""
        handler = node.handler
        if is_async_callable(handler):
            return await handler(payload)
        return await run_sync(current_threads.get(), handler, payload)

    async def aclose(self) -> None:
        """Nothing to release."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


def _is_inline(executor: Executor | None) -> bool:
    """The engine's own fast path covers a plain :class:`LocalExecutor` (not a subclass)."""
    return executor is None or type(executor) is LocalExecutor


class ExecutorTable:
    """The engine's executors, resolved per node: ``plan(topo)``.

    ``default`` runs nodes that name no executor (None: local); ``named``
    maps the names that nodes' ``executor=`` options use to executors.
    """

    __slots__ = ("_default", "_named", "_plans")

    #: Plans kept per compiled topology; the cache is dropped whole past this many.
    MAX_PLANS = 64

    def __init__(self, default: Executor | None, named: Mapping[str, Executor] | None) -> None:
        for name, executor in (named or {}).items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"executor names must be non-empty strings, got {name!r}")
            _check_executor(executor, f"executors[{name!r}]")
        if default is not None:
            _check_executor(default, "executor")
        self._default = None if _is_inline(default) else default
        self._named = dict(named or {})
        self._plans: dict[int, tuple[Topology, list[Executor | None] | None]] = {}

    def plan(self, topo: Topology) -> list[Executor | None] | None:
        """Each node's executor by index (None: inline), or None when every node runs inline.

        An executor name no entry of ``named`` has raises :class:`GraphError`
        naming the node and the name; the engine asks before it writes
        anything for a run, so a misnamed executor never fails a run midway.
        """
        cached = self._plans.get(id(topo))
        if cached is not None and cached[0] is topo:
            return cached[1]
        plan = self._resolve(topo)
        if len(self._plans) >= self.MAX_PLANS:
            self._plans.clear()
        self._plans[id(topo)] = (topo, plan)
        return plan

    def wrapped(self, wrap: Callable[[Executor, str | None], Executor]) -> ExecutorTable:
        """A table of the same names whose every executor is ``wrap(executor, name)``.

        The default is wrapped too (``name`` None; a :class:`LocalExecutor`
        when attempts run inline here), e.g. by an instrument that opens a
        span around each attempt (see :mod:`tailrace.core._instruments`).

        Args:
            wrap: makes the executor to use from an executor and its name.
        """
        default = wrap(self._default or LocalExecutor(), None)
        return ExecutorTable(default, {name: wrap(e, name) for name, e in self._named.items()})

    def _resolve(self, topo: Topology) -> list[Executor | None] | None:
        plan: list[Executor | None] = []
        for node in topo.nodes:
            if node.executor is None:
                plan.append(self._default)
                continue
            executor = self._named.get(node.executor)
            if executor is None:
                known = ", ".join(repr(n) for n in sorted(self._named)) or "none"
                raise GraphError(
                    f"graph {topo.graph.name!r}: node {node.id!r} runs on executor "
                    f"{node.executor!r}, which this engine does not have (its executors: {known})"
                )
            plan.append(None if _is_inline(executor) else executor)
        return plan if any(e is not None for e in plan) else None


def _check_executor(executor: Any, where: str) -> None:
    if not isinstance(executor, Executor):
        raise TypeError(f"{where}: {executor!r} is not an executor (it needs invoke and aclose)")
