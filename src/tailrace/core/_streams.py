"""Streams: partial output of running attempts, tagged by attempt, readable live (S1-S4).

A handler publishes chunks with ``current_node().stream(chunk)``. The run
loop holds a :class:`Streams`: it encodes each chunk at the call with the
run's codec (S4), numbers it with the run's stream cursor, tags it with
node, visit, item, attempt and hedge (S1), hands it at once to in-process
listeners (the engine's :class:`StreamHub`) and buffers its row for the next
stage, so chunks are committed with the harvest they were published in
(D1). When an attempt that streamed ends, the loop gives its stream exactly
one terminal mark (S2): ``accepted`` when its result is committed by that
harvest, ``discarded`` otherwise (a lost hedge, a late item cancelled, a
failure, a retry, a cancellation). An attempt that never streams costs
nothing here.

:func:`read_stream` is ``Engine.stream``: the stored rows after a cursor,
then live ones, from the hub when this process drives the run (before they
are durable) and from the store's change feed otherwise, until the run ends
(S3).

:class:`StreamCursor` is how every publisher of stream rows builds them:
the run engine's :class:`Streams` and the LangGraph driver's thread streams
alike check each chunk at the call, number and tag its row, and end each
stream with one terminal mark through it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import enum
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVarTuple

from .._codec import Codec, JsonCodec
from .._errors import EncodeError, RunNotFound, StreamLimit
from ..stores import TERMINAL_STATUSES, ChunkRow, RunStore, StreamHead

if TYPE_CHECKING:
    from ._inflight import Attempt

logger = logging.getLogger("tailrace.streams")

#: The default bound on stream rows per run (``Engine(max_stream_chunks=)``).
MAX_STREAM_CHUNKS = 100_000

#: How many stored rows a reader takes per read.
READ_BATCH = 1000

#: Seconds a reader waits for a wake-up before it looks at the store anyway.
FALLBACK = 0.5

#: Values strict JSON reads back as they went in: no decode needed for listeners.
_SCALARS = frozenset({type(None), bool, int, float, str})
#: A chunk whose value listeners get by decoding its JSON.
_DECODE = object()

_Ts = TypeVarTuple("_Ts")


class ChunkKind(enum.StrEnum):
    """What a stream row is: a chunk, or its attempt's terminal mark (S2)."""

    CHUNK = "chunk"
    ACCEPTED = "accepted"
    DISCARDED = "discarded"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Chunk:
    """One row of a run's streams, as :meth:`Engine.stream` yields it (S1-S3).

    ``seq`` is the run's stream cursor (pass the last one seen as ``after``
    to resume); ``stream`` is the ``seq`` of the first chunk of the attempt
    that published it, shared by all its rows. ``kind`` is
    :attr:`ChunkKind.CHUNK` with ``value`` the chunk (as it reads back from
    JSON), or the attempt's terminal mark, ``accepted`` or ``discarded``,
    with ``value`` None. ``item`` is the map item's index, None for other
    nodes; ``hedge`` says the attempt is a hedge or backup (T3).
    """

    run_id: str
    seq: int
    stream: int
    node_id: str
    visit: int
    item: int | None
    attempt: int
    hedge: bool
    kind: ChunkKind
    value: Any
    ts: float

    @property
    def terminal(self) -> bool:
        """Whether this row is its attempt's terminal mark."""
        return self.kind is not ChunkKind.CHUNK


def chunk_of(run_id: str, row: ChunkRow, codec: Codec, value: Any = _DECODE) -> Chunk:
    """The :class:`Chunk` of stored ``row`` of run ``run_id``, its data decoded with ``codec``
    (unless its ``value`` as it reads back is given)."""
    if value is _DECODE:
        value = None if row.data_json is None else codec.decode(row.data_json)
    return Chunk(
        run_id=run_id,
        seq=row.seq,
        stream=row.stream,
        node_id=row.node_id,
        visit=row.visit,
        item=row.item,
        attempt=row.attempt,
        hedge=bool(row.hedge),
        kind=ChunkKind(row.kind),
        value=value,
        ts=row.ts,
    )


