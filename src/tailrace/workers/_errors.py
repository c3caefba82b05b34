"""Errors of the queue API (to join the tree in ``tailrace._errors``)::

RunError
├── RunExists
│   └── DuplicateRun     a submit's dedup key is held by a live run
└── RunFailed            a run waited for (``Engine.wait``) failed
"""

from __future__ import annotations

from typing import Any

from .._errors import RunError, RunExists


class DuplicateRun(RunExists):
    """A submit found its ``dedup_key`` held by a live run of the queue (``on_duplicate="raise"``).

    ``run_id`` names that run, ``dedup_key`` and ``queue`` the key.
    """

    def __init__(self, message: str, *, run_id: str, queue: str, dedup_key: str) -> None:
        super().__init__(message)
        self.run_id = run_id
        self.queue = queue
        self.dedup_key = dedup_key


class RunFailed(RunError):
    """A run that ``Engine.wait`` waited for failed; ``error`` is its stored error.

    The handler's own exception stayed in the process that ran it (E9); this
    carries its text and the run's ``result`` as stored.
    """

    def __init__(self, message: str, *, run_id: str, error: str | None, result: Any) -> None:
        super().__init__(message)
        self.run_id = run_id
        self.error = error
        self.result = result
