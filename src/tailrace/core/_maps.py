"""Map nodes in a running run (M1-M6): expansion, item attempts, the decision, late items.

The run loop holds one :class:`MapNodes` when its graph has map nodes. Each
item of a map's visit is a unit of its own (M2): admitted, started, hedged
and harvested like a node's attempt, by item index. The pure decisions
(the plan of a visit, first-k over the items, what is late) are
:mod:`._state`'s; this module does what they imply in a live run: it starts
item attempts, records their ends, decides the map, and cancels or parks
(P3) what is late. Maps with ``resume_parked`` first claim the parked items
of their node from the store (P4).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from .._errors import EncodeError, MapError
from .._events import EventType
from ..stores import ParkedRow
from ..tail import TailHooks
from ._admission import RunAdmission, Unit
from ._checkpoints import Checkpoints
from ._hedger import Hedger
from ._inflight import Attempt, InFlight, describe, traceback_text
from ._outbox import Outbox
from ._state import (
    OPEN_ITEMS,
    ItemStatus,
    MapItems,
    NodeStatus,
    RunState,
    map_plan,
    parked_fit,
    parked_room,
)
from ._streams import Streams
from ._writer import RunWriter


class MapNodes:
    """The map nodes of one run: their visits' items from expansion to decision (M1-M6).

    It is handed the run's values (state, outbox, admission, in-flight set,
    checkpoints, streams, writer, tail hooks, hedger, the per-node durations
    it adds a map's time to) and two callbacks: ``launch(attempt, payload,
    data)`` runs an item's attempt as a task, and ``fired(frozen_before)``
    reports the first-k decisions a map's completion made downstream.
    """

    def __init__(
        self,
        *,
        run_id: str,
        state: RunState,
        outbox: Outbox,
        admission: RunAdmission,
        inflight: InFlight,
        checkpoints: Checkpoints,
        streams: Streams,
        writer: RunWriter | None,
        tail: TailHooks | None,
        hedger: Hedger | None,
        durations: list[float],
        launch: Callable[[Attempt, Any, Mapping[str, Any] | None], None],
        fired: Callable[[int], None],
    ) -> None:
        self.run_id = run_id
        self.state = state
        self.topo = state.topo
        self._outbox = outbox
        self._admission = admission
        self._inflight = inflight
        self._checkpoints = checkpoints
        self._streams = streams
        self._writer = writer
        self._tail = tail
        self._hedger = hedger
        self._durations = durations
        self._launch = launch
        self._fired = fired
        #: Maps waiting to claim parked items before their items start (P4).
        self.claims: list[int] = []
        #: Claimed parked items given back to ``parked`` with the next write, as
        #: ``(claimant, park_id)`` (P4).
        self.unclaimed: list[tuple[str, str]] = []
        #: Late child run items whose abandoned attempts still end (see :meth:`settle`).
        self.settling: set[tuple[MapItems, int]] = set()

    # -- expansion (M1, P4) -------------------------------------------------------

    def expand(self, i: int, parked: list[ParkedRow] | None = None) -> list[int]:
        """Start map ``i``'s visit (M1); the items to dispatch now, in item order.

        A bad input fails the node (E9) and an empty list completes it with
        ``[]``, both through the next harvest. A visit restored mid-way (D3,
        M6) dispatches only the items that had not ended. A map with
        ``resume_parked`` first claims the parked items of its node (see
        :meth:`take_parked`); they become its first items (P4).
        """
        state = self.state
        ns = state.nodes[i]
        items = ns.items
        now = time.monotonic()
        node = self.topo.nodes[i]
        if items is None and parked is None and node.resume_parked and self._writer is not None:
            self.claims.append(i)  # claimed from the store before its items start
            return []
        if items is None:
            payload = ns.payload
            if parked and isinstance(payload, list | tuple):
                codec = self._checkpoints.codec
                payload = [codec.decode(row.value_json) for row in parked] + list(payload)
            try:
                values, k = map_plan(node, payload)
            except MapError as exc:
                state.start(i, now)
                self._settled(i, error=exc)
                return []
            items = state.expand(i, values, k, now)
            if parked:
                items.took_parked(parked, node.max_parks)
                self._checkpoints.unpark(node.id, items.visit, parked)
                state.dirty[i] = None
            self._outbox.emit(EventType.NODE_STARTED, i, ns.visits, ns.attempts, items=len(values))
            if not values:
                self._settled(i, value=[])
                return []
        elif ns.status is NodeStatus.QUEUED:  # restored with some items ended
            state.start(i, now)
            self._outbox.emit(
                EventType.NODE_STARTED, i, ns.visits, ns.attempts, items=len(items), resumed=True
            )
        return items.pending()

    async def take_parked(self) -> list[Unit]:
        """Claim, for each map waiting on it, the parked items of its node (P4); the units to
        dispatch. Each parked item is claimed by exactly one map visit across processes.

        A map claims at most what it may run: ``max_items`` less its own items,
        and never so many that its plan fails for them (a ``required``
        function of the count); what it claimed past that goes back to parked.
        """
        claims, self.claims = self.claims, []
        assert self._writer is not None
        store = self._writer.store
        units: list[Unit] = []
        for i in claims:
            node, payload = self.topo.nodes[i], self.state.nodes[i].payload
            claimant = self._claimant(i, self.state.nodes[i].visits)
            room = parked_room(node, payload)
            rows = []
            if room > 0:
                rows = await store.claim_parked(self.topo.graph.name, node.id, claimant, limit=room)
            keep = parked_fit(node, payload, len(rows))
            if keep < len(rows):
                await store.unclaim_parked(claimant, [row.park_id for row in rows[keep:]])
            units.extend((i, j) for j in self.expand(i, rows[:keep]))
        return units

    def _claimant(self, i: int, visit: int) -> str:
        """Who claims parked items for map ``i``'s ``visit`` (P4): the visit, by its place."""
        return f"{self.run_id}/{self.topo.ids[i]}/{visit}"

    def give_back_unfinished(self) -> None:
        """The run ends failed: the parked items its maps claimed and did not finish go back
        to parked, in their order, with the run's final write (P4).

        A visit that was not decided gives back every claimed item without a
        result; a decided one, those still running (``late="record"``) when
        the run ends. Items the map's own ``late`` policy cancelled or parked
        again are settled.
        """
        for i, ns in enumerate(self.state.nodes):
            items = ns.items
            if items is None or not items.parked:
                continue
            claimant = self._claimant(i, items.visit)
            decided = items.winners is not None
            for j, park_id in enumerate(items.parked):
                status = items.status[j]
                if status in OPEN_ITEMS or (not decided and status is ItemStatus.FAILED):
                    self.unclaimed.append((claimant, park_id))

    def _settled(self, i: int, *, value: Any = None, error: BaseException | None = None) -> None:
        """Map ``i``'s own outcome, known at its dispatch: harvested like an attempt's end."""
        ns = self.state.nodes[i]
        attempt = Attempt(i, ns.visits, time.monotonic(), False, ns.attempts or 1)
        attempt.value = value
        attempt.error = error
        attempt.finished = True
        self._inflight.done.append(attempt)

    # -- item attempts (M2) -------------------------------------------------------

    def start_item(
        self, i: int, j: int, *, hedge: bool = False, items: MapItems | None = None
    ) -> Attempt:
        """Start an attempt of item ``j`` of map ``i`` (of ``items``, default its current visit)."""
        items = items or self.state.nodes[i].items
        assert items is not None
        if not hedge:
            items.start(j)
        attempt = Attempt(i, items.visit, time.monotonic(), hedge, items.attempts[j] or 1, j, items)
        self._launch(attempt, items.values[j], {"item": j, "hedge": True} if hedge else {"item": j})
        return attempt

    def harvest_item(
        self, attempt: Attempt, now: float, failing: Attempt | None
    ) -> BaseException | None:
        """Record a finished item attempt; the error that fails its map, if it does (M4).

        ``failing`` is the attempt whose failure fails the run in this harvest, if any.
        """
        items, j = attempt.items, attempt.item
        assert items is not None
        if items.status[j] is not ItemStatus.RUNNING:
            return None  # ended already (cancelled as late while it finished)
        i = attempt.index
        if failing is not None and failing.index == i:
            return None  # its map fails in this harvest: nothing after that decides it (E9)
        exc = attempt.error
        value = attempt.value
        text = None
        if exc is None and self._writer is not None:
            try:
                value, text = self._writer.canonical_item(self.topo.ids[i], items.visit, j, value)
            except EncodeError as error:
                exc = error
        if exc is not None:
            return self._item_failed(attempt, exc)
        if self._tail is not None:
            node = self.topo.nodes[i]
            self._tail.observe(node, items.values[j], now - attempt.started, attempt.straggled)
        items.texts[j] = text
        decides = self.state.item_succeeded(items, j, value)
        if attempt.stream is not None:
            self._streams.end(attempt, accepted=True)  # committed with this harvest (S2)
        self._outbox.put(
            EventType.NODE_COMPLETED, i, attempt.visit, attempt.tries,
            {"duration": now - attempt.started, "hedge": attempt.hedge, "item": j},
        )  # fmt: skip
        if decides:
            self._decide(items, now)
        return None

    def _item_failed(self, attempt: Attempt, exc: BaseException) -> BaseException | None:
        """Item ``attempt.item`` failed for good: record it; what fails the map, if anything (M4)."""
        items, j, i = attempt.items, attempt.item, attempt.index
        assert items is not None
        decided = items.winners is not None
        decidable = self.state.item_failed(items, j, describe(exc))
        self._outbox.emit(
            EventType.NODE_FAILED, i, attempt.visit, attempt.tries,
            item=j, error=describe(exc), traceback=traceback_text(exc),
        )  # fmt: skip
        if decided:
            return None  # a late item: its failure changes nothing
        node = self.topo.nodes[i]
        if node.errors == "fail":
            return exc  # E9: the item's own exception fails the node and the run
        if items.hopeless():
            k = "every item" if items.k is None else f"k={items.k}"
            return MapError(
                f"map {node.id!r}: {items.failed} of {len(items)} items failed, so fewer "
                f"than {k} can still succeed; errors: "
                + "; ".join(f"item {e}: {text}" for e, text in sorted(items.errors.items())),
                errors=items.errors,
            )
        if decidable:
            self._decide(items, time.monotonic())
        return None

    # -- the decision and late items (M3, M5, P3) ---------------------------------

    def _decide(self, items: MapItems, now: float) -> None:
        """Decide map ``items`` (M3): complete its node with the output; cancel late items (M5)."""
        i = items.node
        ns = self.state.nodes[i]
        frozen_before = len(self.state.frozen)
        output = self.state.decide_map(items)
        winners = list(items.winners or ())
        self._durations[i] += now - ns.started_at  # a map's time: expansion to decision
        self._outbox.emit(
            EventType.NODE_COMPLETED, i, items.visit, ns.attempts, duration=now - ns.started_at,
            hedge=False, items=len(items), k=len(winners), winners=winners,
        )  # fmt: skip
        if self._writer is not None:
            texts = [items.texts[w] for w in winners]
            text = None if None in texts else "[" + ",".join(t for t in texts if t) + "]"
            self._writer.result_completed(i, items.visit, output, text=text)
        if len(self.state.frozen) != frozen_before:
            self._fired(frozen_before)
        late = self.topo.nodes[i].late
        if late != "record":
            self._cancel_items(items, items.unfinished(), park=late == "park")

    def _cancel_items(self, items: MapItems, late: list[int], *, park: bool = False) -> None:
        """Cancel the items of ``items`` still queued or running at its decision (M5); with
        ``park``, keep each as a parked item (P3).

        A child run's item whose attempt ended, or is ending, is settled by its
        attempt instead (:meth:`settle`): a child that completed before its
        cancel arrived stays completed, and its item is late with reason
        ``fired``, as under ``late="record"`` (R3).
        """
        if not late:
            return
        i = items.node
        admission = self._admission
        for j in late:  # first, so that no slot freed below goes to a late item
            admission.cancel((i, j))
        wanted = set(late)
        child = self.topo.nodes[i].child and not park
        for attempt in self._inflight.attempts:
            if attempt.items is items and attempt.item in wanted and not attempt.abandoned:
                attempt.abandon()  # its end is no failure
                if child:
                    self.settling.add((items, attempt.item))
        node_id, graph_name = self.topo.ids[i], self.topo.graph.name
        for j in late:
            admission.release_unit(i, items.visit, j)
            if self._hedger is not None:
                self._hedger.live.pop((i, j), None)
            if child and items.status[j] is ItemStatus.RUNNING:
                continue  # its attempt tells how its child ended (its harvest, or settle)
            row = None
            if park:
                row = self._checkpoints.park(
                    graph_name, node_id, items.visit, j, items.values[j],
                    origin=items.parks[j] if j < len(items.parks) else None,
                )  # fmt: skip
            if row is not None:
                self._outbox.parked.append(row)
            self._cancelled(items, j, parked=row is not None)

    def _cancelled(self, items: MapItems, j: int, *, parked: bool = False) -> None:
        """Record item ``j`` of ``items`` cancelled as late (M5), or parked (P3)."""
        self.state.item_cancelled(items, j, parked=parked)
        self._outbox.emit(
            EventType.NODE_CANCELLED, items.node, items.visit, items.attempts[j] or None,
            item=j, reason="parked" if parked else "late",
        )  # fmt: skip

    def settle(self, attempt: Attempt, now: float) -> None:
        """An abandoned attempt of a late child run's item ended: record how (M5, R3).

        An attempt that returned its child's output (the child completed
        before its cancel arrived) makes the item late with reason ``fired``;
        otherwise the item is cancelled once no other attempt of it (a hedge)
        is still ending.
        """
        items, j = attempt.items, attempt.item
        key = (items, j)
        if key not in self.settling or items is None:
            return
        if attempt.error is None:
            self.settling.discard(key)
            self.harvest_item(attempt, now, None)  # late: it decides nothing
            return
        if any(a.items is items and a.item == j for a in self._inflight.attempts):
            return  # another attempt of the item is still ending: it settles it
        self.settling.discard(key)
        if items.status[j] is ItemStatus.RUNNING:
            self._cancelled(items, j)