class _Listener:
    """One in-process reader of one run's chunks, fed by the hub on the loop's thread."""

    def __init__(self) -> None:
        self.chunks: collections.deque[Chunk] = collections.deque()
        self.event = asyncio.Event()

    def put(self, chunk: Chunk) -> None:
        self.chunks.append(chunk)
        self.event.set()

    async def wait(self, seconds: float) -> None:
        if not self.chunks:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(seconds):
                    await self.event.wait()
        self.event.clear()


class StreamHub:
    """In-process listeners of the runs an engine drives: chunks reach them as published (S3).

    For each run driven here it knows the last row published (a reader behind
    it reads the store, or waits for the commit); a run with no store keeps
    its rows here while it runs, since no store holds them.
    """

    def __init__(self) -> None:
        self._listeners: dict[str, list[_Listener]] = {}
        #: Callbacks of the runs driven here, called as each row is published.
        self._callbacks: dict[str, list[Callable[[Chunk], object]]] = {}
        #: Runs driven here now, by how many loops (one, but counted to be safe).
        self._live: collections.Counter[str] = collections.Counter()
        self._heads: dict[str, int] = {}
        self._backlog: dict[str, list[Chunk]] = {}

    def live(self, run_id: str) -> bool:
        """Whether this process drives ``run_id`` now (its chunks come through the hub)."""
        return self._live[run_id] > 0

    def head(self, run_id: str) -> int:
        """The ``seq`` of the last row ``run_id`` published here (0: none, or not driven here)."""
        return self._heads.get(run_id, 0)

    @contextlib.contextmanager
    def driving(self, run_id: str) -> Iterator[None]:
        """Mark ``run_id`` driven here while the body runs; its listeners are woken at the end."""
        self._live[run_id] += 1
        try:
            yield
        finally:
            self._live[run_id] -= 1
            if self._live[run_id] <= 0:
                del self._live[run_id]
                self._heads.pop(run_id, None)
                self._backlog.pop(run_id, None)
            for listener in self._listeners.get(run_id, ()):
                listener.event.set()

    def note(self, run_id: str, seq: int) -> None:
        """``run_id`` published row ``seq`` (its head, for readers behind it)."""
        self._heads[run_id] = seq

    def wants(self, run_id: str, *, keep: bool) -> bool:
        """Whether a row of ``run_id`` goes anywhere: a listener, or kept (see :meth:`publish`)."""
        return keep or run_id in self._listeners or run_id in self._callbacks

    def publish(self, chunk: Chunk, *, keep: bool) -> None:
        """Hand ``chunk`` to the listeners of its run (on the event loop's thread); ``keep`` it
        for later listeners while the run is driven here (a run with no store)."""
        run_id = chunk.run_id
        if keep and self.live(run_id):
            self._backlog.setdefault(run_id, []).append(chunk)
        listeners = self._listeners.get(run_id)
        if listeners:
            for listener in listeners:
                listener.put(chunk)
        callbacks = self._callbacks.get(run_id)
        if callbacks:
            for callback in list(callbacks):
                try:
                    callback(chunk)
                except Exception:  # a listener's bug never stops the run: said once, then dropped
                    logger.exception("run %s: a stream listener raised; it is removed", run_id)
                    callbacks.remove(callback)

    @contextlib.contextmanager
    def on_chunk(self, run_id: str, callback: Callable[[Chunk], object]) -> Iterator[None]:
        """Call ``callback(chunk)`` for each row ``run_id`` publishes here while the body runs,
        at the moment it is published (inside the handler's ``stream`` call, on the loop's
        thread), before it is durable."""
        self._callbacks.setdefault(run_id, []).append(callback)
        try:
            yield
        finally:
            callbacks = self._callbacks.get(run_id, [])
            if callback in callbacks:
                callbacks.remove(callback)
            if not callbacks:
                self._callbacks.pop(run_id, None)

    @contextlib.contextmanager
    def listen(self, run_id: str, after: int = 0) -> Iterator[_Listener]:
        """A listener of ``run_id``'s rows past ``after`` published from now on (and those kept)."""
        listener = _Listener()
        for chunk in self._backlog.get(run_id, ()):
            if chunk.seq > after:
                listener.put(chunk)
        self._listeners.setdefault(run_id, []).append(listener)
        try:
            yield listener
        finally:
            listeners = self._listeners[run_id]
            listeners.remove(listener)
            if not listeners:
                del self._listeners[run_id]


