"""The run page's streams: each attempt's chunks and its mark, losers greyed (S1-S3).

Chunks are data: they are decoded from their stored JSON and handed to the
templates as text, which Jinja escapes; nothing of them is read as markup. The
characters a page would act on instead of showing (controls, bidirectional
overrides) are spelled as escapes first, as ``tailrace tail`` prints them.

The page shows the last :data:`TEXT_CHARS` of each attempt's stream, and reads
only that: the store hands it each stream's last rows (``RunStore.stream_tails``)
and how many chunks the stream holds, so what the page reads and holds is
bounded by the number of attempts, not by how much they streamed.

An attempt cancelled to be parked (P3) ends ``discarded`` in the store (S2)
but shows ``parked``: its item keeps its checkpoint and a later run can
continue it. The tails also tell whether a map item streamed a model
generation's usage (the tail account then reads the run's rows, ``_accounts``).
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from .._visible import visible, visible_json
from ..stores import ChunkRow, RunStore, StreamTail
from ..tail import is_usage

#: An attempt as its stream rows name it: node, visit, map item (else None), try.
AttemptKey = tuple[str, int, int | None, int]

#: The page shows at most this many streams of a run (the first ones).
MAX_STREAMS = 2_000
#: Each attempt shows the last this many characters of what it streamed.
TEXT_CHARS = 4_000


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamCard:
    """One attempt's stream: who streamed, how it ended, and the text so far."""

    label: str
    #: ``streaming`` (no mark yet), ``accepted`` (the winner), ``parked`` (a later run can
    #: continue it) or ``discarded``.
    outcome: str
    hedge: bool
    chunks: int
    text: str
    #: Whether the text lost its beginning (only its last :data:`TEXT_CHARS` are shown).
    cut: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class Streams:
    """A run's streams as the page shows them; ``last_seq`` is the last row read."""

    cards: tuple[StreamCard, ...] = ()
    last_seq: int = 0
    #: Whether the run has more streams than the page shows.
    more: bool = False
    #: Whether a map item's stream ended with a model generation's usage.
    generating: bool = False


async def read_streams(
    store: RunStore, run_id: str, parked: Collection[AttemptKey] = ()
) -> Streams:
    """The streams of ``run_id`` as stored now (at most :data:`MAX_STREAMS` of them); the
    attempts in ``parked`` were cancelled to be parked and show so.

    The store cuts each tail by its stored (JSON) characters, the page by the text
    they decode to, which can be shorter (escapes): a tail that decodes to too
    little is read again, larger, until it does or holds its whole stream.
    """
    chars = 2 * TEXT_CHARS  # a JSON string's quotes and escapes: stored text runs longer
    while True:
        tails = await store.stream_tails(run_id, chars=chars, limit=MAX_STREAMS + 1)
        read = [_Tail.of(tail) for tail in tails[:MAX_STREAMS]]
        if all(t.whole or t.length > TEXT_CHARS for t in read):
            break
        chars *= 4
    last_seq = max((tail.rows[-1].seq for tail in tails), default=0)
    cards = tuple(t.card(parked) for t in read)  # in the order the streams began
    return Streams(cards=cards, last_seq=last_seq, more=len(tails) > MAX_STREAMS,
                   generating=any(t.usage for t in read))  # fmt: skip


@dataclass(slots=True)
class _Tail:
    """One attempt's stream as read: its first row read, its mark, its last characters."""

    first: ChunkRow
    chunks: int
    #: Whether the rows read begin at the stream's first: else the text lost its beginning.
    whole: bool
    outcome: str = "streaming"
    #: Characters read, and the newest pieces holding the last TEXT_CHARS of them.
    length: int = 0
    pieces: deque[str] = field(default_factory=deque)
    kept: int = 0
    #: Whether a map item's row read is a model generation's usage chunk.
    usage: bool = False

    @classmethod
    def of(cls, tail: StreamTail) -> _Tail:
        read = cls(first=tail.rows[0], chunks=tail.chunks, whole=tail.whole)
        for row in tail.rows:
            read.add(row)
        return read

    def add(self, row: ChunkRow) -> None:
        if row.kind != "chunk":
            self.outcome = row.kind
            return
        self.outcome = "streaming"
        value = _decoded(row.data_json)
        self.usage = self.usage or (row.item is not None and is_usage(value))
        piece = _piece(row.data_json, value)
        self.length += len(piece)
        self.pieces.append(piece)
        self.kept += len(piece)
        while self.kept - len(self.pieces[0]) >= TEXT_CHARS:  # the rest still fills the tail
            self.kept -= len(self.pieces.popleft())

    def card(self, parked: Collection[AttemptKey]) -> StreamCard:
        first = self.first
        item = "" if first.item is None else f"[{first.item}]"
        outcome = self.outcome
        if (
            outcome == "discarded"
            and (first.node_id, first.visit, first.item, first.attempt) in parked
        ):
            outcome = "parked"
        return StreamCard(
            label=visible(f"{first.node_id}{item} v{first.visit} try {first.attempt}"),
            outcome=outcome,
            hedge=bool(first.hedge),
            chunks=self.chunks,
            text=visible("".join(self.pieces)[-TEXT_CHARS:]),
            cut=self.length > TEXT_CHARS,
        )


#: What a chunk whose stored text is not JSON decodes to here.
_NOT_JSON = object()


def _decoded(data_json: str | None) -> Any:
    """A chunk's value (None for a mark; :data:`_NOT_JSON` when its text does not decode)."""
    if data_json is None:
        return None
    try:
        return json.loads(data_json)
    except ValueError:
        return _NOT_JSON


def _piece(data_json: str | None, value: Any) -> str:
    """A chunk as text: a string as it is (tokens join up), anything else as one JSON line."""
    if data_json is None:
        return ""
    if value is _NOT_JSON:  # not ours to judge: the stored text as it is
        return data_json + "\n"
    if isinstance(value, str):
        return value
    return visible_json(json.dumps(value, ensure_ascii=False)) + "\n"
