"""``tailrace tail RUN_ID``: a run's streams, live, per attempt, winners marked (S1-S3).

Every chunk is data: it is printed through ``_render`` (strings literally,
other values as JSON), never read as markup; only the tags are styled.
"""

from __future__ import annotations

import asyncio
import datetime
import shlex
from typing import Annotated

import typer
from rich.text import Text

from ..core import Chunk, ChunkKind, Engine, tree_questions
from ..stores import LIVE_STATUSES, TERMINAL_STATUSES, QuestionRow, RunRecord, RunStatus, RunStore
from ._render import json_text, text
from ._session import DbOption, console, db_argument, errors, flag, with_store


def register(app: typer.Typer) -> None:
    """Add ``tail`` to ``app``."""
    app.command("tail")(tail)


def tail(
    run_id: Annotated[str, typer.Argument(help="The run whose streams to print.")],
    db: DbOption = None,
    after: Annotated[
        int, typer.Option(min=0, help="Print only rows past this cursor (a seq printed before).")
    ] = 0,
    follow: Annotated[
        bool,
        flag(
            "--follow/--no-follow",
            "Wait for what the run streams next, until it ends (--no-follow: print what is "
            "stored now and stop).",
        ),
    ] = True,
) -> None:
    r"""Print the chunks a run's nodes stream, live, each tagged with its attempt.

    Each line starts with the row's cursor (pass it as --after to go on
    from there), then the attempt: node, \[item], visit, try, and "hedge"
    for a hedge or backup. An attempt's stream ends with its mark: accepted
    (its result was committed: the winner) or discarded (it lost a hedge,
    was cancelled as late, failed, was retried or cut by a crash). Follows the
    run until it completes, fails or is cancelled; a run that waits (at a
    gate, on child runs, in its queue) is said to wait, and why.
    """

    async def work(store: RunStore) -> int:
        shown = 0
        engine = Engine(store=store)
        if not follow:
            cursor = after
            while chunks := await engine.stored_chunks(run_id, after=cursor):
                for chunk in chunks:
                    cursor = chunk.seq
                    console.print(chunk_line(chunk), soft_wrap=True)
                    shown += 1
            why = await waiting(store, await store.get_run(run_id), db)
            if why is not None:
                errors.print(why, soft_wrap=True)
            return shown
        watch = asyncio.create_task(say_waits(store, run_id, db))
        try:
            async for chunk in engine.stream(run_id, after=after):
                console.print(chunk_line(chunk), soft_wrap=True)
                shown += 1
        finally:
            watch.cancel()
            await asyncio.wait([watch])
            if not watch.cancelled():
                watch.exception()  # seen: a failed look only ever costs the notes
        return shown

    if with_store(db, work, read_only=True) == 0:
        console.print(text(f"run {run_id} has no stream rows past {after}"), soft_wrap=True)


#: Seconds between two looks at a followed run's status when nothing wakes the reader.
REREAD = 5.0
#: Seconds at least between two looks (a busy store wakes the feed often).
SPACING = 0.25


async def say_waits(store: RunStore, run_id: str, db: str | None) -> None:
    """Say on stderr, each time it changes, why run ``run_id`` waits (and when it goes on)."""
    said: Text | None = None
    async with store.changes() as feed:
        while True:
            record = await store.get_run(run_id)
            if record.status in TERMINAL_STATUSES:
                return
            why = await waiting(store, record, db)
            if why is None and said is not None:
                errors.print(text(f"run {run_id} goes on ({record.status.value})"), soft_wrap=True)
            elif why is not None and (said is None or why.plain != said.plain):
                errors.print(why, soft_wrap=True)
            said = why
            await feed.wait(REREAD)
            await asyncio.sleep(SPACING)


async def waiting(store: RunStore, record: RunRecord, db: str | None) -> Text | None:
    """Why the run of ``record`` streams nothing now (it waits: queued or suspended), or None."""
    run_id = record.run_id
    if record.status is RunStatus.QUEUED:
        return text(("waiting:", "yellow"), " ", await _queued_why(store, record))
    if record.status is not RunStatus.SUSPENDED:
        return None
    asked = await tree_questions(store, run_id)
    if asked:
        gates = ", ".join(_gate(q, run_id) for q in asked)
        first = asked[0].question_id
        return text(
            ("waiting:", "yellow"),
            f" run {run_id} is suspended: it waits for an answer at {gates}; answer with: "
            f"tailrace answer {shlex.quote(first)} VALUE {db_argument(db)}",
        )
    children = [c for c in await store.list_runs(parent=run_id) if c.status in LIVE_STATUSES]
    if children:
        n = len(children)
        return text(
            ("waiting:", "yellow"),
            f" run {run_id} is suspended: it waits on {n} child run{'s' if n != 1 else ''} "
            f"(tailrace runs --parent {shlex.quote(run_id)})",
        )
    return text(
        ("waiting:", "yellow"),
        f" run {run_id} is suspended: an answer or a child's end waits to be applied by a "
        "worker (or tailrace resume)",
    )


async def _queued_why(store: RunStore, record: RunRecord) -> str:
    queue = record.queue_name or "default"
    why = f"run {record.run_id} is queued in queue {queue}: it starts when a worker serving it claims it"
    now = store.clock()  # a delay is stamped on the store's clock
    if record.not_before is not None and record.not_before > now:
        when = datetime.datetime.fromtimestamp(record.not_before, datetime.UTC)
        why += f", not before {when:%Y-%m-%d %H:%M:%S} UTC"
    if any(s.name == queue and s.paused for s in await store.queue_stats(now)):
        why += f"; the queue is paused (tailrace queues resume {shlex.quote(queue)})"
    return why


def _gate(question: QuestionRow, run_id: str) -> str:
    where = "" if question.run_id == run_id else f" of child run {question.run_id}"
    return f"gate {question.node_id}{where} (question {question.question_id})"


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