#: What each row of a stream says of the attempt that published it (S1): node, visit, map
#: item (None for other nodes), attempt, and whether it is a hedge or backup (T3). A plain
#: tuple: one is built for every chunk.
StreamTags = tuple[str, int, int | None, int, bool]


class StreamBound(enum.Enum):
    """What a stream cursor's bound (``max_chunks``) counts."""

    #: The chunks this cursor let through; marks, and rows stored before it, are not counted.
    CHUNKS = "chunks"
    #: Every row of the run's streams: the stored ones and the terminal marks too.
    ROWS = "rows"


class StreamCursor:
    """A run's stream cursor and how its rows are built: checked, numbered, tagged, marked.

    A chunk is checked at the publishing call (:meth:`encode`: it encodes with
    ``codec``, S4, and the run is within its bound); its row is numbered on the
    event loop's thread (:meth:`on_loop`), in call order, and tagged (S1); each
    stream, the rows of one attempt, ends with one terminal mark (S2). Errors
    name the run as ``owner`` (``run 'r1'``) and an attempt by ``attempts``
    (``{}``: its number or id), and say what ``bound`` counts, then ``hint``
    (how to raise it). Built on the event loop.
    """

    def __init__(
        self,
        run_id: str,
        codec: Codec,
        *,
        owner: str = "run",
        max_chunks: int = MAX_STREAM_CHUNKS,
        bound: StreamBound = StreamBound.CHUNKS,
        hint: str = "",
        attempts: str = "attempt {}",
    ) -> None:
        self.run_id = run_id
        self.codec = codec
        self.max_chunks = max_chunks
        self._owner = owner
        self._bound = bound
        self._hint = hint
        self._attempts = attempts
        #: The last row's seq.
        self.seq = 0
        #: Chunks let through by :meth:`encode`.
        self.count = 0
        self._loop = asyncio.get_running_loop()
        self._thread = threading.get_ident()

    def encode(self, chunk: Any, node_id: str, attempt: object) -> str:
        """``chunk`` encoded (S4) for node ``node_id``'s ``attempt`` (its number or id), if the
        run is within its bound; any thread."""
        try:
            text = self.codec.encode(chunk)
        except (TypeError, ValueError, RecursionError) as exc:
            raise EncodeError(
                f"{self._owner} {self.run_id!r}: stream chunk of node {node_id!r} "
                f"({self._attempts.format(attempt)}) cannot be encoded: {exc}"
            ) from exc
        used = self.count if self._bound is StreamBound.CHUNKS else self.seq
        if used >= self.max_chunks:
            raise StreamLimit(
                f"{self._owner} {self.run_id!r}: node {node_id!r} "
                f"({self._attempts.format(attempt)}) published more than {self.max_chunks} "
                f"stream {self._bound.value}, the {self._owner}'s bound{self._hint}"
            )
        self.count += 1
        return text

    def on_loop(self, call: Callable[[*_Ts], object], *args: *_Ts) -> None:
        """``call(*args)`` on the event loop's thread, where rows are numbered: now when
        called there, else soon (from a sync handler's or node's thread), in call order."""
        if threading.get_ident() == self._thread:
            call(*args)
        else:
            self._loop.call_soon_threadsafe(call, *args)

    def chunk(self, stream: int | None, tags: StreamTags, text: str, ts: float) -> ChunkRow:
        """The next row: chunk ``text`` of ``stream`` (None: this row opens it) published at
        ``ts``; its ``stream`` is the seq of the stream's first chunk."""
        first = self.seq + 1 if stream is None else stream
        return self._row(first, tags, ChunkKind.CHUNK, text, ts)

    def mark(self, stream: int, tags: StreamTags, *, accepted: bool) -> ChunkRow:
        """The next row: ``stream``'s terminal mark, ``accepted`` or ``discarded`` (S2)."""
        kind = ChunkKind.ACCEPTED if accepted else ChunkKind.DISCARDED
        return self._row(stream, tags, kind, None, time.time())

    def reopen(self, head: StreamHead) -> list[ChunkRow]:
        """Continue after the stored rows of ``head``: the ``discarded`` marks of the streams it
        holds open (their attempts were cut), numbered next."""
        self.seq = max(self.seq, head.last_seq)
        marks = []
        for first in head.open:
            self.seq += 1
            marks.append(
                first._replace(
                    seq=self.seq, kind=ChunkKind.DISCARDED.value, data_json=None, ts=time.time()
                )
            )
        return marks

    def _row(
        self, stream: int, tags: StreamTags, kind: ChunkKind, text: str | None, ts: float
    ) -> ChunkRow:
        self.seq += 1
        node_id, visit, item, attempt, hedge = tags
        return ChunkRow(
            self.seq, stream, node_id, visit, item, attempt, int(hedge), kind.value, text, ts
        )


