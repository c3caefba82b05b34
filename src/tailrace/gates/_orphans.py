"""Which orphaned runs a daemon asks the store for (``expired_leases``).

The store returns the oldest ``limit`` runs whose lease expired. A daemon that
has no target for some of them (another deployment's graph, a LangGraph
thread it does not serve) would be handed the same ones on every pass and
never see the runs behind them. :class:`OrphanScan` remembers the runs it
leaves to others, asks for that many more, skips them without reading them
again, and says once that it leaves each one (a daemon survives any row it
cannot handle and says so once).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..stores import RunRecord

logger = logging.getLogger("tailrace.serve")

#: The most orphans one pass asks for, however many are left to others.
MAX_SCAN = 10_000


class OrphanScan:
    """The orphans one daemon leaves to others, and how many to ask the store for."""

    def __init__(self) -> None:
        #: Runs with an expired lease that no target of this daemon drives.
        self.foreign: set[str] = set()

    def limit(self, wanted: int) -> int:
        """How many orphans to ask for, to find ``wanted`` this daemon may drive."""
        return min(wanted + len(self.foreign), MAX_SCAN)

    def ours(self, orphans: list[str]) -> list[str]:
        """The orphans of this pass not left to others; forget those no longer orphaned."""
        self.foreign.intersection_update(orphans)
        return [run_id for run_id in orphans if run_id not in self.foreign]

    def leave(self, record: RunRecord) -> None:
        """No target here drives ``record``'s run: skip it from now on, and say so once."""
        if record.run_id not in self.foreign:
            self.foreign.add(record.run_id)
            logger.info(
                "run %s (graph %r) has an expired lease and no target here drives it; "
                "leaving it to a daemon that has its graph",
                record.run_id,
                record.graph_name,
            )
