"""The tail's account of a map node of generations, read back from stored streams (X4).

The accounting itself is pure and lives in :mod:`tailrace.tail` (the dashboard
shows it too); this reads a graph's runs through an engine and hands their
stream rows and parked items to it.
"""

from __future__ import annotations

from collections.abc import Sequence

from ...core import Engine
from ...graph import Graph
from ...tail import Round, RunStreams, TailAccount, parked_tokens, tail_account

#: Stream rows read per query.
_PAGE = 1000


async def tail_accounting(
    engine: Engine,
    graph: Graph | str,
    node: str,
    run_ids: str | Sequence[str],
    *,
    starvation_bound: int = 3,
) -> TailAccount:
    """The tail's account of map ``node`` over ``run_ids`` (its rounds, oldest first) (X4).

    Reads the runs' stored streams (the usage chunk each generation's attempt
    ends with, and the attempts' marks) and the items parked by them.

    Args:
        engine: An engine on the store that holds the runs.
        graph: The graph (or its name) the runs ran.
        node: The map node whose items are generations.
        run_ids: The runs, oldest first (one id, or several rounds).
        starvation_bound: Rounds of waiting at which a parked item counts as starving.
    """
    runs = (run_ids,) if isinstance(run_ids, str) else tuple(run_ids)
    parked_rows = await engine.parked(graph, node, every=True)
    rounds = []
    for run_id in runs:
        streams = RunStreams()
        after = 0
        while chunks := await engine.stored_chunks(run_id, after=after, limit=_PAGE):
            after = chunks[-1].seq
            for chunk in chunks:
                streams.add(chunk, chunk.value)
        parked = {
            row.item: parked_tokens(row.checkpoint_json)
            for row in parked_rows
            if row.run_id == run_id
        }
        rounds.append(Round(run_id, streams.items_of(node), parked))
    return tail_account(node, rounds, starvation_bound=starvation_bound)
