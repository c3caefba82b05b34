"""Evolution loops: improve an artifact (prompts, skills, rules) from rollouts over tasks.

Rollouts run the rendered artifact on training tasks, a proposer turns them
into edits, and a merger commits the edits that beat the head on held-out
tasks into a versioned ledger in the run store. :func:`evolve` runs
synchronous rounds with a barrier; :func:`async_evolve` runs N workers and one
merger without one, with straggler detection and re-runs from a resume queue.
When the rollout is a tailrace graph whose turns are loop visits, a straggler
is preempted at a turn boundary and resumed, conversation intact, against the
newer head (partial rollouts; ``EvolutionResult.partial`` keeps the pairs).
"""

from ._accept import Acceptance as Acceptance
from ._accept import Verdict as Verdict
from ._accept import prob_beats as prob_beats
from ._async import async_evolve as async_evolve
from ._audit import FAST_MAX as FAST_MAX
from ._audit import AuditItem as AuditItem
from ._audit import AuditScheduler as AuditScheduler
from ._core import Progress as Progress
from ._core import Proposal as Proposal
from ._demo import DemoDomain as DemoDomain
from ._ledger import Ledger as Ledger
from ._ledger import Version as Version
from ._model import Artifact as Artifact
from ._model import Edit as Edit
from ._model import RolloutContext as RolloutContext
from ._model import Task as Task
from ._model import check_reward as check_reward
from ._model import current_rollout as current_rollout
from ._model import render_entries as render_entries
from ._model import split_tasks as split_tasks
from ._openai import CompletionError as CompletionError
from ._openai import OpenAICompatible as OpenAICompatible
from ._openai import openai_compatible as openai_compatible
from ._result import EvolutionResult as EvolutionResult
from ._result import Sweep as Sweep
from ._sync import evolve as evolve

__all__ = [
    "FAST_MAX",
    "Acceptance",
    "Artifact",
    "AuditItem",
    "AuditScheduler",
    "CompletionError",
    "DemoDomain",
    "Edit",
    "EvolutionResult",
    "Ledger",
    "OpenAICompatible",
    "Progress",
    "Proposal",
    "RolloutContext",
    "Sweep",
    "Task",
    "Verdict",
    "Version",
    "async_evolve",
    "check_reward",
    "current_rollout",
    "evolve",
    "openai_compatible",
    "prob_beats",
    "render_entries",
    "split_tasks",
]
