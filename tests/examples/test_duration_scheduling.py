"""The duration-scheduling example runs and shows what it claims (T1, T2)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "duration_scheduling.py"


def _load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("example_duration_scheduling", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def figures() -> dict[str, Any]:
    result: dict[str, Any] = _load_example().main()
    return result


def test_t1_example_reports_every_checkpoint(figures: dict[str, Any]) -> None:
    assert [row["rollouts"] for row in figures["convergence"]] == [3, 10, 30, 100, 300]


def test_t1_example_error_decreases_as_rollouts_accumulate(figures: dict[str, Any]) -> None:
    maes = [row["mae"] for row in figures["convergence"]]
    # Strictly decreasing is what this seed prints; over 300 seeds the error after
    # 300 rollouts is below the error after 3 in ~95% and below 0.02 s in ~95%.
    assert maes == sorted(maes, reverse=True)
    assert len(set(maes)) == len(maes)
    assert maes[-1] < maes[0] / 3
    assert maes[-1] < 0.02  # the typical rollout takes ~0.4 s


def test_t1_example_learns_parameters_near_the_truth(figures: dict[str, Any]) -> None:
    final = figures["convergence"][-1]
    truth = figures["truth"]
    assert final["m"] == pytest.approx(truth["m"], rel=0.05)
    assert final["b"] == pytest.approx(truth["b"], abs=0.02)


def test_t2_example_lpt_by_estimate_beats_round_robin(figures: dict[str, Any]) -> None:
    spans = figures["makespans"]
    assert spans["lower_bound"] <= spans["lpt_estimated"] <= spans["round_robin"]
    assert spans["lower_bound"] <= spans["lpt_oracle"]
    # Against round-robin, which ignores loads, ordering pays a lot on heavy tails.
    assert spans["round_robin"] >= 1.1 * spans["lpt_estimated"]
    assert spans["lpt_estimated"] <= 1.05 * spans["lower_bound"]


def test_t2_example_lpt_gain_over_a_greedy_queue_is_small(figures: dict[str, Any]) -> None:
    # The fair baseline is a work-conserving queue in arrival order (list scheduling):
    # it is already near the bound, so LPT's gain over it is a few percent, not 1.25x.
    spans = figures["makespans"]
    assert spans["lpt_estimated"] <= spans["list_arrival"] <= spans["round_robin"]
    assert spans["list_arrival"] <= 1.05 * spans["lpt_estimated"]
    assert (
        spans["round_robin"] / spans["lpt_estimated"]
        > 1.1
        > (spans["list_arrival"] / spans["lpt_estimated"])
    )


def test_example_prints_both_tables(capsys: pytest.CaptureFixture[str]) -> None:
    _load_example().main()
    out = capsys.readouterr().out
    assert "Estimator convergence" in out
    assert "LPT by learned estimate" in out
    assert "greedy queue (arrival order)" in out
    assert "over a greedy queue" in out
    assert "lower bound" in out
