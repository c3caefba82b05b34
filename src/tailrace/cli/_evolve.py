"""``tailrace evolve-demo``: the synthetic routing domain with a progress bar and a learning curve.

Register it on the CLI app with ``app.command("evolve-demo")(evolve_demo)``.
Needs the ``cli`` extra (typer, rich). Paths and locations the user typed
are printed through :func:`tailrace.cli._render.text` (never read as
markup, CONVENTIONS 15); a store that cannot be opened or a result that
cannot be saved is one ``error:`` line and exit code 1, as in every command
(:mod:`tailrace.cli._session`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..evolve._async import async_evolve
from ..evolve._demo import DEMO_PRICES, DemoDomain
from ..evolve._options import Progress as EvolveProgress
from ..evolve._result import EvolutionResult
from ..evolve._sync import evolve
from ..stores import RunStore
from ..tail import DurationEstimator, ResumeQueue
from ._render import text
from ._session import fail, finish, opened


async def run_demo(
    *,
    mode: str = "async",
    tasks: int = 40,
    workers: int = 4,
    rollouts: int = 200,
    seed: int = 0,
    latency: float = 0.004,
    noise: float = 0.25,
    target: float | None = None,
    quality: float | None = 0.75,
    selection: str = "head",
    store: RunStore | None = None,
    on_progress: Callable[[EvolveProgress], None] | None = None,
) -> EvolutionResult:
    """Evolve the demo domain's routing rules and return the result.

    Args:
        mode: ``"async"`` (workers + merger, with straggler re-runs) or ``"sync"`` (rounds).
        tasks: How many demo tasks.
        workers: How many workers.
        rollouts: The training rollout budget.
        seed: Seeds the domain.
        latency: Base rollout latency in seconds (spikes are 12x, 15% of the time).
        noise: Probability that a proposal is wrong.
        target: Stop once the held-out reward reaches this.
        quality: Report time and cost to this held-out reward (``time_to_quality``).
        selection: ``"head"`` or ``"pareto"``.
        store: Where the ledger lives (in memory when None).
        on_progress: Called with each :class:`~tailrace.evolve.Progress`.
    """
    if mode not in ("async", "sync"):
        raise ValueError(f"mode must be 'async' or 'sync', got {mode!r}")
    demo = DemoDomain(n_tasks=tasks, seed=seed, latency=latency, noise=noise)
    common: dict[str, Any] = dict(
        run=demo.run,
        propose=demo.propose,
        artifact=demo.initial,
        store=store,
        artifact_id=f"demo-routing-{seed}",
        workers=workers,
        max_rollouts=rollouts,
        target=target,
        quality=quality,
        selection=selection,
        prices=DEMO_PRICES,
        progress=on_progress,
    )
    if mode == "sync":
        return await evolve(demo.tasks, demo.reward, **common)
    return await async_evolve(
        demo.tasks,
        demo.reward,
        duration_estimator=DurationEstimator(prior=latency),
        resume_queue=ResumeQueue(max_attempts=1),
        **common,
    )


def curve_table(result: EvolutionResult) -> Table:
    """The learning curve as a rich table: rollouts, version and held-out reward per commit.

    Args:
        result: The evolution's result.
    """
    table = Table(title=f"learning curve ({result.mode})")
    for header in ("rollouts", "version", "held-out", "P(beats base)", ""):
        table.add_column(header, justify="right" if header else "left")
    table.add_row("0", "1", f"{result.initial_held_out:.3f}", "", "")
    for sweep in result.history:
        if sweep.version != sweep.base_version:
            bar = "#" * round(sweep.held_out * 30)
            table.add_row(
                str(sweep.rollouts),
                str(sweep.version),
                f"{sweep.held_out:.3f}",
                f"{sweep.probability:.3f}",
                bar,
            )
    return table


def summary_table(result: EvolutionResult) -> Table:
    """Counters and figures of a result as a two-column rich table.

    Args:
        result: The evolution's result.
    """
    table = Table(title="evolution", show_header=False)
    rows = {
        "stop reason": result.stop_reason,
        "final version": str(result.version),
        "held-out reward": f"{result.initial_held_out:.3f} -> {result.held_out:.3f}",
        "rollouts (train / eval)": f"{result.rollouts} / {result.eval_rollouts}",
        "proposals / commits": f"{result.proposals} / {result.commits}",
        "stale proposals dropped": str(result.stale_dropped),
        "stragglers / resumed": f"{result.stragglers} / {result.resumed}",
        "rollouts/s": f"{result.rollouts_per_second:,.1f}",
        "worker utilisation": f"{result.utilisation:.1%}",
        "cheap-ranking trust": f"{result.audit_trust:.2f}",
        "audits bought / reversals": f"{result.audits} / {len(result.reversals)}",
        "calls / failed attempts": f"{result.calls} / {len(result.errors)}",
        "tokens (prompt / completion)": " / ".join(
            f"{sum(getattr(u, f) for u in result.usage):,}"
            for f in ("prompt_tokens", "completion_tokens")
        ),
        "cost": f"{result.cost:.6f}",
    }
    if result.quality is not None:
        reached = result.time_to_quality is not None
        rows[f"time / cost to {result.quality:.2f}"] = (
            f"{result.time_to_quality:.2f} s / {result.cost_to_quality:.6f}"
            if reached
            else "not reached"
        )
    for key, value in rows.items():
        table.add_row(key, value)
    return table


def progress_bar(console: Console) -> Progress:
    """The demo's progress bar: rollouts done, head version and held-out reward.

    Args:
        console: Where it is drawn.
    """
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("v{task.fields[version]} held-out {task.fields[held_out]:.3f}"),
        TimeElapsedColumn(),
        console=console,
    )


def evolve_demo(
    mode: Annotated[str, typer.Option(help="async (workers + merger) or sync (rounds).")] = "async",
    tasks: Annotated[int, typer.Option(min=4, help="How many synthetic tasks.")] = 40,
    workers: Annotated[int, typer.Option(min=1, help="How many rollout workers.")] = 4,
    rollouts: Annotated[int, typer.Option(min=0, help="Training rollout budget.")] = 200,
    seed: Annotated[int, typer.Option(help="Seed of the synthetic domain.")] = 0,
    latency: Annotated[float, typer.Option(min=0.0, help="Base rollout latency (s).")] = 0.004,
    target: Annotated[
        float | None, typer.Option(min=0.0, max=1.0, help="Stop at this held-out reward.")
    ] = None,
    quality: Annotated[
        float, typer.Option(min=0.0, max=1.0, help="Report time and cost to this reward.")
    ] = 0.75,
    selection: Annotated[str, typer.Option(help="head (one head) or pareto (GEPA pool).")] = "head",
    db: Annotated[
        str | None, typer.Option("--db", help="Keep the ledger in this store (default: memory).")
    ] = None,
    save: Annotated[
        Path | None, typer.Option("--save", help="Write the result as JSON here.")
    ] = None,
) -> None:
    """Evolve keyword-routing rules on a synthetic heavy-tailed domain and print the learning curve.

    Running it again with the same --db resumes the evolution kept there.
    """
    console = Console()
    if mode not in ("async", "sync"):
        raise typer.BadParameter("must be 'async' or 'sync'", param_hint="--mode")
    if selection not in ("head", "pareto"):
        raise typer.BadParameter("must be 'head' or 'pareto'", param_hint="--selection")
    if save is not None and not save.parent.is_dir():  # refused before the run, not after it
        fail(f"cannot save the result to {save}: there is no directory {save.parent}")

    async def demo(store: RunStore | None) -> EvolutionResult:
        with progress_bar(console) as bar:
            job = bar.add_task(f"evolve ({mode})", total=rollouts, version=1, held_out=0.0)

            def on_progress(p: EvolveProgress) -> None:
                bar.update(job, completed=p.rollouts, version=p.version, held_out=p.held_out)

            return await run_demo(
                mode=mode,
                tasks=tasks,
                workers=workers,
                rollouts=rollouts,
                seed=seed,
                latency=latency,
                target=target,
                quality=quality,
                selection=selection,
                store=store,
                on_progress=on_progress,
            )

    async def main() -> EvolutionResult:
        if not db:
            return await demo(None)
        # Opened before the bar shows: a store that cannot be opened is one error line.
        async with opened(db) as store:
            return await demo(store)

    result = finish(main)
    console.print(curve_table(result))
    console.print(summary_table(result))
    if save is not None:
        try:
            result.save(save)
        except OSError as exc:
            fail(f"cannot save the result to {save}: {exc.strerror or exc}")
        console.print(text("result saved to ", str(save)))
