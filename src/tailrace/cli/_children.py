"""A run's child runs as ``tailrace show`` prints them (R1): node, item, graph, status.

Child ids, node ids and graph names are data: every cell goes through
:func:`~tailrace.cli._render.table_of` (shown literally, never as markup).
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Iterable, Sequence

from rich.table import Column, Table
from rich.text import Text

from .._lineage import ChildPlace, child_place
from ..stores import RunRecord
from ._render import table_of, text

#: Children ``show`` lists; past it, it says how many more and how to list them all.
SHOWN_CHILDREN = 200


def ordered_children(
    parent_id: str, children: Sequence[RunRecord], node_ids: Iterable[str]
) -> list[tuple[RunRecord, ChildPlace | None]]:
    """``children`` with their place in the parent, by node, visit and item (ids last if unread)."""
    known = list(node_ids)
    placed = [(c, child_place(parent_id, c.run_id, known)) for c in children]
    return sorted(
        placed,
        key=lambda pair: (
            pair[1] is None,
            pair[1] or ChildPlace("", 0, None),
            pair[0].run_id,
        ),
    )


def children_table(
    parent_id: str,
    children: Sequence[RunRecord],
    node_ids: Iterable[str],
    status_of: Callable[[RunRecord], str],
) -> Table:
    """The child runs of ``parent_id``: run, node, visit, item (maps), graph, queue, status."""
    placed = ordered_children(parent_id, children, node_ids)
    rows = (
        (
            child.run_id,
            "" if place is None else place.node_id,
            "" if place is None else str(place.visit),
            "" if place is None or place.item is None else str(place.item),
            child.graph_name,
            child.queue_name or "",
            status_of(child),
        )
        for child, place in placed[:SHOWN_CHILDREN]
    )
    headers = (
        Column("child run", no_wrap=True),
        "node",
        "visit",
        "item",
        "graph",
        "queue",
        "status",
    )
    return table_of(headers, rows, title=f"child runs ({len(children)})")


def more_children(parent_id: str, count: int, db_argument: str) -> Text | None:
    """What ``show`` says of the children it did not list (and how to list them all), if any."""
    if count <= SHOWN_CHILDREN:
        return None
    more = count - SHOWN_CHILDREN
    command = f"tailrace runs --parent {shlex.quote(parent_id)} --limit {count} {db_argument}"
    return text(f"  ... and {more} more child runs: ", (command.rstrip(), "bold"))
