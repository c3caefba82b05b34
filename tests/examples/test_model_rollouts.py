"""The model-rollouts example does what its docstring says, against the batching test server:
each step keeps the first ``KEEP`` samples, parks the rest with their partial tokens, and the
next step continues those first, under its newer model version."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("httpx")

import tailrace as tr
from tailrace.integrations.openai import BatchingServer, tail_accounting
from tailrace.stores import SQLiteStore
from tests import fixtures

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "model_rollouts.py"


@pytest.fixture(scope="module")
def example() -> object:
    return fixtures.load_module("example_model_rollouts", EXAMPLE)


async def test_each_step_keeps_k_and_continues_the_parked_first_under_the_new_version(
    example: object, tmp_path: Path
) -> None:
    keep, launch = example.KEEP, example.LAUNCH  # type: ignore[attr-defined]
    async with (
        BatchingServer(median_tokens=60, step=0.001) as server,
        SQLiteStore(tmp_path / "runs.db") as store,
    ):
        engine = tr.Engine(store=store)
        steps = [await example.step(engine, server.url, "m", n) for n in (1, 2, 3)]  # type: ignore[attr-defined]
        runs = [r.run_id for r, _ in steps]
        account = await tail_accounting(engine, example.graph, "rollout", runs)  # type: ignore[attr-defined]

    def whole(sample: dict[str, Any]) -> int:
        """The length of ``sample``'s whole generation (the server's lengths are fixed)."""
        return min(server.length(sample["prompt"], sample["seed"]), example.MAX_TOKENS)  # type: ignore[attr-defined]

    for number, (result, kept) in enumerate(steps, start=1):
        assert len(kept) == keep and len(result.late_inputs) == launch - keep
        assert all(x.reason == "parked" for x in result.late_inputs)
        assert {s["version"] for s in kept} == {f"v{number}"}
        assert all(s["tokens"] == whole(s) for s in kept)  # continued or not
        continued = [s for s in kept if s["salvaged"]]
        if number == 1:
            assert not continued
            continue
        # Parked samples go first, with a head start: some finish in this step, under its version.
        assert continued and all(s["stale"] and s["rounds"] >= 1 for s in continued)
        assert any(s["decoded"] for s in continued)
        for s in continued:  # each decodes the rest of its text here, unless its checkpoint held
            # it all: it finished, then was parked before its result was committed
            assert s["decoded"] > 0 or s["salvaged"] == whole(s), s
    assert account.accepted == 3 * keep and account.salvaged > 0
    assert account.parked == launch - keep and min(account.waiting.values()) >= 1
    assert account.wasted_share < 0.1  # a parked sample loses only what followed its checkpoint


async def test_the_script_runs_its_own_server_and_reports_the_account(
    example: object, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async with BatchingServer(median_tokens=30, step=0.001) as server:
        account = await example.train(server.url, "m", 2, tmp_path / "runs.db")  # type: ignore[attr-defined]
    out = capsys.readouterr().out
    assert out.count("kept 24 samples") == 2 and "wasted" in out
    assert account.accepted == 48
