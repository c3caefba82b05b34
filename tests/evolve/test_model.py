"""Contracts: tasks, edits, artifacts, the reward check and the held-out split."""

from __future__ import annotations

import pytest

from tailrace.evolve import Artifact, Edit, Task, check_reward, split_tasks
from tailrace.evolve._model import check_edit, shard


def _tasks(n: int) -> list[Task]:
    return [Task(id=f"t{i}", prompt=f"p{i}") for i in range(n)]


def test_artifact_apply_sets_and_removes_without_mutating():
    base = Artifact(entries={"a": "1", "b": "2"})
    new = base.apply(Edit(set={"c": "3", "a": "9"}, remove=("b", "missing")))
    assert new.entries == {"a": "9", "c": "3"}
    assert base.entries == {"a": "1", "b": "2"}
    assert new.render() == "a: 9\nc: 3"


def test_artifact_keeps_its_renderer_through_edits():
    art = Artifact(entries={"x": "1"}, renderer=lambda e: "|".join(sorted(e.values())))
    assert art.apply(Edit(set={"y": "2"})).render() == "1|2"


def test_artifact_copies_its_entries():
    entries = {"a": "1"}
    art = Artifact(entries=entries)
    entries["a"] = "changed"
    assert art.entries == {"a": "1"}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"set": {"": "x"}}, "non-empty"),
        ({"set": {"a": 1}}, "must be a string"),
        ({"set": {"a": "x"}, "remove": ("a",)}, "both sets and removes"),
    ],
)
def test_edit_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Edit(**kwargs)


def test_edit_round_trips_and_measures_blast_radius():
    edit = Edit(set={"a": "1"}, remove=("b", "c"), note="why")
    assert Edit.from_dict(edit.to_dict()) == edit
    assert edit.blast_radius == 3


@pytest.mark.parametrize("value", [-0.1, 1.5, float("nan"), "1", None, True])
def test_reward_out_of_range_names_the_task(value):
    with pytest.raises(ValueError, match="'task-7'"):
        check_reward(Task(id="task-7", prompt=""), value)


@pytest.mark.parametrize("value", [0, 1, 0.25])
def test_reward_in_range_is_a_float(value):
    assert check_reward(Task(id="t", prompt=""), value) == float(value)


def test_check_edit_refuses_non_edits_and_drops_empty_ones():
    task = Task(id="t9", prompt="")
    assert check_edit(task, None) is None
    assert check_edit(task, Edit()) is None
    with pytest.raises(TypeError, match="'t9'"):
        check_edit(task, {"set": {}})


def test_split_default_holds_out_40_percent_at_the_end():
    train, held = split_tasks(_tasks(10))
    assert [t.id for t in train] == [f"t{i}" for i in range(6)]
    assert [t.id for t in held] == [f"t{i}" for i in range(6, 10)]


def test_split_shuffle_is_seeded():
    a = split_tasks(_tasks(12), 0.5, shuffle_seed=3)
    b = split_tasks(_tasks(12), 0.5, shuffle_seed=3)
    c = split_tasks(_tasks(12), 0.5)
    assert a == b
    assert a != c
    assert sorted(t.id for part in a for t in part) == sorted(t.id for t in _tasks(12))


@pytest.mark.parametrize(
    ("tasks", "frac", "message"),
    [
        (_tasks(3), 0.4, "at least 4 tasks"),
        ([*_tasks(4), Task(id="t0", prompt="dup")], 0.4, r"unique.*'t0'"),
        (_tasks(4), 0.0, "held_out_frac"),
        (_tasks(4), 1.0, "held_out_frac"),
    ],
)
def test_split_refuses_bad_input(tasks, frac, message):
    with pytest.raises(ValueError, match=message):
        split_tasks(tasks, frac)


def test_split_keeps_both_sides_non_empty():
    train, held = split_tasks(_tasks(4), 0.9)
    assert len(train) == 1 and len(held) == 3


def test_shard_deals_round_robin():
    assert [[t.id for t in s] for s in shard(_tasks(5), 2)] == [["t0", "t2", "t4"], ["t1", "t3"]]
    with pytest.raises(ValueError):
        shard(_tasks(5), 0)


def test_task_cost_defaults_to_one():
    assert Task(id="a", prompt="").cost == 1.0
    assert Task(id="a", prompt="", meta={"cost": 4}).cost == 4.0
