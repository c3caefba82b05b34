"""Values that cross the engine's seams: a gate's ``GateTimeout`` answer (Q5), checked run ids
and stream cursors."""

from __future__ import annotations

from typing import Any

MARKER = "$tailrace"
KIND = "gate_timeout"


class GateTimeout(dict[str, Any]):
    """A gate's answer after its deadline passed; route on it with a switch.

    It is a ``dict`` so that it stores as plain JSON; the default codec turns
    it back into a ``GateTimeout`` when a run is resumed.

    >>> t = GateTimeout(question_id="q1", deadline=10.0)
    >>> isinstance(t, GateTimeout), t["question_id"], t.deadline
    (True, 'q1', 10.0)
    """

    def __init__(self, *, question_id: str, deadline: float | None) -> None:
        super().__init__({MARKER: KIND, "question_id": question_id, "deadline": deadline})

    @property
    def question_id(self) -> str:
        """The question that timed out."""
        return str(self["question_id"])

    @property
    def deadline(self) -> float | None:
        """The wall-clock deadline that passed."""
        value = self["deadline"]
        return None if value is None else float(value)


def revive(data: dict[str, Any]) -> Any:
    """JSON object hook: rebuild a ``GateTimeout`` from its stored form (``data``)."""
    if data.get(MARKER) == KIND:
        return GateTimeout(question_id=data["question_id"], deadline=data["deadline"])
    return data


#: The longest run id every store keys on (child run ids included).
MAX_RUN_ID_CHARS = 512


def checked_run_id(run_id: Any) -> str:
    """``run_id`` if it is text every store can key on; else a ``ValueError`` naming it."""
    if not isinstance(run_id, str) or not run_id:
        raise ValueError(f"run id must be a non-empty string, got {run_id!r}")
    if "\x00" in run_id or any(0xD800 <= ord(c) <= 0xDFFF for c in run_id):
        raise ValueError(
            f"run id {run_id!r} holds a NUL or a lone surrogate; no store can key on it"
        )
    if len(run_id) > MAX_RUN_ID_CHARS:
        raise ValueError(
            f"run id {run_id[:40]!r}... is {len(run_id)} characters long; "
            f"at most {MAX_RUN_ID_CHARS}"
        )
    return run_id


#: The largest stream cursor: a row's ``seq`` is a signed 64-bit integer in every store.
MAX_CURSOR = 2**63 - 1


def checked_cursor(after: Any) -> int:
    """``after`` if it is a stream cursor every store can compare (S3); else a ``ValueError``
    naming it.

    >>> checked_cursor(2**63)
    Traceback (most recent call last):
    ...
    ValueError: after must be a stream cursor (an integer within 0..9223372036854775807), got 9223372036854775808
    """
    if not isinstance(after, int) or isinstance(after, bool) or not 0 <= after <= MAX_CURSOR:
        raise ValueError(
            f"after must be a stream cursor (an integer within 0..{MAX_CURSOR}), got {after!r}"
        )
    return after
