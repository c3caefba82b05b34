"""Failures that do not stop evolution: retries, the error record, and the error-rate stop.

A user call (``run``, ``reward`` or ``propose``) that raises is recorded as a
:class:`FailedAttempt` and, when :class:`Retry` says the error is transient
(a timeout, a dropped connection, an endpoint's 429 or 5xx, an executor's
worker lost under the call), retried after a
backoff, or after the delay the server asked for (``Retry-After``). A unit of
work whose attempts all failed is dropped and the loop goes on: a training
rollout yields no proposal, a held-out rollout scores 0 (which makes a
candidate harder to accept, never easier). The loop stops only when more than
``max_error_rate`` of the last ``error_window`` units failed.

Contract violations are not failures: a reward outside ``[0, 1]`` or a
proposer returning something other than an ``Edit`` is a bug in the caller's
code, and raises at once.
"""

from __future__ import annotations

import asyncio
import collections
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from .._errors import ExecutorLost


class UnitFailed(Exception):
    """Internal: every attempt of a unit of work failed (its errors are already recorded)."""

    def __init__(self, error: FailedAttempt) -> None:
        super().__init__(f"{error.stage} of task {error.task_id!r} failed: {error.message}")
        self.error = error


@dataclass(frozen=True, slots=True, kw_only=True)
class Retry:
    """How a failing ``run``, ``reward`` or ``propose`` call is retried.

    An exception is transient when it is an instance of ``retry_on``, has a
    true ``retryable`` attribute (the OpenAI-compatible adapter's
    :class:`CompletionError` does for 429, 5xx, timeouts and dropped
    connections), or is :class:`~tailrace.ExecutorLost` (the executor's
    worker died under the call: ``executor=RayExecutor()``), whatever
    ``retry_on`` says. Retry ``n`` waits ``min(backoff * multiplier**(n-1),
    max_backoff)`` seconds, or the exception's ``retry_after`` seconds when it
    has one (the server's ``Retry-After``, honoured as given).

    Args:
        attempts: Tries per call, the first included; 1 never retries.
        backoff: Seconds before the first retry.
        multiplier: Growth of the backoff per retry (>= 1).
        max_backoff: The backoff never exceeds this (``retry_after`` may).
        retry_on: Exception classes that are transient.
        sleep: Awaited with each delay (default ``asyncio.sleep``).

    >>> Retry(backoff=1.0).delay(3, RuntimeError())
    4.0
    """

    attempts: int = 3
    backoff: float = 0.5
    multiplier: float = 2.0
    max_backoff: float = 30.0
    retry_on: tuple[type[BaseException], ...] = (TimeoutError, ConnectionError)
    sleep: Callable[[float], Awaitable[None]] = field(default=asyncio.sleep, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.attempts, bool) or not isinstance(self.attempts, int):
            raise ValueError(f"Retry.attempts must be an integer, got {self.attempts!r}")
        if self.attempts < 1:
            raise ValueError(f"Retry.attempts must be >= 1, got {self.attempts}")
        for name in ("backoff", "max_backoff", "multiplier"):
            value = getattr(self, name)
            floor = 1.0 if name == "multiplier" else 0.0
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= floor):
                raise ValueError(f"Retry.{name} must be a finite number >= {floor}, got {value!r}")
        object.__setattr__(self, "retry_on", tuple(self.retry_on))

    def transient(self, exc: BaseException) -> bool:
        """Whether ``exc`` is worth another attempt.

        Args:
            exc: What the call raised.
        """
        # A lost worker (a Ray worker or node that died) says nothing about the call itself.
        if isinstance(exc, ExecutorLost):
            return True
        return isinstance(exc, self.retry_on) or getattr(exc, "retryable", False) is True

    def delay(self, retry: int, exc: BaseException) -> float:
        """Seconds to wait before retry number ``retry`` (1-based) after ``exc``.

        Args:
            retry: Which retry this is.
            exc: The error that made it necessary (its ``retry_after`` wins).
        """
        asked = getattr(exc, "retry_after", None)
        if isinstance(asked, int | float) and math.isfinite(asked) and asked >= 0:
            return float(asked)
        return float(min(self.backoff * self.multiplier ** (retry - 1), self.max_backoff))


@dataclass(frozen=True, slots=True, kw_only=True)
class FailedAttempt:
    """One failed attempt of a user call, as :attr:`EvolutionResult.errors` lists it.

    Args:
        task_id: The task the call was for.
        phase: ``"train"`` (a worker's rollout) or ``"eval"`` (held-out scoring).
        stage: ``"run"``, ``"reward"`` or ``"propose"``.
        attempt: 1 for the first try, 2 for the first retry, ...
        error: The exception's class (``module.QualName``, builtins bare).
        message: ``str()`` of the exception.
        version: The ledger version the call rendered.
        retried: Whether another attempt followed.
    """

    task_id: str
    phase: str
    stage: str
    attempt: int
    error: str
    message: str
    version: int
    retried: bool


def error_name(exc: BaseException) -> str:
    """``module.QualName`` of ``exc``'s class; builtins by their bare name.

    Args:
        exc: The exception.

    >>> error_name(KeyError("x")), error_name(asyncio.CancelledError())
    ('KeyError', 'asyncio.exceptions.CancelledError')
    """
    cls = type(exc)
    return (
        cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    )


class ErrorWindow:
    """Outcomes of the last ``size`` units of work; tells when too many failed.

    Args:
        size: How many recent outcomes count.
        max_rate: The loop stops when the window is full and more than this
            fraction of it failed.
    """

    def __init__(self, size: int, max_rate: float) -> None:
        if size < 1:
            raise ValueError(f"error_window must be >= 1, got {size}")
        if not 0.0 <= max_rate <= 1.0:
            raise ValueError(f"max_error_rate must be in [0, 1], got {max_rate}")
        self.size = size
        self.max_rate = max_rate
        self._outcomes: collections.deque[bool] = collections.deque(maxlen=size)
        self.failed_units = 0
        self.ok_units = 0

    def add(self, failed: bool) -> None:
        """Record one unit's outcome.

        Args:
            failed: True when every attempt of the unit failed.
        """
        self._outcomes.append(failed)
        self.failed_units += int(failed)
        self.ok_units += int(not failed)

    @property
    def rate(self) -> float:
        """The failed fraction of the window (0 while empty)."""
        return sum(self._outcomes) / len(self._outcomes) if self._outcomes else 0.0

    def exceeded(self) -> bool:
        """Whether the window is full and its failed fraction is above ``max_rate``."""
        return len(self._outcomes) == self.size and self.rate > self.max_rate