class Streams:
    """One run's stream buffer: each attempt's stream and its mark, rows to commit and publish.

    ``codec`` encodes chunks (S4) and ``max_chunks`` bounds how many the run
    publishes, through its :class:`StreamCursor`; ``hub`` gets each chunk as
    it is published; ``durable`` keeps rows for the writer (:meth:`take`);
    ``poke`` wakes the run loop so buffered rows are staged even while
    nothing completes.
    """

    def __init__(
        self,
        run_id: str,
        node_ids: tuple[str, ...],
        codec: Codec,
        hub: StreamHub | None,
        *,
        durable: bool,
        poke: Callable[[], None],
        max_chunks: int = MAX_STREAM_CHUNKS,
    ) -> None:
        self.run_id = run_id
        self._ids = node_ids
        self._hub = hub
        self._durable = durable
        self._poke = poke
        #: Numbers and tags the rows; refuses what does not encode or passes the bound.
        self.cursor = StreamCursor(
            run_id, codec, max_chunks=max_chunks, hint=" (Engine(max_stream_chunks=))"
        )
        #: Streams with no terminal mark yet (the run loop looks only when some are open).
        self.open = 0
        self._rows: list[ChunkRow] = []
        self._plain = isinstance(codec, JsonCodec)

    @property
    def seq(self) -> int:
        """The run's stream cursor: the last row's seq."""
        return self.cursor.seq

    # -- the handler's side (NodeContext.stream) --------------------------------

    def publish(self, attempt: Attempt, tries: int, chunk: Any) -> None:
        """Encode ``chunk`` now and publish it for try ``tries`` of ``attempt`` (S1, S4); any
        thread (the try is the handler's own: a thread may outlive its try)."""
        text = self.cursor.encode(chunk, self._ids[attempt.index], tries)
        value = chunk if self._plain and type(chunk) in _SCALARS else _DECODE
        self.cursor.on_loop(self._add, attempt, tries, text, value)

    def _add(self, attempt: Attempt, tries: int, text: str, value: Any) -> None:
        if tries != attempt.tries or (attempt.finished and attempt.stream is None):
            # A thread the engine cannot stop streams on after its try ended (timed out,
            # cancelled, retried): that try's stream has its mark, so the chunk is dropped.
            return
        if attempt.stream is None:
            self.open += 1
        row = self.cursor.chunk(attempt.stream, self._tags(attempt, tries), text, time.time())
        attempt.stream = row.stream
        self._append(row, value)

    # -- the run loop's side ----------------------------------------------------

    def end(self, attempt: Attempt, *, accepted: bool, tries: int | None = None) -> None:
        """Give ``attempt``'s stream its terminal mark, once; nothing if it never streamed (S2)."""
        stream = attempt.stream
        if stream is None:
            return
        attempt.stream = None
        self.open -= 1
        tags = self._tags(attempt, attempt.tries if tries is None else tries)
        self._append(self.cursor.mark(stream, tags, accepted=accepted), None)

    def reopen(self, head: StreamHead) -> None:
        """Continue after the stored rows of ``head``; mark the cut attempts' streams discarded."""
        for mark in self.cursor.reopen(head):
            self._append(mark, None)

    @property
    def waiting(self) -> bool:
        """Whether rows are buffered for the next stage (readers elsewhere wait for its commit)."""
        return bool(self._rows)

    def take(self) -> list[ChunkRow]:
        """The rows buffered since the last call, for the writer's next stage."""
        rows, self._rows = self._rows, []
        return rows

    def _tags(self, attempt: Attempt, tries: int) -> StreamTags:
        item = None if attempt.item < 0 else attempt.item
        return (self._ids[attempt.index], attempt.visit, item, tries, attempt.hedge)

    def _append(self, row: ChunkRow, value: Any) -> None:
        """Buffer ``row`` for the writer and hand it to the hub (``value``: as it reads back)."""
        durable = self._durable
        if durable:
            if not self._rows:
                self._poke()  # staged with the next harvest, even if nothing completes
            self._rows.append(row)
        hub = self._hub
        if hub is not None:
            hub.note(self.run_id, row.seq)
            if hub.wants(self.run_id, keep=not durable):
                hub.publish(chunk_of(self.run_id, row, self.cursor.codec, value), keep=not durable)


