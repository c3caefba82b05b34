"""The run page's streams: each attempt's chunks and its mark, losers greyed (S1-S3).

Chunks are data: they are decoded from their stored JSON and handed to the
templates as text, which Jinja escapes; nothing of them is read as markup. The
characters a page would act on instead of showing (controls, bidirectional
overrides) are spelled as escapes first, as ``tailrace tail`` prints them.

The page shows the last :data:`TEXT_CHARS` of each attempt's stream. The store
reads stream rows forwards only, so the rows are read in batches and each
attempt keeps only the tail it shows: what the page holds is bounded by the
number of attempts, not by how much they streamed.
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass, field

from .._visible import visible, visible_json
from ..stores import ChunkRow, RunStore

#: The page reads at most this many stream rows of a run (the first ones).
MAX_ROWS = 20_000
#: Each attempt shows the last this many characters of what it streamed.
TEXT_CHARS = 4_000


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamCard:
    """One attempt's stream: who streamed, how it ended, and the text so far."""

    label: str
    #: ``streaming`` (no mark yet), ``accepted`` (the winner) or ``discarded``.
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
    #: Whether the run has more rows than the page reads.
    more: bool = False


async def read_streams(store: RunStore, run_id: str) -> Streams:
    """The streams of ``run_id`` as stored now (at most :data:`MAX_ROWS` rows)."""
    tails: dict[int, _Tail] = {}
    read, last_seq = 0, 0
    while read < MAX_ROWS:
        batch = await store.chunks(run_id, after=last_seq, limit=min(1000, MAX_ROWS - read))
        if not batch:
            break
        for row in batch:
            tail = tails.get(row.stream)
            if tail is None:
                tail = tails[row.stream] = _Tail(first=row)
            tail.add(row)
        read, last_seq = read + len(batch), batch[-1].seq
    more = read >= MAX_ROWS and bool(await store.chunks(run_id, after=last_seq, limit=1))
    cards = tuple(tail.card() for tail in tails.values())  # in the order the streams began
    return Streams(cards=cards, last_seq=last_seq, more=more)


@dataclass(slots=True)
class _Tail:
    """One attempt's stream as read so far: its first row, its mark, its last characters."""

    first: ChunkRow
    outcome: str = "streaming"
    chunks: int = 0
    #: Characters streamed in all, and the newest pieces holding the last TEXT_CHARS of them.
    length: int = 0
    pieces: deque[str] = field(default_factory=deque)
    kept: int = 0

    def add(self, row: ChunkRow) -> None:
        if row.kind != "chunk":
            self.outcome = row.kind
            return
        self.outcome = "streaming"
        piece = _piece(row.data_json)
        self.chunks += 1
        self.length += len(piece)
        self.pieces.append(piece)
        self.kept += len(piece)
        while self.kept - len(self.pieces[0]) >= TEXT_CHARS:  # the rest still fills the tail
            self.kept -= len(self.pieces.popleft())

    def card(self) -> StreamCard:
        first = self.first
        item = "" if first.item is None else f"[{first.item}]"
        return StreamCard(
            label=visible(f"{first.node_id}{item} v{first.visit} try {first.attempt}"),
            outcome=self.outcome,
            hedge=bool(first.hedge),
            chunks=self.chunks,
            text=visible("".join(self.pieces)[-TEXT_CHARS:]),
            cut=self.length > TEXT_CHARS,
        )


def _piece(data_json: str | None) -> str:
    """A chunk as text: a string as it is (tokens join up), anything else as one JSON line."""
    if data_json is None:
        return ""
    try:
        value = json.loads(data_json)
    except ValueError:  # not ours to judge: the stored text as it is
        return data_json + "\n"
    if isinstance(value, str):
        return value
    return visible_json(json.dumps(value, ensure_ascii=False)) + "\n"
