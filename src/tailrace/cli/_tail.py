"""``tailrace tail RUN_ID``: a run's streams, live, per attempt, winners marked (S1-S3).

Every chunk is data: it is printed through ``_render`` (strings literally,
other values as JSON), never read as markup; only the tags are styled.
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich.text import Text

from ..core import Chunk, ChunkKind, Engine
from ..stores import RunStore
from ._render import json_text, text
from ._session import DbOption, console, flag, with_store


def register(app: typer.Typer) -> None:
    """Add ``tail`` to ``app``."""
    app.command("tail")(tail)


def tail(
    run_id: Annotated[str, typer.Argument(help="The run whose streams to print.")],
    db: DbOption = None,
    after: Annotated[
        int, typer.Option(min=0, help="Print only rows past this cursor (a seq printed before).")
    ] = 0,
    no_follow: Annotated[
        bool, flag("--no-follow", "Print what is stored now and stop, without waiting.")
    ] = False,
) -> None:
    """Print the chunks a run's nodes stream, live, each tagged with its attempt.

    Each line starts with the row's cursor (pass it as ``--after`` to go on
    from there), then the attempt: node, [item], visit, try, and ``hedge``
    for a hedge or backup. An attempt's stream ends with its mark: ``accepted``
    (its result was committed: the winner) or ``discarded`` (it lost a hedge,
    was cancelled as late, failed, was retried or cut by a crash). Follows the
    run until it completes, fails or is cancelled.
    """

    async def work(store: RunStore) -> int:
        shown = 0
        engine = Engine(store=store)
        if no_follow:
            cursor = after
            while chunks := await engine.stored_chunks(run_id, after=cursor):
                for chunk in chunks:
                    cursor = chunk.seq
                    console.print(chunk_line(chunk), soft_wrap=True)
                    shown += 1
            return shown
        async for chunk in engine.stream(run_id, after=after):
            console.print(chunk_line(chunk), soft_wrap=True)
            shown += 1
        return shown

    if with_store(db, work, read_only=True) == 0:
        console.print(text(f"run {run_id} has no stream rows past {after}"), soft_wrap=True)


def attempt_label(chunk: Chunk) -> str:
    """``node[item] v1 try 2 hedge``: which attempt a row belongs to."""
    item = "" if chunk.item is None else f"[{chunk.item}]"
    hedge = " hedge" if chunk.hedge else ""
    return f"{chunk.node_id}{item} v{chunk.visit} try {chunk.attempt}{hedge}"


def chunk_line(chunk: Chunk) -> Text:
    """One printed row: the cursor and attempt (styled), then the chunk (data) or the mark."""
    head = text((f"{chunk.seq:>6} ", "dim"), (attempt_label(chunk), "cyan"), " ")
    if chunk.kind is ChunkKind.ACCEPTED:
        return head + text(("accepted (winner)", "bold green"))
    if chunk.kind is ChunkKind.DISCARDED:
        return head + text(("discarded", "dim red"))
    value = chunk.value
    return head + (text(value) if isinstance(value, str) else json_text(value, indent=None))
