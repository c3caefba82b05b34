"""The evolve ledger: an artifact's versions in the run store, committed by compare-and-set.

The store keeps every version (``RunStore.artifact_head``/``commit_artifact``/
``artifact_history``); a commit names the version it was based on and is
refused with :class:`~tailrace.StaleVersion` when someone committed first. A
:class:`Ledger` retries such a commit by re-applying the edit to the newer
head, so edits (which set or remove keys) rebase the way a merge would.
Opening a ledger on a store that already holds the artifact resumes it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .._errors import CorruptRecord, StaleVersion
from ..stores import RunStore
from ._model import Artifact, Edit


@dataclass(frozen=True, slots=True, kw_only=True)
class Version:
    """One decoded ledger version.

    Args:
        version: Counts from 1.
        artifact: The artifact at this version.
        meta: What produced it (edit, scores, sweep), as committed.
    """

    version: int
    artifact: Artifact
    meta: Mapping[str, Any]

    @property
    def rendered(self) -> str:
        """The artifact's rendered text."""
        return self.artifact.render()


def encode_entries(entries: Mapping[str, str]) -> str:
    """Canonical JSON of ``entries`` (sorted keys), as the ledger stores them.

    Args:
        entries: The artifact's keyed text entries.
    """
    return json.dumps(dict(entries), sort_keys=True, separators=(",", ":"))


class Ledger:
    """An artifact's version history in a :class:`~tailrace.stores.RunStore`.

    Args:
        store: An opened store implementing the evolve ledger.
        artifact_id: Which artifact; one store holds many.
        template: Supplies the renderer for decoded versions (its entries are
            the first version when the store has none, see :meth:`open`).
        retries: How many times a stale commit is rebased and retried before
            :class:`~tailrace.StaleVersion` propagates.
    """

    def __init__(
        self, store: RunStore, artifact_id: str, template: Artifact, *, retries: int = 8
    ) -> None:
        if not artifact_id:
            raise ValueError("artifact_id must be a non-empty string")
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        self.store = store
        self.artifact_id = artifact_id
        self.template = template
        self.retries = retries
        #: How many commits lost their compare-and-set and were retried.
        self.stale_retries = 0

    async def open(self) -> Version:
        """Return the head, committing the template's entries as version 1 if there is none.

        Opening a ledger on a store that already has the artifact resumes it:
        the stored head wins over the template's entries.
        """
        head = await self.head()
        if head is not None:
            return head
        try:
            row = await self.store.commit_artifact(
                self.artifact_id,
                0,
                encode_entries(self.template.entries),
                json.dumps({"initial": True}),
            )
        except StaleVersion:  # another process created it first: resume that one
            head = await self.head()
            assert head is not None
            return head
        return self._decode(row.version, row.entries_json, row.meta_json)

    async def head(self) -> Version | None:
        """The newest version, or None when the artifact has none."""
        row = await self.store.artifact_head(self.artifact_id)
        if row is None:
            return None
        return self._decode(row.version, row.entries_json, row.meta_json)

    async def history(self) -> list[Version]:
        """Every version, oldest first."""
        rows = await self.store.artifact_history(self.artifact_id)
        return [self._decode(r.version, r.entries_json, r.meta_json) for r in rows]

    async def commit(self, base: Version, edit: Edit, meta: Mapping[str, Any]) -> Version:
        """Commit ``edit`` on top of ``base``; on a stale head, rebase it onto the newer head.

        Args:
            base: The version the edit was evaluated against.
            edit: The change to commit.
            meta: Recorded with the version (with the edit and base version added).

        Raises:
            StaleVersion: still stale after ``retries`` rebases.
        """
        current = base
        for attempt in range(self.retries + 1):
            record = {**meta, "edit": edit.to_dict(), "base_version": base.version}
            if current.version != base.version:
                record["rebased_onto"] = current.version
            entries = current.artifact.apply(edit).entries
            try:
                row = await self.store.commit_artifact(
                    self.artifact_id,
                    current.version,
                    encode_entries(entries),
                    json.dumps(record, sort_keys=True),
                )
            except StaleVersion:
                self.stale_retries += 1
                head = await self.head()
                if head is None or attempt == self.retries:
                    raise
                current = head
                continue
            return self._decode(row.version, row.entries_json, row.meta_json)
        raise AssertionError("unreachable")  # pragma: no cover

    def _decode(self, version: int, entries_json: str, meta_json: str) -> Version:
        try:
            entries = json.loads(entries_json)
            meta = json.loads(meta_json)
        except json.JSONDecodeError as exc:
            raise CorruptRecord(
                f"artifact {self.artifact_id!r} version {version}: undecodable: {exc}"
            ) from exc
        if not isinstance(entries, dict) or not all(isinstance(v, str) for v in entries.values()):
            raise CorruptRecord(f"artifact {self.artifact_id!r} version {version}: bad entries")
        return Version(
            version=version,
            artifact=self.template.with_entries(entries),
            meta=meta if isinstance(meta, dict) else {},
        )
