"""The instruments seam: hooks around each drive of a run and around each attempt's executor.

Every test drives real runs through the public API and watches them from an
:class:`~tailrace.Instrument`; nothing here reads the engine's private fields.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

import tailrace as tr
from tailrace.executors import AttemptContext, Executor
from tailrace.graph import Node
from tailrace.stores import MemoryStore, RunStatus

GUARD = 30.0

#: Set by :class:`Recorder` around each drive: the handler sees it (it is current while the run drives).
CURRENT: contextvars.ContextVar[str | None] = contextvars.ContextVar("current", default=None)


class Recorder(tr.Instrument):
    """Records each drive (its kind, run and outcome) and each attempt, in order."""

    def __init__(self, name: str, log: list[Any]) -> None:
        self.name = name
        self.log = log

    async def drive(
        self, call: tr.RunCall, proceed: Callable[[], Awaitable[tr.RunResult]]
    ) -> tr.RunResult:
        self.log.append((self.name, "enter", call.kind, call.run_id))
        token = CURRENT.set(f"{call.kind} {call.run_id}")
        try:
            result = await proceed()
        finally:
            CURRENT.reset(token)
        self.log.append((self.name, "exit", call.kind, result.status.value))
        return result

    def wrap_executor(self, executor: Executor, name: str | None) -> Executor:
        return Wrapped(executor, self.name, self.log)


class Wrapped:
    def __init__(self, inner: Executor, by: str, log: list[Any]) -> None:
        self.inner, self.by, self.log = inner, by, log

    async def invoke(self, node: Node, payload: Any, context: AttemptContext) -> Any:
        self.log.append((self.by, "attempt", context.node_id))
        return await self.inner.invoke(node, payload, context)

    async def aclose(self) -> None:
        await self.inner.aclose()


def doubling() -> tr.Graph:
    g = tr.Graph("doubling")

    @g.task()
    async def double(x: int) -> list[Any]:
        return [2 * x, CURRENT.get()]

    return g


async def test_instruments_nest_in_the_order_added_around_the_drive_and_each_attempt() -> None:
    log: list[Any] = []
    outer, inner = Recorder("outer", log), Recorder("inner", log)
    engine = tr.Engine(instruments=[outer])
    engine.instruments.add(inner)
    assert list(engine.instruments) == [outer, inner] and len(engine.instruments) == 2
    result = await asyncio.wait_for(engine.run(doubling(), 21, run_id="r"), GUARD)
    assert result.output == [42, "run r"]  # the hook's context is current in the handler
    assert log == [
        ("outer", "enter", "run", "r"),
        ("inner", "enter", "run", "r"),
        ("outer", "attempt", "double"),
        ("inner", "attempt", "double"),
        ("inner", "exit", "run", "completed"),
        ("outer", "exit", "run", "completed"),
    ]


async def test_a_removed_instrument_hooks_nothing_more() -> None:
    log: list[Any] = []
    recorder = Recorder("only", log)
    engine = tr.Engine(instruments=[recorder])
    with pytest.raises(ValueError, match="already"):
        engine.instruments.add(recorder)
    engine.instruments.remove(recorder)
    assert recorder not in engine.instruments
    with pytest.raises(ValueError, match="not an instrument"):
        engine.instruments.remove(recorder)
    with pytest.raises(TypeError, match="not an Instrument"):
        engine.instruments.add(object())  # type: ignore[arg-type]
    result = await engine.run(doubling(), 1)
    assert result.output == [2, None] and log == []


async def test_a_base_instrument_changes_nothing() -> None:
    engine = tr.Engine(instruments=[tr.Instrument()])
    assert (await engine.run(doubling(), 2)).output == [4, None]


async def test_resume_fork_and_a_woken_parent_are_drives_too() -> None:
    child = tr.Graph("asks")

    @child.gate()
    async def approve(x: int) -> str:
        return f"approve {x}?"

    g = tr.Graph("waits_on_child")
    g.add_node("sub", child)

    @g.task()
    async def after(text: str) -> str:
        return str(text).upper()

    g.chain("sub", "after")
    log: list[Any] = []
    engine = tr.Engine(store=MemoryStore(), instruments=[Recorder("rec", log)])
    async with engine.store:  # type: ignore[union-attr]
        suspended = await asyncio.wait_for(engine.run(g, 3, run_id="q"), GUARD)
        assert suspended.status is RunStatus.SUSPENDED
        await engine.answer(suspended.questions[0].question_id, "yes")
        forked = await engine.fork("q", at="after", fork_id="f")
    assert forked.output == "YES"
    drives = [(e[2], e[3]) for e in log if e[1] == "enter"]
    # The answer resumes the child; its end wakes the parent, resumed as a drive of its own.
    assert drives == [("run", "q"), ("resume", "q/sub/1"), ("resume", "q"), ("fork", "f")]
    ends = [(e[2], e[3]) for e in log if e[1] == "exit"]
    assert ends == [
        ("run", "suspended"),
        ("resume", "completed"),  # the parent, within the child's call
        ("resume", "completed"),
        ("fork", "completed"),
    ]
