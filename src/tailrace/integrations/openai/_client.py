"""The model client: generations that stream, checkpoint, stop and continue with their attempt.

Inside a handler a generation is part of the attempt (X1-X6):

- each event's text is a stream chunk ``{"text": ..., "tokens": n}`` of the
  attempt (S1), unless ``stream_tokens=False``;
- the partial generation is the attempt's checkpoint, saved every
  ``checkpoint_every`` tokens or ``checkpoint_interval`` seconds, whichever
  comes first (P1: one row per commit however often it is saved), without
  waiting for its commit; the finished generation is saved last and
  committed before the call returns (``checkpoint_durable``), so a crash
  after it never sends the request again;
- cancelling the attempt closes the request, so the server stops
  generating; what it decoded is saved on its way out (a parked item carries
  it, parked again with it);
- an attempt that resumes (crash, adoption, ``RetryPolicy(resume=True)``,
  unpark) continues from ``resumed_from``: it sends the prompt plus the
  salvaged text and asks only for the tokens still allowed (X3);
- the attempt's stream ends with a usage chunk ``{"usage": {...}}`` (prompt,
  decoded and salvaged tokens, the model versions, how many rounds the item
  was parked), read back by :func:`tail_accounting` (X4), and the same goes on
  the current OpenTelemetry span (the attempt's, under
  :func:`tailrace.integrations.otel.instrument`).

Outside a handler a generation is a plain streamed request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Self

from ..._context import NodeContext, current_node
from ...tail import generation_checkpoint, generation_origin, generation_state
from ._errors import CompletionError, retry_after_seconds
from ._pools import Pools
from ._replicas import Replica, Replicas
from ._wire import Delta, Prompt, choice_delta, event_delta, request_body, usage_tokens

if TYPE_CHECKING:
    import httpx

#: Requests one httpx client streams at once (see :mod:`._pools`): its pool's bookkeeping
#: per request grows with the square of the connections it keeps.
POOL_SIZE = 16


@dataclass(frozen=True, slots=True, kw_only=True)
class Generation:
    """What one generation returned, and what it cost this attempt.

    ``text`` starts with the salvaged text when the attempt continued a
    checkpoint. ``completion_tokens`` is ``salvaged_tokens`` (reused from the
    checkpoint) plus ``decoded_tokens`` (decoded by this attempt).
    ``salvaged_version`` is the model version of the salvaged part's last
    piece; ``stale`` says it differs from ``version``. ``rounds`` counts the
    times the item was parked before it finished.
    """

    text: str
    finish_reason: str
    prompt_tokens: int | None
    decoded_tokens: int
    salvaged_tokens: int
    version: str | None
    salvaged_version: str | None
    rounds: int
    replica: str | None

    @property
    def completion_tokens(self) -> int:
        """Tokens of the whole completion: salvaged plus decoded."""
        return self.salvaged_tokens + self.decoded_tokens

    @property
    def stale(self) -> bool:
        """Whether part of the text came from another model version than this attempt's."""
        return self.salvaged_tokens > 0 and self.salvaged_version != self.version


