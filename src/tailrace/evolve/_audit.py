"""Audit scheduler: which changes deserve the expensive oracle, and how much to trust the cheap layer.

A cheap layer (ranking on a small subset of held-out tasks, a linter, a small
model) judges every change; an oracle (the full held-out set, a person, a big
model) is costly and rationed. Items are audited by priority
``blast_radius x uncertainty / trust``: wide changes, unsure verdicts and an
untrusted cheap layer go first. Trust is per artifact and learnt by comparing
the two layers: +0.25 when they agreed, halved when they did not, kept within
``[TRUST_MIN, TRUST_MAX] = [0.25, 1.0]``. The evolution loops measure it on
every comparison they make: the cheap verdict is the candidate's score on the
ranking subset, the oracle's is the full held-out verdict.

Why a cap of 1 and a floor of 0.25 (agentdescent caps trust at 4.0 and floors
it at 0.25): trust here is read against the 0.75 gate of :meth:`force_oracle`.
With a cap of 4 a long agreement streak banks trust, and a cheap layer that
goes bad (the head got good and the ranking subset no longer tells candidates
apart) decides alone through three disagreements in a row (4 -> 2 -> 1 -> 0.5)
before the oracle sees a change again; with a cap of 1, the first disagreement
sends the next decision to the oracle. The floor keeps the priority's divisor
bounded (an untrusted layer multiplies priorities by at most 4) and makes trust
recoverable: two agreements lift it from the floor back to the gate.

>>> audit = AuditScheduler()
>>> audit.force_oracle(FAST_MAX + 1, "prompt"), audit.force_oracle(1, "prompt")
(True, True)
>>> audit.record(agreed=True, artifact_id="prompt")
0.75
>>> audit.force_oracle(1, "prompt")
False
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Any

#: The widest change (keys touched) the cheap layer may pass alone; wider ones go to the oracle.
FAST_MAX = 3

#: Below this trust the cheap layer's verdict is not enough.
TRUST_FLOOR = 0.75

#: Trust never rises above this (agreements add 0.25 up to it).
TRUST_MAX = 1.0

#: Trust never falls below this (disagreements halve it down to it).
TRUST_MIN = 0.25

#: How many items a collecting scheduler keeps; the lowest priorities are shed beyond it.
HEAP_CAP = 4096


@dataclass(frozen=True, slots=True, kw_only=True, order=True)
class AuditItem:
    """An item waiting for the oracle, ordered by priority (highest first when popped).

    Args:
        priority: ``blast_radius x uncertainty / trust`` when it was submitted.
        item_id: The caller's name for it (a ledger version, say).
        artifact_id: The artifact it changes.
        blast_radius: How much it touches.
        uncertainty: How unsure the cheap layer was, in ``[0, 1]``.
        payload: Anything the caller wants back.
    """

    priority: float
    item_id: str = field(compare=False)
    artifact_id: str = field(compare=False)
    blast_radius: float = field(compare=False)
    uncertainty: float = field(compare=False)
    payload: Any = field(default=None, compare=False)


class AuditScheduler:
    """Prioritises audits, learns trust in the cheap layer, and rations the oracle.

    Args:
        collect: Keep submitted items in a heap (at most ``HEAP_CAP``, shedding
            the lowest priority and counting it in :attr:`dropped`); with
            False, :meth:`submit` only returns the priority.
        oracle_budget: How many oracle calls :meth:`spend_oracle` grants;
            None for no limit.
        initial_trust: Trust in the cheap layer for an artifact never measured,
            in ``[TRUST_MIN, TRUST_MAX]``.
    """

    def __init__(
        self, *, collect: bool = True, oracle_budget: int | None = None, initial_trust: float = 0.5
    ) -> None:
        if oracle_budget is not None and oracle_budget < 0:
            raise ValueError(f"oracle_budget must be >= 0 or None, got {oracle_budget}")
        if not TRUST_MIN <= initial_trust <= TRUST_MAX:
            raise ValueError(
                f"initial_trust must be in [{TRUST_MIN}, {TRUST_MAX}], got {initial_trust}"
            )
        self.collect = collect
        self.oracle_budget = oracle_budget
        self.initial_trust = initial_trust
        self.oracle_used = 0
        #: Oracle calls refused because the budget was spent.
        self.oracle_refused = 0
        #: Items shed because the heap was full.
        self.dropped = 0
        #: Cheap/oracle comparisons recorded, and how many agreed.
        self.comparisons = 0
        self.agreements = 0
        self._trust: dict[str, float] = {}
        self._heap: list[tuple[float, int, AuditItem]] = []  # min-heap on priority
        self._seq = itertools.count()

    def trust(self, artifact_id: str) -> float:
        """Current trust in the cheap layer for ``artifact_id``.

        Args:
            artifact_id: The artifact.
        """
        return self._trust.get(artifact_id, self.initial_trust)

    def trust_by_artifact(self) -> dict[str, float]:
        """Trust in the cheap layer for every artifact measured so far."""
        return dict(self._trust)

    def record(self, *, agreed: bool, artifact_id: str) -> float:
        """Record whether the cheap layer agreed with the oracle; return the new trust.

        Args:
            agreed: True when both layers reached the same verdict.
            artifact_id: The artifact judged.
        """
        old = self.trust(artifact_id)
        new = min(TRUST_MAX, old + 0.25) if agreed else max(TRUST_MIN, old / 2.0)
        self._trust[artifact_id] = new
        self.comparisons += 1
        self.agreements += int(agreed)
        return new

    def priority(self, blast_radius: float, uncertainty: float, artifact_id: str) -> float:
        """``blast_radius x uncertainty / trust``.

        Args:
            blast_radius: How much the change touches (>= 0).
            uncertainty: How unsure the cheap verdict is, in ``[0, 1]``.
            artifact_id: The artifact whose trust divides.
        """
        if blast_radius < 0 or not 0.0 <= uncertainty <= 1.0:
            raise ValueError("blast_radius must be >= 0 and uncertainty in [0, 1]")
        return blast_radius * uncertainty / self.trust(artifact_id)

    def force_oracle(self, blast_radius: float, artifact_id: str) -> bool:
        """True when the cheap layer must not decide alone: too wide, or not trusted enough.

        Args:
            blast_radius: How much the change touches; above ``FAST_MAX`` forces the oracle.
            artifact_id: The artifact; trust below ``TRUST_FLOOR`` forces the oracle.
        """
        return blast_radius > FAST_MAX or self.trust(artifact_id) < TRUST_FLOOR

    @property
    def oracle_left(self) -> int | None:
        """Oracle calls the budget still grants; None for no limit."""
        if self.oracle_budget is None:
            return None
        return max(0, self.oracle_budget - self.oracle_used)

    def spend_oracle(self) -> bool:
        """Take one oracle call from the budget; False (and counted) when none is left."""
        if self.oracle_budget is not None and self.oracle_used >= self.oracle_budget:
            self.oracle_refused += 1
            return False
        self.oracle_used += 1
        return True

    def submit(
        self,
        item_id: str,
        *,
        blast_radius: float,
        uncertainty: float,
        artifact_id: str,
        payload: Any = None,
    ) -> float:
        """Score an item for audit and, when collecting, queue it; return its priority.

        Args:
            item_id: The caller's name for the item.
            blast_radius: How much it touches.
            uncertainty: How unsure the cheap verdict is, in ``[0, 1]``.
            artifact_id: The artifact it changes.
            payload: Returned with the item by :meth:`pop`.
        """
        priority = self.priority(blast_radius, uncertainty, artifact_id)
        if not self.collect:
            return priority
        item = AuditItem(
            priority=priority,
            item_id=item_id,
            artifact_id=artifact_id,
            blast_radius=blast_radius,
            uncertainty=uncertainty,
            payload=payload,
        )
        entry = (priority, next(self._seq), item)
        if len(self._heap) < HEAP_CAP:
            heapq.heappush(self._heap, entry)
        else:
            heapq.heappushpop(self._heap, entry)
            self.dropped += 1
        return priority

    def pop(self) -> AuditItem | None:
        """Remove and return the highest-priority item, or None when none is queued."""
        if not self._heap:
            return None
        best = max(self._heap)
        self._heap.remove(best)
        heapq.heapify(self._heap)
        return best[2]

    def __len__(self) -> int:
        """How many items are queued."""
        return len(self._heap)
