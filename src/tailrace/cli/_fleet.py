"""``tailrace`` fleet commands: submit, worker (and serve, its other name), cancel, queues.

A worker claims runs from queues and drives them, applies answers, polls
machine gates and adopts runs of dead workers; ``serve`` is the same daemon
(with no ``--queue`` it claims from the ``default`` queue). Everything printed
that came from a user or a store goes through ``_render``; errors are one
line from ``_session``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shlex
import signal
import uuid
from collections.abc import Sequence
from typing import Annotated, Any

import typer
from rich.table import Column

from ..core import Engine
from ..graph import Graph
from ..stores import TERMINAL_STATUSES, Queue, QueueStats, RunRecord, RunStore
from ..workers import HEARTBEAT, MAX_RECOVERIES, RunFailed, Schedule, Worker, WorkerStats
from ._load import is_file_spec, load_graph, load_graphs, load_object, load_pollers
from ._render import json_text, table_of, text
from ._session import (
    CommandError,
    DbOption,
    ExecutorOption,
    closing_executors,
    console,
    db_location,
    errors,
    executors_from,
    flag,
    shown_location,
    with_store,
    with_store_at,
)

LeaseTtlOption = Annotated[
    float,
    typer.Option(
        "--lease-ttl",
        min=0.001,
        envvar="TAILRACE_LEASE_TTL",
        help="Seconds a run stays leased to a worker that died on another host before "
        "another worker adopts it (a dead worker on this host is replaced at once).",
    ),
]
#: The queue a submit goes to unless told; known to every store.
DEFAULT_QUEUE = "default"
LangGraphOption = Annotated[
    list[str] | None,
    typer.Option(
        "--langgraph",
        help="[NAME=]MODULE_OR_FILE:ATTR, a compiled LangGraph graph (or a function or "
        "context manager making one) whose threads to serve (repeatable). Give each a "
        "NAME=: LangGraph names every graph 'LangGraph'.",
    ),
]
#: ``graph_name`` prefix of a LangGraph thread's run row; the integration's own constant
#: sits behind the optional langgraph extra, which reading a run must not need.
LANGGRAPH_PREFIX = "langgraph:"
QueueFilter = Annotated[
    str | None, typer.Option("--queue", help="Only runs submitted to this queue.")
]


def register(app: typer.Typer) -> None:
    """Add the fleet commands to ``app``."""
    app.command("submit")(submit)
    app.command("worker")(worker)
    app.command(
        "serve",
        help="Serve: the worker under its older name (resume answered runs, poll machine "
        "gates, adopt runs whose owner died, and claim queued runs).",
    )(worker)
    app.command("cancel")(cancel)
    group = typer.Typer(
        name="queues", invoke_without_command=True,
        help="List queues (with no command), or pause, resume or delete one.",
    )  # fmt: skip
    group.callback()(queues)
    group.command("pause")(pause)
    group.command("resume")(resume_queue)
    group.command("delete")(delete_queue)
    app.add_typer(group)


# --- submit -------------------------------------------------------------------------------


def submit(
    graph: Annotated[
        str,
        typer.Argument(
            help="MODULE_OR_FILE:GRAPH, e.g. examples/research.py:graph, or the NAME of a "
            "graph a worker registered (tailrace worker --graphs ...)."
        ),
    ],
    input: Annotated[str, typer.Option("--input", "-i", help="Run input as JSON.")] = "null",
    queue: Annotated[str, typer.Option("--queue", "-q", help="The queue.")] = DEFAULT_QUEUE,
    db: DbOption = None,
    run_id: Annotated[str | None, typer.Option(help="Name the run (default: random).")] = None,
    priority: Annotated[int, typer.Option(help="Higher first, in a priority queue.")] = 0,
    partition: Annotated[
        str | None,
        typer.Option(
            help="Runs with one key start in submit order, within the queue's partition limits."
        ),
    ] = None,
    dedup_key: Annotated[
        str | None, typer.Option(help="Return the live run with this key instead.")
    ] = None,
    cost: Annotated[float | None, typer.Option(help="The estimator's cost (lpt queues).")] = None,
    wait: Annotated[bool, flag("--wait", "Wait for the result and print it.")] = False,
    delay: Annotated[
        float | None, typer.Option(min=0.0, help="Seconds from now before a worker may start it.")
    ] = None,
    deadline: Annotated[
        float | None,
        typer.Option(
            min=0.0,
            help="Seconds from now after which the run, if unfinished, is cancelled with its "
            "child runs.",
        ),
    ] = None,
) -> None:
    """Submit a run to a queue and print its id; a worker serving the queue runs it.

    A run whose dedup key is held by a live run of the queue is not stored: the
    live run's id is printed. GRAPH is a graph to load, or the name of one a
    worker registered in the store (its newest version), for a submitter with
    no graph code.
    """
    loaded: Graph | str
    ref: str | None
    if ":" not in graph and not is_file_spec(graph):
        loaded, ref = graph, None
    else:
        loaded, ref = load_graph(graph)
    run_id = run_id or uuid.uuid4().hex  # known before it is stored: a dedup hit shows
    try:
        payload = json.loads(input)
    except json.JSONDecodeError as exc:
        raise typer.BadParameter(f"not JSON: {exc}", param_hint="'--input'") from exc

    async def work(store: RunStore) -> tuple[str, Any]:
        engine = Engine(store=store)
        now = store.clock()  # the workers judge delays and deadlines by the store's clock
        stored = await engine.submit(
            loaded, payload, queue=queue, run_id=run_id, priority=priority,
            partition=partition, dedup_key=dedup_key, cost=cost, graph_ref=ref,
            not_before=None if delay is None else now + delay,
            deadline=None if deadline is None else now + deadline,
        )  # fmt: skip
        if await queue_is_paused(store, queue):
            errors.print(
                text(
                    ("note:", "yellow"),
                    f" queue {queue} is paused: no worker starts run {stored} until it is "
                    f"resumed (tailrace queues resume {shlex.quote(queue)})",
                ),
                soft_wrap=True,
            )
        if not wait:
            return stored, None
        try:
            return stored, await engine.wait(
                stored, graph=None if isinstance(loaded, str) else loaded
            )
        except RunFailed as exc:
            raise CommandError(str(exc)) from exc

    stored, result = with_store(db, work)
    if stored != run_id:
        console.print(
            text(f"dedup key {dedup_key} is held by live run {stored}; not submitted again"),
            soft_wrap=True,
        )
    console.print(text(stored), soft_wrap=True)
    if result is not None:
        console.print(text(f"run {stored} {result.status} in {result.duration:.3f}s"))
        if isinstance(loaded, str) and result.output is None:
            # No graph code here to tell which node is the output: every node's result.
            console.print(json_text(result.results), soft_wrap=True)
        else:
            console.print(json_text(result.output), soft_wrap=True)


# --- worker / serve ---------------------------------------------------------------------------


def worker(
    db: DbOption = None,
    queue: Annotated[
        list[str] | None,
        typer.Option(
            "--queue",
            "-q",
            help="A queue to claim runs from (repeatable): NAME (its stored limits), or "
            "MODULE_OR_FILE:ATTR naming a tailrace.Queue (declared, so every worker keeps "
            "its limits). Default: the queue 'default'.",
        ),
    ] = None,
    concurrency: Annotated[
        int, typer.Option(min=1, help="Most runs this worker drives at once.")
    ] = 8,
    graphs: Annotated[
        list[str] | None,
        typer.Option(
            "--graphs",
            help="FILE_OR_MODULE[:GRAPH] whose graphs runs may be of (repeatable); graph "
            "files named in the store are never executed.",
        ),
    ] = None,
    poller: Annotated[
        list[str] | None,
        typer.Option(help="NAME=MODULE_OR_FILE:CALLABLE, a machine gate's poller (repeatable)."),
    ] = None,
    langgraph: LangGraphOption = None,
    lease_ttl: LeaseTtlOption = 30.0,
    grace: Annotated[
        float, typer.Option(min=0, help="Seconds runs in flight get to finish on SIGTERM.")
    ] = 30.0,
    max_interval: Annotated[
        float | None,
        typer.Option(
            min=0.001, help="Longest wait between two looks at the store (default: --heartbeat)."
        ),
    ] = None,
    heartbeat: Annotated[
        float,
        typer.Option(
            min=0.001,
            help="Seconds between two heartbeats (one cheap transaction each); give every "
            "worker of a fleet the same.",
        ),
    ] = HEARTBEAT,
    executor: ExecutorOption = None,
    max_recoveries: Annotated[
        int,
        typer.Option(
            min=0,
            help="A run taken over this many times (its workers died) is failed, not adopted again.",
        ),
    ] = MAX_RECOVERIES,
    schedule: Annotated[
        list[str] | None,
        typer.Option(
            help="MODULE_OR_FILE:ATTR naming a tailrace.Schedule to declare (repeatable); every "
            "worker submits the store's schedules, one worker per tick.",
        ),
    ] = None,
    take_children: Annotated[
        bool,
        flag(
            "--take-children",
            "Claim the child runs a run driven here submits to a served queue in the same "
            "write, as many as there are free slots (--no-take-children: leave them all to "
            "the fleet).",
        ),
    ] = True,
) -> None:
    """Worker: claim queued runs and drive them; resume answered runs, poll machine gates, adopt runs whose owner died.

    Any number of workers on any number of hosts share one store; claims make
    sure no two drive the same run. SIGTERM (or Ctrl-C) drains: no more
    claims, runs in flight get --grace seconds, then are stopped where they
    are and their leases released, so another worker adopts them at once.
    """
    specs = queue or [DEFAULT_QUEUE]
    queues = [_load_queue(spec) for spec in specs]
    loaded = load_graphs(graphs)
    pollers = load_pollers(poller)
    sources = [load_langgraph(spec) for spec in langgraph or []]
    location = shown_location(db_location(db))
    made = executors_from(executor)
    schedules = [_load_schedule(spec) for spec in schedule or []]

    async def work(store: RunStore) -> WorkerStats | list[str]:
        return await closing_executors(made, serve_queues(store))

    async def serve_queues(store: RunStore) -> WorkerStats | list[str]:
        async with contextlib.AsyncExitStack() as stack:
            drivers = [
                await stack.enter_async_context(open_langgraph(source, store, name, lease_ttl))
                for name, source in sources
            ]
            names = [d.name for d in drivers]
            twice = sorted({n for n in names if names.count(n) > 1})
            if twice:
                return twice
            daemon = Worker(
                store, queues=queues, concurrency=concurrency, graphs=loaded, pollers=pollers,
                targets=drivers, lease_ttl=lease_ttl, grace=grace, poll_interval=max_interval,
                heartbeat=heartbeat,
                executors=made, max_recoveries=max_recoveries, schedules=schedules,
                take_children=take_children,
            )  # fmt: skip
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
            names_shown = ", ".join(q.name for q in daemon.queues)
            console.print(
                text(f"serving {location} as {daemon.owner}, queues: {names_shown}"),
                soft_wrap=True,
            )
            return await daemon.run(stop)

    outcome = with_store(db, work)
    if isinstance(outcome, list):
        raise typer.BadParameter(
            f"graphs named twice: {', '.join(outcome)}; give each its own NAME= "
            "(LangGraph names every graph 'LangGraph')",
            param_hint="'--langgraph'",
        )
    console.print(text(f"stopped: {outcome}"), soft_wrap=True)


def _load_queue(spec: str) -> Queue | str:
    """``--queue``: a name, or ``MODULE_OR_FILE:ATTR`` naming a :class:`~tailrace.Queue`."""
    if ":" not in spec:
        if not spec:
            raise typer.BadParameter("a queue name cannot be empty", param_hint="'--queue'")
        return spec
    found, _ = load_object(spec, hint="--queue", form="NAME or MODULE_OR_FILE:QUEUE")
    if not isinstance(found, Queue):
        raise typer.BadParameter(
            f"{spec!r} is a {type(found).__name__}, not a tailrace.Queue", param_hint="'--queue'"
        )
    return found


def _load_schedule(spec: str) -> Schedule:
    """``--schedule MODULE_OR_FILE:ATTR`` naming a :class:`~tailrace.Schedule`."""
    found, _ = load_object(spec, hint="--schedule", form="MODULE_OR_FILE:SCHEDULE")
    if not isinstance(found, Schedule):
        raise typer.BadParameter(
            f"{spec!r} is a {type(found).__name__}, not a tailrace.Schedule",
            param_hint="'--schedule'",
        )
    return found


def load_langgraph(spec: str) -> tuple[str | None, Any]:
    """``--langgraph [NAME=]MODULE_OR_FILE:ATTR``: the driver's name (or None) and what to open."""
    name, sep, ref = spec.partition("=")
    if not sep or ":" in name or "/" in name or is_file_spec(name):
        name, ref = "", spec
    source, _ = load_object(ref, hint="--langgraph", form="[NAME=]MODULE_OR_FILE:ATTR")
    return name or None, source


