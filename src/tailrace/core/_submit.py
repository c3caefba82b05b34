"""Submitting runs to a queue: ``Engine.submit``.

The run is stored ``queued`` with its input already encoded (D5: a bad input
fails here, not in a worker) and the graph's reference, so any worker that
can load the graph runs it. For ``lpt`` queues the run carries an estimate
of its duration: the caller's, or the :class:`~tailrace.tail.DurationEstimator`
fitted on the graph's completed queued runs (``seconds ~ b + m * cost``),
refreshed from the store every :data:`REFRESH` seconds.
"""

from __future__ import annotations

import time
import uuid
import weakref
from typing import TYPE_CHECKING, Any

from .._codec import DEFAULT_CODEC
from .._errors import DuplicateRun, EncodeError
from ..stores import NewRun, RunStore, Submission
from ..tail import DurationEstimator

if TYPE_CHECKING:
    from ..graph import Graph
    from ._engine import Engine

#: Seconds an estimator fitted from the store is reused before it is fitted again.
REFRESH = 30.0
#: How many completed runs an estimator is fitted on.
HISTORY = 200


class RunEstimates:
    """Duration estimators per graph fingerprint, fitted from one store's completed runs."""

    def __init__(self, store: RunStore) -> None:
        self.store = store
        self._fitted: dict[str, tuple[float, DurationEstimator]] = {}

    async def estimate(self, fingerprint: str, cost: float | None) -> float:
        """Expected seconds of a run of ``fingerprint`` with ``cost`` (0 with no history)."""
        fitted = self._fitted.get(fingerprint)
        if fitted is None or time.monotonic() - fitted[0] > REFRESH:
            estimator = DurationEstimator(prior=0.0)
            for seen_cost, seconds in reversed(
                await self.store.run_durations(fingerprint, limit=HISTORY)
            ):
                estimator.observe(seen_cost, max(seconds, 0.0))
            fitted = self._fitted[fingerprint] = (time.monotonic(), estimator)
        return fitted[1].estimate(cost or 0.0)


_ESTIMATES: weakref.WeakKeyDictionary[RunStore, RunEstimates] = weakref.WeakKeyDictionary()


def estimates_of(store: RunStore) -> RunEstimates:
    """The estimators of ``store`` (one set per store object)."""
    found = _ESTIMATES.get(store)
    if found is None:
        found = _ESTIMATES[store] = RunEstimates(store)
    return found


async def submit_run(
    engine: Engine,
    graph: Graph,
    input: Any,
    *,
    queue: str,
    run_id: str | None,
    priority: int,
    partition: str | None,
    dedup_key: str | None,
    on_duplicate: str,
    cost: float | None,
    estimate: float | None,
    graph_ref: str | None,
) -> str:
    """``Engine.submit``: store the run ``queued`` and return its id (or the dedup holder's)."""
    from ._engine import _guess_ref, checked_run_id

    store = engine.store
    if store is None:
        raise ValueError("submit needs an engine with a store: Engine(store=...)")
    if on_duplicate not in ("return", "raise"):
        raise ValueError(f"on_duplicate must be 'return' or 'raise', got {on_duplicate!r}")
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ValueError(f"priority must be an int, got {priority!r}")
    topo = graph.compile()
    engine.register(graph)
    run_id = uuid.uuid4().hex if run_id is None else checked_run_id(run_id)
    try:
        input_json = (engine.codec or DEFAULT_CODEC).encode(input)
    except (TypeError, ValueError) as exc:
        raise EncodeError(f"run {run_id!r}: input is not encodable: {exc}") from exc
    if estimate is None:
        estimate = await estimates_of(store).estimate(topo.fingerprint, cost)
    new = NewRun(
        run_id=run_id, graph_name=graph.name, graph_ref=graph_ref or _guess_ref(graph),
        fingerprint=topo.fingerprint, input_json=input_json, created_at=time.time(),
    )  # fmt: skip
    submission = Submission(
        queue=queue, priority=priority, partition=partition, dedup_key=dedup_key, cost=cost,
        estimate=estimate,
    )  # fmt: skip
    stored = await store.submit_run(new, submission)
    if stored != run_id and on_duplicate == "raise":
        assert dedup_key is not None
        raise DuplicateRun(
            f"queue {queue!r}: dedup key {dedup_key!r} is held by live run {stored!r}; "
            f"run {run_id!r} was not submitted",
            run_id=stored, queue=queue, dedup_key=dedup_key,
        )  # fmt: skip
    return stored
