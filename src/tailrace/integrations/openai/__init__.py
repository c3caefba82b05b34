"""A client for OpenAI-compatible inference servers whose generations are attempts (X1-X6).

:class:`ModelClient` calls vLLM, SGLang, llama.cpp or a hosted API from
inside a handler. A generation streams its tokens as the attempt's stream
chunks, saves its partial text as the attempt's checkpoint (with the model
version that produced it), stops at the server when the attempt is
cancelled (a first-k loser, a hedge loser, a deadline, a park) and continues
from the checkpoint when the attempt resumes. :func:`tail_accounting` reads a
map's runs back: tokens decoded, salvaged and wasted, the length bias of what
was accepted, and how long parked items have waited.

:class:`BatchingServer` is an OpenAI-compatible server of the project's own
that decodes many requests at once, with heavy-tailed lengths, for tests and
benchmarks at a scale a CPU model cannot reach.

Needs ``pip install 'tailrace[openai]'`` (httpx)::

    client = ModelClient(["http://gpu-0:8000/v1", "http://gpu-1:8000/v1"], "qwen", version="step-7")

    @g.map(required=48, late="park", resume_parked=True,
           retry=RetryPolicy(attempts=4, resume=True, retry_on=(CompletionError,)))
    async def rollout(prompt: str) -> str:
        generation = await client.complete(prompt, max_tokens=2048, temperature=1.0)
        return generation.text
"""

from ...tail import ItemAccount as ItemAccount
from ...tail import TailAccount as TailAccount
from ...tail import ks_statistic as ks_statistic
from ._accounting import tail_accounting as tail_accounting
from ._client import Generation as Generation
from ._client import ModelClient as ModelClient
from ._errors import CompletionError as CompletionError
from ._errors import retry_after_seconds as retry_after_seconds
from ._server import BatchingServer as BatchingServer
from ._server import ServerStats as ServerStats

__all__ = [
    "BatchingServer",
    "CompletionError",
    "Generation",
    "ItemAccount",
    "ModelClient",
    "ServerStats",
    "TailAccount",
    "ks_statistic",
    "retry_after_seconds",
    "tail_accounting",
]
