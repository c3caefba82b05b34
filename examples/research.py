"""A small agent-shaped workflow: plan, fan out to tools, take the first two, review in a loop.

Run it durably (SQLite, ./tailrace.db)::

    tailrace run examples/research.py:graph --input '"tail latency"'
"""

from __future__ import annotations

import asyncio
import random

from tailrace import Graph, current_node

graph = Graph("research")


@graph.task()
async def plan(topic: str) -> dict[str, object]:
    return {
        "topic": topic,
        "queries": [f"{topic} {angle}" for angle in ("survey", "bench", "bugs")],
    }


def _tool(name: str, seconds: float) -> None:
    async def tool(plan: dict[str, object]) -> str:
        # A heavy tail: one call in a while takes ten times longer.
        rng = random.Random(f"{name}:{plan['topic']}")
        await asyncio.sleep(seconds * (10 if rng.random() < 0.2 else 1))
        return f"{name} notes on {plan['topic']}"

    tool.__name__ = tool.__qualname__ = name
    graph.add_node(name, tool)
    graph.add_edge("plan", name)


_tool("search", 0.02)
_tool("papers", 0.05)
_tool("issues", 0.03)


@graph.aggregate(required=2)
def merge(notes: list[str]) -> dict[str, object]:
    """First two tools to answer win; the straggler is recorded as a late input.

    The merge fires without it, but the run still waits for it to finish
    (``late="cancel"`` would cancel it instead).
    """
    return {"notes": notes, "draft": 0}


for tool_name in ("search", "papers", "issues"):
    graph.add_edge(tool_name, "merge")


@graph.task(max_visits=3)
def write(state: dict[str, object]) -> dict[str, object]:
    ctx = current_node()
    visit = ctx.visit if ctx else 0
    return {
        **state,
        "draft": visit,
        "text": f"draft {visit}: " + "; ".join(map(str, state["notes"])),
    }  # type: ignore[call-overload]


@graph.switch()
def review(state: dict[str, object]) -> str:
    return "done" if int(state["draft"]) >= 2 else "revise"  # type: ignore[call-overload]


@graph.task()
def publish(state: dict[str, object]) -> str:
    return str(state["text"])


graph.add_edge("merge", "write")
graph.add_edge("write", "review")
graph.add_edge("review", "write", route="revise")
graph.add_edge("review", "publish", route="done")
