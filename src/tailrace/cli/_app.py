"""``tailrace`` subcommands: run, resume, runs, show, questions, answer (typer + rich).

The fleet commands (submit, worker and serve, cancel, queues) live in ``_fleet``,
``tail`` (a run's streams) in ``_tail``.

Everything printed that came from a user or a store goes through
``_render`` (shown literally, never as markup); every failure is one line
from ``_session``.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import shlex
import uuid
from collections.abc import Sequence
from typing import Annotated, Any

import typer
from rich.table import Column
from rich.text import Text

from .._attempts import attempts_from_events, event_data, hedge_account, last_known
from .._errors import GraphError, LeaseHeld, NotResumable, RunNotFound
from .._events import EventType
from .._lineage import child_place
from ..core import Engine, RunResult, owner_is_dead, stretches_of, tree_questions
from ..graph import Graph
from ..integrations.openai import TailAccount
from ..stores import EventRow, QuestionRow, QuestionStatus, RunRecord, RunStatus, RunStore
from ._children import children_table, more_children
from ._evolve import evolve_demo
from ._fleet import (
    LANGGRAPH_PREFIX,
    LangGraphOption,
    QueueFilter,
    is_langgraph_thread,
    load_langgraph,
    open_langgraph,
)
from ._fleet import register as register_fleet
from ._load import is_file_spec, load_graph, load_graphs
from ._parked import register as register_parked
from ._render import question_table, table_of, text
from ._rollouts import AccountGraphsOption, account_table, run_accounts
from ._rollouts import register as register_rollouts
from ._schedules import register as register_schedules
from ._session import (
    CommandError,
    DbOption,
    ExecutorOption,
    FailureWatch,
    closing_executors,
    console,
    db_argument,
    executors_from,
    finish,
    flag,
    print_result,
    with_store,
    with_store_at,
)
from ._tail import register as register_tail
from ._timeline import map_table, timeline
from ._ui import ui
from ._versions import register as register_versions

app = typer.Typer(
    name="tailrace",
    help="Run durable, concurrent graphs for long-tailed agent workloads.",
    no_args_is_help=True,
    add_completion=False,
)
app.command("evolve-demo")(evolve_demo)
app.command("ui")(ui)

LeaseTtlOption = Annotated[
    float,
    typer.Option(
        "--lease-ttl",
        min=0.001,
        envvar="TAILRACE_LEASE_TTL",
        help="Seconds a crashed run stays leased before another process may resume it.",
    ),
]


GraphsOption = Annotated[
    list[str] | None,
    typer.Option(
        "--graphs",
        help="FILE_OR_MODULE[:GRAPH] whose graphs runs may be resumed with (repeatable); "
        "graph files named in the store are never executed.",
    ),
]


def _resume_command(run_id: str, db: str | None, graphs: Sequence[str]) -> str:
    """The exact command that resumes ``run_id``, ready to paste into a shell."""
    words = ["tailrace", "resume", shlex.quote(run_id), db_argument(db)]
    words += [f"--graphs {shlex.quote(spec)}" for spec in graphs]
    return " ".join(words)


def _interrupted(run_id: str, db: str | None, graphs: Sequence[str]) -> Text:
    return text(
        ("interrupted:", "yellow"),
        f" run {run_id} stopped; what it committed is kept.\nresume it with: ",
        (_resume_command(run_id, db, graphs), "bold"),
    )


def _parse_json(value: str, hint: str) -> Any:
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise typer.BadParameter(f"not JSON: {exc}", param_hint=hint) from exc


@app.command()
def run(
    graph: Annotated[
        str, typer.Argument(help="MODULE_OR_FILE:GRAPH, e.g. examples/research.py:graph")
    ],
    input: Annotated[str, typer.Option("--input", "-i", help="Run input as JSON.")] = "null",
    db: DbOption = None,
    run_id: Annotated[str | None, typer.Option(help="Name the run (default: random).")] = None,
    memory: Annotated[bool, flag("--memory", "Keep nothing: run in memory.")] = False,
    capacity: Annotated[int | None, typer.Option(help="Bound on handlers in flight.")] = None,
    lease_ttl: LeaseTtlOption = 30.0,
    executor: ExecutorOption = None,
) -> None:
    """Run a graph durably and print a per-node summary and its output.

    Ctrl-C stops the run and prints the command that resumes it.
    """
    loaded, ref = load_graph(graph)
    payload = _parse_json(input, "'--input'")
    run_id = run_id or uuid.uuid4().hex  # known before it starts, for the resume hint
    # A file graph is resumed only with --graphs naming it: the store's word is not enough.
    graphs = [ref] if is_file_spec(ref.rpartition(":")[0]) else []
    watch = FailureWatch()
    made = executors_from(executor)
    if memory:
        engine = Engine(capacity=capacity, bus=watch.bus, executors=made)
        result = finish(
            lambda: closing_executors(made, engine.run(loaded, payload, run_id=run_id)),
            watch=watch,
            interrupted=lambda: text(("interrupted:", "yellow"), f" run {run_id} ran in memory"),
        )
    else:
        result = with_store(
            db,
            lambda store: closing_executors(
                made,
                Engine(
                    store=store,
                    capacity=capacity,
                    lease_ttl=lease_ttl,
                    bus=watch.bus,
                    executors=made,
                ).run(loaded, payload, run_id=run_id, graph_ref=ref),
            ),
            watch=watch,
            interrupted=lambda: _interrupted(run_id, db, graphs),
        )
    print_result(result, db, graphs, durable=not memory)


async def _resume_here(
    engine: Engine,
    store: RunStore,
    run_id: str,
    graphs: list[Graph],
    force: bool,
    cancelled: bool = False,
) -> RunResult:
    """Resume ``run_id`` with a graph named by ``--graphs`` or importable by its reference."""
    record = await store.get_run(run_id)
    engine.register(*graphs)
    chosen = None
    if graphs and not engine.knows_graph(record.fingerprint):
        # The run's graph changed shape: one of the same name takes it over when it
        # fits what the run did (V1), or with --force.
        chosen = next((g for g in graphs if g.name == record.graph_name), None)
        if chosen is None:
            names = ", ".join(repr(g.name) for g in graphs)
            raise CommandError(
                f"run {run_id!r} ran graph {record.graph_name!r} (fingerprint "
                f"{record.fingerprint}); --graphs named none with that shape or name: {names}"
            )
    try:
        return await engine.resume(run_id, chosen, force=force, cancelled=cancelled)
    except GraphError as exc:
        if "--graphs" in str(exc):
            raise  # the engine already said how
        ref_module = (record.graph_ref or "").rpartition(":")[0]
        where = ref_module if is_file_spec(ref_module) else "path/to/graphs.py"
        hint = f"tailrace resume {shlex.quote(run_id)} --graphs {shlex.quote(where)}"
        raise CommandError(f"{exc}; name the file or module that defines it: {hint}") from exc


@app.command()
def resume(
    run_id: Annotated[str, typer.Argument(help="The run to resume.")],
    db: DbOption = None,
    graphs: GraphsOption = None,
    force: Annotated[bool, flag("--force", "Resume even if the graph changed shape.")] = False,
    lease_ttl: LeaseTtlOption = 30.0,
    cancelled: Annotated[
        bool, flag("--cancelled", "Continue a cancelled run where its cancellation stopped it.")
    ] = False,
) -> None:
    """Resume a run where it stopped: running nodes re-run, completed ones are reused.

    The run's graph is the one --graphs names with the run's fingerprint,
    else the module its reference names; a graph file recorded in the store
    is never executed (trust model). A cancelled run continues only with
    --cancelled.
    """
    loaded = load_graphs(graphs)
    watch = FailureWatch()
    result = with_store(
        db,
        lambda store: _resume_here(
            Engine(store=store, lease_ttl=lease_ttl, bus=watch.bus),
            store,
            run_id,
            loaded,
            force,
            cancelled,
        ),
        watch=watch,
        interrupted=lambda: _interrupted(run_id, db, graphs or []),
    )
    print_result(result, db, graphs or [])


def run_status(record: RunRecord, now: float) -> str:
    """A run's status; a ``running`` run that no live engine holds is ``running (orphaned)``.

    Nobody holds it when its lease was released or expired, or when its owner
    is a process on this host that is provably gone (D6).
    """
    if record.status is not RunStatus.RUNNING:
        return record.status.value
    expired = record.lease_expires is None or record.lease_expires <= now
    if record.lease_owner is None or expired or owner_is_dead(record.lease_owner):
        return "running (orphaned)"
    return record.status.value


@app.command("runs")
def list_runs(
    db: DbOption = None,
    status: Annotated[RunStatus | None, typer.Option(help="Only runs with this status.")] = None,
    limit: Annotated[int, typer.Option(help="At most this many runs.")] = 50,
    queue: QueueFilter = None,
    graph: Annotated[str | None, typer.Option(help="Only runs of this graph name.")] = None,
    parent: Annotated[
        str | None, typer.Option("--parent", help="Only the child runs of this run.")
    ] = None,
) -> None:
    """List runs, newest first: status, start, duration and nodes done.

    A running run that no live process holds shows as "running (orphaned)":
    resume it, or let serve adopt it. With --graph, each run's graph version
    and, for a fork, the run and node it came from. A child run (a node whose
    handler is a graph) names its parent run; --parent lists one run's children.
    """
    records, now = with_store_at(
        db,
        lambda store: store.list_runs(
            status=status, limit=limit, queue=queue, graph=graph, parent=parent
        ),
        read_only=True,
    )
    headers: tuple[str | Column, ...] = (
        Column("run", no_wrap=True), "graph", "status", "started", "duration", "nodes done",
    )  # fmt: skip
    if graph is not None:  # one graph: its versions, and where its forks came from
        headers = (*headers[:2], "version", *headers[2:], "forked from")
    children = any(r.parent_run_id is not None for r in records)
    if children:
        headers = (*headers, Column("parent", no_wrap=True))
    rows = (_run_row(r, now, versions=graph is not None, parents=children) for r in records)
    console.print(table_of(headers, rows))


def _run_row(r: RunRecord, now: float, *, versions: bool, parents: bool) -> tuple[str, ...]:
    """A row of ``tailrace runs``: with ``versions``, the run's version and a fork's origin;
    with ``parents``, the run a child run belongs to."""
    row = _run_cells(r, now, versions=versions)
    return (*row, r.parent_run_id or "") if parents else row


def _run_cells(r: RunRecord, now: float, *, versions: bool) -> tuple[str, ...]:
    row = (
        r.run_id,
        r.graph_name,
        run_status(r, now),
        _clock(r.created_at),
        f"{(r.finished_at or r.updated_at) - r.created_at:.3f}s",
        str(r.nodes_done),
    )
    if not versions:
        return row
    origin = "" if r.forked_from is None else f"{r.forked_from} at {r.forked_at}"
    return (*row[:2], r.fingerprint, *row[2:], origin)


#: Lines of a stored traceback ``show`` prints without ``--traceback``: the last frames.
TRACEBACK_TAIL = 12


def _tracebacks(events: Sequence[EventRow]) -> list[tuple[EventRow, str]]:
    """The ``node_failed`` events that carry a stored traceback, with it."""
    found = []
    for event in events:
        if event.type != EventType.NODE_FAILED.value:
            continue
        try:
            data = json.loads(event.data_json)
        except ValueError:
            continue  # a row we cannot read says nothing about a traceback
        stored = data.get("traceback") if isinstance(data, dict) else None
        if isinstance(stored, str) and stored:
            found.append((event, stored))
    return found


def _print_drivers(events: Sequence[EventRow], recoveries: int) -> None:
    """Who drove each stretch of the run (W6), and how often it was taken over (W3)."""
    stretches = stretches_of(events)
    if not stretches:
        return
    plural = "s" if recoveries != 1 else ""
    taken = f", taken over {recoveries} time{plural}" if recoveries else ""
    many = "es" if len(stretches) != 1 else ""
    console.print(text(f"driven by ({len(stretches)} stretch{many}{taken}):"), soft_wrap=True)
    rows = [
        (
            s.owner or "unrecorded", s.how,
            datetime.datetime.fromtimestamp(s.started_at).strftime("%Y-%m-%d %H:%M:%S"),
            f"{s.ended_at - s.started_at:.3f}s", str(s.events),
        )
        for s in stretches
    ]  # fmt: skip
    console.print(table_of(("worker", "how", "from", "for", "events"), rows))


def _print_tracebacks(events: Sequence[EventRow], *, whole: bool) -> None:
    """Each failed node's stored traceback, as text: its last frames, or all of it."""
    for event, stored in _tracebacks(events):
        lines = stored.rstrip("\n").split("\n")
        cut = len(lines) - TRACEBACK_TAIL
        attempt = f" attempt {event.attempt}" if event.attempt is not None else ""
        item = event_data(event).get("item")
        if isinstance(item, int):
            attempt = f" item {item}{attempt}"
        console.print(
            text((f"traceback of node {event.node_id}{attempt}:", "bold")), soft_wrap=True
        )
        if not whole and cut > 0:
            lines = lines[cut:]
            console.print(text((f"  ... {cut} lines above (--traceback shows all)", "dim")))
        for line in lines:
            console.print(
                text(line), soft_wrap=True
            )  # stored text: never markup (escape at the edge)