@dataclass(slots=True, kw_only=True)
class _Partial:
    """The generation so far, as the checkpoint holds it (JSON-ready)."""

    origin: str | None
    text: str = ""
    tokens: int = 0
    token_ids: list[int] | None = None
    segments: list[list[Any]] = field(default_factory=list)  # [version, tokens], in order
    rounds: int = 0
    finish: str | None = None
    prompt_tokens: int | None = None
    moved: bool = False  # continued from another run's checkpoint (an unparked item)

    @classmethod
    def resumed(cls, ctx: NodeContext | None) -> _Partial:
        """The partial generation ``ctx`` resumes; a new one when there is none."""
        if ctx is None:
            return cls(origin=None, token_ids=[])
        origin = generation_origin(ctx.run_id, ctx.node_id, ctx.visit, ctx.item)
        saved = ctx.resumed_from
        state = generation_state(saved.value) if saved else None
        if state is None:
            return cls(origin=origin, token_ids=[])
        ids = state.get("token_ids")
        partial = cls(
            origin=str(state.get("origin") or origin),
            text=str(state.get("text", "")),
            tokens=int(state.get("tokens", 0)),
            token_ids=[int(i) for i in ids] if isinstance(ids, list) else None,
            segments=[list(s) for s in state.get("segments", [])],
            rounds=int(state.get("rounds", 0)),
            finish=state.get("finish"),
            prompt_tokens=state.get("prompt_tokens"),
        )
        if saved is not None and saved.run_id != ctx.run_id:
            partial.rounds += 1  # it waited a round parked (finished or not)
            partial.moved = True
        return partial

    @property
    def version(self) -> str | None:
        return self.segments[-1][0] if self.segments else None

    def add(self, delta: Delta, version: str | None) -> None:
        self.text += delta.text
        self.tokens += delta.tokens
        if self.token_ids is not None and delta.token_ids is not None:
            self.token_ids.extend(delta.token_ids)
        elif delta.tokens and delta.token_ids is None:
            self.token_ids = None  # ids are kept only while every event carries them
        if delta.tokens:
            if self.segments and self.segments[-1][0] == version:
                self.segments[-1][1] += delta.tokens
            else:
                self.segments.append([version, delta.tokens])

    def value(self) -> dict[str, Any]:
        state = {
            "text": self.text, "tokens": self.tokens, "segments": self.segments,
            "rounds": self.rounds, "origin": self.origin, "finish": self.finish,
            "prompt_tokens": self.prompt_tokens, "version": self.version,
        }  # fmt: skip
        if self.token_ids is not None:
            state["token_ids"] = self.token_ids
        return generation_checkpoint(state)


class _Attempt:
    """The attempt a generation belongs to: where its checkpoints and chunks go, at what rate,
    and what it salvaged."""

    def __init__(self, ctx: NodeContext | None, client: ModelClient, partial: _Partial) -> None:
        self.ctx = ctx
        self.every, self.interval = client.checkpoint_every, client.checkpoint_interval
        self.stream_tokens, self.version = client.stream_tokens, client.version
        self.can_stream = self.can_save = ctx is not None
        self.salvaged, self.salvaged_version = partial.tokens, partial.version
        self.checkpointed = partial.tokens
        self.saved_at = time.monotonic()

    def publish(self, chunk: Any) -> None:
        if self.ctx is None or not self.can_stream:
            return
        try:
            self.ctx.stream(chunk)
        except RuntimeError:  # a handler run in another process: it has no stream
            self.can_stream = False

    def delta(self, delta: Delta, partial: _Partial) -> None:
        if self.stream_tokens and delta.text:
            self.publish({"text": delta.text, "tokens": delta.tokens})
        if delta.finish_reason is not None:
            # Saved at once: an attempt parked or cut while the rest of the stream (usage,
            # [DONE]) arrives resumes a finished generation, and sends nothing more.
            self.save(partial, first=True)
            return
        due = partial.tokens - self.checkpointed >= self.every
        if due or time.monotonic() - self.saved_at >= self.interval:
            self.save(partial)

    def save(self, partial: _Partial, *, first: bool = False) -> None:
        """Save ``partial`` as the attempt's checkpoint if it grew (or, ``first``, at all)."""
        if (
            self.ctx is None
            or not self.can_save
            or (partial.tokens == self.checkpointed and not first)
        ):
            return
        try:
            self.ctx.checkpoint(partial.value())
        except RuntimeError:  # a handler run in another process: nowhere to save
            self.can_save = False
            return
        self.saved_at, self.checkpointed = time.monotonic(), partial.tokens

    async def save_committed(self, partial: _Partial) -> None:
        """Save ``partial`` as the attempt's checkpoint and return once it is committed."""
        if self.ctx is None or not self.can_save:
            return
        try:
            await self.ctx.checkpoint_durable(partial.value())
        except RuntimeError:  # a handler run in another process: nowhere to save
            self.can_save = False
            return
        self.saved_at, self.checkpointed = time.monotonic(), partial.tokens

    def report(self, partial: _Partial, outcome: str, model: str) -> None:
        """End the attempt's stream with its usage, and put it on the current trace span."""
        usage = self.usage(partial, outcome)
        self.publish({"usage": usage})
        _annotate_span(usage, model)

    def usage(self, partial: _Partial, outcome: str) -> dict[str, Any]:
        """The attempt's usage chunk: what :func:`tail_accounting` reads back."""
        return {
            "outcome": outcome, "prompt": partial.prompt_tokens,
            "decoded": partial.tokens - self.salvaged, "salvaged": self.salvaged,
            "checkpointed": self.checkpointed, "version": self.version,
            "salvaged_version": self.salvaged_version, "rounds": partial.rounds,
            "origin": partial.origin, "finish": partial.finish, "tokens": partial.tokens,
        }  # fmt: skip


