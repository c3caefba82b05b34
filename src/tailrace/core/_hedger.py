"""One run's stragglers and hedges (T3, T5): straggler timers, backups, clones, which attempt wins.

The run loop holds a :class:`Hedger` when its engine has tail hooks (a node
declares a cost or hedges, or admission is ``lpt``). The hedger keeps its
own state: the live attempts per unit while a hedge may race, the
stragglers waiting for a backup, and the counters a :class:`~tailrace.RunResult`
reports (stragglers, hedges, hedges refused). It reads estimates, hedge
delays and the budget from the engine-wide :class:`~tailrace.tail.TailHooks`;
the run loop hands it values (the graph, the event loop, its outbox, its
admission) and callbacks: what a unit runs on, how a hedge of an attempt
starts, and a poke.

When an attempt runs past its hedge delay (a high quantile of what its
estimate key's attempts took, or ``factor x estimate`` until enough were
seen) a timer fires *while it runs*: the attempt is counted as a straggler
and a ``NODE_STRAGGLER`` event is emitted. A node with ``hedge=True`` then
gets a backup attempt:

- without a :class:`~tailrace.tail.HedgePolicy`, at once, beside its
  primary and without a slot of its own;
- with one (T5), once the engine's budget gives it a token (it waits for
  one while it runs; if it ends first, the budget *refused* its backup),
  on the next slot freed, ahead of every queued first attempt, never
  preempting running work. Clones at launch take idle capacity only.

The first of the attempts to succeed wins; the others are cancelled and
awaited by the run loop, and only the winner's result is committed, its
``NODE_COMPLETED`` saying whether the backup won.

The items of a map node are hedged one by one (M2): everything here is keyed
by the *unit* ``(node, item)``, the item -1 for a node's own attempts.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any

from .._events import EventType
from ..graph import Topology
from ..tail import HedgeDelay, TailHooks
from ..tail._hooks import MIN_STRAGGLER_DELAY
from ._admission import RunAdmission
from ._inflight import Attempt
from ._outbox import Outbox
from ._state import MapItems


class Hedger:
    """Stragglers and hedges of one run (T3, T5).

    ``topo`` is the run's graph and ``loop`` its event loop; events go to
    ``outbox``; ``admission`` gives backups their slots.
    ``payload_of(node, item, items)`` is what a unit runs on;
    ``restart(attempt, extra_slot)`` starts a hedge of ``attempt``'s unit
    (holding the slot admission gave it with ``extra_slot``); ``poke`` wakes
    the run loop.
    """

    def __init__(
        self,
        tail: TailHooks,
        *,
        topo: Topology,
        loop: asyncio.AbstractEventLoop,
        outbox: Outbox,
        admission: RunAdmission,
        payload_of: Callable[[int, int, MapItems | None], Any],
        restart: Callable[[Attempt, bool], None],
        poke: Callable[[], None],
    ) -> None:
        self.tail = tail
        self._topo = topo
        self._loop = loop
        self._outbox = outbox
        self._admission = admission
        self._payload_of = payload_of
        self._restart = restart
        self._poke = poke
        self.stragglers = 0
        #: Backups and clones started (with a policy: those the budget allowed).
        self.hedges = 0
        #: Stragglers whose backup the budget refused: they ended still waiting for a token.
        self.refused = 0
        #: Live attempts per unit (node, item) while a hedge may race.
        self.live: dict[tuple[int, int], list[Attempt]] = {}
        #: Stragglers a hedge policy backs up, with their estimate and when they became due.
        self.backup_candidates: dict[Attempt, tuple[float, float]] = {}
        #: Candidates holding a token whose backup waits for a slot ahead of the queue.
        self._asked: dict[Attempt, None] = {}
        #: Candidates that found the budget empty and wait for a token.
        self._starved: dict[Attempt, None] = {}
        #: Set when the run winds down: no hedge starts any more.
        self.closing = False

    # -- stragglers and hedges ------------------------------------------------

    def watch(self, attempt: Attempt) -> None:
        """A new attempt started: refill the budget, and arm its straggler timer (T3, T5)."""
        self.live.setdefault((attempt.index, attempt.item), []).append(attempt)
        if attempt.hedge or self.closing:
            return
        tail = self.tail
        node = self._topo.nodes[attempt.index]
        policy = tail.hedging
        if policy is not None:
            tail.started(node)
        delay = tail.hedge_delay(node, self._payload_of(attempt.index, attempt.item, attempt.items))
        if delay is None:
            return
        attempt.timer = self._loop.call_later(
            max(delay.delay, MIN_STRAGGLER_DELAY), self._straggling, attempt, delay
        )
        if policy is not None and node.hedge and not delay.adaptive:
            # Too few observations for a quantile: the policy backs up early, by its estimate.
            attempt.backup_timer = self._loop.call_later(
                max(policy.backup_delay(delay.estimate), MIN_STRAGGLER_DELAY),
                self._backup_due,
                attempt,
                delay.estimate,
            )

    def _straggling(self, attempt: Attempt, delay: HedgeDelay) -> None:
        attempt.timer = None
        if attempt.task is None or attempt.finished or self.closing:
            return
        attempt.straggled = delay.delay
        i = attempt.index
        self.stragglers += 1
        elapsed = self._loop.time() - attempt.started
        item = _item_data(attempt)
        tail = self.tail
        adaptive = {"quantile": tail.quantile} if delay.adaptive else {}
        self._outbox.emit(
            EventType.NODE_STRAGGLER, i, attempt.visit, None, elapsed=elapsed,
            estimate=delay.estimate, factor=tail.factor, delay=delay.delay, **adaptive, **item,
        )  # fmt: skip
        if self._topo.nodes[i].hedge:
            if tail.hedging is None:
                self.hedges += 1
                self._outbox.emit(EventType.NODE_HEDGED, i, attempt.visit, attempt.tries, **item)
                self._restart(attempt, False)
            elif delay.adaptive:
                self._backup_due(attempt, delay.estimate)
        self._poke()

    # -- the hedge policy (T5) --------------------------------------------------

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
            if not self._clone(attempt):
                return

    def _clone(self, attempt: Attempt) -> bool:
        """Start a clone of ``attempt``'s unit on idle capacity, if the budget allows one."""
        if self.closing or not self._admission.take_idle():
            return False  # a clone never delays a first attempt
        if not self.tail.take(self._topo.nodes[attempt.index]):
            self._admission.give_back()
            return False
        self._start_extra(attempt, "clone")
        return True

    def _backup_due(self, attempt: Attempt, estimate: float) -> None:
        """An attempt is past its hedge delay: a candidate for a backup (LATE)."""
        attempt.backup_timer = None
        if self._gone(attempt) or attempt in self.backup_candidates:
            return
        self.backup_candidates[attempt] = (estimate, self._loop.time())
        self.back_up()

    def back_up(self) -> None:
        """Ask for backups for the candidates, the longest expected remaining time first: the
        longest estimate, then the longest overdue.

        Called when a candidate appears, after every harvest (a candidate may
        have ended) and when the budget has a token again. Each candidate
        takes a token, then asks for a slot ahead of the queued units; one
        that finds no token waits for one (and is counted refused if it ends
        first). A candidate whose attempt ended, or whose unit races two
        attempts already, is dropped.
        """
        candidates = self.backup_candidates
        if not candidates or self.tail.hedging is None:
            return
        ranked = sorted(
            candidates.items(),
            key=lambda entry: (-entry[1][0], entry[1][1], entry[0].index, entry[0].item),
        )
        starved = False
        for attempt, _due in ranked:
            if attempt not in candidates or attempt in self._asked:
                continue  # started or asked meanwhile
            if self._gone(attempt):
                self._drop(attempt)
            elif not self.tail.take(self._topo.nodes[attempt.index]):
                starved = True  # no token (the engine's, or its node's): it waits for one
                self._starved[attempt] = None
            else:
                self._asked[attempt] = None
                self._admission.ask_ahead(attempt, functools.partial(self._slot_granted, attempt))
        if starved:
            self.tail.when_refilled(self._poke)  # back_up() again once a token is free

    def _slot_granted(self, attempt: Attempt) -> None:
        """Admission gave ``attempt``'s backup a slot (perhaps from another run's harvest)."""
        self._asked.pop(attempt, None)
        self._starved.pop(attempt, None)  # the budget gave it a token: not refused
        if self.backup_candidates.pop(attempt, None) is None or self._gone(attempt):
            self._admission.give_back()
            self.tail.refund(self._topo.nodes[attempt.index])
            return
        self._start_extra(attempt, "backup")

    def _start_extra(self, attempt: Attempt, reason: str) -> None:
        """Start a clone or backup of ``attempt``'s unit on the slot admission gave it."""
        policy = self.tail.hedging
        assert policy is not None
        self.hedges += 1
        self._outbox.emit(
            EventType.NODE_HEDGED, attempt.index, attempt.visit, attempt.tries, reason=reason,
            budget=policy.budget, **_item_data(attempt),
        )  # fmt: skip
        self._restart(attempt, True)
        self._poke()

    def _gone(self, attempt: Attempt) -> bool:
        """Whether ``attempt`` needs no backup any more: it ended, was cancelled, or races one."""
        if attempt.finished or attempt.abandoned or self.closing:
            return True
        return len(self.live.get((attempt.index, attempt.item), ())) != 1

    def _drop(self, attempt: Attempt) -> None:
        """``attempt`` is no candidate any more: withdraw its request and give its token back;
        if it was still waiting for a token, the budget refused its backup."""
        if self.backup_candidates.pop(attempt, None) is None:
            return
        policy = self.tail.hedging
        assert policy is not None
        if attempt in self._asked:
            del self._asked[attempt]
            self._admission.withdraw(attempt)
            self.tail.refund(self._topo.nodes[attempt.index])
        if attempt in self._starved:
            del self._starved[attempt]
            self.refused += 1
            self.tail.count_refused()
            self._outbox.emit(
                EventType.NODE_HEDGE_REFUSED, attempt.index, attempt.visit, attempt.tries,
                budget=policy.budget, **_item_data(attempt),
            )  # fmt: skip

    # -- endings ----------------------------------------------------------------

    def settle(self, attempt: Attempt) -> bool:
        """Decide a finished attempt: True to harvest it, False to ignore it.

        A successful attempt wins, decided once, and cancels its rivals; a
        failed one is ignored while a rival is still running (the rival may
        still succeed). A straggler waiting for its backup no longer needs one.
        """
        unit = (attempt.index, attempt.item)
        live = self.live.get(unit, [])
        if attempt in live:
            live.remove(attempt)
        if attempt in self.backup_candidates:
            self._drop(attempt)
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
        for attempt in [a for a in self.backup_candidates if a.index == i]:
            self._drop(attempt)

    def close(self) -> None:
        """Stop hedging in a run that is winding down, and disarm its timers."""
        self.closing = True
        for attempts in self.live.values():
            for attempt in attempts:
                if attempt.timer is not None:
                    attempt.timer.cancel()
                if attempt.backup_timer is not None:
                    attempt.backup_timer.cancel()
        for attempt in list(self.backup_candidates):
            self._drop(attempt)
        self.tail.forget(self._poke)
        self.live.clear()


def _item_data(attempt: Attempt) -> dict[str, int]:
    """The ``item`` of a map item's event data (M2); nothing for a node's attempt."""
    return {} if attempt.item < 0 else {"item": attempt.item}
