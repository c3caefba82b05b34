"""Driving runs: the engine, the run loop and its collaborators (like trio's ``_core``).

This floor never imports the floors above it (gates, workers, the dashboard,
evolution, integrations, the command line); they import what they need from
here. The public names are re-exported by :mod:`tailrace`.
"""

from ._admission import AdmissionPolicy as AdmissionPolicy
from ._cancel import cancel_undriven as cancel_undriven
from ._engine import Engine as Engine
from ._engine import run as run
from ._outcome import NodeReport as NodeReport
from ._outcome import RunResult as RunResult
from ._owner import make_owner as make_owner
from ._owner import owner_is_dead as owner_is_dead
from ._state import LateInput as LateInput
from ._state import NodeStatus as NodeStatus
from ._writer import Persister as Persister

__all__ = [
    "AdmissionPolicy",
    "Engine",
    "LateInput",
    "NodeReport",
    "NodeStatus",
    "Persister",
    "RunResult",
    "cancel_undriven",
    "make_owner",
    "owner_is_dead",
    "run",
]
