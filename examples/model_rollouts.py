"""RL-style rollouts on an inference server: groups of samples per prompt, over-provisioned,
the first k kept, the rest parked with their partial tokens and continued first next round
under the newer model version.

Each training step needs ``KEEP`` samples. It launches ``LAUNCH`` (the parked samples of the
last step first, then ``SAMPLES`` new samples of each new prompt), keeps the first ``KEEP``
to finish, and parks the others: each is cancelled at the server, and keeps what it had
decoded in its checkpoint. The next step's map takes the parked samples first and continues
each from its partial text under that step's model version (``Generation.stale`` says the
text spans two versions). ``tail_accounting`` reads back what it cost: tokens decoded,
salvaged and wasted, the length bias of what was kept, how long parked samples waited.

Against any OpenAI-compatible server (vLLM, SGLang, llama.cpp)::

    python examples/model_rollouts.py --url http://127.0.0.1:8000/v1 --model my-model

Without ``--url`` it starts the project's batching test server, whose lengths are
lognormal, as RL traces show.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path
from typing import Any

import tailrace as tr
from tailrace.integrations.openai import (
    BatchingServer,
    CompletionError,
    ModelClient,
    TailAccount,
    tail_accounting,
)
from tailrace.stores import SQLiteStore

#: Samples kept per step, samples per prompt, and samples launched per step.
KEEP, SAMPLES, LAUNCH = 24, 4, 32
#: The longest sample, in tokens.
MAX_TOKENS = 2048

#: The client of the current step: the step's model version (its weights) changes each step.
current: dict[str, ModelClient] = {}

graph = tr.Graph("model_rollouts")


@graph.task()
def samples(step: dict[str, Any]) -> list[dict[str, Any]]:
    """The step's new samples: ``SAMPLES`` per prompt, as many as leave room for the parked."""
    room = LAUNCH - step["parked"]
    return [
        {"prompt": f"step {step['step']} problem {i // SAMPLES}", "seed": i % SAMPLES}
        for i in range(room)
    ]


@graph.map(
    required=KEEP,
    late="park",
    resume_parked=True,
    retry=tr.RetryPolicy(attempts=4, backoff=0.5, resume=True, retry_on=(CompletionError,)),
)
async def rollout(sample: dict[str, Any]) -> dict[str, Any]:
    """One sample: a generation that streams, checkpoints, and continues where it stopped."""
    generation = await current["client"].complete(
        sample["prompt"], max_tokens=MAX_TOKENS, temperature=1.0, seed=sample["seed"]
    )
    return {
        **sample,
        "tokens": generation.completion_tokens,
        "salvaged": generation.salvaged_tokens,
        "decoded": generation.decoded_tokens,
        "rounds": generation.rounds,
        "stale": generation.stale,
        "version": generation.version,
    }


graph.chain("samples", "rollout")


async def step(
    engine: tr.Engine, url: str | list[str], model: str, number: int
) -> tuple[tr.RunResult, list[dict[str, Any]]]:
    """One training step under model version ``v{number}``: its run and its kept samples."""
    parked = len(await engine.parked(graph, "rollout"))
    async with ModelClient(url, model, version=f"v{number}") as client:
        current["client"] = client
        result = await engine.run(graph, {"step": number, "parked": parked})
    return result, list(result.output)


async def train(url: str | list[str], model: str, steps: int, db: Path) -> TailAccount:
    """Run ``steps`` steps and return the tail's account of them."""
    async with SQLiteStore(db) as store:
        engine = tr.Engine(store=store)
        runs = []
        for number in range(1, steps + 1):
            result, kept = await step(engine, url, model, number)
            runs.append(result.run_id)
            continued = [s for s in kept if s["salvaged"]]
            print(
                f"step {number}: kept {len(kept)} samples, {len(continued)} continued from a "
                f"parked checkpoint ({sum(s['stale'] for s in continued)} under a newer version), "
                f"{len(result.late_inputs)} parked"
            )
        account = await tail_accounting(engine, graph, "rollout", runs)
    print(
        f"tokens: {account.decoded} decoded, {account.salvaged} salvaged, {account.wasted} "
        f"wasted ({100 * account.wasted_share:.1f}%); KS(accepted, launched) = {account.ks:.3f}; "
        f"parked now: {account.parked}, the longest wait: {account.max_rounds} rounds"
    )
    return account


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--url", action="append", help="an API root (repeat for replicas)")
    parser.add_argument("--model", default="batching")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.url:
            await train(args.url, args.model, args.steps, Path(tmp) / "runs.db")
            return
        async with BatchingServer(median_tokens=60, step=0.001) as server:
            await train(server.url, args.model, args.steps, Path(tmp) / "runs.db")


if __name__ == "__main__":
    asyncio.run(main())
