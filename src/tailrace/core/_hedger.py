"""One run's stragglers and hedges (T3): straggler timers, backups, clones, which attempt wins.

The run loop holds a :class:`Hedger` when its engine has tail hooks (a node
declares a cost or hedges, or admission is ``lpt``). The hedger keeps its
own state: the live attempts per node while a hedge may race, the
candidates for a backup, and the counters a :class:`~tailrace.RunResult`
reports (stragglers, hedges). It reads estimates from the engine-wide
:class:`~tailrace.tail.TailHooks`; the run loop hands it values (the
graph, the event loop, its outbox) and callbacks: what a unit runs on, how
a hedge of an attempt starts, how idle capacity is taken, and a poke.

When an attempt runs past ``factor x estimate`` a timer fires *while it
runs*: the attempt is counted as a straggler and a ``NODE_STRAGGLER`` event
is emitted; a node with ``hedge=True`` then starts a backup attempt. The
first of the two to succeed wins; the other is cancelled and awaited by the
run loop, and only the winner's result is committed. With a
:class:`~tailrace.tail.HedgePolicy` the backups follow it instead: clones at
launch and early backups on idle capacity, within a budget.

The items of a map node are hedged one by one (M2): everything here is keyed
by the *unit* ``(node, item)``, the item -1 for a node's own attempts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from .._events import EventType
from ..graph import Topology
from ..tail import TailHooks
from ..tail._hooks import MIN_STRAGGLER_DELAY
from ._inflight import Attempt
from ._outbox import Outbox
from ._state import MapItems


class Hedger:
    """Stragglers and hedges of one run (T3).

    ``topo`` is the run's graph and ``loop`` its event loop; events go to
    ``outbox``. ``payload_of(node, item, items)`` is what a unit runs on;
    ``restart(attempt, extra_slot)`` starts a hedge of ``attempt``'s unit;
    ``take_idle(attempt)`` takes idle capacity for a clone or backup of it
    (True when it got a slot); ``poke`` wakes the run loop.
    """

    def __init__(
        self,
        tail: TailHooks,
        *,
        topo: Topology,
        loop: asyncio.AbstractEventLoop,
        outbox: Outbox,
        payload_of: Callable[[int, int, MapItems | None], Any],
        restart: Callable[[Attempt, bool], None],
        take_idle: Callable[[], bool],
        poke: Callable[[], None],
    ) -> None:
        self.tail = tail
        self._topo = topo
        self._loop = loop
        self._outbox = outbox
        self._payload_of = payload_of
        self._restart = restart
        self._take_idle = take_idle
        self._poke = poke
        self.stragglers = 0
        self.hedges = 0
        #: Live attempts per unit (node, item) while a hedge may race.
        self.live: dict[tuple[int, int], list[Attempt]] = {}
        #: Attempts a hedge policy would back up, with their estimates.
        self.backup_candidates: dict[Attempt, float] = {}
        #: First attempts started (a hedge policy's budget is a share of them).
        self.first_attempts = 0
        #: Set when the run winds down: no hedge starts any more.
        self.closing = False

    # -- stragglers and hedges ------------------------------------------------

    def watch(self, attempt: Attempt) -> None:
        """Arm the straggler timer of a new attempt (T3)."""
        self.live.setdefault((attempt.index, attempt.item), []).append(attempt)
        if attempt.hedge or self.closing:
            return
        node = self._topo.nodes[attempt.index]
        payload = self._payload_of(attempt.index, attempt.item, attempt.items)
        estimate = self.tail.estimate(attempt.index, payload, node)
        if estimate is None:
            return
        delay = max(self.tail.factor * estimate, MIN_STRAGGLER_DELAY)
        attempt.timer = self._loop.call_later(delay, self._straggling, attempt, estimate)
        if self.tail.hedging is not None and node.hedge:
            attempt.backup_timer = self._loop.call_later(
                max(self.tail.hedging.backup_delay(estimate), MIN_STRAGGLER_DELAY),
                self._backup_due,
                attempt,
                estimate,
            )

    def _straggling(self, attempt: Attempt, estimate: float) -> None:
        attempt.timer = None
        if attempt.task is None or attempt.finished or self.closing:
            return
        attempt.straggled = self.tail.factor * estimate
        i = attempt.index
        self.stragglers += 1
        elapsed = self._loop.time() - attempt.started
        item = _item_data(attempt)
        self._outbox.emit(
            EventType.NODE_STRAGGLER,
            i,
            attempt.visit,
            None,
            elapsed=elapsed,
            estimate=estimate,
            factor=self.tail.factor,
            **item,
        )
        if self._topo.nodes[i].hedge and self.tail.hedging is None:
            self.hedges += 1
            self._outbox.emit(EventType.NODE_HEDGED, i, attempt.visit, None, **item)
            self._restart(attempt, False)
        self._poke()

    # -- the hedge policy -------------------------------------------------------

    def launched(self, batch: list[tuple[int, int]]) -> None:
        """Clone, at launch, the units of a batch dispatched together that need it (Dolly).

        ``batch`` lists the units (node, item) that became ready together; those
        running now with ``hedge=True`` and an estimate are candidates, longest
        estimate first.
        """
        policy = self.tail.hedging
        if policy is None or self.closing or len(batch) < 2:
            return
        estimates = []
        for unit in batch:
            i = unit[0]
            node = self._topo.nodes[i]
            live = self.live.get(unit, ())
            if node.hedge and len(live) == 1:
                estimate = self.tail.estimate(i, self._payload_of(unit[0], unit[1], None), node)
                if estimate is not None:
                    estimates.append((estimate, unit, live[0]))
        if not estimates:
            return
        longest = max(estimate for estimate, _, _ in estimates)
        estimates.sort(key=lambda entry: (-entry[0], entry[1]))
        for estimate, _unit, attempt in estimates:
            if not policy.clones_at_launch(estimate, longest):
                break  # sorted: no shorter node needs a clone either
            if not self._extra_attempt(attempt, "clone"):
                return

    def _backup_due(self, attempt: Attempt, estimate: float) -> None:
        """An attempt is past its backup delay: a candidate for a backup (LATE)."""
        attempt.backup_timer = None
        if attempt.finished or attempt.abandoned or self.closing:
            return
        self.backup_candidates[attempt] = estimate
        self.back_up()

    def back_up(self) -> None:
        """Start backups for candidates, the longest expected remaining time first.

        Called when a candidate appears and after every harvest (a slot may
        have been freed). A candidate that finished, or whose node already
        races two attempts, is dropped; the others wait for budget and capacity.
        """
        candidates = self.backup_candidates
        if not candidates or self.tail.hedging is None:
            return
        ranked = sorted(
            candidates.items(), key=lambda entry: (-entry[1], entry[0].index, entry[0].item)
        )
        for attempt, _estimate in ranked:
            unit = (attempt.index, attempt.item)
            if attempt.finished or attempt.abandoned or len(self.live.get(unit, ())) != 1:
                del candidates[attempt]
                continue
            if not self._extra_attempt(attempt, "backup"):
                return
            del candidates[attempt]

    def _extra_attempt(self, attempt: Attempt, reason: str) -> bool:
        """Start a clone or backup of ``attempt``'s unit if budget and idle capacity allow it."""
        assert self.tail.hedging is not None
        if self.closing:
            return False
        if self.tail.hedging.allowed(first_attempts=self.first_attempts, extra=self.hedges) < 1:
            return False  # the budget grows with the run's first attempts
        if not self._take_idle():
            return False
        self.hedges += 1
        self._outbox.emit(
            EventType.NODE_HEDGED,
            attempt.index,
            attempt.visit,
            None,
            reason=reason,
            **_item_data(attempt),
        )
        self._restart(attempt, True)
        self._poke()
        return True

    def settle(self, attempt: Attempt) -> bool:
        """Decide a finished attempt: True to harvest it, False to ignore it.

        A successful attempt wins and cancels its rivals; a failed one is
        ignored while a rival is still running (the rival may still succeed).
        """
        unit = (attempt.index, attempt.item)
        live = self.live.get(unit, [])
        if attempt in live:
            live.remove(attempt)
        failed = attempt.error is not None
        rivals = [a for a in live if a.task is not None and not a.finished]
        if failed and rivals:
            return False
        for rival in live:
            rival.abandon()
        self.live.pop(unit, None)
        return True

    def forget(self, i: int) -> None:
        """Stop racing node ``i``'s units (the node is cancelled as a dead input)."""
        for unit in [u for u in self.live if u[0] == i]:
            del self.live[unit]

    def close(self) -> None:
        """Stop hedging in a run that is winding down, and disarm its timers."""
        self.closing = True
        for attempts in self.live.values():
            for attempt in attempts:
                if attempt.timer is not None:
                    attempt.timer.cancel()
                if attempt.backup_timer is not None:
                    attempt.backup_timer.cancel()
        self.live.clear()
        self.backup_candidates.clear()


def _item_data(attempt: Attempt) -> dict[str, int]:
    """The ``item`` of a map item's event data (M2); nothing for a node's attempt."""
    return {} if attempt.item < 0 else {"item": attempt.item}
