"""``tailrace parked``: the stragglers ``late="park"`` kept (P3), listed and dropped (P4).

Parked items never expire: each waits until a map with ``resume_parked=True``
claims it, or until it is dropped here. Everything printed from the store
goes through ``_render`` (data, never markup).
"""

from __future__ import annotations

import datetime
from typing import Annotated

import typer

from ..stores import ParkedRow, ParkedStatus, RunStore
from ._render import table_of, text
from ._session import DbOption, console, fail, flag, with_store

parked_app = typer.Typer(
    help='Stragglers parked by late="park": list them, or drop one.',
    no_args_is_help=False,
    invoke_without_command=True,
)


def register(app: typer.Typer) -> None:
    """Add ``tailrace parked`` to ``app``."""
    app.add_typer(parked_app, name="parked")


@parked_app.callback()
def parked(
    ctx: typer.Context,
    graph: Annotated[str | None, typer.Option("--graph", help="Only this graph name.")] = None,
    node: Annotated[str | None, typer.Option("--node", help="Only this node.")] = None,
    every: Annotated[
        bool, flag("--all", "List claimed and dropped items too (default: parked ones).")
    ] = False,
    db: DbOption = None,
) -> None:
    """List parked items, oldest first: graph, node, item, the run and visit they came from,
    whether they saved a checkpoint, and who claimed them."""
    if ctx.invoked_subcommand is not None:
        return

    async def work(store: RunStore) -> list[ParkedRow]:
        status = None if every else ParkedStatus.PARKED
        return await store.list_parked(graph_name=graph, node_id=node, status=status)

    rows = with_store(db, work, read_only=True)
    if not rows:
        console.print(text("no parked items"))
        return
    console.print(
        table_of(
            (
                "park id",
                "graph",
                "node",
                "item",
                "from run",
                "visit",
                "checkpoint",
                "parked",
                "parks",
                "status",
                "claimed by",
            ),
            (
                (
                    r.park_id,
                    r.graph_name,
                    r.node_id,
                    "-" if r.item < 0 else str(r.item),
                    r.run_id,
                    str(r.visit),
                    "yes" if r.checkpoint_json is not None else "no",
                    _clock(r.parked_at),
                    str(r.parks),
                    r.status,
                    r.claimed_by or "",
                )
                for r in rows
            ),
        )
    )


@parked_app.command("drop")
def drop(
    park_id: Annotated[str, typer.Argument(help="The parked item to drop (see tailrace parked).")],
    db: DbOption = None,
) -> None:
    """Drop a parked item: no map will claim it. Exits 1 if it is no longer parked, saying
    whether a map claimed it (and which), it was dropped before, or there is no such item."""

    async def work(store: RunStore) -> tuple[bool, ParkedRow | None]:
        if await store.drop_parked(park_id):
            return True, None
        rows = await store.list_parked(status=None)  # it is not parked: what became of it
        return False, next((r for r in rows if r.park_id == park_id), None)

    dropped, row = with_store(db, work)
    if not dropped:
        fail(not_dropped(park_id, row))
    console.print(text(f"dropped parked item {park_id}"))


def not_dropped(park_id: str, row: ParkedRow | None) -> str:
    """Why parked item ``park_id`` (stored as ``row``, or None) could not be dropped."""
    if row is None:
        return f"no parked item {park_id!r} in the store (tailrace parked --all lists them all)"
    if row.status == ParkedStatus.CLAIMED:
        when = "" if row.claimed_at is None else f" at {_clock(row.claimed_at)}"
        return (
            f"parked item {park_id!r} was claimed by {row.claimed_by or 'a map'}{when}: that map "
            "runs it again from its checkpoint; nothing was dropped"
        )
    return f"parked item {park_id!r} was dropped already; nothing changed"


def _clock(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")
