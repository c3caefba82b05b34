"""One command's session: where the store is, opening it, and what an error means.

A command fails in one of a few ways, and the message says which: the store could not be opened (nothing ran), the
engine refused (a :class:`~tailrace.TailraceError`: an unknown run, a lease
held elsewhere), a handler failed the run (E9: the node and its own
exception), or the user pressed Ctrl-C (exit code 130, with how to go on).
Each is one line on stderr, never a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

import typer
from rich.console import Console
from rich.text import Text

from .._errors import TailraceError
from .._events import Event, EventBus, EventType
from ..core import RunResult
from ..executors import Executor, RayExecutor
from ..stores import RunStore, open_store
from ._render import json_text, node_table, question_table, text

T = TypeVar("T")

DEFAULT_DB = "tailrace.db"

console = Console()
errors = Console(stderr=True)

#: ``--db`` of every command that opens a store, said the same way everywhere.
DbOption = Annotated[
    str | None,
    typer.Option(
        "--db",
        help="Store: a SQLite path (default ./tailrace.db or $TAILRACE_DB) or a "
        "postgresql:// URL (add ?schema=NAME for a schema other than public).",
    ),
]


ExecutorOption = Annotated[
    list[str] | None,
    typer.Option(
        "--executor",
        metavar="ray[=ADDRESS]",
        help="An executor the graph's nodes name (executor=...): ray, or ray=ADDRESS for a "
        "running Ray cluster (needs the ray extra). Repeatable.",
    ),
]


def executors_from(specs: list[str] | None) -> dict[str, Executor]:
    """The executors ``--executor`` names, by the name nodes use (a usage error names a bad one)."""
    made: dict[str, Executor] = {}
    for spec in specs or ():
        name, _, address = spec.partition("=")
        if name != "ray":
            raise typer.BadParameter(
                f"{spec!r}: the executors are ray or ray=ADDRESS", param_hint="'--executor'"
            )
        if name in made:
            raise typer.BadParameter(f"{name!r} is named twice", param_hint="'--executor'")
        made[name] = RayExecutor(address or None)
    return made


async def closing_executors(executors: dict[str, Executor], work: Awaitable[T]) -> T:
    """Await ``work``, then close ``executors`` (whoever makes executors closes them)."""
    try:
        return await work
    finally:
        for executor in executors.values():
            await executor.aclose()


def flag(name: str, help: str) -> Any:
    """A boolean option ``--name/--no-name`` (or ``--on/--off`` when ``name`` has a slash).

    The empty metavar keeps typer from labelling a switch with a value type.
    """
    return typer.Option(name if "/" in name else f"{name}/--no-{name[2:]}", help=help, metavar="")


_POSTGRES = ("postgresql://", "postgres://")
_MEMORY = (":memory:", "memory:")


def db_location(db: str | None) -> str:
    """The store location: ``--db``, else ``$TAILRACE_DB``, else ``./tailrace.db``."""
    return db or os.environ.get("TAILRACE_DB") or DEFAULT_DB


def shown_location(location: str) -> str:
    """``location`` fit to print: a URL's password is never echoed."""
    if not location.startswith(_POSTGRES):
        return location
    parts = urllib.parse.urlsplit(location)
    if parts.password is None:
        return location
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def db_argument(db: str | None) -> str:
    """``--db ...`` for a command to paste: the same store as this one, from any directory."""
    if db is None and os.environ.get("TAILRACE_DB"):
        return '--db "$TAILRACE_DB"'
    location = db_location(db)
    if not location.startswith(_POSTGRES) and location not in _MEMORY:
        location = str(Path(location).resolve())
    return f"--db {shlex.quote(location)}"


class CommandError(Exception):
    """An error already phrased for the user (printed as ``error: MESSAGE``, exit code 1)."""


class StoreUnavailable(Exception):
    """The store could not be opened; nothing ran."""

    def __init__(self, location: str, reason: BaseException) -> None:
        super().__init__(f"cannot open store {shown_location(location)}: {reason}")


def fail(*message: str | tuple[str, str], code: int = 1) -> NoReturn:
    """Print ``error: MESSAGE`` (shown literally) on stderr and exit with ``code``."""
    errors.print(text(("error:", "red"), " ", *message), soft_wrap=True)
    raise typer.Exit(code)


