"""Graphs the gate tests resume from other engines, threads and processes.

Other processes load this file by path, so it holds only graphs and the
side-file helpers their handlers use. Runs record ``graph_ref=f"{GRAPH_FILE}:approval"``,
a file reference that no engine executes (trust model): engines that resume
them are told the graphs instead (:func:`engine`, ``serve --graphs``). A node
that must run exactly once appends one line per execution to a side file
(append + fsync) named in the answer it receives, so executions are counted
even in processes that were SIGKILLed afterwards.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import tailrace as tr
from tailrace.stores import RunStore

GRAPH_FILE = Path(__file__).resolve()


def record(path: str, line: str) -> None:
    """Append ``line`` to ``path`` durably (one ``write`` on an ``O_APPEND`` fd, then fsync)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def executions(path: str | os.PathLike[str], run_id: str, node_id: str) -> int:
    """How many times ``node_id`` of ``run_id`` ran, per the side file at ``path``."""
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        return 0
    return sum(1 for line in lines if line.split()[:2] == [run_id, node_id])


def _note(answer: Any) -> None:
    """Record this execution in the side file the answer names (if any)."""
    ctx = tr.current_node()
    assert ctx is not None
    if isinstance(answer, dict) and answer.get("side"):
        record(str(answer["side"]), f"{ctx.run_id} {ctx.node_id} {ctx.visit} {os.getpid()}")


# -- approval: prepare -> review (gate) -> ship ------------------------------------

approval = tr.Graph("approval")


@approval.task()
async def prepare(x: Any) -> Any:
    return x


@approval.gate()
async def review(x: Any) -> Any:
    return {"ask": "ship it?", "input": x}


@approval.task()
async def ship(answer: Any) -> Any:
    _note(answer)
    return {"shipped": answer}


approval.chain("prepare", "review", "ship")


# -- padded: review (gate) -> settle (sleeps answer["pad"]) -> ship -------------------
# The pad keeps ``ship`` out of a kill window that opens when the answer is recorded.

padded = tr.Graph("padded")


@padded.gate(name="review")
async def padded_review(x: Any) -> Any:
    return {"ask": "ship it?", "input": x}


@padded.task(name="settle")
async def padded_settle(answer: Any) -> Any:
    _note(answer)
    await asyncio.sleep(float(answer.get("pad", 0.0)) if isinstance(answer, dict) else 0.0)
    return answer


@padded.task(name="ship")
async def padded_ship(answer: Any) -> Any:
    _note(answer)
    return {"shipped": answer}


padded.chain("review", "settle", "ship")


# -- fragile: review (gate) -> deploy, which fails on {"explode": true} -----------------

fragile = tr.Graph("fragile")


@fragile.gate(name="review")
async def fragile_review(x: Any) -> Any:
    return {"ask": "deploy?", "input": x}


@fragile.task(name="deploy")
async def fragile_deploy(answer: Any) -> Any:
    _note(answer)
    if isinstance(answer, dict) and answer.get("explode"):
        raise RuntimeError("deploy exploded")
    return {"deployed": answer}


fragile.chain("review", "deploy")


def engine(store: RunStore | None, **options: Any) -> tr.Engine:
    """An engine on ``store`` told about every graph of this file (as a daemon is with ``--graphs``)."""
    made = tr.Engine(store=store, **options)
    made.register(approval, padded, fragile)
    return made
