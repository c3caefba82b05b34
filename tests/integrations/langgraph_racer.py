"""One racing process of ``test_langgraph_busy.py``'s cross-process race on parallel interrupts.

``python langgraph_racer.py STORE CHECKPOINTS LOG NAME`` opens its own store,
LangGraph connection and driver over :func:`lg_graphs.parallel_graph`, prints
``ready``, then for each JSON trial read from stdin (``{"left": QID, "right":
QID}``; ``{"quit": true}`` ends it) answers both questions and resumes both,
all at once, and prints one JSON line: what each of the four calls returned
(an outcome, or the exception's class name). It never sweeps: a ``busy``
answer must be applied by whoever held the thread.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

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


def _name(result: Any) -> str:
    return type(result).__name__ if isinstance(result, BaseException) else str(result)


async def race(store_path: Path, checkpoints: Path, log: Path, name: str) -> None:
    """Race every trial read from stdin; one JSON result line per trial."""
    from tailrace.integrations.langgraph import LangGraphDriver

    graphs = _graphs()
    with graphs.sync_saver(checkpoints) as cp:
        async with SQLiteStore(store_path) as store:
            driver = LangGraphDriver(graphs.parallel_graph(cp, log), store)
            print("ready", flush=True)
            while line := await asyncio.to_thread(sys.stdin.readline):
                trial = json.loads(line)
                if trial.get("quit"):
                    return
                left, right = trial["left"], trial["right"]
                results = await asyncio.gather(
                    driver.answer(left, f"{name}:L", by=name),
                    driver.answer(right, f"{name}:R", by=name),
                    driver.worker.resume(left),
                    driver.worker.resume(right),
                    return_exceptions=True,
                )
                print(json.dumps([_name(r) for r in results]), flush=True)


if __name__ == "__main__":
    if len(sys.argv) != 5:
        sys.exit("usage: langgraph_racer.py STORE CHECKPOINTS LOG NAME")
    store_arg, checkpoints_arg, log_arg, name_arg = sys.argv[1:]
    asyncio.run(race(Path(store_arg), Path(checkpoints_arg), Path(log_arg), name_arg))
