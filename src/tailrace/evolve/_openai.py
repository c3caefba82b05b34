"""Real model access: a completion adapter for OpenAI-compatible chat endpoints (httpx).

Needs ``pip install 'tailrace[openai]'``; httpx is imported when the adapter
is built, so the rest of :mod:`tailrace.evolve` works without it. The adapter
is a ``run`` callable: the rendered artifact is the system message and the
task's prompt the user message.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ._model import Task

if TYPE_CHECKING:
    import httpx


class CompletionError(RuntimeError):
    """The endpoint failed or answered something that is not a chat completion."""


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
        import httpx

        body: dict[str, Any] = {
            "model": self.model,
            "messages": [dict(m) for m in messages],
            "temperature": self.temperature,
        }
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        try:
            response = await self.client.post("chat/completions", json=body, headers=self._headers)
        except httpx.HTTPError as exc:
            raise CompletionError(f"{self.model}: request failed: {exc}") from exc
        if response.status_code >= 400:
            raise CompletionError(
                f"{self.model}: HTTP {response.status_code}: {response.text[:200]}"
            )
        try:
            content = response.json()["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise CompletionError(f"{self.model}: not a chat completion: {exc!r}") from exc
        if not isinstance(content, str):
            raise CompletionError(f"{self.model}: message content is not text: {content!r}")
        return content

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
        import httpx
    except ImportError as exc:  # pragma: no cover - exercised only without httpx
        raise ImportError("openai_compatible needs httpx: pip install 'tailrace[openai]'") from exc
    api_key = os.environ.get(api_key_env) if api_key_env else None
    client = httpx.AsyncClient(base_url=base_url.rstrip("/") + "/", timeout=timeout)
    return OpenAICompatible(client, model, api_key, temperature=temperature, max_tokens=max_tokens)
