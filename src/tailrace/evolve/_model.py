"""The evolve contracts: tasks, artifacts, edits, and the user callables' shapes.

An *artifact* (a prompt, a skill file, a rule set) is a keyed set of text
entries plus a ``render`` function that turns the entries into the text a
rollout sees. An *edit* sets or removes entries. Rollouts run the rendered
artifact on a :class:`Task`, a reward scores the output in ``[0, 1]``, and a
proposer turns a rollout into an :class:`Edit` (or None).

>>> art = Artifact(entries={"tone": "be brief"})
>>> art.apply(Edit(set={"lang": "answer in French"})).render()
'lang: answer in French\\ntone: be brief'
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import inspect
import math
import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

Renderer = Callable[[Mapping[str, str]], str]


def render_entries(entries: Mapping[str, str]) -> str:
    """Render ``entries`` as ``key: text`` lines sorted by key (the default renderer).

    Args:
        entries: The artifact's keyed text entries.

    >>> render_entries({"b": "2", "a": "1"})
    'a: 1\\nb: 2'
    """
    return "\n".join(f"{key}: {entries[key]}" for key in sorted(entries))


@dataclass(frozen=True, slots=True, kw_only=True)
class Task:
    """One task a rollout runs on.

    Args:
        id: Unique id of the task (shards, the resume queue and the held-out
            split refer to tasks by it).
        prompt: The task's text.
        meta: Anything else the run, reward or proposer need (JSON-able when
            the run is a durable graph); ``meta["cost"]`` (a number) is the
            cost fed to a duration estimator, default 1.
    """

    id: str
    prompt: str
    meta: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The task as a JSON-ready dict (the ``task`` of a graph rollout's input)."""
        return {"id": self.id, "prompt": self.prompt, "meta": dict(self.meta)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Task:
        """Rebuild a task from ``data``, the output of :meth:`to_dict`.

        Args:
            data: ``{"id": ..., "prompt": ..., "meta": {...}}`` (``meta`` optional).

        >>> Task.from_dict(Task(id="t1", prompt="hi", meta={"cost": 2}).to_dict())
        Task(id='t1', prompt='hi', meta={'cost': 2})
        """
        return cls(id=data["id"], prompt=data["prompt"], meta=dict(data.get("meta") or {}))

    @property
    def cost(self) -> float:
        """``meta["cost"]`` as a float, 1.0 when absent: the duration estimator's input."""
        value = self.meta.get("cost", 1.0)
        return float(value) if isinstance(value, int | float) else 1.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Edit:
    """A change to an artifact: entries to set and keys to remove.

    Args:
        set: Keys mapped to their new text.
        remove: Keys to delete (absent keys are ignored).
        note: Why; recorded in the ledger with the commit.

    Raises:
        ValueError: a key is empty or not a string, a value is not a string,
            or a key is both set and removed.
    """

    set: Mapping[str, str] = field(default_factory=dict)
    remove: tuple[str, ...] = ()
    note: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "set", dict(self.set))
        object.__setattr__(self, "remove", tuple(self.remove))
        for key in (*self.set, *self.remove):
            if not isinstance(key, str) or not key:
                raise ValueError(f"edit keys must be non-empty strings, got {key!r}")
        for key, value in self.set.items():
            if not isinstance(value, str):
                raise ValueError(f"edit of {key!r}: value must be a string, got {value!r}")
        both = sorted(set(self.set) & set(self.remove)) if self.remove else []
        if both:
            raise ValueError(f"edit both sets and removes {both}")

    @property
    def blast_radius(self) -> int:
        """How many keys the edit touches (what an audit weighs it by)."""
        return len(self.set) + len(self.remove)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form; :meth:`from_dict` reverses it."""
        return {"set": dict(self.set), "remove": list(self.remove), "note": self.note}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Edit:
        """Rebuild an edit from ``data``, the output of :meth:`to_dict`."""
        return cls(
            set=data.get("set", {}), remove=tuple(data.get("remove", ())), note=data.get("note", "")
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Artifact:
    """A keyed set of text entries and the function that renders them.

    Args:
        entries: Keys mapped to text; copied, so later changes to the mapping
            passed in do not leak in.
        renderer: Turns entries into the text rollouts see (default
            :func:`render_entries`).
    """

    entries: Mapping[str, str] = field(default_factory=dict)
    renderer: Renderer = render_entries

    def __post_init__(self) -> None:
        object.__setattr__(self, "entries", dict(self.entries))

    def render(self) -> str:
        """The rendered text of the entries."""
        return self.renderer(self.entries)

    def apply(self, edit: Edit) -> Artifact:
        """Return a new artifact with ``edit`` applied (this one is unchanged).

        Args:
            edit: The keys to set and remove.
        """
        entries = {k: v for k, v in self.entries.items() if k not in edit.remove}
        entries.update(edit.set)
        return Artifact(entries=entries, renderer=self.renderer)

    def with_entries(self, entries: Mapping[str, str]) -> Artifact:
        """Return an artifact with the same renderer and ``entries``.

        Args:
            entries: The new keyed text entries.
        """
        return Artifact(entries=entries, renderer=self.renderer)


class RunFn(Protocol):
    """``run(rendered, task) -> output``, sync or async."""

    def __call__(self, rendered: str, task: Task, /) -> Any:
        """Run the rendered artifact on ``task`` (``rendered``) and return the output."""


class RewardFn(Protocol):
    """``reward(task, output) -> float`` in ``[0, 1]``, sync or async."""

    def __call__(self, task: Task, output: Any, /) -> Any:
        """Score ``output`` on ``task``."""


class ProposeFn(Protocol):
    """``propose(rendered, task, output, reward) -> Edit | None``, sync or async."""

    def __call__(self, rendered: str, task: Task, output: Any, reward: float, /) -> Any:
        """Suggest an edit from one rollout (``rendered``, ``task``, ``output``, ``reward``)."""


def check_reward(task: Task, value: Any) -> float:
    """Return ``value`` as a float if it is a finite number in ``[0, 1]``.

    Args:
        task: The task the reward is for (named in the error).
        value: What the reward function returned.

    Raises:
        ValueError: naming the task, when ``value`` is not a number in ``[0, 1]``.

    >>> check_reward(Task(id="t1", prompt=""), 1)
    1.0
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"reward for task {task.id!r} must be a number in [0, 1], got {value!r}")
    reward = float(value)
    if not (math.isfinite(reward) and 0.0 <= reward <= 1.0):
        raise ValueError(f"reward for task {task.id!r} must be in [0, 1], got {value!r}")
    return reward


