"""Hedging within a budget, ahead of queued work (T3, T5).

Waiting for ``factor x estimate`` before a backup starts bounds the cure at
``(1 + factor) x`` the stalled attempt's length, and no threshold can rescue
the longest attempt of a batch: its backup cannot start before its estimate
has passed. :class:`HedgePolicy` does three things instead:

- *Early backups* (LATE, Zaharia et al., OSDI 2008; "The Tail at Scale"'s
  hedged requests): a running attempt past its hedge delay (a high quantile
  of what its estimate key's attempts took, see
  :meth:`~tailrace.tail.TailHooks.hedge_delay`) is presumed stuck; its backup
  takes the next free slot *ahead of queued first attempts*, never
  preempting running work, so a stall is cured while the queue is still
  full. Backups go to the presumed-stuck attempts with the longest expected
  remaining time first: the longest estimates, then the longest overdue.
- *A budget*: every backup takes a token from a :class:`HedgeBudget`, a
  token bucket per engine (and, with ``node_budget``, one per node) that each
  attempt started refills by ``budget`` tokens, up to ``burst``. A
  straggler that finds the bucket empty waits for a token while it runs;
  one that ends first was *refused* its backup.
- *Clones at launch* (Dolly, "Attack of the Clones", NSDI 2013): of the nodes
  dispatched together, those whose backup could not start early enough to
  keep the batch within ``tolerance x`` its longest estimate get a second
  attempt at once, longest estimate first, on idle capacity only and within
  the same budget.

The first attempt to succeed wins; the others are cancelled and awaited, and
one result is committed with the winner recorded (the run loop's hedge
rules, unchanged).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class HedgePolicy:
    """When nodes declared ``hedge=True`` get a second attempt (see the module docstring).

    ``budget`` is the share of attempts started that may be backups: each
    attempt started adds ``budget`` tokens to the engine's bucket, which
    holds at most ``burst`` (and starts full); a backup or clone takes one.
    ``node_budget`` gives each node (its estimate key) a bucket of its own
    as well, refilled by that share of its own attempts and holding at most
    ``node_burst`` (default ``burst``), so that one node cannot spend the
    whole engine's budget. ``backup_after`` and ``slack`` make the hedge
    delay while a node has too few observations for a quantile:
    ``backup_after x estimate + slack`` seconds (``slack`` keeps scheduling
    noise on short attempts from being taken for a stall); ``tolerance``
    is how far past its longest estimate a batch of nodes dispatched
    together may finish: a node whose stalled attempt, backed up late, would
    end past that is cloned at launch.

    >>> policy = HedgePolicy(backup_after=1.5, slack=0.0, tolerance=1.5)
    >>> policy.clones_at_launch(1.0, 1.0), policy.clones_at_launch(0.5, 1.0)
    (True, False)
    >>> budget = HedgePolicy(budget=0.05, burst=1.0).new_budget()
    >>> budget.take(), budget.take()  # it starts full: one token
    (True, False)
    >>> sum(budget.refill() for _ in range(20)), budget.take()  # 20 attempts x 5%
    (1, True)
    """

    budget: float = 0.05
    burst: float = 10.0
    node_budget: float | None = None
    node_burst: float | None = None
    backup_after: float = 1.0
    slack: float = 0.01
    tolerance: float = 1.5

    def __post_init__(self) -> None:
        for name, share in (("budget", self.budget), ("node_budget", self.node_budget)):
            if share is not None and not 0.0 <= share <= 1.0:
                raise ValueError(f"{name} must be within 0..1, got {share}")
        for name, size in (("burst", self.burst), ("node_burst", self.node_burst)):
            if size is not None and not size >= 1.0:
                raise ValueError(f"{name} must be >= 1 (one backup), got {size}")
        if self.backup_after <= 0.0 or self.slack < 0.0:
            raise ValueError(
                f"backup_after must be > 0 and slack >= 0, got {self.backup_after}, {self.slack}"
            )
        if self.tolerance < 1.0:
            raise ValueError(f"tolerance must be >= 1, got {self.tolerance}")

    def backup_delay(self, estimate: float) -> float:
        """Seconds after its start that an attempt estimated at ``estimate`` is backed up,
        while its node has too few observations for a quantile."""
        return self.backup_after * estimate + self.slack

    def clones_at_launch(self, estimate: float, longest: float) -> bool:
        """Whether a node estimated at ``estimate``, dispatched in a batch whose longest
        estimate is ``longest``, needs a clone: a late backup would overrun the batch."""
        return self.backup_delay(estimate) + estimate > self.tolerance * longest

    def new_budget(self) -> HedgeBudget:
        """A full bucket of this policy's ``budget`` and ``burst`` (an engine's)."""
        return HedgeBudget(share=self.budget, burst=self.burst)


class HedgeBudget:
    """A token bucket of extra attempts (T5): ``refill`` per attempt started, ``take`` per backup.

    It holds at most ``burst`` tokens and starts full; each :meth:`refill`
    adds ``share``. Not locked: its owner (:class:`~tailrace.tail.TailHooks`)
    serialises the calls.
    """

    __slots__ = ("burst", "share", "tokens")

    def __init__(self, *, share: float, burst: float) -> None:
        self.share = share
        self.burst = burst
        self.tokens = burst

    def refill(self) -> bool:
        """An attempt started: add ``share`` tokens; True when that makes a whole token free."""
        before = self.tokens
        self.tokens = min(self.burst, before + self.share)
        return before < 1.0 <= self.tokens

    def take(self) -> bool:
        """Take a token for a backup if there is one."""
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True

    def refund(self) -> None:
        """Give back a token whose backup did not start."""
        self.tokens = min(self.burst, self.tokens + 1.0)

    def __repr__(self) -> str:
        return f"HedgeBudget(tokens={self.tokens:.2f}, share={self.share}, burst={self.burst})"
