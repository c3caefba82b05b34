"""Generations under faults: the driving process SIGKILLed mid-generation then resumed, and the
server killed and restarted mid-stream (X2, X3, X6, D3), against the batching test server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

pytest.importorskip("httpx")

import tailrace as tr
from tailrace.integrations.openai import BatchingServer, ModelClient, tail_accounting
from tailrace.integrations.openai._server import generated_text
from tailrace.stores import Harvest, SQLiteStore
from tests import fixtures
from tests.faults import _faulty as faulty  # the hang guard
from tests.integrations.openai import rollout_graphs as graphs

ROOT = Path(__file__).resolve().parents[3]


def prompts_of(server: BatchingServer, quick: int, slow: int) -> list[str]:
    """``quick`` prompts of at most 15 tokens and ``slow`` ones of 80 to 400."""
    lengths = {p: server.length(p, None) for p in (f"fault {i}" for i in range(500))}
    short = [p for p, n in lengths.items() if n <= 15][:quick]
    long = [p for p, n in lengths.items() if 80 <= n <= 400][:slow]
    return short + long


@pytest.mark.slow  # a child process, SIGKILLed mid-generation
async def test_a_sigkill_mid_generation_resumes_from_the_checkpoints_and_reruns_no_finished_item(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = tmp_path / "runs.db"
    async with BatchingServer(median_tokens=40, step=0.01) as server:
        prompts = prompts_of(server, 3, 4)
        monkeypatch.setenv("ROLLOUT_URLS", server.url)
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.integrations.openai.rollout_graphs", str(db), "killed",
            server.url, *prompts, cwd=ROOT,
        )  # fmt: skip
        try:
            async with SQLiteStore(db) as store:

                async def partial_generations() -> dict[str, int] | None:
                    """Prompt -> tokens of each unfinished generation's committed checkpoint."""
                    try:
                        stored = await store.load_run("killed")
                    except tr.RunNotFound:
                        return None
                    partial = {}
                    for row in stored.checkpoints:
                        state = json.loads(row.value_json)["generation"]
                        if state["finish"] is None and state["tokens"] >= 8:
                            partial[prompts[row.item]] = state["tokens"]
                    return partial if len(partial) >= 2 else None

                await fixtures.until(partial_generations, "checkpoints of running generations")
                os.kill(child.pid, signal.SIGKILL)
                await child.wait()
                partial = await partial_generations()
                assert partial is not None
                requests_before = len(server.generations)
                accepted_before = await _accepted(store, prompts)
                result = await tr.Engine(store=store).resume("killed", graphs.graph)
        finally:
            if child.returncode is None:
                child.kill()
                await child.wait()
    assert child.returncode == -signal.SIGKILL
    assert result.status == "completed"
    by_prompt = {r["prompt"]: r for r in result.output}
    for prompt in prompts:  # every text as if never cut (X3)
        assert by_prompt[prompt]["text"] == generated_text(0, server.length(prompt, None))
    after = server.generations[requests_before:]
    for prompt, tokens in partial.items():  # continued from at least the committed checkpoint
        assert by_prompt[prompt]["salvaged"] >= tokens
        assert [prefix for p, prefix in after if p == prompt] == [by_prompt[prompt]["salvaged"]]
    resent = {p for p, _ in after}
    assert accepted_before, "some generation had finished and been committed before the kill"
    assert not resent & accepted_before  # D3: no completed item runs again


async def _accepted(store: SQLiteStore, prompts: list[str]) -> set[str]:
    """The prompts whose generation ended ``accepted`` in the stored stream (committed)."""
    chunks = await tr.Engine(store=store).stored_chunks("killed", limit=100_000)
    accepted = tr.ChunkKind.ACCEPTED
    return {prompts[c.item] for c in chunks if c.kind is accepted and c.item is not None}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.asynccontextmanager
