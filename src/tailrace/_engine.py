"""Engine: runs and resumes runs; owns the store, admission, event bus and leases.

>>> g = Graph("double")
>>> @g.task()
... async def double(x):
...     return 2 * x
>>> run(g, 21).results["double"]
42
"""

from __future__ import annotations

import asyncio
import os
import socket
import uuid
from typing import TYPE_CHECKING, Any

from ._admission import AdmissionPolicy, SlotQueue, resolve_policy
from ._errors import GraphMismatch, NotResumable
from ._events import EventBus, EventType
from ._graph import Graph
from ._runloop import RunLoop, RunResult
from ._state import LateInput, RunState
from ._topology import Topology

if TYPE_CHECKING:
    from ._codec import Codec
    from .stores import RunStore
    from .tail._hooks import TailHooks


class Engine:
    """Runs graphs: concurrent, eager, optionally durable.

    ``capacity`` bounds handlers in flight across all runs of this engine and
    ``run_capacity`` within one run (None: unbounded; E3); ``admission``
    orders queued nodes (``"fifo"``, ``"priority"``, ``"lpt"`` or a policy
    object); ``store`` makes runs durable (None keeps them in memory only);
    ``bus`` receives events; ``codec`` encodes payloads for the store
    (default strict JSON); ``owner`` names this engine in leases; ``lease_ttl``
    is the lease lifetime in seconds, renewed at a third of it;
    ``straggler_factor`` flags attempts running past that many times their
    estimate (T3); ``tail`` supplies duration estimators and hedging (default:
    built when a node declares a cost or hedges, or admission is ``"lpt"``).
    """

    def __init__(
        self,
        *,
        capacity: int | None = None,
        run_capacity: int | None = None,
        admission: str | AdmissionPolicy = "fifo",
        store: RunStore | None = None,
        bus: EventBus | None = None,
        codec: Codec | None = None,
        owner: str | None = None,
        lease_ttl: float = 30.0,
        straggler_factor: float = 3.0,
        tail: TailHooks | None = None,
    ) -> None:
        if run_capacity is not None and run_capacity < 1:
            raise ValueError(f"run_capacity must be >= 1 or None, got {run_capacity}")
        if not 0 < lease_ttl < float("inf"):
            raise ValueError(f"lease_ttl must be a positive number of seconds, got {lease_ttl}")
        if straggler_factor <= 1.0:
            raise ValueError(f"straggler_factor must be > 1, got {straggler_factor}")
        self.policy = resolve_policy(admission)
        self.slots = SlotQueue(capacity) if capacity is not None else None
        self.run_capacity = run_capacity
        self.store = store
        self.bus = bus if bus is not None else EventBus()
        self.codec = codec
        self.owner = owner or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.lease_ttl = lease_ttl
        self.straggler_factor = straggler_factor
        self._tail = tail

    # -- public API -----------------------------------------------------------

    async def run(
        self,
        graph: Graph,
        input: Any = None,
        *,
        run_id: str | None = None,
        graph_ref: str | None = None,
    ) -> RunResult:
        """Run ``graph`` on ``input`` and return its :class:`RunResult`.

        ``run_id`` names the run (default: a fresh uuid); ``graph_ref``
        (``module:attribute``) tells another process where to find the graph
        to resume it. A handler's exception is re-raised unwrapped (E9).
        """
        topo = graph.compile()
        run_id = run_id or uuid.uuid4().hex
        state = RunState(topo)
        state.activate_entries(input)
        if self.store is None:
            loop = self._loop_for(run_id, state, None)
            loop.emit(EventType.RUN_STARTED, graph=graph.name)
            return await loop.drive()
        from ._persist import Persister

        persister = await Persister.create(
            self, run_id, graph, topo, input, graph_ref or _guess_ref(graph)
        )
        async with persister.leased():
            loop = self._loop_for(run_id, state, persister)
            loop.emit(EventType.RUN_STARTED, graph=graph.name)
            return await loop.drive()

    async def resume(
        self, run_id: str, graph: Graph | None = None, *, force: bool = False
    ) -> RunResult:
        """Resume the durable run ``run_id`` where it stopped (D3).

        Nodes that were running are re-run; completed results and first-k
        decisions are reused. ``graph`` defaults to the one the run recorded
        (by ``module:attribute`` reference); a graph whose structural
        fingerprint differs is refused with :class:`GraphMismatch` unless
        ``force`` is true.
        """
        from ._persist import Persister

        store = self._require_store("resume")
        stored = await store.load_run(run_id)
        if stored.run.status in ("completed", "failed", "cancelled"):
            raise NotResumable(f"run {run_id!r} is {stored.run.status}; nothing to resume")
        graph = graph or Persister.find_graph(stored.run)
        topo = graph.compile()
        if topo.fingerprint != stored.run.fingerprint and not force:
            raise GraphMismatch(
                f"run {run_id!r} started with graph fingerprint {stored.run.fingerprint}, "
                f"but {graph.name!r} now has {topo.fingerprint}; pass force=True to resume anyway"
            )
        persister = Persister(self, run_id, topo, stored.run)
        async with persister.leased():
            stored = await store.load_run(run_id)  # re-read under the lease
            late = [
                LateInput(
                    node_id=e.node_id or "",
                    source_id=str(data.get("source")),
                    activation=e.visit or 0,
                    reason=str(data.get("reason")),
                )
                for e in await store.events(run_id)
                if e.type == EventType.NODE_LATE_INPUT.value
                for data in (self._decode_event(e.data_json),)
            ]
            state, event_seq = persister.restore(stored, late)
            loop = self._loop_for(run_id, state, persister, event_seq)
            loop.emit(EventType.RUN_RESUMED, graph=graph.name)
            return await loop.drive()

    # -- internals ------------------------------------------------------------

    def _decode_event(self, text: str) -> dict[str, Any]:
        from ._codec import DEFAULT_CODEC

        data = (self.codec or DEFAULT_CODEC).decode(text)
        return data if isinstance(data, dict) else {}

    def _loop_for(
        self, run_id: str, state: RunState, persister: Any, event_seq: int = 0
    ) -> RunLoop:
        return RunLoop(
            run_id=run_id,
            state=state,
            publish=self.bus.publish if self.bus.active else None,
            persister=persister,
            engine_slots=self.slots,
            run_capacity=self.run_capacity,
            policy=self.policy,
            tail=self._tail_for(state.topo),
            event_seq=event_seq,
        )

    def _tail_for(self, topo: Topology) -> TailHooks | None:
        if self._tail is not None:
            return self._tail
        needs = self.policy.name == "lpt" or any(n.cost is not None or n.hedge for n in topo.nodes)
        if not needs:
            return None
        from .tail._hooks import TailHooks

        self._tail = TailHooks(factor=self.straggler_factor)
        return self._tail

    def _require_store(self, what: str) -> RunStore:
        if self.store is None:
            raise NotResumable(f"{what} needs a durable store: Engine(store=SQLiteStore(...))")
        return self.store


def _guess_ref(graph: Graph) -> str | None:
    """``module:name`` of the graph, looked up in the modules that define its handlers."""
    import sys

    seen: set[str] = set()
    for node in graph.nodes.values():
        module_name = getattr(node.handler, "__module__", None) or ""
        if module_name in seen or module_name == "__main__":
            continue
        seen.add(module_name)
        module = sys.modules.get(module_name)
        for attr, value in vars(module).items() if module is not None else ():
            if value is graph:
                return f"{module_name}:{attr}"
    return None


def run(graph: Graph, input: Any = None, **engine_options: Any) -> RunResult:
    """Run ``graph`` on ``input`` synchronously with ``Engine(**engine_options)``.

    A convenience for scripts; inside async code, use ``await Engine().run(...)``.
    """
    return asyncio.run(Engine(**engine_options).run(graph, input))
