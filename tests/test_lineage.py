"""Child run ids (R1): one id per child, none a user may take, each read back to its place.

Hypothesis builds trees of runs from a small alphabet (``/``, ``%``, digits and a
letter, so node ids like ``b/1``, ``7`` and ``50%`` come up often) and checks the
encoding against its three promises.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tailrace._lineage import ChildPlace, child_place, child_run_id, own_run_id

#: Node ids and user run ids from an alphabet that makes collisions likely.
TEXT = st.text(alphabet="b/%71", min_size=1, max_size=5)
LEVEL = st.tuples(TEXT, st.integers(1, 12), st.none() | st.integers(0, 12))


@st.composite
def places(draw: Any) -> tuple[str, tuple[tuple[str, int, int | None], ...]]:
    """A user's run id that is accepted, and a path of (node, visit, item) below it."""
    root = draw(TEXT.filter(_accepted))
    return root, tuple(draw(st.lists(LEVEL, min_size=1, max_size=3)))


def _accepted(run_id: str) -> bool:
    try:
        own_run_id(run_id)
    except ValueError:
        return False
    return True


def _id_of(root: str, path: tuple[tuple[str, int, int | None], ...]) -> str:
    run_id = root
    for node, visit, item in path:
        run_id = child_run_id(run_id, node, visit, item)
    return run_id


#: Trees small enough that ids collide unless the encoding keeps them apart.
TINY = st.tuples(
    st.sampled_from(["r", "1", "r/b", "%"]),
    st.lists(
        st.tuples(
            st.text(alphabet="b/1%", min_size=1, max_size=3),
            st.integers(1, 2),
            st.none() | st.integers(0, 2),
        ),
        min_size=1,
        max_size=3,
    ).map(tuple),
)


@settings(max_examples=300)
@given(st.lists(TINY, min_size=2, max_size=60, unique=True))
@example([("r", (("b/1", 1, None),)), ("r", (("b", 1, 1),))])  # node b/1, item 1 of map b
@example([("r", (("a", 1, 2), ("3", 4, None))), ("r", (("a", 1, None), ("2", 3, 4)))])
def test_two_runs_of_a_tree_share_an_id_only_when_they_are_one_run(
    runs: list[tuple[str, Any]],
) -> None:
    ids = {_id_of(*run): run for run in runs}
    assert len(ids) == len(runs), "two runs got one id"


@settings(max_examples=300)
@given(places())
def test_no_child_id_is_a_run_id_a_user_may_choose_and_each_reads_back(
    place: tuple[str, Any],
) -> None:
    root, path = place
    parent = _id_of(root, path[:-1])
    node, visit, item = path[-1]
    child = child_run_id(parent, node, visit, item)
    assert not _accepted(child)
    assert child_place(parent, child, [node]) == ChildPlace(node, visit, item)
    assert child_place(parent, child, ()) == ChildPlace(node, visit, item)  # no node ids known


def test_an_id_stored_before_node_ids_were_escaped_is_read_with_the_parents_node_ids() -> None:
    assert child_place("p", "p/a/1/2", ["a/1"]) == ChildPlace("a/1", 2, None)
    assert child_place("p", "p/a/1/2", ["a", "a/1"]) == ChildPlace("a", 1, 2)  # escaped first


@pytest.mark.parametrize(
    ("run_id", "named"),
    [("victim/kid/1", "victim"), ("a/b/c/kid/12/0", "a/b/c"), ("/x/1", "")],
)
def test_a_run_id_that_ends_as_a_child_id_is_refused_naming_the_run_it_would_be_a_child_of(
    run_id: str, named: str
) -> None:
    with pytest.raises(ValueError, match="child run") as caught:
        own_run_id(run_id)
    assert f"the child of run {named!r}" in str(caught.value)
