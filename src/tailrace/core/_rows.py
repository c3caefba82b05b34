"""The rows a persister writes, built cheaply: slot-filled records, node rows
kept as plain tuples of already-encoded text until a write composes them, and
the pending write that harvests fold into.
"""

from __future__ import annotations

from typing import Any

from .._codec import Codec
from ..stores import (
    FORMAT_VERSION,
    EventRow,
    FrozenInput,
    Harvest,
    NodeRow,
    QuestionRow,
    ResultRow,
    RunStatus,
)

#: Version of the node rows' ``data_json``. Version 2 may refer to a result row
#: instead of repeating a large value (``result_ref``, ``payload_ref``).
NODE_ROW_VERSION = 2


def _pairs(frontier: dict[int, int] | None, ids: tuple[str, ...]) -> list[list[Any]] | None:
    return None if frontier is None else [[ids[k], v] for k, v in sorted(frontier.items())]


def _unpairs(pairs: list[list[Any]] | None, index: dict[str, int]) -> dict[int, int] | None:
    return None if pairs is None else {index[k]: int(v) for k, v in pairs}


#: Types whose values strict JSON reads back unchanged (exact types: no subclasses).
_SCALARS = frozenset({type(None), bool, int, float, str})


def _scalar_json(codec: Codec, value: Any) -> str:
    """JSON of a scalar, as :class:`JsonCodec` writes it (floats must be finite)."""
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if type(value) is int:
        return int.__repr__(value)
    return codec.encode(value)  # str and float: the encoder's checks (surrogates, NaN)


_new_tuple = tuple.__new__


def _make_node_row(node_id: str, status: str, visits: int, data_json: str) -> NodeRow:
    # Rows are named tuples: built with tuple.__new__, not their keyword __new__.
    return _new_tuple(NodeRow, (node_id, status, visits, data_json))


def _make_result_row(node_id: str, visit: int, value_json: str) -> ResultRow:
    return _new_tuple(ResultRow, (node_id, visit, value_json))


#: A plain node row before it is composed: status, fired, visits, attempts,
#: payload JSON, result JSON, has_result JSON (see ``Persister._plain_row``).
PlainRow = tuple[str, int, int, int, str, str, str]


def _compose(node_id: str, row: PlainRow) -> NodeRow:
    status, fired, visits, attempts, payload, result, has_result = row
    return _make_node_row(
        node_id,
        status,
        visits,
        f'{{"v":{NODE_ROW_VERSION},"fired":{fired},"visits":{visits},'
        f'"attempts":{attempts},"payload":{payload},"result":{result},'
        f'"has_result":{has_result},"frontier":null,"inputs":null,"pending":null,'
        '"question":null}',
    )


def state_text(seq: int, events: int, turn: int, durability: str) -> str:
    """A run's state JSON when nothing is parked and no loop edge has a generation."""
    return (
        f'{{"v":{FORMAT_VERSION},"seq":{seq},"events":{events},"turn":{turn},'
        f'"durability":"{durability}","parked":[],"edge_gen":[]}}'
    )


_STATUSES = {status.value: status for status in RunStatus}


class _Pending:
    """Consecutive harvests of one run with one status, merged in order into one write (D2).

    The latest row of each node wins; results, first-k decisions and events
    are concatenated; the run's state, error and status are the last harvest's.
    """

    __slots__ = (
        "applied",
        "error",
        "events",
        "finished_at",
        "frozen",
        "nodes",
        "questions",
        "results",
        "state",
        "status",
        "superseded",
    )

    def __init__(self, status: RunStatus) -> None:
        self.status = status
        self.error: str | None = None
        #: The run's state JSON, or its counters (seq, events, turn) and durability
        #: to write it from.
        self.state: str | tuple[int, int, int, str] = ""
        self.finished_at: float | None = None
        #: node index -> its latest row, or the snapshot to compose it from.
        self.nodes: dict[int, NodeRow | PlainRow] = {}
        self.results: list[ResultRow] = []
        self.frozen: list[FrozenInput] = []
        self.events: list[EventRow] = []
        self.questions: list[QuestionRow] = []
        self.applied: list[str] = []
        self.superseded: list[str] = []

    def harvest(self, ids: tuple[str, ...]) -> Harvest:
        """The merged harvest, as the store takes it (``ids``: node ids by index)."""
        state = self.state
        if not isinstance(state, str):
            state = state_text(*state)
        return Harvest(
            state_json=state,
            status=self.status,
            error=self.error,
            nodes=[
                row if isinstance(row, NodeRow) else _compose(ids[i], row)
                for i, row in self.nodes.items()
            ],
            results=self.results,
            frozen=self.frozen,
            events=self.events,
            nodes_done_delta=len(self.results),
            finished_at=self.finished_at,
            questions=self.questions,
            applied=self.applied,
            superseded=self.superseded,
        )
