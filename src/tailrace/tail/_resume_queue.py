"""A bounded queue of partial rollouts waiting to be resumed (T4).

When a long rollout is cut at a turn boundary (to free its worker for shorter
work), its conversation so far is queued and later resumed, possibly against a
newer policy head. Two things must never happen: a task resumed more times than
allowed (a crash-looping rollout would otherwise eat the fleet), and a worker
resuming a task another shard owns. :class:`ResumeQueue` enforces both with
all its accounting under one lock, so a push and a pop that race cannot both
see room for the same last attempt.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True, kw_only=True)
class ResumeItem:
    """A partial rollout checkpointed at a turn boundary, ready to be resumed (T4).

    Args:
        task_id: The task this rollout belongs to; the unit of the attempt bound.
        turn: The turn the rollout stopped at.
        version_at_checkpoint: The policy version that produced the turns so far,
            so the resumer can tell how stale they are.
        conversation: The messages so far; stored as a tuple, so the queued item
            cannot change after it was pushed.
        external_handle: An optional reference to state held elsewhere (a
            sandbox, a KV-cache slot) that the resumer can reattach.
    """

    task_id: str
    turn: int
    version_at_checkpoint: int
    conversation: Sequence[Any] = ()
    external_handle: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.conversation, tuple):
            # Frozen dataclasses can only be set through object.__setattr__.
            object.__setattr__(self, "conversation", tuple(self.conversation))


class ResumeQueue:
    """FIFO of :class:`ResumeItem` that resumes each task at most ``max_attempts`` times (T4).

    A task's *attempts* are its items handed out by :meth:`pop` or
    :meth:`pop_for` plus those still queued. :meth:`push` refuses a task whose
    attempts have reached ``max_attempts`` and counts the refusal in
    :attr:`dropped`. Handed-out attempts are never given back, so the bound is on
    resumes over the queue's lifetime. All methods are thread-safe.

    Args:
        max_attempts: How many times one task may be resumed; at least 1.

    Raises:
        ValueError: ``max_attempts < 1``.

    >>> q = ResumeQueue(max_attempts=1)
    >>> item = ResumeItem(task_id="t1", turn=3, version_at_checkpoint=7)
    >>> [q.push(item) for _ in range(3)]
    [True, False, False]
    >>> q.pop_for({"t2"}) is None, q.pop_for({"t1"}) == item, q.push(item), q.dropped
    (True, True, False, 3)
    """

    __slots__ = ("_dropped", "_handed_out", "_items", "_lock", "_max_attempts", "_queued")

    def __init__(self, max_attempts: int = 1) -> None:
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts!r}")
        self._max_attempts = max_attempts
        self._lock = threading.Lock()
        self._items: deque[ResumeItem] = deque()
        self._queued: Counter[str] = Counter()
        self._handed_out: Counter[str] = Counter()
        self._dropped = 0

    def push(self, item: ResumeItem) -> bool:
        """Queue ``item``; return False (and count it dropped) if its task has no attempts left.

        Args:
            item: The partial rollout to resume later.
        """
        task_id = item.task_id
        with self._lock:
            if self._handed_out[task_id] + self._queued[task_id] >= self._max_attempts:
                self._dropped += 1
                return False
            self._items.append(item)
            self._queued[task_id] += 1
            return True

    def pop(self) -> ResumeItem | None:
        """Hand out the oldest queued item, whatever its task, or None if the queue is empty."""
        with self._lock:
            if not self._items:
                return None
            return self._hand_out(self._items.popleft())

    def pop_for(self, task_ids: Collection[str]) -> ResumeItem | None:
        """Hand out the oldest item whose task is in ``task_ids``, or None if there is none.

        A worker passes the tasks its shard owns, so it never resumes another
        shard's task. Takes O(queue length) membership tests.

        Args:
            task_ids: The task ids the caller owns; anything supporting ``in``
                (a set is fastest). A plain ``str`` is refused, because ``in``
                on it would match substrings.

        Raises:
            TypeError: ``task_ids`` is a ``str``.
        """
        if isinstance(task_ids, str):
            raise TypeError("task_ids must be a collection of task ids, not a str")
        with self._lock:
            for index, item in enumerate(self._items):
                if item.task_id in task_ids:
                    del self._items[index]
                    return self._hand_out(item)
            return None

    def handed_out(self, task_id: str) -> int:
        """Return how many items of ``task_id`` have been handed out so far.

        Args:
            task_id: The task to ask about.
        """
        with self._lock:
            return self._handed_out[task_id]

    @property
    def dropped(self) -> int:
        """How many pushes were refused because their task had no attempts left."""
        with self._lock:
            return self._dropped

    @property
    def max_attempts(self) -> int:
        """The per-task bound on attempts (handed out + queued)."""
        return self._max_attempts

    def __len__(self) -> int:
        """Return the number of items queued (not yet handed out)."""
        with self._lock:
            return len(self._items)

    def _hand_out(self, item: ResumeItem) -> ResumeItem:
        # Caller holds the lock: the move from queued to handed-out is atomic,
        # so a concurrent push never sees the attempt counted zero or two times.
        task_id = item.task_id
        self._queued[task_id] -= 1
        if not self._queued[task_id]:
            del self._queued[task_id]  # keep the counter from growing with finished tasks
        self._handed_out[task_id] += 1
        return item
