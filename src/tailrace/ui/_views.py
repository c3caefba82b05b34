"""What each page shows, read from the store: runs, one run, questions, an artifact.

Every function here only reads (the dashboard's reader store is opened
read-only) and returns plain records the templates render; stored text stays
text until Jinja2 escapes it.
"""

from __future__ import annotations

import enum
import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from .._attempts import (
    MapSummary,
    attempts_from_events,
    event_data,
    fold_items,
    hedge_account,
    last_known,
    map_summaries,
)
from ..core import owner_is_dead, stretches_of
from ..stores import (
    TERMINAL_STATUSES,
    EventRow,
    NodeRow,
    ParkedRow,
    QuestionRow,
    QuestionStatus,
    RunCount,
    RunRecord,
    RunStatus,
    RunStore,
    StoredRun,
)
from ._accounts import Generations, TailPanel, tail_panels
from ._catalog import GraphCatalog, Origin
from ._children import Lineage, lineage_of
from ._chunks import AttemptKey, Streams, read_streams
from ._curve import Curve, VersionRow, reward_curve, version_rows
from ._format import clock, decode, event_text, pretty, preview, seconds
from ._gantt import Gantt, gantt
from ._layout import Drawing, layout, nodes_from_events, shape_from_store, shape_of_graph

#: The run page lists at most this many of the newest events (the stream appends more).
EVENT_LIMIT = 1000
ORPHANED = "orphaned"
#: Shown statuses whose duration grows until now: running, or waiting in a queue.
_GROWING = ("running", "queued")


class RunTimes(NamedTuple):
    """When a run started, how long it ran, how long it waited in its queue (if it did)."""

    started: str
    duration: str
    waited: str | None


def run_times(record: RunRecord, status: str, now: float) -> RunTimes:
    """When a run started, how long it ran and how long it waited in its queue, apart.

    A queued run has not started: its wait grows, its run time is none yet. A
    claimed one runs from its claim (``started_at``), not from its submit.
    """
    queued_at = record.queued_at or record.created_at
    if status == "queued":
        return RunTimes("not yet", "-", seconds(now - queued_at))
    start = record.started_at or record.created_at
    end = record.finished_at or (now if status in _GROWING else record.updated_at)
    waited = None if record.started_at is None else seconds(record.started_at - queued_at)
    return RunTimes(clock(start), seconds(end - start), waited)


#: Node statuses of a node that has not finished.
_UNFINISHED = ("queued", "running", "waiting")
#: Status filters of the runs page, in lifecycle order; ``orphaned`` is a running run no
#: live process holds (shown after ``running``).
RUN_FILTERS = tuple(
    name
    for status in RunStatus
    for name in ((status.value, ORPHANED) if status is RunStatus.RUNNING else (status.value,))
)


class Tab(enum.StrEnum):
    """The questions inbox's tabs."""

    OPEN = "open"
    ANSWERED = "answered"
    EXPIRED = "expired"
    STUCK = "stuck"
    SUPERSEDED = "superseded"
    ALL = "all"


def shown_status(record: RunRecord, now: float) -> str:
    """A run's status; ``orphaned`` for a running run no live engine holds (D6).

    Nobody holds it when its lease was released or expired, or when its owner
    is a process on this host that is provably gone.
    """
    if record.status is not RunStatus.RUNNING:
        return record.status.value
    expired = record.lease_expires is None or record.lease_expires <= now
    if record.lease_owner is None or expired or owner_is_dead(record.lease_owner):
        return ORPHANED
    return record.status.value


# -- the runs list ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class RunRow:
    """One line of the runs list."""

    run_id: str
    graph: str
    queue: str | None
    status: str
    started: str
    duration: str
    nodes_done: int
    questions: int
    #: How long it waited in its queue before a worker claimed it, if it did.
    waited: str | None = None
    #: The run whose node runs this one, for a child run (R1).
    parent: str | None = None
    #: Its graph's version (fingerprint) and where that version comes from, if known.
    fingerprint: str = ""
    origin: Origin | None = None
    #: A fork's origin: the run and node it was forked from (V4).
    forked_from: str | None = None
    forked_at: str | None = None

    @property
    def version(self) -> str:
        """The short form of its version's fingerprint."""
        return self.fingerprint[:8]


