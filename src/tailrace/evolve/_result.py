"""What an evolution returns: :class:`EvolutionResult`, saved and loaded as JSON.

Files written by older versions lack newer fields; :meth:`EvolutionResult.load`
fills those with their defaults, and ignores fields it does not know.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

#: Version of the saved JSON document.
RESULT_FORMAT = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class Sweep:
    """One merge sweep: candidates ranked, the best judged on the held-out set.

    Args:
        index: Counts sweeps from 1.
        base_version: The head the candidates were judged against.
        candidates: How many candidate edits were ranked.
        accepted: Whether the best candidate was committed.
        version: The head after the sweep.
        probability: Posterior probability that the best beat the base.
        threshold: The bar it had to clear.
        held_out: The head's mean held-out reward after the sweep.
        cheap_agreed: Whether the ranking subset's verdict matched the held-out one.
        rollouts: Training rollouts completed when the sweep ended.
        elapsed: Seconds since the evolution started.
    """

    index: int
    base_version: int
    candidates: int
    accepted: bool
    version: int
    probability: float
    threshold: float
    held_out: float
    cheap_agreed: bool
    rollouts: int = 0
    elapsed: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class EvolutionResult:
    """The outcome of :func:`~tailrace.evolve.evolve` or :func:`~tailrace.evolve.async_evolve`.

    Args:
        mode: ``"sync"`` or ``"async"``.
        artifact_id: The artifact's id in the ledger.
        version: The final head version.
        entries: The final head's entries.
        rendered: The final head rendered.
        held_out: Mean held-out reward of the final head.
        initial_held_out: Mean held-out reward of the head the run started from.
        history: One :class:`Sweep` per merge sweep, in order.
        stop_reason: ``"budget"``, ``"target"`` or ``"rounds"``.
        rollouts: Training rollouts completed.
        eval_rollouts: Held-out rollouts run by the merger.
        commits: Versions committed by this run.
        proposals: Edits proposed by the workers.
        stale_dropped: Proposals dropped for lagging more than ``async_ratio`` behind head.
        stragglers: Rollouts that ran past ``straggler_factor x estimate`` (or past
            ``round_timeout`` in sync rounds).
        resumed: Tasks re-run from the resume queue.
        wall: Seconds the rollout phase took.
        worker_busy: Seconds each worker spent in rollouts.
        utilisation: ``sum(worker_busy) / (workers x wall)``.
        rollouts_per_second: ``rollouts / wall``.
        audit_trust: Trust in the cheap ranking layer at the end.
        partial: Cross-version pairs of partial rollouts, one per resume of a
            rollout preempted at a turn boundary: ``{"task_id", "run_id",
            "from_version"`` (what its first turns rendered), ``"to_version"``
            (the head patched in for the rest), ``"turns_before"``,
            ``"turns_after"``, ``"status"}`` (``"completed"``, or
            ``"preempted"`` when it straggled again and was queued anew).
    """

    mode: str
    artifact_id: str
    version: int
    entries: dict[str, str]
    rendered: str
    held_out: float
    initial_held_out: float = 0.0
    history: tuple[Sweep, ...] = ()
    stop_reason: str = "budget"
    rollouts: int = 0
    eval_rollouts: int = 0
    commits: int = 0
    proposals: int = 0
    stale_dropped: int = 0
    stragglers: int = 0
    resumed: int = 0
    wall: float = 0.0
    worker_busy: tuple[float, ...] = ()
    utilisation: float = 0.0
    rollouts_per_second: float = 0.0
    audit_trust: float = 0.0
    partial: tuple[Mapping[str, Any], ...] = field(default=())

    def learning_curve(self) -> list[tuple[int, float]]:
        """``(rollouts, held-out reward)`` at the start and after every sweep that committed."""
        points = [(0, self.initial_held_out)]
        points.extend((s.rollouts, s.held_out) for s in self.history if s.accepted)
        return points

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (with a ``format`` version)."""
        data = dataclasses.asdict(self)
        data["format"] = RESULT_FORMAT
        return data

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the result to ``path`` as JSON.

        Args:
            path: The file to write (replaced if it exists).
        """
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(self.to_dict(), fh, indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EvolutionResult:
        """Rebuild a result from ``data``; missing newer fields take their defaults.

        Args:
            data: The output of :meth:`to_dict` (or an older version of it).

        Raises:
            ValueError: an unknown format version or a required field is missing.
        """
        version = data.get("format", RESULT_FORMAT)
        if version != RESULT_FORMAT:
            raise ValueError(f"unsupported EvolutionResult format {version!r}")
        values = _known_fields(cls, data, "EvolutionResult")
        values["history"] = tuple(
            Sweep(**_known_fields(Sweep, s, f"EvolutionResult history[{i}]"))
            for i, s in enumerate(values.get("history", ()))
        )
        values["worker_busy"] = tuple(values.get("worker_busy", ()))
        values["partial"] = tuple(values.get("partial", ()))
        return cls(**values)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> EvolutionResult:
        """Read a result written by :meth:`save`.

        Args:
            path: The JSON file.
        """
        with open(path, encoding="utf-8") as fh:
            return cls.from_dict(json.load(fh))


def _known_fields(cls: type, data: Mapping[str, Any], what: str) -> dict[str, Any]:
    """The fields of ``cls`` found in ``data``; unknown keys are ignored, defaults fill the rest.

    Raises:
        ValueError: ``data`` is not a mapping, or lacks a field without a default.
    """
    if not isinstance(data, Mapping):
        raise ValueError(f"{what} must be a JSON object, got {type(data).__name__}")
    fields = dataclasses.fields(cls)
    values = {f.name: data[f.name] for f in fields if f.name in data}
    missing = [f.name for f in fields if _required(f) and f.name not in values]
    if missing:
        raise ValueError(f"{what} is missing required fields: {missing}")
    return values


def _required(f: dataclasses.Field[Any]) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
