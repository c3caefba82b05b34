"""Evolution benchmark: the synchronous barrier vs the asynchronous loop, like for like (tailrace.evolve).

Run as::

    python bench/evolve.py [--repeats N] [--seeds N] [--quick]

agentdescent's setup throughout: 4 workers, rollouts of 4 ms, 12x that on 15%
of calls. In parts 1 and 2 the latencies are one seeded sequence shared by
both loops: the k-th training call of either loop sleeps ``L[k]``, so both
draw the same multiset and the "cap" below is computed from the very
latencies the runs drew. A proposer that never proposes keeps merges out.

1. **Barrier removal alone.** ``evolve`` (rounds: each waits for its slowest
   rollout) against ``async_evolve`` (no barrier), neither cutting anything.
   The latency model's cap is what zero-overhead loops would reach on this
   sequence: the sum over rounds of the round's maximum, over the makespan of
   greedy list scheduling of the same sequence on 4 workers (what workers
   pulling the next rollout when free do). In expectation it is ``E[max of
   4] / E[one] = 25.0 / 10.6 = 2.36x``.

2. **Each side with its best straggler tool**, at the same threshold (3x the
   4 ms typical latency): ``evolve(round_timeout=12 ms)`` cuts a round's
   unfinished rollouts (they are lost); ``async_evolve`` with a
   ``DurationEstimator`` flags a rollout past 3x its estimate and detaches it
   (``detach_stragglers``: its worker takes the next task, the straggler's
   result is used when it lands), or, in the ``cut`` row, cuts it and re-runs
   its task from a ``ResumeQueue``. Utilisation counts only attempts whose
   result was used: a cut attempt is waste, a detached one is not. Extra rows
   show both loops at a 2x threshold, for transparency.

3. **Time to held-out reward 0.75** on the demo domain (40 tasks, noisy
   proposer, the demo's own per-task latencies, held-out rollouts included),
   each side with its best tools: sync with ``round_timeout``; async with the
   estimator (stragglers detached, the merger's held-out rollouts hedged).
   Mean over the ``--seeds`` seeds both loops reached the bar on (a seed
   whose head stalls below it, see part 4, is left out and counted); time
   counts from the end of the initial scoring, which both pay alike.

4. **Single head vs Pareto selection** (GEPA): the demo domain at zero latency,
   held-out reward of the head after N training rollouts, ``--seeds`` seeds.

Nothing here asserts; the ``targets`` table reports PASS/MISS.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
from dataclasses import dataclass
from typing import Any

from _common import Column, Table, Target, environment, fmt_ratio, fmt_seconds, targets_table

from tailrace.evolve import (
    DemoDomain,
    EvolutionResult,
    Task,
    async_evolve,
    current_rollout,
    evolve,
)
from tailrace.tail import DurationEstimator, ResumeQueue, list_makespan

WORKERS = 4
LATENCY = 0.004
SPIKE, SPIKE_P = 12.0, 0.15
QUALITY = 0.75
# Stragglers arrive at ~15% of ~700 rollouts/s and run ~35 ms past the limit: about
# 4 are detached at any time, so room for 16 keeps a worker from ever waiting on one.
DETACH = 4 * WORKERS
CURVE_POINTS = (50, 100, 200, 400)
INF = float("inf")


@dataclass(frozen=True, slots=True)
class Config:
    """Command-line settings."""

    repeats: int
    seeds: int
    rollouts: int
    seed: int


def latency_sequence(n: int, seed: int) -> list[float]:
    """``n`` latencies of the model: ``LATENCY``, ``SPIKE`` times it with probability ``SPIKE_P``."""
    rng = random.Random(f"bench-evolve:{seed}")
    return [LATENCY * (SPIKE if rng.random() < SPIKE_P else 1.0) for _ in range(n)]


def analytic_cap() -> float:
    """``E[max of WORKERS] / E[one]`` under the latency model."""
    p_spike_round = 1.0 - (1.0 - SPIKE_P) ** WORKERS
    e_max = p_spike_round * SPIKE + (1.0 - p_spike_round)
    e_one = SPIKE_P * SPIKE + (1.0 - SPIKE_P)
    return e_max / e_one


def realized_cap(seq: list[float]) -> float:
    """Zero-overhead sync wall (rounds wait for their max) over async wall (list scheduling)."""
    rounds = sum(max(seq[i : i + WORKERS]) for i in range(0, len(seq), WORKERS))
    return rounds / list_makespan(seq, WORKERS)


class SequencedRun:
    """A ``run`` whose k-th training call sleeps ``seq[k]``; held-out calls do not sleep."""

    def __init__(self, seq: list[float]) -> None:
        self.seq = seq
        self.calls = 0

    async def __call__(self, rendered: str, task: Task) -> str:
        context = current_rollout()
        if context is not None and context.phase == "train":
            delay = self.seq[self.calls % len(self.seq)]
            self.calls += 1
            await asyncio.sleep(delay)
        return "unknown"


async def _never(*args: object) -> None:
    return None


async def _zero(task: Task, output: object) -> float:
    """The reward of parts 1 and 2 (async: a cheap reward stays on the loop, off the threads)."""
    return 0.0


def _tasks() -> list[Task]:
    return DemoDomain(n_tasks=40, seed=0, latency=0.0).tasks


async def _throughput(mode: str, seq: list[float], rollouts: int) -> EvolutionResult:
    run = SequencedRun(seq)
    common: dict[str, Any] = dict(run=run, propose=_never, workers=WORKERS, max_rollouts=rollouts)
    reward = _zero
    if mode.startswith("sync"):
        factor = {"sync": None, "sync+round_timeout": 3.0, "sync+round_timeout 2x": 2.0}[mode]
        timeout = None if factor is None else factor * LATENCY
        return await evolve(_tasks(), reward, round_timeout=timeout, **common)
    extra: dict[str, Any] = {}
    if mode.startswith("async+tail") and not mode.endswith("cut"):
        extra = dict(
            duration_estimator=DurationEstimator(prior=LATENCY),
            detach_stragglers=DETACH,
            straggler_factor=2.0 if mode.endswith("2x") else 3.0,
        )
    elif mode == "async+tail cut":
        extra = dict(
            duration_estimator=DurationEstimator(prior=LATENCY),
            resume_queue=ResumeQueue(max_attempts=rollouts),
        )
    return await async_evolve(_tasks(), reward, **extra, **common)


async def _best(modes: tuple[str, ...], cfg: Config, rollouts: int) -> dict[str, EvolutionResult]:
    """Best of ``repeats`` runs per mode, the modes interleaved so load drift hits all alike."""
    seq = latency_sequence(4 * rollouts, cfg.seed)
    best: dict[str, EvolutionResult] = {}
    for _ in range(cfg.repeats):
        for mode in modes:
            r = await _throughput(mode, seq, rollouts)
            if mode not in best or r.rollouts_per_second > best[mode].rollouts_per_second:
                best[mode] = r
    return best


def _throughput_table(title: str, best: dict[str, EvolutionResult], base: str) -> Table:
    table = Table(
        title,
        [
            Column("loop"),
            Column("rollouts", right=True),
            Column("wall", right=True),
            Column("rollouts/s", right=True),
            Column(f"vs {base}", right=True),
            Column("utilisation (used)", right=True),
            Column("busy", right=True),
            Column("stragglers", right=True),
        ],
    )
    base_rate = best[base].rollouts_per_second
    for mode, r in best.items():
        busy = sum(r.worker_busy) / (WORKERS * r.wall) if r.wall else 0.0
        table.add_row(
            mode,
            r.rollouts,
            fmt_seconds(r.wall),
            f"{r.rollouts_per_second:,.0f}/s",
            fmt_ratio(r.rollouts_per_second / base_rate),
            f"{r.utilisation:.1%}",
            f"{busy:.1%}",
            r.stragglers,
        )
    return table


async def barrier_alone(cfg: Config) -> list[Target]:
    best = await _best(("sync", "async"), cfg, cfg.rollouts)
    cap = realized_cap(latency_sequence(4 * cfg.rollouts, cfg.seed)[: cfg.rollouts])
    ratio = best["async"].rollouts_per_second / best["sync"].rollouts_per_second
    table = _throughput_table(
        f"1. Barrier removal alone: {WORKERS} workers, {LATENCY * 1e3:.0f} ms, "
        f"{SPIKE:.0f}x spikes on {SPIKE_P:.0%}, {cfg.rollouts} rollouts, no cutting "
        f"(best of {cfg.repeats})",
        best,
        "sync",
    )
    table.add_note(
        f"cap on the latencies drawn: {fmt_ratio(cap)} (model expectation "
        f"{fmt_ratio(analytic_cap())}); async reaches {ratio / cap:.1%} of it"
    )
    table.print()
    return [
        Target(
            "barrier removal: async/sync vs the latency cap",
            f"{ratio / cap:.1%} ({fmt_ratio(ratio)})",
            f">= 95% of {fmt_ratio(cap)}",
            ratio >= 0.95 * cap,
        )
    ]


async def best_tools(cfg: Config) -> list[Target]:
    modes = (
        "sync+round_timeout",
        "async+tail",
        "async+tail cut",
        "sync+round_timeout 2x",
        "async+tail 2x",
    )
    rollouts = 2 * cfg.rollouts
    best = await _best(modes, cfg, rollouts)
    table = _throughput_table(
        f"2. Each side with its best straggler tool, threshold 3x the typical latency, "
        f"{rollouts} rollouts (best of {cfg.repeats})",
        best,
        "sync+round_timeout",
    )
    table.add_note("utilisation (used): time in attempts whose result was used / (workers x wall)")
    table.add_note("busy: time in any attempt, cut ones included / (workers x wall)")
    table.print()
    tail, sync = best["async+tail"], best["sync+round_timeout"]
    ratio = tail.rollouts_per_second / sync.rollouts_per_second
    return [
        Target(
            "best tools: async+tail vs sync+round_timeout",
            fmt_ratio(ratio),
            ">= 1.50x",
            ratio >= 1.5,
        ),
        Target(
            "async+tail utilisation (used attempts)",
            f"{tail.utilisation:.1%}",
            ">= 97%",
            tail.utilisation >= 0.97,
        ),
    ]


async def _to_quality(mode: str, seed: int) -> EvolutionResult:
    demo = DemoDomain(n_tasks=40, seed=seed, latency=LATENCY)
    common: dict[str, Any] = dict(
        run=demo.run,
        propose=demo.propose,
        artifact=demo.initial,
        workers=WORKERS,
        max_rollouts=1500,
        max_seconds=10.0,  # a seed where the head stalls below the bar ends here
        target=QUALITY,
    )
    if mode == "sync":
        return await evolve(demo.tasks, demo.reward, round_timeout=3 * LATENCY, **common)
    return await async_evolve(
        demo.tasks,
        demo.reward,
        duration_estimator=DurationEstimator(prior=LATENCY),
        detach_stragglers=DETACH,
        **common,
    )


async def time_to_quality(cfg: Config) -> list[Target]:
    table = Table(
        f"3. Time to held-out reward {QUALITY}: demo domain, each side with its best tools, "
        f"{cfg.seeds} seeds",
        [
            Column("seed", right=True),
            Column("sync", right=True),
            Column("sync sweeps", right=True),
            Column("sync rollouts", right=True),
            Column("async", right=True),
            Column("async sweeps", right=True),
            Column("async rollouts", right=True),
            Column("hedged evals", right=True),
        ],
    )
    times: dict[str, list[float]] = {"sync": [], "async": []}
    for seed in range(cfg.seeds):
        row: list[object] = [seed]
        for mode in ("sync", "async"):
            r = await _to_quality(mode, seed)
            seconds = r.time_to_quality if r.time_to_quality is not None else INF
            times[mode].append(seconds)
            shown = fmt_seconds(seconds) if seconds < INF else "not reached"
            row += [shown, len(r.history), r.rollouts_to_quality or r.rollouts]
        row.append(r.eval_hedges)
        table.add_row(*row)
    both = [(s, a) for s, a in zip(times["sync"], times["async"], strict=True) if s + a < INF]
    reached = {mode: sum(t < INF for t in ts) for mode, ts in times.items()}
    mean_sync = statistics.fmean(s for s, _ in both) if both else INF
    mean_async = statistics.fmean(a for _, a in both) if both else INF
    ratio = mean_sync / mean_async if both else 0.0
    table.add_note(
        f"reached {QUALITY}: sync {reached['sync']}/{cfg.seeds}, async {reached['async']}/"
        f"{cfg.seeds} seeds (a seed whose head stalls below the bar is left out of the means)"
    )
    if both:
        table.add_note(
            f"mean over the {len(both)} seeds both reached: sync {fmt_seconds(mean_sync)}, "
            f"async {fmt_seconds(mean_async)}: async {fmt_ratio(ratio)} faster; median ratio "
            f"per seed {fmt_ratio(statistics.median(s / a for s, a in both))}"
        )
    table.print()
    ok = bool(both) and ratio >= 2 and reached["async"] >= reached["sync"]
    return [Target("time to held-out 0.75: sync/async (mean)", fmt_ratio(ratio), ">= 2.00x", ok)]


def _held_out_at(result: EvolutionResult, rollouts: int) -> float:
    value = result.initial_held_out
    for sweep in result.history:
        if sweep.rollouts <= rollouts:
            value = sweep.held_out
    return value


async def pareto_vs_head(cfg: Config) -> None:
    table = Table(
        f"4. Held-out reward after N rollouts, single head vs Pareto: demo domain, sync "
        f"rounds, zero latency, mean of {cfg.seeds} seeds (split and sampling seeded)",
        [
            Column("selection"),
            *(Column(f"N={n}", right=True) for n in CURVE_POINTS),
            Column("stuck below 1.0 at the end", right=True),
        ],
    )
    for selection in ("head", "pareto"):
        curves = []
        for seed in range(cfg.seeds):
            demo = DemoDomain(n_tasks=40, seed=seed, latency=0.0)
            r = await evolve(
                demo.tasks,
                demo.reward,
                run=demo.run,
                propose=demo.propose,
                artifact=demo.initial,
                max_rollouts=max(CURVE_POINTS),
                selection=selection,
                shuffle_seed=seed,
            )
            curves.append([_held_out_at(r, n) for n in CURVE_POINTS])
        means = [statistics.fmean(column) for column in zip(*curves, strict=True)]
        stuck = sum(curve[-1] < 1.0 for curve in curves)
        table.add_row(selection, *(f"{m:.3f}" for m in means), f"{stuck}/{cfg.seeds}")
    table.add_note(
        "the demo's proposer is deterministic given what it sees (temperature 0): once every "
        "failing task's proposal under the head is wrong, a single head stalls; Pareto parents "
        "show the proposer other contexts"
    )
    table.print()


async def main(cfg: Config) -> None:
    print(environment(no_gc=False), end="\n\n")
    targets = await barrier_alone(cfg)
    targets += await best_tools(cfg)
    targets += await time_to_quality(cfg)
    await pareto_vs_head(cfg)
    targets_table(targets).print()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2, help="runs per row; the best is kept")
    parser.add_argument("--seeds", type=int, default=8, help="seeds for parts 3 and 4")
    parser.add_argument("--seed", type=int, default=0, help="seed of the latency sequence")
    parser.add_argument("--quick", action="store_true", help="fewer rollouts (a smoke run)")
    args = parser.parse_args()
    rollouts = 100 if args.quick else 400
    asyncio.run(main(Config(args.repeats, args.seeds, rollouts, args.seed)))
