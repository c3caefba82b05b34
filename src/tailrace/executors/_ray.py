"""``RayExecutor``: node attempts as Ray tasks (extra ``ray``; DESIGN "Scale-out").

The store keeps the run state, the driving engine is its only writer, and
Ray runs the work: each try of an attempt is one Ray task. What crosses to the
worker is the handler (Ray pickles the function itself, as it does for any
task), the input as the codec's JSON text, and the attempt's ids; what comes
back is the result as JSON text (D5: run state is never pickled). Ray's own
retries are off (``max_retries=0``): the node's :class:`~tailrace.RetryPolicy`
is the only one, so every try is an event (E11).

Cancellation (failure teardown, a hedge loser, a timeout, the caller
cancelling the run) sends ``ray.cancel``, which raises ``KeyboardInterrupt``
in a worker running Python code; a worker that has not stopped after
``cancel_grace`` seconds (it is blocked in C code or a sleep) is killed with
``ray.cancel(force=True)``. The attempt ends once Ray reports the task
stopped, so a retry or a hedge never overlaps its predecessor's side effects
for longer than the grace period.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
from collections.abc import Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

from .._codec import DEFAULT_CODEC
from .._context import Where, _current
from .._errors import EncodeError, ExecutorLost
from ..graph import file_modules

if TYPE_CHECKING:
    from .._codec import Codec
    from ..graph import Handler, Node
    from ._base import AttemptContext

logger = logging.getLogger("tailrace.executors.ray")

#: Node resources Ray takes as task options of their own; any other name is a custom resource.
_RAY_OPTIONS = ("num_cpus", "num_gpus", "memory")

#: Cached task functions per node are dropped whole past this many (nodes of many graphs).
_MAX_FUNCTIONS = 4096


class RayExecutor:
    """Runs node attempts as Ray tasks; see the module docstring.

    ``address`` is the Ray cluster to connect to (``"auto"``, ``"host:port"``
    or ``"ray://host:10001"``); None uses ``RAY_ADDRESS`` when it is set and
    otherwise starts a local Ray. If Ray is already initialised in this
    process, that connection is used as it is. ``init`` holds further
    keyword arguments for ``ray.init`` (``num_cpus=2`` for a local Ray, say).
    ``resources`` and ``runtime_env`` are defaults for every task; a node's
    own ``resources`` override them per key and its ``runtime_env`` per
    top-level key. ``codec`` encodes inputs and results (default: tailrace's
    JSON codec; a custom one must be picklable, as it travels with the task).
    ``cancel_grace`` is how long a cancelled task may take to stop before its
    worker is killed, and ``kill_wait`` how long to wait for Ray to confirm
    the kill (seconds).

    Use it as ``async with RayExecutor() as ray_executor:`` or call
    :meth:`start` and :meth:`aclose`; it connects on first use otherwise.
    :meth:`aclose` shuts Ray down only if this executor started it.
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        init: Mapping[str, Any] | None = None,
        resources: Mapping[str, float] | None = None,
        runtime_env: Mapping[str, Any] | None = None,
        codec: Codec | None = None,
        cancel_grace: float = 2.0,
        kill_wait: float = 10.0,
    ) -> None:
        for name, value in (("cancel_grace", cancel_grace), ("kill_wait", kill_wait)):
            if not 0 <= value < float("inf"):
                raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
        self.address = address
        self.init = dict(init or {})
        self.resources = dict(resources or {})
        self.runtime_env = dict(runtime_env or {})
        self.codec = codec
        self.cancel_grace = cancel_grace
        self.kill_wait = kill_wait
        self._codec = codec or DEFAULT_CODEC
        self._started = False
        self._owns_ray = False
        self._lock: asyncio.Lock | None = None
        self._functions: dict[int, tuple[Node, Any]] = {}
        #: Ray remote functions by handler identity (a handler need not be hashable).
        self._remotes: dict[int, tuple[Handler, Any]] = {}

    # -- lifecycle ------------------------------------------------------------

    async def start(self) -> None:
        """Connect to Ray (or start a local one) off the event loop; idempotent."""
        if self._started:
            return
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._started:
                return
            await asyncio.get_running_loop().run_in_executor(None, self._connect)

    def _connect(self) -> None:
        ray = _import_ray()
        if not ray.is_initialized():
            address = self.address or os.environ.get("RAY_ADDRESS") or None
            ray.init(address=address, **self.init)
            self._owns_ray = True
        self._started = True

    async def aclose(self) -> None:
        """Forget the task functions; shut Ray down if this executor started it. Idempotent."""
        self._functions.clear()
        self._remotes.clear()
        if not self._started:
            return
        self._started = False
        if self._owns_ray:
            self._owns_ray = False
            await asyncio.get_running_loop().run_in_executor(None, _import_ray().shutdown)

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    # -- one attempt ----------------------------------------------------------

    async def invoke(self, node: Node, payload: Any, context: AttemptContext) -> Any:
        """Run ``node.handler(payload)`` as a Ray task for the attempt ``context`` (see :class:`~tailrace.executors.Executor`)."""
        if not self._started:
            await self.start()
        try:
            text = self._codec.encode(payload)
        except (TypeError, ValueError) as exc:
            raise EncodeError(
                f"run {context.run_id!r}: node {node.id!r}: its input cannot be sent to Ray "
                f"as JSON: {exc}"
            ) from exc
        # A map's item and a backup's primary: current_node().item and .backup_of in the worker too.
        where: Where = (
            context.run_id, context.node_id, context.visit, context.attempt, context.item,
            context.backup_of,
        )  # fmt: skip
        ref = self._function_for(node).remote(text, where)
        try:
            result = await ref
        except asyncio.CancelledError:
            await self._stop(ref, node)
            raise
        except Exception as exc:
            raise _outcome_error(exc, context) from None
        return self._codec.decode(result)

    def _function_for(self, node: Node) -> Any:
        """The node's Ray task function with its options (one export per handler)."""
        cached = self._functions.get(id(node))
        if cached is not None and cached[0] is node:
            return cached[1]
        known = self._remotes.get(id(node.handler))
        if known is not None and known[0] is node.handler:
            remote = known[1]
        else:
            _file_modules_by_value()
            remote = _import_ray().remote(_task_for(node.handler, self.codec))
            if len(self._remotes) >= _MAX_FUNCTIONS:
                self._remotes.clear()
            self._remotes[id(node.handler)] = (node.handler, remote)
        options = task_options(
            {**self.resources, **(node.resources or {})},
            {**self.runtime_env, **(node.runtime_env or {})},
        )
        function = remote.options(name=f"tailrace:{node.id}", **options)
        if len(self._functions) >= _MAX_FUNCTIONS:
            self._functions.clear()
        self._functions[id(node)] = (node, function)
        return function

    async def _stop(self, ref: Any, node: Node) -> None:
        """Cancel the task, kill its worker after the grace period, wait (boundedly) until it ended."""
        _cancel(ref, force=False, node=node)
        try:
            if await _settles(ref, self.cancel_grace):
                return
            _cancel(ref, force=True, node=node)
            if not await _settles(ref, self.kill_wait):
                logger.warning(
                    "node %r: Ray has not confirmed the kill of its task after %.1f s",
                    node.id,
                    self.kill_wait,
                )
        except asyncio.CancelledError:
            _cancel(ref, force=True, node=node)  # cancelled again while waiting: stop it now
            raise


