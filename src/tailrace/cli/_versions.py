"""``tailrace check``, ``migrate`` and ``fork``: runs against changed graphs, and forks (V1-V5).

The graphs come from ``--graphs`` only (a graph file recorded in the store is
never executed); what is printed from the store goes through ``_render``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Annotated

import typer
from rich.table import Column

from ..core import Compatibility, Engine, MigrationReport, MoveOutcome, RunResult
from ..graph import Graph
from ..stores import RunStore
from ._load import load_named_graphs, one_graph_named
from ._render import table_of, text
from ._session import CommandError, DbOption, console, flag, print_result, with_store

NewGraphsOption = Annotated[
    list[str],
    typer.Option(
        "--graphs",
        help="FILE_OR_MODULE[:GRAPH] defining the new version of the graph (repeatable).",
    ),
]


def register(app: typer.Typer) -> None:
    """Add the version commands to ``app``."""
    app.command("check")(check)
    app.command("migrate")(migrate)
    app.command("fork")(fork)


def _named(graphs: Sequence[tuple[Graph, str]], name: str, what: str) -> Graph:
    """The one graph of ``graphs`` named ``name``; an error naming what was given otherwise."""
    try:
        found = one_graph_named(graphs, name)
    except typer.BadParameter as exc:  # decided once the store said which graph: exit 1
        raise CommandError(exc.format_message()) from exc
    if found is None:
        names = ", ".join(sorted({repr(g.name) for g, _ in graphs})) or "none"
        raise CommandError(f"{what} is of graph {name!r}; --graphs defines {names}")
    return found


# --- check ---------------------------------------------------------------------------------


def check(
    run_id: Annotated[str, typer.Argument(help="The run to check.")],
    graphs: NewGraphsOption,
    db: DbOption = None,
) -> None:
    """Say whether a run can continue on the graph --graphs defines (of the run's name); write nothing.

    Lists each node that ran or holds state and that the new graph changed
    incompatibly, and why. Exits 1 when the run cannot move.
    """
    loaded = load_named_graphs(graphs)

    async def work(store: RunStore) -> Compatibility:
        record = await store.get_run(run_id)
        graph = _named(loaded, record.graph_name, f"run {run_id!r}")
        return await Engine(store=store).check(run_id, graph)

    report = with_store(db, work, read_only=True)
    console.print(text(report.describe()), soft_wrap=True)
    if not report.compatible:
        raise typer.Exit(1)


# --- migrate -------------------------------------------------------------------------------


def migrate(
    graphs: NewGraphsOption,
    db: DbOption = None,
    graph: Annotated[
        str | None, typer.Option("--graph", help="Only the graph of this name (default: each).")
    ] = None,
    apply: Annotated[
        bool, flag("--apply/--dry-run", "Move the compatible runs (default: report only).")
    ] = False,
    every: Annotated[
        bool, flag("--all", "List every run (default: those that cannot move, and a summary).")
    ] = False,
) -> None:
    """Check (and with --apply, move) the live runs of each graph --graphs defines onto that version.

    Live runs are running or suspended ones. A run another process drives is
    left alone (held); one whose graph changed incompatibly stays where it is,
    with each node and why (listed; --all lists every run). Each move is one
    fenced write.
    """
    loaded = load_named_graphs(graphs)
    names = sorted({g.name for g, _ in loaded if graph is None or g.name == graph})
    if not names:
        raise typer.BadParameter(f"--graphs defines no graph named {graph!r}", param_hint="--graph")
    chosen = [one_graph_named(loaded, name) for name in names]

    async def work(store: RunStore) -> list[MigrationReport]:
        engine = Engine(store=store)
        return [await engine.migrate(g, apply=apply) for g in chosen if g is not None]

    for report in with_store(db, work, read_only=not apply):
        headers = (Column("run", no_wrap=True), "status", "from version", "outcome", "why")
        shown = [m for m in report.runs if every or m.outcome in _STUCK]
        rows = (
            (m.run_id, m.status.value, m.from_fingerprint, m.outcome.value, m.reason) for m in shown
        )
        if shown:
            console.print(table_of(headers, rows))
        console.print(text((report.summary(), "bold")), soft_wrap=True)


#: Outcomes ``migrate`` lists without ``--all``: runs that stay where they are.
_STUCK = frozenset({MoveOutcome.INCOMPATIBLE, MoveOutcome.HELD, MoveOutcome.GONE})


# --- fork ------------------------------------------------------------------------------------


def fork(
    run_id: Annotated[str, typer.Argument(help="The run to fork.")],
    at: Annotated[str, typer.Option("--at", help="The node to run again, with all after it.")],
    db: DbOption = None,
    graphs: Annotated[
        list[str] | None,
        typer.Option(
            "--graphs",
            help="FILE_OR_MODULE[:GRAPH] defining the graph the fork runs (default: the "
            "source run's own, by its module reference).",
        ),
    ] = None,
    input: Annotated[
        str | None,
        typer.Option("--input", "-i", help="The payload (JSON) NODE runs with; default: its last."),
    ] = None,
    fork_id: Annotated[str | None, typer.Option(help="Name the fork (default: random).")] = None,
) -> None:
    """Run a new run that reuses a run's results up to --at NODE and runs NODE and what follows again.

    The source run is unchanged; the fork records where it came from
    (tailrace show prints it).
    """
    loaded = load_named_graphs(graphs)
    payload = None if input is None else _json_input(input)

    async def work(store: RunStore) -> RunResult:
        record = await store.get_run(run_id)
        engine = Engine(store=store)
        engine.register(*(g for g, _ in loaded))
        chosen = _named(loaded, record.graph_name, f"run {run_id!r}") if loaded else None
        return await engine.fork(run_id, at=at, graph=chosen, input=payload, fork_id=fork_id)

    result = with_store(db, work)
    print_result(result, db, graphs or [])
    console.print(text(f"forked from run {run_id} at node {at}"), soft_wrap=True)


def _json_input(value: str) -> object:
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise typer.BadParameter(f"not JSON: {exc}", param_hint="--input") from exc