def _annotate_span(usage: dict[str, Any], model: str) -> None:
    """Put a generation's usage on the current OpenTelemetry span (the attempt's span under
    :func:`tailrace.integrations.otel.instrument`), when OpenTelemetry is installed."""
    try:
        from opentelemetry import trace  # the otel extra is optional
    except ImportError:  # pragma: no cover - exercised only without opentelemetry
        return
    span = trace.get_current_span()
    if not span.is_recording():
        return
    attributes = {
        "gen_ai.request.model": model, "gen_ai.usage.input_tokens": usage["prompt"],
        "gen_ai.usage.output_tokens": usage["decoded"],
        "tailrace.generation.salvaged_tokens": usage["salvaged"],
        "tailrace.generation.checkpointed_tokens": usage["checkpointed"],
        "tailrace.generation.outcome": usage["outcome"],
        "tailrace.generation.version": usage["version"],
        "tailrace.generation.salvaged_version": usage["salvaged_version"],
        "tailrace.generation.rounds": usage["rounds"],
    }  # fmt: skip
    span.set_attributes({k: v for k, v in attributes.items() if v is not None})


class ModelClient:
    """A client for OpenAI-compatible servers (vLLM, SGLang, llama.cpp, hosted APIs).

    Use it inside handlers: :meth:`complete` and :meth:`chat` stream, save
    and continue their generation with the attempt that calls them (see the
    module's documentation). Use it as an async context manager, or call
    :meth:`aclose`, to release its connections.

    Args:
        base_urls: The API root (``http://127.0.0.1:8000/v1``), or one per
            replica of the same model: requests go to the replica with the
            fewest outstanding requests.
        model: The model name sent with each request.
        version: The version of the model's weights, saved with every
            checkpoint; a continuation under another version is ``stale``.
        api_key: Sent as a bearer token when not None.
        timeout: Seconds to wait for each read of an answer (a stream's next
            event included).
        connect_timeout: Seconds to wait for a connection.
        checkpoint_every: Tokens between two checkpoints at most.
        checkpoint_interval: Seconds between two checkpoints at most.
        stream_tokens: Publish each event's text as a stream chunk.
        continue_chat: Continue a salvaged chat message with
            ``continue_final_message`` (vLLM, SGLang); False starts a resumed
            chat generation over (for servers that refuse the field).
        transport: An httpx transport to send requests through (default: the network).
    """

    def __init__(
        self,
        base_urls: str | Sequence[str],
        model: str,
        *,
        version: str | None = None,
        api_key: str | None = None,
        timeout: float = 60.0,
        connect_timeout: float = 5.0,
        checkpoint_every: int = 16,
        checkpoint_interval: float = 0.25,
        stream_tokens: bool = True,
        continue_chat: bool = True,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        try:
            import httpx  # the openai extra is optional
        except ImportError as exc:  # pragma: no cover - exercised only without httpx
            raise ImportError("ModelClient needs httpx: pip install 'tailrace[openai]'") from exc
        if checkpoint_every < 1 or checkpoint_interval <= 0:
            raise ValueError("checkpoint_every must be >= 1 and checkpoint_interval > 0")
        self.model, self.version = model, version
        self.replicas = Replicas([base_urls] if isinstance(base_urls, str) else base_urls)
        self.checkpoint_every, self.checkpoint_interval = checkpoint_every, checkpoint_interval
        self.stream_tokens, self.continue_chat = stream_tokens, continue_chat
        options: dict[str, Any] = {
            "timeout": httpx.Timeout(timeout, connect=connect_timeout),
            "limits": httpx.Limits(max_connections=None, max_keepalive_connections=POOL_SIZE),
            "headers": {"Authorization": f"Bearer {api_key}"} if api_key else None,
        }
        if transport is not None:
            options["transport"] = transport
        elif hasattr(httpx, "create_ssl_context"):  # one TLS context for every pool (0.28+)
            options["verify"] = httpx.create_ssl_context()
        self._pools = Pools(
            lambda: httpx.AsyncClient(**options), None if transport is not None else POOL_SIZE
        )

    async def complete(
        self, prompt: Prompt, *, max_tokens: int | None = None, **options: Any
    ) -> Generation:
        """Generate a completion of ``prompt`` (``POST /completions``).

        Args:
            prompt: The prompt: text, or token ids (then a continuation
                appends the salvaged token ids when the server sent them).
            max_tokens: The completion's length bound (salvaged tokens count
                against it); None leaves it to the server.
            **options: More fields of the request (``temperature``, ``seed``, ``stop``, ...).

        Raises:
            CompletionError: the request failed, the answer is not a
                completion, or the stream was cut (``retryable`` says whether
                another attempt may succeed).
        """
        return await self._generate(prompt, None, max_tokens, options)

    async def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        max_tokens: int | None = None,
        **options: Any,
    ) -> Generation:
        """Generate the next assistant message after ``messages`` (``POST /chat/completions``).

        A continuation sends the salvaged text as a final assistant message
        with ``continue_final_message`` (vLLM, SGLang); use :meth:`complete`
        with a server that cannot continue a chat message (llama.cpp).

        Args:
            messages: Chat messages (``{"role": ..., "content": ...}``).
            max_tokens: The message's length bound (salvaged tokens count
                against it); None leaves it to the server.
            **options: More fields of the request (``temperature``, ``seed``, ``stop``, ...).

        Raises:
            CompletionError: as for :meth:`complete`.
        """
        return await self._generate(None, messages, max_tokens, options)

    async def _generate(
        self,
        prompt: Prompt | None,
        messages: Sequence[Mapping[str, Any]] | None,
        max_tokens: int | None,
        options: Mapping[str, Any],
    ) -> Generation:
        ctx = current_node()
        partial = _Partial.resumed(ctx)
        if messages is not None and not self.continue_chat and partial.finish is None:
            partial = _Partial(
                origin=partial.origin, rounds=partial.rounds, token_ids=[], moved=True
            )
        attempt = _Attempt(ctx, self, partial)
        if ctx is not None and (ctx.resumed_from is None or partial.moved):
            attempt.save(partial, first=True)  # parked before its next token, it keeps its story
        salvaged = partial.tokens
        replica: str | None = None
        try:
            if partial.finish is None and (max_tokens is None or max_tokens > salvaged):
                body = request_body(
                    model=self.model, prompt=prompt, messages=messages, prefix=partial.text,
                    prefix_ids=partial.token_ids, options=options,
                    max_tokens=None if max_tokens is None else max_tokens - salvaged,
                )  # fmt: skip
                replica = await self._request(body, messages is not None, partial, attempt)
            else:
                partial.finish = partial.finish or "length"
            # With its finish reason, committed before the generation returns: a crash from
            # here on sends nothing again (one commit's wait per generation, none per token).
            await attempt.save_committed(partial)
        except BaseException as exc:
            # However the attempt ends, what it decoded is saved: the next try
            # (RetryPolicy(resume=True)) or a parked item (parked again with it) continues
            # from there, so checkpoints at a coarse rate lose nothing at a park (X2). Its
            # stream ends with its usage, cancelled while it waits for that commit too (X4).
            attempt.save(partial)
            cancelled = isinstance(exc, asyncio.CancelledError)
            attempt.report(partial, "cancelled" if cancelled else "failed", self.model)
            raise
        attempt.report(partial, "completed", self.model)
        return Generation(
            text=partial.text, finish_reason=partial.finish or "length",
            prompt_tokens=partial.prompt_tokens, decoded_tokens=partial.tokens - salvaged,
            salvaged_tokens=salvaged, version=self.version,
            salvaged_version=attempt.salvaged_version, rounds=partial.rounds, replica=replica,
        )  # fmt: skip

    async def _request(
        self,
        body: dict[str, Any],
        chat: bool,
        partial: _Partial,
        attempt: _Attempt,
    ) -> str:
        """Send ``body`` and add its answer to ``partial``; the replica that answered."""
        import httpx  # the openai extra is optional: imported only when a request is made

        ctx = attempt.ctx
        unit = None if ctx is None else (ctx.run_id, ctx.node_id, ctx.visit, ctx.item)
        replica, wait = self.replicas.pick(unit)
        if wait > 0:
            await asyncio.sleep(wait)  # every replica asked to wait (Retry-After)
        try:
            with self.replicas.serving(replica, unit):
                path = "chat/completions" if chat else "completions"
                with self._pools.client() as http:
                    async with http.stream("POST", replica.url + path, json=body) as response:
                        await self._check_status(response, replica)
                        await self._read(response, chat, partial, attempt)
        except httpx.HTTPError as exc:
            raise CompletionError(f"{self.model}: request failed: {exc!r}", retryable=True) from exc
        return replica.url

    async def _check_status(self, response: httpx.Response, replica: Replica) -> None:
        status = response.status_code
        if status < 400:
            return
        text = (await response.aread()).decode("utf-8", "replace")
        retry_after = retry_after_seconds(response.headers.get("Retry-After"))
        if retry_after:
            self.replicas.wait_out(replica, retry_after)
        raise CompletionError(
            f"{self.model}: HTTP {status}: {text[:200]}",
            status=status,
            retryable=status == 429 or status >= 500,
            retry_after=retry_after,
        )

    async def _read(
        self, response: httpx.Response, chat: bool, partial: _Partial, attempt: _Attempt
    ) -> None:
        """Add the answer's events to ``partial``; a stream without a finish reason was cut."""
        if not response.headers.get("content-type", "").startswith("text/event-stream"):
            await response.aread()
            try:
                answer = response.json()
            except ValueError as exc:
                raise CompletionError(f"{self.model}: not a completion: {exc!r}") from exc
            if not isinstance(answer, dict):
                raise CompletionError(f"{self.model}: not a completion: {answer!r:.200}")
            self._take(choice_delta(answer, chat, self.model, streamed=False), partial, attempt)
            partial.finish = partial.finish or "stop"  # a whole answer is complete
            return
        # Lines are split here, off the bytes as they come: a read holds several events, and
        # httpx's text and line decoders cost as much again as the events' JSON.
        pending = b""
        async for data in response.aiter_bytes():
            lines = (pending + data).splitlines(keepends=True)
            pending = lines.pop() if lines and not lines[-1].endswith((b"\n", b"\r")) else b""
            for line in lines:
                delta = event_delta(line, chat, self.model)
                if delta is not None:
                    self._take(delta, partial, attempt)
        delta = event_delta(pending, chat, self.model)  # a last line without its line end
        if delta is not None:
            self._take(delta, partial, attempt)
        if partial.finish is None:
            raise CompletionError(
                f"{self.model}: the stream ended without a finish reason (cut)", retryable=True
            )

    def _take(self, delta: Delta, partial: _Partial, attempt: _Attempt) -> None:
        if delta.usage is not None:
            partial.prompt_tokens = usage_tokens(delta.usage, "prompt_tokens")
        if delta.text or delta.tokens:
            partial.add(delta, self.version)
        if delta.finish_reason is not None:
            partial.finish = delta.finish_reason
        if delta.text or delta.tokens or delta.finish_reason is not None:
            attempt.delta(delta, partial)

    async def aclose(self) -> None:
        """Close the client's connections."""
        await self._pools.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