def task_options(resources: Mapping[str, float], runtime_env: Mapping[str, Any]) -> dict[str, Any]:
    """Ray task options for a node's ``resources`` and ``runtime_env``; Ray's retries off.

    >>> task_options({"num_cpus": 2, "accelerator": 1}, {})
    {'max_retries': 0, 'retry_exceptions': False, 'num_cpus': 2, 'resources': {'accelerator': 1}}
    """
    options: dict[str, Any] = {"max_retries": 0, "retry_exceptions": False}
    custom: dict[str, float] = {}
    for name, amount in resources.items():
        if name in _RAY_OPTIONS:
            options[name] = amount
        else:
            custom[name] = amount
    if custom:
        options["resources"] = custom
    if runtime_env:
        options["runtime_env"] = dict(runtime_env)
    return options


def _file_modules_by_value() -> None:
    """Have Ray pickle the code of modules loaded from files by value.

    A graph loaded from a file (``tailrace run path.py:graph``, a worker's
    ``--graphs``) lives in a module only this process can import; its
    handlers, and what they call in that file, reach the workers as code.
    """
    from ray import cloudpickle  # the ray extra is optional: imported once Ray is in use

    pickler: Any = cloudpickle
    registered = pickler.list_registry_pickle_by_value()
    for module in file_modules():
        if module.__name__ not in registered:
            pickler.register_pickle_by_value(module)