async def read_stream(
    store: RunStore | None, codec: Codec, hub: StreamHub, run_id: str, after: int
) -> AsyncIterator[Chunk]:
    """``Engine.stream``: the rows of ``run_id`` after cursor ``after``, in order, until it ends.

    While this process drives the run, rows come from the hub as they are
    published; otherwise from the store, woken by its change feed. A gap in
    what the hub delivered (rows published before the reader listened) is
    filled from the store, and rows at or below the cursor are skipped, so a
    reader sees each row once. The run ends when its stored status is
    completed, failed or cancelled and every row it committed was read. An
    unknown run raises :class:`~tailrace.RunNotFound`, with a store or without
    (then a run this process does not drive now is unknown).
    """
    cursor = after
    with hub.listen(run_id, after) as local:
        if store is None:  # an engine without a store: only what its own runs publish
            if not hub.live(run_id) and not local.chunks:
                raise RunNotFound(
                    f"no run {run_id!r} driven by this engine (it has no store: only the runs "
                    "it drives now can be read)"
                )
            while hub.live(run_id) or local.chunks:
                while local.chunks:
                    chunk = local.chunks.popleft()
                    if chunk.seq > cursor:
                        cursor = chunk.seq
                        yield chunk
                await local.wait(FALLBACK)
            return
        async with store.changes() as feed:
            stale = True  # the store may hold rows past the cursor
            while True:
                while local.chunks and local.chunks[0].seq <= cursor + 1:
                    chunk = local.chunks.popleft()
                    if chunk.seq == cursor + 1:
                        cursor = chunk.seq
                        yield chunk
                live = hub.live(run_id)
                # Published here before this reader listened: in the store, or soon.
                behind = cursor < hub.head(run_id)
                if stale or behind or not live:
                    rows = await _stored_rows(store, hub, run_id, cursor)
                    for row in rows:
                        if row.seq > cursor:
                            cursor = row.seq
                            yield chunk_of(run_id, row, codec)
                    if rows:
                        continue
                    stale = False
                    if live and behind:  # not committed yet: its commit wakes the feed
                        await feed.wait(FALLBACK)
                        continue
                if live:
                    await local.wait(FALLBACK)
                    continue
                record = await store.get_run(run_id)
                if record.status in TERMINAL_STATUSES:
                    rows = await store.chunks(run_id, after=cursor, limit=READ_BATCH)
                    if not rows:
                        return
                    for row in rows:
                        cursor = row.seq
                        yield chunk_of(run_id, row, codec)
                    continue
                await feed.wait(FALLBACK)


async def _stored_rows(store: RunStore, hub: StreamHub, run_id: str, after: int) -> list[ChunkRow]:
    """The stored rows of ``run_id`` after ``after``; none yet for a run starting here."""
    try:
        return await store.chunks(run_id, after=after, limit=READ_BATCH)
    except RunNotFound:
        if hub.live(run_id):
            return []  # driven here, not stored yet: its chunks come through the hub
        raise