def is_langgraph_thread(record: RunRecord) -> bool:
    """Whether ``record`` is a LangGraph thread's run (a ``--langgraph`` driver applies its answers)."""
    return record.graph_name.startswith(LANGGRAPH_PREFIX)


def open_langgraph(
    source: Any, store: RunStore, name: str | None, lease_ttl: float
) -> contextlib.AbstractAsyncContextManager[Any]:
    """A driver for ``--langgraph``'s ``source``; a clear error without the langgraph extra."""
    try:
        from ..integrations.langgraph import open_driver  # the langgraph extra is optional
    except ImportError as exc:
        raise CommandError(
            f"--langgraph needs the langgraph extra ({exc}): pip install 'tailrace[langgraph]'"
        ) from exc
    return open_driver(source, store, name=name, lease_ttl=lease_ttl)


# --- cancel --------------------------------------------------------------------------------


def cancel(
    run_id: Annotated[str, typer.Argument(help="The run to cancel.")],
    db: DbOption = None,
) -> None:
    """Cancel a run: a queued one at once, a running one at its next harvest (its worker stops it).

    A run that already finished is left as it is, and the command says so.
    """

    async def work(store: RunStore) -> tuple[bool, str]:
        before = await store.get_run(run_id)
        if before.status in TERMINAL_STATUSES:
            return True, before.status.value
        return False, await Engine(store=store).cancel(run_id)

    finished, status = with_store(db, work)
    if finished:
        message = f"run {run_id} already {status}; nothing to cancel"
    elif status == "running":
        message = f"run {run_id}: cancel requested; its worker ends it at its next harvest"
    else:
        message = f"run {run_id}: {status}"
    console.print(text(message), soft_wrap=True)


