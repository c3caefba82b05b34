"""Candidate pools: today's single head, and the Pareto front over per-task rewards (GEPA).

A :class:`Member` is an artifact with its reward on every held-out task.
With ``selection="head"`` the pool is the ledger head alone: every rollout
renders it and every edit is judged against it. With ``selection="pareto"``
(GEPA, Agrawal et al. 2025, "Reflective Prompt Evolution Can Outperform
Reinforcement Learning") the pool keeps every candidate that is best on at
least one held-out task and not dominated by another; a rollout's parent is
sampled from it, each member weighted by the number of tasks it is best on,
so a candidate that alone solves a few tasks keeps being improved even while
its mean is below the head's. The ledger head is still one artifact: the
member with the best mean held-out reward, once the acceptance gate says it
beats the head.

>>> a = Member(id=1, artifact=Artifact(), rewards=[1.0, 0.0], parent=None)
>>> b = Member(id=2, artifact=Artifact(), rewards=[0.0, 1.0], parent=1)
>>> [m.id for m in pareto_front([a, b])], [m.id for m in pareto_front([a, b, Member(
...     id=3, artifact=Artifact(), rewards=[1.0, 1.0], parent=1)])]
([1, 2], [3])
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from ._model import Artifact


@dataclass(frozen=True, slots=True, kw_only=True)
class Member:
    """A candidate artifact and its held-out rewards, task by task.

    Args:
        id: Counts members from 1 (the starting head) in the order they were made.
        artifact: The candidate.
        rewards: Its reward on each held-out task, in held-out order.
        parent: The member it was derived from (None for the first).
    """

    id: int
    artifact: Artifact
    rewards: Sequence[float]
    parent: int | None

    @property
    def mean(self) -> float:
        """Mean held-out reward."""
        return math.fsum(self.rewards) / len(self.rewards) if self.rewards else 0.0


def dominates(a: Sequence[float], b: Sequence[float]) -> bool:
    """True when ``a`` is at least ``b`` on every task and above it on one.

    Args:
        a: Per-task rewards.
        b: Per-task rewards on the same tasks.
    """
    return all(x >= y for x, y in zip(a, b, strict=True)) and any(
        x > y for x, y in zip(a, b, strict=True)
    )


def best_per_task(members: Sequence[Member]) -> list[list[Member]]:
    """For each task, the members reaching its best reward; empty where the best is 0.

    A task no member solves at all says nothing about who to keep.

    Args:
        members: Members scored on the same tasks.
    """
    if not members:
        return []
    winners: list[list[Member]] = []
    for t in range(len(members[0].rewards)):
        top = max(m.rewards[t] for m in members)
        winners.append([m for m in members if m.rewards[t] == top] if top > 0 else [])
    return winners


def pareto_front(members: Sequence[Member]) -> list[Member]:
    """Members best on at least one task and dominated by none, oldest first.

    Of members with identical rewards only the oldest is kept. When no member
    is best anywhere (all rewards 0), the front is the oldest member.

    Args:
        members: Members scored on the same tasks.
    """
    distinct: dict[tuple[float, ...], Member] = {}
    for m in sorted(members, key=lambda m: m.id):
        distinct.setdefault(tuple(m.rewards), m)
    unique = list(distinct.values())
    winning = {m.id for best in best_per_task(unique) for m in best}
    front = [
        m
        for m in unique
        if m.id in winning and not any(dominates(o.rewards, m.rewards) for o in unique)
    ]
    return front or unique[:1]


class Pool:
    """The Pareto pool: admits children on the front, samples parents by tasks won.

    Args:
        first: The starting head.
        seed: Seeds parent sampling (deterministic per seed).
    """

    def __init__(self, first: Member, seed: int) -> None:
        self.front: list[Member] = [first]
        self._rng = random.Random(f"pareto:{seed}")
        self.admitted = 0

    def admits(self, child: Member) -> bool:
        """Whether ``child`` would be on the front next to the current members.

        Args:
            child: A scored candidate.
        """
        return any(m.id == child.id for m in pareto_front([*self.front, child]))

    def admit(self, child: Member, keep: Member) -> bool:
        """Add ``child`` if it is on the front; drop members it pushes off (never ``keep``).

        Args:
            child: A scored candidate.
            keep: The ledger head, kept in the pool whatever the front says.

        Returns:
            Whether ``child`` was admitted.
        """
        if not self.admits(child):
            return False
        front = pareto_front([*self.front, child])
        if all(m.id != keep.id for m in front):
            front.insert(0, keep)
        self.front = front
        self.admitted += 1
        return True

    def sample(self) -> Member:
        """A parent for the next rollout: weighted by how many tasks each member is best on."""
        wins: dict[int, int] = {m.id: 0 for m in self.front}
        for best in best_per_task(self.front):
            for m in best:
                wins[m.id] += 1
        weights = [wins[m.id] for m in self.front]
        if not any(weights):
            return self._rng.choice(self.front)
        return self._rng.choices(self.front, weights=weights)[0]
