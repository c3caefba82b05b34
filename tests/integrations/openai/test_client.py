"""ModelClient alone and inside one attempt (X1, X3, X5, X6), against the batching test server.

The server's generations are fixed by prompt and seed (token k is `` ·k``),
so a continued generation is compared with the uninterrupted one exactly.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

pytest.importorskip("httpx")

import httpx

import tailrace as tr
from tailrace._context import Checkpoint, set_current
from tailrace.integrations.openai import BatchingServer, CompletionError, ModelClient
from tailrace.integrations.openai._replicas import Replicas
from tailrace.integrations.openai._server import generated_text
from tailrace.tail import HedgePolicy, TailHooks
from tests import fixtures


class Recorder:
    """Where a fake attempt's checkpoints and chunks go (the engine's sinks, recorded)."""

    def __init__(self) -> None:
        self.saved: list[Any] = []
        self.committed: list[int] = []  # the tickets waited for (checkpoint_durable)
        self.chunks: list[Any] = []

    def save(
        self, node_id: str, visit: int, item: int | None, attempt: int, value: Any, handle: Any
    ) -> int:
        self.saved.append(value)
        return len(self.saved)

    async def wait_committed(self, ticket: int) -> None:
        self.committed.append(ticket)

    def publish(self, attempt: Any, tries: int, chunk: Any) -> None:
        self.chunks.append(chunk)


def attempt(recorder: Recorder, resumed: Any = None, run_id: str = "r1") -> None:
    """Make the calling task an attempt of node ``gen`` (item 0) of run ``run_id``."""
    checkpoint = None
    if resumed is not None:
        checkpoint = Checkpoint(
            value=resumed, run_id="r0" if run_id == "r1" else "r1", node_id="gen", visit=1,
            item=0, saved_at=0.0,
        )  # fmt: skip
    set_current((run_id, "gen", 1, 1, 0, recorder, checkpoint, recorder, None, None))


@pytest.fixture
async def server() -> AsyncIterator[BatchingServer]:
    async with BatchingServer(median_tokens=30, step=0.0005) as srv:
        yield srv


async def test_a_completion_outside_a_node_is_a_plain_streamed_request(server):
    length = server.length("hello", 7)
    async with ModelClient(server.url, "m", version="v1") as client:
        generation = await client.complete("hello", seed=7)
        short = await client.chat([{"role": "user", "content": "hi"}], seed=1, max_tokens=3)
    assert generation.text == generated_text(0, length)
    assert (generation.finish_reason, generation.decoded_tokens) == ("stop", length)
    assert generation.prompt_tokens == 1 and generation.salvaged_tokens == 0
    assert not generation.stale and generation.replica == server.url + "/"
    assert short.text == generated_text(0, 3) and short.finish_reason == "length"


async def test_each_event_is_a_chunk_and_checkpoints_come_at_a_bounded_rate(server):
    recorder = Recorder()
    attempt(recorder)
    length = server.length("p", 3)
    async with ModelClient(
        server.url, "m", version="v1", checkpoint_every=5, checkpoint_interval=60
    ) as client:
        generation = await client.complete("p", seed=3)
    texts = [c for c in recorder.chunks if "text" in c]
    assert "".join(c["text"] for c in texts) == generation.text and len(texts) == length
    # one save per 5 tokens, the finish as soon as it arrives, and the finished generation once
    # more, committed (X1, P1)
    expected = [0, *range(5, length, 5), length, length]
    assert [s["generation"]["tokens"] for s in recorder.saved] == expected
    final = recorder.saved[-1]["generation"]
    assert final["finish"] == "stop" and final["text"] == generation.text
    # only the finished generation is waited for: committed before the call returns
    assert recorder.committed == [len(recorder.saved)]
    assert final["segments"] == [["v1", length]] and final["origin"] == "r1/gen/1/0"
    [usage] = [c["usage"] for c in recorder.chunks if "usage" in c]
    assert usage["outcome"] == "completed" and usage["decoded"] == length
    assert usage["salvaged"] == 0 and usage["checkpointed"] == length


async def test_a_resumed_attempt_asks_only_for_the_rest_and_says_it_is_stale(server):
    length = server.length("q", 11)
    assert length > 4
    salvaged = {"generation": {"text": generated_text(0, 4), "tokens": 4, "segments": [["v1", 4]],
                               "rounds": 0, "origin": "r0/gen/1/0", "finish": None}}  # fmt: skip
    recorder = Recorder()
    attempt(recorder, resumed=salvaged)
    async with ModelClient(server.url, "m", version="v2") as client:
        generation = await client.complete("q", seed=11, max_tokens=length + 10)
    assert generation.text == generated_text(0, length)  # as if never cut (X3)
    assert (generation.salvaged_tokens, generation.decoded_tokens) == (4, length - 4)
    assert generation.stale and generation.salvaged_version == "v1"  # X5
    assert generation.rounds == 1  # it came from another run: a parked round
    assert server.stats.continued == 1
    final = recorder.saved[-1]["generation"]
    assert final["segments"] == [["v1", 4], ["v2", length - 4]] and final["origin"] == "r0/gen/1/0"


async def test_the_server_counts_its_steps_and_the_seconds_they_were_modelled_to_take():
    async with BatchingServer(median_tokens=12, step=0.001, per_request=0.0005) as server:
        length = server.length("alone", 1)
        async with ModelClient(server.url, "m") as client:
            await client.complete("alone", seed=1)
    # one request in the batch: a step per token, each of step + per_request seconds
    assert server.stats.steps == length and server.stats.connections == 1
    assert server.stats.busy == pytest.approx(length * 0.0015)


async def test_a_finished_checkpoint_is_returned_without_a_request(server):
    done = {"generation": {"text": " ·0 ·1", "tokens": 2, "segments": [["v1", 2]], "rounds": 0,
                           "origin": "r1/gen/1/0", "finish": "stop"}}  # fmt: skip
    attempt(Recorder(), resumed=done, run_id="r1")
    async with ModelClient(server.url, "m", version="v1") as client:
        generation = await client.complete("z", max_tokens=50)
    assert generation.text == " ·0 ·1" and generation.decoded_tokens == 0
    assert server.stats.requests == 0


async def test_token_id_prompts_continue_with_token_ids(server):
    length = server.length("1 2 3", None)
    salvaged = {"generation": {"text": generated_text(0, 2), "tokens": 2, "token_ids": [100000, 100001],
                               "segments": [["v1", 2]], "rounds": 0, "origin": "o", "finish": None}}  # fmt: skip
    recorder = Recorder()
    attempt(recorder, resumed=salvaged)
    async with ModelClient(server.url, "m", version="v1") as client:
        generation = await client.complete([1, 2, 3], max_tokens=1000)
    assert generation.text == generated_text(0, length)
    assert recorder.saved[-1]["generation"]["token_ids"] == [100000 + k for k in range(length)]


async def test_a_fresh_generation_keeps_the_token_ids_the_server_sends(server):
    recorder = Recorder()
    attempt(recorder)
    length = server.length("7 8", None)
    async with ModelClient(server.url, "m") as client:
        await client.complete([7, 8], max_tokens=1000)
    assert recorder.saved[-1]["generation"]["token_ids"] == [100000 + k for k in range(length)]


async def test_a_chat_that_cannot_be_continued_starts_over(server):
    messages = [{"role": "user", "content": "hi"}]
    salvaged = {"generation": {"text": generated_text(0, 3), "tokens": 3, "segments": [["v1", 3]],
                               "rounds": 0, "origin": "o", "finish": None}}  # fmt: skip
    attempt(Recorder(), resumed=salvaged, run_id="r0")  # a retry in the same run
    async with ModelClient(server.url, "m", continue_chat=False) as client:
        generation = await client.chat(messages, max_tokens=1000)
    assert generation.salvaged_tokens == 0 and server.stats.continued == 0
    assert generation.text == generated_text(0, generation.decoded_tokens)


async def test_http_errors_are_completion_errors_that_say_whether_to_retry(server):
    server.inject(
        429, retry_after=1
    )  # the next request waits it out: the one replica is the only way
    server.inject(503)
    server.inject(400)
    async with ModelClient(server.url, "m") as client:
        errors = []
        for _ in range(3):
            with pytest.raises(CompletionError) as caught:
                await client.complete("x")
            errors.append(caught.value)
    assert [(e.status, e.retryable, e.retry_after) for e in errors] == [
        (429, True, 1.0),
        (503, True, None),
        (400, False, None),
    ]


async def test_a_cut_stream_is_retryable_and_never_complete(server):
    server.cut(3)
    async with ModelClient(server.url, "m") as client:
        with pytest.raises(CompletionError) as caught:
            await client.complete("long", seed=1, max_tokens=20)
    assert caught.value.retryable and server.stats.cut == 1


async def test_retry_after_keeps_a_replica_out_and_the_next_request_goes_elsewhere(server):
    async with BatchingServer(median_tokens=5, step=0.0005) as other:
        server.inject(429, retry_after=30)
        async with ModelClient([server.url, other.url], "m") as client:
            with pytest.raises(CompletionError):
                await client.complete("a")
            generation = await client.complete("a")
    assert generation.replica == other.url + "/" and other.stats.completed == 1


def test_least_outstanding_first_and_a_unit_avoids_its_own_replica():
    now = [0.0]
    replicas = Replicas(["http://a/v1", "http://b/v1", "http://c/v1"], clock=lambda: now[0])
    a, b, c = replicas.replicas
    with replicas.serving(a, unit="u1"), replicas.serving(b):
        assert replicas.pick()[0] is c
        with replicas.serving(c):
            assert replicas.pick("u1")[0] is b  # a backup of u1: not on a, then least busy
    replicas.wait_out(a, 5.0)
    replicas.wait_out(b, 2.0)
    replicas.wait_out(c, 9.0)
    assert replicas.pick() == (b, 2.0)  # all wait: the soonest free, and how long
    now[0] = 3.0
    assert replicas.pick()[0] is b


async def test_a_hedged_backup_is_sent_to_the_other_replica_and_its_primary_is_closed():
    # Two replicas of one model: "slow" (listed first) and "other". The primary goes to
    # slow (both idle); an unrelated request then goes to other, so both have one request
    # out. The backup (T5) knows it is one and avoids its primary's replica although the
    # replicas tie (X6): it wins on other, and slow sees the primary's request closed.
    async with (
        BatchingServer(median_tokens=40, sigma=0.1, step=0.25) as slow,
        BatchingServer(median_tokens=40, sigma=0.1, step=0.04) as other,
        ModelClient([slow.url, other.url], "m") as client,
    ):
        hooks = TailHooks(hedging=HedgePolicy(backup_after=1.0, slack=0.0))
        for _ in range(3):
            # The backup comes 1 s in, long after the unrelated request went out (and
            # before it ends, some 40 x 40 ms later).
            hooks.estimator("gen").observe(1.0, 1.0)
        engine = tr.Engine(tail=hooks, capacity=4)

        async def gen(prompt: str) -> dict[str, Any]:
            ctx = tr.current_node(required=True)
            generation = await client.complete(prompt, seed=1)
            return {"replica": generation.replica, "backup_of": ctx.backup_of,
                    "text": generation.text}  # fmt: skip

        g = tr.Graph("replicas")
        g.add_node("gen", gen, hedge=True)
        run = asyncio.ensure_future(engine.run(g, "hello"))
        await fixtures.until(lambda: slow.stats.running == 1, "the primary at slow")
        unrelated = asyncio.ensure_future(client.complete("unrelated", seed=2))
        await fixtures.until(lambda: other.stats.running == 1, "the unrelated request at other")
        async with asyncio.timeout(fixtures.HANG_GUARD):
            result = await run
            await unrelated
        await fixtures.until(lambda: slow.stats.disconnected == 1, "the primary closed at slow")

    assert result.output["replica"] == other.url + "/"
    assert result.output["backup_of"] == 1
    assert result.output["text"] == generated_text(0, other.length("hello", 1))
    assert result.hedges == 1
    assert (slow.stats.completed, other.stats.completed) == (0, 2)


def test_the_facade_documents_every_parameter_of_its_callables():
    import dataclasses
    import inspect

    import tailrace.integrations.openai as facade
    from tests.test_facade import _documented_params

    missing = {}
    for name in facade.__all__:
        obj = getattr(facade, name)
        members = [(name, obj, "")] if inspect.isfunction(obj) else []
        if inspect.isclass(obj):
            doc = inspect.getdoc(obj) or ""
            members += [(f"{name}.{attr}", fn, doc if attr == "__init__" else "")
                        for attr, fn in vars(obj).items()
                        if (inspect.isfunction(fn) and not attr.startswith("_"))
                        or (attr == "__init__" and not dataclasses.is_dataclass(obj))]  # fmt: skip
        for qualname, fn, extra in members:
            assert inspect.getdoc(fn) or extra, f"{qualname} has no docstring"
            if _documented_params(fn, extra):
                missing[qualname] = _documented_params(fn, extra)
    assert not missing, missing


async def test_stream_events_split_anywhere_across_reads_parse_whole():
    """Events arrive as the network cuts them: mid-line, mid-character, CRLF or LF, several
    in one read, the last line without its line end."""
    events = [
        {"choices": [{"index": 0, "text": "héllo", "finish_reason": None}]},
        {"choices": [{"index": 0, "text": " wörld", "finish_reason": None}]},
        {"choices": [{"index": 0, "text": " ✓", "finish_reason": "stop"}]},
        {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 3}},
    ]
    body = b": a comment\r\n\r\n" + b"".join(
        b"data: " + json.dumps(e, ensure_ascii=False).encode() + (b"\r\n\r\n" if i % 2 else b"\n\n")
        for i, e in enumerate(events)
    ) + b"data: [DONE]"  # fmt: skip

    async def pieces() -> AsyncIterator[bytes]:
        cut = body.index("ö".encode()) + 1  # inside the two bytes of one character
        for start, end in ((0, 7), (7, cut), (cut, cut + 3), (cut + 3, len(body))):
            yield body[start:end]

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=pieces())

    recorder = Recorder()
    attempt(recorder)
    async with ModelClient("http://m/v1", "m", transport=httpx.MockTransport(answer)) as client:
        generation = await client.complete("p")
    assert generation.text == "héllo wörld ✓" and generation.finish_reason == "stop"
    assert (generation.decoded_tokens, generation.prompt_tokens) == (3, 2)
    assert [c["text"] for c in recorder.chunks if "text" in c] == ["héllo", " wörld", " ✓"]


async def test_a_stream_event_that_is_not_json_is_an_error_that_shows_it():
    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(
            200, headers={"content-type": "text/event-stream"}, content=b"data: {\xc3\xa9 oops\n\n"
        )

    async with ModelClient("http://m/v1", "m", transport=httpx.MockTransport(answer)) as client:
        with pytest.raises(CompletionError, match=r"a stream event is not JSON: '\{é oops'"):
            await client.complete("p")
