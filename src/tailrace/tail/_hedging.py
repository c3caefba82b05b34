"""Hedging that uses the estimates and idle capacity rather than a straggler threshold (T3).

Waiting for ``factor x estimate`` before a backup starts bounds the cure at
``(1 + factor) x`` the stalled attempt's length, and no threshold can rescue
the longest attempt of a batch: its backup cannot start before its estimate
has passed. :class:`HedgePolicy` does two things instead, within a budget of
extra attempts per run:

- *Clones at launch* (Dolly, "Attack of the Clones", NSDI 2013): of the nodes
  dispatched together, those whose backup could not start early enough to
  keep the batch within ``tolerance x`` its longest estimate get a second
  attempt at once, longest estimate first.
- *Early backups* (LATE, Zaharia et al., OSDI 2008; "The Tail at Scale"'s
  hedged requests): a running attempt past ``backup_after x`` its estimate
  (plus ``slack`` seconds) is presumed stuck; backups go to the presumed-stuck
  attempts with the longest expected remaining time first, which, with no
  progress to measure, are those with the longest estimates.

A clone or backup starts only on idle capacity: with a capacity bound it
takes a free slot nobody waits for, and holds it until it ends, so it never
delays a first attempt. The first attempt to succeed wins; the others are
cancelled and awaited, and one result is committed (the run loop's hedge
rules, unchanged).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class HedgePolicy:
    """When nodes declared ``hedge=True`` get a second attempt (see the module docstring).

    ``budget`` bounds the extra attempts of a run to ``ceil(budget x`` its
    first attempts so far); ``backup_after`` is the multiple of its estimate
    after which a running attempt is backed up, ``slack`` seconds added to
    that delay so that scheduling noise on short attempts is not taken for
    a stall; ``tolerance`` is how far past its longest estimate a batch of
    nodes dispatched together may finish: a node whose stalled attempt,
    backed up late, would end past that is cloned at launch.

    >>> policy = HedgePolicy(backup_after=1.5, slack=0.0, tolerance=1.5)
    >>> policy.clones_at_launch(1.0, 1.0), policy.clones_at_launch(0.5, 1.0)
    (True, False)
    >>> policy.allowed(first_attempts=66, extra=0)
    14

    The defaults back an attempt up as soon as it overruns its estimate by
    ``slack``: with a budget, a backup that turns out unneeded costs one
    cancelled attempt, while one that comes late costs the whole batch.
    """

    budget: float = 0.2
    backup_after: float = 1.0
    slack: float = 0.01
    tolerance: float = 1.5

    def __post_init__(self) -> None:
        if not 0.0 <= self.budget <= 1.0:
            raise ValueError(f"budget must be within 0..1, got {self.budget}")
        if self.backup_after <= 0.0 or self.slack < 0.0:
            raise ValueError(
                f"backup_after must be > 0 and slack >= 0, got {self.backup_after}, {self.slack}"
            )
        if self.tolerance < 1.0:
            raise ValueError(f"tolerance must be >= 1, got {self.tolerance}")

    def backup_delay(self, estimate: float) -> float:
        """Seconds after its start that an attempt estimated at ``estimate`` is backed up."""
        return self.backup_after * estimate + self.slack

    def clones_at_launch(self, estimate: float, longest: float) -> bool:
        """Whether a node estimated at ``estimate``, dispatched in a batch whose longest
        estimate is ``longest``, needs a clone: a late backup would overrun the batch."""
        return self.backup_delay(estimate) + estimate > self.tolerance * longest

    def allowed(self, *, first_attempts: int, extra: int) -> int:
        """Extra attempts a run may still start, having started ``first_attempts`` and ``extra``."""
        return max(0, math.ceil(self.budget * first_attempts) - extra)
