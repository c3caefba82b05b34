"""The options and records both loops share: :class:`Settings`, :class:`Proposal`, :class:`Progress`."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ._accept import Acceptance
from ._failures import Retry
from ._model import Edit
from ._pool import Member
from ._usage import Price

#: Values of ``selection``.
SELECTIONS = ("head", "pareto")


@dataclass(frozen=True, slots=True, kw_only=True)
class Proposal:
    """An edit a worker proposed, and what its rollout rendered.

    Args:
        edit: The proposed change.
        base_version: The ledger head version when the rollout started.
        task_id: The training task it came from.
        reward: The rollout's reward.
        parent: The pool member the rollout rendered (with ``selection="pareto"``
            the edit is judged against it; with ``"head"``, against the head
            at the time of the sweep). None when built by hand: the head.
    """

    edit: Edit
    base_version: int
    task_id: str
    reward: float
    parent: Member | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Progress:
    """A progress report passed to the ``progress`` callback of the loops.

    Args:
        rollouts: Training rollouts completed so far.
        max_rollouts: The rollout budget.
        version: The current head version.
        held_out: The head's mean held-out reward.
        sweeps: Merge sweeps so far.
        calls: User calls made so far (every attempt).
        cost: Cost so far under the price table.
        errors: Failed attempts recorded so far.
    """

    rollouts: int
    max_rollouts: int
    version: int
    held_out: float
    sweeps: int
    calls: int = 0
    cost: float = 0.0
    errors: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    """Options both loops accept (see :func:`~tailrace.evolve.async_evolve` for each)."""

    max_rollouts: int
    target: float | None
    held_out_frac: float
    shuffle_seed: int | None
    rank_size: int | None
    max_candidates: int
    acceptance: Acceptance
    progress: Callable[[Progress], None] | None
    retry: Retry = field(default_factory=Retry)
    max_error_rate: float = 0.5
    error_window: int = 20
    max_seconds: float | None = None
    max_calls: int | None = None
    max_cost: float | None = None
    patience: int | None = None
    prices: Mapping[str, Price] = field(default_factory=dict)
    quality: float | None = None
    selection: str = "head"
    audits_per_sweep: int = 1
    round_timeout: float | None = None

    def __post_init__(self) -> None:
        for name in ("max_rollouts", "max_candidates", "error_window", "audits_per_sweep"):
            value = getattr(self, name)
            low = 1 if name in ("max_candidates", "error_window") else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        for name in ("target", "quality"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value}")
        for name in ("max_seconds", "max_cost"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a number > 0 or None, got {value!r}")
        for name in ("max_calls", "patience"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1 or None, got {value!r}")
        if self.selection not in SELECTIONS:
            raise ValueError(f"selection must be one of {SELECTIONS}, got {self.selection!r}")
        if not isinstance(self.retry, Retry):
            raise ValueError(f"retry must be a Retry, got {self.retry!r}")

    @property
    def quality_bar(self) -> float | None:
        """The held-out reward whose first reaching is reported (``quality``, else ``target``)."""
        return self.quality if self.quality is not None else self.target


def settings_from(options: Mapping[str, Any]) -> Settings:
    """The :class:`Settings` among a loop's keyword arguments (its ``locals()``), defaults filled.

    Args:
        options: The loop function's arguments by name.
    """
    names = {f.name for f in dataclasses.fields(Settings)}
    values = {k: v for k, v in options.items() if k in names}
    values["acceptance"] = values.get("acceptance") or Acceptance()
    values["retry"] = values.get("retry") or Retry()
    values["prices"] = dict(values.get("prices") or {})
    return Settings(**values)
