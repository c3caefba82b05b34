"""T4: ResumeQueue bounds resumes per task, routes by shard, and counts under one lock."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tailrace.tail import ResumeItem, ResumeQueue


class _YieldingTaskId(str):
    """A task id whose hashing gives up the GIL, so unlocked accounting would interleave.

    Every Counter lookup hashes the key, so this forces a thread switch inside
    the queue's critical sections; under the GIL they would otherwise rarely
    be interrupted and the concurrent test could pass without the lock.
    """

    __slots__ = ()

    def __hash__(self) -> int:
        time.sleep(0)
        return str.__hash__(self)


def _item(task_id: str, turn: int = 1) -> ResumeItem:
    return ResumeItem(task_id=task_id, turn=turn, version_at_checkpoint=3)


def test_t4_burst_push_single_handout() -> None:
    q = ResumeQueue(max_attempts=1)
    item = _item("t1")
    assert [q.push(item) for _ in range(3)] == [True, False, False]
    assert q.dropped == 2
    assert len(q) == 1
    assert q.pop_for({"t1"}) == item
    assert q.pop_for({"t1"}) is None
    assert q.handed_out("t1") == 1
    assert q.push(item) is False  # one was handed out: no attempts left
    assert q.dropped == 3
    assert len(q) == 0


def test_t4_pop_counts_toward_the_bound() -> None:
    q = ResumeQueue(max_attempts=2)
    assert q.push(_item("t", turn=1))
    assert q.pop() == _item("t", turn=1)
    assert q.push(_item("t", turn=2))
    assert q.push(_item("t", turn=3)) is False  # one handed out + one queued = 2
    assert q.pop_for(["t"]) == _item("t", turn=2)
    assert q.push(_item("t", turn=4)) is False
    assert q.handed_out("t") == 2
    assert q.dropped == 2


def test_t4_bound_is_per_task() -> None:
    q = ResumeQueue(max_attempts=1)
    assert q.push(_item("a"))
    assert q.push(_item("b"))
    assert q.push(_item("a")) is False
    assert q.handed_out("a") == 0
    assert len(q) == 2


def test_t4_pop_is_fifo_and_none_when_empty() -> None:
    q = ResumeQueue(max_attempts=3)
    assert q.pop() is None
    assert q.pop_for({"a"}) is None
    items = [_item("a", 1), _item("b", 1), _item("a", 2)]
    for item in items:
        assert q.push(item)
    assert [q.pop(), q.pop(), q.pop()] == items
    assert q.pop() is None


def test_t4_pop_for_takes_the_oldest_owned_item_and_leaves_the_rest_in_order() -> None:
    q = ResumeQueue(max_attempts=3)
    items = [_item("x", 1), _item("a", 1), _item("y", 1), _item("a", 2), _item("b", 1)]
    for item in items:
        q.push(item)
    assert q.pop_for({"a", "b"}) == _item("a", 1)
    assert q.pop_for({"a", "b"}) == _item("a", 2)
    assert q.pop_for({"q"}) is None
    assert [q.pop(), q.pop(), q.pop()] == [_item("x", 1), _item("y", 1), _item("b", 1)]


def test_t4_pop_for_refuses_a_bare_string() -> None:
    # "a" in "abc" is a substring test: a str would hand out tasks "a", "b", "c", "ab", ...
    q = ResumeQueue()
    q.push(_item("a"))
    with pytest.raises(TypeError, match="task_ids"):
        q.pop_for("abc")
    assert len(q) == 1


@pytest.mark.parametrize("max_attempts", [0, -1])
def test_t4_rejects_max_attempts_below_one(max_attempts: int) -> None:
    with pytest.raises(ValueError, match="max_attempts"):
        ResumeQueue(max_attempts=max_attempts)


def test_t4_resume_item_is_a_frozen_keyword_only_record() -> None:
    messages = [{"role": "user", "content": "hi"}]
    item = ResumeItem(task_id="t", turn=2, version_at_checkpoint=5, conversation=messages)
    assert item.conversation == ({"role": "user", "content": "hi"},)
    messages.append({"role": "assistant", "content": "late edit"})
    assert len(item.conversation) == 1  # the queued item does not see later edits
    assert item.external_handle is None
    assert _item("t").conversation == ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        item.turn = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        ResumeItem("t", 2, 5)  # type: ignore[call-arg]


def test_t4_concurrent_producers_and_consumers_respect_the_bound() -> None:
    n_producers = n_consumers = 24
    pushes_each = 10
    q = ResumeQueue(max_attempts=5)
    task_id = _YieldingTaskId("hot")
    start = threading.Barrier(n_producers + n_consumers)
    producers_done = threading.Event()
    accepted: list[bool] = []
    received: list[ResumeItem] = []

    def produce(p: int) -> None:
        start.wait()
        for k in range(pushes_each):
            ok = q.push(
                ResumeItem(task_id=task_id, turn=p * pushes_each + k, version_at_checkpoint=0)
            )
            accepted.append(ok)

    def consume(c: int) -> None:
        start.wait()
        while True:
            # Read the flag before popping: if producers had finished by then,
            # an empty pop means nothing more can ever arrive.
            finished = producers_done.is_set()
            # Half the consumers pop by shard, half pop anything: both count.
            item = q.pop_for({task_id}) if c % 2 else q.pop()
            if item is not None:
                received.append(item)
            elif finished:
                return
            else:
                time.sleep(0)

    producers = [threading.Thread(target=produce, args=(p,)) for p in range(n_producers)]
    consumers = [threading.Thread(target=consume, args=(c,)) for c in range(n_consumers)]
    for thread in producers + consumers:
        thread.start()
    for thread in producers:
        thread.join()
    producers_done.set()
    for thread in consumers:
        thread.join()

    assert accepted.count(True) == 5
    assert len(received) == 5
    assert len({item.turn for item in received}) == 5  # five distinct items, none twice
    assert q.handed_out("hot") == 5
    assert q.dropped == n_producers * pushes_each - 5
    assert len(q) == 0


def test_t4_disjoint_shards_never_receive_each_others_tasks() -> None:
    shards = [
        frozenset(f"t{i}" for i in range(0, 40, 2)),
        frozenset(f"t{i}" for i in range(1, 40, 2)),
    ]
    q = ResumeQueue(max_attempts=1)
    start = threading.Barrier(3)
    pushed_all = threading.Event()
    received: list[list[str]] = [[], []]

    def worker(w: int) -> None:
        start.wait()
        while True:
            finished = pushed_all.is_set()  # read first: see the consumer test above
            item = q.pop_for(shards[w])
            if item is not None:
                received[w].append(item.task_id)
            elif finished:
                return
            else:
                time.sleep(0)

    workers = [threading.Thread(target=worker, args=(w,)) for w in range(2)]
    for thread in workers:
        thread.start()
    start.wait()
    for i in range(40):
        assert q.push(_item(f"t{i}"))
    pushed_all.set()
    for thread in workers:
        thread.join()

    for w in range(2):
        assert set(received[w]) <= shards[w]
        assert received[w] == sorted(received[w], key=lambda t: int(t[1:]))  # FIFO per shard
    assert sorted(received[0] + received[1]) == sorted(f"t{i}" for i in range(40))
    assert len(q) == 0


# --- the whole contract against a reference model ----------------------------------------

tasks = st.sampled_from(["a", "b", "c"])
operations = st.lists(
    st.one_of(
        st.tuples(st.just("push"), tasks),
        st.tuples(st.just("pop"), st.just("")),
        st.tuples(st.just("pop_for"), st.sets(tasks).map(lambda s: "".join(sorted(s)))),
    ),
    max_size=40,
)


@settings(max_examples=500)
@given(max_attempts=st.integers(1, 3), ops=operations)
def test_t4_matches_a_reference_model(max_attempts: int, ops: list[tuple[str, str]]) -> None:
    q = ResumeQueue(max_attempts=max_attempts)
    queued: list[ResumeItem] = []
    handed: dict[str, int] = {}
    dropped = 0
    for step, (op, arg) in enumerate(ops):
        if op == "push":
            item = _item(arg, turn=step)
            room = handed.get(arg, 0) + sum(i.task_id == arg for i in queued) < max_attempts
            assert q.push(item) is room
            if room:
                queued.append(item)
            else:
                dropped += 1
            continue
        owned = set(arg) if op == "pop_for" else {"a", "b", "c"}
        expected = next((i for i in queued if i.task_id in owned), None)
        got = q.pop_for(owned) if op == "pop_for" else q.pop()
        assert got == expected
        if expected is not None:
            queued.remove(expected)
            handed[expected.task_id] = handed.get(expected.task_id, 0) + 1
    assert len(q) == len(queued)
    assert q.dropped == dropped
    for task_id in "abc":
        assert q.handed_out(task_id) == handed.get(task_id, 0)
        assert handed.get(task_id, 0) <= max_attempts
