"""The tail's account of a map node of generations, read back from stored streams (X4).

Every attempt of a :class:`ModelClient` generation ends its stream with a
usage chunk (decoded and salvaged tokens, tokens in its last checkpoint,
model versions, the item's origin and how many rounds it was parked), and
every attempt's stream ends ``accepted`` or ``discarded`` (S2).
:func:`tail_accounting` reads those back for one or more runs (rounds) of a
graph and adds up, per item:

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
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ...core import ChunkKind, Engine
from ...graph import Graph
from ._client import CHECKPOINT_KEY


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
class _Item:
    """What the stream says of one item: its attempts' usage chunks and terminal marks."""

    usage: dict[int, dict[str, Any]] = field(default_factory=dict)
    streamed: dict[int, int] = field(default_factory=dict)  # tokens of text chunks per attempt
    marks: dict[int, str] = field(default_factory=dict)


async def _stream_items(engine: Engine, run_id: str, node: str) -> dict[int, _Item]:
    """The items of ``node`` in run ``run_id``, from its stored stream (S3)."""
    items: dict[int, _Item] = {}
    after = 0
    while True:
        chunks = await engine.stored_chunks(run_id, after=after, limit=1000)
        if not chunks:
            return items
        after = chunks[-1].seq
        for chunk in chunks:
            if chunk.node_id != node:
                continue
            entry = items.setdefault(-1 if chunk.item is None else chunk.item, _Item())
            if chunk.kind is not ChunkKind.CHUNK:
                entry.marks[chunk.attempt] = chunk.kind.value
            elif isinstance(chunk.value, dict) and isinstance(chunk.value.get("usage"), dict):
                entry.usage[chunk.attempt] = chunk.value["usage"]
            elif isinstance(chunk.value, dict) and isinstance(chunk.value.get("tokens"), int):
                entry.streamed[chunk.attempt] = (
                    entry.streamed.get(chunk.attempt, 0) + chunk.value["tokens"]
                )


def _item_account(run_id: str, item: int, entry: _Item, parked: int | None) -> ItemAccount:
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


def _parked_tokens(checkpoint_json: str | None) -> int:
    """Tokens in a parked item's checkpoint (0 when it holds no generation)."""
    value = json.loads(checkpoint_json) if checkpoint_json else None
    state = value.get(CHECKPOINT_KEY) if isinstance(value, dict) else None
    return int(state.get("tokens", 0)) if isinstance(state, dict) else 0


async def tail_accounting(
    engine: Engine,
    graph: Graph | str,
    node: str,
    run_ids: str | Sequence[str],
    *,
    starvation_bound: int = 3,
) -> TailAccount:
    """The tail's account of map ``node`` over ``run_ids`` (its rounds, oldest first) (X4).

    Reads the runs' stored streams (the usage chunk each generation's attempt
    ends with, and the attempts' marks) and the items parked by them.

    Args:
        engine: An engine on the store that holds the runs.
        graph: The graph (or its name) the runs ran.
        node: The map node whose items are generations.
        run_ids: The runs, oldest first (one id, or several rounds).
        starvation_bound: Rounds of waiting at which a parked item counts as starving.
    """
    runs = (run_ids,) if isinstance(run_ids, str) else tuple(run_ids)
    parked_rows = await engine.parked(graph, node, every=True)
    items: list[ItemAccount] = []
    for run_id in runs:
        parked = {
            row.item: _parked_tokens(row.checkpoint_json)
            for row in parked_rows
            if row.run_id == run_id
        }
        for item, entry in sorted((await _stream_items(engine, run_id, node)).items()):
            items.append(_item_account(run_id, item, entry, parked.get(item)))
    final: dict[str, ItemAccount] = {}
    for account in items:  # the last word on each origin
        final[account.origin] = account
    accepted = [a for a in final.values() if a.outcome == "accepted"]
    waiting = {a.origin: a.rounds + 1 for a in final.values() if a.outcome == "parked"}
    launched_lengths = tuple(a.length for a in final.values())
    accepted_lengths = tuple(a.length for a in accepted)
    return TailAccount(
        node_id=node, run_ids=runs,
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
