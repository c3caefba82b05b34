"""``tailrace rollouts``: the tail's account of a map of model generations over its rounds (X4).

Reads what :func:`~tailrace.integrations.openai.tail_accounting` reads (the usage
chunk each generation's attempt ends with, the attempts' marks, the items parked)
and prints it; everything from the store goes through ``_render`` (data, never markup).
"""

from __future__ import annotations

from typing import Annotated

import typer

from ..core import Engine
from ..integrations.openai import TailAccount, tail_accounting
from ..stores import RunStore
from ._render import table_of, text
from ._session import DbOption, console, with_store


def register(app: typer.Typer) -> None:
    """Add ``tailrace rollouts`` to ``app``."""
    app.command("rollouts")(rollouts)


def rollouts(
    run_ids: Annotated[
        list[str], typer.Argument(help="The runs (rounds) to account for, oldest first.")
    ],
    node: Annotated[str, typer.Option("--node", help="The map node whose items are generations.")],
    bound: Annotated[
        int, typer.Option("--bound", help="Rounds of waiting at which a parked item is starving.")
    ] = 3,
    db: DbOption = None,
) -> None:
    """Tokens decoded, salvaged and wasted by a map of generations; the length bias of what it
    kept (KS); how long its parked items have waited."""

    async def work(store: RunStore) -> TailAccount:
        graph = (await store.load_run(run_ids[0])).run.graph_name
        return await tail_accounting(
            Engine(store=store), graph, node, run_ids, starvation_bound=bound
        )

    account = with_store(db, work, read_only=True)
    share = f"{100 * account.wasted_share:.1f}%"
    rows = [
        ("items launched / accepted / parked / cancelled",
         f"{account.launched} / {account.accepted} / {account.parked} / {account.cancelled}"),
        ("tokens decoded / salvaged / wasted", f"{account.decoded} / {account.salvaged} / {account.wasted} ({share})"),
        ("accepted under another model version", str(account.stale)),
        ("KS(accepted, launched lengths)", f"{account.ks:.3f} ({account.censored} lengths not final)"),
        ("most rounds waited", f"{account.max_rounds} (bound {account.starvation_bound})"),
        ("starving parked items", ", ".join(account.starving) or "none"),
    ]  # fmt: skip
    console.print(text(f"node {node} over {len(run_ids)} run(s)"))
    console.print(table_of(("measure", "value"), rows))
