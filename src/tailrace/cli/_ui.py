"""``tailrace ui``: serve the web dashboard over a store (needs the ``web`` extra)."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable, Sequence
from typing import Annotated, Any

import typer

from ..stores import RunStore, open_store
from ._fleet import load_langgraph, open_langgraph
from ._load import load_graphs
from ._render import text
from ._session import console, db_location, errors, fail, shown_location, with_store

_MEMORY = (":memory:", "memory:")


def _listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (0: any free port); a busy port is one clear line."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        fail(f"cannot listen on {host}:{port}: {exc.strerror or exc}")
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


Opening = Callable[[RunStore], contextlib.AbstractAsyncContextManager[Any]]


def _drivers(specs: Sequence[str], lease_ttl: float) -> list[Opening]:
    """``--langgraph`` specs as what opens each driver over the dashboard's store."""

    def opener(name: str | None, source: Any) -> Opening:
        return lambda store: open_langgraph(source, store, name, lease_ttl)

    return [opener(name, source) for name, source in (load_langgraph(s) for s in specs)]


async def _check_drivers(store: RunStore, drivers: Sequence[Opening]) -> list[str]:
    """Open each driver once before serving (one clear line if one cannot); names given twice."""
    async with contextlib.AsyncExitStack() as stack:
        names = [(await stack.enter_async_context(opening(store))).name for opening in drivers]
    return sorted({n for n in names if names.count(n) > 1})


def ui(
    db: Annotated[
        str | None,
        typer.Option("--db", help="Store: a SQLite path (default ./tailrace.db or $TAILRACE_DB) or a postgresql:// URL."),
    ] = None,
    host: Annotated[str, typer.Option(help="Address to listen on; 127.0.0.1 keeps it on this machine.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="Port (0: any free port).")] = 8765,
    token: Annotated[
        str | None,
        typer.Option(envvar="TAILRACE_UI_TOKEN", help="Secret every change must carry (default: generated and printed)."),
    ] = None,
    read_only: Annotated[bool, typer.Option("--read-only", help="Only show: hide and refuse answering and resuming.")] = False,
    graphs: Annotated[
        list[str] | None,
        typer.Option("--graphs", help="FILE_OR_MODULE[:GRAPH] whose runs are drawn whole and resumed here (repeatable)."),
    ] = None,
    artifact: Annotated[
        list[str] | None, typer.Option("--artifact", help="An evolve artifact id to list on the evolution page (repeatable)."),
    ] = None,
    langgraph: Annotated[
        list[str] | None,
        typer.Option("--langgraph", help="[NAME=]MODULE_OR_FILE:ATTR, a compiled LangGraph graph (or a function or context manager making one) whose threads' answers are applied here (repeatable). Give each a NAME=: LangGraph names every graph 'LangGraph'."),
    ] = None,
    lease_ttl: Annotated[
        float, typer.Option("--lease-ttl", min=0.001, envvar="TAILRACE_LEASE_TTL", help="Lease seconds of runs resumed here."),
    ] = 30.0,
) -> None:  # fmt: skip
    """Serve a web dashboard: runs, a live Gantt of every attempt, questions to answer, evolutions.

    Open the printed address. On 127.0.0.1 reading needs nothing; beyond
    loopback (--host 0.0.0.0) reading needs the token too. Answering,
    resuming and cancelling are POSTs that need the token (--token, or
    one generated and printed here); log in at /login with it once and
    the browser remembers it (an HttpOnly cookie).
    An answered question's run resumes in this process when its graph is
    importable or named with --graphs, and a LangGraph thread's when its
    graph is named with --langgraph; otherwise tailrace serve applies it.
    """
    try:
        # The web extra is optional (starlette, uvicorn, jinja2): imported only by this command.
        import uvicorn

        from ..ui import UiConfig, create_app, new_token
        from ..ui._security import LOOPBACK_HOSTS, is_loopback
    except ImportError as exc:
        fail(f"tailrace ui needs the 'web' extra ({exc.name} is missing): pip install 'tailrace[web]'", code=2)  # fmt: skip
    location = db_location(db)
    if location in _MEMORY:
        fail(
            "a memory store lives inside one process: point --db at a SQLite file or a postgresql:// URL"
        )
    loaded = load_graphs(graphs)
    drivers = _drivers(langgraph or [], lease_ttl)
    with_store(db, lambda store: store.list_runs(limit=1), read_only=read_only)  # fails in one line
    if drivers and not read_only:
        twice = with_store(db, lambda store: _check_drivers(store, drivers))
        if twice:
            raise typer.BadParameter(
                f"graphs named twice: {', '.join(twice)}; give each its own NAME= "
                "(LangGraph names every graph 'LangGraph')",
                param_hint="'--langgraph'",
            )
    secret = token or new_token()
    config = UiConfig(
        store=lambda ro: open_store(location, read_only=ro),
        token=secret,
        location=shown_location(location),
        read_only=read_only,
        graphs=loaded,
        drivers=drivers,
        artifacts=tuple(artifact or ()),
        allowed_hosts=LOOPBACK_HOSTS if is_loopback(host) else ("*",),
        reading_needs_token=not is_loopback(host),
        lease_ttl=lease_ttl,
    )
    sock = _listen(host, port)
    address = f"http://{host if ':' not in host else f'[{host}]'}:{sock.getsockname()[1]}"
    console.print(
        text(f"tailrace ui: {config.location}" + (" (read-only)" if read_only else "")),
        soft_wrap=True,
    )
    # The token is printed, never put in an address: addresses end up in histories and logs.
    needs = "reading and changes" if config.reading_needs_token else "changes"
    if token is None and (config.reading_needs_token or not read_only):
        console.print(
            text(f"token for {needs}: {secret} (log in at {address}/login)"), soft_wrap=True
        )
    if config.reading_needs_token:
        errors.print(text(("warning:", "yellow"), f" listening on {host}: reading needs the token; over plain HTTP, put TLS in front on a network that is not yours"), soft_wrap=True)  # fmt: skip
    console.print(text("open ", (address + "/runs", "bold")), soft_wrap=True)
    server = uvicorn.Server(
        uvicorn.Config(create_app(config), log_level="warning", timeout_graceful_shutdown=2)
    )
    try:
        server.run(sockets=[sock])  # uvicorn stops gracefully, then re-raises the signal
    except KeyboardInterrupt:
        console.print("stopped")
        raise typer.Exit(130) from None
    if not server.started:
        fail("the dashboard did not start (see the log above)")
