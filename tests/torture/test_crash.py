"""Crash torture: real processes SIGKILLed at seeded random points, then resumed (D1-D3).

The harness is ``bench/torture.py`` (imported here by path; run it directly for
hundreds of kills: ``python bench/torture.py --kills 300``). Each store gets
at least ``KILLS`` kill points over short runs of a ~30-node graph (fan-out,
first-k aggregate, any_of, switch, self-loop). After every run the harness
checks that no node visit whose result was committed at a kill ran again after
it, that committed first-k decisions and running nodes' payloads were reused,
that every committed completion had its inputs committed, and that the final
results equal an uninterrupted run's.

``TAILRACE_TORTURE_SEED`` and ``TAILRACE_TORTURE_KILLS`` override the seed and
the kill count (a failure message names the seed).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.fixtures import POSTGRES_DSN, SHARED_STORES

pytestmark = pytest.mark.slow  # SIGKILLs a durable run at seeded moments, 30 times a store

BENCH_TORTURE = Path(__file__).resolve().parents[2] / "bench" / "torture.py"

KILLS = int(os.environ.get("TAILRACE_TORTURE_KILLS", "30"))
SEED = int(os.environ.get("TAILRACE_TORTURE_SEED", "20261129"))


def load_harness() -> ModuleType:
    """Import ``bench/torture.py`` by path (``bench/`` is not a package)."""
    name = "tailrace_bench_torture"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCH_TORTURE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file runs
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


@pytest.mark.parametrize("store", SHARED_STORES)
def test_sigkill_at_random_points_then_resume(store: str, tmp_path: Path) -> None:
    torture = load_harness()
    seed = SEED + (1 if store == "postgres" else 0)
    stats = torture.torture(store, KILLS, workdir=tmp_path, seed=seed, dsn=POSTGRES_DSN)
    report = f"store {store}, seed {seed} (TAILRACE_TORTURE_SEED={SEED}): {stats}\n" + "\n".join(
        stats.problems
    )
    assert stats.kills >= KILLS, report
    assert stats.reexec_committed == 0, report
    assert stats.mismatches == 0, report
    assert stats.runs_completed == stats.runs_started, report
    # The kills hit runs mid-flight (some results committed, some not), not only start-ups.
    assert stats.mid_run_kills >= KILLS // 5, report
    assert stats.resumes >= 1, report
