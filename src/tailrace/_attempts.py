"""Every node attempt of a run, derived from its durable events (no I/O of its own).

Both the terminal timeline (``tailrace show``) and the dashboard's Gantt
(``tailrace ui``) draw what :func:`attempts_from_events` returns, so they
never disagree on how an attempt ended:

- a ``node_started`` opens an attempt; ``node_completed``, ``node_failed`` and
  ``node_cancelled`` close it (E9, E11);
- each ``node_retrying`` closes one try as ``retried`` and the next try starts
  after its backoff (E11), so every try is a segment of its own;
- a ``node_started`` with ``hedge`` is a backup attempt (T3); the first of the
  rivals to complete wins and the others end ``lost`` at that moment;
- ``node_straggler`` marks the running attempt it flagged (T3);
- a gate's attempt ends when its question opens (``asked``) and a ``waiting``
  segment runs until the answer is applied (Q1, Q3);
- a run that suspends to wait for its child runs (``run_suspended`` with
  reason ``children``, R4) ends the attempts it stopped ``suspended``, and a
  ``children`` segment of each runs until the run is woken (``run_resumed``):
  the node's next try re-attaches to its child, nothing was cut;
- an item or input cancelled to be parked (``node_cancelled`` with reason
  ``parked``, P3) ends ``parked``: a later run can continue it;
- the end of a run (``run_cancelled``, ``run_failed``, ``run_completed``)
  ends what is still running or waiting as ``cancelled``;
- an attempt still open when the run was resumed was cut by a crash or a stop:
  it ends ``cut`` at the last thing known of it: the last event its process
  committed before the resume, or later its last checkpoint or stream chunk
  (D3, P1, S1; see :func:`last_known`); the re-run is the next try, as its events number it (a run stored
  before re-runs were numbered so has its re-runs numbered on from the cut
  tries here); a retry's next try cut while it still waited out its backoff
  had not started: its re-run keeps its number and it is not drawn twice;
- a ``node_late_input`` marks the completed attempt of its source as ``late``
  (E5);
- the items of a map node (M2) are segments of their own, keyed by their
  ``item`` index (which every item event carries), next to the map's own
  segment from its expansion to its decision.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol


class EventRow(Protocol):
    """The fields of a stored event this module reads (``tailrace.stores.EventRow`` has them)."""

    @property
    def seq(self) -> int: ...
    @property
    def type(self) -> str: ...
    @property
    def node_id(self) -> str | None: ...
    @property
    def visit(self) -> int | None: ...
    @property
    def attempt(self) -> int | None: ...
    @property
    def ts(self) -> float: ...
    @property
    def data_json(self) -> str: ...


class CheckpointRow(Protocol):
    """The fields of a stored checkpoint this module reads (``tailrace.stores.CheckpointRow``)."""

    @property
    def node_id(self) -> str: ...
    @property
    def visit(self) -> int: ...
    @property
    def item(self) -> int: ...
    @property
    def attempt(self) -> int: ...
    @property
    def saved_at(self) -> float: ...


class ChunkRow(Protocol):
    """The fields of a stored stream row this module reads (``tailrace.stores.ChunkRow``)."""

    @property
    def seq(self) -> int: ...
    @property
    def node_id(self) -> str: ...
    @property
    def visit(self) -> int: ...
    @property
    def item(self) -> int | None: ...
    @property
    def attempt(self) -> int: ...
    @property
    def kind(self) -> str: ...
    @property
    def ts(self) -> float: ...


#: An attempt as the store numbers it: node id, visit, map item (else None) and try.
#: A hedge shares its rival's try number, so what is known of one counts for both.
SeenKey = tuple[str, int | None, int | None, int]


class Outcome(enum.StrEnum):
    """How one node attempt (or try, or wait) ended."""

    COMPLETED = "completed"
    FAILED = "failed"
    RETRIED = "retried"
    CANCELLED = "cancelled"
    LOST = "lost"
    CUT = "cut"
    RUNNING = "running"
    ASKED = "asked"
    WAITING = "waiting"
    #: Stopped when its run suspended to wait for its child runs (R4); not cut.
    SUSPENDED = "suspended"
    #: A node's wait for its child runs while its run was suspended (R4).
    CHILDREN = "children"
    #: Cancelled to be parked with its checkpoint (P3): a later run can continue it.
    PARKED = "parked"


@dataclass(frozen=True, slots=True, kw_only=True)
class Attempt:
    """One segment of a node visit on the timeline.

    ``attempt`` is the try number the events carry (None for waits);
    ``hedge`` marks a backup attempt; ``straggler_at`` is when the attempt was
    flagged a straggler (wall clock), if it was; ``late`` marks a completion
    that arrived after its aggregate had fired; ``error`` is the failure text
    of a failed or retried try.
    """

    node_id: str
    visit: int | None
    attempt: int | None
    start: float
    end: float
    outcome: Outcome
    hedge: bool = False
    straggler_at: float | None = None
    late: bool = False
    error: str | None = None
    #: The item index of a map item's segment (M2), None for a node's.
    item: int | None = None
    #: How many items of a map's visit this one segment stands for (see :func:`fold_items`).
    folded: int = 0

    @property
    def label(self) -> str:
        """``node#visit`` (``node#visit[item]`` for a map's item), as both timelines label a row."""
        if self.folded:
            return f"{self.node_id}#{self.visit}[{self.folded} more items]"
        if self.item is not None:
            return f"{self.node_id}#{self.visit}[{self.item}]"
        return f"{self.node_id}#{self.visit}"

    @property
    def duration(self) -> float:
        """Seconds from start to end."""
        return self.end - self.start


