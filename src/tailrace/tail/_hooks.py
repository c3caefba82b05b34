"""The engine's long-tail settings: a duration estimate per node, the straggler factor, hedging (T2, T3).

One :class:`TailHooks` per engine keeps a :class:`DurationEstimator` per
estimate key (``Node.estimate_key`` or the node id), fed by every winning
attempt. Each run's hedger (``tailrace.core``) reads them: when an attempt
runs past ``factor x estimate`` a timer fires *while it runs*, the attempt is
counted as a straggler, and a node with ``hedge=True`` gets a backup attempt;
the first of the two to succeed wins and only its result is committed.

With a :class:`~tailrace.tail.HedgePolicy` (``TailHooks(hedging=...)``) the
backups of ``hedge=True`` nodes follow it instead: clones at launch and early
backups on idle capacity, within a budget (see :mod:`._hedging`); the
straggler events stay as they are.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any, Protocol

from ._estimator import DurationEstimator
from ._hedging import HedgePolicy

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


class TailHooks:
    """Duration estimates, the straggler factor and the hedge policy of one engine.

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

    def observe(
        self, node: Estimated, payload: Any, seconds: float, cap: float | None = None
    ) -> None:
        """Record that ``node`` took ``seconds`` on ``payload``.

        ``cap`` bounds the observation: a straggler's duration is recorded as
        at most ``factor x estimate`` so that one stall does not drag the fit
        (and every later straggler threshold) off course.
        """
        if cap is not None:
            seconds = min(seconds, cap)
        self.estimator(node.estimate_key or node.id).observe(self.cost_of(node, payload), seconds)
