"""The demo domain, the evolve-demo command and the example."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import typer
from typer.testing import CliRunner

from tailrace.cli._evolve import evolve_demo, run_demo
from tailrace.evolve import DemoDomain
from tailrace.evolve._demo import route

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "evolve_demo.py"


def test_demo_is_deterministic_and_heavy_tailed():
    a, b = DemoDomain(seed=5), DemoDomain(seed=5)
    assert [t.prompt for t in a.tasks] == [t.prompt for t in b.tasks]
    lat = [a.rollout_latency(t, n) for t in a.tasks for n in range(1, 26)]
    spikes = sum(x > a.latency for x in lat) / len(lat)
    assert 0.10 < spikes < 0.20
    assert max(lat) == a.latency * 12


async def test_demo_proposer_is_noisy_but_mostly_right():
    demo = DemoDomain(n_tasks=200, seed=1, latency=0.0)
    right = 0
    for task in demo.tasks:
        edit = await demo.propose("", task, "unknown", 0.0)
        assert edit is not None
        right += next(iter(edit.set.values())) == task.meta["label"]
        assert await demo.propose("", task, task.meta["label"], 1.0) is None
    assert 0.6 < right / len(demo.tasks) < 0.9


def test_route_follows_the_first_matching_rule():
    rules = "When a message mentions 'refund', answer billing.\nnot a rule"
    assert route(rules, "a refund please") == "billing"
    assert route(rules, "refunds") == "unknown"


async def test_run_demo_both_modes_learn():
    for mode in ("async", "sync"):
        for selection in ("head", "pareto"):
            result = await run_demo(
                mode=mode, tasks=30, rollouts=60, latency=0.0, selection=selection, quality=0.3
            )
            assert result.mode == mode and result.held_out > result.initial_held_out
            assert result.selection == selection and result.cost > 0


def test_evolve_demo_command_prints_the_curve_and_saves(tmp_path):
    app = typer.Typer()
    app.command("evolve-demo")(evolve_demo)
    app.command("noop")(lambda: None)  # two commands: typer keeps the subcommand name
    out = tmp_path / "result.json"
    db = tmp_path / "ledger.db"
    args = ["evolve-demo", "--rollouts", "40", "--latency", "0", "--db", str(db)]
    result = CliRunner().invoke(app, [*args, "--save", str(out)])
    assert result.exit_code == 0, result.output
    assert "learning curve" in result.output and "held-out reward" in result.output
    assert (
        "time / cost to 0.75" in result.output and "tokens (prompt / completion)" in result.output
    )
    first = json.loads(out.read_text())
    assert first["usage"][0]["model"] == "demo-router" and first["cost"] > 0
    again = CliRunner().invoke(app, [*args, "--save", str(out), "--mode", "sync"])
    assert again.exit_code == 0, again.output
    second = json.loads(out.read_text())
    assert second["initial_held_out"] == first["held_out"]  # same --db: resumed
    bad = CliRunner().invoke(app, ["evolve-demo", "--mode", "nope"])
    assert bad.exit_code != 0
    bad = CliRunner().invoke(app, ["evolve-demo", "--selection", "nope"])
    assert bad.exit_code != 0 and "--selection" in bad.output


def test_example_runs_and_both_loops_improve(capsys):
    spec = importlib.util.spec_from_file_location("example_evolve_demo", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    figures = module.main(latency=0.0)
    for mode in ("async", "sync"):
        assert figures[mode]["held_out"] > figures[mode]["initial_held_out"]
        assert figures[mode]["rollouts"] == 200
    assert "final rules" in capsys.readouterr().out
