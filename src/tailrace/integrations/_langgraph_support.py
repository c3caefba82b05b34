"""Helpers of the LangGraph driver: reading LangGraph's objects, and the machine-gate convention.

Everything here touches LangGraph only through the attributes it documents
(``StateSnapshot.interrupts``/``tasks``/``next``/``metadata``, ``Interrupt.id``
and ``.value``), or imports it lazily, so ``import tailrace`` never needs it.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .._codec import DEFAULT_CODEC
from .._values import KIND as _TIMEOUT_KIND
from .._values import MARKER as _TIMEOUT_MARKER
from ..gates import GateTimeout
from ..stores import Harvest, QuestionRow, QuestionStatus, RunRecord, RunStatus

logger = logging.getLogger("tailrace.integrations.langgraph")

#: Keys of an interrupt value that make it a machine gate (see :func:`machine_gate`).
POLLER_KEY = "poller"
DEADLINE_KEY = "deadline"


@dataclass(frozen=True, slots=True)
class Pending:
    """One interrupt the thread waits on, as LangGraph reports it."""

    interrupt_id: str
    node: str
    value: Any


@dataclass(frozen=True, slots=True)
class GateFields:
    """What an interrupt value asks of the daemon: a poller, a deadline in seconds from now."""

    poller: str | None = None
    deadline: float | None = None


# --- the machine-gate convention -------------------------------------------------


def machine_gate(prompt: Any, *, poller: str | None = None, deadline: float | None = None) -> Any:
    """The value to pass to LangGraph's ``interrupt()`` for a gate a machine answers, or that times out.

    A LangGraph interrupt is a machine gate when its value is a dict with a
    ``"poller"`` key: ``tailrace serve`` (a :class:`~tailrace.gates.Server`
    given the driver as a target) calls the poller registered under that
    name with the whole value until it returns something other than None,
    and answers the interrupt with it (Q5). A ``"deadline"`` key, in seconds
    from when the driver records the interrupt, makes the daemon answer it
    with a :class:`~tailrace.gates.GateTimeout` once it passes; see
    :func:`as_gate_timeout` to route on it. Writing the dict by hand works
    the same; this builder checks the fields where the node runs.

    Args:
        prompt: what the gate asks (JSON), stored under ``"prompt"``.
        poller: the name a daemon registered its poller under (``serve --poller ci=...``).
        deadline: seconds until the gate times out; a positive finite number.

    >>> machine_gate("CI green?", poller="ci", deadline=600)
    {'prompt': 'CI green?', 'poller': 'ci', 'deadline': 600}
    """
    if poller is None and deadline is None:
        raise ValueError("machine_gate needs a poller=, a deadline=, or both")
    if poller is not None and not _valid_poller(poller):
        raise ValueError(f"machine_gate: poller must be a non-empty string, got {poller!r}")
    if deadline is not None and not _valid_deadline(deadline):
        raise ValueError(
            f"machine_gate: deadline must be a finite number of seconds > 0, got {deadline!r}"
        )
    value: dict[str, Any] = {"prompt": prompt}
    if poller is not None:
        value[POLLER_KEY] = poller
    if deadline is not None:
        value[DEADLINE_KEY] = deadline
    return value


def as_gate_timeout(answer: Any) -> GateTimeout | None:
    """``answer`` as a :class:`~tailrace.gates.GateTimeout` when it is one, else None.

    Route on this inside a LangGraph node rather than on ``isinstance``: the
    first time ``interrupt()`` returns, the answer is a ``GateTimeout``, but
    LangGraph's checkpointer stores it as a plain dict, so a node that runs
    again (a later interrupt in the same node, a retried step) gets the dict.

    Args:
        answer: what ``interrupt()`` returned.

    >>> as_gate_timeout({"$tailrace": "gate_timeout", "question_id": "t/1", "deadline": 5.0})
    {'$tailrace': 'gate_timeout', 'question_id': 't/1', 'deadline': 5.0}
    >>> as_gate_timeout("yes") is None
    True
    """
    if isinstance(answer, GateTimeout):
        return answer
    if isinstance(answer, Mapping) and answer.get(_TIMEOUT_MARKER) == _TIMEOUT_KIND:
        return GateTimeout(
            question_id=str(answer.get("question_id")), deadline=answer.get("deadline")
        )
    return None


def gate_fields(value: Any, where: str) -> GateFields:
    """The poller and deadline an interrupt ``value`` names; invalid ones are logged and ignored.

    ``where`` names the question in the warning. The graph already stopped on
    this interrupt, so a bad field cannot fail its node any more: the question
    is opened as one for a person, and the warning says why.
    """
    if not isinstance(value, Mapping):
        return GateFields()
    poller, deadline = value.get(POLLER_KEY), value.get(DEADLINE_KEY)
    if poller is not None and not _valid_poller(poller):
        logger.warning("%s: ignoring poller %r: not a non-empty string", where, poller)
        poller = None
    if deadline is not None and not _valid_deadline(deadline):
        logger.warning("%s: ignoring deadline %r: not a number of seconds > 0", where, deadline)
        deadline = None
    return GateFields(poller=poller, deadline=None if deadline is None else float(deadline))


def _valid_poller(poller: Any) -> bool:
    return isinstance(poller, str) and poller != ""


def _valid_deadline(deadline: Any) -> bool:
    number = isinstance(deadline, (int, float)) and not isinstance(deadline, bool)
    return number and math.isfinite(deadline) and deadline > 0


# --- the ledger ----------------------------------------------------------------------


def unapplied(question: QuestionRow) -> bool:
    """Whether ``question`` carries an answer (or a timeout) nobody applied yet (Q4)."""
    return question.status is QuestionStatus.ANSWERED or (
        question.status is QuestionStatus.EXPIRED and question.applied_at is None
    )


def encode(value: Any) -> str:
    """``value`` as JSON; what JSON cannot carry (LangChain messages, ...) as its ``repr``."""
    try:
        return DEFAULT_CODEC.encode(value)
    except (TypeError, ValueError):
        return DEFAULT_CODEC.encode(repr(value))


def state_of(record: RunRecord) -> dict[str, Any]:
    """The run row's state as the driver stored it (empty when it is not the driver's)."""
    try:
        state = DEFAULT_CODEC.decode(record.state_json)
    except ValueError:
        return {}
    return state if isinstance(state, dict) else {}


def turn_of(record: RunRecord) -> int:
    """The thread's turn as the driver stored it in the run row."""
    turn = state_of(record).get("turn", 0)
    return turn if isinstance(turn, int) else 0


