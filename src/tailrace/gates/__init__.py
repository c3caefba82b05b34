"""Gates: questions to people and machines, resumed exactly once (Q1-Q6).

- :class:`GateTimeout`: the answer of a gate whose deadline passed.
- :class:`ResumeWorker`: applies answers single-flight and turn-guarded,
  for tailrace runs (:class:`EngineTarget`) or anything :class:`Resumable`.
- :func:`serve`: the daemon loop: resume answered questions (deferring with
  backoff those it cannot apply), poll machine gates concurrently under a
  time limit, fire deadlines on time, take over runs whose owner died; for
  the engine and any extra :class:`Resumable` targets.
"""

from .._values import GateTimeout as GateTimeout
from ._polling import Poller as Poller
from ._serve import Server as Server
from ._serve import ServeStats as ServeStats
from ._serve import serve as serve
from ._worker import EngineTarget as EngineTarget
from ._worker import Outcome as Outcome
from ._worker import Resumable as Resumable
from ._worker import ResumeWorker as ResumeWorker
from ._worker import WaitState as WaitState

__all__ = [
    "EngineTarget",
    "GateTimeout",
    "Outcome",
    "Poller",
    "Resumable",
    "ResumeWorker",
    "ServeStats",
    "Server",
    "WaitState",
    "serve",
]
