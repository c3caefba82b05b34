"""``tailrace`` subcommands: run, runs, show, resume (typer + rich)."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.table import Column, Table

from .._engine import Engine
from .._errors import TailraceError
from .._graph import Graph, resolve_reference
from .._runloop import RunResult
from ..evolve._cli import evolve_demo
from ..stores import RunStatus, RunStore, open_store
from ._timeline import node_table, question_table, timeline

T = TypeVar("T")

app = typer.Typer(
    name="tailrace",
    help="Run durable, concurrent graphs for long-tailed agent workloads.",
    no_args_is_help=True,
    add_completion=False,
)
app.command("evolve-demo")(evolve_demo)
console = Console()

DEFAULT_DB = "tailrace.db"

LeaseTtlOption = Annotated[
    float,
    typer.Option(
        "--lease-ttl",
        min=0.001,
        envvar="TAILRACE_LEASE_TTL",
        help="Seconds a crashed run stays leased before another process may resume it.",
    ),
]

DbOption = Annotated[
    str | None,
    typer.Option(
        "--db",
        help="Store: a SQLite path (default ./tailrace.db or $TAILRACE_DB) or a postgresql:// URL.",
    ),
]


def db_location(db: str | None) -> str:
    """The store location: ``--db``, else ``$TAILRACE_DB``, else ``./tailrace.db``."""
    return db or os.environ.get("TAILRACE_DB") or DEFAULT_DB


def load_graph(spec: str) -> tuple[Graph, str]:
    """Load ``MODULE_OR_FILE:GRAPH``; returns the graph and a reference other processes can import."""
    module, sep, attr = spec.rpartition(":")
    if not sep or not module or not attr:
        raise typer.BadParameter(f"{spec!r} is not MODULE_OR_FILE:GRAPH", param_hint="GRAPH")
    if module.endswith(".py"):
        module = str(Path(module).resolve())
    ref = f"{module}:{attr}"
    try:
        graph = resolve_reference(ref)
    except (ImportError, AttributeError, ValueError) as exc:
        raise typer.BadParameter(f"cannot load {spec!r}: {exc}", param_hint="GRAPH") from exc
    if not isinstance(graph, Graph):
        raise typer.BadParameter(f"{spec!r} is a {type(graph).__name__}, not a tailrace Graph")
    return graph, ref


def _with_store(db: str | None, work: Callable[[RunStore], Awaitable[T]]) -> T:
    async def main() -> T:
        async with open_store(db_location(db)) as store:
            return await work(store)

    try:
        return asyncio.run(main())
    except TailraceError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(1) from exc
    except Exception as exc:  # a handler's own exception: the run failed (E9)
        console.print(f"[red]error:[/red] the run failed: {type(exc).__name__}: {exc}")
        raise typer.Exit(1) from exc


def _print_result(result: RunResult) -> None:
    console.print(node_table(result))
    if result.questions:
        console.print(question_table(result.questions, title="open questions"))
        console.print("answer with: tailrace answer QUESTION_ID VALUE")
    console.print(
        f"run [bold]{result.run_id}[/bold] {result.status} in {result.duration:.3f}s"
        + (f", {len(result.late_inputs)} late inputs" if result.late_inputs else "")
    )
    console.print_json(json.dumps(result.output, default=repr))


@app.command()
def run(
    graph: Annotated[
        str, typer.Argument(help="MODULE_OR_FILE:GRAPH, e.g. examples/hello.py:graph")
    ],
    input: Annotated[str, typer.Option("--input", "-i", help="Run input as JSON.")] = "null",
    db: DbOption = None,
    run_id: Annotated[str | None, typer.Option(help="Name the run (default: random).")] = None,
    memory: Annotated[bool, typer.Option("--memory", help="Keep nothing: run in memory.")] = False,
    capacity: Annotated[int | None, typer.Option(help="Bound on handlers in flight.")] = None,
    lease_ttl: LeaseTtlOption = 30.0,
) -> None:
    """Run a graph durably and print a per-node summary and its output."""
    loaded, ref = load_graph(graph)
    try:
        payload = json.loads(input)
    except json.JSONDecodeError as exc:
        raise typer.BadParameter(f"--input is not JSON: {exc}") from exc
    if memory:
        result = asyncio.run(Engine(capacity=capacity).run(loaded, payload, run_id=run_id))
    else:
        result = _with_store(
            db,
            lambda store: Engine(store=store, capacity=capacity, lease_ttl=lease_ttl).run(
                loaded, payload, run_id=run_id, graph_ref=ref
            ),
        )
    _print_result(result)


@app.command()
def resume(
    run_id: Annotated[str, typer.Argument(help="The run to resume.")],
    db: DbOption = None,
    force: Annotated[bool, typer.Option(help="Resume even if the graph changed shape.")] = False,
    lease_ttl: LeaseTtlOption = 30.0,
) -> None:
    """Resume a run where it stopped: running nodes re-run, completed ones are reused."""
    result = _with_store(
        db, lambda store: Engine(store=store, lease_ttl=lease_ttl).resume(run_id, force=force)
    )
    _print_result(result)


@app.command("runs")
def list_runs(
    db: DbOption = None,
    status: Annotated[RunStatus | None, typer.Option(help="Only runs with this status.")] = None,
    limit: Annotated[int, typer.Option(help="At most this many runs.")] = 50,
) -> None:
    """List runs, newest first: status, start, duration and nodes done."""
    records = _with_store(db, lambda store: store.list_runs(status=status, limit=limit))
    table = Table(
        Column("run", no_wrap=True), "graph", "status", "started", "duration", "nodes done"
    )
    for r in records:
        end = r.finished_at or r.updated_at
        table.add_row(
            r.run_id,
            r.graph_name,
            r.status.value,
            _clock(r.created_at),
            f"{end - r.created_at:.3f}s",
            str(r.nodes_done),
        )
    console.print(table)


@app.command()
def show(
    run_id: Annotated[str, typer.Argument(help="The run to show.")],
    db: DbOption = None,
) -> None:
    """Show a run's nodes and a timeline of every node attempt."""

    async def gather(store: RunStore) -> tuple[Any, Any]:
        stored = await store.load_run(run_id)
        return stored, await store.events(run_id)

    stored, events = _with_store(db, gather)
    record = stored.run
    console.print(
        f"run [bold]{record.run_id}[/bold] graph {record.graph_name} "
        f"status {record.status.value}" + (f" error: {record.error}" if record.error else "")
    )
    table = Table("node", "status", "visits")
    for node_id, row in stored.nodes.items():
        table.add_row(node_id, row.status, str(row.visits))
    console.print(table)
    console.print(timeline(events, width=max(console.width - 30, 20)))


