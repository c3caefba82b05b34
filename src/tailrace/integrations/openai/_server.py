"""An OpenAI-compatible server of the project's own that decodes many requests as one batch.

It stands in for vLLM or SGLang where the real model cannot go (CI, benchmarks
of thousands of rollouts): every decode step gives each running request one
token, and a step takes ``step + per_request * batch`` seconds, so tokens per
second per request fall as the batch grows. A generation's length comes from
a lognormal distribution (median ``median_tokens``, ``sigma``) seeded by the
prompt and the request's ``seed``, so it is the same on every run. A request
whose connection closes leaves the batch at its next event (what vLLM and
SGLang do on a disconnect), and the server counts the tokens it had decoded.

Token ``k`` of a generation is the text `` ·k`` (id ``100000 + k``), so a
continuation (the prompt followed by a salvaged prefix, as text, as token
ids, or as a final assistant message) is recognised: the server goes on at
token ``k`` and the continued text equals the uninterrupted one.

Faults for tests: :meth:`BatchingServer.inject` answers the next requests
with an HTTP status (and ``Retry-After``); :meth:`BatchingServer.cut` ends
the next streams after some tokens without a finish reason, closing the
connection; :meth:`BatchingServer.hold` keeps the next streams open after
their finish event, before their usage and ``[DONE]``.
``python -m tailrace.integrations.openai --port N`` runs it in a process of
its own; ``POST /admin/inject``, ``POST /admin/cut``, ``POST /admin/hold``
and ``GET /admin/stats`` reach the same controls there.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Self

GENERATED = " ·"  # the text every generated token starts with
FIRST_ID = 100_000  # the id of generated token 0
#: Connections the kernel holds for the server while it decodes: a round of rollouts connects
#: thousands at once, and asyncio's default (100) drops the rest until their connects time out.
BACKLOG = 4096


@dataclass(slots=True, kw_only=True)
class ServerStats:
    """What the server did: requests, tokens, disconnects, the largest batch, the batch now.

    ``held`` counts the streams held open after their finish event (:meth:`BatchingServer.hold`);
    ``connections``, the connections accepted (a client that keeps its connections alive
    sends many requests on one); ``steps`` and ``busy``, the decode steps and the seconds
    they were modelled to take (``busy`` against the time that passed says how much of it
    the server was the bottleneck).
    """

    connections: int = 0
    requests: int = 0
    completed: int = 0
    failed: int = 0
    disconnected: int = 0
    cut: int = 0
    held: int = 0
    tokens: int = 0
    tokens_disconnected: int = 0
    max_batch: int = 0
    running: int = 0
    continued: int = 0
    steps: int = 0
    busy: float = 0.0


@dataclass(slots=True, eq=False)
class _Request:
    """One generation in the batch."""

    start: int  # the token it starts at (a continuation's prefix length)
    remaining: int
    finish: str
    chat: bool
    ids: bool
    events: asyncio.Queue[tuple[list[int], str | None]] = field(default_factory=asyncio.Queue)
    decoded: int = 0
    pending: list[int] = field(default_factory=list)
    cut_after: int | None = None
    held: bool = False


def generated_text(first: int, count: int) -> str:
    """The text of generated tokens ``first`` .. ``first + count - 1``.

    Args:
        first: The index of the first token.
        count: How many tokens.

    >>> generated_text(0, 3)
    ' ·0 ·1 ·2'
    """
    return "".join(f"{GENERATED}{k}" for k in range(first, first + count))


class BatchingServer:
    """The batching test server: serve it with ``async with`` and point a client at :attr:`url`.

    Args:
        median_tokens: The median generation length.
        sigma: The lognormal shape of lengths (about 1 in RL traces).
        step: Seconds of one decode step with one request in the batch.
        per_request: Seconds each request in the batch adds to a step.
        tokens_per_event: Tokens sent per stream event (one by default; more
            send ``token_ids`` with each event, as vLLM's stream interval).
        max_tokens: The longest generation, whatever the length drawn.
        host: The address to listen on (loopback).
        port: The port (0: any free one).
    """

    def __init__(
        self,
        *,
        median_tokens: float = 40.0,
        sigma: float = 1.0,
        step: float = 0.002,
        per_request: float = 0.00001,
        tokens_per_event: int = 1,
        max_tokens: int = 100_000,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.median_tokens, self.sigma = median_tokens, sigma
        self.step, self.per_request = step, per_request
        self.tokens_per_event, self.max_tokens = tokens_per_event, max_tokens
        self.host, self.port = host, port
        self.stats = ServerStats()
        #: (prompt without its generated prefix, the prefix's tokens) of each generation request.
        self.generations: list[tuple[str, int]] = []
        self._batch: list[_Request] = []
        self._failures: list[tuple[int, float | None]] = []
        self._cuts: list[int] = []
        self._holds = 0
        self._wake = asyncio.Event()
        self._server: asyncio.Server | None = None
        self._decoder: asyncio.Task[None] | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        """The API root, ``http://host:port/v1``."""
        return f"http://{self.host}:{self.port}/v1"

    def length(self, prompt: str, seed: Any) -> int:
        """The length of the generation for ``prompt`` and ``seed`` (drawn once, the same each time).

        Args:
            prompt: The prompt without any generated prefix.
            seed: The request's ``seed`` field.
        """
        rng = random.Random(f"{prompt}|{seed}")
        drawn = rng.lognormvariate(math.log(self.median_tokens), self.sigma)
        return max(1, min(self.max_tokens, round(drawn)))

    def inject(self, status: int, *, retry_after: float | None = None, count: int = 1) -> None:
        """Answer the next ``count`` generation requests with HTTP ``status``.

        Args:
            status: The status (429, 503, ...).
            retry_after: The ``Retry-After`` seconds to send with it, if any.
            count: How many requests get it.
        """
        self._failures.extend([(status, retry_after)] * count)

    def cut(self, after: int, *, count: int = 1) -> None:
        """End the next ``count`` streams after ``after`` tokens, without a finish reason.

        Args:
            after: Tokens sent before the connection closes.
            count: How many streams are cut.
        """
        self._cuts.extend([after] * count)

    def hold(self, *, count: int = 1) -> None:
        """Hold the next ``count`` streams open after their finish event: their usage and
        ``[DONE]`` never come, and the stream ends when the client closes it (a finished
        generation whose attempt is cancelled while the end of its answer is on its way).

        Args:
            count: How many streams are held.
        """
        self._holds += count

    async def start(self) -> None:
        """Listen, and start the decode loop."""
        self._server = await asyncio.start_server(
            self._connection, self.host, self.port, backlog=BACKLOG
        )
        self.port = self._server.sockets[0].getsockname()[1]
        self._decoder = asyncio.create_task(self._decode())

    async def stop(self) -> None:
        """Stop listening, close every connection, end the decode loop."""
        if self._server is not None:
            self._server.close()
        for writer in self._writers:
            writer.close()  # its handler sees the end of its stream and returns
        await asyncio.gather(*self._connections, return_exceptions=True)
        if self._decoder is not None:
            self._decoder.cancel()
            await asyncio.wait({self._decoder})
        if self._server is not None:
            await self._server.wait_closed()
        self._server = self._decoder = None

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    # -- the batch ------------------------------------------------------------------

    async def _decode(self) -> None:
        """One decode step after another while any request runs: a token for each.

        A step lasts ``step + per_request * batch`` from the end of the one before, the
        server's own work on it (handing out tokens, writing events) included, as a GPU's
        step does not wait for its host; a step whose work overran starts at once.
        """
        loop = asyncio.get_running_loop()
        mark = loop.time()
        while True:
            if not self._batch:
                self._wake.clear()
                await self._wake.wait()
                mark = loop.time()
            size = len(self._batch)
            self.stats.max_batch = max(self.stats.max_batch, size)
            duration = self.step + self.per_request * size
            self.stats.steps += 1
            self.stats.busy += duration
            mark += duration
            delay = mark - loop.time()
            if delay < 0:
                mark -= delay  # overran: no debt carried into the next steps
            await asyncio.sleep(max(delay, 0.0))
            for request in list(self._batch):
                request.pending.append(FIRST_ID + request.start + request.decoded)
                request.decoded += 1
                self.stats.tokens += 1
                done = request.decoded >= request.remaining
                cut = request.cut_after is not None and request.decoded >= request.cut_after
                if done or cut or len(request.pending) >= self.tokens_per_event:
                    finish = request.finish if done and not cut else None
                    request.events.put_nowait((request.pending, finish))
                    request.pending = []
                if done or cut:
                    self._batch.remove(request)
            self.stats.running = len(self._batch)

    def _admit(self, body: dict[str, Any], chat: bool) -> _Request:
        prompt, prefix, ids = _split(body, chat)
        self.generations.append((prompt, prefix))
        length = self.length(prompt, body.get("seed"))
        max_tokens = body.get("max_tokens")
        remaining = length - prefix
        finish = "stop"
        if isinstance(max_tokens, int) and max_tokens < remaining:
            remaining, finish = max_tokens, "length"
        request = _Request(
            start=prefix, remaining=max(0, remaining), finish=finish, chat=chat, ids=ids
        )
        self.stats.continued += prefix > 0
        if self._cuts:
            request.cut_after = self._cuts.pop(0)
        if self._holds:
            self._holds -= 1
            request.held = True
        if request.remaining == 0:
            request.events.put_nowait(([], finish))
        else:
            self._batch.append(request)
            self.stats.running = len(self._batch)
            self._wake.set()
        return request

    # -- HTTP -------------------------------------------------------------------------

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        self._writers.add(writer)
        self.stats.connections += 1
        try:
            while await self._serve_one(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._connections.discard(task)
            self._writers.discard(writer)
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def _serve_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Answer one request; whether the connection stays open for another."""
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        method, path, _ = lines[0].split(" ", 2)
        headers = {
            k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:] if x)
        }
        raw = await reader.readexactly(int(headers.get("content-length", "0")))
        body = json.loads(raw) if raw else {}
        if method == "GET" and path.endswith("/models"):
            return await _send_json(writer, 200, {"data": [{"id": "batching", "object": "model"}]})
        if method == "GET" and path == "/admin/stats":
            return await _send_json(writer, 200, asdict(self.stats))
        if method == "POST" and path == "/admin/inject":
            self.inject(
                body["status"], retry_after=body.get("retry_after"), count=body.get("count", 1)
            )
            return await _send_json(writer, 200, {})
        if method == "POST" and path == "/admin/cut":
            self.cut(body["after"], count=body.get("count", 1))
            return await _send_json(writer, 200, {})
        if method == "POST" and path == "/admin/hold":
            self.hold(count=body.get("count", 1))
            return await _send_json(writer, 200, {})
        if method != "POST" or not path.endswith(("/completions", "/chat/completions")):
            return await _send_json(writer, 404, {"error": f"no route {method} {path}"})
        self.stats.requests += 1
        if self._failures:
            status, retry_after = self._failures.pop(0)
            self.stats.failed += 1
            extra = {} if retry_after is None else {"Retry-After": str(int(retry_after))}
            return await _send_json(writer, status, {"error": "injected"}, extra)
        request = self._admit(body, path.endswith("/chat/completions"))
        if not body.get("stream"):
            return await self._answer_whole(writer, request, body)
        return await self._answer_stream(reader, writer, request, body)

    async def _answer_whole(
        self, writer: asyncio.StreamWriter, request: _Request, body: dict[str, Any]
    ) -> bool:
        tokens: list[int] = []
        finish = None
        while finish is None:
            ids, finish = await request.events.get()
            tokens.extend(ids)
        text = generated_text(request.start, len(tokens))
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
        choice.update(
            {"message": {"role": "assistant", "content": text}} if request.chat else {"text": text}
        )
        self.stats.completed += 1
        return await _send_json(
            writer, 200, {"choices": [choice], "usage": self._usage(body, request)}
        )

    async def _answer_stream(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        request: _Request,
        body: dict[str, Any],
    ) -> bool:
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\ncache-control: no-cache\r\n\r\n"
        )
        with_ids = request.ids or self.tokens_per_event > 1 or bool(body.get("return_token_ids"))
        try:
            while True:
                ids, finish = await request.events.get()
                if reader.at_eof():  # the client closed the request: it leaves the batch
                    raise ConnectionResetError("the client closed the request")
                if ids or finish:
                    await _send_chunk(writer, self._event(request, ids, finish, with_ids))
                if finish is not None:
                    break
                if request.cut_after is not None and request.decoded >= request.cut_after:
                    self.stats.cut += 1
                    return False  # the connection closes mid-stream
            if request.held:
                self.stats.held += 1
                await reader.read()  # the client's close (or the server's stop) ends it
                raise ConnectionResetError("the client closed a held request")
            if body.get("stream_options", {}).get("include_usage"):
                await _send_chunk(writer, {"choices": [], "usage": self._usage(body, request)})
            await _send_chunk(writer, "[DONE]")
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            self.stats.completed += 1
            return not reader.at_eof()
        except ConnectionError:
            if request in self._batch:
                self._batch.remove(request)
                self.stats.running = len(self._batch)
                self.stats.disconnected += 1
                self.stats.tokens_disconnected += request.decoded
            raise

    def _event(
        self, request: _Request, ids: list[int], finish: str | None, with_ids: bool
    ) -> dict[str, Any]:
        text = generated_text(ids[0] - FIRST_ID, len(ids)) if ids else ""
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
        choice.update({"delta": {"content": text}} if request.chat else {"text": text})
        if with_ids:
            choice["token_ids"] = ids
        return {
            "object": "chat.completion.chunk" if request.chat else "text_completion",
            "choices": [choice],
        }

    @staticmethod
    def _usage(body: dict[str, Any], request: _Request) -> dict[str, int]:
        prompt, _, _ = _split(body, request.chat)
        return {
            "prompt_tokens": len(prompt.split()) + request.start,
            "completion_tokens": request.decoded,
            "total_tokens": len(prompt.split()) + request.start + request.decoded,
        }


def _split(body: dict[str, Any], chat: bool) -> tuple[str, int, bool]:
    """(the prompt without its generated prefix, the prefix's token count, sent as ids)."""
    if chat:
        messages = body.get("messages") or []
        prefix = ""
        if (
            body.get("continue_final_message")
            and messages
            and messages[-1].get("role") == "assistant"
        ):
            prefix = str(messages[-1].get("content", ""))
            messages = messages[:-1]
        prompt = json.dumps(messages, sort_keys=True)
        return prompt, prefix.count(GENERATED), False
    raw = body.get("prompt", "")
    if isinstance(raw, list):
        base = [i for i in raw if i < FIRST_ID]
        return " ".join(map(str, base)), len(raw) - len(base), True
    text = str(raw)
    cut = text.find(GENERATED)
    return (text, 0, False) if cut < 0 else (text[:cut], text.count(GENERATED), False)


async def _send_json(
    writer: asyncio.StreamWriter,
    status: int,
    payload: dict[str, Any],
    headers: dict[str, str] | None = None,
) -> bool:
    data = json.dumps(payload).encode()
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    writer.write(
        f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\n{extra}"
        f"content-length: {len(data)}\r\n\r\n".encode()
        + data
    )
    await writer.drain()
    return True


async def _send_chunk(writer: asyncio.StreamWriter, event: dict[str, Any] | str) -> None:
    data = ("data: " + (event if isinstance(event, str) else json.dumps(event)) + "\n\n").encode()
    writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
    await writer.drain()


async def serve(
    server: BatchingServer, ready: Callable[[str], Awaitable[None] | None] | None = None
) -> None:
    """Serve ``server`` until cancelled; ``ready(url)`` is called once it listens."""
    async with server:
        if ready is not None:
            maybe = ready(server.url)
            if maybe is not None:
                await maybe
        await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> None:
    """Run a :class:`BatchingServer` in this process; it prints its URL once it listens.

    Args:
        argv: Command-line arguments (default: the process's).
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--median-tokens", type=float, default=40.0)
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--step", type=float, default=0.002)
    parser.add_argument("--per-request", type=float, default=0.00001)
    parser.add_argument("--tokens-per-event", type=int, default=1)
    args = parser.parse_args(argv)
    server = BatchingServer(
        median_tokens=args.median_tokens, sigma=args.sigma, step=args.step,
        per_request=args.per_request, tokens_per_event=args.tokens_per_event, port=args.port,
    )  # fmt: skip

    def announce(url: str) -> None:
        print(url, flush=True)

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(server, announce))
