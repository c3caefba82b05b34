"""Usage and cost: tokens per model, priced, gathered from whatever calls a model during a rollout.

The OpenAI-compatible adapter calls :func:`record_usage` with each
response's ``usage``; a ``run``, ``reward`` or ``propose`` of your own can do
the same. Each evolution installs a meter for the calls it makes (a context
variable, so concurrent evolutions keep theirs apart), and a price table
turns tokens into cost for ``max_cost``, ``EvolutionResult.usage`` and
``cost_to_quality``.

>>> Price(prompt=0.15, completion=0.60).cost(1_000_000, 500_000)
0.45
"""

from __future__ import annotations

import contextvars
import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class Price:
    """What a model costs, per million tokens.

    Args:
        prompt: Cost of a million prompt (input) tokens.
        completion: Cost of a million completion (output) tokens.
    """

    prompt: float
    completion: float

    def __post_init__(self) -> None:
        for name in ("prompt", "completion"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ValueError(f"Price.{name} must be a finite number >= 0, got {value!r}")

    def cost(self, prompt_tokens: int, completion_tokens: int) -> float:
        """The cost of ``prompt_tokens`` in and ``completion_tokens`` out.

        Args:
            prompt_tokens: Prompt tokens.
            completion_tokens: Completion tokens.
        """
        return (prompt_tokens * self.prompt + completion_tokens * self.completion) / 1e6


@dataclass(frozen=True, slots=True, kw_only=True)
class Usage:
    """Tokens one model used during an evolution, and what they cost.

    Args:
        model: The model name as the caller reported it.
        calls: How many responses reported usage.
        prompt_tokens: Prompt tokens, summed.
        completion_tokens: Completion tokens, summed.
        cost: Their cost under the price table; None when it has no price
            for ``model`` (counted as 0 against ``max_cost``).
    """

    model: str
    calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost: float | None = None


class UsageMeter:
    """Thread-safe token counters per model (user sync callables report from threads).

    Args:
        prices: Model name mapped to its :class:`Price`.
    """

    def __init__(self, prices: Mapping[str, Price] | None = None) -> None:
        self.prices = dict(prices or {})
        for model, price in self.prices.items():
            if not isinstance(price, Price):
                raise ValueError(f"prices[{model!r}] must be a Price, got {price!r}")
        self._lock = threading.Lock()
        self._tokens: dict[str, list[int]] = {}  # model -> [calls, prompt, completion]
        self._cost = 0.0

    def add(self, model: str, prompt_tokens: int, completion_tokens: int) -> None:
        """Count one response's usage.

        Args:
            model: The model that answered.
            prompt_tokens: Its prompt tokens.
            completion_tokens: Its completion tokens.
        """
        self.add_counts(model, 1, prompt_tokens, completion_tokens)

    def add_counts(
        self, model: str, calls: int, prompt_tokens: int, completion_tokens: int
    ) -> None:
        """Count ``calls`` responses' usage at once (what another meter's :meth:`counts` gave).

        Args:
            model: The model that answered.
            calls: How many responses.
            prompt_tokens: Their prompt tokens, summed.
            completion_tokens: Their completion tokens, summed.
        """
        price = self.prices.get(model)
        with self._lock:
            counts = self._tokens.setdefault(model, [0, 0, 0])
            counts[0] += calls
            counts[1] += prompt_tokens
            counts[2] += completion_tokens
            if price is not None:
                self._cost += price.cost(prompt_tokens, completion_tokens)

    def counts(self) -> list[list[str | int]]:
        """``[model, calls, prompt_tokens, completion_tokens]`` per model, sorted: JSON-ready."""
        with self._lock:
            return [[model, *counts] for model, counts in sorted(self._tokens.items())]

    @property
    def cost(self) -> float:
        """Total cost so far (models without a price count 0)."""
        with self._lock:
            return self._cost

    def snapshot(self) -> tuple[Usage, ...]:
        """One :class:`Usage` per model, sorted by model name."""
        with self._lock:
            items = sorted((m, list(c)) for m, c in self._tokens.items())
        return tuple(
            Usage(
                model=model,
                calls=calls,
                prompt_tokens=prompt,
                completion_tokens=completion,
                cost=self.prices[model].cost(prompt, completion) if model in self.prices else None,
            )
            for model, (calls, prompt, completion) in items
        )


_meter: contextvars.ContextVar[UsageMeter | None] = contextvars.ContextVar(
    "tailrace_usage_meter", default=None
)


def record_usage(*, model: str, prompt_tokens: int, completion_tokens: int) -> bool:
    """Count a model response's tokens towards the evolution running this call.

    Call it from a ``run``, ``reward`` or ``propose`` that talks to a model
    (the OpenAI-compatible adapter does). Outside an evolution it does nothing.

    Args:
        model: The model name (the key of the evolution's price table).
        prompt_tokens: Prompt tokens of the response.
        completion_tokens: Completion tokens of the response.

    Returns:
        True when an evolution counted it.

    Raises:
        ValueError: a token count is negative or not an integer.

    >>> record_usage(model="m", prompt_tokens=3, completion_tokens=1)
    False
    """
    for name, value in (("prompt_tokens", prompt_tokens), ("completion_tokens", completion_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    meter = _meter.get()
    if meter is None:
        return False
    meter.add(model, prompt_tokens, completion_tokens)
    return True


def install_meter(meter: UsageMeter) -> contextvars.Token[UsageMeter | None]:
    """Make ``meter`` count the usage of calls made from this context on; reset with the token.

    Args:
        meter: The evolution's meter.
    """
    return _meter.set(meter)


def uninstall_meter(token: contextvars.Token[UsageMeter | None]) -> None:
    """Undo :func:`install_meter`.

    Args:
        token: What :func:`install_meter` returned.
    """
    _meter.reset(token)
