"""A child run's id, and where a child run sits in its parent (R1; pure).

A child run's id is ``{parent}/{node}/{visit}``, plus ``/{item}`` for a
map's item. In it the node id is escaped so that the id reads back one way:
``%`` becomes ``%25`` and ``/`` becomes ``%2F``, and a node id of ASCII
digits alone has its first digit escaped (``7`` becomes ``%37``). So a
child id ends in one node part (never digits alone, never a ``/``) and one
or two numbers: two children share an id only if they are one child (node
``b/1`` is ``p/b%2F1/1``, item 1 of map ``b`` is ``p/b/1/1``). A run id a
user chooses may not end that way (:func:`own_run_id`), so it never takes a
child's. A child id is bounded like any run id (512 characters): one that
would be longer is refused, naming the node and the run.

>>> child_run_id("r1", "review", 1, None), child_run_id("r1", "review", 1, 3)
('r1/review/1', 'r1/review/1/3')
>>> child_run_id("r1", "b/1", 1, None), child_run_id("r1", "7", 2, None)
('r1/b%2F1/1', 'r1/%37/2')
>>> child_place("p", "p/review/1/3", ["review"])
ChildPlace(node_id='review', visit=1, item=3)
>>> child_place("p", "p/a%2F1/2", ["a/1"])
ChildPlace(node_id='a/1', visit=2, item=None)
>>> child_place("p", "q/review/1", ["review"]) is None
True

Ids stored before node ids were escaped (``p/a/1/2`` for node ``a/1``
visit 2) are read with the parent's node ids: a known node id the rest
starts with, escaped first, then as it is, the longest first.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import NamedTuple

from ._values import MAX_RUN_ID_CHARS, checked_run_id

_ESCAPE = re.compile(r"%([0-9A-F]{2})")


class ChildPlace(NamedTuple):
    """The node of the parent whose visit (and map item) runs a child run."""

    node_id: str
    visit: int
    item: int | None

    def label(self) -> str:
        """``node#visit``, plus ``[item]`` for a map's item."""
        item = "" if self.item is None else f"[{self.item}]"
        return f"{self.node_id}#{self.visit}{item}"


def child_run_id(parent: str, node_id: str, visit: int, item: int | None) -> str:
    """The id of the child run of ``node_id``'s ``visit`` (and map ``item``) in run ``parent``.

    Raises ``ValueError`` naming the node and the run when that id is no run
    id every store keys on (longer than 512 characters, say): the node fails
    with it, and nothing is written for the child.
    """
    base = f"{parent}/{_escaped(node_id)}/{visit}"
    child = base if item is None else f"{base}/{item}"
    try:
        return checked_run_id(child)
    except ValueError as exc:
        where = f"visit {visit}" + ("" if item is None else f" item {item}")
        size = f"{len(child)} characters long" if len(child) > MAX_RUN_ID_CHARS else str(exc)
        raise ValueError(
            f"run {_shown(parent)}: the child run of node {_shown(node_id)} ({where}) cannot "
            f"be stored: its id would be {size}, and a run id holds at most "
            f"{MAX_RUN_ID_CHARS} characters (shorten the node id or the run's id)"
        ) from None


def own_run_id(run_id: object) -> str:
    """``run_id`` for a run its user names (run, submit, fork): checked as any run id, and
    refused (``ValueError`` naming it) when it has the form of a child run's id, which
    only child runs may take."""
    checked = checked_run_id(run_id)
    place = _place_from_the_right(checked)
    if place is not None:
        parent, found = place
        raise ValueError(
            f"run id {checked!r} has the form of a child run's id (the child of run "
            f"{parent!r} at {found.label()}): a '/', a node id and one or two numbers at "
            "the end are kept for child runs; choose an id that does not end so"
        )
    return checked


def child_place(parent_id: str, child_id: str, node_ids: Iterable[str]) -> ChildPlace | None:
    """The place ``child_id`` names in run ``parent_id``; None when it is not that run's child id.

    Args:
        parent_id: the parent run.
        child_id: the child run's id.
        node_ids: the parent's node ids, to read ids stored before node ids were escaped.
    """
    prefix = parent_id + "/"
    if not child_id.startswith(prefix):
        return None
    rest = child_id[len(prefix) :]
    known = sorted(set(node_ids), key=len, reverse=True)
    for form in (_escaped, _as_is):
        for node_id in known:
            head = form(node_id) + "/"
            if rest.startswith(head):
                place = _numbers(node_id, rest[len(head) :].split("/"))
                if place is not None:
                    return place
    found = _place_from_the_right(child_id)
    if found is not None and found[0] == parent_id:
        return found[1]
    parts = rest.split("/")  # an unescaped node id holding '/': its numbers from the right
    for count in (2, 1):
        if len(parts) > count:
            place = _numbers("/".join(parts[:-count]), parts[-count:])
            if place is not None:
                return place
    return None


def _place_from_the_right(run_id: str) -> tuple[str, ChildPlace] | None:
    """The parent and place ``run_id`` names if it ends as a child id does (a node part, one
    or two numbers), else None."""
    parts = run_id.split("/")
    count = 0
    while count < min(len(parts), 3) and _is_number(parts[-1 - count]):
        count += 1
    if count not in (1, 2) or len(parts) < count + 2:
        return None
    node = parts[-1 - count]
    if not node or _is_number(node):
        return None
    place = _numbers(_unescaped(node), parts[len(parts) - count :])
    if place is None:
        return None
    return "/".join(parts[: -1 - count]), place


def _escaped(node_id: str) -> str:
    text = node_id.replace("%", "%25").replace("/", "%2F")
    return f"%{ord(text[0]):02X}{text[1:]}" if _is_number(text) else text


def _as_is(node_id: str) -> str:
    return node_id


def _unescaped(part: str) -> str:
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 16)), part)


def _is_number(part: str) -> bool:
    return part.isascii() and part.isdecimal()


def _numbers(node_id: str, tail: list[str]) -> ChildPlace | None:
    if not node_id or not 1 <= len(tail) <= 2 or not all(_is_number(p) for p in tail):
        return None
    return ChildPlace(node_id, int(tail[0]), int(tail[1]) if len(tail) == 2 else None)


def _shown(text: str) -> str:
    """``text`` as a repr, cut to 60 characters (a long id is named, not printed whole)."""
    return repr(text) if len(text) <= 60 else f"{text[:57]!r}... ({len(text)} characters)"
