"""The tail's account of a map node of generations, read back from stored streams (X4).

The accounting itself is pure and lives in :mod:`tailrace.tail` (the dashboard
shows it too); this reads a graph's runs through an engine and hands their
stream rows and parked items to it, with the node's starvation bound: its
``max_parks`` (P5), which only the graph knows. The OpenTelemetry
integration hands it what it saw of one run (:func:`run_accounts`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ...core import Engine
from ...graph import Graph, max_parks_of
from ...tail import ParkedItem, Round, RunStreams, TailAccount, tail_account

#: Stream rows read per query.
_PAGE = 1000


def run_accounts(
    run_id: str, streams: RunStreams, parked: Iterable[ParkedItem], graph: Graph | None
) -> list[TailAccount]:
    """The account of each map node of run ``run_id`` whose items generated (X4).

    Args:
        run_id: The run.
        streams: Its stream rows, folded.
        parked: The items it parked (items of other runs are left out).
        graph: Its graph, for each node's starvation bound (None: not known).
    """
    rows = tuple(parked)
    return [
        tail_account(
            node,
            [Round.of(run_id, node, streams, rows)],
            starvation_bound=max_parks_of(graph, node),
        )
        for node in streams.generating
    ]


async def tail_accounting(
    engine: Engine,
    graph: Graph | str,
    node: str,
    run_ids: str | Sequence[str],
    *,
    starvation_bound: int | None = None,
) -> TailAccount:
    """The tail's account of map ``node`` over ``run_ids`` (its rounds, oldest first) (X4).

    Reads the runs' stored streams (the usage chunk each generation's attempt
    ends with, and the attempts' marks) and the items parked by them.

    Args:
        engine: An engine on the store that holds the runs.
        graph: The graph (or its name) the runs ran.
        node: The map node whose items are generations.
        run_ids: The runs, oldest first (one id, or several rounds).
        starvation_bound: Rounds of waiting at which a parked item counts as
            starving. None: the map's ``max_parks`` (P5), read from ``graph``,
            or from the graph ``engine`` ran or registered for the last run
            when ``graph`` is a name; ``tailrace.graph.MAX_PARKS`` when neither
            is known.

    Raises:
        ValueError: ``graph`` is a graph without a node ``node``.
    """
    runs = (run_ids,) if isinstance(run_ids, str) else tuple(run_ids)
    if isinstance(graph, Graph) and node not in graph.nodes:
        raise ValueError(f"graph {graph.name!r} has no node {node!r} to account for")
    if starvation_bound is None:
        known = graph if isinstance(graph, Graph) else await _graph_of(engine, runs)
        starvation_bound = max_parks_of(known, node)
    parked_rows = await engine.parked(graph, node, every=True)
    rounds = []
    for run_id in runs:
        streams = RunStreams()
        after = 0
        while chunks := await engine.stored_chunks(run_id, after=after, limit=_PAGE):
            after = chunks[-1].seq
            for chunk in chunks:
                streams.add(chunk, chunk.value)
        rounds.append(Round.of(run_id, node, streams, parked_rows))
    return tail_account(node, rounds, starvation_bound=starvation_bound)


async def _graph_of(engine: Engine, run_ids: Sequence[str]) -> Graph | None:
    """The graph ``engine`` ran or registered for the last of ``run_ids``, if it has one."""
    if engine.store is None or not run_ids:
        return None
    return engine.graph_for(await engine.store.get_run(run_ids[-1]))
