"""The engine's long-tail settings: a duration estimate per node, the hedge delay, hedging (T2, T3, T5).

One :class:`TailHooks` per engine keeps a :class:`DurationEstimator` per
estimate key (``Node.estimate_key`` or the node id), fed by every winning
attempt. Each run's hedger (``tailrace.core``) reads them: when an attempt
runs past its *hedge delay* a timer fires *while it runs*, the attempt is
counted as a straggler, and a node with ``hedge=True`` gets a backup attempt;
the first of the two to succeed wins and only its result is committed.

The hedge delay adapts to what the key's attempts actually take: the
``quantile`` of their observed durations (relative to their estimates, so a
node with a cost function gets the same quantile at every cost, and at most
``factor x estimate``), once ``min_observations`` have been seen; before
that, ``factor x estimate``.

With a :class:`~tailrace.tail.HedgePolicy` (``TailHooks(hedging=...)``) the
backups of ``hedge=True`` nodes follow it instead: they go ahead of queued
first attempts within a token bucket of extra attempts that this object
holds for the engine (and per node, optionally), and clones at launch (see
:mod:`._hedging`); the straggler events stay as they are.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

from ._estimator import DurationEstimator
from ._hedging import HedgeBudget, HedgePolicy

#: Straggler timers never fire sooner than this (seconds): sub-millisecond
#: estimates would otherwise flag every scheduling hiccup.
MIN_STRAGGLER_DELAY = 0.005


class Estimated(Protocol):
    """What an estimate reads of a node (``tailrace.Node`` has it)."""

    @property
    def id(self) -> str: ...
    @property
    def estimate_key(self) -> str | None: ...
    @property
    def cost(self) -> float | Callable[[Any], float] | None: ...


class HedgeDelay(NamedTuple):
    """An attempt's estimate and hedge delay (seconds); ``adaptive`` when the delay is the
    quantile of observed durations rather than ``factor x estimate``."""

    estimate: float
    delay: float
    adaptive: bool


class TailHooks:
    """Duration estimates, the hedge delay and the hedge policy of one engine.

    ``factor`` is the straggler threshold as a multiple of the estimate
    while a key has fewer than ``min_observations`` observations; from
    then on the threshold is the ``quantile`` of its observed durations
    (see the module docstring). ``prior`` is each estimator's answer before
    any observation (the engine itself arms no straggler timer and gives
    LPT no estimate until a key has been observed at least once);
    ``min_samples`` is passed to each :class:`DurationEstimator`;
    ``hedging`` replaces the backup at the straggler threshold by a
    :class:`HedgePolicy` (None: back up at the threshold, beside the
    primary, unbudgeted); its budget is this engine's (:attr:`budget`).

    ``allowed`` and ``refused`` count the backups the budget allowed and
    refused over the engine's lifetime (a run's own are in its result).
    """

    def __init__(
        self,
        *,
        factor: float = 3.0,
        prior: float = 1.0,
        min_samples: int = 3,
        hedging: HedgePolicy | None = None,
        quantile: float = 0.99,
        min_observations: int = 20,
    ) -> None:
        if factor <= 1.0:
            raise ValueError(f"factor must be > 1, got {factor}")
        if not 0.5 <= quantile < 1.0:
            raise ValueError(f"quantile must be within 0.5..1 (a high one), got {quantile}")
        if min_observations < 1:
            raise ValueError(f"min_observations must be >= 1, got {min_observations}")
        self.factor = factor
        self.hedging = hedging
        self.prior = prior
        self.min_samples = min_samples
        self.quantile = quantile
        self.min_observations = min_observations
        self.estimators: dict[str, DurationEstimator] = {}
        self._lock = threading.Lock()
        #: The engine's bucket of extra attempts (T5), with a hedge policy.
        self.budget: HedgeBudget | None = None if hedging is None else hedging.new_budget()
        self._node_budgets: dict[str, HedgeBudget] = {}
        #: Called once when a token is free again (runs whose stragglers wait for one).
        self._waiting: dict[Callable[[], None], None] = {}
        self.allowed = 0
        self.refused = 0

    # -- estimates ------------------------------------------------------------

    def estimator(self, key: str) -> DurationEstimator:
        """The estimator for ``key``, created on first use."""
        with self._lock:
            est = self.estimators.get(key)
            if est is None:
                est = DurationEstimator(
                    prior=self.prior, min_samples=self.min_samples, max_ratio=self.factor
                )
                self.estimators[key] = est
            return est

    @staticmethod
    def cost_of(node: Estimated, payload: Any, *, item: int | None = None) -> float:
        """The node's declared cost for ``payload`` (1.0 when it declares none).

        ``item`` is the map item ``payload`` is, named in the error. A cost
        function that raises, or returns anything but a finite number, raises
        :class:`ValueError` naming the node (and item).

        >>> from tailrace.graph import Node
        >>> TailHooks.cost_of(Node(id="n", handler=print, cost=len), "abc")
        3.0
        """
        cost = node.cost
        if cost is None:
            return 1.0
        if not callable(cost):
            return float(cost)
        where = f"node {node.id!r}" if item is None else f"map {node.id!r} item {item}"
        try:
            value = cost(payload)
        except Exception as exc:
            raise ValueError(f"{where}: its cost raised {type(exc).__name__}: {exc}") from exc
        if (
            not isinstance(value, int | float)
            or isinstance(value, bool)
            or not math.isfinite(value)
        ):
            shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
            raise ValueError(
                f"{where}: its cost returned {shown} ({type(value).__name__}), not a finite number"
            )
        return float(value)

    def estimate(self, i: int, payload: Any, node: Estimated | None = None) -> float | None:
        """Estimated seconds for node ``i`` on ``payload``; None before any observation."""
        assert node is not None
        est = self.estimator(node.estimate_key or node.id)
        if est.count == 0:
            return None
        return est.estimate(self.cost_of(node, payload))

    def hedge_delay(self, node: Estimated, payload: Any) -> HedgeDelay | None:
        """When an attempt of ``node`` on ``payload`` becomes a straggler (T3): the
        ``quantile`` of the key's observed durations once it has ``min_observations``,
        else ``factor x estimate``; None before any observation.

        >>> from tailrace.graph import Node
        >>> hooks = TailHooks(factor=3.0, min_observations=4)
        >>> node = Node(id="n", handler=print)
        >>> for seconds in (1.0, 1.0, 1.0, 1.0):
        ...     hooks.observe(node, None, seconds)
        >>> hooks.hedge_delay(node, None)  # three ratios: 3 x the estimate
        HedgeDelay(estimate=1.0, delay=3.0, adaptive=False)
        >>> hooks.observe(node, None, 2.0)
        >>> hooks.hedge_delay(node, None)  # the 99th percentile of 1, 1, 1, 2 x 1.2
        HedgeDelay(estimate=1.2, delay=2.4, adaptive=True)
        """
        est = self.estimator(node.estimate_key or node.id)
        if est.count == 0:
            return None
        cost = self.cost_of(node, payload)
        estimate = est.estimate(cost)
        delay = est.quantile(cost, self.quantile, self.min_observations)
        if delay is None:
            return HedgeDelay(estimate, self.factor * estimate, False)
        return HedgeDelay(estimate, delay, True)

    def observe(
        self, node: Estimated, payload: Any, seconds: float, cap: float | None = None
    ) -> None:
        """Record that ``node`` took ``seconds`` on ``payload``.

        ``cap`` bounds what the estimate learns from it: a straggler's duration
        counts as at most its hedge delay, so that one stall does not drag the
        fit off course. The hedge delay's quantile records it as it was, up to
        ``factor x estimate``: the delay follows how slow attempts really get,
        and never exceeds ``factor x estimate``, however many stall.
        """
        self.estimator(node.estimate_key or node.id).observe(
            self.cost_of(node, payload), seconds, fit_cap=cap
        )

    # -- the budget (T5) ------------------------------------------------------

    def started(self, node: Estimated) -> None:
        """An attempt of ``node`` started: refill the budget by the policy's share of it."""
        budget = self.budget
        if budget is None:
            return
        with self._lock:
            freed = budget.refill()
            own = self._node_budget(node)
            if own is not None:
                freed = own.refill() or freed
            waiting = self._woken() if freed else None
        _wake(waiting)

    def take(self, node: Estimated) -> bool:
        """Take a token for a backup of ``node`` (from its node's bucket too, if it has one)."""
        budget = self.budget
        assert budget is not None, "a budget needs a hedge policy"
        with self._lock:
            if not budget.take():
                return False
            own = self._node_budget(node)
            if own is not None and not own.take():
                budget.refund()
                return False
            self.allowed += 1
            return True

    def refund(self, node: Estimated) -> None:
        """Give back a token :meth:`take` took whose backup did not start after all."""
        budget = self.budget
        assert budget is not None, "a budget needs a hedge policy"
        with self._lock:
            budget.refund()
            own = self._node_budget(node)
            if own is not None:
                own.refund()
            self.allowed -= 1
            waiting = self._woken()
        _wake(waiting)

    def count_refused(self) -> None:
        """A straggler ended still waiting for a token: the budget refused its backup."""
        with self._lock:
            self.refused += 1

    def when_refilled(self, wake: Callable[[], None]) -> None:
        """Call ``wake`` once, when the next attempt started frees a token."""
        with self._lock:
            self._waiting[wake] = None

    def forget(self, wake: Callable[[], None]) -> None:
        """Drop ``wake`` from those waiting for a token (its run ended)."""
        with self._lock:
            self._waiting.pop(wake, None)

    def _woken(self) -> dict[Callable[[], None], None] | None:
        # Caller holds the lock: those waiting for a token, now to be called once.
        waiting, self._waiting = self._waiting, {}
        return waiting or None

    def _node_budget(self, node: Estimated) -> HedgeBudget | None:
        # Caller holds the lock. Keyed like the node's estimates.
        hedging = self.hedging
        if hedging is None or hedging.node_budget is None:
            return None
        key = node.estimate_key or node.id
        budget = self._node_budgets.get(key)
        if budget is None:
            budget = self._node_budgets[key] = HedgeBudget(
                share=hedging.node_budget,
                burst=hedging.burst if hedging.node_burst is None else hedging.node_burst,
            )
        return budget


def _wake(waiting: dict[Callable[[], None], None] | None) -> None:
    """Call those that waited for a token (outside the lock: a callback may take one)."""
    if waiting:
        for wake in waiting:
            wake()
