"""The evolve ledger's rules, shared by every backend, and its in-memory form.

An artifact (prompts, skills, rules) evolves as numbered versions, 1, 2, 3...
A commit is a compare-and-set on the head version: of several writers that
read the same head, exactly one stores the next version and every other gets
:class:`~tailrace.StaleVersion` with nothing written. The SQL stores let the
``artifact_versions`` primary key decide between racing writers; the memory
store decides under its lock.

>>> ledger = ArtifactLedger(clock=lambda: 5.0)
>>> ledger.commit("prompt", 0, '{"system":"Be brief."}').version
1
>>> ledger.commit("prompt", 0, '{"system":"Be terse."}')
Traceback (most recent call last):
...
tailrace._errors.StaleVersion: artifact 'prompt': expected head version 0, but the head is version 1; nothing was written
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from .._errors import StaleVersion
from ._records import ArtifactVersion
from ._rules import check_name


def check_expected(artifact_id: str, expected: int) -> None:
    """Raise ``ValueError`` unless ``expected``, the head version a commit to ``artifact_id`` expects, is an int >= 0.

    ``artifact_id`` itself must hold no NUL or lone surrogate (see ``_rules.check_name``).
    """
    check_name("artifact_id", artifact_id)
    if isinstance(expected, bool) or not isinstance(expected, int) or expected < 0:
        raise ValueError(
            f"artifact {artifact_id!r}: expected head version must be an int >= 0 "
            f"(0 before the first version), got {expected!r}"
        )


def stale_version(artifact_id: str, expected: int, head: int) -> StaleVersion:
    """The error for a commit to ``artifact_id`` that expected head ``expected`` but found ``head``."""
    return StaleVersion(
        f"artifact {artifact_id!r}: expected head version {expected}, "
        f"but the head is version {head}; nothing was written"
    )


class ArtifactLedger:
    """Every artifact's versions in process memory; the ledger of :class:`MemoryStore`.

    Args:
        clock: wall clock stamping ``created_at``, seconds since the epoch.

    Thread-safe: each operation runs under one :class:`threading.Lock`.
    """

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._versions: dict[str, list[ArtifactVersion]] = {}

    def head(self, artifact_id: str) -> ArtifactVersion | None:
        """The newest version of ``artifact_id``, or None if it has none."""
        check_name("artifact_id", artifact_id)
        with self._lock:
            versions = self._versions.get(artifact_id)
            return versions[-1] if versions else None

    def commit(
        self, artifact_id: str, expected: int, entries_json: str, meta_json: str = "{}"
    ) -> ArtifactVersion:
        """Store version ``expected + 1`` of ``artifact_id`` if its head is ``expected``.

        ``entries_json`` and ``meta_json`` are stored as given. A stale
        ``expected`` raises :class:`StaleVersion` and writes nothing.
        """
        check_expected(artifact_id, expected)
        with self._lock:
            head = len(self._versions.get(artifact_id, ()))  # versions are dense from 1
            if head != expected:
                raise stale_version(artifact_id, expected, head)
            version = ArtifactVersion(
                artifact_id=artifact_id, version=expected + 1, entries_json=entries_json,
                meta_json=meta_json, created_at=self._clock(),
            )  # fmt: skip
            self._versions.setdefault(artifact_id, []).append(version)
            return version

    def history(self, artifact_id: str) -> list[ArtifactVersion]:
        """Every version of ``artifact_id``, oldest first (empty if it has none)."""
        check_name("artifact_id", artifact_id)
        with self._lock:
            return list(self._versions.get(artifact_id, ()))
