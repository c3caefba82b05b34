"""The engine's long-tail hooks: estimates per node, stragglers while running, hedging (T2, T3).

One :class:`TailHooks` per engine keeps a :class:`DurationEstimator` per
estimate key (``Node.estimate_key`` or the node id) and observes every
winning attempt. When an attempt runs past ``factor x estimate`` a timer
fires *while it runs*: the attempt is counted as a straggler and a
``NODE_STRAGGLER`` event is emitted; a node with ``hedge=True`` then starts a
backup attempt. The first of the two to succeed wins; the other is cancelled
and awaited by the run loop, and only the winner's result is committed.

With a :class:`~tailrace.tail.HedgePolicy` (``TailHooks(hedging=...)``) the
backups of ``hedge=True`` nodes follow it instead: clones at launch and early
backups on idle capacity, within a budget (see :mod:`._hedging`); the
straggler events stay as they are.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from .._events import EventType
from ._estimator import DurationEstimator
from ._hedging import HedgePolicy

#: Straggler timers never fire sooner than this (seconds): sub-millisecond
#: estimates would otherwise flag every scheduling hiccup.
MIN_STRAGGLER_DELAY = 0.005

if TYPE_CHECKING:
    from ..core._inflight import Attempt
    from ..core._loop import RunLoop
    from ..graph import Node


class TailHooks:
    """Duration estimates, straggler timers and hedges for one engine.

    ``factor`` is the straggler threshold as a multiple of the estimate;
    ``prior`` is each estimator's answer before any observation (the engine
    itself arms no straggler timer and gives LPT no estimate until a key has
    been observed at least once);
    ``min_samples`` is passed to each :class:`DurationEstimator`;
    ``hedging`` replaces the backup at the straggler threshold by a
    :class:`HedgePolicy` (None: back up at ``factor x estimate``).
    """

    def __init__(
        self,
        *,
        factor: float = 3.0,
        prior: float = 1.0,
        min_samples: int = 3,
        hedging: HedgePolicy | None = None,
    ) -> None:
        if factor <= 1.0:
            raise ValueError(f"factor must be > 1, got {factor}")
        self.factor = factor
        self.hedging = hedging
        self.prior = prior
        self.min_samples = min_samples
        self.estimators: dict[str, DurationEstimator] = {}
        self._lock = threading.Lock()

    # -- estimates ------------------------------------------------------------

    def estimator(self, key: str) -> DurationEstimator:
        """The estimator for ``key``, created on first use."""
        with self._lock:
            est = self.estimators.get(key)
            if est is None:
                est = DurationEstimator(prior=self.prior, min_samples=self.min_samples)
                self.estimators[key] = est
            return est

    @staticmethod
    def cost_of(node: Node, payload: Any) -> float:
        """The node's declared cost for ``payload`` (1.0 when it declares none)."""
        cost = node.cost
        if cost is None:
            return 1.0
        value = cost(payload) if callable(cost) else cost
        return float(value)

    def estimate(self, i: int, payload: Any, node: Node | None = None) -> float | None:
        """Estimated seconds for node ``i`` on ``payload``; None before any observation."""
        assert node is not None
        est = self.estimator(node.estimate_key or node.id)
        if est.count == 0:
            return None
        return est.estimate(self.cost_of(node, payload))

    def observe(self, node: Node, payload: Any, seconds: float, cap: float | None = None) -> None:
        """Record that ``node`` took ``seconds`` on ``payload``.

        ``cap`` bounds the observation: a straggler's duration is recorded as
        at most ``factor x estimate`` so that one stall does not drag the fit
        (and every later straggler threshold) off course.
        """
        if cap is not None:
            seconds = min(seconds, cap)
        self.estimator(node.estimate_key or node.id).observe(self.cost_of(node, payload), seconds)

    # -- stragglers and hedges ------------------------------------------------

    def watch(self, loop: RunLoop, attempt: Attempt) -> None:
        """Arm the straggler timer of a new attempt (T3)."""
        loop.live.setdefault(attempt.index, []).append(attempt)
        if attempt.hedge or loop.closing:
            return
        node = loop.topo.nodes[attempt.index]
        estimate = self.estimate(attempt.index, loop.state.nodes[attempt.index].payload, node)
        if estimate is None:
            return
        delay = max(self.factor * estimate, MIN_STRAGGLER_DELAY)
        attempt.timer = loop.loop.call_later(delay, self._straggling, loop, attempt, estimate)
        if self.hedging is not None and node.hedge:
            attempt.backup_timer = loop.loop.call_later(
                max(self.hedging.backup_delay(estimate), MIN_STRAGGLER_DELAY),
                self._backup_due,
                loop,
                attempt,
                estimate,
            )

    def _straggling(self, loop: RunLoop, attempt: Attempt, estimate: float) -> None:
        attempt.timer = None
        if attempt.task is None or attempt.finished or loop.closing:
            return
        attempt.straggled = self.factor * estimate
        i = attempt.index
        loop.stragglers += 1
        elapsed = loop.loop.time() - attempt.started
        loop.emit(
            EventType.NODE_STRAGGLER,
            i,
            attempt.visit,
            None,
            elapsed=elapsed,
            estimate=estimate,
            factor=self.factor,
        )
        if loop.topo.nodes[i].hedge and self.hedging is None:
            loop.hedges += 1
            loop.emit(EventType.NODE_HEDGED, i, attempt.visit, None)
            loop.start_attempt(i, hedge=True)
        loop.poke()

    # -- the hedge policy -------------------------------------------------------

    def launched(self, loop: RunLoop, batch: list[int]) -> None:
        """Clone, at launch, the nodes of a batch dispatched together that need it (Dolly).

        ``batch`` lists the nodes that became ready together; those running now
        with ``hedge=True`` and an estimate are candidates, longest estimate first.
        """
        policy = self.hedging
        if policy is None or loop.closing or len(batch) < 2:
            return
        estimates = []
        for i in batch:
            node = loop.topo.nodes[i]
            if node.hedge and len(loop.live.get(i, ())) == 1:
                estimate = self.estimate(i, loop.state.nodes[i].payload, node)
                if estimate is not None:
                    estimates.append((estimate, i))
        if not estimates:
            return
        longest = max(estimate for estimate, _ in estimates)
        estimates.sort(key=lambda pair: (-pair[0], pair[1]))
        for estimate, i in estimates:
            if not policy.clones_at_launch(estimate, longest):
                break  # sorted: no shorter node needs a clone either
            if not self._extra_attempt(loop, i, "clone"):
                return

    def _backup_due(self, loop: RunLoop, attempt: Attempt, estimate: float) -> None:
        """An attempt is past its backup delay: a candidate for a backup (LATE)."""
        attempt.backup_timer = None
        if attempt.finished or attempt.abandoned or loop.closing:
            return
        loop.backup_candidates[attempt] = estimate
        self.back_up(loop)

    def back_up(self, loop: RunLoop) -> None:
        """Start backups for candidates, the longest expected remaining time first.

        Called when a candidate appears and after every harvest (a slot may
        have been freed). A candidate that finished, or whose node already
        races two attempts, is dropped; the others wait for budget and capacity.
        """
        candidates = loop.backup_candidates
        if not candidates or self.hedging is None:
            return
        ranked = sorted(candidates.items(), key=lambda item: (-item[1], item[0].index))
        for attempt, _estimate in ranked:
            i = attempt.index
            if attempt.finished or attempt.abandoned or len(loop.live.get(i, ())) != 1:
                del candidates[attempt]
                continue
            if not self._extra_attempt(loop, i, "backup"):
                return
            del candidates[attempt]

    def _extra_attempt(self, loop: RunLoop, i: int, reason: str) -> bool:
        """Start a clone or backup of node ``i`` if budget and idle capacity allow it."""
        assert self.hedging is not None
        if loop.closing:
            return False
        if self.hedging.allowed(first_attempts=loop.first_attempts, extra=loop.hedges) < 1:
            return False  # the budget grows with the run's first attempts
        if not loop.take_idle_slot():
            return False
        loop.hedges += 1
        visit = loop.state.nodes[i].visits
        loop.emit(EventType.NODE_HEDGED, i, visit, None, reason=reason)
        loop.start_attempt(i, hedge=True, extra_slot=True)
        loop.poke()
        return True

    def settle(self, loop: RunLoop, attempt: Attempt) -> bool:
        """Decide a finished attempt: True to harvest it, False to ignore it.

        A successful attempt wins and cancels its rivals; a failed one is
        ignored while a rival is still running (the rival may still succeed).
        """
        live = loop.live.get(attempt.index, [])
        if attempt in live:
            live.remove(attempt)
        failed = attempt.error is not None
        rivals = [a for a in live if a.task is not None and not a.finished]
        if failed and rivals:
            return False
        for rival in live:
            rival.abandon()
        loop.live.pop(attempt.index, None)
        return True

    def close(self, loop: RunLoop) -> None:
        """Stop hedging in a run that is winding down, and disarm its timers."""
        loop.closing = True
        for attempts in loop.live.values():
            for attempt in attempts:
                if attempt.timer is not None:
                    attempt.timer.cancel()
                if attempt.backup_timer is not None:
                    attempt.backup_timer.cancel()
        loop.live.clear()
        loop.backup_candidates.clear()
