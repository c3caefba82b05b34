"""The engine's long-tail hooks: estimates per node, stragglers while running, hedging (T2, T3).

One :class:`TailHooks` per engine keeps a :class:`DurationEstimator` per
estimate key (``Node.estimate_key`` or the node id) and observes every
winning attempt. When an attempt runs past ``factor x estimate`` a timer
fires *while it runs*: the attempt is counted as a straggler and a
``NODE_STRAGGLER`` event is emitted; a node with ``hedge=True`` then starts a
backup attempt. The first of the two to succeed wins; the other is cancelled
and awaited by the run loop, and only the winner's result is committed.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from .._events import EventType
from ._estimator import DurationEstimator

if TYPE_CHECKING:
    from .._graph import Node
    from .._runloop import Attempt, RunLoop


class TailHooks:
    """Duration estimates, straggler timers and hedges for one engine.

    ``factor`` is the straggler threshold as a multiple of the estimate;
    ``prior`` the estimate (seconds) of a key with no observations yet;
    ``min_samples`` is passed to each :class:`DurationEstimator`.
    """

    def __init__(self, *, factor: float = 3.0, prior: float = 1.0, min_samples: int = 3) -> None:
        if factor <= 1.0:
            raise ValueError(f"factor must be > 1, got {factor}")
        self.factor = factor
        self.prior = prior
        self.min_samples = min_samples
        self.estimators: dict[str, DurationEstimator] = {}
        self._lock = threading.Lock()
        self._live: dict[tuple[int, int], list[Attempt]] = {}

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

    def observe(self, node: Node, payload: Any, seconds: float) -> None:
        """Record that ``node`` took ``seconds`` on ``payload``."""
        self.estimator(node.estimate_key or node.id).observe(self.cost_of(node, payload), seconds)

    # -- stragglers and hedges ------------------------------------------------

    def watch(self, loop: RunLoop, attempt: Attempt) -> None:
        """Arm the straggler timer of a new attempt (T3)."""
        key = (id(loop), attempt.index)
        self._live.setdefault(key, []).append(attempt)
        if attempt.hedge:
            return
        node = loop.topo.nodes[attempt.index]
        estimate = self.estimate(attempt.index, loop.state.nodes[attempt.index].payload, node)
        if estimate is None:
            return
        delay = max(self.factor * estimate, 1e-3)
        attempt.timer = loop.loop.call_later(delay, self._straggling, loop, attempt, estimate)

    def _straggling(self, loop: RunLoop, attempt: Attempt, estimate: float) -> None:
        attempt.timer = None
        if attempt.task is None or attempt.task.done():
            return
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
        if loop.topo.nodes[i].hedge:
            loop.hedges += 1
            loop.emit(EventType.NODE_HEDGED, i, attempt.visit, None)
            loop.start_attempt(i, hedge=True)
        loop.poke()

    def settle(self, loop: RunLoop, attempt: Attempt) -> bool:
        """Decide a finished attempt: True to harvest it, False to ignore it.

        A successful attempt wins and cancels its rivals; a failed one is
        ignored while a rival is still running (the rival may still succeed).
        """
        key = (id(loop), attempt.index)
        live = self._live.get(key, [])
        if attempt in live:
            live.remove(attempt)
        assert attempt.task is not None
        failed = attempt.task.exception() is not None
        rivals = [a for a in live if a.task is not None and not a.task.done()]
        if failed and rivals:
            return False
        for rival in live:
            if rival.task is not None:
                rival.task.cancel()
            if rival.timer is not None:
                rival.timer.cancel()
        self._live.pop(key, None)
        return True

    def close(self, loop: RunLoop) -> None:
        """Forget a finished run's attempts and disarm its timers."""
        ident = id(loop)
        for key in [k for k in self._live if k[0] == ident]:
            for attempt in self._live.pop(key):
                if attempt.timer is not None:
                    attempt.timer.cancel()
