"""Graphs with child runs for the fleet tests; a module file, so worker processes load it
with ``--graphs`` (a worker given ``family`` can drive ``kid`` too: it is its node's graph).

Each ``kid`` appends ``run node visit`` to the file named by ``$TAILRACE_TEST_SIDE`` when
its work starts (one ``os.write``, O_APPEND), so a test counts how often each child ran
across kills. A kid sleeps ``sleep`` seconds from its input (``$TAILRACE_TEST_KID_SLEEP``
overrides it, for a process started to hold its children).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import tailrace as tr

SIDE_ENV = "TAILRACE_TEST_SIDE"
SLEEP_ENV = "TAILRACE_TEST_KID_SLEEP"


def log_start() -> None:
    path = os.environ.get(SIDE_ENV)
    ctx = tr.current_node()
    if not path or ctx is None:
        return
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{ctx.run_id} {ctx.node_id} {ctx.visit}\n".encode())
    finally:
        os.close(fd)


kid = tr.Graph("kid")


@kid.task()
async def work(job: dict[str, Any]) -> int:
    log_start()
    override = os.environ.get(SLEEP_ENV)
    seconds = float(override) if override else float(job.get("sleep", 0.0))
    if "stagger" in job:  # a child of fan's node k<i> sleeps (i + 1) x stagger
        ctx = tr.current_node()
        assert ctx is not None
        seconds = float(job["stagger"]) * (int(ctx.run_id.split("/")[-2][1:]) + 1)
    await asyncio.sleep(seconds)
    if job.get("fail"):
        raise RuntimeError(f"kid {job['n']} broke")
    return int(job["n"]) * 10


def jobs(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The children's inputs: ``count`` jobs sleeping ``sleep`` (or ``sleeps[i]``) seconds."""
    sleeps = spec.get("sleeps") or [spec.get("sleep", 0.0)] * int(spec["count"])
    broken = set(spec.get("fail", []))
    return [{"n": i, "sleep": s, "fail": i in broken} for i, s in enumerate(sleeps)]


#: A parent on a queue: its map's children go to queue ``kids``; it waits holding nothing.
family = tr.Graph("family")
family.add_node("plan", jobs)
family.add_node("each", kid, "map", queue="kids")


@family.task()
def total(values: list[int]) -> int:
    return sum(values)


family.chain("plan", "each", "total")

#: First-k over children on a queue: the seven first to finish, the rest cancelled.
family_k = tr.Graph("family_k")
family_k.add_node("plan", jobs)
family_k.add_node("each", kid, "map", queue="kids", required=7, late="cancel")
family_k.add_edge("plan", "each")

asker = tr.Graph("asker")


@asker.gate()
def approve(job: dict[str, Any]) -> str:
    return f"approve job {job['n']}?"


asker.add_node("then", lambda answer: f"done {answer}")
asker.chain("approve", "then")

#: A parent with a child that waits on a person (queue ``asks``) and a map of kids.
mixed = tr.Graph("mixed")
mixed.add_node("plan", jobs)
mixed.add_node("ask", asker, queue="asks")
mixed.add_node("each", kid, "map", queue="kids")
mixed.add_edge("plan", "each")
mixed.add_node("first", lambda js: js[0])
mixed.chain("plan", "first", "ask")

#: Four child task nodes on queue ``kids`` into one join: only the last child's end lets
#: the parent go on, so it sleeps through the first three.
fan = tr.Graph("fan")
fan.add_node("plan", lambda spec: spec)
fan.add_node("join", sum, "aggregate")
for _i in range(4):
    fan.add_node(f"k{_i}", kid, queue="kids")
    fan.add_edge("plan", f"k{_i}")
    fan.add_edge(f"k{_i}", "join")

#: Inline children (no ``queue=``) whose own node is a queued grandchild on ``kids``: a
#: parent on a queue runs ``inline_1`` (one inline level) or ``inline_2`` (two), each
#: waiting, through its inline child, on a ``kid`` in the fleet.
inner = tr.Graph("inner")
inner.add_node("grandchild", kid, queue="kids")
middle = tr.Graph("middle")
middle.add_node("inner", inner)
inline_1 = tr.Graph("inline_1")
inline_1.add_node("child", inner)
inline_2 = tr.Graph("inline_2")
inline_2.add_node("child", middle)

#: An inline child that works itself (``slow``, a kid's task: it logs and sleeps) beside its
#: queued grandchild, so it cannot suspend while ``slow`` runs.
inner_slow = tr.Graph("inner_slow")
inner_slow.add_node("grandchild", kid, queue="kids")
inner_slow.add_node("slow", work)
inline_slow = tr.Graph("inline_slow")
inline_slow.add_node("child", inner_slow)
