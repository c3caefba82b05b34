"""Evolution loops: improve an artifact (prompts, skills, rules) from rollouts over tasks.

Rollouts run the rendered artifact on training tasks, a proposer turns them
into edits, and a merger commits the edits that beat the head on held-out
tasks into a versioned ledger in the run store. :func:`evolve` runs
synchronous rounds with a barrier; :func:`async_evolve` runs N workers and one
merger without one, with straggler detection, re-runs from a resume queue and
detached stragglers. When the rollout is a tailrace graph whose turns are loop
visits, a straggler is preempted at a turn boundary and resumed, conversation
intact, against the newer head (partial rollouts; ``EvolutionResult.partial``
keeps the pairs).

Each merge decision is routed by an :class:`AuditScheduler` (the oracle, the
cheap ranking layer, queued audits paid from ``oracle_budget``); failing user
calls are recorded and retried (:class:`Retry`, ``EvolutionResult.errors``);
``max_seconds``, ``max_calls``, ``max_cost`` and ``patience`` end a loop with a
``stop_reason``; :func:`record_usage` and a :class:`Price` table give usage and
cost; ``selection="pareto"`` keeps a GEPA-style pool of candidates.
``executor=`` (say a ``RayExecutor``) runs every ``run``, ``reward`` and
``propose`` attempt on it, inputs and results as JSON, while the merger and
the ledger stay in the driving process.
"""

from ._accept import Acceptance as Acceptance
from ._accept import Verdict as Verdict
from ._accept import prob_beats as prob_beats
from ._async import async_evolve as async_evolve
from ._audit import FAST_MAX as FAST_MAX
from ._audit import AuditItem as AuditItem
from ._audit import AuditScheduler as AuditScheduler
from ._demo import DemoDomain as DemoDomain
from ._failures import FailedAttempt as FailedAttempt
from ._failures import Retry as Retry
from ._ledger import Ledger as Ledger
from ._ledger import Version as Version
from ._model import MIN_HELD_OUT as MIN_HELD_OUT
from ._model import Artifact as Artifact
from ._model import Edit as Edit
from ._model import HeldOutTooSmall as HeldOutTooSmall
from ._model import RolloutContext as RolloutContext
from ._model import Task as Task
from ._model import check_reward as check_reward
from ._model import current_rollout as current_rollout
from ._model import render_entries as render_entries
from ._model import split_tasks as split_tasks
from ._openai import CompletionError as CompletionError
from ._openai import OpenAICompatible as OpenAICompatible
from ._openai import openai_compatible as openai_compatible
from ._options import Progress as Progress
from ._options import Proposal as Proposal
from ._pool import Member as Member
from ._result import EvolutionResult as EvolutionResult
from ._result import Sweep as Sweep
from ._sync import evolve as evolve
from ._usage import Price as Price
from ._usage import Usage as Usage
from ._usage import record_usage as record_usage

__all__ = [
    "FAST_MAX",
    "MIN_HELD_OUT",
    "Acceptance",
    "Artifact",
    "AuditItem",
    "AuditScheduler",
    "CompletionError",
    "DemoDomain",
    "Edit",
    "EvolutionResult",
    "FailedAttempt",
    "HeldOutTooSmall",
    "Ledger",
    "Member",
    "OpenAICompatible",
    "Price",
    "Progress",
    "Proposal",
    "Retry",
    "RolloutContext",
    "Sweep",
    "Task",
    "Usage",
    "Verdict",
    "Version",
    "async_evolve",
    "check_reward",
    "current_rollout",
    "evolve",
    "openai_compatible",
    "prob_beats",
    "record_usage",
    "render_entries",
    "split_tasks",
]