@app.command()
def show(
    run_id: Annotated[str, typer.Argument(help="The run to show.")],
    db: DbOption = None,
    whole_traceback: Annotated[
        bool,
        flag(
            "--traceback",
            "Print the whole stored traceback of a failed node (default: its last lines).",
        ),
    ] = False,
    graphs: AccountGraphsOption = None,
) -> None:
    """Show a run's nodes, a timeline of every node attempt, and where a failed node raised;
    the backups it raced (started, won, refused by the hedge budget); for a map of model
    generations, the tail's account of it (tokens decoded, salvaged and wasted, the KS
    distance of kept lengths, rounds parked)."""

    loaded = load_graphs(graphs)

    async def gather(
        store: RunStore,
    ) -> tuple[Any, Any, Any, Any, list[RunRecord], list[str], list[TailAccount]]:
        stored = await store.load_run(run_id)
        events = await store.events(run_id)
        parked = await store.list_parked(graph_name=stored.run.graph_name, status=None)
        mine = [p for p in parked if p.run_id == run_id]
        children = await store.list_runs(parent=run_id)
        seen = await last_known(  # a cut attempt is drawn to its last checkpoint or chunk
            attempts_from_events(events),
            stored.checkpoints,
            lambda after, limit: store.chunks(run_id, after=after, limit=limit),
        )
        return (
            stored,
            events,
            seen,
            mine,
            children,
            await _parent_nodes(store, stored.run),
            await run_accounts(store, stored.run, loaded),
        )

    (stored, events, seen, parked, children, parent_nodes, accounts), now = with_store_at(
        db, gather, read_only=True
    )
    record = stored.run
    error = f" error: {record.error}" if record.error else ""
    console.print(
        text(
            "run ",
            (record.run_id, "bold"),
            f" graph {record.graph_name} status {run_status(record, now)}{error}",
        ),
        soft_wrap=True,
    )
    if record.graph_ref:
        console.print(text(f"graph reference: {record.graph_ref}"), soft_wrap=True)
    console.print(text(f"graph version: {record.fingerprint}"), soft_wrap=True)
    if record.forked_from is not None:
        origin = f"forked from run {record.forked_from} at node {record.forked_at}"
        console.print(text(origin), soft_wrap=True)
    if record.parent_run_id is not None:  # a child run (R1): the run whose node runs it
        place = child_place(record.parent_run_id, record.run_id, parent_nodes)
        at = "" if place is None else f" at node {place.node_id} visit {place.visit}"
        item = "" if place is None or place.item is None else f" item {place.item}"
        console.print(text(f"child run of run {record.parent_run_id}{at}{item}"), soft_wrap=True)
    rows = ((node_id, row.status, str(row.visits)) for node_id, row in stored.nodes.items())
    console.print(table_of(("node", "status", "visits"), rows))
    if children:
        table = children_table(run_id, children, stored.nodes, lambda c: run_status(c, now))
        console.print(table)
        more = more_children(run_id, len(children), db_argument(db))
        if more is not None:
            console.print(more, soft_wrap=True)
    maps = map_table(events, seen)
    if maps is not None:
        console.print(maps)
    hedging = hedge_account(events)
    if hedging is not None:  # backups it raced, and those its hedge budget refused (T3, T5)
        console.print(text(f"backups: {hedging.describe()}"), soft_wrap=True)
    if parked:  # the stragglers this run parked (P3) and what became of them
        console.print(
            table_of(
                ("parked", "item", "checkpoint", "status", "claimed by"),
                (
                    (
                        p.node_id,
                        "-" if p.item < 0 else str(p.item),
                        "yes" if p.checkpoint_json is not None else "no",
                        p.status,
                        p.claimed_by or "",
                    )
                    for p in parked
                ),
                title="parked items",
            )
        )
    for account in accounts:  # a map of model generations: its tail's account (X4)
        console.print(account_table(account, title=f"tail account of node {account.node_id}"))
    _print_drivers(events, record.recoveries)
    console.print(timeline(events, width=max(console.width - 30, 20), seen=seen))
    _print_tracebacks(events, whole=whole_traceback)


