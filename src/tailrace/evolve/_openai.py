"""Real model access: a completion adapter for OpenAI-compatible chat endpoints (httpx).

Needs ``pip install 'tailrace[openai]'``; httpx is imported when the adapter
is built, so the rest of :mod:`tailrace.evolve` works without it. The adapter
is a ``run`` callable: the rendered artifact is the system message and the
task's prompt the user message.

Each response's ``usage`` (prompt and completion tokens) is counted with
:func:`~tailrace.evolve.record_usage` under the adapter's model name, so an
evolution's price table turns it into cost. Failures raise
:class:`CompletionError`; those worth retrying (HTTP 429 and 5xx, timeouts,
dropped connections) say so with ``retryable`` and carry the server's
``Retry-After`` as ``retry_after`` seconds, which :class:`~tailrace.evolve.Retry`
honours.
"""

from __future__ import annotations

import datetime
import email.utils
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ._model import Task
from ._usage import record_usage

if TYPE_CHECKING:
    import httpx


class CompletionError(RuntimeError):
    """The endpoint failed or answered something that is not a chat completion.

    Args:
        message: What went wrong, naming the model.
        status: The HTTP status, when there was a response.
        retryable: True for failures another attempt may fix (429, 5xx,
            timeouts, transport errors).
        retry_after: Seconds the server asked to wait (``Retry-After``), if any.
    """

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        retryable: bool = False,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.retryable = retryable
        self.retry_after = retry_after


def retry_after_seconds(value: str | None, now: datetime.datetime | None = None) -> float | None:
    """Seconds a ``Retry-After`` header asks to wait (delta-seconds or an HTTP date), or None.

    Args:
        value: The header's value.
        now: The current time, for an HTTP date (default: now, UTC).

    >>> retry_after_seconds("7"), retry_after_seconds("soon")
    (7.0, None)
    """
    if value is None:
        return None
    text = value.strip()
    if text.isdigit():
        return float(text)
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.UTC)
    now = now or datetime.datetime.now(datetime.UTC)
    return max(0.0, (when - now).total_seconds())


class OpenAICompatible:
    """An async ``run(rendered, task) -> str`` over ``POST {base_url}/chat/completions``.

    Build it with :func:`openai_compatible`. Use it as an async context
    manager, or call :meth:`aclose`, to release its connections.

    Args:
        client: The httpx client (its base URL is the API root).
        model: The model name sent with each request.
        api_key: Sent as a bearer token when not None.
        temperature: Sampling temperature.
        max_tokens: Completion length bound; None leaves it to the server.
    """

    def __init__(
        self,
        client: httpx.AsyncClient,
        model: str,
        api_key: str | None,
        *,
        temperature: float = 0.0,
        max_tokens: int | None = None,
    ) -> None:
        self.client = client
        self.model = model
        self.temperature = temperature
        self.max_tokens = max_tokens
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def complete(self, messages: Sequence[Mapping[str, str]]) -> str:
        """Return the first choice's message content for ``messages``.

        Args:
            messages: Chat messages (``{"role": ..., "content": ...}``).

        Raises:
            CompletionError: an HTTP error status, a transport failure, or a
                body without ``choices[0].message.content``.
        """
        import httpx  # the openai extra is optional: imported only when a request is made

        body: dict[str, Any] = {
            "model": self.model,
            "messages": [dict(m) for m in messages],
            "temperature": self.temperature,
        }
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        try:
            response = await self.client.post("chat/completions", json=body, headers=self._headers)
        except httpx.HTTPError as exc:  # timeouts and transport failures: worth another try
            raise CompletionError(f"{self.model}: request failed: {exc!r}", retryable=True) from exc
        if response.status_code >= 400:
            status = response.status_code
            raise CompletionError(
                f"{self.model}: HTTP {status}: {response.text[:200]}",
                status=status,
                retryable=status == 429 or status >= 500,
                retry_after=retry_after_seconds(response.headers.get("Retry-After")),
            )
        try:
            data = response.json()
            content = data["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise CompletionError(f"{self.model}: not a chat completion: {exc!r}") from exc
        if not isinstance(content, str):
            raise CompletionError(f"{self.model}: message content is not text: {content!r}")
        self._count_usage(data.get("usage"))
        return content

    def _count_usage(self, usage: Any) -> None:
        """Count the response's ``usage`` (a server that sends none is counted as a call only)."""
        usage = usage if isinstance(usage, dict) else {}
        prompt, completion = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
        valid = all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in (prompt, completion)
        )
        record_usage(
            model=self.model,
            prompt_tokens=prompt if valid else 0,
            completion_tokens=completion if valid else 0,
        )

    async def __call__(self, rendered: str, task: Task) -> str:
        """Run the artifact on a task: ``rendered`` as the system message, ``task.prompt`` as the user's.

        Args:
            rendered: The rendered artifact.
            task: The task.
        """
        return await self.complete(
            [{"role": "system", "content": rendered}, {"role": "user", "content": task.prompt}]
        )

    async def aclose(self) -> None:
        """Close the underlying client."""
        await self.client.aclose()

    async def __aenter__(self) -> OpenAICompatible:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


def openai_compatible(
    base_url: str,
    model: str,
    api_key_env: str | None = "OPENAI_API_KEY",
    *,
    timeout: float = 60.0,
    temperature: float = 0.0,
    max_tokens: int | None = None,
) -> OpenAICompatible:
    """Build a ``run`` callable for any OpenAI-compatible chat completions endpoint.

    Args:
        base_url: The API root, e.g. ``https://api.openai.com/v1`` or a local
            server's ``http://127.0.0.1:8000/v1``.
        model: The model name.
        api_key_env: The environment variable holding the API key; an unset
            variable (or None) sends no key, which local servers accept.
        timeout: Seconds per request.
        temperature: Sampling temperature.
        max_tokens: Completion length bound; None leaves it to the server.

    Raises:
        ImportError: httpx is missing (``pip install 'tailrace[openai]'``).
    """
    try:
        import httpx  # the openai extra is optional
    except ImportError as exc:  # pragma: no cover - exercised only without httpx
        raise ImportError("openai_compatible needs httpx: pip install 'tailrace[openai]'") from exc
    api_key = os.environ.get(api_key_env) if api_key_env else None
    client = httpx.AsyncClient(base_url=base_url.rstrip("/") + "/", timeout=timeout)
    return OpenAICompatible(client, model, api_key, temperature=temperature, max_tokens=max_tokens)