@dataclass(slots=True)
class _Open:
    """An attempt that has started and not ended yet."""

    start: float
    attempt: int | None
    hedge: bool
    straggler_at: float | None = None
    #: False for a retry's next try until an event shows it ran (it waits out its backoff).
    started: bool = True


#: A segment's row: node id, visit, and the item of a map's item (else None).
_Key = tuple[str, int | None, int | None]


@dataclass(slots=True)
class _Walk:
    """The fold over the event log: open attempts, open waits, finished segments."""

    open: dict[_Key, list[_Open]] = field(default_factory=dict)
    waiting: dict[_Key, float] = field(default_factory=dict)
    #: Node visits waiting for their child runs while the run is suspended (R4), since when.
    children: dict[_Key, float] = field(default_factory=dict)
    done: list[Attempt] = field(default_factory=list)
    #: The highest try of a visit cut by a crash or a stop, until its re-run starts.
    cut_tries: dict[_Key, int] = field(default_factory=dict)
    #: Added to the try numbers events carry: re-runs stored under their cut try's number.
    offset: dict[_Key, int] = field(default_factory=dict)
    #: Cut tries that had not started (a retry's backoff), with where they were cut.
    held: dict[_Key, tuple[_Open, float]] = field(default_factory=dict)
    #: When the last event so far was committed (a cut attempt ends there at the earliest).
    last_ts: float | None = None
    #: The latest time known of each attempt besides its events (see :func:`last_known`).
    seen: Mapping[SeenKey, float] = field(default_factory=dict)

    def number(self, key: _Key, attempt: int | None) -> int | None:
        """The try number of ``attempt`` (as an event carries it) across resumes."""
        return None if attempt is None else attempt + self.offset.get(key, 0)

    def rerun(self, key: _Key, attempt: int | None) -> int | None:
        """The try number of a ``node_started`` carrying ``attempt``: after a cut try, the next."""
        cut = self.cut_tries.pop(key, None)
        if cut is not None and attempt is not None:
            self.offset[key] = max(0, cut - attempt + 1)
        tries = self.number(key, attempt)
        held = self.held.pop(key, None)
        if held is not None and held[0].attempt != tries:  # it was another try: it was cut
            self.close(key, held[0], held[1], Outcome.CUT)
        return tries

    def cut_end(self, key: _Key, item: _Open, end: float) -> float:
        """Where ``item`` cut at ``end`` is drawn to: the last thing known of it, if later."""
        if item.attempt is None:
            return max(end, item.start)
        stored = item.attempt - self.offset.get(key, 0)  # the try number its rows carry
        return max(end, item.start, self.seen.get((*key, stored), end))

    def cut(self, end: float) -> None:
        """A resume: every open attempt was cut where its process last committed."""
        for key in list(self.open):
            items = self.open.pop(key)
            for item in items:
                if not item.started and not item.hedge:
                    self.held[key] = (item, max(end, item.start))
                    continue
                self.close(key, item, self.cut_end(key, item, end), Outcome.CUT)
                tries = item.attempt or 1
                self.cut_tries[key] = max(self.cut_tries.get(key, 0), tries)

    def release_held(self) -> None:
        """Cut tries that had not started and were not re-run under their number: drawn cut."""
        for key, (item, end) in self.held.items():
            self.close(key, item, end, Outcome.CUT)
        self.held.clear()

    def close(self, key: _Key, item: _Open, end: float, outcome: Outcome, **extra: Any) -> None:
        self.done.append(
            Attempt(
                node_id=key[0], visit=key[1], attempt=item.attempt, start=item.start, end=end,
                outcome=outcome, hedge=item.hedge, straggler_at=item.straggler_at, item=key[2],
                **extra,
            )
        )  # fmt: skip

    def close_all(self, key: _Key, end: float, first: Outcome, rest: Outcome, **extra: Any) -> None:
        """Close every open attempt of ``key``: the main one as ``first``, rivals as ``rest``."""
        items = self.open.pop(key, [])
        for n, item in enumerate(items):
            self.close(key, item, end, first if n == 0 else rest, **(extra if n == 0 else {}))

    def close_wait(self, key: _Key, end: float, outcome: Outcome) -> None:
        start = self.waiting.pop(key, None)
        if start is not None:
            self.done.append(
                Attempt(node_id=key[0], visit=key[1], attempt=None, start=start, end=end,
                        outcome=outcome, item=key[2])
            )  # fmt: skip

    def suspend(self, ts: float) -> None:
        """The run suspended for its child runs: what ran stopped there, and waits (R4)."""
        for key in list(self.open):
            self.close_all(key, ts, Outcome.SUSPENDED, Outcome.SUSPENDED)
            self.children[key] = ts

    def wake(self, end: float, outcome: Outcome = Outcome.CHILDREN) -> None:
        """The suspended run was woken (or ended): every wait for children ends at ``end``."""
        for key, start in self.children.items():
            self.done.append(
                Attempt(node_id=key[0], visit=key[1], attempt=None, start=start,
                        end=max(end, start), outcome=outcome, item=key[2])
            )  # fmt: skip
        self.children.clear()


