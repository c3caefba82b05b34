"""Long-tail primitives: duration estimates (T1), LPT (T2), hedging (T3, T5), the bounded resume queue (T4).

Each is usable on its own; the engine's admission policy builds on them.
:class:`Cron` parses the cron expressions of schedules (W4).
"""

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
    "ResumeItem",
    "ResumeQueue",
    "TailHooks",
    "fifo_makespan",
    "list_makespan",
    "lpt_schedule",
    "makespan_lower_bound",
]