async def _parent_nodes(store: RunStore, record: RunRecord) -> list[str]:
    """The node ids of a child run's parent (to read where the child sits); none for others."""
    if record.parent_run_id is None:
        return []
    try:
        return list((await store.load_run(record.parent_run_id)).nodes)
    except RunNotFound:
        return []  # a parent deleted since: the child's id is read without its node ids


def _clock(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


@app.command()
def questions(
    db: DbOption = None,
    open_only: Annotated[
        bool, flag("--open/--all", "Only open questions (stuck answers are not open).")
    ] = False,
    run_id: Annotated[
        str | None,
        typer.Option("--run", help="Only this run's questions, and those of its child runs."),
    ] = None,
) -> None:
    """List questions: open ones wait for an answer (tailrace answer)."""
    status = QuestionStatus.OPEN if open_only else None

    async def read(store: RunStore) -> list[QuestionRow]:
        if run_id is None:
            return await store.list_questions(status=status)
        return await tree_questions(store, run_id, status)  # a child's are its parent's too

    rows = with_store(db, read, read_only=True)
    console.print(question_table(rows))


def _apply_hint(record: RunRecord) -> str:
    """How to apply an answer recorded for ``record``'s run: the daemon that can, or resume."""
    run_id = shlex.quote(record.run_id)
    if is_langgraph_thread(record):
        name = record.graph_name.removeprefix(LANGGRAPH_PREFIX)
        spec = shlex.quote(f"{name}=MODULE_OR_FILE:ATTR")
        return (
            f"a tailrace serve or tailrace worker with --langgraph {spec} applies it "
            f"(or answer with --langgraph here)"
        )
    ref_module = (record.graph_ref or "").rpartition(":")[0]
    where = shlex.quote(ref_module if is_file_spec(ref_module) else "path/to/graphs.py")
    return (
        f"a tailrace serve or tailrace worker with --graphs {where} applies it, "
        f"or apply it now: tailrace resume {run_id} --graphs {where}"
    )


async def _answer_with_engine(
    engine: Engine, store: RunStore, question_id: str, payload: Any, by: str | None, resume: bool
) -> RunResult | Text:
    """Record the answer (first answer wins); resume its run here when its graph is at hand."""
    await engine.answer(question_id, payload, by=by, resume=False)
    record = await store.get_run((await store.get_question(question_id)).run_id)
    if not resume:
        return text(f"answered {question_id}; recorded: ", _apply_hint(record))
    if is_langgraph_thread(record):
        return text(
            f"answered {question_id}; recorded: run {record.run_id} is a LangGraph thread: ",
            _apply_hint(record),
        )
    try:
        return await engine.resume(record.run_id)
    except (LeaseHeld, NotResumable):
        return text(f"answered {question_id}; its run is resumed by its owner or a worker")
    except GraphError as exc:
        # The engine's own advice names --graphs too; the hint below says it for this command.
        why = "its graph is not at hand" if "--graphs" in str(exc) else str(exc)
        return text(
            f"answered {question_id}; recorded, not applied here ({why}): ", _apply_hint(record)
        )


async def _answer_with_drivers(
    drivers: Sequence[Any], store: RunStore, question_id: str, payload: Any, by: str | None
) -> Text | None:
    """Answer through the LangGraph driver whose thread asked; None when none of them did."""
    record = await store.get_run((await store.get_question(question_id)).run_id)
    driver = next((d for d in drivers if d.handles(record)), None)
    if driver is None:
        return None
    outcome = str(await driver.answer(question_id, payload, by=by))
    after = await store.get_run(record.run_id)
    if outcome == "failed":
        raise CommandError(
            f"answered {question_id}; thread {record.run_id} failed: {after.error or 'unknown'}"
        )
    if outcome == "deferred":
        why = (await store.get_question(question_id)).apply_error or after.error
        return text(f"answered {question_id}; recorded, not applied here ({why}): ",
                    _apply_hint(record))  # fmt: skip
    return text(f"answered {question_id}; thread {record.run_id}: {outcome}, {after.status}")


@app.command()
def answer(
    question_id: Annotated[str, typer.Argument(help="The question to answer.")],
    value: Annotated[
        str, typer.Argument(help="The answer as JSON, e.g. '\"yes\"' or '{\"ok\": true}'.")
    ],
    db: DbOption = None,
    raw: Annotated[bool, flag("--raw/--json", "VALUE is a plain string, not JSON.")] = False,
    by: Annotated[str | None, typer.Option(help="Who answers.")] = None,
    resume: Annotated[
        bool, flag("--resume", "Resume the run here; --no-resume only records the answer.")
    ] = True,
    graphs: GraphsOption = None,
    langgraph: LangGraphOption = None,
    lease_ttl: LeaseTtlOption = 30.0,
) -> None:
    """Answer a question (first answer wins) and resume its run here.

    VALUE is JSON; malformed JSON is refused and nothing is recorded. With
    --raw it is taken as a plain string. When the run's graph is not at hand
    (--graphs, or --langgraph for a LangGraph thread) the answer is recorded
    and a tailrace serve or worker with the graph applies it.
    """
    payload = value if raw else _parse_json(value, "VALUE")
    loaded = load_graphs(graphs)
    sources = [load_langgraph(spec) for spec in langgraph or []]
    watch = FailureWatch()

    async def work(store: RunStore) -> RunResult | Text:
        engine = Engine(store=store, lease_ttl=lease_ttl, bus=watch.bus)
        engine.register(*loaded)
        if sources and resume:
            async with contextlib.AsyncExitStack() as stack:
                drivers = [
                    await stack.enter_async_context(open_langgraph(src, store, name, lease_ttl))
                    for name, src in sources
                ]
                said = await _answer_with_drivers(drivers, store, question_id, payload, by)
                if said is not None:
                    return said
        return await _answer_with_engine(engine, store, question_id, payload, by, resume)

    result = with_store(db, work, watch=watch)
    if isinstance(result, Text):
        console.print(result, soft_wrap=True)
        return
    print_result(result, db, graphs or [])


register_fleet(app)  # submit, worker (and serve, its other name), cancel, queues
register_versions(app)  # check, migrate, fork
register_parked(app)  # parked, parked drop
register_rollouts(app)  # rollouts
register_tail(app)  # tail
register_schedules(app)  # schedules
