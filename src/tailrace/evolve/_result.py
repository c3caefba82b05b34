"""What an evolution returns: :class:`EvolutionResult`, saved and loaded as JSON.

Files written by older versions lack newer fields; :meth:`EvolutionResult.load`
fills those with their defaults, and ignores fields it does not know.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ._failures import FailedAttempt
from ._usage import Usage

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
        cheap_agreed: Whether the ranking subset's verdict matched the full
            held-out one; None when the full verdict was not computed.
        rollouts: Training rollouts completed when the sweep ended (0 in
            results saved before it existed).
        elapsed: Seconds since the rollout phase started (0 likewise).
        route: How the decision was made: ``"oracle"`` (forced to the full
            held-out evaluation and paid from the oracle budget), ``"cheap"``
            (the ranking subset passed it early; the full held-out comparison,
            free, decides before anything is committed), ``"escalated"`` (the
            ranking subset did not pass it, and it never vetoes: the full
            comparison, free, decides) or ``"refused"`` (forced to the oracle
            with its budget spent: not merged, queued for audit).
        reversed: The full held-out evaluation overturned the cheap verdict.
        audits: Queued audits this sweep bought from the oracle budget.
        admitted: With ``selection="pareto"``: the candidate joined the pool.
    """

    index: int
    base_version: int
    candidates: int
    accepted: bool
    version: int
    probability: float
    threshold: float
    held_out: float
    cheap_agreed: bool | None
    rollouts: int = 0
    elapsed: float = 0.0
    route: str = "oracle"
    reversed: bool = False
    audits: int = 0
    admitted: bool = False


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
        stop_reason: Why the loop ended: ``"budget"`` (``max_rollouts``),
            ``"target"``, ``"rounds"`` (``max_rounds``), ``"max_seconds"``,
            ``"max_calls"``, ``"max_cost"``, ``"patience"``, ``"errors"``
            (``max_error_rate`` exceeded, or not one unit of work succeeded:
            see ``failure``) or ``"oracle_budget"`` (the oracle
            budget is spent while trust is below the gate: nothing can merge).
        rollouts: Training rollouts completed.
        eval_rollouts: Held-out rollouts run by the merger.
        commits: Versions committed by this run.
        proposals: Edits proposed by the workers.
        stale_dropped: Proposals dropped for lagging more than ``async_ratio`` behind head.
        stragglers: Rollouts that ran past ``straggler_factor x estimate`` (or past
            ``round_timeout`` in sync rounds).
        resumed: Tasks re-run from the resume queue.
        eval_hedges: Backup attempts started for held-out rollouts that ran
            past the straggler limit (``async_evolve`` with a duration estimator).
        wall: Seconds the rollout phase took.
        worker_busy: Seconds each worker spent in rollout attempts.
        worker_used: Seconds each worker spent in attempts whose result was
            used (cut stragglers excluded; a detached straggler counts).
        utilisation: ``sum(worker_used) / (workers x wall)``.
        rollouts_per_second: ``rollouts / wall``.
        audit_trust: Trust in the cheap ranking layer at the end.
        trust: Trust per artifact the audit scheduler measured.
        audits: Oracle calls bought from the oracle budget (forced decisions
            and queued audits).
        oracle_refused: Oracle calls refused because the budget was spent.
        reversals: Decisions the full held-out evaluation reversed: ``{"sweep",
            "kind"`` (``"accept_overturned"``: the cheap layer accepted, the
            full set did not, nothing was merged; ``"reject_overturned"``: the
            full comparison (or an audit) accepted what the cheap layer did
            not pass, and it was merged),
            ``"edit", "base_version", "version", "cheap_probability",
            "probability"}``.
        partial: Cross-version pairs of partial rollouts, one per resume of a
            rollout preempted at a turn boundary: ``{"task_id", "run_id",
            "from_version"`` (what its first turns rendered), ``"to_version"``
            (the head patched in for the rest), ``"turns_before"``,
            ``"turns_after"``, ``"status"}`` (``"completed"``, or
            ``"preempted"`` when it straggled again and was queued anew).
        errors: Every failed attempt of a user call (:class:`FailedAttempt`).
        failed_units: Units of work (rollouts, proposals, held-out scores)
            whose every attempt failed and that were dropped.
        calls: User calls made (``run``, ``reward``, ``propose``; every attempt).
        usage: Tokens and cost per model (:class:`Usage`).
        cost: Total cost under the price table.
        quality: The held-out reward ``time_to_quality`` refers to
            (``quality``, else ``target``), None when neither was given.
        time_to_quality: Seconds from the start of the rollout phase until
            the head's held-out reward first reached ``quality``; None if never.
        cost_to_quality: The cost spent by then (initial scoring included).
        rollouts_to_quality: Training rollouts completed by then.
        failure: When units of work failed and not one succeeded (every
            ``run`` raised, say, or was cut): ``"the backend failed: ..."``
            with the stage, task, error class and message of the last failed
            attempt, and ``stop_reason`` is ``"errors"`` whatever ended the
            loop. None when anything succeeded. Check it: such a run returns
            normally, with the starting artifact unchanged.
        selection: ``"head"`` or ``"pareto"``.
        pool: With ``"pareto"``: the final front, ``{"id", "parent",
            "held_out", "entries"}`` per member.
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
    worker_used: tuple[float, ...] = ()
    trust: dict[str, float] = field(default_factory=dict)
    audits: int = 0
    oracle_refused: int = 0
    reversals: tuple[Mapping[str, Any], ...] = ()
    errors: tuple[FailedAttempt, ...] = ()
    failed_units: int = 0
    calls: int = 0
    usage: tuple[Usage, ...] = ()
    cost: float = 0.0
    quality: float | None = None
    time_to_quality: float | None = None
    cost_to_quality: float | None = None
    rollouts_to_quality: int | None = None
    selection: str = "head"
    pool: tuple[Mapping[str, Any], ...] = ()
    eval_hedges: int = 0
    failure: str | None = None

    def learning_curve(self) -> list[tuple[int, float]]:
        """``(rollouts, held-out reward)`` at the start and after every sweep that moved the head."""
        points = [(0, self.initial_held_out)]
        points.extend((s.rollouts, s.held_out) for s in self.history if s.version != s.base_version)
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
        if not isinstance(data, Mapping):
            raise ValueError(f"an EvolutionResult must be a JSON object, got {type(data).__name__}")
        version = data.get("format", RESULT_FORMAT)
        if version != RESULT_FORMAT:
            raise ValueError(f"unsupported EvolutionResult format {version!r}")
        values = _known_fields(cls, data, "EvolutionResult")
        values["history"] = tuple(
            Sweep(**_known_fields(Sweep, s, f"EvolutionResult history[{i}]"))
            for i, s in enumerate(values.get("history", ()))
        )
        for name in ("worker_busy", "worker_used", "partial", "reversals", "pool"):
            values[name] = tuple(values.get(name, ()))
        values["errors"] = tuple(
            FailedAttempt(**_known_fields(FailedAttempt, e, f"EvolutionResult errors[{i}]"))
            for i, e in enumerate(values.get("errors", ()))
        )
        values["usage"] = tuple(
            Usage(**_known_fields(Usage, u, f"EvolutionResult usage[{i}]"))
            for i, u in enumerate(values.get("usage", ()))
        )
        return cls(**values)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> EvolutionResult:
        """Read a result written by :meth:`save`; a bad file is refused whole.

        Args:
            path: The JSON file.

        Raises:
            ValueError: the file is not JSON, nests too deep, holds a number
                that is not finite (``NaN``, ``Infinity``), is not a result
                object, or a field is missing or of the wrong kind; the
                message names the file and what is wrong.
        """
        try:
            with open(path, encoding="utf-8") as fh:
                data = json.load(fh, parse_constant=_no_constant, parse_float=_finite_float)
            result = cls.from_dict(data)
            _check_values(result)
        except RecursionError:
            raise ValueError(f"{os.fspath(path)!r}: JSON nests too deep") from None
        except ValueError as exc:
            raise ValueError(f"{os.fspath(path)!r}: {exc}") from exc
        except TypeError as exc:  # a field of the wrong shape for its record
            raise ValueError(f"{os.fspath(path)!r}: not an EvolutionResult: {exc}") from exc
        return result


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a finite number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is not a finite number")
    return value


