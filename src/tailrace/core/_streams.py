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
from typing import TYPE_CHECKING, Any

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


class Streams:
    """One run's stream buffer: numbering, tags, the bound, terminal marks, rows to commit.

    ``codec`` encodes chunks (S4); ``hub`` gets each chunk as it is published;
    ``durable`` keeps rows for the writer (:meth:`take`); ``poke`` wakes the
    run loop so buffered rows are staged even while nothing completes.
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
        self._codec = codec
        self._hub = hub
        self._durable = durable
        self._poke = poke
        self.max_chunks = max_chunks
        #: The run's stream cursor: the last row's seq.
        self.seq = 0
        #: Chunks published in this run (marks not counted), against ``max_chunks``.
        self.count = 0
        #: Streams with no terminal mark yet (the run loop looks only when some are open).
        self.open = 0
        self._rows: list[ChunkRow] = []
        self._plain = isinstance(codec, JsonCodec)
        self._loop = asyncio.get_running_loop()
        self._thread = threading.get_ident()

    # -- the handler's side (NodeContext.stream) --------------------------------

    def publish(self, attempt: Attempt, tries: int, chunk: Any) -> None:
        """Encode ``chunk`` now and publish it for try ``tries`` of ``attempt`` (S1, S4); any
        thread (the try is the handler's own: a thread may outlive its try)."""
        node_id = self._ids[attempt.index]
        try:
            text = self._codec.encode(chunk)
        except (TypeError, ValueError, RecursionError) as exc:
            raise EncodeError(
                f"run {self.run_id!r}: stream chunk of node {node_id!r} "
                f"(attempt {tries}) cannot be encoded: {exc}"
            ) from exc
        if self.count >= self.max_chunks:
            raise StreamLimit(
                f"run {self.run_id!r}: node {node_id!r} (attempt {tries}) published more than "
                f"{self.max_chunks} stream chunks, the run's bound (Engine(max_stream_chunks=))"
            )
        self.count += 1
        value = chunk if self._plain and type(chunk) in _SCALARS else _DECODE
        if threading.get_ident() == self._thread:
            self._add(attempt, tries, text, value)
        else:  # a sync handler on a thread: rows are numbered on the loop, in call order
            self._loop.call_soon_threadsafe(self._add, attempt, tries, text, value)

    def _add(self, attempt: Attempt, tries: int, text: str, value: Any) -> None:
        if tries != attempt.tries or (attempt.finished and attempt.stream is None):
            # A thread the engine cannot stop streams on after its try ended (timed out,
            # cancelled, retried): that try's stream has its mark, so the chunk is dropped.
            return
        if attempt.stream is None:
            attempt.stream = self.seq + 1
            self.open += 1
        self._row(attempt.stream, attempt, tries, ChunkKind.CHUNK, text, value)

    # -- the run loop's side ----------------------------------------------------

    def end(self, attempt: Attempt, *, accepted: bool, tries: int | None = None) -> None:
        """Give ``attempt``'s stream its terminal mark, once; nothing if it never streamed (S2)."""
        stream = attempt.stream
        if stream is None:
            return
        attempt.stream = None
        self.open -= 1
        kind = ChunkKind.ACCEPTED if accepted else ChunkKind.DISCARDED
        self._row(stream, attempt, attempt.tries if tries is None else tries, kind, None, None)

    def reopen(self, head: StreamHead) -> None:
        """Continue after the stored rows of ``head``; mark the cut attempts' streams discarded."""
        self.seq = max(self.seq, head.last_seq)
        for first in head.open:
            mark = first._replace(
                seq=self.seq + 1, kind=ChunkKind.DISCARDED.value, data_json=None, ts=time.time()
            )
            self._append(mark, None)

    @property
    def waiting(self) -> bool:
        """Whether rows are buffered for the next stage (readers elsewhere wait for its commit)."""
        return bool(self._rows)

    def take(self) -> list[ChunkRow]:
        """The rows buffered since the last call, for the writer's next stage."""
        rows, self._rows = self._rows, []
        return rows

    def _row(
        self,
        stream: int,
        attempt: Attempt,
        tries: int,
        kind: ChunkKind,
        text: str | None,
        value: Any,
    ) -> None:
        item = None if attempt.item < 0 else attempt.item
        node_id = self._ids[attempt.index]
        row = ChunkRow(
            self.seq + 1, stream, node_id, attempt.visit, item, tries, int(attempt.hedge),
            kind.value, text, time.time(),
        )  # fmt: skip
        self._append(row, value)

    def _append(self, row: ChunkRow, value: Any) -> None:
        """Buffer ``row`` for the writer and hand it to the hub (``value``: as it reads back)."""
        self.seq = row.seq
        durable = self._durable
        if durable:
            if not self._rows:
                self._poke()  # staged with the next harvest, even if nothing completes
            self._rows.append(row)
        hub = self._hub
        if hub is not None:
            hub.note(self.run_id, row.seq)
            if hub.wants(self.run_id, keep=not durable):
                hub.publish(chunk_of(self.run_id, row, self._codec, value), keep=not durable)


async def read_stream(
    store: RunStore | None, codec: Codec, hub: StreamHub, run_id: str, after: int
) -> AsyncIterator[Chunk]:
    """``Engine.stream``: the rows of ``run_id`` after cursor ``after``, in order, until it ends.

    While this process drives the run, rows come from the hub as they are
    published; otherwise from the store, woken by its change feed. A gap in
    what the hub delivered (rows published before the reader listened) is
    filled from the store, and rows at or below the cursor are skipped, so a
    reader sees each row once. The run ends when its stored status is
    completed, failed or cancelled and every row it committed was read.
    """
    cursor = after
    with hub.listen(run_id, after) as local:
        if store is None:  # an engine without a store: only what its own runs publish
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
