"""Hardening of the evolution loops, through the public API.

The scripted domain: ten training tasks and ten held-out tasks ``h0..h9``
(``held_out_frac=0.5``); the ranking subset is ``h0 h1`` (``rank_size=2``).
An artifact's entry ``"solves"`` lists the held-out tasks it solves, so every
verdict is written by the test. One worker, one proposal per round: the sync
loop is deterministic.
"""

from __future__ import annotations

import asyncio
import json
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tailrace.evolve import (
    MIN_HELD_OUT,
    AuditScheduler,
    Edit,
    EvolutionResult,
    HeldOutTooSmall,
    Retry,
    Task,
    async_evolve,
    current_rollout,
    evolve,
)

HELD = [f"h{i}" for i in range(10)]


def _tasks() -> list[Task]:
    train = [Task(id=f"r{i}", prompt="") for i in range(10)]
    return [*train, *(Task(id=h, prompt="") for h in HELD)]


def _reward(task: Task, output: str) -> float:
    solved = output.split("solves: ", 1)[-1].split() if "solves: " in output else []
    return 1.0 if task.id in solved else 0.0


def _proposer(edits: list[Edit]) -> object:
    queue: Iterator[Edit] = iter(edits)

    def propose(rendered: str, task: Task, output: str, value: float) -> Edit | None:
        return next(queue, None)

    return propose


def solves(*tasks: str) -> Edit:
    return Edit(set={"solves": " ".join(tasks)})


async def _scripted(
    edits: list[Edit], audit: AuditScheduler, run: object = None, **options: object
) -> EvolutionResult:
    settings: dict[str, object] = {"artifact": {"solves": " ".join(HELD[:5])}, **options}
    return await evolve(
        _tasks(),
        _reward,
        run=run or (lambda rendered, task: rendered),  # type: ignore[arg-type]
        propose=_proposer(edits),
        held_out_frac=0.5,
        rank_size=2,
        workers=1,
        max_candidates=1,
        max_rollouts=len(edits),
        audit=audit,
        **settings,  # type: ignore[arg-type]
    )


# -- the cheap subset passes early or escalates, never vetoes ---------------------------


async def test_a_gain_the_subset_cannot_see_is_merged_and_the_target_reached():
    # The head solves h0..h4 (0.5); the edit solves all ten. On the subset (h0 h1) both
    # score 1.0: a coin flip. A trusted cheap layer with no oracle budget left must
    # still let the full comparison accept it.
    audit = AuditScheduler(initial_trust=1.0, oracle_budget=0)
    result = await _scripted([solves(*HELD)], audit, target=1.0)
    [sweep] = result.history
    assert sweep.route == "escalated" and sweep.accepted and sweep.reversed
    assert result.held_out == 1.0 and result.stop_reason == "target"
    assert result.commits == 1 and result.entries == {"solves": " ".join(HELD)}
    [reversal] = result.reversals
    assert reversal["kind"] == "reject_overturned" and reversal["version"] == 2


async def test_an_escalated_candidate_the_full_set_rejects_is_not_merged():
    audit = AuditScheduler(initial_trust=1.0)
    result = await _scripted([solves("h0", "h1")], audit)  # worse on the rest
    [sweep] = result.history
    assert sweep.route == "escalated" and not sweep.accepted and not sweep.reversed
    assert sweep.cheap_agreed is True and result.commits == 0 and result.reversals == ()


# -- the audit's verdict is the acceptance test's: never bought again -------------------


async def test_an_escalation_buys_no_audit_and_no_second_held_out_sweep():
    phases: list[str] = []

    def run(rendered: str, task: Task) -> str:
        ctx = current_rollout()
        assert ctx is not None
        phases.append(ctx.phase)
        return rendered

    audit = AuditScheduler(initial_trust=1.0)  # no budget limit: an audit could be bought
    result = await _scripted([solves(*HELD[:7])], audit, run=run)  # invisible on h0 h1
    [sweep] = result.history
    assert sweep.route == "escalated" and sweep.accepted and result.commits == 1
    # The initial scoring (10), the subset (2) and the rest (8): the audit's 8 are free.
    assert phases.count("eval") == 10 + 2 + 8 == result.eval_rollouts
    assert audit.oracle_used == 0 and result.audits == 0 and sweep.audits == 0


