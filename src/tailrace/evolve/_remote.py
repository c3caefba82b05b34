"""User calls on an executor: ``evolve``/``async_evolve(..., executor=...)``.

DESIGN "Scale-out": the evolution keeps its state (ledger, head, pool,
counters, audit) in the driving process, and an :class:`~tailrace.executors.Executor`
runs the work. Each attempt of a ``run``, ``reward`` or ``propose`` call is
one ``executor.invoke(node, payload, AttemptContext(...))`` on a cached node
per role (node id ``"run"``, ``"reward"`` or ``"propose"``) whose handler
spreads the payload back into the user's arguments.

What crosses (D5: the evolution's state is never pickled):

- the payload is JSON-shaped: ``{"args": [...], "rollout": {...} | None}``,
  the task as :meth:`Task.to_dict`, the rollout context as a dict; the
  handler rebuilds the :class:`Task` and makes the rollout context current
  (``current_rollout()`` works in the worker);
- the result is ``{"value": ..., "usage": [[model, calls, prompt, completion], ...]}``:
  an edit as :meth:`Edit.to_dict`, rebuilt here; a reward that is not a
  number or a proposal that is not an ``Edit`` as ``{"repr": ...}``, so the
  contract check still raises here, naming the task; the usage the call
  recorded with :func:`~tailrace.evolve.record_usage` is counted by the
  evolution's meter (``max_cost`` works on a remote executor too).

An executor that ships the payload to another process (``RayExecutor``)
encodes it with its codec, so a ``run`` output must be JSON-able there. The
user's functions themselves travel the way the executor sends handlers:
Ray pickles them (cloudpickle), as it does any task function.

>>> payload = call_payload("reward", (Task(id="t1", prompt="p"), "out"), None)
>>> payload["args"]
[{'id': 't1', 'prompt': 'p', 'meta': {}}, 'out']
>>> spread("reward", lambda task, output: float(task.id == "t1"))(payload)["value"]
1.0
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any

from .._context import _current
from ..executors import AttemptContext, Executor
from ..graph import Node
from ._model import Edit, RolloutContext, Task, current_rollout
from ._model import _current as _current_rollout
from ._usage import UsageMeter, _meter

#: Where each role's task sits among its arguments.
TASK_ARG = {"run": 1, "reward": 0, "propose": 1}


class RemoteValue:
    """A value a remote call returned that fails the contract, known by its ``repr``.

    The local contract checks (``check_reward``, ``check_edit``) reject it
    with the same message they give the value itself.

    Args:
        text: ``repr()`` of the value, taken where it was returned.
    """

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


class RemoteCalls:
    """Makes one attempt of a user call at a time through ``executor`` (see the module docstring).

    Args:
        executor: Runs each attempt.
        functions: The user's callables by role (``run`` absent when it is a graph).
        run_id: Names the evolution in each :class:`AttemptContext` (and in
            the errors a lost worker raises).
        meter: The evolution's usage meter; remote usage is added to it.
    """

    def __init__(
        self,
        executor: Executor,
        functions: Mapping[str, Callable[..., Any]],
        run_id: str,
        meter: UsageMeter,
    ) -> None:
        self.executor = executor
        self.run_id = run_id
        self.meter = meter
        # One node per role, made once: executors cache per node (Ray exports each handler once).
        self.nodes = {
            role: Node(id=role, handler=spread(role, fn)) for role, fn in functions.items()
        }
        self.visits = dict.fromkeys(functions, 0)

    def call(self, role: str, args: Sequence[Any]) -> Callable[[], Awaitable[Any]]:
        """The attempts of one call of ``role`` with ``args``: each await is the next try.

        The payload is built once, from the rollout context current now;
        the visit numbers the calls of a role, the attempt the tries of this one.

        Args:
            role: ``"run"``, ``"reward"`` or ``"propose"``.
            args: The user function's positional arguments.
        """
        node = self.nodes[role]
        self.visits[role] += 1
        visit = self.visits[role]
        payload = call_payload(role, args, current_rollout())
        tries = 0

        async def attempt() -> Any:
            nonlocal tries
            tries += 1
            context = AttemptContext(run_id=self.run_id, node_id=role, visit=visit, attempt=tries)
            # The executor contract: current_node() already returns the attempt in the caller.
            token = _current.set((self.run_id, role, visit, tries))
            try:
                result = await self.executor.invoke(node, payload, context)
            finally:
                _current.reset(token)
            return self.unwrap(role, result)

        return attempt

    def unwrap(self, role: str, result: Any) -> Any:
        """The user's value out of a handler's result; its usage counted by the evolution's meter.

        Args:
            role: The role of the call.
            result: What the handler returned (after the executor's decoding).

        Raises:
            TypeError: ``result`` is not what a handler of this module returns
                (a custom executor that changed it).
        """
        if not isinstance(result, Mapping) or not ("value" in result or "repr" in result):
            raise TypeError(
                f"evolve {role!r} call: the executor returned {result!r}, "
                "not the handler's result envelope"
            )
        for model, calls, prompt, completion in result.get("usage") or ():
            self.meter.add_counts(str(model), int(calls), int(prompt), int(completion))
        if "repr" in result:
            return RemoteValue(str(result["repr"]))
        value = result["value"]
        if role == "propose" and value is not None:
            return Edit.from_dict(value)
        return value


def call_payload(role: str, args: Sequence[Any], rollout: RolloutContext | None) -> dict[str, Any]:
    """The JSON-shaped payload of one call: its arguments (the task as a dict) and rollout context.

    Args:
        role: ``"run"``, ``"reward"`` or ``"propose"``.
        args: The user function's positional arguments.
        rollout: The rollout the call belongs to, or None.
    """
    sent = list(args)
    task = sent[TASK_ARG[role]]
    assert isinstance(task, Task)
    sent[TASK_ARG[role]] = task.to_dict()
    context = None
    if rollout is not None:
        context = {
            "task_id": rollout.task_id,
            "version": rollout.version,
            "phase": rollout.phase,
            "resumed": rollout.resumed,
        }
    return {"args": sent, "rollout": context}


def spread(role: str, fn: Callable[..., Any]) -> Callable[[Any], Any]:
    """The node handler of ``role``: spreads a payload into ``fn``'s arguments, wraps its result.

    Async when ``fn`` is, so an executor runs it the way it runs ``fn``.

    Args:
        role: ``"run"``, ``"reward"`` or ``"propose"``.
        fn: The user's callable.
    """
    if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - async callable objects
    ):
        return AsyncSpread(role, fn)
    return Spread(role, fn)


class Spread:
    """The handler of a sync user callable (see :func:`spread`).

    Args:
        role: The role it plays.
        fn: The user's callable.
    """

    __slots__ = ("fn", "role")

    def __init__(self, role: str, fn: Callable[..., Any]) -> None:
        self.role = role
        self.fn = fn

    def __call__(self, payload: Mapping[str, Any]) -> Any:
        """Run ``fn`` on the payload's arguments; its result as an envelope (see the module)."""
        args, rollout = _arguments(self.role, payload)
        meter = UsageMeter()
        with _scope(rollout, meter):
            value = self.fn(*args)
        if inspect.isawaitable(value):  # a sync callable that returns an awaitable
            return _finish(self.role, value, rollout, meter)
        return envelope(self.role, value, meter)


class AsyncSpread:
    """The handler of an async user callable (see :func:`spread`).

    Args:
        role: The role it plays.
        fn: The user's callable.
    """

    __slots__ = ("fn", "role")

    def __init__(self, role: str, fn: Callable[..., Any]) -> None:
        self.role = role
        self.fn = fn

    async def __call__(self, payload: Mapping[str, Any]) -> Any:
        """Await ``fn`` on the payload's arguments; its result as an envelope (see the module)."""
        args, rollout = _arguments(self.role, payload)
        meter = UsageMeter()
        with _scope(rollout, meter):
            value = await self.fn(*args)
        return envelope(self.role, value, meter)


async def _finish(
    role: str, value: Awaitable[Any], rollout: RolloutContext | None, meter: UsageMeter
) -> Any:
    with _scope(rollout, meter):
        result = await value
    return envelope(role, result, meter)


def _arguments(role: str, payload: Mapping[str, Any]) -> tuple[list[Any], RolloutContext | None]:
    args = list(payload["args"])
    args[TASK_ARG[role]] = Task.from_dict(args[TASK_ARG[role]])
    rollout = payload.get("rollout")
    return args, None if rollout is None else RolloutContext(**rollout)


@contextlib.contextmanager
def _scope(rollout: RolloutContext | None, meter: UsageMeter) -> Iterator[None]:
    """The rollout context and a meter of this call's own, current while the user's code runs."""
    rollout_token = _current_rollout.set(rollout)
    meter_token = _meter.set(meter)
    try:
        yield
    finally:
        _meter.reset(meter_token)
        _current_rollout.reset(rollout_token)


def envelope(role: str, value: Any, meter: UsageMeter) -> dict[str, Any]:
    """A handler's result: the value in JSON form (or its ``repr`` when it breaks the contract), and usage.

    Args:
        role: The role of the call.
        value: What the user's callable returned.
        meter: The usage it recorded.
    """
    usage = meter.counts()
    if role == "propose":
        if value is None or isinstance(value, Edit):
            return {"value": None if value is None else value.to_dict(), "usage": usage}
        return {"repr": repr(value), "usage": usage}
    if role == "reward" and not _json_number(value):
        return {"repr": repr(value), "usage": usage}
    return {"value": value, "usage": usage}


def _json_number(value: Any) -> bool:
    """Whether ``value`` is a number JSON keeps as it is (no bool, NaN or infinity)."""
    return not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)