def state_json(turn: int, events: Mapping[str, Any] | None = None) -> str:
    """The run row's state for a LangGraph thread at ``turn``, with its event counters."""
    state: dict[str, Any] = {"driver": "langgraph", "turn": turn}
    if events is not None:
        state["events"] = dict(events)
    return DEFAULT_CODEC.encode(state)


# --- LangGraph's objects -------------------------------------------------------------


def command_class() -> Any:
    """LangGraph's ``Command``; a clear ImportError without the extra."""
    try:
        from langgraph.types import Command
    except ImportError as exc:  # pragma: no cover - exercised without the extra
        raise ImportError(
            "LangGraphDriver needs LangGraph: pip install 'tailrace[langgraph]'"
        ) from exc
    return Command


def strict_resume_key() -> str | None:
    """LangGraph's config key for strict resumes (refuse a consumed interrupt), if it has one."""
    try:
        from langgraph._internal._constants import CONFIG_KEY_STRICT_RESUME
    except ImportError:
        return None
    return str(CONFIG_KEY_STRICT_RESUME)


def unknown_interrupt_error() -> type[Exception]:
    """The error a strict resume raises for a consumed interrupt (a stand-in if absent)."""
    try:
        from langgraph.errors import UnknownInterruptError
    except ImportError:
        return _NeverRaised
    return UnknownInterruptError


class _NeverRaised(Exception):
    """Stands in for an error class this LangGraph version lacks."""


