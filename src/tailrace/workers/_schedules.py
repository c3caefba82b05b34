"""Schedules: a run of a graph submitted once per cron tick, by one worker of the fleet (W4).

A :class:`Schedule` is declared on the store (``Worker(schedules=...)`` does
it as the worker starts; ``await schedule.declare(store)`` does it from
anywhere), so every worker of the fleet knows it. Every worker runs a
:class:`ScheduleTicker`: it sleeps until the next tick of any schedule, then
asks the store to submit that tick's run (``RunStore.fire_schedule``). The
store's compare-and-set on the schedule's last tick, and the run id that
names the schedule and the tick, make one worker win each tick however many
try, and no tick is submitted twice, across crashes and restarts too.

Missed ticks: while no worker runs, nothing is submitted. A worker that
starts (or wakes) after ticks went by submits only the latest of them, once:
one catch-up run, not a burst of the backlog; the earlier missed ticks are
skipped. Ticks before a schedule was first declared are never due.

One clock: ticks are judged by the store's (``RunStore.now``: on Postgres
the server's), never by a worker's own, so a host whose clock runs ahead
can neither submit a tick early nor hold the others' ticks back.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from dataclasses import KW_ONLY, dataclass
from typing import Any

from .._codec import DEFAULT_CODEC, Codec
from ..gates._daemon import nap
from ..graph import Graph, guess_reference
from ..stores import RunStore, ScheduleRow, tick_is_due
from ..tail import Cron

logger = logging.getLogger("tailrace.workers")

#: Seconds between two readings of the store's schedules with no news of a declaration
#: (a declaration wakes every worker's ticker through the change feed: ``config``).
REFRESH = 600.0


@dataclass(frozen=True, slots=True)
class Schedule:
    """A run of ``graph`` on ``input`` submitted to ``queue`` at every tick of ``cron`` (UTC).

    Args:
        graph: the graph to run; workers drive it by its reference or because
            they were given it (``Worker(graphs=...)``).
        cron: five cron fields or a macro (see :class:`~tailrace.tail.Cron`);
            a bad one raises ``ValueError`` here.
        input: the input of every run (JSON through the codec).
        name: the schedule's name (default: the graph's); a run's id is
            ``{name}@{tick as YYYY-MM-DDTHH:MMZ}``.
        queue: the queue its runs are submitted to.
        graph_ref: ``module:attribute`` of the graph (default: guessed).

    >>> import tailrace as tr
    >>> g = tr.Graph("nightly_report")
    >>> @g.task()
    ... async def report(days: int) -> int:
    ...     return days
    >>> Schedule(g, "0 3 * * *", {"days": 1}).name
    'nightly_report'
    """

    graph: Graph
    cron: str
    input: Any = None
    _: KW_ONLY
    name: str | None = None
    queue: str = "default"
    graph_ref: str | None = None

    def __post_init__(self) -> None:
        Cron(self.cron)
        if self.name is None:
            object.__setattr__(self, "name", self.graph.name)

    def row(self, codec: Codec, now: float) -> ScheduleRow:
        """The store's row of this schedule declared at ``now``, its input encoded with ``codec``."""
        assert self.name is not None
        try:
            input_json = codec.encode(self.input)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"schedule {self.name!r}: input is not encodable: {exc}") from exc
        return ScheduleRow(
            name=self.name, cron=self.cron, graph_name=self.graph.name,
            graph_ref=self.graph_ref or guess_reference(self.graph),
            fingerprint=self.graph.compile().fingerprint, input_json=input_json,
            queue=self.queue, declared_at=now,
        )  # fmt: skip

    async def declare(self, store: RunStore, codec: Codec = DEFAULT_CODEC) -> None:
        """Declare this schedule on ``store`` (see :meth:`RunStore.declare_schedule`) at the
        store's clock, its input encoded with ``codec``."""
        await store.declare_schedule(self.row(codec, await store.now()))


class ScheduleTicker:
    """Submits the store's schedules as their ticks come; one runs in every worker.

    ``refresh`` is the most seconds between two readings of the store's
    schedules. ``fired`` counts the ticks this ticker submitted (others may
    have won the rest).
    """

    def __init__(self, store: RunStore, *, refresh: float = REFRESH) -> None:
        self.store = store
        self.refresh = refresh
        self.fired = 0
        self._rows: list[ScheduleRow] = []
        self._crons: dict[str, Cron] = {}
        #: Schedules whose stored cron does not parse (said once each).
        self._broken: set[str] = set()
        self._read_at = -math.inf
        self._wake = asyncio.Event()

    def changed(self) -> None:
        """A schedule was declared or deleted somewhere: read them again at once."""
        self._read_at = -math.inf
        self._wake.set()

    async def tick(self, now: float) -> float:
        """Submit every tick due at ``now``, the store's clock (the latest one per schedule);
        seconds until the next look."""
        if time.monotonic() - self._read_at >= self.refresh:
            self._rows = await self.store.schedules()
            self._read_at = time.monotonic()
        soonest = self.refresh
        for n, row in enumerate(self._rows):
            cron = self._cron(row)
            if cron is None:
                continue
            due = cron.latest_at(now)
            if due is not None and tick_is_due(row.last_tick, due, now):
                run_id = await self.store.fire_schedule(row.name, due)
                if run_id is not None:
                    self.fired += 1
                    logger.info("schedule %s: submitted run %s", row.name, run_id)
                self._rows[n] = dataclasses.replace(row, last_tick=due)
            soonest = min(soonest, cron.next_after(now) - now)
        return max(soonest, 0.0)

    def _cron(self, row: ScheduleRow) -> Cron | None:
        """The parsed cron of ``row`` (a stored one that does not parse is said once and skipped)."""
        cron = self._crons.get(row.cron)
        if cron is None:
            try:
                cron = self._crons[row.cron] = Cron(row.cron)
            except ValueError as exc:
                if row.name not in self._broken:
                    self._broken.add(row.name)
                    logger.warning("schedule %s cannot be used: %s", row.name, exc)
                return None
        return cron

    async def run(self, closing: asyncio.Event) -> None:
        """Tick until ``closing`` is set; a failed round is logged and tried again shortly."""
        delay = 1.0
        while not closing.is_set():
            self._wake.clear()  # before the tick: a change during it wakes the nap
            try:
                wait = await self.tick(await self.store.now())
                delay = 1.0
            except Exception:
                logger.exception("schedule tick failed; trying again in %.3g s", delay)
                wait, delay = delay, min(delay * 2, self.refresh)
            await nap(closing, self._wake, wait)