async def server_process(port: int) -> AsyncIterator[asyncio.subprocess.Process]:
    """A batching server in a process of its own on ``port``; killed on the way out."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tailrace.integrations.openai", "--port", str(port),
        "--median-tokens", "40", "--step", "0.01", stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        async with asyncio.timeout(fixtures.HANG_GUARD):
            await process.stdout.readline()  # its URL: it listens
        yield process
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


@pytest.mark.slow  # two server processes, the first killed mid-stream
async def test_a_server_killed_and_restarted_mid_stream_is_retried_and_continued(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1"
    monkeypatch.setenv("ROLLOUT_URLS", url)
    twin = BatchingServer(median_tokens=40)  # the same lengths as the process's server
    prompt = next(p for p in (f"restart {i}" for i in range(500)) if twin.length(p, None) >= 150)
    async with SQLiteStore(tmp_path / "runs.db") as store:
        engine = tr.Engine(store=store)
        async with server_process(port) as first:
            run = asyncio.ensure_future(engine.run(graphs.graph, [prompt], run_id="restart"))

            async def streaming() -> bool:
                try:
                    chunks = await engine.stored_chunks("restart")
                except tr.RunNotFound:  # not committed yet
                    return False
                return (
                    sum(1 for c in chunks if isinstance(c.value, dict) and "text" in c.value) >= 20
                )

            await fixtures.until(streaming, "tokens streaming")
            first.send_signal(signal.SIGKILL)
            await first.wait()
        async with server_process(port):
            async with asyncio.timeout(fixtures.HANG_GUARD):
                result = await run
    [r] = result.output
    assert r["text"] == generated_text(0, twin.length(prompt, None))
    assert r["salvaged"] >= 20 - 4  # from its last checkpoint (every 4 tokens)
    chunks = await _chunks(tmp_path / "runs.db", "restart")
    marks = [(c.attempt, c.kind.value) for c in chunks if c.terminal]
    assert marks[-1][1] == "accepted" and all(k == "discarded" for _, k in marks[:-1])


async def test_a_busy_server_holds_a_rounds_connections_and_then_answers_each() -> None:
    """A round of rollouts connects by the thousand at once. While the server is busy (here:
    SIGSTOPped) the kernel holds every connection in its backlog, instead of dropping those
    past asyncio's default of 100 until their connects time out; once it runs, it answers each.
    """
    port = free_port()
    async with server_process(port) as server:
        server.send_signal(signal.SIGSTOP)
        try:
            async with asyncio.timeout(fixtures.HANG_GUARD):
                connections = await asyncio.gather(
                    *(asyncio.open_connection("127.0.0.1", port) for _ in range(1000))
                )
        finally:
            server.send_signal(signal.SIGCONT)
        request = f"GET /v1/models HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n\r\n".encode()

        async def models(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
            writer.write(request)
            await writer.drain()
            status = await reader.readline()
            writer.close()
            return status

        async with asyncio.timeout(fixtures.HANG_GUARD):
            answers = await asyncio.gather(*(models(r, w) for r, w in connections))
    assert answers == [b"HTTP/1.1 200 X\r\n"] * 1000


async def _chunks(db: Path, run_id: str) -> list[tr.Chunk]:
    async with SQLiteStore(db) as store:
        return await tr.Engine(store=store).stored_chunks(run_id, limit=100_000)


class HeldAtTheFinishedCheckpoint(SQLiteStore):
    """A SQLite store that holds the commit of a finished generation's last checkpoint (the
    one that carries the answer's usage, saved as the generation returns) until ``release``."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.reached = asyncio.Event()
        self.release = asyncio.Event()

    async def commit(self, run_id: str, token: int, harvest: Harvest) -> bool:
        finished = [json.loads(c.value_json)["generation"] for c in harvest.checkpoints]
        if any(g["finish"] and g["prompt_tokens"] for g in finished):
            self.reached.set()
            await self.release.wait()
        return await super().commit(run_id, token, harvest)


async def test_an_item_cancelled_while_its_finished_generation_commits_still_reports_its_usage(
    tmp_path: Path,
) -> None:
    """The generation's last checkpoint is committed before it returns; an attempt cancelled
    (parked) in that wait ends its stream with its usage, so the account has its tokens under
    the origin its continuation uses, and nothing stays parked in the account (X4)."""
    async with (
        BatchingServer(median_tokens=8, step=0.0005) as server,
        HeldAtTheFinishedCheckpoint(tmp_path / "runs.db") as store,
    ):
        engine = tr.Engine(store=store)
        usage: list[dict[str, object]] = []

        def seen(chunk: tr.Chunk) -> None:
            if isinstance(chunk.value, dict) and "usage" in chunk.value:
                usage.append(chunk.value["usage"])
                store.release.set()  # the cancelled attempt told its usage: let the commit go

        async with ModelClient(server.url, "m", version="v1") as client:

            def rounds(**options: object) -> tr.Graph:
                g = tr.Graph("cancelled_in_the_commit")

                async def rollout(prompt: str) -> dict[str, object]:
                    if prompt == "wins while the other waits for its commit":
                        await store.reached.wait()
                        return {}
                    generation = await client.complete(prompt, max_tokens=100)
                    return {"salvaged": generation.salvaged_tokens, "rounds": generation.rounds}

                g.add_node("rollout", rollout, "map", resume_parked=True, **options)
                return g

            prompt = "finishes, then waits for its commit"
            with engine.on_chunk("first", seen):
                one = await faulty.guarded(engine.run(
                    rounds(required=1, late="park"),
                    [prompt, "wins while the other waits for its commit"], run_id="first",
                ), "the first round")  # fmt: skip
            assert [(x.item, x.reason) for x in one.late_inputs] == [(0, "parked")]
            length = server.length(prompt, None)
            assert [(u["outcome"], u["tokens"], u["finish"]) for u in usage] == [
                ("cancelled", length, "stop")
            ]
            two = await engine.run(rounds(), [], run_id="second")
        assert two.output == [{"salvaged": length, "rounds": 1}]
        account = await tail_accounting(engine, "cancelled_in_the_commit", "rollout",
                                        ["first", "second"])  # fmt: skip
    assert (account.launched, account.accepted, account.parked) == (1, 1, 0)
    assert (account.decoded, account.wasted, account.max_rounds) == (length, 0, 1)
