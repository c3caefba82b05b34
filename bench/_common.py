"""Shared helpers for the scripts in ``bench/``: timing, gc control, aligned tables.

Benchmarks import this as ``from _common import ...`` (running ``python
bench/<script>.py`` puts ``bench/`` on ``sys.path``). Everything here is
standard library only, and nothing asserts: benchmarks report, they do not fail.

>>> t = Table("demo", [Column("name"), Column("value", right=True)])
>>> t.add_row("x", "1.00")
>>> print(t.render())
demo
name  value
----  -----
x      1.00
"""

from __future__ import annotations

import gc
import math
import os
import platform
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

# -- timing -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Timing:
    """Wall-clock seconds of repeated runs of one measurement; rates use their median."""

    samples: tuple[float, ...]

    @property
    def best(self) -> float:
        """The fastest run (the least disturbed by noise)."""
        return min(self.samples)

    @property
    def median(self) -> float:
        """The median run (what the tables report: the machine is shared and noisy)."""
        ordered = sorted(self.samples)
        mid = len(ordered) // 2
        return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2

    @property
    def runs(self) -> int:
        """How many runs were timed."""
        return len(self.samples)

    def rate(self, items: int) -> float:
        """``items`` per second at the median run."""
        return items / self.median if self.median > 0 else math.inf

    def per_item(self, items: int) -> float:
        """Seconds per item at the median run."""
        return self.median / items


@contextmanager
def timed_section(*, no_gc: bool) -> Iterator[None]:
    """Collect garbage first, then optionally keep the collector off inside the block."""
    gc.collect()
    was_enabled = gc.isenabled()
    if no_gc:
        gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def time_once(fn: Callable[[], object], *, no_gc: bool = False) -> float:
    """Seconds one call of ``fn`` takes (see :func:`timed_section` for ``no_gc``)."""
    with timed_section(no_gc=no_gc):
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start


async def time_once_async(fn: Callable[[], Awaitable[object]], *, no_gc: bool = False) -> float:
    """Seconds one awaited call of ``fn`` takes (see :func:`timed_section` for ``no_gc``)."""
    with timed_section(no_gc=no_gc):
        start = time.perf_counter()
        await fn()
        return time.perf_counter() - start


@dataclass(frozen=True, slots=True)
class Repeat:
    """How often to time one measurement.

    At least ``runs`` runs, and more until ``min_time`` seconds are spent (short
    measurements are noisy); never more than ``max_runs``, and no new run once
    ``budget`` seconds are spent (long measurements are expensive).

    >>> Repeat(runs=3, min_time=1.0).more(spent=0.5, done=3)
    True
    >>> Repeat(runs=3, budget=5.0).more(spent=6.0, done=1)
    False
    """

    runs: int = 3
    min_time: float = 0.0
    max_runs: int = 100
    budget: float = math.inf

    def more(self, *, spent: float, done: int) -> bool:
        """Whether to start another run after ``done`` runs took ``spent`` seconds."""
        if done >= self.max_runs or spent >= self.budget:
            return False
        return done < self.runs or spent < self.min_time


def best_of(fn: Callable[[], object], repeat: Repeat, *, no_gc: bool = False) -> Timing:
    """Time ``fn`` as often as ``repeat`` says (at least once); keep every sample."""
    samples = [time_once(fn, no_gc=no_gc)]
    while repeat.more(spent=sum(samples), done=len(samples)):
        samples.append(time_once(fn, no_gc=no_gc))
    return Timing(tuple(samples))


async def best_of_async(
    fn: Callable[[], Awaitable[object]], repeat: Repeat, *, no_gc: bool = False
) -> Timing:
    """Async :func:`best_of`: await ``fn()`` as often as ``repeat`` says."""
    samples = [await time_once_async(fn, no_gc=no_gc)]
    while repeat.more(spent=sum(samples), done=len(samples)):
        samples.append(await time_once_async(fn, no_gc=no_gc))
    return Timing(tuple(samples))


async def interleaved_best_of_async(
    fns: Sequence[Callable[[], Awaitable[object]]], repeat: Repeat, *, no_gc: bool = False
) -> list[Timing]:
    """Time several coroutine functions in alternation, one run of each per round.

    Alternating keeps their ratio honest when the machine's load drifts;
    ``repeat`` counts rounds and the time spent by all of them.
    """
    samples: list[list[float]] = [[] for _ in fns]
    while not samples[0] or repeat.more(spent=sum(map(sum, samples)), done=len(samples[0])):
        for fn, own in zip(fns, samples, strict=True):
            own.append(await time_once_async(fn, no_gc=no_gc))
    return [Timing(tuple(own)) for own in samples]


