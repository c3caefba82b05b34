"""The tail's account of a map node of generations, from its stream rows (X4); no I/O of its own.

Every attempt of a model generation (``tailrace.integrations.openai``'s
``ModelClient``) ends its stream with a usage chunk (decoded and salvaged
tokens, tokens in its last checkpoint, model versions, the item's origin and
how many rounds it was parked), and every attempt's stream ends ``accepted``
or ``discarded`` (S2). :class:`RunStreams` folds one run's stream rows (read
by whoever holds the store: the model client's ``tail_accounting`` through an
engine, the dashboard through its read-only store); :func:`tail_account`
adds up, per item, over one or more runs (rounds) of a graph:

- decoded: tokens the attempts of the item decoded in these runs;
- salvaged: tokens attempts reused from a checkpoint instead of decoding;
- kept: tokens the item still holds at the end (its accepted completion, or
  the checkpoint it is parked with);
- wasted: tokens decoded (or carried in from an earlier round) that are not
  kept: ``decoded + carried in - kept``.

Across the runs it compares the lengths of accepted completions with those of
every item launched (the final length when one of the runs accepted it, the
tokens known so far otherwise: such a length is censored) by the two-sample
Kolmogorov-Smirnov statistic, and counts the rounds each parked item has
waited against ``starvation_bound``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._attempts import ChunkRow

#: The key of a generation's state in its attempt's checkpoint value.
_GENERATION = "generation"


@dataclass(frozen=True, slots=True, kw_only=True)
class ItemAccount:
    """One item of a map node in one run, and its generation's tokens.

    ``outcome`` is ``accepted``, ``parked``, ``cancelled``, ``failed`` or
    ``running`` (no attempt ended). ``carried_in`` counts the tokens it
    resumed from another run's parked checkpoint; ``kept`` those it holds at
    the end; ``rounds`` the times it was parked before this run;
    ``stale`` says its text holds tokens of another model version than its
    last attempt's.
    """

    run_id: str
    item: int
    origin: str
    outcome: str
    attempts: int
    decoded: int
    salvaged: int
    carried_in: int
    kept: int
    wasted: int
    length: int
    rounds: int
    stale: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class TailAccount:
    """The account of a map node over one or more runs (rounds) of a graph (X4).

    ``accepted_lengths`` and ``launched_lengths`` are completion lengths in
    tokens, one per item (``censored`` of the launched ones are lower bounds:
    items not accepted in these runs); ``ks`` is the two-sample KS statistic
    between them. ``waiting`` maps each item still parked after the last run
    to the rounds it has waited; ``starving`` lists those at
    ``starvation_bound`` or past it; ``max_rounds`` is the most rounds any
    item waited (accepted ones included).
    """

    node_id: str
    run_ids: tuple[str, ...]
    decoded: int
    salvaged: int
    wasted: int
    kept: int
    launched: int
    accepted: int
    parked: int
    cancelled: int
    stale: int
    accepted_lengths: tuple[int, ...]
    launched_lengths: tuple[int, ...]
    censored: int
    ks: float
    waiting: dict[str, int]
    max_rounds: int
    starvation_bound: int
    starving: tuple[str, ...]
    items: tuple[ItemAccount, ...] = field(repr=False)

    @property
    def wasted_share(self) -> float:
        """Wasted tokens over decoded tokens (0 when nothing was decoded)."""
        return self.wasted / self.decoded if self.decoded else 0.0

    def measures(self) -> list[tuple[str, str]]:
        """The account as (measure, value) lines of text, as ``tailrace show`` and the dashboard
        print them (a parked item's origin is data: printers escape it)."""
        share = f"{100 * self.wasted_share:.1f}%"
        return [
            ("items launched / accepted / parked / cancelled",
             f"{self.launched} / {self.accepted} / {self.parked} / {self.cancelled}"),
            ("tokens decoded / salvaged / wasted",
             f"{self.decoded} / {self.salvaged} / {self.wasted} ({share})"),
            ("accepted under another model version", str(self.stale)),
            ("KS(accepted, launched lengths)", f"{self.ks:.3f} ({self.censored} lengths not final)"),
            ("most rounds waited", f"{self.max_rounds} (bound {self.starvation_bound})"),
            ("starving parked items", ", ".join(self.starving) or "none"),
        ]  # fmt: skip


def ks_statistic(a: Sequence[float], b: Sequence[float]) -> float:
    """The two-sample Kolmogorov-Smirnov statistic: the largest gap between two empirical CDFs.

    Args:
        a: One sample.
        b: The other sample.

    >>> ks_statistic([1, 2, 3], [1, 2, 3]), ks_statistic([1, 2], [3, 4])
    (0.0, 1.0)
    """
    if not a or not b:
        return 0.0
    xs, ys = sorted(a), sorted(b)
    i = j = 0
    gap = 0.0
    while i < len(xs) and j < len(ys):
        x = min(xs[i], ys[j])
        while i < len(xs) and xs[i] == x:
            i += 1
        while j < len(ys) and ys[j] == x:
            j += 1
        gap = max(gap, abs(i / len(xs) - j / len(ys)))
    return gap


@dataclass(slots=True)
class ItemStream:
    """What the stream says of one item: its attempts' usage chunks, streamed tokens and marks."""

    usage: dict[int, dict[str, Any]] = field(default_factory=dict)
    #: Tokens of the text chunks of each attempt (what an attempt cut before its usage decoded).
    streamed: dict[int, int] = field(default_factory=dict)
    marks: dict[int, str] = field(default_factory=dict)


def is_usage(value: object) -> bool:
    """Whether a chunk's value is the usage a model generation's attempt ends with."""
    return isinstance(value, dict) and isinstance(value.get("usage"), dict)


class RunStreams:
    """One run's stream rows folded per node and item, as they are read (in any number of reads).

    ``generating`` lists the map nodes whose items streamed a generation's
    usage, in the order first seen.
    """

    __slots__ = ("generating", "nodes")

    def __init__(self) -> None:
        self.nodes: dict[str, dict[int, ItemStream]] = {}
        self.generating: dict[str, None] = {}

    def add(self, row: ChunkRow, value: Any) -> None:
        """Fold ``row`` (a ``tailrace.Chunk`` or a store's ``ChunkRow``: its ``kind`` is
        ``chunk``, ``accepted`` or ``discarded``), whose chunk reads back as ``value``."""
        items = self.nodes.setdefault(row.node_id, {})
        entry = items.setdefault(-1 if row.item is None else row.item, ItemStream())
        if row.kind != "chunk":
            entry.marks[row.attempt] = str(row.kind)
        elif is_usage(value):
            entry.usage[row.attempt] = value["usage"]
            if row.item is not None:
                self.generating.setdefault(row.node_id, None)
        elif isinstance(value, dict) and isinstance(value.get("tokens"), int):
            entry.streamed[row.attempt] = entry.streamed.get(row.attempt, 0) + value["tokens"]

    def items_of(self, node: str) -> dict[int, ItemStream]:
        """The items of ``node`` the rows named (the item -1 stands for a node outside a map)."""
        return self.nodes.get(node, {})


@dataclass(frozen=True, slots=True)
class Round:
    """One run of a map node, as :func:`tail_account` reads it.

    ``items`` are the node's items as its stream rows tell them
    (:meth:`RunStreams.items_of`); ``parked`` maps each item this run parked
    to the tokens of its parked checkpoint (:func:`parked_tokens`).
    """

    run_id: str
    items: Mapping[int, ItemStream]
    parked: Mapping[int, int]


def generation_checkpoint(state: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint value that holds a model generation's ``state`` (text, tokens, versions)."""
    return {_GENERATION: state}


def generation_state(value: object) -> dict[str, Any] | None:
    """The generation's state a checkpoint value holds (see :func:`generation_checkpoint`),
    or None when it holds none."""
    state = value.get(_GENERATION) if isinstance(value, dict) else None
    return state if isinstance(state, dict) else None


def parked_tokens(checkpoint_json: str | None) -> int:
    """Tokens in a parked item's checkpoint (0 when it holds no generation)."""
    try:
        value = json.loads(checkpoint_json) if checkpoint_json else None
    except ValueError:  # not a checkpoint the model client wrote: no generation in it
        return 0
    tokens = (generation_state(value) or {}).get("tokens", 0)
    return int(tokens) if isinstance(tokens, int | float) else 0


def _item_account(run_id: str, item: int, entry: ItemStream, parked: int | None) -> ItemAccount:
    """The account of one item: ``parked`` is the token count of its parked checkpoint, if parked."""
    attempts = sorted(set(entry.usage) | set(entry.marks) | set(entry.streamed))
    decoded = sum(
        int(entry.usage[a].get("decoded", 0)) if a in entry.usage else entry.streamed.get(a, 0)
        for a in attempts
    )
    usages = [entry.usage[a] for a in attempts if a in entry.usage]
    salvaged = sum(int(u.get("salvaged", 0)) for u in usages)
    last = usages[-1] if usages else {}
    rounds = int(last.get("rounds", 0))
    carried_in = min((int(u.get("salvaged", 0)) for u in usages), default=0) if rounds else 0
    final_mark = entry.marks.get(attempts[-1]) if attempts else None
    if final_mark == "accepted":
        outcome, kept = "accepted", int(last.get("tokens", 0))
    elif parked is not None:
        outcome, kept = "parked", parked
    elif final_mark is None:
        outcome, kept = "running", int(last.get("checkpointed", 0))
    else:
        outcome, kept = ("cancelled" if last.get("outcome") == "cancelled" else "failed"), 0
    version, salvaged_version = last.get("version"), last.get("salvaged_version")
    return ItemAccount(
        run_id=run_id, item=item, origin=str(last.get("origin") or f"{run_id}/{item}"),
        outcome=outcome, attempts=len(attempts), decoded=decoded, salvaged=salvaged,
        carried_in=carried_in, kept=kept, wasted=max(0, decoded + carried_in - kept),
        length=kept if outcome in ("accepted", "parked") else int(last.get("tokens", decoded)),
        rounds=rounds, stale=bool(last.get("salvaged")) and salvaged_version != version,
    )  # fmt: skip


def tail_account(node: str, rounds: Sequence[Round], *, starvation_bound: int = 3) -> TailAccount:
    """The tail's account of map ``node`` over ``rounds`` (its runs, oldest first) (X4).

    Args:
        node: The map node whose items are generations.
        rounds: Each run's items and the items it parked, oldest first.
        starvation_bound: Rounds of waiting at which a parked item counts as starving.
    """
    items = [
        _item_account(r.run_id, item, entry, r.parked.get(item))
        for r in rounds
        for item, entry in sorted(r.items.items())
    ]
    final: dict[str, ItemAccount] = {}
    for account in items:  # the last word on each origin
        final[account.origin] = account
    accepted = [a for a in final.values() if a.outcome == "accepted"]
    waiting = {a.origin: a.rounds + 1 for a in final.values() if a.outcome == "parked"}
    launched_lengths = tuple(a.length for a in final.values())
    accepted_lengths = tuple(a.length for a in accepted)
    return TailAccount(
        node_id=node, run_ids=tuple(r.run_id for r in rounds),
        decoded=sum(a.decoded for a in items), salvaged=sum(a.salvaged for a in items),
        wasted=sum(a.wasted for a in items), kept=sum(a.kept for a in final.values()),
        launched=len(final), accepted=len(accepted), parked=len(waiting),
        cancelled=sum(a.outcome in ("cancelled", "failed") for a in final.values()),
        stale=sum(a.stale for a in accepted),
        accepted_lengths=accepted_lengths, launched_lengths=launched_lengths,
        censored=len(final) - len(accepted), ks=ks_statistic(accepted_lengths, launched_lengths),
        waiting=waiting, max_rounds=max([*waiting.values(), *(a.rounds for a in accepted), 0]),
        starvation_bound=starvation_bound,
        starving=tuple(o for o, r in waiting.items() if r >= starvation_bound),
        items=tuple(items),
    )  # fmt: skip
