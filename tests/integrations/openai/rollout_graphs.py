"""A map of generations for fault tests: one generation per prompt, retried from its checkpoint.

``python -m tests.integrations.openai.rollout_graphs DB RUN_ID URL[,URL...] PROMPT...`` runs
it in a process of its own (to be SIGKILLed); the test resumes it in its own process with
:data:`graph`. The client is made per event loop (httpx's connections belong to one).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import tailrace as tr
from tailrace.integrations.openai import CompletionError, ModelClient
from tailrace.stores import SQLiteStore

_clients: dict[int, ModelClient] = {}


def client() -> ModelClient:
    """This event loop's client, on the URLs of ``ROLLOUT_URLS``."""
    loop = id(asyncio.get_running_loop())
    if loop not in _clients:
        urls = os.environ["ROLLOUT_URLS"].split(",")
        _clients[loop] = ModelClient(
            urls, os.environ.get("ROLLOUT_MODEL", "m"), version=os.environ.get("ROLLOUT_VERSION", "v1"),
            checkpoint_every=int(os.environ.get("ROLLOUT_CHECKPOINT_EVERY", "4")),
            checkpoint_interval=0.1, timeout=float(os.environ.get("ROLLOUT_TIMEOUT", "30")),
        )  # fmt: skip
    return _clients[loop]


async def rollout(prompt: str) -> dict[str, Any]:
    log = os.environ.get("ROLLOUT_LOG")
    if log:  # each generation call, with what it resumes from: a finished item never shows again
        ctx = tr.current_node()
        resumed = ctx.resumed_from if ctx is not None else None
        line = json.dumps({"prompt": prompt, "resumed": resumed is not None}) + "\n"
        with Path(log).open("a") as out:  # noqa: ASYNC230 - one short line, flushed at once
            out.write(line)
    generation = await client().complete(
        prompt, max_tokens=int(os.environ.get("ROLLOUT_MAX_TOKENS", "10000")), temperature=0.0
    )
    return {
        "prompt": prompt, "text": generation.text, "salvaged": generation.salvaged_tokens,
        "decoded": generation.decoded_tokens, "finish": generation.finish_reason,
    }  # fmt: skip


graph = tr.Graph("llm_rollouts")
graph.add_node(
    "rollout", rollout, "map",
    retry=tr.RetryPolicy(attempts=6, backoff=0.3, resume=True, retry_on=(CompletionError,)),
)  # fmt: skip


async def _main(db: str, run_id: str, prompts: list[str]) -> None:
    async with SQLiteStore(db) as store:
        await tr.Engine(store=store).run(graph, prompts, run_id=run_id)


if __name__ == "__main__":
    os.environ["ROLLOUT_URLS"] = sys.argv[3]
    asyncio.run(_main(sys.argv[1], sys.argv[2], sys.argv[4:]))
