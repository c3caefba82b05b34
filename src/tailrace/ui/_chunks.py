"""The run page's streams: each attempt's chunks and its mark, losers greyed (S1-S3).

Chunks are data: they are decoded from their stored JSON and handed to the
templates as text, which Jinja escapes; nothing of them is read as markup.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

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
    rows: list[ChunkRow] = []
    while len(rows) < MAX_ROWS:
        batch = await store.chunks(run_id, after=rows[-1].seq if rows else 0)
        if not batch:
            break
        rows += batch
    more = len(rows) >= MAX_ROWS
    rows = rows[:MAX_ROWS]
    return Streams(cards=stream_cards(rows), last_seq=rows[-1].seq if rows else 0, more=more)


def stream_cards(rows: Sequence[ChunkRow]) -> tuple[StreamCard, ...]:
    """One card per attempt's stream, in the order the streams began."""
    by_stream: dict[int, list[ChunkRow]] = {}
    for row in rows:
        by_stream.setdefault(row.stream, []).append(row)
    return tuple(_card(stream) for stream in by_stream.values())


def _card(rows: list[ChunkRow]) -> StreamCard:
    first, last = rows[0], rows[-1]
    outcome = last.kind if last.kind != "chunk" else "streaming"
    pieces = [_piece(r.data_json) for r in rows if r.kind == "chunk"]
    text = "".join(pieces)
    item = "" if first.item is None else f"[{first.item}]"
    return StreamCard(
        label=f"{first.node_id}{item} v{first.visit} try {first.attempt}",
        outcome=outcome,
        hedge=bool(first.hedge),
        chunks=len(pieces),
        text=text[-TEXT_CHARS:],
        cut=len(text) > TEXT_CHARS,
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
    return json.dumps(value, ensure_ascii=False) + "\n"