def check_edit(task: Task, value: Any) -> Edit | None:
    """Return the proposer's ``value`` as an edit, None for None or an empty edit.

    Args:
        task: The task the proposal came from (named in the error).
        value: What the proposer returned.

    Raises:
        TypeError: ``value`` is neither None nor an :class:`Edit`.
    """
    if value is None:
        return None
    if not isinstance(value, Edit):
        raise TypeError(f"propose for task {task.id!r} must return an Edit or None, got {value!r}")
    return value if value.blast_radius else None


#: Fewer held-out tasks than this warn (:class:`HeldOutTooSmall`): one task then
#: moves the held-out mean by more than 0.1, and the gate reads noise as gains.
MIN_HELD_OUT = 10


class HeldOutTooSmall(UserWarning):
    """The held-out set has fewer than ``MIN_HELD_OUT`` tasks: its verdicts mean little.

    Warned, not refused: a small set is fine for a smoke test or a demo. Add
    tasks or raise ``held_out_frac`` for a verdict worth merging on.
    """


def split_tasks(
    tasks: Sequence[Task], held_out_frac: float = 0.4, shuffle_seed: int | None = None
) -> tuple[list[Task], list[Task]]:
    """Split ``tasks`` into ``(train, held_out)``; the held-out part comes last.

    Args:
        tasks: At least 4 tasks with unique ids.
        held_out_frac: Fraction held out, strictly between 0 and 1; rounded,
            but both parts keep at least one task.
        shuffle_seed: Shuffle with ``random.Random(shuffle_seed)`` first; None
            keeps the given order.

    Raises:
        ValueError: fewer than 4 tasks, duplicate ids, or a fraction out of range.

    >>> train, held = split_tasks([Task(id=str(i), prompt="") for i in range(5)])
    >>> [t.id for t in train], [t.id for t in held]
    (['0', '1', '2'], ['3', '4'])
    """
    if len(tasks) < 4:
        raise ValueError(f"evolution needs at least 4 tasks, got {len(tasks)}")
    ids = [t.id for t in tasks]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise ValueError(f"task ids must be unique; duplicated: {duplicates}")
    if not 0.0 < held_out_frac < 1.0:
        raise ValueError(f"held_out_frac must be in (0, 1), got {held_out_frac!r}")
    ordered = list(tasks)
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(ordered)
    n_held = min(len(ordered) - 1, max(1, round(len(ordered) * held_out_frac)))
    cut = len(ordered) - n_held
    return ordered[:cut], ordered[cut:]


def shard(tasks: Sequence[Task], workers: int) -> list[list[Task]]:
    """Deal ``tasks`` round-robin into ``workers`` shards (each non-empty if possible).

    Args:
        tasks: The training tasks.
        workers: How many shards; at least 1.
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    return [list(tasks[w::workers]) for w in range(workers)]


@dataclass(frozen=True, slots=True, kw_only=True)
class RolloutContext:
    """What the rollout running now is: visible to ``run`` through :func:`current_rollout`.

    Args:
        task_id: The task being run.
        version: The ledger version of the artifact it renders.
        phase: ``"train"`` (a worker's rollout) or ``"eval"`` (held-out scoring).
        resumed: True when a worker re-runs the task from the resume queue.
    """

    task_id: str
    version: int
    phase: str
    resumed: bool = False


_current: contextvars.ContextVar[RolloutContext | None] = contextvars.ContextVar(
    "tailrace_rollout", default=None
)


def current_rollout() -> RolloutContext | None:
    """The :class:`RolloutContext` of the rollout calling this, or None outside one.

    >>> current_rollout() is None
    True
    """
    return _current.get()


def set_rollout(context: RolloutContext) -> None:
    """Mark the current asyncio task as running the rollout ``context`` describes.

    Args:
        context: The rollout.
    """
    _current.set(context)


async def call_user(
    fn: Callable[..., Any], *args: Any, executor: concurrent.futures.Executor | None = None
) -> Any:
    """Call a user callable: await it if async, else run it in a thread (off the loop).

    Args:
        fn: The callable.
        args: Its positional arguments.
        executor: Where a sync ``fn`` runs (the evolution's daemon threads, so
            an abandoned call never holds the interpreter open); None uses
            asyncio's default executor.
    """
    if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - async callable objects
    ):
        return await fn(*args)
    # The copied context carries the rollout context into the thread, as to_thread does.
    call = functools.partial(contextvars.copy_context().run, fn, *args)
    result = await asyncio.get_running_loop().run_in_executor(executor, call)
    if inspect.isawaitable(result):
        return await _await(result)
    return result


async def _await(value: Awaitable[Any]) -> Any:
    return await value
