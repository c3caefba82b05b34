"""A run's graph version on its page: where it came from, the other versions it could move to, forks.

The run page shows the version a run is on (its graph's name and structural
fingerprint) and, for a fork, the run and node it was forked from. For each
other version of the run's graph the dashboard holds (``--graphs``), it says
whether the run can move to it, as :meth:`Engine.check` would (V1): the same
read-only check, each incompatible node with its reason. A store keeps no
order of versions, so every other version held is listed, in the order the
graphs were named.

It also lists the nodes a fork can start from (V4): the nodes of the graph
that ran in this run, each with a "fork from here" form, when the dashboard
holds the run's version (named with ``--graphs`` or importable as a module).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core import check_stored
from ..graph import Graph
from ..stores import RunStatus, RunStore, StoredRun
from ._catalog import Found, GraphCatalog, Origin

#: Characters of a fingerprint the page shows (the whole one is in its tooltip).
SHORT = 8


def short(fingerprint: str) -> str:
    """The short form of a version's fingerprint the page shows.

    >>> short("42fe3a98359e6f48")
    '42fe3a98'
    """
    return fingerprint[:SHORT]


@dataclass(frozen=True, slots=True, kw_only=True)
class Reason:
    """Why a version cannot take over the run at one node (``node`` None: the graph as a whole)."""

    node: str | None
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class OtherVersion:
    """Another version of the run's graph the dashboard holds, and whether the run can move to it."""

    fingerprint: str
    short: str
    compatible: bool
    reasons: tuple[Reason, ...]
    #: Where the dashboard loaded it from (file or module, and attribute), if known.
    origin: Origin | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class VersionsView:
    """What the run page says of the run's version, the other versions and forks."""

    graph_name: str
    fingerprint: str
    short: str
    #: A fork's origin: the run and the node it re-ran from.
    forked_from: str | None
    forked_at: str | None
    #: Whether the run is live (running or suspended): only a live run is moved (V2).
    live: bool
    others: tuple[OtherVersion, ...]
    #: Nodes a fork can start from: the graph's nodes that ran here, in definition order.
    forkable: tuple[str, ...]
    #: Why no fork can start here (the dashboard does not hold the run's version), if so.
    no_fork: str | None
    #: Where the run's version comes from (file or module, and attribute), if known.
    origin: Origin | None = None


async def versions_view(
    store: RunStore, catalog: GraphCatalog, stored: StoredRun, found: Found
) -> VersionsView:
    """The run page's versions part for ``stored``; ``found`` is the run's own graph, if held.

    Reads only: the check of each other version is :func:`check_stored`'s (V2).
    """
    record = stored.run
    own = catalog.registered(record)
    others = []
    for graph in catalog.versions_of(record.graph_name):
        fingerprint = graph.fingerprint()
        if fingerprint == record.fingerprint:
            continue
        report = await check_stored(store, stored, graph, own)
        others.append(
            OtherVersion(
                fingerprint=fingerprint,
                short=short(fingerprint),
                compatible=report.compatible,
                reasons=tuple(Reason(node=i.node_id, reason=i.reason) for i in report.incompatible),
                origin=catalog.origin_of(graph),
            )
        )
    return VersionsView(
        graph_name=record.graph_name,
        fingerprint=record.fingerprint,
        short=short(record.fingerprint),
        forked_from=record.forked_from,
        forked_at=record.forked_at,
        live=record.status in (RunStatus.RUNNING, RunStatus.SUSPENDED),
        others=tuple(others),
        forkable=() if found.graph is None else forkable(found.graph, stored),
        no_fork=None if found.graph is not None else found.reason,
        origin=catalog.origin(record),
    )


def forkable(graph: Graph, stored: StoredRun) -> tuple[str, ...]:
    """The nodes of ``graph`` a fork of ``stored`` can start from: those that ran, in order.

    A fork runs its node with the payload the node's latest visit ran with,
    so a node that never ran has none to start from.
    """
    return tuple(
        node_id
        for node_id in graph.compile().ids
        if (row := stored.nodes.get(node_id)) is not None and row.visits > 0
    )
