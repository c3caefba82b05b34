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

import os
from collections.abc import Mapping, Sequence

from ..integrations.openai import CompletionError as CompletionError
from ..integrations.openai import ModelClient
from ..integrations.openai import retry_after_seconds as retry_after_seconds
from ._model import Task
from ._usage import record_usage


class OpenAICompatible:
    """An async ``run(rendered, task) -> str`` over ``POST {base_url}/chat/completions``.

    Build it with :func:`openai_compatible`. Use it as an async context
    manager, or call :meth:`aclose`, to release its connections. Requests go
    through a :class:`~tailrace.integrations.openai.ModelClient`, so a
    rollout run inside a tailrace node streams and checkpoints its answer.

    Args:
        client: The model client (its model name is sent with each request).
        temperature: Sampling temperature.
        max_tokens: Completion length bound; None leaves it to the server.
    """

    def __init__(
        self, client: ModelClient, *, temperature: float = 0.0, max_tokens: int | None = None
    ) -> None:
        self.client = client
        self.model = client.model
        self.temperature = temperature
        self.max_tokens = max_tokens

    async def complete(self, messages: Sequence[Mapping[str, str]]) -> str:
        """Return the assistant's answer to ``messages``.

        Args:
            messages: Chat messages (``{"role": ..., "content": ...}``).

        Raises:
            CompletionError: an HTTP error status, a transport failure, or a
                body that is not a chat completion.
        """
        generation = await self.client.chat(
            messages, max_tokens=self.max_tokens, temperature=self.temperature
        )
        record_usage(
            model=self.model,
            prompt_tokens=generation.prompt_tokens or 0,
            completion_tokens=generation.completion_tokens,
        )
        return generation.text

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
    api_key = os.environ.get(api_key_env) if api_key_env else None
    client = ModelClient(base_url, model, api_key=api_key, timeout=timeout, stream_tokens=False)
    return OpenAICompatible(client, temperature=temperature, max_tokens=max_tokens)
