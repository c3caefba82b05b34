"""The run page's tail account: each map node whose items are model generations (X4).

What ``tailrace show`` prints under "tail account of node ...", read the same
way (:mod:`tailrace.tail`'s pure account over the run's stream rows and the
items it parked): items launched, accepted, parked and cancelled; tokens
decoded, salvaged and wasted; how many were accepted under another model
version; the rounds parked items waited. The page adds the two length
distributions the KS distance compares: the accepted items' and every
launched item's, as quantiles and as two empirical CDFs on one SVG canvas of
fixed user units (no inline style: the page's CSP forbids them).

The stream rows are read only for a run whose stream tails show a
generation's usage (the page reads those tails anyway), and a live page's
:class:`Generations` reads on from where its last update stopped, so a live
run's rows are read once, not once per update.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..graph import Graph, max_parks_of
from ..stores import ParkedRow, RunStore
from ..tail import Round, RunStreams, TailAccount, tail_account
from ._format import decode

#: Stream rows read per query.
PAGE = 1000
#: The CDF canvas, in user units.
CDF_W = 420.0
CDF_H = 150.0
_PAD_L = 40.0
_PAD_R = 12.0
_PAD_T = 10.0
_PAD_B = 24.0
#: The quantiles the lengths table shows.
QUANTILES = (0.5, 0.9, 0.99)


class Generations:
    """One run's stream rows folded for the account, read on from the last row it saw."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.streams = RunStreams()
        self.after = 0

    async def read(self, store: RunStore) -> RunStreams:
        """Read the rows committed since the last read, fold them, and return the fold."""
        while rows := await store.chunks(self.run_id, after=self.after, limit=PAGE):
            for row in rows:
                self.streams.add(row, decode(row.data_json) if row.kind == "chunk" else None)
            self.after = rows[-1].seq
        return self.streams


@dataclass(frozen=True, slots=True, kw_only=True)
class Lengths:
    """One length distribution as the page's table shows it (tokens)."""

    label: str
    count: int
    quantiles: tuple[int | None, ...]
    longest: int | None
    mean: float | None
    #: How many of these lengths are lower bounds (items not accepted: their length is not final).
    censored: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Cdf:
    """Two empirical CDFs (accepted, launched) and where they are farthest apart (the KS gap)."""

    width: float
    height: float
    accepted: str
    launched: str
    #: The KS gap's x and the two CDF heights there, as canvas coordinates.
    gap_x: float
    gap_y1: float
    gap_y2: float
    x_ticks: tuple[tuple[float, str], ...]
    y_ticks: tuple[tuple[float, str], ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class TailPanel:
    """The account of one map node of generations in this run."""

    node_id: str
    measures: tuple[tuple[str, str], ...]
    ks: float
    lengths: tuple[Lengths, ...]
    cdf: Cdf | None


async def tail_panels(
    store: RunStore,
    run_id: str,
    parked: Sequence[ParkedRow],
    generations: Generations | None,
    *,
    generating: bool,
    graph: Graph | None = None,
) -> tuple[TailPanel, ...]:
    """The tail account of each map node of ``run_id`` whose items streamed a generation's usage.

    Args:
        store: where the run is.
        run_id: the run.
        parked: the items the run parked (all its parked rows: each node's are picked).
        generations: the run's rows read so far (a live page's); None reads them afresh.
        generating: whether the stream tails the page read show a generation: without one
            (and nothing read before) no row is read.
        graph: the run's graph when the dashboard has it: each map's own ``max_parks`` is its
            starvation bound (P5); :data:`~tailrace.graph.MAX_PARKS` without it.
    """
    if generations is None:
        generations = Generations(run_id)
    if not generating and not generations.streams.generating:
        return ()
    streams = await generations.read(store)
    panels = []
    for node in streams.generating:
        rounds = [Round.of(run_id, node, streams, parked)]
        account = tail_account(node, rounds, starvation_bound=max_parks_of(graph, node))
        panels.append(panel_of(account))
    return tuple(panels)


def panel_of(account: TailAccount) -> TailPanel:
    """What the page shows of ``account``."""
    accepted, launched = account.accepted_lengths, account.launched_lengths
    return TailPanel(
        node_id=account.node_id,
        measures=tuple(account.measures()),
        ks=account.ks,
        lengths=(
            lengths_of("accepted", accepted),
            lengths_of("launched", launched, censored=account.censored),
        ),
        cdf=cdf(accepted, launched) if accepted and launched else None,
    )


def lengths_of(label: str, values: Sequence[int], *, censored: int = 0) -> Lengths:
    """The count, :data:`QUANTILES`, longest and mean of ``values`` (None when there are none)."""
    ordered = sorted(values)
    return Lengths(
        label=label,
        count=len(ordered),
        quantiles=tuple(quantile(ordered, q) for q in QUANTILES),
        longest=ordered[-1] if ordered else None,
        mean=sum(ordered) / len(ordered) if ordered else None,
        censored=censored,
    )


def quantile(ordered: Sequence[int], q: float) -> int | None:
    """The ``q`` quantile of sorted ``ordered`` (the nearest rank: a length that occurred).

    >>> quantile([1, 2, 3, 4], 0.5), quantile([1, 2, 3, 4], 0.99), quantile([], 0.5)
    (2, 4, None)
    """
    if not ordered:
        return None
    rank = math.ceil(q * len(ordered) - 1e-9)
    return ordered[min(max(rank, 1), len(ordered)) - 1]


def cdf(accepted: Sequence[int], launched: Sequence[int]) -> Cdf:
    """The empirical CDFs of ``accepted`` and ``launched`` as step polylines, with the KS gap.

    Both share the x axis (0 to the longest length) and the y axis (0 to 1);
    the gap is drawn where the two step functions are farthest apart.
    """
    a, b = sorted(accepted), sorted(launched)
    top = max(a[-1], b[-1], 1)
    track_w = CDF_W - _PAD_L - _PAD_R
    track_h = CDF_H - _PAD_T - _PAD_B

    def x(value: float) -> float:
        return _PAD_L + value / top * track_w

    def y(share: float) -> float:
        return _PAD_T + (1 - share) * track_h

    at = max(sorted(set(a) | set(b)), key=lambda v: abs(_share(a, v) - _share(b, v)))
    return Cdf(
        width=CDF_W,
        height=CDF_H,
        accepted=_steps(a, top, x, y),
        launched=_steps(b, top, x, y),
        gap_x=x(at),
        gap_y1=y(_share(a, at)),
        gap_y2=y(_share(b, at)),
        x_ticks=tuple((x(t), str(t)) for t in sorted({0, top // 2, top})),
        y_ticks=tuple((y(share), f"{share:g}") for share in (0.0, 0.5, 1.0)),
    )


def _share(ordered: Sequence[int], at: float) -> float:
    """The empirical CDF of sorted ``ordered`` at ``at``: the share of lengths at most ``at``."""
    return bisect.bisect_right(ordered, at) / len(ordered)


def _steps(
    ordered: Sequence[int], top: int, x: Callable[[float], float], y: Callable[[float], float]
) -> str:
    """The polyline points of the empirical CDF of sorted ``ordered``, from 0 to ``top``."""
    n = len(ordered)
    points = [(x(0), y(0.0))]
    for i, value in enumerate(ordered, start=1):
        if i < n and ordered[i] == value:
            continue  # equal lengths make one step
        points += [(x(value), points[-1][1]), (x(value), y(i / n))]
    points.append((x(top), points[-1][1]))
    return " ".join(f"{px:.1f},{py:.1f}" for px, py in points)