# -- loading a result refuses a bad file whole -------------------------------------------


def _saved(tmp_path: Path) -> dict[str, Any]:
    result = EvolutionResult(
        mode="sync", artifact_id="a", version=1, entries={}, rendered="", held_out=0.0
    )
    path = tmp_path / "good.json"
    result.save(path)
    return dict(json.loads(path.read_text()))


def _bad_files(tmp_path: Path) -> dict[str, str]:
    good = _saved(tmp_path)
    sweep = {
        "index": 1,
        "base_version": 1,
        "candidates": 1,
        "accepted": False,
        "version": 1,
        "probability": 0.5,
        "threshold": 0.55,
        "held_out": 0.5,
        "cheap_agreed": None,
    }
    return {
        "a JSON list": "[1, 2, 3]",
        "deep nesting": "[" * 100_000 + "]" * 100_000,
        "NaN reward": json.dumps({**good, "held_out": float("nan")}),
        "Infinity reward": json.dumps({**good, "initial_held_out": float("inf")}),
        "overflowing reward": json.dumps(good).replace('"held_out": 0.0', '"held_out": 1e999'),
        "reward above 1": json.dumps({**good, "held_out": 3.0}),
        "sweep with NaN": json.dumps({**good, "history": [{**sweep, "held_out": float("nan")}]}),
        "text for a number": json.dumps({**good, "rollouts": "many"}),
        "history not a list": json.dumps({**good, "history": 7}),
        "not JSON": "{",
    }


@pytest.mark.parametrize(
    "case",
    [
        "a JSON list",
        "deep nesting",
        "NaN reward",
        "Infinity reward",
        "overflowing reward",
        "reward above 1",
        "sweep with NaN",
        "text for a number",
        "history not a list",
        "not JSON",
    ],
)
def test_loading_a_bad_result_file_is_a_value_error_naming_the_file(tmp_path, case):
    path = tmp_path / "bad.json"
    path.write_text(_bad_files(tmp_path)[case])
    with pytest.raises(ValueError) as caught:
        EvolutionResult.load(path)
    assert str(path) in str(caught.value)
    assert type(caught.value) is ValueError


def test_a_good_result_file_still_loads(tmp_path):
    path = tmp_path / "good.json"
    path.write_text(json.dumps(_saved(tmp_path)))
    assert EvolutionResult.load(path).mode == "sync"


# -- a backend that always fails is an error, not an evolution ---------------------------


async def test_a_loop_whose_every_rollout_fails_says_the_backend_failed_with_its_message():
    def run(rendered: str, task: Task) -> str:
        raise ConnectionRefusedError("model server at 127.0.0.1:9 refused the connection")

    result = await evolve(
        _tasks(),
        _reward,
        run=run,
        propose=_proposer([]),
        held_out_frac=0.5,
        workers=2,
        max_rounds=2,
        retry=Retry(attempts=2, backoff=0.0),
    )
    assert result.stop_reason == "errors" and result.rollouts == 0
    assert result.failure is not None and result.failure.startswith("the backend failed")
    assert "ConnectionRefusedError: model server at 127.0.0.1:9 refused" in result.failure
    assert result.failed_units == 10 + 2 * 2  # the held-out scores and two rounds


async def test_a_loop_with_some_successes_still_returns_its_result():
    def run(rendered: str, task: Task) -> str:
        if task.id.startswith("r"):
            raise ConnectionRefusedError("training backend down")
        return rendered

    result = await evolve(
        _tasks(),
        _reward,
        run=run,
        propose=_proposer([]),
        held_out_frac=0.5,
        workers=2,
        max_rounds=2,
        retry=Retry(attempts=1),
    )
    assert result.stop_reason == "rounds" and result.failed_units == 4
    assert result.failure is None


