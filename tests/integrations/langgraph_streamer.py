"""The driver process of ``test_langgraph_streams.py``'s fault test: it dies mid-stream.

``python langgraph_streamer.py STORE CHECKPOINTS HOLD`` drives thread ``t1``
of :func:`lg_graphs.streaming_graph` with a one-second lease. Its ``talk``
node streams five chunks, then, while the file ``HOLD`` exists, waits
forever: the test SIGKILLs this process there, mid-stream.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver

from tailrace.integrations.langgraph import LangGraphDriver
from tailrace.stores import SQLiteStore


def _graphs() -> object:
    spec = importlib.util.spec_from_file_location(
        "lg_graphs", Path(__file__).with_name("lg_graphs.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def main(store_path: str, checkpoints: str, hold: str) -> None:
    graphs = _graphs()
    async with (
        AsyncSqliteSaver.from_conn_string(checkpoints) as saver,
        SQLiteStore(store_path) as store,
    ):
        graph = graphs.streaming_graph(saver, Path(hold))  # type: ignore[attr-defined]
        driver = LangGraphDriver(graph, store, lease_ttl=1.0)
        await driver.start("t1", {"topic": "tides"})


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
