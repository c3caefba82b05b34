"""A re-run after a crash is the next try everywhere (E11, S1, S2, D3).

A real process drives a plain node and a map, each stuck in a first try that
streamed, and is SIGKILLed; a resume runs the cut tries again as try 2: the
events, the stream tags, ``tailrace tail`` and ``tailrace show`` all say so,
and none shows one try twice.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

import tailrace as tr
from tailrace.cli._app import app
from tailrace.stores import RunStore, open_store
from tests import fixtures
from tests.durable.test_checkpoints import shared_target

ROOT = Path(__file__).resolve().parents[2]
GUARD = 30.0
ENV: dict[str, str | None] = {"COLUMNS": "400", "TAILRACE_DB": None}


async def _streamed(store: RunStore, run_id: str, *texts: str) -> bool:
    try:
        rows = await store.chunks(run_id)
    except tr.RunNotFound:
        return False
    return set(texts) <= {r.data_json for r in rows}


def _tags(rows: list[tr.stores.ChunkRow]) -> list[tuple[str, int | None, int, str]]:
    return [(r.node_id, r.item, r.attempt, r.kind) for r in rows]


@pytest.mark.slow  # a child process per store, killed in the middle of two tries
@pytest.mark.parametrize("kind", fixtures.SHARED_STORES)
async def test_a_re_run_after_a_sigkill_is_the_next_try_everywhere(
    kind: str, tmp_path: Path
) -> None:
    from tests.durable import tries_graphs as graphs

    async with shared_target(kind, tmp_path) as target:
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.durable.tries_graphs", target, cwd=ROOT
        )
        try:
            async with open_store(target) as store:

                async def both_streamed() -> bool:
                    return await _streamed(
                        store, "tries-node", '"summarise try 1"'
                    ) and await _streamed(store, "tries-map", '"rollout 1 try 1"')

                await fixtures.until(both_streamed, "both first tries streamed", guard=GUARD)
                os.kill(child.pid, signal.SIGKILL)
                await child.wait()
                engine = tr.Engine(store=store)
                async with asyncio.timeout(GUARD):
                    node = await engine.resume("tries-node", graphs.node_graph)
                    mapped = await engine.resume("tries-map", graphs.map_graph)
                assert (node.output, mapped.output) == ("summary 7", [0, 1, 2])
                node_events = await store.events("tries-node")
                map_events = await store.events("tries-map")
                node_rows = await store.chunks("tries-node")
                map_rows = await store.chunks("tries-map")
        finally:
            if child.returncode is None:
                child.kill()
                await child.wait()

        starts = [e.attempt for e in node_events if e.type == "node_started"]
        assert starts == [1, 2]
        item_starts = [
            e.attempt
            for e in map_events
            if e.type == "node_started" and e.node_id == "rollout" and '"item":1' in e.data_json
        ]
        assert item_starts == [1, 2]
        assert _tags(node_rows) == [
            ("summarise", None, 1, "chunk"),
            ("summarise", None, 1, "discarded"),
            ("summarise", None, 2, "chunk"),
            ("summarise", None, 2, "accepted"),
        ]
        assert [r.data_json for r in node_rows if r.kind == "chunk"] == [
            '"summarise try 1"',
            '"summarise try 2"',
        ]
        item1 = [t for t in _tags(map_rows) if t[:2] == ("rollout", 1)]
        assert item1 == [
            ("rollout", 1, 1, "chunk"),
            ("rollout", 1, 1, "discarded"),
            ("rollout", 1, 2, "chunk"),
            ("rollout", 1, 2, "accepted"),
        ]

        tail = await _cli("tail", "tries-map", "--db", target, "--no-follow")
        assert tail.exit_code == 0, tail.output
        item_lines = [line.split(None, 1)[1] for line in tail.output.splitlines()
                      if "rollout[1] " in line]  # fmt: skip
        assert item_lines == [
            "rollout[1] v1 try 1 rollout 1 try 1",
            "rollout[1] v1 try 1 discarded",
            "rollout[1] v1 try 2 rollout 1 try 2",
            "rollout[1] v1 try 2 accepted (winner)",
        ]
        show = await _cli("show", "tries-node", "--db", target)
        assert show.exit_code == 0, show.output
        bars = [line.split("█")[0].strip() for line in show.output.splitlines()
                if line.startswith("summarise#1")]  # fmt: skip
        assert bars == ["summarise#1", "summarise#1 try 2"]  # the cut try, then the re-run
        # The cut try is drawn up to its last chunk (it streamed 0.2 s after its start, then
        # committed nothing more), marked cut, not as 0 ms at its start.
        cut, _ = [line for line in show.output.splitlines() if line.startswith("summarise#1")]
        start = next(e.ts for e in node_events if e.type == "node_started")
        chunk = next(r.ts for r in node_rows if r.kind == "chunk" and r.attempt == 1)
        assert cut.endswith(f" {(chunk - start) * 1000:.1f} ms cut"), cut
        assert chunk - start >= 0.2


async def _cli(*args: str) -> Result:
    """Run the command line in a thread (it runs its own event loop)."""
    return await asyncio.to_thread(CliRunner().invoke, app, list(args), env=ENV)
