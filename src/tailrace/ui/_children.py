"""A run's place among child runs (R1): its ancestors, its children and the tree below it.

The run page links the run's parent (a breadcrumb of every ancestor), lists
its children with their status (a map's by item) and draws the tree of its
descendants as nested lists, :data:`TREE_DEPTH` levels deep and at most
:data:`TREE_LIMIT` runs; what it leaves out it counts ("and N more"). Only
reads: one ``list_runs(parent=...)`` per run whose children are shown, one
``get_run`` per ancestor.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from .._errors import RunNotFound
from .._lineage import ChildPlace, child_place
from ..stores import RunRecord, RunStore

#: Levels of descendants the tree shows, and the most runs it shows in all.
TREE_DEPTH = 3
TREE_LIMIT = 200
#: Ancestors the breadcrumb follows up (a guard: parent links never loop).
ANCESTRY_LIMIT = 32

StatusOf = Callable[[RunRecord], str]


@dataclass(frozen=True, slots=True, kw_only=True)
class ChildRow:
    """A child run as its parent's page lists it: where it sits, what it runs, how it is."""

    run_id: str
    #: The id as the parent's page shows it: what follows the parent's id (``…/each/1/2``).
    label: str
    graph: str
    queue: str | None
    status: str
    #: The parent's node, visit and (for a map) item that runs it; None if its id does not say.
    node: str | None
    visit: int | None
    item: int | None


@dataclass(frozen=True, slots=True, kw_only=True)
class TreeNode:
    """A descendant in the tree: its row, its own children shown, how many more it has."""

    row: ChildRow
    children: tuple[TreeNode, ...]
    #: Children of this run the tree leaves out (its run limit).
    more: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Lineage:
    """What the run page shows of a run's parent and children."""

    #: The run's ancestors, the top-level run first, its parent last.
    ancestors: tuple[str, ...]
    #: Where the run sits in its parent (``node#visit[item]``), if it is a child run.
    place: str | None
    #: Its children, by node, visit and item (at most :data:`TREE_LIMIT`).
    children: tuple[ChildRow, ...]
    children_total: int
    #: Its descendants as a tree, and how many runs the tree left out in all.
    tree: tuple[TreeNode, ...]
    left_out: int
    depth: int = TREE_DEPTH

    @property
    def parent(self) -> str | None:
        """The run whose node runs this one, if it is a child run."""
        return self.ancestors[-1] if self.ancestors else None


async def lineage_of(
    store: RunStore, record: RunRecord, node_ids: Iterable[str], status_of: StatusOf
) -> Lineage:
    """Read ``record``'s ancestors, its children and the tree of its descendants.

    Args:
        store: where the runs are.
        record: the run.
        node_ids: the run's node ids (to read its children's ids).
        status_of: the status a run is shown with.
    """
    ancestors, place = await _ancestry(store, record)
    tree, left_out, total = await _tree(store, record.run_id, list(node_ids), status_of)
    return Lineage(
        ancestors=ancestors,
        place=place,
        children=tuple(t.row for t in tree),
        children_total=total,
        tree=tree,
        left_out=left_out,
    )


async def _ancestry(store: RunStore, record: RunRecord) -> tuple[tuple[str, ...], str | None]:
    """The run's ancestors (top-level first) and its place in its parent."""
    if record.parent_run_id is None:
        return (), None
    place: ChildPlace | None = None
    try:
        parent = await store.load_run(record.parent_run_id)
        place = child_place(record.parent_run_id, record.run_id, parent.nodes)
    except RunNotFound:  # a parent deleted since: its id is still worth a link
        return (record.parent_run_id,), _label(child_place(record.parent_run_id, record.run_id, ()))
    chain = [record.parent_run_id]
    above = parent.run.parent_run_id
    while above is not None and above not in chain and len(chain) < ANCESTRY_LIMIT:
        chain.append(above)
        try:
            above = (await store.get_run(above)).parent_run_id
        except RunNotFound:
            break
    return tuple(reversed(chain)), _label(place)


def _label(place: ChildPlace | None) -> str | None:
    return None if place is None else place.label()


@dataclass(slots=True)
class _Growing:
    """A tree node while the tree is read breadth first."""

    row: ChildRow
    children: list[_Growing] = field(default_factory=list)
    more: int = 0

    def frozen(self) -> TreeNode:
        kids = tuple(c.frozen() for c in self.children)
        return TreeNode(row=self.row, children=kids, more=self.more)


async def _tree(
    store: RunStore, run_id: str, node_ids: list[str], status_of: StatusOf
) -> tuple[tuple[TreeNode, ...], int, int]:
    """The descendants of ``run_id`` breadth first within the limits, how many of those read
    were left out, and how many children ``run_id`` has.

    Only runs the tree shows above its last level are asked for their children,
    so a page reads at most :data:`TREE_LIMIT` lists of children.
    """
    top: list[_Growing] = []
    budget, left_out, total = TREE_LIMIT, 0, 0
    pending: deque[tuple[str, Sequence[str], int, _Growing | None]] = deque(
        [(run_id, node_ids, 1, None)]
    )
    while pending:
        parent_id, parent_nodes, depth, owner = pending.popleft()
        records = await store.list_runs(parent=parent_id)
        rows = child_rows(parent_id, records, parent_nodes, status_of)
        shown = rows[:budget]
        budget -= len(shown)
        left_out += len(rows) - len(shown)
        grown = [_Growing(row) for row in shown]
        if owner is None:
            top, total = grown, len(rows)
        else:
            owner.children, owner.more = grown, len(rows) - len(shown)
        if depth < TREE_DEPTH and budget > 0:
            # A deeper run's own node ids are not read: its children's ids are read from the right.
            pending.extend((g.row.run_id, (), depth + 1, g) for g in grown)
    return tuple(t.frozen() for t in top), left_out, total


def child_rows(
    parent_id: str, records: Sequence[RunRecord], node_ids: Iterable[str], status_of: StatusOf
) -> list[ChildRow]:
    """``records`` (children of ``parent_id``) as rows, by node, visit and item; unread ids last."""
    known = list(node_ids)
    rows = []
    for r in records:
        place = child_place(parent_id, r.run_id, known)
        rows.append(
            ChildRow(
                run_id=r.run_id, label=_relative(parent_id, r.run_id), graph=r.graph_name, queue=r.queue_name, status=status_of(r),
                node=None if place is None else place.node_id,
                visit=None if place is None else place.visit,
                item=None if place is None else place.item,
            )
        )  # fmt: skip
    rows.sort(key=lambda c: (c.node is None, c.node or "", c.visit or 0, c.item or 0, c.run_id))
    return rows


def _relative(parent_id: str, child_id: str) -> str:
    """``child_id`` without its parent's id in front (which the page already shows)."""
    if child_id.startswith(parent_id + "/"):
        return "…" + child_id[len(parent_id) :]
    return child_id