@contextlib.asynccontextmanager
async def opened(location: str, *, read_only: bool = False) -> AsyncIterator[RunStore]:
    """The store at ``location``, opened; a failure to open is :class:`StoreUnavailable`.

    A read-only store never writes: it works next to a writer and on
    read-only media, and a missing file is an error naming it.
    """
    store: RunStore | None = None
    try:
        store = open_store(location, read_only=read_only)
        await store.open()
    except Exception as exc:  # a bad location, a missing driver, an unreachable server
        if store is not None:
            with contextlib.suppress(Exception):  # best effort: it never opened
                await store.close()
        raise StoreUnavailable(location, exc) from exc
    try:
        yield store
    finally:
        await store.close()


class FailureWatch:
    """Listens on an engine's bus for the node that failed a run (E9 emits it last)."""

    def __init__(self) -> None:
        self.bus = EventBus()
        self.failed: Event | None = None
        self.bus.subscribe(self._seen, EventType.NODE_FAILED)

    def _seen(self, event: Event) -> None:
        self.failed = event

    def describe(self, exc: BaseException) -> str:
        """What failed: the run and node a handler exception came from, when it is known."""
        cause = f"{type(exc).__name__}: {exc}"
        if self.failed is None:
            return cause
        event = self.failed
        return f"run {event.run_id!r} failed: node {event.node_id!r} raised {cause}"


def finish(
    main: Callable[[], Coroutine[Any, Any, T]],
    *,
    watch: FailureWatch | None = None,
    interrupted: Callable[[], Text] | None = None,
) -> T:
    """Run ``main`` to completion; turn every way it can fail into one line and an exit code."""
    try:
        return asyncio.run(main())
    except KeyboardInterrupt as exc:
        errors.print(interrupted() if interrupted else text("interrupted"), soft_wrap=True)
        raise typer.Exit(130) from exc
    except (StoreUnavailable, CommandError) as exc:
        fail(str(exc))
    except Exception as exc:
        if watch is not None and watch.failed is not None:
            fail(watch.describe(exc))  # a handler's own exception, whatever its class (E9)
        if isinstance(exc, TailraceError):
            fail(str(exc))  # the engine refused: the message names the run, node or question
        fail(f"{type(exc).__name__}: {exc}")  # a store's argument check, a driver


def with_store(
    db: str | None,
    work: Callable[[RunStore], Awaitable[T]],
    *,
    read_only: bool = False,
    watch: FailureWatch | None = None,
    interrupted: Callable[[], Text] | None = None,
) -> T:
    """Open the store ``db`` names, run ``work`` on it, close it; errors as in :func:`finish`."""
    location = db_location(db)

    async def main() -> T:
        async with opened(location, read_only=read_only) as store:
            return await work(store)

    return finish(main, watch=watch, interrupted=interrupted)


def with_store_at(
    db: str | None, work: Callable[[RunStore], Awaitable[T]], *, read_only: bool = False
) -> tuple[T, float]:
    """:func:`with_store`, and the store's clock as ``work`` ended: the stored times (leases,
    delays, waits) are stamped on it, so they are judged by it, not by this host's clock."""

    async def timed(store: RunStore) -> tuple[T, float]:
        result = await work(store)
        return result, store.clock()

    return with_store(db, timed, read_only=read_only)


def print_result(
    result: RunResult, db: str | None, graphs: Sequence[str] = (), *, durable: bool = True
) -> None:
    """The node table, open questions and how to answer them, the summary, the output."""
    console.print(node_table(result))
    if result.questions:
        console.print(question_table(result.questions, title="open questions"))
        if durable:
            words = ["tailrace answer QUESTION_ID VALUE", db_argument(db)]
            words += [f"--graphs {shlex.quote(spec)}" for spec in graphs]
            console.print(text("answer with: ", " ".join(words)), soft_wrap=True)
        else:
            console.print("the run is in memory: its questions end with this process")
    late = f", {len(result.late_inputs)} late inputs" if result.late_inputs else ""
    summary = f" {result.status} in {result.duration:.3f}s{late}"
    console.print(text("run ", (result.run_id, "bold"), summary), soft_wrap=True)
    console.print(json_text(result.output), soft_wrap=True)