# --- queues -----------------------------------------------------------------------------------


def queues(
    ctx: typer.Context,
    db: DbOption = None,
    window: Annotated[
        float, typer.Option(min=1.0, help="Seconds the start rate and workers are counted over.")
    ] = 60.0,
) -> None:
    """List queues: limits, runs queued, running and suspended, start rate, workers seen.

    The start rate is in runs per second over the last --window seconds, and the
    oldest wait in seconds. A paused queue says so in its limits.
    tailrace queues pause|resume|delete NAME changes one.
    """
    if ctx.invoked_subcommand is not None:
        return
    stats, now = with_store_at(
        db, lambda store: store.queue_stats(store.clock(), window=window), read_only=True
    )
    headers = (
        Column("queue", no_wrap=True), "limits", "order", "queued", "running", "suspended",
        f"started (runs/s, last {window:g}s)", "oldest wait (s)", "workers",
    )  # fmt: skip
    console.print(table_of(headers, (_queue_row(s, now) for s in stats)))


QueueName = Annotated[str, typer.Argument(help="The queue's name.")]


async def queue_is_paused(store: RunStore, name: str) -> bool:
    """Whether queue ``name`` is paused (its queued runs wait until it is resumed)."""
    return any(s.name == name and s.paused for s in await store.queue_stats(store.clock()))


