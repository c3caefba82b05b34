"""The OpenAI wire format: request bodies for a (continued) generation, and the events of a
streamed answer (server-sent events) or of a whole one (a server that ignores ``stream``).

A continuation sends the prompt plus the salvaged text as the answer's prefix:
for ``/completions`` the prefix is appended to the prompt (token ids to token
ids when both are ids); for ``/chat/completions`` it is the final assistant
message, continued with ``continue_final_message`` (vLLM, SGLang).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ._errors import CompletionError

Prompt = str | list[int]


@dataclass(frozen=True, slots=True, kw_only=True)
class Delta:
    """One event of an answer: new text, how many tokens it holds, and what ended it.

    ``tokens`` counts the event's ``logprobs.content`` or ``token_ids`` when
    the server sends them, else one token per event with text (vLLM and
    llama.cpp stream one token an event). ``usage`` is the answer's usage
    when the event carries it.
    """

    text: str
    tokens: int
    token_ids: tuple[int, ...] | None = None
    finish_reason: str | None = None
    usage: Mapping[str, Any] | None = None


def request_body(
    *,
    model: str,
    prompt: Prompt | None,
    messages: Sequence[Mapping[str, Any]] | None,
    prefix: str,
    prefix_ids: Sequence[int] | None,
    max_tokens: int | None,
    options: Mapping[str, Any],
) -> dict[str, Any]:
    """The JSON body of one streamed request that continues after ``prefix`` (maybe empty)."""
    body: dict[str, Any] = {"model": model, **options, "stream": True}
    body["stream_options"] = {"include_usage": True}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if messages is not None:
        sent = [dict(m) for m in messages]
        if prefix:
            sent.append({"role": "assistant", "content": prefix})
            body["continue_final_message"] = True
            body["add_generation_prompt"] = False
        body["messages"] = sent
        return body
    if isinstance(prompt, list):
        body["prompt"] = list(prompt) + list(prefix_ids or ())
        body["return_token_ids"] = True
    else:
        body["prompt"] = (prompt or "") + prefix
    return body


def event_delta(line: bytes, chat: bool, model: str) -> Delta | None:
    """The delta of one server-sent-event line (its line end included or not); None for a
    comment, a blank or ``[DONE]``."""
    if not line.startswith(b"data:"):
        return None
    data = line[5:].strip()
    if not data or data == b"[DONE]":
        return None
    try:
        event = json.loads(data)
    except ValueError as exc:
        raise CompletionError(f"{model}: a stream event is not JSON: {_shown(data)}") from exc
    if not isinstance(event, dict):
        raise CompletionError(f"{model}: a stream event is not an object: {_shown(data)}")
    if "error" in event:
        raise CompletionError(f"{model}: the server ended the stream: {event['error']!r}")
    return choice_delta(event, chat, model, streamed=True)


def _shown(data: bytes) -> str:
    """The start of an event's data as text, quoted, for an error message."""
    return repr(data[:200].decode("utf-8", "replace"))


def choice_delta(event: Mapping[str, Any], chat: bool, model: str, *, streamed: bool) -> Delta:
    """The first choice of a streamed event or of a whole answer, as a :class:`Delta`."""
    usage = event.get("usage") if isinstance(event.get("usage"), dict) else None
    kind = "chat completion" if chat else "completion"
    choices = event.get("choices")
    if not choices:  # the usage-only event that ends a stream
        if usage is None and not streamed:
            raise CompletionError(f"{model}: not a {kind}: no choices")
        return Delta(text="", tokens=0, usage=usage)
    try:
        choice = choices[0]
        if chat:
            part = choice["delta"] if streamed else choice["message"]
            text = part.get("content") or ""
        else:
            text = choice.get("text") or ""
    except (KeyError, IndexError, TypeError, AttributeError) as exc:
        raise CompletionError(f"{model}: not a {kind}: {exc!r}") from exc
    if not isinstance(text, str):
        raise CompletionError(f"{model}: content is not text: {text!r}")
    ids = choice.get("token_ids")
    token_ids = tuple(ids) if isinstance(ids, list) and all(type(i) is int for i in ids) else None
    return Delta(
        text=text,
        tokens=_tokens_of(choice, text, token_ids, usage, streamed),
        token_ids=token_ids,
        finish_reason=choice.get("finish_reason") or None,
        usage=usage,
    )


def _tokens_of(
    choice: Mapping[str, Any],
    text: str,
    token_ids: tuple[int, ...] | None,
    usage: Mapping[str, Any] | None,
    streamed: bool,
) -> int:
    logprobs = choice.get("logprobs")
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    if isinstance(content, list):
        return len(content)
    if token_ids is not None:
        return len(token_ids)
    if not streamed:
        completion = usage.get("completion_tokens") if usage else None
        return completion if type(completion) is int and completion >= 0 else int(bool(text))
    return int(bool(text))


def usage_tokens(usage: Mapping[str, Any] | None, name: str) -> int | None:
    """A whole, non-negative count from ``usage`` (``prompt_tokens``, ...), or None."""
    value = usage.get(name) if usage else None
    return value if type(value) is int and value >= 0 else None
