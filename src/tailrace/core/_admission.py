"""Admission: capacity bounds on handlers in flight, and the order queued nodes start in (E3, T2).

A :class:`SlotQueue` is a counting semaphore without awaiting: ``submit``
grants a slot at once (calling ``grant`` synchronously) or queues the ticket
by the policy's key; ``release`` hands the freed slot to the best live
ticket. Tickets are cancelled lazily, so a cancelled waiter never blocks the
queue. Only queued nodes are reordered: a node that got a slot keeps it.
A backup's ticket (``submit_ahead``, T5) waits in a lane of its own that
every freed slot serves first, so a backup starts ahead of queued first
attempts; it never takes a slot from running work.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Hashable
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
    """``capacity`` slots (None: unlimited), a priority queue of waiting tickets, and the lane
    of backups' tickets ahead of it (T5)."""

    __slots__ = ("_ahead", "_counter", "_heap", "capacity", "in_use")

    def __init__(self, capacity: int | None) -> None:
        if capacity is not None and capacity < 1:
            raise ValueError(f"capacity must be >= 1 or None, got {capacity}")
        self.capacity = capacity
        self.in_use = 0
        self._heap: list[tuple[AdmissionKey, int, Ticket]] = []
        #: Backups' tickets, first come first served, ahead of every ticket in the heap.
        self._ahead: deque[Ticket] = deque()
        self._counter = itertools.count()

    def submit(self, key: AdmissionKey, ticket: Ticket) -> None:
        """Grant ``ticket`` now if a slot is free and nobody waits, else queue it by ``key``."""
        self._drop_dead()
        if (
            not self._heap
            and not self._ahead
            and (self.capacity is None or self.in_use < self.capacity)
        ):
            self.in_use += 1
            ticket.alive = False
            ticket.grant()
            return
        heapq.heappush(self._heap, (key, next(self._counter), ticket))

    def submit_ahead(self, ticket: Ticket) -> None:
        """Grant ``ticket`` now if a slot is free, else queue it ahead of every ticket queued
        by key (a backup, T5): the next slot freed is its, unless an earlier one waits."""
        self._drop_dead()
        if not self._ahead and (self.capacity is None or self.in_use < self.capacity):
            self.in_use += 1
            ticket.alive = False
            ticket.grant()
            return
        self._ahead.append(ticket)

    def try_acquire(self) -> bool:
        """Take a slot if one is free and nobody waits for it (idle capacity); never queues."""
        self._drop_dead()
        if (
            self._heap
            or self._ahead
            or (self.capacity is not None and self.in_use >= self.capacity)
        ):
            return False
        self.in_use += 1
        return True

    def release(self) -> None:
        """Free one slot and grant it to the first live backup's ticket, else the best live
        ticket, if any."""
        self.in_use -= 1
        self._drop_dead()
        if self.capacity is not None and self.in_use >= self.capacity:
            return
        if self._ahead:
            ticket = self._ahead.popleft()
        elif self._heap:
            _, _, ticket = heapq.heappop(self._heap)
        else:
            return
        self.in_use += 1
        ticket.alive = False
        ticket.grant()

    def waiting(self) -> int:
        """Live tickets in the queue (backups' included)."""
        return sum(t.alive for _, _, t in self._heap) + sum(t.alive for t in self._ahead)

    def _drop_dead(self) -> None:
        heap = self._heap
        while heap and not heap[0][2].alive:
            heapq.heappop(heap)
        ahead = self._ahead
        while ahead and not ahead[0].alive:
            ahead.popleft()


#: What admission queues: (node index, item index), the item -1 for a node's own attempt.
Unit = tuple[int, int]

#: A unit that holds a slot: (node index, visit, item index).
HeldUnit = tuple[int, int, int]


class _Slotted(Protocol):
    """What :class:`RunAdmission` reads of an attempt: its unit, and its own identity."""

    index: int
    visit: int
    item: int


