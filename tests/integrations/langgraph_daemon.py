"""A serve daemon for LangGraph threads, run as a subprocess by ``test_langgraph_serve.py``.

``python langgraph_daemon.py STORE CHECKPOINTS LOG CI_FILE POLLS_FILE`` serves
the threads of :func:`lg_graphs.team_graph` (checkpointed by LangGraph's sync
``SqliteSaver`` in ``CHECKPOINTS``) out of the tailrace SQLite store ``STORE``:
a :class:`~tailrace.gates.Server` with the driver as a target and one poller,
``ci``, which appends a line to ``POLLS_FILE`` on every poll and answers with
the JSON in ``CI_FILE`` once that file exists (None before: CI still runs).
SIGTERM stops it gracefully (exit 0); the tests SIGKILL it to play a crash.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import signal
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import tailrace as tr
from tailrace.gates import Server
from tailrace.integrations.langgraph import open_driver
from tailrace.stores import SQLiteStore


def _graphs() -> ModuleType:
    """``lg_graphs.py`` next to this file, imported by path (pytest imports this module too)."""
    key = "tailrace_tests_integrations_lg_graphs"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, Path(__file__).parent / "lg_graphs.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


def ci_poller(ci_file: Path, polls_file: Path) -> Any:
    """The ``ci`` poller: CI's verdict from ``ci_file`` once it is written, else None."""

    def poll(prompt: Any) -> Any:
        _graphs().log(polls_file, json.dumps(prompt))
        if not ci_file.exists():
            return None
        return json.loads(ci_file.read_text())

    return poll


async def serve(store_path: Path, checkpoints: Path, log: Path, ci: Path, polls: Path) -> None:
    """Serve until SIGTERM."""
    lg_graphs = _graphs()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    with lg_graphs.sync_saver(checkpoints) as cp:
        async with (
            SQLiteStore(store_path) as store,
            # a factory, as ``tailrace serve --langgraph module:factory`` would hand it over
            open_driver(lambda: lg_graphs.team_graph(cp, log), store, lease_ttl=2.0) as driver,
        ):
            engine = tr.Engine(store=store, lease_ttl=2.0)
            server = Server(
                engine,
                targets=[driver],
                pollers={"ci": ci_poller(ci, polls)},
                interval=0.02,
                max_interval=0.1,
            )
            await server.run(stop)


if __name__ == "__main__":
    paths = [Path(arg) for arg in sys.argv[1:]]
    if len(paths) != 5:
        sys.exit("usage: langgraph_daemon.py STORE CHECKPOINTS LOG CI_FILE POLLS_FILE")
    asyncio.run(serve(*paths))