async def known_queue(store: RunStore, name: str) -> None:
    """Refuse a queue nobody knows: not declared, holding no runs, served by no worker that
    reported itself, and not ``default`` (a :class:`CommandError` listing the queues there are)."""
    names = {s.name for s in await store.queue_stats(store.clock())}
    names.update(queue for worker in await store.workers() for queue in worker.queues)
    if name in names or name == DEFAULT_QUEUE:
        return
    known = ", ".join(sorted(names | {DEFAULT_QUEUE}))
    raise CommandError(
        f"no queue named {name!r}: none is declared, holds runs or is served by a worker; "
        f"the queues are: {known}. Nothing was changed."
    )


def pause(name: QueueName, db: DbOption = None) -> None:
    """Pause a queue: workers claim none of its queued runs until it is resumed.

    Submits are still stored and runs already started go on; a worker's own
    declaration of the queue keeps the pause. A queue nobody knows is refused.
    """

    async def work(store: RunStore) -> None:
        await known_queue(store, name)
        await store.pause_queue(name)

    with_store(db, work)
    console.print(text(f"queue {name} paused"), soft_wrap=True)


def resume_queue(name: QueueName, db: DbOption = None) -> None:
    """Resume a paused queue: workers claim its runs again at once."""

    async def work(store: RunStore) -> bool:
        await known_queue(store, name)
        return await store.resume_queue(name)

    shown = "resumed" if with_store(db, work) else "was not paused"
    console.print(text(f"queue {name} {shown}"), soft_wrap=True)


