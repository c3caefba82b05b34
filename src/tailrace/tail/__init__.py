"""Long-tail primitives: duration estimates (T1), LPT (T2), hedging (T3, T5), the bounded resume queue (T4).

Each is usable on its own; the engine's admission policy builds on them.
:class:`Cron` parses the cron expressions of schedules (W4). :func:`tail_account`
adds up the tail of a map of model generations from its stream rows (X4).
"""

from ._accounting import ItemAccount as ItemAccount
from ._accounting import ItemStream as ItemStream
from ._accounting import Round as Round
from ._accounting import RunStreams as RunStreams
from ._accounting import TailAccount as TailAccount
from ._accounting import generation_checkpoint as generation_checkpoint
from ._accounting import generation_state as generation_state
from ._accounting import is_usage as is_usage
from ._accounting import ks_statistic as ks_statistic
from ._accounting import parked_tokens as parked_tokens
from ._accounting import tail_account as tail_account
from ._cron import Cron as Cron
from ._estimator import DurationEstimator as DurationEstimator
from ._hedging import HedgeBudget as HedgeBudget
from ._hedging import HedgePolicy as HedgePolicy
from ._hooks import HedgeDelay as HedgeDelay
from ._hooks import TailHooks as TailHooks
from ._lpt import fifo_makespan as fifo_makespan
from ._lpt import list_makespan as list_makespan
from ._lpt import lpt_schedule as lpt_schedule
from ._lpt import makespan_lower_bound as makespan_lower_bound
from ._resume_queue import ResumeItem as ResumeItem
from ._resume_queue import ResumeQueue as ResumeQueue

__all__ = [
    "Cron",
    "DurationEstimator",
    "HedgeBudget",
    "HedgeDelay",
    "HedgePolicy",
    "ItemAccount",
    "ItemStream",
    "ResumeItem",
    "ResumeQueue",
    "Round",
    "RunStreams",
    "TailAccount",
    "TailHooks",
    "fifo_makespan",
    "generation_checkpoint",
    "generation_state",
    "is_usage",
    "ks_statistic",
    "list_makespan",
    "lpt_schedule",
    "makespan_lower_bound",
    "parked_tokens",
    "tail_account",
]
