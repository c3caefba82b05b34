"""Checkpoint and parking benchmark: what a checkpoint costs, what a crash repeats, what parking saves.

Run as::

    python bench/checkpoints.py [--quick]

1. **Cost.** One node of 200 turns (a turn yields to the loop) on a SQLite
   file, durability ``"async"``, with a checkpoint every turn against none:
   commits, checkpoint rows and bytes written per commit. Target: at most one
   checkpoint row per commit however many checkpoints are saved.
2. **A crash repeats at most one turn.** A real process runs a 100-turn node
   (``tests/durable/checkpoint_graphs.py``, a checkpoint per turn) and is
   SIGKILLed once turn 90 is committed (``durability="sync"``); the run is resumed here. Reported:
   the turn it resumed from and the turns that ran twice, per durability mode.
3. **Parking.** Ten rounds of 64 rollouts with lognormal lengths (sigma 1.0),
   ``required=56``: ``late="park"`` with ``resume_parked=True`` (a straggler
   continues in the next round from its checkpoint) against ``late="cancel"``
   (stragglers are thrown away) and against waiting for all 64. Reported: wall
   time of the ten rounds, the share of the slowest decile of prompts (by
   planned length) whose rollout completes within the ten rounds, and, for
   parking, the share still parked at the end (kept, not lost: it continues
   in the next round that resumes parked items).

Nothing here asserts; the ``targets`` table reports PASS/MISS.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import Column, Table, environment, fmt_seconds, verdict

import tailrace as tr
from tailrace import current_node
from tailrace.stores import Harvest, SQLiteStore, open_store

ROOT = Path(__file__).resolve().parents[1]


class CountingStore(SQLiteStore):
    """A SQLite store that counts its commits and the checkpoint rows and bytes they carry."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.commits = 0
        self.checkpoint_rows = 0
        self.checkpoint_bytes = 0

    async def commit(self, run_id: str, token: int, harvest: Harvest) -> bool:
        self.commits += 1
        self.checkpoint_rows += len(harvest.checkpoints)
        self.checkpoint_bytes += sum(len(c.value_json) for c in harvest.checkpoints)
        return bool(await super().commit(run_id, token, harvest))


def turns_graph(checkpoint: bool, turns: int) -> tr.Graph:
    g = tr.Graph("turns_cost")

    async def long(n: int) -> int:
        ctx = current_node()
        assert ctx is not None
        for turn in range(turns):
            if checkpoint:
                ctx.checkpoint({"turn": turn + 1, "notes": "x" * 64})
            await asyncio.sleep(0.001)
        return turns

    g.add_node("long", long)
    return g


async def cost(workdir: Path, turns: int) -> tuple[Table, float]:
    table = Table(
        f"1. one node of {turns} turns on SQLite (async durability)",
        [Column("checkpoints"), Column("commits", right=True), Column("rows", right=True),
         Column("rows/commit", right=True), Column("bytes/commit", right=True),
         Column("wall", right=True)],
    )  # fmt: skip
    worst = 0.0
    for label, on in (("none", False), ("every turn", True)):
        store = CountingStore(workdir / f"cost-{label.replace(' ', '-')}.db")
        async with store:
            start = time.perf_counter()
            await tr.Engine(store=store).run(turns_graph(on, turns), 1)
            wall = time.perf_counter() - start
        per = store.checkpoint_rows / store.commits
        worst = max(worst, per)
        table.add_row(
            label, str(store.commits), str(store.checkpoint_rows), f"{per:.2f}",
            f"{store.checkpoint_bytes / store.commits:.0f}", fmt_seconds(wall),
        )  # fmt: skip
    return table, worst


async def crash(workdir: Path) -> tuple[Table, int]:
    sys.path.insert(0, str(ROOT))
    from tests.durable import checkpoint_graphs as graphs

    table = Table(
        "2. a 100-turn node SIGKILLed once turn 90 is committed, then resumed",
        [Column("durability"), Column("committed", right=True), Column("resumed at", right=True),
         Column("turns run twice", right=True)],
    )  # fmt: skip
    worst = 0
    for mode in ("sync",):
        db = workdir / f"crash-{mode}.db"
        log = workdir / f"crash-{mode}.log"
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.durable.checkpoint_graphs", str(db), "crash", str(log),
            cwd=ROOT,
        )  # fmt: skip
        async with open_store(db) as store:
            while True:
                try:
                    stored = await store.load_run("crash")
                    if any(int(c.value_json) >= 90 for c in stored.checkpoints):
                        break
                except tr.RunNotFound:
                    pass
                await asyncio.sleep(0.005)
            os.kill(child.pid, signal.SIGKILL)
            await child.wait()
            committed = int((await store.load_run("crash")).checkpoints[0].value_json)
            before = graphs.turns_done(log)
            graphs.LOG[:] = [log]
            await tr.Engine(store=store, durability=mode).resume("crash", graphs.graph)
        after = graphs.turns_done(log)[len(before) :]
        twice = len(set(after) & set(before))
        worst = max(worst, twice)
        table.add_row(mode, str(committed), str(after[0]), str(twice))
    return table, worst