# -- the initial scoring obeys the time limits -------------------------------------------

HANG_GUARD = 5.0  # seconds; the limits under test are 0.2-1 s


def _hangs_once_on(task_id: str, release: threading.Event) -> object:
    """A sync run that blocks its thread the first time it sees ``task_id``."""
    seen: set[str] = set()

    def run(rendered: str, task: Task) -> str:
        if task.id == task_id and task_id not in seen:
            seen.add(task_id)
            release.wait()
        return rendered

    return run


def _hangs_forever_on(task_id: str) -> object:
    async def run(rendered: str, task: Task) -> str:
        if task.id == task_id:
            await asyncio.Event().wait()
        return rendered

    return run


@pytest.mark.parametrize("loop", [evolve, async_evolve])
async def test_a_run_hanging_in_the_initial_scoring_is_cut_at_max_seconds(loop):
    async with asyncio.timeout(HANG_GUARD):
        result = await loop(
            _tasks(),
            _reward,
            run=_hangs_forever_on("h3"),
            propose=_proposer([solves(*HELD)]),
            held_out_frac=0.5,
            max_seconds=1.0,  # room for the nine quick rollouts on a loaded host
        )
    assert result.stop_reason == "max_seconds" and result.rollouts == 0
    assert result.failure is None  # the deadline cut it: no failure of the backend
    [cut] = result.errors
    assert cut.task_id == "h3" and cut.phase == "eval" and cut.error == "TimeoutError"
    assert "max_seconds" in cut.message


@pytest.mark.parametrize("loop", [evolve, async_evolve])
async def test_max_seconds_cutting_every_initial_rollout_is_no_backend_failure(loop):
    async def hangs(rendered: str, task: Task) -> str:
        await asyncio.Event().wait()
        return rendered

    async with asyncio.timeout(HANG_GUARD):
        result = await loop(
            _tasks(),
            _reward,
            run=hangs,
            propose=_proposer([solves(*HELD)]),
            held_out_frac=0.5,
            max_seconds=0.2,
        )
    assert result.stop_reason == "max_seconds" and result.failure is None
    assert result.rollouts == 0
    assert sorted(e.task_id for e in result.errors) == HELD


async def test_a_sync_run_blocking_its_thread_in_the_initial_scoring_is_abandoned():
    release = threading.Event()
    try:
        async with asyncio.timeout(HANG_GUARD):
            result = await evolve(
                _tasks(),
                _reward,
                run=_hangs_once_on("h3", release),
                propose=_proposer([]),
                artifact={"solves": " ".join(HELD[:5])},
                held_out_frac=0.5,
                workers=1,
                max_rounds=1,
                round_timeout=1.0,  # room for the nine quick rollouts on a loaded host
            )
    finally:
        release.set()  # frees the abandoned thread
    # round_timeout cuts the stuck held-out rollout (it scores 0) and the loop goes on.
    assert result.stop_reason == "rounds" and result.rollouts == 1
    [cut] = result.errors
    assert cut.task_id == "h3" and "round_timeout" in cut.message and "abandoned" in cut.message
    assert result.initial_held_out == 0.4  # h0..h4 solved, h3 cut


# -- a held-out set too small to mean anything is called out ------------------------------


@pytest.mark.parametrize("loop", [evolve, async_evolve])
async def test_a_held_out_set_under_the_minimum_warns_naming_its_size(loop):
    tasks = [Task(id=f"t{i}", prompt="") for i in range(8)]
    with pytest.warns(
        HeldOutTooSmall, match=rf"has 4 tasks, fewer than the minimum of {MIN_HELD_OUT}"
    ):
        await loop(tasks, _reward, run=lambda r, t: r, propose=_proposer([]), held_out_frac=0.5)


async def test_a_held_out_set_of_the_minimum_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error", HeldOutTooSmall)
        result = await evolve(
            _tasks(), _reward, run=lambda r, t: r, propose=_proposer([]), held_out_frac=0.5
        )
    assert result.stop_reason == "budget"