#: The kinds a record's scalar field may hold, by its annotation.
_KINDS: dict[str, tuple[type, ...]] = {
    "float": (int, float),
    "int": (int,),
    "str": (str,),
    "bool": (bool,),
}

#: Fields that are a reward, a probability or a trust: within ``[0, 1]``.
_UNIT = frozenset({"held_out", "initial_held_out", "audit_trust", "probability", "threshold"})


def _check_values(result: EvolutionResult) -> None:
    """Every field holds its kind, every number is finite, a reward or probability is in ``[0, 1]``.

    Raises:
        ValueError: naming the first field that is wrong.
    """
    records: list[tuple[str, Any]] = [("EvolutionResult", result)]
    for name in ("history", "errors", "usage"):
        records += [(f"{name}[{i}]", r) for i, r in enumerate(getattr(result, name))]
    for where, record in records:
        for f in dataclasses.fields(record):
            _check_scalar(f"{where}.{f.name}", str(f.type), getattr(record, f.name))
    for name in ("worker_busy", "worker_used"):
        for i, value in enumerate(getattr(result, name)):
            _check_scalar(f"EvolutionResult.{name}[{i}]", "float", value)
    for key, value in result.trust.items():
        _check_scalar(f"EvolutionResult.trust[{key!r}]", "float", value)


def _check_scalar(where: str, annotation: str, value: Any) -> None:
    if value is None and annotation.endswith(" | None"):
        return
    kind = annotation.removesuffix(" | None")
    expected = _KINDS.get(kind)
    if expected is None:  # a container, checked where it is read
        return
    if not isinstance(value, expected) or (kind != "bool" and isinstance(value, bool)):
        raise ValueError(f"{where} must be {kind}, got {value!r}")
    if kind != "float" or not isinstance(value, int | float):
        return
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{where} is {value!r}, not a finite number")
    if where.rsplit(".", 1)[-1] in _UNIT and not 0.0 <= number <= 1.0:
        raise ValueError(f"{where} is {value!r}, outside [0, 1]")


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
