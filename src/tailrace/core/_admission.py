"""Admission: capacity bounds on handlers in flight, and the order queued nodes start in (E3, T2).

A :class:`SlotQueue` is a counting semaphore without awaiting: ``submit``
grants a slot at once (calling ``grant`` synchronously) or queues the ticket
by the policy's key; ``release`` hands the freed slot to the best live
ticket. Tickets are cancelled lazily, so a cancelled waiter never blocks the
queue. Only queued nodes are reordered: a node that got a slot keeps it.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from ..graph import Node

AdmissionKey = tuple[float, ...]


@runtime_checkable
class AdmissionPolicy(Protocol):
    """Orders queued nodes: smaller keys start first; arrival order breaks ties."""

    name: str

    def key(self, node: Node, payload: Any, estimate: float | None) -> AdmissionKey:
        """Sort key of ``node`` queued with ``payload`` and duration ``estimate`` (seconds or None)."""
        ...


class FifoPolicy:
    """First queued, first started."""

    name = "fifo"

    def key(self, node: Node, payload: Any, estimate: float | None) -> AdmissionKey:
        """Every node has the same key, so arrival order decides (``node``, ``payload``, ``estimate`` unused)."""
        return ()


class PriorityPolicy:
    """Higher ``Node.priority`` first."""

    name = "priority"

    def key(self, node: Node, payload: Any, estimate: float | None) -> AdmissionKey:
        """``-node.priority`` (``payload`` and ``estimate`` unused)."""
        return (-node.priority,)


class LptPolicy:
    """Longest estimated duration first (T2); nodes without an estimate go last."""

    name = "lpt"

    def key(self, node: Node, payload: Any, estimate: float | None) -> AdmissionKey:
        """``-estimate`` (``node`` and ``payload`` unused)."""
        return (float("inf"),) if estimate is None else (-estimate,)


POLICIES: dict[str, Callable[[], AdmissionPolicy]] = {
    "fifo": FifoPolicy,
    "priority": PriorityPolicy,
    "lpt": LptPolicy,
}


def resolve_policy(admission: str | AdmissionPolicy) -> AdmissionPolicy:
    """A policy object from a name (``fifo``, ``priority``, ``lpt``) or the object itself."""
    if isinstance(admission, str):
        try:
            return POLICIES[admission]()
        except KeyError:
            raise ValueError(
                f"unknown admission policy {admission!r}; choose one of {sorted(POLICIES)}"
            ) from None
    if not isinstance(admission, AdmissionPolicy):
        raise ValueError(f"admission={admission!r} is neither a policy name nor a policy object")
    return admission


class Ticket:
    """A queued request for a slot; ``cancel()`` withdraws it."""

    __slots__ = ("alive", "grant")

    def __init__(self, grant: Callable[[], None]) -> None:
        self.grant = grant
        self.alive = True

    def cancel(self) -> None:
        """Withdraw the request; the queue skips it."""
        self.alive = False


class SlotQueue:
    """``capacity`` slots (None: unlimited) and a priority queue of waiting tickets."""

    __slots__ = ("_counter", "_heap", "capacity", "in_use")

    def __init__(self, capacity: int | None) -> None:
        if capacity is not None and capacity < 1:
            raise ValueError(f"capacity must be >= 1 or None, got {capacity}")
        self.capacity = capacity
        self.in_use = 0
        self._heap: list[tuple[AdmissionKey, int, Ticket]] = []
        self._counter = itertools.count()

    def submit(self, key: AdmissionKey, ticket: Ticket) -> None:
        """Grant ``ticket`` now if a slot is free and nobody waits, else queue it by ``key``."""
        self._drop_dead()
        if not self._heap and (self.capacity is None or self.in_use < self.capacity):
            self.in_use += 1
            ticket.alive = False
            ticket.grant()
            return
        heapq.heappush(self._heap, (key, next(self._counter), ticket))

    def try_acquire(self) -> bool:
        """Take a slot if one is free and nobody waits for it (idle capacity); never queues."""
        self._drop_dead()
        if self._heap or (self.capacity is not None and self.in_use >= self.capacity):
            return False
        self.in_use += 1
        return True

    def release(self) -> None:
        """Free one slot and grant it to the best live ticket, if any."""
        self.in_use -= 1
        self._drop_dead()
        if self._heap and (self.capacity is None or self.in_use < self.capacity):
            _, _, ticket = heapq.heappop(self._heap)
            self.in_use += 1
            ticket.alive = False
            ticket.grant()

    def waiting(self) -> int:
        """Live tickets in the queue."""
        return sum(t.alive for _, _, t in self._heap)

    def _drop_dead(self) -> None:
        heap = self._heap
        while heap and not heap[0][2].alive:
            heapq.heappop(heap)
