"""A client streaming thousands of generations at once spreads them over bounded httpx pools.

httpcore's pool walks every connection it holds when a request starts or ends,
and closes idle connections beyond its keep-alive limit; the client's pools
each hold a bounded number of streams, so the cost per request stays flat and
every connection is kept for the next round.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

pytest.importorskip("httpx")

import httpx

import tailrace as tr
from tailrace.integrations.openai import BatchingServer, ModelClient
from tailrace.integrations.openai._client import POOL_SIZE
from tailrace.integrations.openai._pools import Pools
from tailrace.integrations.openai._server import generated_text
from tailrace.stores import SQLiteStore
from tests import fixtures

WIDTH = 100  # more streams at once than one httpx pool keeps alive (64)


async def test_a_round_of_many_streams_keeps_every_connection_for_the_next_round():
    # Long generations (a 10 ms step, about 100 tokens each): every stream of a round is open
    # at once, even on a loaded machine.
    async with (
        BatchingServer(median_tokens=100, sigma=0.01, step=0.01) as server,
        ModelClient(server.url, "m", stream_tokens=False) as client,
    ):
        for seed in (1, 2):
            generations = await asyncio.gather(
                *(client.complete(f"p{i}", seed=seed) for i in range(WIDTH))
            )
            assert [g.text for g in generations] == [
                generated_text(0, server.length(f"p{i}", seed)) for i in range(WIDTH)
            ]
    assert server.stats.max_batch == WIDTH and server.stats.completed == 2 * WIDTH
    # One connection per stream of the first round, each used again by the second.
    assert server.stats.connections == WIDTH


async def test_a_pool_holds_at_most_its_size_and_a_full_one_takes_requests_again():
    made: list[httpx.AsyncClient] = []

    def make() -> httpx.AsyncClient:
        made.append(httpx.AsyncClient())
        return made[-1]

    pools = Pools(make, 2)
    with pools.client() as a, pools.client() as b, pools.client() as c:
        assert a is b and c is not a and pools.clients == 2
        with pools.client() as d:
            assert d is c  # room left in the second
        with pools.client() as e:
            assert e is c
    with pools.client() as f:
        assert f is a  # the first had room again most recently
    await pools.aclose()
    assert all(client.is_closed for client in made)
    with pytest.raises(ValueError, match="at least one request"):
        Pools(make, 0)


async def test_a_transport_of_the_callers_is_one_client_for_every_request():
    async with BatchingServer(median_tokens=5) as server:
        transport = httpx.AsyncHTTPTransport()
        async with ModelClient(server.url, "m", transport=transport) as client:
            await asyncio.gather(*(client.complete(f"q{i}") for i in range(POOL_SIZE + 3)))
            assert client._pools.clients == 1


async def test_losers_cancelled_across_pools_leave_every_pool_empty_and_the_next_round_whole(
    tmp_path: Path,
) -> None:
    async with (
        BatchingServer(median_tokens=60, sigma=1.0, step=0.002) as server,
        ModelClient(server.url, "m", stream_tokens=False) as client,
        SQLiteStore(tmp_path / "runs.db") as store,
    ):
        g = tr.Graph("pooled")

        async def sample(prompt: str) -> str:
            return (await client.complete(prompt, max_tokens=10_000)).text

        g.add_node("sample", sample, "map", required=5, late="cancel")
        engine = tr.Engine(store=store)
        prompts = [f"q{i}" for i in range(3 * POOL_SIZE)]  # three pools' worth
        first = await engine.run(g, prompts)
        assert len(first.output) == 5 and len(first.late_inputs) == len(prompts) - 5
        await fixtures.until(lambda: server.stats.running == 0, "the losers closed")
        assert client._pools.clients >= 3
        assert all(pool.load == 0 for pool in client._pools._pools)  # every slot given back
        g2 = tr.Graph("pooled_all")
        g2.add_node("sample", sample, "map")
        second = await engine.run(g2, prompts)
    assert second.output == [generated_text(0, server.length(p, None)) for p in prompts]
    assert all(pool.load == 0 for pool in client._pools._pools)
