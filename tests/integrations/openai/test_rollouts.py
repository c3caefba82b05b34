"""Generations as map items (X1-X5): losers stopped at the server, parked items continued in
the next round under a newer model version, cut streams retried from their checkpoint, and the
tail's account of it all, against the batching test server and a SQLite store."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("httpx")

import tailrace as tr
from tailrace.graph import MAX_PARKS
from tailrace.integrations.openai import (
    BatchingServer,
    CompletionError,
    ModelClient,
    tail_accounting,
)
from tailrace.integrations.openai._server import generated_text
from tailrace.stores import SQLiteStore
from tests import fixtures


@pytest.fixture
async def server() -> AsyncIterator[BatchingServer]:
    async with BatchingServer(median_tokens=40, sigma=1.0, step=0.001) as srv:
        yield srv


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[tr.Engine]:
    async with SQLiteStore(tmp_path / "runs.db") as store:
        yield tr.Engine(store=store)


def rollouts(clients: dict[str, ModelClient], **options: Any) -> tr.Graph:
    """A map of generations, one per prompt, through ``clients["now"]`` (swapped between rounds)."""
    g = tr.Graph("rollouts")

    async def rollout(prompt: str) -> dict[str, Any]:
        generation = await clients["now"].complete(prompt, max_tokens=10_000)
        return {
            "prompt": prompt, "text": generation.text, "salvaged": generation.salvaged_tokens,
            "stale": generation.stale, "rounds": generation.rounds,
        }  # fmt: skip

    g.add_node("rollout", rollout, "map", **options)
    return g


def spread(server: BatchingServer, quick: int, slow: int) -> list[str]:
    """``quick`` prompts of at most 10 tokens and ``slow`` ones of 60 or more: the first k are
    known, with room for the decision before any loser can finish."""
    lengths = {p: server.length(p, None) for p in (f"prompt {i}" for i in range(400))}
    short = [p for p, n in lengths.items() if n <= 10][:quick]
    long = [p for p, n in lengths.items() if n >= 60][:slow]
    return sorted(short + long)


async def test_late_cancel_closes_the_losers_requests_and_the_server_stops(server, engine):
    async with ModelClient(server.url, "m", version="v1") as client:
        g = rollouts({"now": client}, required=3, late="cancel")
        result = await engine.run(g, spread(server, 3, 5))
    assert result.status == "completed" and len(result.output) == 3
    losers = sorted(x.item for x in result.late_inputs)
    assert len(losers) == 5
    # every loser was running (one batch holds them all): each request was closed (X2)
    await fixtures.until(lambda: server.stats.running == 0, "the server's batch emptied")
    assert server.stats.disconnected == 5 and server.stats.completed == 3
    account = await tail_accounting(engine, g, "rollout", result.run_id)
    assert (account.accepted, account.cancelled, account.parked) == (3, 5, 0)
    cancelled = [a for a in account.items if a.outcome == "cancelled"]
    assert sorted(a.item for a in cancelled) == losers
    assert account.wasted == sum(a.decoded for a in cancelled) > 0  # decoded, then thrown away
    assert account.decoded == account.wasted + sum(len(r["text"].split()) for r in result.output)
    assert (
        server.stats.tokens == account.decoded + server.stats.tokens_disconnected - account.wasted
    )


async def test_parked_items_continue_next_round_from_their_partial_text_under_the_new_version(
    server, engine
):
    clients: dict[str, ModelClient] = {}
    g = rollouts(clients, required=4, late="park", resume_parked=True)
    async with ModelClient(server.url, "m", version="v1", checkpoint_every=2) as first:
        clients["now"] = first
        one = await engine.run(g, spread(server, 4, 4))
    parked = await engine.parked(g, "rollout")
    assert len(parked) == 4 and all(row.checkpoint_json for row in parked)
    salvage = {}
    for row in parked:
        state = json.loads(row.checkpoint_json)["generation"]
        salvage[json.loads(row.value_json)] = state
        assert state["segments"] == [["v1", state["tokens"]]] and state["tokens"] > 0
    async with ModelClient(server.url, "m", version="v2", checkpoint_every=2) as second:
        clients["now"] = second
        two = await engine.run(g, [f"round 2 prompt {i}" for i in range(8)])
    assert two.status == "completed"
    continued = [r for r in two.output if r["prompt"] in salvage]
    assert continued, "a parked item, dispatched first, finishes first in the next round"
    for r in continued:
        state = salvage[r["prompt"]]
        assert r["text"].startswith(state["text"]) and r["salvaged"] == state["tokens"]
        assert r["text"] == generated_text(0, server.length(r["prompt"], None))  # as if never cut
        assert r["stale"] and r["rounds"] == 1  # continued under v2 from a v1 checkpoint (X5)
    account = await tail_accounting(engine, g, "rollout", [one.run_id, two.run_id])
    assert account.salvaged >= sum(state["tokens"] for p, state in salvage.items()
                                   if any(r["prompt"] == p for r in continued))  # fmt: skip
    assert account.stale == len(continued)
    # a parked item loses at most the tokens decoded since its last checkpoint (two)
    parked_items = [a for a in account.items if a.outcome == "parked"]
    assert all(a.wasted <= 2 for a in parked_items)
    assert account.wasted <= 2 * len(parked_items) + sum(
        a.wasted for a in account.items if a.outcome == "cancelled"
    )
    assert account.launched == 16 and account.accepted == 8  # 8 prompts a round, 4 kept
    still = [a for a in account.items if a.outcome == "parked" and a.run_id == two.run_id]
    assert account.waiting == {a.origin: a.rounds + 1 for a in still}
    assert account.max_rounds == 2 if any(a.rounds for a in still) else 1


async def test_an_item_parked_after_its_finish_arrived_continues_finished_without_a_request(
    server, engine
):
    """The finish reason goes into the checkpoint as soon as it arrives: an item parked while the
    end of its answer (usage, ``[DONE]``) is on its way carries its finished text, and the next
    round returns it without a request, one round waited (X3, X4)."""
    prompt = next(p for p in (f"f{i}" for i in range(200)) if 3 <= server.length(p, None) <= 12)
    length = server.length(prompt, None)
    finished = asyncio.Event()
    streamed = [0]

    def seen(chunk: tr.Chunk) -> None:  # inside the generation's own stream call
        if chunk.item == 0 and isinstance(chunk.value, dict):
            streamed[0] += chunk.value.get("tokens", 0)
            if streamed[0] == length:
                finished.set()

    def rounds(client: ModelClient, **options: Any) -> tr.Graph:
        g = tr.Graph("finished_then_parked")

        async def rollout(prompt: str) -> dict[str, Any]:
            if prompt == "wins once the other's last token is in":
                await finished.wait()
                return {"prompt": prompt}
            generation = await client.complete(prompt, max_tokens=100)
            return {"text": generation.text, "salvaged": generation.salvaged_tokens,
                    "decoded": generation.decoded_tokens, "rounds": generation.rounds}  # fmt: skip

        g.add_node("rollout", rollout, "map", resume_parked=True, **options)
        return g

    server.hold()  # the finish event comes; the usage and [DONE] do not
    async with ModelClient(server.url, "m", version="v1", checkpoint_every=1) as client:
        with engine.on_chunk("first", seen):
            one = await engine.run(
                rounds(client, required=1, late="park"),
                [prompt, "wins once the other's last token is in"],
                run_id="first",
            )
        assert [(x.item, x.reason) for x in one.late_inputs] == [(0, "parked")]
        assert server.stats.held == 1
        [row] = await engine.parked("finished_then_parked", "rollout")
        state = json.loads(row.checkpoint_json or "null")["generation"]
        assert (state["tokens"], state["finish"]) == (length, "stop")
        requests = server.stats.requests
        two = await engine.run(rounds(client), [], run_id="second")
    [continued] = two.output
    assert continued == {"text": generated_text(0, length), "salvaged": length, "decoded": 0,
                         "rounds": 1}  # fmt: skip
    assert server.stats.requests == requests  # nothing left to decode: no request
    account = await tail_accounting(engine, "finished_then_parked", "rollout", ["first", "second"])
    assert (account.launched, account.accepted, account.parked) == (1, 1, 0)
    assert (account.decoded, account.salvaged, account.wasted) == (length, length, 0)
    assert account.max_rounds == 1 and account.accepted_lengths == (length,)


async def test_a_cut_stream_is_retried_from_its_checkpoint(server, engine):
    retry = tr.RetryPolicy(attempts=3, resume=True, retry_on=(CompletionError,))
    long_prompt = next(p for p in (f"p{i}" for i in range(100)) if server.length(p, None) > 10)
    server.cut(6)
    async with ModelClient(server.url, "m", version="v1", checkpoint_every=100) as client:
        g = rollouts({"now": client}, retry=retry)
        result = await engine.run(g, [long_prompt])
    [r] = result.output
    assert r["text"] == generated_text(0, server.length(long_prompt, None))
    assert r["salvaged"] == 6 and server.stats.continued == 1  # the failed try saved all it had
    account = await tail_accounting(engine, g, "rollout", result.run_id)
    [item] = account.items
    assert item.attempts == 2 and item.wasted == 0 and item.salvaged == 6


async def test_an_item_parked_round_after_round_is_counted_against_the_starvation_bound(
    server, engine
):
    lengths = {p: server.length(p, None) for p in (f"q{i}" for i in range(200))}
    quick = [p for p, n in lengths.items() if n <= 10][:3]
    slow = max(lengths, key=lengths.__getitem__)
    clients: dict[str, ModelClient] = {}
    g = rollouts(clients, required=3, late="park", resume_parked=True)
    runs = []
    async with ModelClient(server.url, "m", version="v1") as client:
        clients["now"] = client
        for n in range(3):  # the slow one, parked, goes first each round, and is parked again
            runs.append((await engine.run(g, quick + ([slow] if n == 0 else []))).run_id)
    account = await tail_accounting(engine, g, "rollout", runs)  # the map's max_parks: 3
    [(origin, waited)] = account.waiting.items()
    assert waited == 3 and account.starving == (origin,) and account.max_rounds == 3
    assert account.launched == 3 * 3 + 1 and account.accepted == 9


async def test_the_starvation_bound_is_the_maps_max_parks_and_a_starving_item_finishes_next(
    server, engine
):
    """``starving`` means "runs to completion in the next round that takes it" (P5): the
    bound defaults to the map's own ``max_parks``, read from the graph, or from the graph the
    engine ran when it is named; an engine that never saw it uses ``MAX_PARKS``."""
    lengths = {p: server.length(p, None) for p in (f"q{i}" for i in range(200))}
    quick = [p for p, n in lengths.items() if n <= 10][:3]
    slow = max(lengths, key=lengths.__getitem__)
    clients: dict[str, ModelClient] = {}
    g = rollouts(clients, required=3, late="park", resume_parked=True, max_parks=2)
    runs = []
    async with ModelClient(server.url, "m", version="v1") as client:
        clients["now"] = client
        for n in range(2):  # parked twice: it has waited two rounds
            runs.append((await engine.run(g, quick + ([slow] if n == 0 else []))).run_id)
        account = await tail_accounting(engine, g, "rollout", runs)
        [(origin, waited)] = account.waiting.items()
        assert (waited, account.starvation_bound, account.starving) == (2, 2, (origin,))
        named = await tail_accounting(engine, "rollouts", "rollout", runs)
        assert (named.starvation_bound, named.starving) == (2, (origin,))
        stranger = await tail_accounting(tr.Engine(store=engine.store), "rollouts", "rollout", runs)
        assert (stranger.starvation_bound, stranger.starving) == (MAX_PARKS, ())
        patient = await tail_accounting(engine, g, "rollout", runs, starvation_bound=5)
        assert patient.starving == ()
        last = await engine.run(g, quick)  # it goes first, and now runs to completion
        runs.append(last.run_id)
    assert slow in [r["prompt"] for r in last.output]
    after = await tail_accounting(engine, g, "rollout", runs)
    assert after.waiting == {} and after.starving == () and after.max_rounds == 2
    with pytest.raises(ValueError, match="graph 'rollouts' has no node 'judge'"):
        await tail_accounting(engine, g, "judge", runs)


async def test_each_attempts_span_carries_its_generations_usage(server, engine):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from tailrace.integrations.otel import instrument

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    async with ModelClient(server.url, "m", version="v3") as client:
        g = rollouts({"now": client}, required=1, late="cancel")
        quick, slow = sorted(spread(server, 1, 1), key=lambda p: server.length(p, None))
        with instrument(engine, tracer_provider=provider):
            await engine.run(g, [quick, slow])
    spans = {  # the items' attempts (the map's own span carries no generation)
        s.attributes["tailrace.generation.outcome"]: s.attributes
        for s in exporter.get_finished_spans()
        if s.attributes and "tailrace.item" in s.attributes
    }
    assert set(spans) == {"completed", "cancelled"}
    won = spans["completed"]
    assert won["gen_ai.request.model"] == "m" and won["tailrace.generation.version"] == "v3"
    assert won["gen_ai.usage.output_tokens"] == server.length(quick, None)
    lost = spans["cancelled"]
    assert 0 < lost["gen_ai.usage.output_tokens"] < server.length(slow, None)
    assert lost["tailrace.outcome"] == "cancelled"


async def test_a_429_with_retry_after_is_waited_out_by_the_nodes_retry_policy(server, engine):
    server.inject(429, retry_after=1)
    events: list[tr.Event] = []
    engine.bus.subscribe(events.append, tr.EventType.NODE_RETRYING)
    async with ModelClient(server.url, "m") as client:
        g = tr.Graph("throttled")

        async def generate(prompt: str) -> str:
            return (await client.complete(prompt, max_tokens=20)).text

        policy = tr.RetryPolicy(attempts=2, backoff=0.0, retry_on=(CompletionError,))
        g.add_node("generate", generate, retry=policy)
        result = await engine.run(g, "prompt")
    assert result.status == "completed" and result.output
    assert [e.data["error"].startswith("CompletionError") for e in events] == [True]
    assert [e.data["delay"] for e in events] == [1.0]  # Retry-After, not the zero backoff


async def test_a_parked_generation_keeps_every_token_it_decoded_between_checkpoints(server, engine):
    # Checkpoints far apart (one at the start, none after): the park itself saves what the
    # losers decoded on their way out, so a parked item carries all of it (X2).
    clients: dict[str, ModelClient] = {}
    g = rollouts(clients, required=3, late="park", resume_parked=True)
    async with ModelClient(
        server.url, "m", version="v1", checkpoint_every=10_000, checkpoint_interval=3600
    ) as client:
        clients["now"] = client
        one = await engine.run(g, spread(server, 3, 3))
        await fixtures.until(lambda: server.stats.running == 0, "the losers closed")
        parked = await engine.parked(g, "rollout")
        saved = [json.loads(row.checkpoint_json or "null")["generation"] for row in parked]
        assert len(saved) == 3 and any(s["tokens"] > 0 for s in saved)
        assert all(s["text"] == generated_text(0, s["tokens"]) for s in saved)
        account = await tail_accounting(engine, g, "rollout", one.run_id)
        assert account.parked == 3 and account.wasted == 0
        assert account.kept == account.decoded  # the accepted texts and the parked ones
        two = await engine.run(g, [])  # the parked items, continued from all they decoded
    continued = {r["prompt"]: r for r in two.output}
    assert sorted(continued) == sorted(json.loads(row.value_json) for row in parked)
    for row, state in zip(parked, saved, strict=True):
        r = continued[json.loads(row.value_json)]
        assert r["salvaged"] == state["tokens"]
        assert r["text"] == generated_text(0, server.length(r["prompt"], None))
