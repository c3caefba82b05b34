"""Heavy-tailed rollouts: launch more than you need, keep the first k, cancel the rest.

A step of an agent trainer (or a best-of-n sampler) needs ``KEEP`` finished
rollouts. Rollout lengths are heavy-tailed, so waiting for every rollout means
waiting for the slowest one. The map node ``rollout`` runs one attempt per
prompt, decides at its ``KEEP``-th success (``required=KEEP``), hands those
results on in prompt order, and cancels the stragglers (``late="cancel"``).
Every finished rollout is durable: a crash re-runs only the rollouts that
were in flight.

Run it durably (SQLite, ./tailrace.db), then look at its items::

    tailrace run examples/rollouts.py:graph --input '{"step": 1, "prompts": 12}'
    tailrace show <run id>
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

from tailrace import Graph, current_node

#: Rollouts the step keeps; it launches 1.5x as many.
KEEP = 8

graph = Graph("rollouts")


@graph.task()
def prompts(step: dict[str, int]) -> list[dict[str, int]]:
    """The step's prompts: a list known only at run time."""
    return [{"step": step["step"], "prompt": p} for p in range(step["prompts"])]


def keep(count: int) -> int:
    """The map's k for ``count`` prompts: ``KEEP``, or every prompt when there are fewer."""
    return min(KEEP, count)


@graph.map(required=keep, late="cancel")
async def rollout(prompt: dict[str, int]) -> dict[str, Any]:
    """One rollout: its length is lognormal, so a few take ten times the median."""
    ctx = current_node()
    rng = random.Random(f"{prompt['step']}:{prompt['prompt']}")
    turns = max(1, int(rng.lognormvariate(1.5, 0.9)))
    await asyncio.sleep(0.005 * turns)
    return {
        "prompt": prompt["prompt"],
        "turns": turns,
        "reward": rng.random(),
        "item": ctx and ctx.item,
    }


@graph.task()
def update(rollouts: list[dict[str, Any]]) -> dict[str, Any]:
    """The trainer's update: the mean reward of the rollouts kept."""
    rewards = [r["reward"] for r in rollouts]
    return {
        "kept": [r["prompt"] for r in rollouts],
        "mean_reward": round(sum(rewards) / len(rewards), 4),
    }


graph.chain("prompts", "rollout", "update")