def _clock(ts: float) -> str:
    import datetime

    return datetime.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


@app.command()
def questions(
    db: DbOption = None,
    open_only: Annotated[bool, typer.Option("--open", help="Only open questions.")] = False,
    run_id: Annotated[str | None, typer.Option("--run", help="Only this run's questions.")] = None,
) -> None:
    """List questions: open ones wait for an answer (tailrace answer)."""
    from ..stores import QuestionStatus

    status = QuestionStatus.OPEN if open_only else None
    rows = _with_store(db, lambda store: store.list_questions(status=status, run_id=run_id))
    console.print(question_table(rows))


@app.command()
def answer(
    question_id: Annotated[str, typer.Argument(help="The question to answer.")],
    value: Annotated[str, typer.Argument(help="The answer, as JSON (a bare word is a string).")],
    db: DbOption = None,
    by: Annotated[str | None, typer.Option(help="Who answers.")] = None,
    no_resume: Annotated[
        bool, typer.Option("--no-resume", help="Only record the answer; serve applies it.")
    ] = False,
    lease_ttl: LeaseTtlOption = 30.0,
) -> None:
    """Answer a question (first answer wins) and resume its run here."""
    try:
        payload = json.loads(value)
    except json.JSONDecodeError:
        payload = value
    result = _with_store(
        db,
        lambda store: Engine(store=store, lease_ttl=lease_ttl).answer(
            question_id, payload, by=by, resume=not no_resume
        ),
    )
    if result is None:
        console.print(f"answered {question_id}; its run is resumed by its owner or serve")
        return
    _print_result(result)


@app.command()
def serve(
    db: DbOption = None,
    poller: Annotated[
        list[str] | None,
        typer.Option(help="NAME=MODULE_OR_FILE:CALLABLE, a machine gate's poller (repeatable)."),
    ] = None,
    lease_ttl: LeaseTtlOption = 30.0,
    max_interval: Annotated[float, typer.Option(help="Longest idle wait, seconds.")] = 2.0,
) -> None:
    """Serve: resume answered runs, poll machine gates, adopt runs whose owner died."""
    import signal

    from ..gates import Server

    pollers = {}
    for spec in poller or []:
        name, sep, ref = spec.partition("=")
        if not sep:
            raise typer.BadParameter(f"{spec!r} is not NAME=MODULE:CALLABLE", param_hint="--poller")
        pollers[name] = resolve_reference(ref)

    async def work(store: RunStore) -> Any:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        engine = Engine(store=store, lease_ttl=lease_ttl)
        server = Server(engine, pollers=pollers, max_interval=max_interval)
        console.print(f"serving {db_location(db)} as {engine.owner}")
        return await server.run(stop)

    stats = _with_store(db, work)
    console.print(f"stopped: {stats}")
