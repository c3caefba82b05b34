"""The graph versions each worker drives, as the SQL stores keep them (``worker_graphs``).

A worker registers what it drives as it starts; a child run that a worker
cannot drive goes back to its queue while another live worker of that queue
can drive it, and is failed otherwise (R3). Registrations of workers whose
row is gone are dropped by a later registration, once they are
:data:`~tailrace.stores._queue_rules.STALE_REGISTRATION` seconds old (a
starting worker registers before its first report).
"""

from __future__ import annotations

from collections.abc import Sequence

from ._transactions import Tx, rows_for_ids

#: Values: worker_id, graph_name, fingerprint, registered_at.
INSERT_WORKER_GRAPH = (
    "INSERT INTO worker_graphs (worker_id, graph_name, fingerprint, registered_at) "
    "VALUES (?, ?, ?, ?) ON CONFLICT (worker_id, graph_name, fingerprint) DO NOTHING"
)
#: Values: worker_id. What a worker registered before (it registers again whole).
DELETE_WORKER_GRAPHS = "DELETE FROM worker_graphs WHERE worker_id = ?"
#: Values: registered before. The registrations of workers whose row is gone.
DROP_LEFT_WORKER_GRAPHS = (
    "DELETE FROM worker_graphs WHERE registered_at < ? "
    "AND worker_id NOT IN (SELECT worker_id FROM workers)"
)
#: The registrations of some workers (``ids``: their placeholders).
SELECT_WORKER_GRAPHS = (
    "SELECT worker_id, graph_name, fingerprint FROM worker_graphs WHERE worker_id IN ({ids})"
)


async def register_worker_graphs(
    tx: Tx, worker_id: str, graphs: Sequence[tuple[str, str]], now: float, stale: float
) -> None:
    """Replace ``worker_id``'s registrations with ``graphs``; drop those of workers gone
    whose registrations were made before ``stale``."""
    await tx.change_all(DROP_LEFT_WORKER_GRAPHS, (stale,))
    await tx.change_all(DELETE_WORKER_GRAPHS, (worker_id,))
    for name, fingerprint in graphs:
        await tx.change(INSERT_WORKER_GRAPH, (worker_id, name, fingerprint, now))


async def worker_graphs(tx: Tx, worker_ids: Sequence[str]) -> dict[str, frozenset[tuple[str, str]]]:
    """The graph versions each of ``worker_ids`` registered; one that registered none is absent."""
    found: dict[str, set[tuple[str, str]]] = {}
    for worker_id, name, fingerprint in await rows_for_ids(tx, SELECT_WORKER_GRAPHS, worker_ids):
        found.setdefault(str(worker_id), set()).add((str(name), str(fingerprint)))
    return {worker_id: frozenset(graphs) for worker_id, graphs in found.items()}
