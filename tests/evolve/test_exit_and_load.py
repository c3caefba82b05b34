"""Issue 9, finding 12: an abandoned sync rollout never holds the interpreter open, and
results saved by older versions (before ``Sweep`` had ``rollouts``/``elapsed``) still load.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tailrace.evolve import EvolutionResult, Sweep

# Generous: the script itself needs about a second; an unfixed build never exits.
EXIT_GUARD = 120.0

_SCRIPT = textwrap.dedent(
    """
    import asyncio, sys, threading
    from tailrace.evolve import Task, current_rollout, evolve, async_evolve
    from tailrace.tail import DurationEstimator, ResumeQueue

    NEVER = threading.Event()  # never set: the first training rollout of t0 blocks for ever

    class Scripted(DurationEstimator):
        # t0 (cost 7) gets a 5 ms timer, everything else an hour: only t0 straggles.
        def estimate(self, cost):
            return 0.001 if cost == 7.0 else 3600.0

    def run(rendered, task):  # a *sync* callable: it runs on a thread
        ctx = current_rollout()
        if task.id == "t0" and ctx.phase == "train" and not ctx.resumed:
            NEVER.wait()
        return "ok"

    tasks = [Task(id=f"t{i}", prompt="", meta={"cost": 7.0 if i == 0 else 1.0}) for i in range(8)]
    common = dict(run=run, propose=lambda *a: None, workers=2, max_rollouts=4, held_out_frac=0.5)
    if sys.argv[1] == "sync":
        coro = evolve(tasks, lambda t, o: 1.0, round_timeout=0.2, **common)
    else:
        coro = async_evolve(
            tasks, lambda t, o: 1.0, duration_estimator=Scripted(),
            resume_queue=ResumeQueue(max_attempts=1), **common,
        )
    result = asyncio.run(coro)
    print("returned", result.stragglers, result.rollouts, flush=True)
    """
)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_cut_sync_rollout_does_not_hold_the_process_open(tmp_path: Path, mode: str) -> None:
    script = tmp_path / "blocked_rollout.py"
    script.write_text(_SCRIPT)
    try:
        done = subprocess.run(
            [sys.executable, str(script), mode],
            capture_output=True,
            text=True,
            timeout=EXIT_GUARD,  # on expiry the child is SIGKILLed and the test fails
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{mode}: the process did not exit after evolve returned: {exc.stdout!r}")
    assert done.returncode == 0, done.stderr
    word, stragglers, _ = done.stdout.split()
    assert word == "returned" and int(stragglers) >= 1  # t0 was cut and left blocked


def _old_result() -> dict:
    """A result as saved before Sweep gained ``rollouts`` and ``elapsed``."""
    sweep = {
        "index": 1,
        "base_version": 1,
        "candidates": 2,
        "accepted": True,
        "version": 2,
        "probability": 0.9,
        "threshold": 0.55,
        "held_out": 0.5,
        "cheap_agreed": True,
    }
    return {
        "format": 1,
        "mode": "sync",
        "artifact_id": "a",
        "version": 2,
        "entries": {"x": "y"},
        "rendered": "x: y",
        "held_out": 0.5,
        "history": [sweep],
        "stop_reason": "budget",
        "rollouts": 8,
    }


def test_a_result_saved_before_sweep_had_rollouts_and_elapsed_loads(tmp_path: Path) -> None:
    path = tmp_path / "old.json"
    path.write_text(json.dumps(_old_result()))
    loaded = EvolutionResult.load(path)
    [sweep] = loaded.history
    assert isinstance(sweep, Sweep)
    assert (sweep.index, sweep.version, sweep.accepted) == (1, 2, True)
    assert (sweep.rollouts, sweep.elapsed) == (0, 0.0)
    assert loaded.learning_curve() == [(0, 0.0), (0, 0.5)]


def test_a_sweep_missing_a_required_field_is_named() -> None:
    data = _old_result()
    del data["history"][0]["accepted"]
    with pytest.raises(
        ValueError, match=r"history\[0\] is missing required fields: \['accepted'\]"
    ):
        EvolutionResult.from_dict(data)
    data["history"] = ["not a sweep"]
    with pytest.raises(ValueError, match=r"history\[0\] must be a JSON object"):
        EvolutionResult.from_dict(data)


async def test_errors_usage_and_reversals_survive_save_and_load(tmp_path: Path) -> None:
    from tailrace.evolve import FailedAttempt, Retry, Task, Usage, evolve, record_usage

    calls = {"n": 0}

    def run(rendered: str, task: Task) -> str:
        calls["n"] += 1
        record_usage(model="m", prompt_tokens=3, completion_tokens=1)
        if calls["n"] % 3 == 0:
            raise ConnectionError("dropped")
        return rendered

    tasks = [Task(id=f"t{i}", prompt="") for i in range(8)]
    result = await evolve(
        tasks,
        lambda t, o: 0.0,
        run=run,
        propose=lambda *a: None,
        max_rollouts=8,
        retry=Retry(backoff=0.0),
    )
    assert result.errors and all(isinstance(e, FailedAttempt) for e in result.errors)
    path = tmp_path / "result.json"
    result.save(path)
    loaded = EvolutionResult.load(path)
    assert loaded == result
    assert isinstance(loaded.usage[0], Usage) and isinstance(loaded.errors[0], FailedAttempt)
