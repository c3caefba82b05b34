"""Which graph a stored run ran: one handed to the dashboard, or one importable by module.

A run records its graph as ``graph_ref`` and a structural fingerprint. The
dashboard draws the full graph when it was handed one with that fingerprint
(``tailrace ui --graphs``) or when the reference names an importable module;
a stored **file** reference is never executed (trust model, docs/trust.md),
and a graph whose shape changed since the run began is not used.

A version is also said by where its graph comes from (:class:`Origin`): the
file and attribute, or module and attribute, the dashboard loaded it from,
else the reference the run recorded, with a file loaded under a hashed module
name (``tailrace_file_...``) spelled as its path when this process loaded it.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterable
from dataclasses import dataclass

from .._errors import GraphError
from ..core import find_graph
from ..graph import FILE_MODULE_PREFIX, Graph, file_modules, guess_reference, is_file_reference
from ..stores import RunRecord


@dataclass(frozen=True, slots=True, kw_only=True)
class Found:
    """The graph for a run, or None with the reason the page shows instead."""

    graph: Graph | None
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Origin:
    """Where a version's graph comes from: ``text`` to show (``flow_v2.py:flow``,
    ``pkg.flows:flow``) and ``full``, the whole reference (a file's absolute path)."""

    text: str
    full: str


def readable_reference(ref: str) -> Origin:
    """``ref`` as a person reads it: a file loaded here under a hashed module name becomes
    its path; a file's path is shown by its name (the whole path in ``full``)."""
    module, _, attr = ref.rpartition(":")
    loaded = {m.__name__: m for m in file_modules()}
    if module in loaded and isinstance(path := getattr(loaded[module], "__file__", None), str):
        module = path
    elif module.startswith(FILE_MODULE_PREFIX):  # a file another process loaded: path unknown
        return Origin(text=f"{attr} in a file its driver loaded", full=ref)
    full = f"{module}:{attr}"
    if is_file_reference(full):
        return Origin(text=f"{os.path.basename(module)}:{attr}", full=full)
    return Origin(text=full, full=full)


def graph_origin(graph: Graph) -> Origin | None:
    """Where ``graph`` was loaded from in this process (its module or file, and attribute)."""
    ref = guess_reference(graph)
    if ref is None:  # its handlers live elsewhere (a file importing its neighbour's)
        ref = next(
            (f"{m.__name__}:{name}" for m in file_modules()
             for name, value in vars(m).items() if value is graph),
            None,
        )  # fmt: skip
    return None if ref is None else readable_reference(ref)


class GraphCatalog:
    """Graphs by name and fingerprint, plus a cache of module imports by reference.

    A graph is its name and its fingerprint: a run is never drawn or resumed
    with a graph of another name, whatever its shape.

    Args:
        graphs: graphs the user named (``--graphs``); their runs are drawn
            and resumed whatever reference the store records.
    """

    def __init__(self, graphs: Iterable[Graph] = ()) -> None:
        self._by_key = {(g.name, g.fingerprint()): g for g in graphs}
        self._imported: dict[str, Graph | GraphError] = {}
        self._origins: dict[tuple[str, str], Origin | None] = {}

    def registered(self, record: RunRecord) -> Graph | None:
        """The graph handed in for ``record``'s run (its name and fingerprint), if any."""
        return self._by_key.get((record.graph_name, record.fingerprint))

    def versions_of(self, name: str) -> tuple[Graph, ...]:
        """Every version of graph ``name`` handed in, in the order they were named."""
        return tuple(g for (known, _), g in self._by_key.items() if known == name)

    def origin(self, record: RunRecord) -> Origin | None:
        """Where ``record``'s version comes from: the graph handed in for it, else its reference."""
        graph = self.registered(record)
        found = None if graph is None else self.origin_of(graph)
        if found is None and record.graph_ref:
            found = readable_reference(record.graph_ref)
        return found

    def origin_of(self, graph: Graph) -> Origin | None:
        """Where a graph handed in was loaded from (looked up once per graph)."""
        key = (graph.name, graph.fingerprint())
        if key not in self._origins:
            self._origins[key] = graph_origin(graph)
        return self._origins[key]

    async def find(self, record: RunRecord) -> Found:
        """The graph ``record`` ran, if this dashboard may and can load it."""
        graph = self.registered(record)
        if graph is not None:
            return Found(graph=graph, reason="named with --graphs")
        ref = record.graph_ref
        if not ref:
            return Found(graph=None, reason="the run recorded no graph reference")
        if is_file_reference(ref):
            return Found(
                graph=None,
                reason=f"its graph is the file {ref!r}, which a stored reference never executes; "
                "start the dashboard with --graphs naming that file to draw and resume it",
            )
        loaded = self._imported.get(ref)
        if loaded is None:
            loaded = self._imported[ref] = await asyncio.to_thread(_import, record)
        if isinstance(loaded, GraphError):
            return Found(graph=None, reason=str(loaded))
        if loaded.name != record.graph_name:
            return Found(
                graph=None,
                reason=f"{ref} is graph {loaded.name!r}, not the run's {record.graph_name!r}",
            )
        if loaded.fingerprint() != record.fingerprint:
            return Found(
                graph=None,
                reason=f"{ref} changed shape since the run began (fingerprint "
                f"{loaded.fingerprint()}, the run's is {record.fingerprint})",
            )
        return Found(graph=loaded, reason=f"imported from {ref}")


def _import(record: RunRecord) -> Graph | GraphError:
    """Import the module reference (the engine's own lookup, which refuses files).

    The result is cached by reference and shown for every run naming it, so an
    error says what is wrong with the reference, not which run met it first.
    """
    try:
        return find_graph(record)
    except GraphError as exc:
        return GraphError(str(exc).removeprefix(f"run {record.run_id!r}: "))
