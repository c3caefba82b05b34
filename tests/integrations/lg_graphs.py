"""Real LangGraph graphs and checkpointers shared by the LangGraph tests and their subprocesses.

Every graph logs the code that runs *after* an ``interrupt(...)`` returned to
a file, one line each, so "applied exactly once" is checked on what LangGraph
really ran, not on tailrace's bookkeeping. Imported by path (the tests) or
from the script's own directory (``langgraph_daemon.py``, ``langgraph_racer.py``).
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, TypedDict

from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.graph import END, START, StateGraph
from langgraph.types import interrupt

from tailrace.gates import GateTimeout
from tailrace.integrations.langgraph import as_gate_timeout, machine_gate

HERE = Path(__file__).resolve().parent


def log(path: Path, line: str) -> None:
    """Append ``line``; O_APPEND keeps short lines whole across threads and processes."""
    with path.open("a") as f:
        f.write(line + "\n")


def lines(path: Path) -> list[str]:
    """The lines logged to ``path`` so far."""
    return path.read_text().splitlines() if path.exists() else []


@contextlib.contextmanager
def sync_saver(path: Path) -> Iterator[SqliteSaver]:
    """LangGraph's sync SQLite checkpointer on the file ``path``."""
    conn = sqlite3.connect(path, check_same_thread=False, timeout=30)
    try:
        yield SqliteSaver(conn)
    finally:
        conn.close()


@contextlib.asynccontextmanager
async def saver(kind: str, path: Path) -> AsyncIterator[Any]:
    """The sync (``"sync"``) or async (``"async"``) SQLite checkpointer on ``path``."""
    if kind == "sync":
        with sync_saver(path) as cp:
            yield cp
    else:
        from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver

        async with AsyncSqliteSaver.from_conn_string(str(path)) as cp:
            yield cp


# --- two parallel branches, each interrupting ------------------------------------


class TrialState(TypedDict, total=False):
    trial: str
    left: Any
    right: Any
    done: bool


def parallel_graph(
    checkpointer: Any,
    path: Path,
    *,
    name: str = "parallel",
    hold_left: tuple[threading.Event, threading.Event] | None = None,
) -> Any:
    """``left`` and ``right`` interrupt in the same superstep; ``join`` runs once both are answered.

    Lines are ``<trial>:left-after`` and so on, ``trial`` taken from the input.
    With ``hold_left=(entered, release)``, ``left`` sets ``entered`` once its
    interrupt returned and waits for ``release`` before it goes on.
    """

    def left(state: TrialState) -> TrialState:
        answer = interrupt({"side": "left?"})
        if hold_left is not None:
            entered, release = hold_left
            entered.set()
            release.wait(timeout=60)
        log(path, f"{state['trial']}:left-after")
        return {"left": answer}

    def right(state: TrialState) -> TrialState:
        answer = interrupt({"side": "right?"})
        log(path, f"{state['trial']}:right-after")
        return {"right": answer}

    def join(state: TrialState) -> TrialState:
        log(path, f"{state['trial']}:join")
        return {"done": True}

    builder = StateGraph(TrialState)
    builder.add_node("left", left)
    builder.add_node("right", right)
    builder.add_node("join", join)
    builder.add_edge(START, "left")
    builder.add_edge(START, "right")
    builder.add_edge(["left", "right"], "join")
    builder.add_edge("join", END)
    return builder.compile(checkpointer=checkpointer, name=name)


# --- a team runner's VERIFY step, waiting on CI ----------------------------------


class TeamState(TypedDict, total=False):
    task: str
    ci_deadline: float
    ci: Any
    outcome: str


def team_graph(checkpointer: Any, path: Path, *, name: str = "team") -> Any:
    """implement -> VERIFY (a machine gate on the ``ci`` poller) -> merge, or escalate on a timeout.

    ``verify`` logs ``verify-after:<type of the answer>``, so a test sees the
    node got a real ``GateTimeout`` the first time ``interrupt()`` returned.
    """

    def implement(state: TeamState) -> TeamState:
        log(path, "implement")
        return {}

    def verify(state: TeamState) -> TeamState:
        gate = machine_gate(
            {"check": "ci", "task": state["task"]},
            poller="ci",
            deadline=state.get("ci_deadline"),
        )
        result = interrupt(gate)
        kind = "GateTimeout" if isinstance(result, GateTimeout) else type(result).__name__
        log(path, f"verify-after:{kind}")
        return {"ci": result}

    def route(state: TeamState) -> str:
        return "escalate" if as_gate_timeout(state["ci"]) is not None else "merge"

    def merge(state: TeamState) -> TeamState:
        log(path, f"merge:{state['ci']['status']}")
        return {"outcome": "merged"}

    def escalate(state: TeamState) -> TeamState:
        log(path, "escalate")
        return {"outcome": "escalated"}

    builder = StateGraph(TeamState)
    builder.add_node("implement", implement)
    builder.add_node("verify", verify)
    builder.add_node("merge", merge)
    builder.add_node("escalate", escalate)
    builder.add_edge(START, "implement")
    builder.add_edge("implement", "verify")
    builder.add_conditional_edges("verify", route, ["merge", "escalate"])
    builder.add_edge("merge", END)
    builder.add_edge("escalate", END)
    return builder.compile(checkpointer=checkpointer, name=name)


# --- nodes streaming custom writes ----------------------------------------------


class StreamState(TypedDict, total=False):
    topic: str
    said: list[str]


def streaming_graph(checkpointer: Any, hold: Path | None = None, *, name: str = "streamer") -> Any:
    """prep -> talk: ``talk`` streams ``{"turn": i}`` for i in 0..4 with LangGraph's stream writer.

    While the file ``hold`` exists, ``talk`` waits after its fifth chunk (a test
    kills the process there); once it is gone, ``talk`` returns.
    """
    import asyncio

    from langgraph.config import get_stream_writer

    def prep(state: StreamState) -> StreamState:
        return {"said": []}

    async def talk(state: StreamState) -> StreamState:
        write = get_stream_writer()
        for i in range(5):
            write({"turn": i})
            await asyncio.sleep(0.01)
        while hold is not None and await asyncio.to_thread(hold.exists):  # noqa: ASYNC110
            await asyncio.sleep(0.05)  # (another process removes the file: no event to wait on)
        return {"said": [f"{state['topic']} {i}" for i in range(5)]}

    builder = StateGraph(StreamState)
    builder.add_node("prep", prep)
    builder.add_node("talk", talk)
    builder.add_edge(START, "prep")
    builder.add_edge("prep", "talk")
    builder.add_edge("talk", END)
    return builder.compile(checkpointer=checkpointer, name=name)
