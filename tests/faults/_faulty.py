"""Shared pieces of the fault-injection suite: stores, a failing store, a handler recorder.

Imported by the test modules as ``from tests.faults import _faulty as faulty``.

- The stores under test (each backend on a fresh database) come from
  :mod:`tests.fixtures`: the modules bind ``fixtures.each_store`` as their ``store``.
- :class:`DelegatingStore` forwards every method of the :class:`RunStore`
  contract to a real store; :class:`LaggingStore` makes each call late;
  :class:`CancellingStore` cancels a task just
  before forwarding its N-th call; :class:`FailingStore` makes its ``commit`` raise
  from the ``fail_at``-th call on, and lets handlers pace themselves on what its
  successful commits wrote, so a run makes a known least number of writes.
- :class:`Recorder` builds async handlers that log each start and end per
  ``(node, visit)`` and phase, wait (paced or for ever) when told, and saw
  ``CancelledError`` when they were cancelled.
- :func:`guarded` awaits a coroutine under a hang guard that is never a timing
  assertion: it fails the test only when something hangs.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import pytest

import tailrace as tr
from tailrace._errors import RunNotFound
from tailrace.stores import Harvest, RunStore
from tests import fixtures

#: Seconds after which a wait is a hang; generous, so a loaded machine never trips it.
HANG_GUARD = fixtures.HANG_GUARD

T = TypeVar("T")


# --- stores that misbehave -------------------------------------------------------------


def _delegate(name: str) -> Callable[..., Any]:
    public = name.removeprefix("_")  # a backend primitive ``_x`` forwards the contract's ``x``
    if public.startswith("read_"):  # a synchronous read (``_read_clock``): ``clock``
        public = public.removeprefix("read_")
    method: Callable[..., Any]
    if inspect.iscoroutinefunction(getattr(RunStore, name)):

        async def method(self: DelegatingStore, *args: Any, **kwargs: Any) -> Any:
            self.before(public)
            await self.on_the_way(public)
            return await getattr(self.inner, public)(*args, **kwargs)

    else:  # read at once, no store call to fault: forwarded as it is

        def method(self: DelegatingStore, *args: Any, **kwargs: Any) -> Any:
            return getattr(self.inner, public)(*args, **kwargs)

    method.__name__ = name
    method.__doc__ = f"Forward ``{public}`` to the wrapped store."
    return method


class _Forwarding(RunStore):
    """Every abstract method of the contract, forwarded (built from the contract itself,
    so a method added to :class:`RunStore` is forwarded without touching this file)."""

    inner: RunStore


for _name in sorted(RunStore.__abstractmethods__):
    setattr(_Forwarding, _name, _delegate(_name))
_Forwarding.__abstractmethods__ = frozenset()


class DelegatingStore(_Forwarding):
    """A :class:`RunStore` that forwards every call to ``inner``."""

    def __init__(self, inner: RunStore) -> None:
        self.inner = inner

    @property
    def read_only(self) -> bool:
        """Whether the wrapped store is read-only."""
        return self.inner.read_only

    def before(self, name: str) -> None:
        """Called before each forwarded call of method ``name``; a hook for subclasses."""

    async def on_the_way(self, name: str) -> None:
        """Awaited after :meth:`before`, before the call reaches the wrapped store: where a
        subclass makes the way to the database slow."""


class LaggingStore(DelegatingStore):
    """Forwards everything, each call ``lag`` seconds late: a database across a slow link,
    so what other processes do lands between the calls of one step."""

    def __init__(self, inner: RunStore, lag: float) -> None:
        super().__init__(inner)
        self.lag = lag

    async def on_the_way(self, name: str) -> None:
        """Wait ``lag`` seconds."""
        await asyncio.sleep(self.lag)


class CancellingStore(DelegatingStore):
    """Forwards everything; cancels ``target`` just before forwarding the ``at``-th call.

    Whatever method that call is (creating the run, taking the lease, a
    commit the run waits for, a heartbeat, the release), the cancellation
    lands while the run is inside it or waiting for it. ``calls`` lists the
    methods called, in order; ``at=0`` only counts.
    """

    def __init__(self, inner: RunStore, *, at: int = 0) -> None:
        super().__init__(inner)
        self.at = at
        self.calls: list[str] = []
        self.target: asyncio.Future[Any] | None = None
        self.fired = False

    def before(self, name: str) -> None:
        """Count the call; cancel ``target`` if it is the ``at``-th."""
        self.calls.append(name)
        if len(self.calls) == self.at and self.target is not None:
            self.fired = True
            self.target.cancel()


class FailingStore(DelegatingStore):
    """Forwards everything, but ``commit`` raises :class:`~tailrace.StoreError` from call ``fail_at`` on.

    A failing call writes nothing (as a rolled-back transaction). ``errors``
    keeps every error raised, in order; ``log``, when given, receives
    ``("store_failed", call)`` at the moment of the first failure, so a test
    can order it against handler starts. ``durable`` holds what successful
    commits wrote: ``("started", node, visit)`` and ``("result", node, visit)``.
    """

    def __init__(self, inner: RunStore, *, fail_at: int, log: list[Any] | None = None) -> None:
        super().__init__(inner)
        self.fail_at = fail_at
        self.calls = 0
        self.errors: list[tr.StoreError] = []
        self.durable: set[tuple[str, str, int]] = set()
        self._log = log
        self._committed = asyncio.Event()

    async def commit(self, run_id: str, token: int, harvest: Harvest) -> None:
        """Forward the write, or raise from the ``fail_at``-th call on."""
        self.calls += 1
        if self.calls >= self.fail_at:
            error = tr.StoreError(f"run {run_id!r}: injected failure of commit {self.calls}")
            if not self.errors and self._log is not None:
                self._log.append(("store_failed", self.calls))
            self.errors.append(error)
            raise error
        await self.inner.commit(run_id, token, harvest)
        for event in harvest.events:
            if event.type == tr.EventType.NODE_STARTED.value and event.node_id is not None:
                self.durable.add(("started", event.node_id, event.visit or 0))
        self.durable.update(("result", r.node_id, r.visit) for r in harvest.results)
        done, self._committed = self._committed, asyncio.Event()
        done.set()

    async def until_durable(self, wanted: set[tuple[str, str, int]]) -> None:
        """Return once every entry of ``wanted`` was written by a successful commit.

        Waiting for one's own start to be durable paces a handler on the
        writes themselves, never on time: a chain of such handlers makes at
        least one commit per link, however the writer groups harvests.
        """
        while not wanted <= self.durable:
            await self._committed.wait()


# --- handlers that record themselves -----------------------------------------------------


class Recorder:
    """Builds handlers that log starts and ends per ``(node, visit)`` and per phase.

    ``phase`` names the current stage of a test (handlers of two phases never
    overlap); ``pace`` (a :class:`FailingStore`) makes handlers wait for their
    own start to be durable in it before returning (see :meth:`task`); ``hang`` makes
    :meth:`never_returns` handlers wait for ever. ``on_start(run_id, phase, n)``
    is called at the ``n``-th start of a run in a phase, from inside the handler.
    """

    def __init__(self) -> None:
        self.phase = "start"
        self.pace: FailingStore | None = None
        self.hang = False
        self.log: list[Any] = []
        self.started: defaultdict[str, Counter[tuple[str, int]]] = defaultdict(Counter)
        self.returned: defaultdict[str, Counter[tuple[str, int]]] = defaultdict(Counter)
        self.cancelled: defaultdict[str, Counter[tuple[str, int]]] = defaultdict(Counter)
        self.payloads: dict[tuple[str, str, int], Any] = {}
        self.run_starts: Counter[tuple[str, str]] = Counter()
        self.on_start: Callable[[str, str, int], None] | None = None
        #: Run id -> phase of its handlers, for tests that drive many runs at once.
        self.phase_of_run: dict[str, str] = {}

    def _enter(self, payload: Any) -> tuple[str, tuple[str, int]]:
        ctx = tr.current_node()
        assert ctx is not None
        key = (ctx.node_id, ctx.visit)
        phase = self.phase_of_run.get(ctx.run_id, self.phase)
        self.log.append(("start", phase, key))
        self.started[phase][key] += 1
        self.payloads[(phase, *key)] = payload
        self.run_starts[(ctx.run_id, phase)] += 1
        if self.on_start is not None:
            self.on_start(ctx.run_id, phase, self.run_starts[(ctx.run_id, phase)])
        return phase, key

    def task(
        self, fn: Callable[[Any], Any], *, after: tuple[str, ...] = (), yields: int = 0
    ) -> Callable[[Any], Coroutine[Any, Any, Any]]:
        """An async handler returning ``fn(payload)``.

        When paced, it first waits until the pace store made its own start
        durable, and the results (visit 1) of the nodes named in ``after``;
        otherwise it yields to the loop ``yields`` times (so a run spans many
        loop iterations and cancellations land at many points).
        """

        async def handler(payload: Any) -> Any:
            phase, key = self._enter(payload)
            try:
                if self.pace is not None:
                    wanted = {("started", *key)} | {("result", node, 1) for node in after}
                    await self.pace.until_durable(wanted)
                for _ in range(yields):
                    await asyncio.sleep(0)
            except asyncio.CancelledError:
                self._cancelled(phase, key)
                raise
            self._returned(phase, key)
            return fn(payload)

        return handler

    def never_returns(self, value: Any) -> Callable[[Any], Coroutine[Any, Any, Any]]:
        """A handler that, while ``hang`` is set, awaits an event nobody sets; else returns ``value``."""

        async def handler(payload: Any) -> Any:
            phase, key = self._enter(payload)
            if self.hang:
                try:
                    await asyncio.Event().wait()
                except asyncio.CancelledError:
                    self._cancelled(phase, key)
                    raise
            self._returned(phase, key)
            return value

        return handler

    def _cancelled(self, phase: str, key: tuple[str, int]) -> None:
        self.log.append(("cancelled", phase, key))
        self.cancelled[phase][key] += 1

    def _returned(self, phase: str, key: tuple[str, int]) -> None:
        self.log.append(("returned", phase, key))
        self.returned[phase][key] += 1

    def unfinished(self, phase: str) -> Counter[tuple[str, int]]:
        """Handler executions of ``phase`` that neither returned nor saw their cancellation."""
        return self.started[phase] - self.returned[phase] - self.cancelled[phase]


# --- helpers ---------------------------------------------------------------------------------


async def guarded(awaitable: Coroutine[Any, Any, T], what: str, guard: float = HANG_GUARD) -> T:
    """Await ``awaitable`` in a task of its own; fail the test (naming ``what``) if it hangs.

    Unlike a timeout around the call, the guard never cancels into the code
    under test before it decides it is a hang, so a slow machine changes nothing.
    """
    task = asyncio.ensure_future(awaitable)
    done, _ = await asyncio.wait({task}, timeout=guard)
    if not done:
        task.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.wait({task}, timeout=5.0)
        pytest.fail(f"{what} hung for {guard} s")
    return task.result()


async def until(condition: Callable[[], bool], what: str, guard: float = HANG_GUARD) -> None:
    """Poll ``condition()`` until it holds (a deadlock guard after ``guard`` s, never a timing check)."""
    await fixtures.until(condition, what, guard=guard, every=0.001)


def after_hops(hops: int, fn: Callable[[], Any]) -> None:
    """Call ``fn`` after ``hops`` turns of the event loop (0: now)."""
    if hops == 0:
        fn()
    else:
        asyncio.get_running_loop().call_soon(after_hops, hops - 1, fn)


async def committed_keys(store: RunStore, run_id: str) -> dict[tuple[str, int], str]:
    """``(node, visit) -> value_json`` of every result ``run_id`` committed (none if not stored)."""
    try:
        return {(r.node_id, r.visit): r.value_json for r in await store.results(run_id)}
    except RunNotFound:
        return {}


def lease_tasks() -> list[asyncio.Task[Any]]:
    """Lease heartbeat tasks still alive (structured concurrency: none once a run returned)."""
    return [t for t in asyncio.all_tasks() if t.get_name().startswith("lease:") and not t.done()]


async def assert_no_lease_held(store: RunStore, run_ids: list[str]) -> None:
    """Every run of ``run_ids`` that is stored, and every run listed, holds no live lease."""
    listed = {r.run_id: r for r in await store.list_runs()}
    for run_id in run_ids:
        try:
            record = await store.get_run(run_id)
        except RunNotFound:
            assert run_id not in listed, f"run {run_id!r} is listed but get_run cannot find it"
            continue
        listed[run_id] = record
    now = store_now()
    held = {
        run_id: (r.lease_owner, r.lease_expires)
        for run_id, r in listed.items()
        if r.lease_owner is not None and (r.lease_expires is None or r.lease_expires > now)
    }
    assert not held, f"{len(held)} lease(s) left held: {held}"


def store_now() -> float:
    """The stores' wall clock (they run on ``time.time`` in this suite)."""
    return time.time()
