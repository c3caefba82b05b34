"""A deterministic synthetic domain: learn keyword -> label routing rules.

Each task is a customer message containing one keyword; its label is the team
that keyword belongs to. The artifact is a rule set (``route:<keyword>`` ->
label) rendered as sentences; the "model" follows the rendered rules exactly
and answers ``unknown`` when none applies. Rollout latency is heavy-tailed
(``latency`` seconds, ``spike_factor`` times that with probability
``spike_prob``), and the proposer is noisy: on a failed task it proposes the
right rule, except with probability ``noise`` a rule with a wrong label.
Everything is seeded by the task and call number, so a run's outcomes do not
depend on scheduling. Each rollout reports its usage (a word is a token) under
``DEMO_MODEL``, priced by ``DEMO_PRICES``.

>>> demo = DemoDomain(n_tasks=8, seed=1, latency=0.0)
>>> task = demo.tasks[0]
>>> route(demo.initial.render(), task.prompt)
'unknown'
>>> rules = demo.initial.apply(demo.correct_edit(task)).render()
>>> route(rules, task.prompt) == task.meta["label"]
True
"""

from __future__ import annotations

import asyncio
import random
import re
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from ._model import Artifact, Edit, Task
from ._usage import Price, record_usage

#: The name the demo's "model" reports its usage under, and a price for it
#: (a small hosted model's list price per million tokens), so the demo shows cost.
DEMO_MODEL = "demo-router"
DEMO_PRICES = {DEMO_MODEL: Price(prompt=0.15, completion=0.60)}

#: Teams and the keywords that route to them.
KEYWORDS: dict[str, tuple[str, ...]] = {
    "billing": ("refund", "invoice"),
    "shipping": ("parcel", "courier"),
    "technical": ("crash", "firmware"),
    "account": ("password", "login"),
    "sales": ("discount", "quote"),
}
_LABEL_OF = {kw: label for label, kws in KEYWORDS.items() for kw in kws}
_FILLER = ("please", "help", "today", "my", "about", "urgent", "thanks", "hello", "again")
_RULE = re.compile(r"^When a message mentions '([^']+)', answer (\w+)\.$")


def render_rules(entries: Mapping[str, str]) -> str:
    """Render ``route:<keyword>`` entries as one rule sentence each, sorted.

    Args:
        entries: ``route:<keyword>`` mapped to a label.

    >>> render_rules({"route:refund": "billing"})
    "When a message mentions 'refund', answer billing."
    """
    lines = [
        f"When a message mentions '{key.removeprefix('route:')}', answer {label}."
        for key, label in sorted(entries.items())
        if key.startswith("route:")
    ]
    return "\n".join(lines)


def route(rendered: str, prompt: str) -> str:
    """The synthetic model: the label of the first rule whose keyword is in ``prompt``.

    Args:
        rendered: Rule sentences as :func:`render_rules` writes them.
        prompt: The message.
    """
    words = set(prompt.split())
    for line in rendered.splitlines():
        match = _RULE.match(line)
        if match and match.group(1) in words:
            return match.group(2)
    return "unknown"