def _task_for(handler: Handler, codec: Codec | None) -> Any:
    """The function Ray runs for ``handler``: a closure Ray pickles once, calling :func:`run_task`."""

    def tailrace_task(text: str, where: Where) -> str:
        return run_task(handler, codec, text, where)

    return tailrace_task


def run_task(handler: Handler, codec: Codec | None, text: str, where: Where) -> str:
    """Inside the worker: decode the input, run the handler as that attempt, encode its result.

    ``where`` is (run id, node id, visit, try[, item]): ``current_node()`` returns it
    while the handler runs. An async handler runs on an event loop of its own.
    """
    codec = codec or DEFAULT_CODEC
    payload = codec.decode(text)
    token = _current.set(where)
    try:
        result = handler(payload)
        if inspect.isawaitable(result):
            result = asyncio.run(_awaited(result))
    finally:
        _current.reset(token)
    try:
        return codec.encode(result)
    except (TypeError, ValueError) as exc:
        raise EncodeError(
            f"run {where[0]!r}: node {where[1]!r} (visit {where[2]}, try {where[3]}): "
            f"its result is not encodable: {exc}"
        ) from None


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


async def _settles(ref: Any, seconds: float) -> bool:
    """Whether the task behind ``ref`` ends (any outcome) within ``seconds``."""
    future = asyncio.wrap_future(ref.future())
    done, _ = await asyncio.wait({future}, timeout=seconds)
    if not done:
        future.cancel()
        return False
    future.exception()  # retrieved: its outcome is the cancellation we asked for
    return True


def _cancel(ref: Any, *, force: bool, node: Node) -> None:
    try:
        _import_ray().cancel(ref, force=force)
    except Exception:  # never mask the cancellation being delivered; say why it may linger
        logger.warning("node %r: ray.cancel(force=%s) failed", node.id, force, exc_info=True)


def _outcome_error(exc: Exception, context: AttemptContext) -> Exception:
    """The handler's own exception (E9), or :class:`ExecutorLost` when the worker was lost."""
    ray = _import_ray()
    errors = ray.exceptions
    if isinstance(exc, errors.RayTaskError):
        cause = getattr(exc, "cause", None)
        if isinstance(cause, Exception) and not isinstance(cause, errors.TaskCancelledError):
            remote = getattr(exc, "traceback_str", "")
            if remote:
                cause.add_note(f"raised in a Ray task:\n{remote}")
            return cause
    lost = (
        errors.WorkerCrashedError,
        errors.RayActorError,
        errors.NodeDiedError,
        errors.LocalRayletDiedError,
        errors.ObjectLostError,
        errors.OutOfMemoryError,
        errors.TaskCancelledError,
        # Left here: a cancellation that was not ours, or a worker interrupted out of the handler
        # (its cause is TaskCancelledError or a BaseException such as KeyboardInterrupt).
        errors.RayTaskError,
    )
    if isinstance(exc, lost):
        lost_error = ExecutorLost(
            f"run {context.run_id!r}: node {context.node_id!r} (visit {context.visit}, "
            f"try {context.attempt}): the Ray worker running it was lost: "
            f"{type(exc).__name__}: {_first_line(exc)}"
        )
        lost_error.__cause__ = exc
        return lost_error
    return exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def _import_ray() -> Any:
    try:
        import ray  # the ray extra is optional: imported only when an executor connects
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "RayExecutor needs Ray: pip install 'tailrace[ray]'", name=exc.name
        ) from exc
    return ray
