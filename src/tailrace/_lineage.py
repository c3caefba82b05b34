"""Where a child run sits in its parent: the node, visit and item its id names (R1; pure).

A child run's id is ``{parent}/{node}/{visit}``, plus ``/{item}`` for a map's
item. Node ids may themselves hold ``/`` and digits, so the id alone can be
read two ways (``p/a/1/2``: node ``a`` visit 1 item 2, or node ``a/1`` visit
2); the parent's node ids settle it: the longest node id the rest starts
with wins. Both ``tailrace show`` and the dashboard read children this way.

>>> child_place("p", "p/review/1/3", ["review"])
ChildPlace(node_id='review', visit=1, item=3)
>>> child_place("p", "p/a/1/2", ["a/1"])
ChildPlace(node_id='a/1', visit=2, item=None)
>>> child_place("p", "q/review/1", ["review"]) is None
True
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple


class ChildPlace(NamedTuple):
    """The node of the parent whose visit (and map item) runs a child run."""

    node_id: str
    visit: int
    item: int | None

    def label(self) -> str:
        """``node#visit``, plus ``[item]`` for a map's item."""
        item = "" if self.item is None else f"[{self.item}]"
        return f"{self.node_id}#{self.visit}{item}"


def child_place(parent_id: str, child_id: str, node_ids: Iterable[str]) -> ChildPlace | None:
    """The place ``child_id`` names in run ``parent_id``; None when it is not that run's child id.

    Args:
        parent_id: the parent run.
        child_id: the child run's id.
        node_ids: the parent's node ids, to read ids whose node id holds ``/``.
    """
    prefix = parent_id + "/"
    if not child_id.startswith(prefix):
        return None
    rest = child_id[len(prefix) :]
    for node_id in sorted(set(node_ids), key=len, reverse=True):
        if rest.startswith(node_id + "/"):
            place = _numbers(node_id, rest[len(node_id) + 1 :].split("/"))
            if place is not None:
                return place
    parts = rest.split("/")  # no known node fits: read the numbers from the right
    for count in (2, 1):
        if len(parts) > count:
            place = _numbers("/".join(parts[:-count]), parts[-count:])
            if place is not None:
                return place
    return None


def _numbers(node_id: str, tail: list[str]) -> ChildPlace | None:
    if (
        not node_id
        or not 1 <= len(tail) <= 2
        or not all(p.isdecimal() and p.isascii() for p in tail)
    ):
        return None
    return ChildPlace(node_id, int(tail[0]), int(tail[1]) if len(tail) == 2 else None)