def delete_queue(name: QueueName, db: DbOption = None) -> None:
    """Delete a queue's declaration (its limits and pause), refused while it holds live runs.

    Finished runs keep the queue's name; a queue nobody declared has nothing to delete.
    """

    async def work(store: RunStore) -> bool:
        await known_queue(store, name)
        return await store.delete_queue(name)

    shown = "deleted" if with_store(db, work) else "was not declared; nothing to delete"
    console.print(text(f"queue {name} {shown}"), soft_wrap=True)


def _queue_row(stats: QueueStats, now: float) -> Sequence[str]:
    limits = _limits(stats.queue)
    return (
        stats.name,
        f"paused; {limits}" if stats.paused else limits,
        stats.queue.order if stats.queue is not None else "fifo",
        str(stats.queued),
        str(stats.running),
        str(stats.suspended),
        f"{stats.started / stats.window:.3g}",
        "-" if stats.oldest_queued_at is None else f"{now - stats.oldest_queued_at:.1f}",
        str(stats.workers),
    )


def _limits(queue: Queue | None) -> str:
    if queue is None:
        return "not declared"
    parts = []
    if queue.concurrency is not None:
        parts.append(f"concurrency {queue.concurrency}")
    if queue.worker_concurrency is not None:
        parts.append(f"per worker {queue.worker_concurrency}")
    if queue.limit is not None:
        parts.append(f"{queue.limit} per {queue.period:g}s")
    if queue.partition_concurrency != 1:
        parts.append(f"per partition {queue.partition_concurrency}")
    if queue.partition_limit is not None:
        parts.append(f"{queue.partition_limit} per partition per {queue.period:g}s")
    return ", ".join(parts) or "none"
