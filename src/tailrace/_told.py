"""Failures said once: what a loop that keeps trying tells of them.

A loop that works against a store (a worker's round, a session's keeper, the
ring's watch) fails alike on every try while the store is away; a traceback
a try would bury the one that matters. :class:`Told` says each distinct
failure once, and that the loop works again after.
"""

from __future__ import annotations

import logging

from ._errors import StoreError


class Told:
    """What a loop doing ``what`` said of its failures on ``logger``: each distinct reason
    once (a ``StoreError`` as a warning, anything else with its traceback), until it
    works again (said too)."""

    def __init__(self, what: str, logger: logging.Logger) -> None:
        self._what = what
        self._logger = logger
        self._said: set[str] = set()

    def failed(self, exc: Exception) -> None:
        reason = f"{type(exc).__name__}: {exc}"
        if reason in self._said:
            return
        self._said.add(reason)
        if isinstance(exc, StoreError):
            self._logger.warning("%s: %s; trying again until it works", self._what, exc)
        else:
            self._logger.error("%s failed; trying again until it works", self._what, exc_info=exc)

    def worked(self) -> None:
        if self._said:
            self._logger.info("%s works again", self._what)
            self._said.clear()
