"""Instruments: the seam an engine offers tracing and live views (trio's ``Instruments``).

An :class:`Instrument` hooks into an engine without patching it: it is added
with ``Engine(instruments=[...])`` or ``engine.instruments.add(...)`` and
removed with ``engine.instruments.remove(...)``. Two hooks, each optional
(the base class's versions do nothing):

``async drive(call, proceed) -> RunResult``
    Around each call that drives a run (:class:`RunCall`: ``Engine.run``,
    ``resume``, ``fork``, ``start_claimed``, and the resume of a suspended
    ancestor that a child's end lets go on). It returns ``await proceed()``,
    or raises what it raised; a context variable it sets around that await
    (an OpenTelemetry span made current, say) is current while the run
    drives, in its handlers too. Instruments nest in the order they were
    added: the first added is the outermost.

``wrap_executor(executor, name) -> Executor``
    The executor the engine runs attempts on instead of ``executor``: the
    default one (``name`` None; a :class:`~tailrace.executors.LocalExecutor`
    when the engine runs attempts in this process) and each named one. The
    engine plans the runs it starts after :meth:`Instruments.add` with the
    wrapped executors (the first instrument added wraps outermost), and
    those after :meth:`Instruments.remove` without.

Hooks run on the engine's event loop. An exception a hook raises reaches the
caller of the engine's method, as the run's own would.

>>> import asyncio
>>> from tailrace import Engine, Graph, Instrument
>>> class Calls(Instrument):
...     def __init__(self):
...         self.seen = []
...     async def drive(self, call, proceed):
...         result = await proceed()
...         self.seen.append((call.kind, result.status.value))
...         return result
>>> g = Graph("g")
>>> _ = g.add_node("double", lambda x: 2 * x)
>>> calls = Calls()
>>> asyncio.run(Engine(instruments=[calls]).run(g, 21, run_id="r")).output
42
>>> calls.seen
[('run', 'completed')]
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..executors import Executor
from ..executors._base import ExecutorTable

if TYPE_CHECKING:
    from ..graph import Graph
    from ._outcome import RunResult

#: A call's kinds: ``Engine.run``, ``Engine.resume`` (or an ancestor woken when its child
#: ended), ``Engine.fork``, ``Engine.start_claimed``.
KINDS = ("run", "resume", "fork", "start")


@dataclass(frozen=True, slots=True, kw_only=True)
class RunCall:
    """One call that drives a run, as an :class:`Instrument`'s ``drive`` hook sees it.

    ``kind`` is ``"run"`` (``Engine.run``), ``"resume"`` (``Engine.resume``,
    and a suspended ancestor resumed because its child ended), ``"fork"``
    (``Engine.fork``) or ``"start"`` (``Engine.start_claimed``: a run a
    worker claimed from a queue); ``run_id`` is the run it drives (a fork's
    own id); ``graph`` is the graph the caller passed (None: the engine finds
    the run's own, and names it in the run's first event).
    """

    kind: str
    run_id: str
    graph: Graph | None = None


class Instrument:
    """A tracer or live view hooked into an engine: override the hooks you need.

    Both hooks do nothing here; see :mod:`tailrace.core._instruments` (the
    module docstring) for when the engine calls them.
    """

    async def drive(self, call: RunCall, proceed: Callable[[], Awaitable[RunResult]]) -> RunResult:
        """Around the call ``call`` that drives a run: return ``await proceed()``.

        Args:
            call: which call, for which run (a :class:`RunCall`).
            proceed: drives the run (and the hooks of instruments added later);
                call it once.
        """
        return await proceed()

    def wrap_executor(self, executor: Executor, name: str | None) -> Executor:
        """The executor to run attempts on instead of ``executor`` (``executor`` itself: no wrap).

        Args:
            executor: the engine's executor (or what an instrument added
                earlier made of it).
            name: its name in ``Engine(executors=...)``; None for the default one.
        """
        return executor


def _overrides(instrument: Instrument, hook: str) -> bool:
    return getattr(type(instrument), hook, None) is not getattr(Instrument, hook)


class Instruments:
    """An engine's instruments, in the order they were added (``engine.instruments``).

    ``instruments`` are the first ones (``Engine(instruments=...)``).
    """

    __slots__ = ("_drives", "_items", "_tables", "_wraps")

    def __init__(self, instruments: Iterable[Instrument] = ()) -> None:
        self._items: list[Instrument] = []
        self._drives: tuple[Instrument, ...] = ()
        self._wraps: tuple[Instrument, ...] = ()
        #: The wrapped executor table, by the table it wraps (made once per change).
        self._tables: dict[int, tuple[ExecutorTable, ExecutorTable]] = {}
        for instrument in instruments:
            self.add(instrument)

    def add(self, instrument: Instrument) -> None:
        """Hook ``instrument`` in, innermost; ``ValueError`` if it is in already.

        Args:
            instrument: the :class:`Instrument` to add.
        """
        if not isinstance(instrument, Instrument):
            raise TypeError(f"{instrument!r} is not an Instrument (subclass tailrace.Instrument)")
        if instrument in self._items:
            raise ValueError(f"{instrument!r} is an instrument of this engine already")
        self._items.append(instrument)
        self._changed()

    def remove(self, instrument: Instrument) -> None:
        """Unhook ``instrument`` (runs already driving keep its hooks); ``ValueError`` if absent.

        Args:
            instrument: an :class:`Instrument` added before.
        """
        if instrument not in self._items:
            raise ValueError(f"{instrument!r} is not an instrument of this engine")
        self._items.remove(instrument)
        self._changed()

    def _changed(self) -> None:
        self._drives = tuple(i for i in self._items if _overrides(i, "drive"))
        self._wraps = tuple(i for i in self._items if _overrides(i, "wrap_executor"))
        self._tables.clear()

    def __contains__(self, instrument: object) -> bool:
        return instrument in self._items

    def __iter__(self) -> Iterator[Instrument]:
        return iter(tuple(self._items))

    def __len__(self) -> int:
        return len(self._items)

    async def drive(self, call: RunCall, proceed: Callable[[], Awaitable[RunResult]]) -> RunResult:
        """``proceed()`` inside every instrument's ``drive`` hook, the first added outermost.

        Args:
            call: the call that drives a run (a :class:`RunCall`).
            proceed: drives the run.
        """
        hooks = self._drives
        if not hooks:
            return await proceed()
        return await _chain(hooks, call, proceed)()

    def executors(self, table: ExecutorTable) -> ExecutorTable:
        """``table`` with every executor wrapped by each instrument (the first added outermost).

        Args:
            table: the engine's executors (the same table when no instrument wraps).
        """
        wraps = self._wraps
        if not wraps:
            return table
        cached = self._tables.get(id(table))
        if cached is not None and cached[0] is table:
            return cached[1]

        def wrap(executor: Executor, name: str | None) -> Executor:
            for instrument in reversed(wraps):
                executor = instrument.wrap_executor(executor, name)
            return executor

        wrapped = table.wrapped(wrap)
        self._tables[id(table)] = (table, wrapped)
        return wrapped


def _chain(
    hooks: tuple[Instrument, ...], call: RunCall, proceed: Callable[[], Awaitable[RunResult]]
) -> Callable[[], Awaitable[RunResult]]:
    """``proceed`` inside the ``drive`` hooks of ``hooks``, the first outermost."""
    for instrument in reversed(hooks):
        proceed = _bound(instrument, call, proceed)
    return proceed


def _bound(
    instrument: Instrument, call: RunCall, proceed: Callable[[], Awaitable[RunResult]]
) -> Callable[[], Awaitable[RunResult]]:
    return lambda: instrument.drive(call, proceed)