# -- formatting ---------------------------------------------------------------


def fmt_rate(per_second: float) -> str:
    """``12,345/s``."""
    return f"{per_second:,.0f}/s"


def fmt_ratio(ratio: float, digits: int = 2) -> str:
    """``1.23x``."""
    return f"{ratio:.{digits}f}x"


def fmt_seconds(seconds: float) -> str:
    """Seconds with a unit that keeps three significant figures or so."""
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e6:.2f} us"


def fmt_size(n: int) -> str:
    """``1k``, ``10k``, ``100k``, ``1.5M``; other numbers as they are."""
    for unit, scale in (("M", 1_000_000), ("k", 1_000)):
        if n >= scale and n % (scale // 10) == 0:
            return f"{n / scale:g}{unit}"
    return str(n)


def verdict(ok: bool) -> str:
    """``PASS`` or ``MISS`` (benchmarks report targets; they never fail the script)."""
    return "PASS" if ok else "MISS"


def parse_sizes(text: str) -> list[int]:
    """``"1000,10k,1e5"`` -> ``[1000, 10000, 100000]``."""
    sizes = []
    for part in text.split(","):
        part = part.strip().lower()
        scale = 1000 if part.endswith("k") else 1
        sizes.append(int(float(part.rstrip("k")) * scale))
    return sizes


def environment(*, no_gc: bool) -> str:
    """One line naming the interpreter, machine, its load and the gc mode, for a report's top."""
    gc_mode = (
        "DISABLED in timed sections (--no-gc)"
        if no_gc
        else "enabled (gc.collect() before each timed section)"
    )
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (
        f"python {platform.python_version()} ({sys.implementation.name}) on "
        f"{platform.system()} {platform.machine()}, {os.cpu_count()} cpus, "
        f"load average {load}; gc {gc_mode}"
    )


def load_average() -> str:
    """``load average 1.00, 0.80, 0.50`` now: the machine is shared, so every table says it."""
    return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


# -- tables -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Column:
    """A table column: header text; ``right`` aligns numbers to the right."""

    header: str
    right: bool = False


@dataclass(slots=True)
class Table:
    """A plain-text table with aligned columns, a title and footnotes."""

    title: str
    columns: Sequence[Column]
    rows: list[tuple[str, ...]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add_row(self, *cells: object) -> None:
        """Append a row; cells are converted with ``str`` and must match the columns."""
        if len(cells) != len(self.columns):
            raise ValueError(f"row has {len(cells)} cells, table has {len(self.columns)} columns")
        self.rows.append(tuple(str(c) for c in cells))

    def add_note(self, note: str) -> None:
        """Append a footnote printed under the table."""
        self.notes.append(note)

    def render(self) -> str:
        """The table as text."""
        widths = [
            max([len(col.header)] + [len(row[i]) for row in self.rows])
            for i, col in enumerate(self.columns)
        ]
        lines = [self.title]
        lines.append(self._line([c.header for c in self.columns], widths))
        lines.append(self._line(["-" * w for w in widths], widths))
        lines.extend(self._line(row, widths) for row in self.rows)
        lines.extend(f"  {note}" for note in self.notes)
        return "\n".join(lines)

    def _line(self, cells: Sequence[str], widths: Sequence[int]) -> str:
        padded = (
            cell.rjust(width) if col.right else cell.ljust(width)
            for cell, width, col in zip(cells, widths, self.columns, strict=True)
        )
        return "  ".join(padded).rstrip()

    def print(self) -> None:
        """Print the table followed by a blank line."""
        print(self.render(), end="\n\n", flush=True)


@dataclass(frozen=True, slots=True)
class Target:
    """One budget line: what was measured against what goal, and whether it holds."""

    name: str
    measured: str
    goal: str
    ok: bool


def targets_table(targets: Sequence[Target], title: str = "targets") -> Table:
    """A table of :class:`Target` lines with PASS/MISS verdicts."""
    table = Table(
        title,
        [Column("target"), Column("measured", right=True), Column("goal"), Column("verdict")],
    )
    for target in targets:
        table.add_row(target.name, target.measured, target.goal, verdict(target.ok))
    return table