class RunAdmission:
    """One run's side of admission (E3): its queued tickets and the slots its units hold.

    A unit (a node's visit, or one item of a map's visit, M2) takes one slot
    of the engine and one of the run when admission grants it, and gives them
    back once, through :meth:`release`, whichever path ends it: a harvest, a
    hedge that lost, a child run that started (it holds no slot, R4), a late
    input or item cancelled or parked, a failure or the run's end. A backup
    (T5, asked for ahead of queued units with :meth:`ask_ahead`) or a clone
    on idle capacity (:meth:`take_idle`) holds an extra slot of its own until
    it ends (:meth:`release_extra`). Releasing is idempotent, and
    :meth:`release_all` frees whatever is still held when the run stops, so a
    slot can neither leak nor be freed twice.
    """

    __slots__ = (
        "_asked", "_engine", "_extra", "_halfway", "_held", "_run", "bounded", "policy", "tickets",
    )  # fmt: skip

    def __init__(
        self, engine_slots: SlotQueue | None, run_capacity: int | None, policy: AdmissionPolicy
    ) -> None:
        self._engine = engine_slots
        self._run = SlotQueue(run_capacity) if run_capacity is not None else None
        self.policy = policy
        #: Whether slots are counted at all (a capacity per engine or per run).
        self.bounded = engine_slots is not None or run_capacity is not None
        #: Units waiting for a slot, by unit.
        self.tickets: dict[Unit, Ticket] = {}
        self._held: dict[HeldUnit, None] = {}
        self._extra: dict[_Slotted, None] = {}
        #: Backups' requests waiting ahead of the queue, by what names them (T5).
        self._asked: dict[Hashable, Ticket] = {}
        #: Those of them that hold the run's slot while they wait for the engine's.
        self._halfway: dict[Hashable, None] = {}

    def admit(self, unit: Unit, key: AdmissionKey, granted: Callable[[Unit], None]) -> None:
        """Ask for a slot of the run, then of the engine, for ``unit``; ``granted(unit)`` starts
        it once both are granted (at once when they are free, E3)."""
        engine_slots = self._engine

        def granted_by_engine() -> None:
            self.tickets.pop(unit, None)
            granted(unit)

        def granted_by_run() -> None:
            if engine_slots is None:
                granted_by_engine()
                return
            ticket = Ticket(granted_by_engine)
            self.tickets[unit] = ticket
            engine_slots.submit(key, ticket)

        if self._run is None:
            granted_by_run()
            return
        ticket = Ticket(granted_by_run)
        self.tickets[unit] = ticket
        self._run.submit(key, ticket)

    def hold(self, attempt: _Slotted) -> None:
        """``attempt``'s unit started on the slot admission granted it."""
        self._held[(attempt.index, attempt.visit, attempt.item)] = None

    def holds(self, attempt: _Slotted) -> bool:
        """Whether ``attempt``'s unit still holds its slot."""
        return (attempt.index, attempt.visit, attempt.item) in self._held

    def release(self, attempt: _Slotted) -> None:
        """Free the slot of ``attempt``'s unit, if it still holds one, and its extra slot."""
        try:
            del self._held[(attempt.index, attempt.visit, attempt.item)]
        except KeyError:
            pass
        else:
            self._free()
        self.release_extra(attempt)

    def release_unit(self, index: int, visit: int, item: int) -> None:
        """Free the slot of unit ``(index, visit, item)``, if it holds one."""
        try:
            del self._held[(index, visit, item)]
        except KeyError:
            return
        self._free()

    def take_idle(self) -> bool:
        """Take a slot of the engine and of the run if both have one nobody waits for.

        For clones at launch (T5): they use idle capacity only, so they never
        delay a first attempt; the attempt that gets it is named with
        :meth:`hold_extra` (or the slot freed with :meth:`give_back`).
        """
        engine_slots, run_slots = self._engine, self._run
        if engine_slots is not None and not engine_slots.try_acquire():
            return False
        if run_slots is not None and not run_slots.try_acquire():
            if engine_slots is not None:
                engine_slots.release()
            return False
        return True

    def ask_ahead(self, request: Hashable, granted: Callable[[], None]) -> None:
        """Ask for a slot of the run, then of the engine, ahead of every queued unit, for a
        backup (T5): ``granted()`` is called once both are held (at once when both are
        free); it never takes a slot a running unit holds.

        ``request`` names the request for :meth:`withdraw`. Once granted, the
        slot is the caller's: named with :meth:`hold_extra` when the backup
        starts, or freed with :meth:`give_back` when it does not.
        """
        engine_slots, run_slots = self._engine, self._run
        if engine_slots is None and run_slots is None:
            granted()
            return

        def granted_by_engine() -> None:
            self._asked.pop(request, None)
            self._halfway.pop(request, None)
            granted()

        def granted_by_run() -> None:
            if engine_slots is None:
                granted_by_engine()
                return
            self._halfway[request] = None
            ticket = Ticket(granted_by_engine)
            self._asked[request] = ticket
            engine_slots.submit_ahead(ticket)

        if run_slots is None:
            granted_by_run()
            return
        ticket = Ticket(granted_by_run)
        self._asked[request] = ticket
        run_slots.submit_ahead(ticket)

    def withdraw(self, request: Hashable) -> None:
        """Withdraw the backup's request ``request`` if it still waits (its straggler ended)."""
        ticket = self._asked.pop(request, None)
        if ticket is None:
            return
        ticket.cancel()
        if request in self._halfway:  # it held the run's slot while it waited for the engine's
            del self._halfway[request]
            if self._run is not None:
                self._run.release()

    def give_back(self) -> None:
        """Free the slot :meth:`ask_ahead` granted for a backup that did not start after all."""
        self._free()

    def hold_extra(self, attempt: _Slotted) -> None:
        """``attempt`` holds the slot :meth:`take_idle` took, until it ends."""
        if self.bounded:
            self._extra[attempt] = None

    def release_extra(self, attempt: _Slotted) -> None:
        """Free the extra slot a clone or backup ``attempt`` holds, if it does."""
        if self._extra and attempt in self._extra:
            del self._extra[attempt]
            self._free()

    def cancel(self, unit: Unit) -> None:
        """Withdraw ``unit``'s ticket if it waits for a slot."""
        ticket = self.tickets.pop(unit, None)
        if ticket is not None:
            ticket.cancel()

    def cancel_node(self, index: int) -> None:
        """Withdraw the tickets of every unit of node ``index``."""
        for unit in [u for u in self.tickets if u[0] == index]:
            self.tickets.pop(unit).cancel()

    def cancel_all(self) -> list[Unit]:
        """Withdraw every ticket, backups' included; the units that waited."""
        tickets, self.tickets = self.tickets, {}
        for ticket in tickets.values():
            ticket.cancel()
        asked = list(self._asked)
        for ticket in self._asked.values():  # all first: no run slot freed below goes to one
            ticket.cancel()
        for request in asked:
            self.withdraw(request)
        return list(tickets)

    def release_all(self) -> list[HeldUnit]:
        """Free every slot still held (the run stops); the units that held one.

        Tickets are withdrawn first, so that no slot freed here goes to this run.
        """
        self.cancel_all()
        held, self._held = self._held, {}
        extra, self._extra = self._extra, {}
        for _ in range(len(held) + len(extra)):
            self._free()
        return list(held)

    def _free(self) -> None:
        if self._engine is not None:
            self._engine.release()
        if self._run is not None:
            self._run.release()