def rounds_graph(lengths: dict[tuple[int, int], float], late: str, required: int) -> tr.Graph:
    g = tr.Graph(f"rounds_{late}")
    g.add_node("prompts", lambda r: [{"round": r, "p": p} for p in range(64)])

    async def rollout(prompt: dict[str, int]) -> dict[str, Any]:
        ctx = current_node()
        assert ctx is not None
        total = lengths[(prompt["round"], prompt["p"])]
        done = ctx.resumed_from.value if ctx.resumed_from else 0.0
        step = total / 4
        while done < total - 1e-9:
            await asyncio.sleep(min(step, total - done))
            done += min(step, total - done)
            ctx.checkpoint(done)
        return prompt

    g.add_node(
        "rollout", rollout, "map", required=required, late=late, resume_parked=late == "park"
    )
    g.chain("prompts", "rollout")
    return g


async def parking(rounds: int, median: float, seed: int) -> tuple[Table, dict[str, float]]:
    rng = random.Random(seed)
    lengths = {
        (r, p): median * rng.lognormvariate(0, 1.0) for r in range(rounds) for p in range(64)
    }
    slowest = sorted(lengths, key=lengths.__getitem__)[-len(lengths) // 10 :]
    table = Table(
        f"3. {rounds} rounds of 64 lognormal rollouts, keep 56 per round",
        [Column("policy"), Column("wall", right=True), Column("slowest decile completed", right=True),
         Column("still parked", right=True)],
    )  # fmt: skip
    shares: dict[str, float] = {}
    for label, late, required in (("park + resume_parked", "park", 56),
                                  ("cancel (discard)", "cancel", 56),
                                  ("wait for all 64", "record", 64)):  # fmt: skip
        engine = tr.Engine()
        graph = rounds_graph(lengths, late, required)
        completed: set[tuple[int, int]] = set()
        start = time.perf_counter()
        for r in range(rounds):
            result = await engine.run(graph, r)
            completed |= {(x["round"], x["p"]) for x in result.output}
        wall = time.perf_counter() - start
        share = sum(k in completed for k in slowest) / len(slowest)
        shares[label] = share
        kept = "-"
        if late == "park":
            parked = {
                (int(v["round"]), int(v["p"]))
                for row in await engine.parked(graph)
                for v in (json.loads(row.value_json),)
            }
            kept_share = sum(k in parked for k in slowest) / len(slowest)
            shares["parked"] = kept_share
            kept = f"{kept_share:.0%}"
        table.add_row(label, fmt_seconds(wall), f"{share:.0%}", kept)
    return table, shares


async def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seed", type=int, default=20261202)
    opts = parser.parse_args(argv)
    print(environment(no_gc=False))
    print()
    with tempfile.TemporaryDirectory(prefix="tailrace-cp-bench-") as tmp:
        workdir = Path(tmp)
        cost_table, rows_per_commit = await cost(workdir, 200)
        print(cost_table.render(), end="\n\n")
        crash_table, twice = await crash(workdir)
        print(crash_table.render(), end="\n\n")
    park_table, shares = await parking(4 if opts.quick else 10, 0.02, opts.seed)
    print(park_table.render(), end="\n\n")
    targets = Table("targets", [Column("target"), Column("measured", right=True), Column("")])
    targets.add_row("at most one checkpoint row per commit", f"{rows_per_commit:.2f}",
                    verdict(rows_per_commit <= 1.0))  # fmt: skip
    targets.add_row("a resumed 100-turn node repeats at most one turn", str(twice),
                    verdict(twice <= 1))  # fmt: skip
    park = shares["park + resume_parked"]
    kept = park + shares["parked"]
    targets.add_row("parking loses none of the slowest decile (completed or still parked)",
                    f"{kept:.0%}", verdict(kept >= 0.999))  # fmt: skip
    targets.add_row("parking completes more of the slowest decile than discarding",
                    f"{park:.0%} vs {shares['cancel (discard)']:.0%}",
                    verdict(park > shares["cancel (discard)"]))  # fmt: skip
    print(targets.render())


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