@dataclass(frozen=True, slots=True, kw_only=True)
class RunsPage:
    """A page of runs, newest first, with the counts per status the filters offer."""

    rows: tuple[RunRow, ...]
    counts: dict[str, int]
    total: int
    matching: int
    graphs: tuple[str, ...]
    queues: tuple[str, ...]
    status: str | None
    graph: str | None
    queue: str | None
    page: int
    pages: int
    #: Only the child runs of this run, when the list is filtered so (R1).
    parent: str | None = None
    #: Whether child runs are left out (only runs that are no run's child are listed).
    hide_children: bool = False

    @property
    def has_parents(self) -> bool:
        """Whether a row of this page is a child run (the list then shows a parent column)."""
        return any(r.parent is not None for r in self.rows)

    @property
    def has_forks(self) -> bool:
        """Whether a row of this page is a fork (the list then shows a forked-from column)."""
        return any(r.forked_from is not None for r in self.rows)


async def runs_page(
    store: RunStore,
    *,
    status: str | None,
    graph: str | None,
    queue: str | None,
    page: int,
    page_size: int,
    now: float,
    parent: str | None = None,
    hide_children: bool = False,
    catalog: GraphCatalog | None = None,
) -> RunsPage:
    """Runs filtered by ``status`` (one of :data:`RUN_FILTERS`), ``graph``, ``queue`` and
    ``parent``, paginated; child runs left out with ``hide_children``.

    Args:
        store: where the runs are.
        status: only runs shown with this status; None for all.
        graph: only runs of this graph name; None for all.
        queue: only runs submitted to this queue; None for all.
        page: which page, from 1; past the last, the last.
        page_size: runs per page.
        now: wall clock deciding which leases are live.
        parent: only the child runs of this run (R1); None for all runs.
        hide_children: only the runs that are no run's child (not with ``parent``).
        catalog: says where each run's version comes from (the graphs the dashboard holds).
    """
    everything = await store.run_counts()
    hide_children = hide_children and parent is None
    if parent is not None:
        counts, total, window, page, pages = await _children_window(
            store, parent, status=status, graph=graph, queue=queue,
            page=page, page_size=page_size, now=now,
        )  # fmt: skip
    else:
        shown = await store.run_counts(top_level=True) if hide_children else everything
        counts, total, window, page, pages = await _runs_window(
            store, shown, status=status, graph=graph, queue=queue,
            page=page, page_size=page_size, now=now, top_level=hide_children,
        )  # fmt: skip
    open_by_run = {  # the page's runs only: a store with 10,000 open questions reads none else
        r.run_id: len(await store.list_questions(run_id=r.run_id, status=QuestionStatus.OPEN))
        for r, _ in window
    }
    rows = tuple(
        RunRow(
            run_id=r.run_id,
            graph=r.graph_name,
            queue=r.queue_name,
            status=s,
            **run_times(r, s, now)._asdict(),
            nodes_done=r.nodes_done,
            questions=open_by_run.get(r.run_id, 0),
            parent=r.parent_run_id,
            fingerprint=r.fingerprint,
            origin=None if catalog is None else catalog.origin(r),
            forked_from=r.forked_from,
            forked_at=r.forked_at,
        )
        for r, s in window
    )
    return RunsPage(
        rows=rows,
        counts={f: counts.get(f, 0) for f in RUN_FILTERS},
        total=total,
        matching=total if status is None else counts.get(status, 0),
        graphs=tuple(sorted({c.graph_name for c in everything})),
        queues=tuple(sorted({c.queue_name for c in everything if c.queue_name is not None})),
        status=status,
        graph=graph,
        queue=queue,
        page=page,
        pages=pages,
        parent=parent,
        hide_children=hide_children,
    )


_Window = tuple[Counter[str], int, list[tuple[RunRecord, str]], int, int]