def event_data(event: EventRow) -> dict[str, Any]:
    """The event's data as a dict; ``{}`` when it does not decode to one."""
    try:
        data = json.loads(event.data_json)
    except (TypeError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def attempts_from_events(
    events: Sequence[EventRow],
    *,
    live: bool = True,
    now: float | None = None,
    seen: Mapping[SeenKey, float] | None = None,
) -> list[Attempt]:
    """Every attempt, try and wait of a run, sorted by start then label.

    Args:
        events: the run's durable events, in ``seq`` order.
        live: whether the run may still be running: attempts still open at the
            end are then ``running`` and end at ``now``; otherwise (a finished
            or orphaned run) nothing will close them and they are ``cut`` at
            the last event.
        now: where running attempts (when ``live``) and open waits end (a
            suspended run still waits now); the last event's time when None.
        seen: the latest time known of each attempt besides its events (from
            :func:`last_known`): a cut attempt is drawn up to it when it is
            later than the last event its process committed.
    """
    walk = _Walk(seen=seen or {})
    for event in events:
        _step(walk, event)
        walk.last_ts = event.ts
    walk.release_held()
    last = max((e.ts for e in events), default=0.0)
    # Running attempts and open waits go on until now; a cut attempt ended at the last commit.
    end = now if now is not None and live else last
    for key, items in walk.open.items():
        for item in items:
            if live:
                walk.close(key, item, max(end, item.start), Outcome.RUNNING)
            else:
                walk.close(key, item, walk.cut_end(key, item, end), Outcome.CUT)
    wait_end = now if now is not None else last
    walk.wake(wait_end)  # still suspended: the children are waited for until now
    for key, start in walk.waiting.items():
        walk.done.append(
            Attempt(node_id=key[0], visit=key[1], attempt=None, start=start,
                    end=max(wait_end, start), outcome=Outcome.WAITING, item=key[2])
        )  # fmt: skip
    attempts = _mark_late(walk.done, events)
    return sorted(attempts, key=lambda a: (a.start, a.label, a.hedge, a.attempt or 0))


#: Stream rows read per page when looking for the last chunk of cut attempts.
CHUNK_PAGE = 1000

#: Reads a run's stream rows after a ``seq``, at most a ``limit`` (``RunStore.chunks``).
ChunkReader = Callable[[int, int], Awaitable[Sequence[ChunkRow]]]


async def last_known(
    attempts: Sequence[Attempt], checkpoints: Iterable[CheckpointRow], read_chunks: ChunkReader
) -> dict[SeenKey, float]:
    """The latest time known of each attempt besides its events, for :func:`attempts_from_events`.

    That is its last checkpoint's ``saved_at`` (P1) and its last stream chunk's
    time (S1): a process cut by a crash may have saved or streamed after the
    last event it committed. Stream rows are read only when ``attempts`` (from
    :func:`attempts_from_events` without ``seen``) has a cut one, and only
    those of a cut attempt's node visit are kept; a ``discarded`` mark is
    written at the resume, so it is not something known of the attempt.

    Args:
        attempts: the run's attempts as drawn from its events alone.
        checkpoints: the run's checkpoint rows (``StoredRun.checkpoints``).
        read_chunks: reads stream rows: ``read_chunks(after, limit)``.
    """
    known: dict[SeenKey, float] = {}
    for c in checkpoints:
        _later(known, (c.node_id, c.visit, None if c.item < 0 else c.item, c.attempt), c.saved_at)
    cut = {(a.node_id, a.visit, a.item) for a in attempts if a.outcome is Outcome.CUT}
    if not cut:
        return known
    after = 0
    while page := await read_chunks(after, CHUNK_PAGE):
        for r in page:
            if r.kind == "chunk" and (r.node_id, r.visit, r.item) in cut:
                _later(known, (r.node_id, r.visit, r.item, r.attempt), r.ts)
        after = page[-1].seq
    return known


def _later(known: dict[SeenKey, float], key: SeenKey, ts: float) -> None:
    known[key] = max(ts, known.get(key, ts))


def _step(walk: _Walk, e: EventRow) -> None:
    if e.type == "run_resumed":
        walk.wake(e.ts)
        walk.cut(walk.last_ts if walk.last_ts is not None else e.ts)
        return
    if e.type == "run_suspended" and event_data(e).get("reason") == "children":
        walk.suspend(e.ts)
        return
    if e.type in _RUN_ENDS:  # nothing still running or waiting goes on once the run ended
        for still in list(walk.open):
            walk.close_all(still, e.ts, Outcome.CANCELLED, Outcome.CANCELLED)
        for waits in list(walk.waiting):
            walk.close_wait(waits, e.ts, Outcome.CANCELLED)
        walk.wake(e.ts, Outcome.CANCELLED)
        return
    if e.node_id is None:
        return
    data = event_data(e)
    item = data.get("item")
    key: _Key = (e.node_id, e.visit, item if isinstance(item, int) else None)
    if e.type == "node_started":
        hedge = bool(data.get("hedge"))
        walk.open.setdefault(key, []).append(_Open(e.ts, walk.rerun(key, e.attempt), hedge))
    elif e.type == "node_retrying":
        _retry(walk, key, e, data)
    elif e.type == "node_straggler":
        for item in walk.open.get(key, []):
            if not item.hedge and item.straggler_at is None:
                item.straggler_at = e.ts
    elif e.type == "node_completed":
        _complete(walk, key, e, data)
    elif e.type == "node_failed":
        error = data.get("error")
        walk.close_all(key, e.ts, Outcome.FAILED, Outcome.LOST, error=_text(error))
    elif e.type == "node_cancelled":
        ended = Outcome.PARKED if data.get("reason") == "parked" else Outcome.CANCELLED
        walk.close_all(key, e.ts, ended, ended)
        walk.close_wait(key, e.ts, Outcome.CANCELLED)
    elif e.type == "question_opened":
        walk.close_all(key, e.ts, Outcome.ASKED, Outcome.LOST)
        walk.waiting[key] = e.ts
    elif e.type == "question_answered":
        walk.close_wait(key, e.ts, Outcome.WAITING)


#: Events that end a run: a segment still open then ends there.
_RUN_ENDS = ("run_cancelled", "run_failed", "run_completed")


def _retry(walk: _Walk, key: _Key, e: EventRow, data: dict[str, Any]) -> None:
    """Try ``e.attempt`` failed: close it and open the next try after the backoff (E11)."""
    items = walk.open.get(key)
    if not items:
        return
    item = next((i for i in items if not i.hedge), items[0])
    walk.close(key, item, e.ts, Outcome.RETRIED, error=_text(data.get("error")))
    delay = data.get("delay")
    wait = float(delay) if isinstance(delay, int | float) and delay > 0 else 0.0
    tries = walk.number(key, e.attempt) or item.attempt or 1
    items[items.index(item)] = _Open(
        e.ts + wait, tries + 1, item.hedge, item.straggler_at, started=False
    )


def _complete(walk: _Walk, key: _Key, e: EventRow, data: dict[str, Any]) -> None:
    """The winner completed; rivals still running lost the race (T3)."""
    items = walk.open.pop(key, [])
    if not items:
        return
    hedge = bool(data.get("hedge"))
    winner = next((i for i in items if i.hedge == hedge), items[0])
    for item in items:
        walk.close(key, item, e.ts, Outcome.COMPLETED if item is winner else Outcome.LOST)


def _mark_late(done: list[Attempt], events: Sequence[EventRow]) -> list[Attempt]:
    """Mark the completion of each late input's source (emitted in the same harvest, E5),
    or of each late item of a map (M5)."""
    marked = list(done)
    for e in events:
        if e.type != "node_late_input":
            continue
        data = event_data(e)
        source, item = data.get("source"), data.get("item")
        candidates = [
            n
            for n, a in enumerate(marked)
            if a.node_id == source
            and a.item == item
            and a.outcome is Outcome.COMPLETED
            and a.end <= e.ts
        ]
        if candidates:
            n = max(candidates, key=lambda k: marked[k].end)
            marked[n] = replace(marked[n], late=True)
    return marked


def _text(value: object) -> str | None:
    return None if value is None else str(value)


# -- hedging: a run's backups and its budget (T3, T5) ----------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class HedgeAccount:
    """A run's backups as its events record them (T3, T5).

    ``started`` counts backups and clones started (``node_hedged``), ``won``
    the completions a backup won, ``refused`` the stragglers whose backup the
    budget refused (``node_hedge_refused``); ``budget`` is the share of
    attempts started the hedge policy allows as extra attempts, None when the
    backups were unbudgeted (no hedge policy).
    """

    started: int
    won: int
    refused: int
    budget: float | None

    def describe(self) -> str:
        """One line: ``3 started (2 won), 1 refused by the budget of 5% of attempts started``.

        >>> HedgeAccount(started=3, won=2, refused=1, budget=0.05).describe()
        '3 started (2 won), 1 refused by the budget of 5% of attempts started'
        >>> HedgeAccount(started=1, won=1, refused=0, budget=None).describe()
        '1 started (1 won), unbudgeted (no hedge policy)'
        """
        head = f"{self.started} started ({self.won} won)"
        if self.budget is None:
            return f"{head}, unbudgeted (no hedge policy)"
        return (
            f"{head}, {self.refused} refused by the budget of {self.budget:.0%} of attempts started"
        )


def hedge_account(events: Sequence[EventRow]) -> HedgeAccount | None:
    """The :class:`HedgeAccount` of a run from its ``events``; None when it raced no backup."""
    started = won = refused = 0
    budget: float | None = None
    for e in events:
        if e.type not in ("node_hedged", "node_hedge_refused", "node_completed"):
            continue
        data = event_data(e)
        if e.type == "node_completed":
            won += data.get("hedge") is True
            continue
        started += e.type == "node_hedged"
        refused += e.type == "node_hedge_refused"
        share = data.get("budget")
        if isinstance(share, int | float) and not isinstance(share, bool):
            budget = float(share)
    if not started and not refused:
        return None
    return HedgeAccount(started=started, won=won, refused=refused, budget=budget)


# -- map nodes: their items summarised and folded (M2) ------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class MapSummary:
    """One visit of a map node: its items by outcome, its winners and its slowest items.

    ``k`` and ``winners`` are None until the map is decided; ``slowest`` lists
    up to three (item, seconds) pairs, the longest item segments first.
    """

    node_id: str
    visit: int | None
    items: int
    k: int | None
    winners: tuple[int, ...] | None
    completed: int
    late: int
    failed: int
    cancelled: int
    running: int
    slowest: tuple[tuple[int, float], ...]
    #: Items parked with their checkpoint (P3), apart from those cancelled.
    parked: int = 0


def map_summaries(events: Sequence[EventRow], attempts: Sequence[Attempt]) -> list[MapSummary]:
    """A :class:`MapSummary` per map visit in ``events`` (the map's own start carries ``items``),
    counting its item segments in ``attempts`` (from :func:`attempts_from_events`)."""
    sizes: dict[tuple[str, int | None], int] = {}
    decided: dict[tuple[str, int | None], list[int]] = {}
    for e in events:
        if e.node_id is None or e.type not in ("node_started", "node_completed"):
            continue
        data = event_data(e)
        if e.type == "node_started" and isinstance(data.get("items"), int):
            sizes[(e.node_id, e.visit)] = data["items"]
        elif e.type == "node_completed" and isinstance(data.get("winners"), list):
            decided[(e.node_id, e.visit)] = [w for w in data["winners"] if isinstance(w, int)]
    out = []
    for key, size in sizes.items():
        last: dict[int, Attempt] = {}
        longest: dict[int, float] = {}
        for a in attempts:
            if (a.node_id, a.visit) == key and a.item is not None:
                last[a.item] = a  # the segments are sorted by start: the last one ended the item
                longest[a.item] = max(longest.get(a.item, 0.0), a.duration)
        ended = [a for a in last.values()]
        winners = decided.get(key)
        completed = sum(a.outcome is Outcome.COMPLETED and not a.late for a in ended)
        out.append(
            MapSummary(
                node_id=key[0], visit=key[1], items=size,
                k=None if winners is None else len(winners),
                winners=None if winners is None else tuple(winners),
                completed=completed,
                late=sum(a.outcome is Outcome.COMPLETED and a.late for a in ended),
                failed=sum(a.outcome is Outcome.FAILED for a in ended),
                cancelled=sum(a.outcome is Outcome.CANCELLED for a in ended),
                running=sum(a.outcome is Outcome.RUNNING for a in ended),
                slowest=tuple(sorted(longest.items(), key=lambda kv: (-kv[1], kv[0]))[:3]),
                parked=sum(a.outcome is Outcome.PARKED for a in ended),
            )
        )  # fmt: skip
    return out


def fold_items(attempts: Sequence[Attempt], *, keep: int) -> list[Attempt]:
    """``attempts`` with each map visit's item segments cut to its ``keep`` slowest items.

    The other items of that visit become one segment (``folded`` = how many
    items it stands for) spanning them, ending the way most of them ended, so
    a 10,000-item map draws a screenful of rows and keeps its stragglers.
    """
    longest: dict[tuple[str, int | None], dict[int, float]] = {}
    for a in attempts:
        if a.item is not None:
            per = longest.setdefault((a.node_id, a.visit), {})
            per[a.item] = max(per.get(a.item, 0.0), a.duration)
    kept: dict[tuple[str, int | None], set[int]] = {}
    for key, per in longest.items():
        if len(per) > keep:
            ranked = sorted(per, key=lambda j: (-per[j], j))
            kept[key] = set(ranked[:keep])
    if not kept:
        return list(attempts)
    out: list[Attempt] = []
    rest: dict[tuple[str, int | None], list[Attempt]] = {}
    for a in attempts:
        key = (a.node_id, a.visit)
        if a.item is None or key not in kept or a.item in kept[key]:
            out.append(a)
        else:
            rest.setdefault(key, []).append(a)
    for key, folded in rest.items():
        outcomes: dict[Outcome, int] = {}
        for a in folded:
            outcomes[a.outcome] = outcomes.get(a.outcome, 0) + 1
        out.append(
            Attempt(
                node_id=key[0], visit=key[1], attempt=None,
                start=min(a.start for a in folded), end=max(a.end for a in folded),
                outcome=max(outcomes, key=lambda o: (outcomes[o], o.value)),
                folded=len({a.item for a in folded}),
            )
        )  # fmt: skip
    return sorted(out, key=lambda a: (a.start, a.label, a.hedge, a.attempt or 0))