def has_async_api(checkpointer: Any) -> bool:
    """Whether ``checkpointer`` implements LangGraph's async checkpoint API."""
    try:
        from langgraph.checkpoint.sqlite import SqliteSaver
    except ImportError:
        pass
    else:
        if isinstance(checkpointer, SqliteSaver):
            return False  # it defines the async methods only to raise NotImplementedError
    from langgraph.checkpoint.base import BaseCheckpointSaver

    return type(checkpointer).aget_tuple is not BaseCheckpointSaver.aget_tuple


def pending_interrupts(snapshot: Any) -> dict[str, Pending]:
    """Interrupts still waiting for an answer in ``snapshot`` (the latest state), by id, in order."""
    nodes: dict[str, str] = {}
    everything: list[Any] = []
    for task in getattr(snapshot, "tasks", ()) or ():
        for interrupt in getattr(task, "interrupts", ()) or ():
            nodes.setdefault(str(interrupt.id), str(task.name))
            everything.append(interrupt)
    waiting = getattr(snapshot, "interrupts", None)
    pending: dict[str, Pending] = {}
    for interrupt in everything if waiting is None else waiting:
        iid = str(interrupt.id)
        if iid not in pending:
            pending[iid] = Pending(iid, nodes.get(iid, ""), interrupt.value)
    return pending


def has_checkpoint(snapshot: Any) -> bool:
    """Whether LangGraph has saved anything for the thread."""
    return getattr(snapshot, "created_at", None) is not None or bool(
        getattr(snapshot, "metadata", None)
    )


def step_of(snapshot: Any) -> int:
    """LangGraph's step number of ``snapshot`` (0 when it has none)."""
    metadata = getattr(snapshot, "metadata", None) or {}
    step = metadata.get("step", 0) if isinstance(metadata, Mapping) else 0
    return int(step) if isinstance(step, int) else 0


def status_of(snapshot: Any, pending: Mapping[str, Pending]) -> RunStatus:
    """The run status ``snapshot`` means: suspended on interrupts, stopped mid-graph, or done."""
    if pending:
        return RunStatus.SUSPENDED
    if stopped_mid_graph(snapshot):
        return RunStatus.RUNNING  # a failed or cut-off step: not finished
    return RunStatus.COMPLETED


def stopped_mid_graph(snapshot: Any) -> bool:
    """Whether LangGraph has nodes left to run in ``snapshot``."""
    return bool(getattr(snapshot, "next", ()))


# --- rows and graphs the driver builds ---------------------------------------------


async def resolve_graph(source: Any, stack: contextlib.AsyncExitStack) -> Any:
    """Unwrap factories and context managers until a compiled graph appears."""
    current = source
    for _ in range(4):  # a factory may return a context manager, which yields the graph
        if hasattr(current, "checkpointer") and hasattr(current, "invoke"):
            return current
        if hasattr(current, "__aenter__"):
            current = await stack.enter_async_context(current)
        elif hasattr(current, "__enter__"):
            current = stack.enter_context(current)
        elif callable(current):
            current = current()
            if inspect.isawaitable(current):
                current = await current
        else:
            break
    raise TypeError(
        f"expected a compiled LangGraph graph, or a factory or context manager making one; "
        f"{source!r} gave {type(current).__name__}"
    )


def question_row(
    question_id: str, thread_id: str, pending: Pending, snapshot: Any, turn: int, now: float
) -> QuestionRow:
    """The ledger row of a newly seen interrupt; a machine gate's poller and deadline included (Q5)."""
    gate = gate_fields(pending.value, f"thread {thread_id!r} question {question_id!r}")
    return QuestionRow(
        question_id=question_id,
        run_id=thread_id,
        node_id=pending.node,
        visit=step_of(snapshot),
        turn=turn,
        prompt_json=encode(pending.value),
        poller=gate.poller,
        deadline=None if gate.deadline is None else now + gate.deadline,
        created_at=now,
    )


def failed_harvest(record: RunRecord, reason: str) -> Harvest:
    """The harvest that marks ``record``'s thread failed with ``reason``."""
    return Harvest(
        state_json=record.state_json,
        status=RunStatus.FAILED,
        error=f"thread {record.run_id!r}: {reason}",
        finished_at=time.time(),
    )