def _paged(matching: int, page: int, page_size: int) -> tuple[int, int, int]:
    """The page shown (past the last: the last), the number of pages, the first row's index."""
    pages = max(1, -(-matching // page_size))
    page = min(max(page, 1), pages)
    return page, pages, (page - 1) * page_size


async def _children_window(
    store: RunStore, parent: str, *, status: str | None, graph: str | None,
    queue: str | None, page: int, page_size: int, now: float,
) -> _Window:  # fmt: skip
    """The counts and page of one run's children: read whole (a run has as many as its maps' items)."""
    children = [
        (r, shown_status(r, now))
        for r in await store.list_runs(parent=parent)
        if graph in (None, r.graph_name) and queue in (None, r.queue_name)
    ]
    counts = Counter(s for _, s in children)
    chosen = [(r, s) for r, s in children if status in (None, s)]
    page, pages, first = _paged(len(chosen), page, page_size)
    return counts, len(children), chosen[first : first + page_size], page, pages


async def _runs_window(
    store: RunStore, everything: Sequence[RunCount], *, status: str | None, graph: str | None,
    queue: str | None, page: int, page_size: int, now: float, top_level: bool = False,
) -> _Window:  # fmt: skip
    """The counts and page of all runs (``top_level``: of those that are no run's child),
    counted and paged by the store."""
    # A page reads one page of runs, whatever the total. Only the running runs are
    # read whole, to tell live ones from orphans (D6).
    tallies = [
        c for c in everything if graph in (None, c.graph_name) and queue in (None, c.queue_name)
    ]
    running = await store.list_runs(
        status=RunStatus.RUNNING, graph=graph, queue=queue, top_level=top_level
    )
    shown_running = [(r, shown_status(r, now)) for r in running]
    counts = Counter[str]()
    for c in tallies:
        if c.status is not RunStatus.RUNNING:
            counts[c.status.value] += c.count
    counts.update(s for _, s in shown_running)
    total = sum(c.count for c in tallies)
    matching = total if status is None else counts.get(status, 0)
    page, pages, first = _paged(matching, page, page_size)
    if status in (RunStatus.RUNNING.value, ORPHANED):
        window = [(r, s) for r, s in shown_running if s == status][first : first + page_size]
    else:
        stored = None if status is None else RunStatus(status)
        records = await store.list_runs(
            status=stored, graph=graph, queue=queue, limit=page_size, offset=first,
            top_level=top_level,
        )  # fmt: skip
        window = [(r, shown_status(r, now)) for r in records]
    return counts, total, window, page, pages


# -- questions ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class QuestionView:
    """A question as the inbox and run pages show it; ``state`` is its tab, ``label`` its pill."""

    question_id: str
    run_id: str
    node_id: str
    visit: int
    status: str
    state: str
    label: str
    headline: str | None
    prompt: str
    created: str
    deadline: str | None
    poller: str | None
    answer: str | None
    answered_by: str | None
    answered: str | None
    applied: str | None
    apply_error: str | None
    apply_attempts: int
    retry_at: str | None


def question_state(q: QuestionRow) -> Tab:
    """The inbox tab of ``q``: stuck when a daemon failed to apply its answer and still has not."""
    unapplied = q.status is QuestionStatus.ANSWERED or (
        q.status is QuestionStatus.EXPIRED and q.applied_at is None
    )
    if q.apply_error is not None and unapplied:
        return Tab.STUCK
    if q.status in (QuestionStatus.ANSWERED, QuestionStatus.APPLIED):
        return Tab.ANSWERED
    return Tab(q.status.value)


def question_label(q: QuestionRow) -> str:
    """What ``q``'s pill says: its tab, except that an answer a run consumed says ``applied``."""
    if q.status is QuestionStatus.APPLIED:
        return q.status.value
    return question_state(q).value


def headline(prompt_json: str) -> str | None:
    """The question a structured prompt asks (its ``question``/``prompt``/``text`` string), if any."""
    value = decode(prompt_json)
    if isinstance(value, dict):
        for key in ("question", "prompt", "text", "message", "title"):
            if isinstance(value.get(key), str):
                return str(value[key])
    return None


def question_view(q: QuestionRow) -> QuestionView:
    """``q`` decoded for reading (prompt and answer as text)."""
    return QuestionView(
        question_id=q.question_id,
        run_id=q.run_id,
        node_id=q.node_id,
        visit=q.visit,
        status=q.status.value,
        state=question_state(q).value,
        label=question_label(q),
        headline=headline(q.prompt_json),
        prompt=pretty(q.prompt_json),
        created=clock(q.created_at),
        deadline=None if q.deadline is None else clock(q.deadline),
        poller=q.poller,
        answer=None if q.answer_json is None else pretty(q.answer_json),
        answered_by=q.answered_by,
        answered=None if q.answered_at is None else clock(q.answered_at),
        applied=None if q.applied_at is None else clock(q.applied_at),
        apply_error=q.apply_error,
        apply_attempts=q.apply_attempts,
        retry_at=None if q.retry_at is None else clock(q.retry_at),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class Inbox:
    """The questions of one tab and how many each tab holds."""

    tab: Tab
    counts: dict[str, int]
    questions: tuple[QuestionView, ...]
    page: int = 1
    pages: int = 1


async def inbox(store: RunStore, tab: Tab, *, page: int = 1, page_size: int = 50) -> Inbox:
    """One page of ``tab``'s questions: open ones oldest first (waiting longest), the rest
    newest first; the tabs' counts come from one counting query and the unapplied answers.

    The open tab, where thousands may wait, is read a page at a time from the store.
    """
    counts = await store.question_counts()
    unapplied = [
        *await store.list_questions(status=QuestionStatus.ANSWERED),
        *await store.list_questions(status=QuestionStatus.EXPIRED),
    ]
    stuck = Counter(q.status for q in unapplied if question_state(q) is Tab.STUCK)
    shown = {
        Tab.OPEN: counts.get(QuestionStatus.OPEN, 0),
        Tab.ANSWERED: counts.get(QuestionStatus.ANSWERED, 0)
        + counts.get(QuestionStatus.APPLIED, 0)
        - stuck[QuestionStatus.ANSWERED],
        Tab.EXPIRED: counts.get(QuestionStatus.EXPIRED, 0) - stuck[QuestionStatus.EXPIRED],
        Tab.STUCK: sum(stuck.values()),
        Tab.SUPERSEDED: counts.get(QuestionStatus.SUPERSEDED, 0),
        Tab.ALL: sum(counts.values()),
    }
    pages = max(1, -(-shown[tab] // page_size))
    page = min(max(page, 1), pages)
    first = (page - 1) * page_size
    if tab is Tab.OPEN:
        chosen = await store.list_questions(
            status=QuestionStatus.OPEN, limit=page_size, offset=first
        )
    else:
        rows = [
            q for q in await store.list_questions() if tab is Tab.ALL or question_state(q) is tab
        ]
        rows.sort(key=lambda q: q.answered_at or q.created_at, reverse=True)
        chosen = rows[first : first + page_size]
    return Inbox(
        tab=tab,
        counts={t.value: n for t, n in shown.items()},
        questions=tuple(question_view(q) for q in chosen),
        page=page,
        pages=pages,
    )


# -- one run -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeInfo:
    """A node row with its last result, shortened."""

    id: str
    status: str
    visits: int
    result: str


#: Item rows the Gantt draws per map visit (a screenful): its slowest items; the rest fold.
GANTT_ITEM_ROWS = 30


@dataclass(frozen=True, slots=True, kw_only=True)
class LateRow:
    """An input that reached an aggregate after it fired (E5)."""

    node: str
    activation: int | None
    source: str
    reason: str
    at: str


@dataclass(frozen=True, slots=True, kw_only=True)
class EventLine:
    """One event of the log; ``at`` is the time since the run started."""

    seq: int
    at: str
    type: str
    node: str | None
    visit: int | None
    attempt: int | None
    data: str
    #: A failed attempt's stored traceback (shown collapsed), if the event has one.
    traceback: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class RunView:
    """Everything the run page shows, at one moment."""

    run_id: str
    graph_name: str
    graph_ref: str | None
    fingerprint: str
    status: str
    live: bool
    started: str
    duration: str
    nodes_done: int
    error: str | None
    #: How long it waited in its queue before a worker claimed it, if it did.
    waited: str | None
    input: str
    drawing: Drawing
    graph_note: str
    gantt: Gantt
    #: Each map visit's items by outcome, its winners and slowest items (M2-M5).
    maps: tuple[MapSummary, ...]
    #: The stragglers this run parked (P3), and what became of them.
    parked: tuple[ParkedRow, ...]
    late: tuple[LateRow, ...]
    events: tuple[EventLine, ...]
    events_total: int
    last_seq: int
    questions: tuple[QuestionView, ...]
    nodes: tuple[NodeInfo, ...]
    resumable: bool
    queue: str | None
    cancellable: bool
    cancel_requested: str | None
    #: Who drove each stretch of it (W6), and how often it was taken over (W3).
    drivers: tuple[DriverRow, ...] = ()
    recoveries: int = 0
    #: Each attempt's stream, its mark, the text so far (S1-S3).
    streams: Streams
    #: A fork's origin: the run and node it was forked from (V4).
    forked_from: str | None = None
    forked_at: str | None = None
    #: Its parent and ancestors, its children and the tree of its descendants (R1).
    lineage: Lineage
    #: Where its version comes from (the file or module and attribute), if known.
    origin: Origin | None = None
    #: The tail account of each map node whose items are model generations (X4).
    tail: tuple[TailPanel, ...] = ()
    #: The backups it raced: started, won, refused by the hedge budget (T3, T5).
    hedging: str | None = None


class DriverRow(NamedTuple):
    """One stretch of a run on its page: the owner that drove it, from when, for how long;
    ``now`` marks the stretch being driven now (it runs until now)."""

    owner: str
    how: str
    at: str
    duration: str
    events: int
    now: bool = False


def driver_rows(
    events: Sequence[EventRow], *, driven_until: float | None = None
) -> tuple[DriverRow, ...]:
    """The run page's rows of who drove the run (W6); ``driven_until`` is now while a live
    process drives it: its last stretch goes on until then, not its last event."""
    stretches = stretches_of(events)
    last = len(stretches) - 1
    return tuple(
        DriverRow(
            owner=s.owner or "unrecorded", how=s.how, at=clock(s.started_at),
            duration=seconds(
                (driven_until if driven_until is not None and n == last else s.ended_at)
                - s.started_at
            ),
            events=s.events, now=driven_until is not None and n == last,
        )
        for n, s in enumerate(stretches)
    )  # fmt: skip


def parked_attempts(events: Sequence[EventRow]) -> frozenset[AttemptKey]:
    """The attempts cancelled to be parked (P3), as their stream rows name them."""
    return frozenset(
        (e.node_id, e.visit, item if isinstance(item, int) else None, e.attempt)
        for e in events
        if e.type == "node_cancelled" and e.node_id is not None and e.visit is not None
        and e.attempt is not None and (data := event_data(e)).get("reason") == "parked"
        for item in (data.get("item"),)
    )  # fmt: skip


async def run_view(
    store: RunStore,
    catalog: GraphCatalog,
    run_id: str,
    *,
    now: float,
    events: Sequence[EventRow] | None = None,
    stored: StoredRun | None = None,
    generations: Generations | None = None,
) -> RunView:
    """Read ``run_id`` and build its page; ``events``/``stored``/``generations`` reuse what a
    stream already read.

    Args:
        store: where the run is.
        catalog: finds the run's graph to draw it whole.
        run_id: the run.
        now: wall clock: where running attempts end, which leases are live.
        events: the run's events when already read (all of them).
        stored: the run and its node rows when already read.
        generations: the run's stream rows folded so far for its tail account (a live page's).
    """
    stored = stored if stored is not None else await store.load_run(run_id)
    events = events if events is not None else await store.events(run_id)
    record = stored.run
    status = shown_status(record, now)
    live = status == "running"
    rows = settled_nodes(stored.nodes or nodes_from_events(events), record.status)
    ended = record.status in TERMINAL_STATUSES
    found = await catalog.find(record)
    shape = shape_of_graph(found.graph) if found.graph is not None else None
    note = found.reason
    if shape is None:
        shape = shape_from_store(rows, events)
        if shape.complete:
            note = f"from the structure the run stored when it started ({found.reason})"
    drawing = layout(shape, rows)
    questions = await store.list_questions(run_id=run_id)
    seen = await last_known(  # a cut attempt is drawn to its last checkpoint or chunk
        attempts_from_events(events, live=live, now=None if ended else now),
        stored.checkpoints,
        lambda after, limit: store.chunks(record.run_id, after=after, limit=limit),
    )
    attempts = attempts_from_events(events, live=live, now=None if ended else now, seen=seen)
    parked = await _parked_by(store, record.graph_name, record.run_id, events)
    streams = await read_streams(store, record.run_id, parked_attempts(events))
    return RunView(
        run_id=record.run_id,
        graph_name=record.graph_name,
        graph_ref=record.graph_ref,
        fingerprint=record.fingerprint,
        status=status,
        live=live,
        **run_times(record, status, now)._asdict(),
        nodes_done=record.nodes_done,
        error=record.error,
        input=pretty(record.input_json),
        drawing=drawing,
        graph_note=note,
        # A suspended run still waits now; a finished one ended at its last event.
        gantt=gantt(
            fold_items(attempts, keep=GANTT_ITEM_ROWS),
            {
                (c.node_id, c.visit, None if c.item < 0 else c.item): c.saved_at
                for c in stored.checkpoints
            },
        ),
        parked=parked,
        maps=tuple(map_summaries(events, attempts)),
        late=late_inputs(events),
        events=tuple(event_lines(events[-EVENT_LIMIT:], record.created_at)),
        events_total=len(events),
        last_seq=events[-1].seq if events else 0,
        questions=tuple(question_view(q) for q in questions),
        nodes=await _nodes(store, record.run_id, rows, [n.id for n in shape.nodes]),
        resumable=_resumable(status, questions),
        queue=record.queue_name,
        cancellable=status in ("queued", "running", ORPHANED, "suspended")
        and record.cancel_requested_at is None,
        cancel_requested=None
        if record.cancel_requested_at is None
        else clock(record.cancel_requested_at),
        drivers=driver_rows(events, driven_until=now if live else None),
        recoveries=record.recoveries,
        streams=streams,
        forked_from=record.forked_from,
        forked_at=record.forked_at,
        lineage=await lineage_of(store, record, rows, lambda r: shown_status(r, now)),
        origin=catalog.origin(record),
        tail=await tail_panels(
            store,
            record.run_id,
            parked,
            generations,
            generating=streams.generating,
            graph=found.graph,
        ),
        hedging=_hedging(events),
    )


def _hedging(events: Sequence[EventRow]) -> str | None:
    """The run page's line on the backups the run raced, if it raced any (T3, T5)."""
    account = hedge_account(events)
    return None if account is None else account.describe()


async def _parked_by(
    store: RunStore, graph_name: str, run_id: str, events: Sequence[EventRow]
) -> tuple[ParkedRow, ...]:
    """The items ``run_id`` parked (P3), read only for the nodes its events say parked some.

    A parked straggler is a late input with reason ``parked``, stored under the
    node that parked it or the input it came from; a run that parked nothing
    reads no parked row, and one that did reads its own items only, by run.
    """
    nodes: set[str] = set()
    for e in events:
        if e.type == "node_late_input" and (data := event_data(e)).get("reason") == "parked":
            nodes.update(n for n in (e.node_id, data.get("source")) if isinstance(n, str) and n)
    rows = [
        p
        for node_id in sorted(nodes)
        for p in await store.list_parked(
            graph_name=graph_name, node_id=node_id, status=None, run_id=run_id
        )
    ]
    return tuple(sorted(rows, key=lambda p: (p.parked_at, p.park_id)))


def _resumable(status: str, questions: Sequence[QuestionRow]) -> bool:
    """An orphaned run, or a suspended one holding an answer not applied yet, can be resumed."""
    if status == ORPHANED:
        return True
    return status == "suspended" and any(
        q.status is QuestionStatus.ANSWERED
        or (q.status is QuestionStatus.EXPIRED and q.applied_at is None)
        for q in questions
    )


def settled_nodes(rows: Mapping[str, NodeRow], status: RunStatus) -> dict[str, NodeRow]:
    """Node rows as the run's stored status leaves them.

    A run that ended (cancelled, failed) while a node still waited or ran
    stores that node as it was; it will never go on, so it shows cancelled.
    """
    if status not in TERMINAL_STATUSES:
        return dict(rows)
    return {
        node_id: row._replace(status="cancelled") if row.status in _UNFINISHED else row
        for node_id, row in rows.items()
    }


async def _nodes(
    store: RunStore, run_id: str, rows: Mapping[str, NodeRow], order: list[str]
) -> tuple[NodeInfo, ...]:
    """Node rows in the graph's order (definition, or first start), each with its last result."""
    last: dict[str, str] = {}
    for result in await store.results(run_id):  # by node, then visit: the last wins
        last[result.node_id] = result.value_json
    rank = {node_id: n for n, node_id in enumerate(order)}
    return tuple(
        NodeInfo(id=n, status=row.status, visits=row.visits, result=preview(last.get(n)))
        for n, row in sorted(rows.items(), key=lambda item: rank.get(item[0], len(rank)))
    )


def late_inputs(events: Sequence[EventRow]) -> tuple[LateRow, ...]:
    """Every late input the run recorded (``node_late_input`` events, E5)."""
    return tuple(
        LateRow(
            node=e.node_id or "",
            activation=e.visit,
            # A map's late item (M5) is named by its index.
            source=str(data.get("source", ""))
            + (f"[{data['item']}]" if isinstance(data.get("item"), int) else ""),
            reason=str(data.get("reason", "")),
            at=clock(e.ts),
        )
        for e in events
        if e.type == "node_late_input"
        for data in (event_data(e),)
    )


def event_lines(events: Sequence[EventRow], t0: float) -> list[EventLine]:
    """``events`` as log lines, timed from ``t0``; a traceback is kept apart, whole."""
    lines = []
    for e in events:
        data, traceback = e.data_json, None
        if '"traceback"' in data:
            value = decode(data)
            if isinstance(value, dict) and isinstance(value.get("traceback"), str):
                traceback = value.pop("traceback")
                data = json.dumps(value)
        lines.append(
            EventLine(
                seq=e.seq,
                at=seconds(e.ts - t0),
                type=e.type,
                node=e.node_id,
                visit=e.visit,
                attempt=e.attempt,
                data=event_text(data),
                traceback=traceback,
            )
        )
    return lines


# -- evolution -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ArtifactView:
    """An artifact's ledger: versions newest first, the reward curve, commit counts."""

    artifact_id: str
    versions: tuple[VersionRow, ...]
    curve: Curve | None
    commits: int
    rebased: int
    best: VersionRow | None


async def artifact_view(store: RunStore, artifact_id: str) -> ArtifactView:
    """Read ``artifact_id``'s versions from the evolve ledger."""
    rows = version_rows(await store.artifact_history(artifact_id))
    scored = [r for r in rows if r.held_out is not None]
    return ArtifactView(
        artifact_id=artifact_id,
        versions=tuple(reversed(rows)),
        curve=reward_curve(rows),
        commits=sum(not r.initial for r in rows),
        rebased=sum(r.rebased_onto is not None for r in rows),
        best=max(scored, key=lambda r: r.held_out or 0.0) if scored else None,
    )