class DemoDomain:
    """Tasks, run, reward, proposer and a first artifact for the keyword-routing demo.

    Args:
        n_tasks: How many tasks (at least 4).
        seed: Seeds the tasks, the latencies and the proposer's noise.
        latency: Base rollout latency in seconds (0: no sleeping at all).
        spike_factor: A spiking rollout takes this many times ``latency``.
        spike_prob: Probability that a rollout spikes.
        noise: Probability that a proposal carries a wrong label.
        sleep: Awaited with each rollout's latency (default ``asyncio.sleep``).
    """

    def __init__(
        self,
        *,
        n_tasks: int = 40,
        seed: int = 0,
        latency: float = 0.004,
        spike_factor: float = 12.0,
        spike_prob: float = 0.15,
        noise: float = 0.25,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        if n_tasks < 4:
            raise ValueError(f"n_tasks must be >= 4, got {n_tasks}")
        if not 0.0 <= spike_prob <= 1.0 or not 0.0 <= noise <= 1.0:
            raise ValueError("spike_prob and noise must be probabilities")
        self.seed = seed
        self.latency = latency
        self.spike_factor = spike_factor
        self.spike_prob = spike_prob
        self.noise = noise
        self.sleep = sleep
        self.initial = Artifact(entries={}, renderer=render_rules)
        #: The price table of the demo's "model" (pass it as ``prices=``).
        self.prices = dict(DEMO_PRICES)
        self.tasks = [self._task(i) for i in range(n_tasks)]
        self._calls: Counter[str] = Counter()
        #: Rollouts run so far, and how many of them spiked.
        self.runs = 0
        self.spikes = 0

    def _task(self, index: int) -> Task:
        rng = random.Random(f"demo-task:{self.seed}:{index}")
        keyword = rng.choice(sorted(_LABEL_OF))
        words = [rng.choice(_FILLER) for _ in range(rng.randint(2, 6))]
        words.insert(rng.randint(0, len(words)), keyword)
        prompt = " ".join(words)
        return Task(
            id=f"t{index:03d}",
            prompt=prompt,
            meta={"label": _LABEL_OF[keyword], "keyword": keyword, "cost": 1.0},
        )

    def rollout_latency(self, task: Task, call: int) -> float:
        """The latency of the ``call``-th rollout of ``task`` (deterministic).

        Args:
            task: The task.
            call: 1 for its first rollout, 2 for the next, ...
        """
        rng = random.Random(f"demo-latency:{self.seed}:{task.id}:{call}")
        spike = rng.random() < self.spike_prob
        return self.latency * (self.spike_factor if spike else 1.0)

    async def run(self, rendered: str, task: Task) -> str:
        """Follow the rendered rules on ``task`` after a heavy-tailed delay.

        Args:
            rendered: The rendered rule set.
            task: The task.
        """
        self._calls[task.id] += 1
        delay = self.rollout_latency(task, self._calls[task.id])
        self.runs += 1
        # A word is a token here: the rules and the message in, one label out.
        record_usage(
            model=DEMO_MODEL,
            prompt_tokens=len(rendered.split()) + len(task.prompt.split()),
            completion_tokens=1,
        )
        self.spikes += int(delay > self.latency)
        if delay > 0:
            await self.sleep(delay)
        return route(rendered, task.prompt)

    async def reward(self, task: Task, output: Any) -> float:
        """1.0 when ``output`` is the task's label, else 0.0 (async: it is cheap, keep it on the loop).

        Args:
            task: The task.
            output: The routed label.
        """
        return 1.0 if output == task.meta["label"] else 0.0

    def correct_edit(self, task: Task) -> Edit:
        """The rule that routes ``task`` right.

        Args:
            task: The task.
        """
        keyword = str(task.meta["keyword"])
        return Edit(set={f"route:{keyword}": str(task.meta["label"])}, note=f"from {task.id}")

    async def propose(self, rendered: str, task: Task, output: Any, reward: float) -> Edit | None:
        """On a failure, propose a rule for the task's keyword; noisy, deterministic.

        Args:
            rendered: What the rollout rendered (seeds the noise with the task).
            task: The task.
            output: The rollout's output (unused: the demo proposer knows the keyword).
            reward: The rollout's reward; no proposal when it is 1.
        """
        if reward >= 1.0:
            return None
        rng = random.Random(f"demo-propose:{self.seed}:{task.id}:{rendered}")
        edit = self.correct_edit(task)
        if rng.random() < self.noise:
            wrong = sorted(set(KEYWORDS) - {str(task.meta["label"])})
            key = next(iter(edit.set))
            edit = Edit(set={key: rng.choice(wrong)}, note=f"noisy, from {task.id}")
        return edit
