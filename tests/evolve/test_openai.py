"""openai_compatible against a fake OpenAI-compatible server on loopback."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

pytest.importorskip("httpx")

from tailrace.evolve import (
    CompletionError,
    Edit,
    Price,
    Retry,
    Task,
    Usage,
    async_evolve,
    evolve,
    openai_compatible,
)
from tailrace.evolve._openai import retry_after_seconds


class FakeOpenAI(BaseHTTPRequestHandler):
    """Answers /v1/chat/completions with the label the system prompt's rules give."""

    requests: ClassVar[list[dict]] = []
    failures: ClassVar[list[tuple[int, dict[str, str]]]] = []  # (status, headers) to answer next

    def do_POST(self) -> None:
        length = int(self.headers["Content-Length"])
        body = json.loads(self.rfile.read(length))
        self.requests.append({"path": self.path, "auth": self.headers.get("Authorization"), **body})
        if self.path != "/v1/chat/completions":
            self._send(404, {"error": "no such route"})
            return
        if body["model"] == "broken":
            self._send(200, {"unexpected": True})
            return
        if self.failures:
            status, headers = self.failures.pop(0)
            self._send(status, {"error": "try later"}, headers)
            return
        system, user = body["messages"][0]["content"], body["messages"][1]["content"]
        answer = "yes" if "say yes" in system else f"no ({user})"
        usage = {"prompt_tokens": len(system.split()) + len(user.split()), "completion_tokens": 1}
        message = {"role": "assistant", "content": answer}
        self._send(200, {"choices": [{"message": message}], "usage": usage})

    def _send(self, status: int, payload: dict, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    FakeOpenAI.requests = []
    FakeOpenAI.failures = []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), FakeOpenAI)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()


async def test_completion_sends_system_and_user_messages_with_the_key(server, monkeypatch):
    monkeypatch.setenv("FAKE_KEY", "sk-test")
    async with openai_compatible(server, "m1", "FAKE_KEY") as run:
        out = await run("rules", Task(id="t", prompt="hello"))
    assert out == "no (hello)"
    [request] = FakeOpenAI.requests
    assert request["auth"] == "Bearer sk-test"
    assert request["model"] == "m1" and request["temperature"] == 0.0
    assert request["messages"] == [
        {"role": "system", "content": "rules"},
        {"role": "user", "content": "hello"},
    ]


async def test_no_key_sends_no_authorization(server, monkeypatch):
    monkeypatch.delenv("UNSET_KEY_FOR_TEST", raising=False)
    async with openai_compatible(server, "m1", "UNSET_KEY_FOR_TEST", max_tokens=5) as run:
        await run("x", Task(id="t", prompt="p"))
    assert FakeOpenAI.requests[0]["auth"] is None
    assert FakeOpenAI.requests[0]["max_tokens"] == 5


async def test_errors_are_completion_errors(server):
    async with openai_compatible(server, "broken", None) as run:
        with pytest.raises(CompletionError, match="not a chat completion"):
            await run("x", Task(id="t", prompt="p"))
    async with openai_compatible(server + "/wrong", "m", None) as run:
        with pytest.raises(CompletionError, match="HTTP 404"):
            await run("x", Task(id="t", prompt="p"))
    async with openai_compatible("http://127.0.0.1:9", "m", None, timeout=2.0) as run:
        with pytest.raises(CompletionError, match="request failed"):
            await run("x", Task(id="t", prompt="p"))


async def test_the_adapter_drives_an_evolution(server):
    tasks = [Task(id=f"t{i}", prompt=f"q{i}") for i in range(6)]

    def reward(task, output):
        return 1.0 if output == "yes" else 0.0

    def propose(rendered, task, output, value):
        return None if value == 1.0 else Edit(set={"instruction": "say yes"})

    async with openai_compatible(server, "m1", None) as run:
        result = await async_evolve(
            tasks, reward, run=run, propose=propose, workers=2, max_rollouts=4
        )
    assert result.commits == 1 and result.held_out == 1.0
    assert result.entries == {"instruction": "say yes"}


async def test_throttling_and_server_errors_are_retryable_with_retry_after(server):
    FakeOpenAI.failures = [(429, {"Retry-After": "3"}), (503, {}), (400, {})]
    async with openai_compatible(server, "m1", None) as run:
        errors = []
        for _ in range(3):
            with pytest.raises(CompletionError) as caught:
                await run("x", Task(id="t", prompt="p"))
            errors.append(caught.value)
    assert [(e.status, e.retryable, e.retry_after) for e in errors] == [
        (429, True, 3.0),
        (503, True, None),
        (400, False, None),
    ]
    async with openai_compatible("http://127.0.0.1:9", "m", None, timeout=2.0) as run:
        with pytest.raises(CompletionError) as caught:
            await run("x", Task(id="t", prompt="p"))
    assert caught.value.retryable and caught.value.status is None


def test_retry_after_accepts_seconds_and_http_dates():
    import datetime

    now = datetime.datetime(2025, 1, 1, 12, 0, 0, tzinfo=datetime.UTC)
    assert retry_after_seconds("12", now) == 12.0
    assert retry_after_seconds("Wed, 01 Jan 2025 12:00:30 GMT", now) == 30.0
    assert retry_after_seconds("Wed, 01 Jan 2025 11:00:00 GMT", now) == 0.0
    assert retry_after_seconds("later", now) is None and retry_after_seconds(None) is None


async def test_an_evolution_over_the_adapter_retries_throttling_and_prices_its_usage(server):
    tasks = [Task(id=f"t{i}", prompt=f"q{i}") for i in range(6)]
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)

    def reward(task, output):
        return 1.0 if output == "yes" else 0.0

    def propose(rendered, task, output, value):
        return None if value == 1.0 else Edit(set={"instruction": "say yes"})

    FakeOpenAI.failures = [(429, {"Retry-After": "2"})]
    price = Price(prompt=1.0, completion=2.0)
    async with openai_compatible(server, "m1", None) as run:
        result = await evolve(
            tasks,
            reward,
            run=run,
            propose=propose,
            workers=2,
            max_rollouts=4,
            prices={"m1": price},
            quality=1.0,
            retry=Retry(sleep=sleep),
        )
    assert waits == [2.0]  # the server's Retry-After, not the backoff
    [throttled] = result.errors
    assert throttled.error.endswith("CompletionError") and "HTTP 429" in throttled.message
    assert throttled.retried and result.failed_units == 0
    completions = [r for r in FakeOpenAI.requests if r["path"] == "/v1/chat/completions"]
    [usage] = result.usage
    assert usage.model == "m1" and usage.calls == len(completions) - 1  # the 429 had no usage
    assert isinstance(usage, Usage) and usage.completion_tokens == usage.calls
    assert result.cost == pytest.approx(price.cost(usage.prompt_tokens, usage.completion_tokens))
    assert result.held_out == 1.0 and result.time_to_quality is not None
    assert 0 < result.cost_to_quality <= result.cost  # type: ignore[operator]
