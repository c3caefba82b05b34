"""The tail's account of a map of model generations (X4): ``tailrace rollouts`` over its
rounds, and the tables ``tailrace show`` prints for one run.

Reads what :func:`~tailrace.integrations.openai.tail_accounting` reads (the usage
chunk each generation's attempt ends with, the attempts' marks, the items parked)
and prints it; everything from the store goes through ``_render`` (data, never markup).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

import typer
from rich.table import Table

from ..core import Engine
from ..graph import Graph
from ..integrations.openai import TailAccount, tail_accounting
from ..stores import RunRecord, RunStore
from ..tail import is_usage
from ._load import load_graphs
from ._render import table_of, text
from ._session import CommandError, DbOption, console, with_store

#: Stream rows read per query while looking for the map nodes that streamed usage.
_PAGE = 1000


#: ``--graphs`` of the commands that print the tail's account (``rollouts``, ``show``).
AccountGraphsOption = Annotated[
    list[str] | None,
    typer.Option(
        "--graphs",
        help="FILE_OR_MODULE[:GRAPH] that defines the run's graph (repeatable): its maps' "
        "max_parks bound starvation in the tail's account (default: "
        "tailrace.graph.MAX_PARKS).",
    ),
]


def register(app: typer.Typer) -> None:
    """Add ``tailrace rollouts`` to ``app``."""
    app.command("rollouts")(rollouts)


def rollouts(
    run_ids: Annotated[
        list[str], typer.Argument(help="The runs (rounds) to account for, oldest first.")
    ],
    node: Annotated[str, typer.Option("--node", help="The map node whose items are generations.")],
    bound: Annotated[
        int | None,
        typer.Option(
            "--bound",
            help="Rounds of waiting at which a parked item is starving (default: the map's "
            "max_parks, from --graphs; tailrace.graph.MAX_PARKS without it).",
        ),
    ] = None,
    graphs: AccountGraphsOption = None,
    db: DbOption = None,
) -> None:
    """Tokens decoded, salvaged and wasted by a map of generations; the length bias of what it
    kept (KS); how long its parked items have waited."""
    loaded = load_graphs(graphs)

    async def work(store: RunStore) -> TailAccount:
        last = await store.get_run(run_ids[-1])
        engine = engine_knowing(store, loaded, last)
        return await tail_accounting(engine, last.graph_name, node, run_ids, starvation_bound=bound)

    account = with_store(db, work, read_only=True)
    console.print(text(f"node {node} over {len(run_ids)} run(s)"))
    console.print(account_table(account))


def engine_knowing(store: RunStore, graphs: Sequence[Graph], record: RunRecord) -> Engine:
    """An engine on ``store`` that knows ``graphs`` (``--graphs``); one of them must be the
    graph ``record``'s run ran, by name and shape (``CommandError`` naming the run)."""
    engine = Engine(store=store)
    engine.register(*graphs)
    if graphs and engine.graph_for(record) is None:
        names = ", ".join(repr(g.name) for g in graphs)
        raise CommandError(
            f"run {record.run_id!r} ran graph {record.graph_name!r} (fingerprint "
            f"{record.fingerprint}); --graphs named none of that name and shape: {names}"
        )
    return engine


def account_table(account: TailAccount, title: str | None = None) -> Table:
    """The measures of ``account``, one a row (``title``, if any, is shown literally)."""
    return table_of(
        ("measure", "value"), account.measures(), title=None if title is None else text(title)
    )


async def generation_nodes(engine: Engine, run_id: str) -> list[str]:
    """The map nodes of ``run_id`` whose items streamed model usage, in the order first seen."""
    nodes: dict[str, None] = {}
    after = 0
    while chunks := await engine.stored_chunks(run_id, after=after, limit=_PAGE):
        after = chunks[-1].seq
        for chunk in chunks:  # a map item's usage chunk: its generation's end
            if chunk.item is not None and is_usage(chunk.value):
                nodes[chunk.node_id] = None
    return list(nodes)


async def run_accounts(
    store: RunStore, record: RunRecord, graphs: Sequence[Graph] = ()
) -> list[TailAccount]:
    """The tail's account of each map node of ``record``'s run that generated (none: no
    generations); its maps' ``max_parks`` bound starvation when ``graphs`` hold its graph."""
    engine = engine_knowing(store, graphs, record)
    return [
        await tail_accounting(engine, record.graph_name, node, record.run_id)
        for node in await generation_nodes(engine, record.run_id)
    ]
