"""``tailrace schedules``: the store's schedules and the tick each submits next (W4).

Ticks are read by the store's clock (``RunStore.now``), the one the workers
judge them by, and printed in UTC, as cron reads them. Names, crons and
graph names are data: every cell goes through ``_render``.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence

import typer
from rich.table import Column

from ..stores import RunStore, ScheduleRow, next_tick
from ._render import table_of, text
from ._session import DbOption, console, with_store


def register(app: typer.Typer) -> None:
    """Add ``tailrace schedules`` to ``app``."""
    app.command("schedules")(schedules)


def schedules(db: DbOption = None) -> None:
    """List schedules: cron, graph, queue, the last tick submitted and the next one.

    Times are UTC, by the store's clock (on Postgres, the server's), which
    the workers judge ticks by. A next tick that has come is due: any
    worker's next look submits it (none does while no worker runs).
    """

    async def read(store: RunStore) -> tuple[list[ScheduleRow], float]:
        return await store.schedules(), await store.now()

    rows, now = with_store(db, read, read_only=True)
    if not rows:
        console.print(text("no schedules (tailrace worker --schedule declares one)"))
        return
    headers = (
        Column("schedule", no_wrap=True), "cron", "graph", "queue", "last tick (UTC)",
        "next tick (UTC)", "in",
    )  # fmt: skip
    console.print(table_of(headers, (schedule_row(row, now) for row in rows)))


def schedule_row(row: ScheduleRow, now: float) -> Sequence[str]:
    """A row of ``tailrace schedules`` at ``now``, the store's clock."""
    try:
        upcoming = next_tick(row, now)
    except ValueError as exc:  # a stored cron that no longer parses: workers skip it too
        return (row.name, row.cron, row.graph_name, row.queue, _utc(row.last_tick), str(exc), "")
    wait = upcoming - now
    when = "due now" if wait <= 0 else _span(wait)
    return (
        row.name,
        row.cron,
        row.graph_name,
        row.queue,
        _utc(row.last_tick),
        _utc(upcoming),
        when,
    )


def _utc(at: float | None) -> str:
    if at is None:
        return "-"
    return datetime.datetime.fromtimestamp(at, datetime.UTC).strftime("%Y-%m-%d %H:%M")


def _span(seconds: float) -> str:
    """``seconds`` to come, in the largest units that say it: ``42s``, ``3m 20s``, ``2d 4h``."""
    whole = int(seconds + 0.999)
    days, rest = divmod(whole, 86_400)
    hours, rest = divmod(rest, 3_600)
    minutes, secs = divmod(rest, 60)
    parts = [(days, "d"), (hours, "h"), (minutes, "m"), (secs, "s")]
    first = next((i for i, (n, _) in enumerate(parts) if n), len(parts) - 1)
    return " ".join(f"{n}{unit}" for n, unit in parts[first : first + 2] if n) or "0s"
