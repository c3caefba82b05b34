"""The tailrace exception tree.

Misuse of the API is a ``ValueError`` (so generic callers can catch it as
such); breakage outside the program is a ``StoreError``; a few states that
callers are expected to handle get their own class::

    TailraceError
    ├── GraphError (ValueError)          invalid graph definition (G1)
    ├── RunError
    │   ├── RouteError (ValueError)      a switch returned a route with no edge (E8)
    │   ├── StallError                   quiescent with aggregates still waiting (E10)
    │   ├── MapError (ValueError)        a map's input, item count or k is wrong, or too
    │   │                                few of its items can still succeed (M1, M3, M4)
    │   ├── EncodeError (ValueError)     a result the codec cannot encode (D5)
    │   ├── StreamLimit (ValueError)     a run published more stream chunks than its bound
    │   ├── RunNotFound (KeyError)       no run with that id
    │   ├── RunExists                    a run with that id already exists
    │   │   └── DuplicateRun             a submit's dedup key is held by a live run
    │   ├── RunFailed                    a run waited for (``Engine.wait``) failed
    │   ├── GraphMismatch                the graph changed shape since the run began
    │   ├── NotResumable                 the run is finished, or cannot be resumed
    │   └── ExecutorLost                 the worker running an attempt died (retryable)
    ├── QueueNotEmpty (ValueError)       a queue deleted while it holds live runs
    ├── StoreError                       the database failed (driver error chained)
    │   ├── UnsupportedFormat            a stored format version we cannot read (D4)
    │   ├── CorruptRecord                a stored row that does not decode
    │   └── StaleVersion                 an artifact commit lost its compare-and-set
    ├── LeaseError
    │   ├── LeaseHeld                    another live engine owns the run (D6)
    │   └── LeaseLost                    our lease was taken over; writes are fenced (D6)
    │       └── LeaseLapsed              the store did not answer in time to renew it (W7)
    └── QuestionError
        ├── QuestionNotFound (KeyError)
        └── AlreadyAnswered              first answer won (Q2)

Handler exceptions are never wrapped: a failed run re-raises the handler's own
exception (E9).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple


class TailraceError(Exception):
    """Root of every exception tailrace raises itself."""


class GraphError(TailraceError, ValueError):
    """The graph definition is invalid; the message names the node or edge (G1)."""


class RunError(TailraceError):
    """A run could not proceed for a reason of the engine's, not a handler's."""


class RouteError(RunError, ValueError):
    """A switch returned a route that matches no edge and there is no exit edge (E8)."""


class StallError(RunError):
    """Nothing is ready, nothing is in flight, no gate is open, yet aggregates still wait (E10)."""


class MapError(RunError, ValueError):
    """A map node cannot decide: its input is not a list, it has too many items, its k
    exceeds the item count, or too few items can still succeed (M1, M3, M4).

    The message names the node; ``errors`` lists the failed items' errors
    (``item index -> "Type: message"``) when items failing is the reason.
    """

    def __init__(self, message: str, *, errors: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.errors = dict(errors or {})


class EncodeError(RunError, ValueError):
    """A node's result cannot be encoded by the codec; nothing was committed (D5)."""


class StreamLimit(RunError, ValueError):
    """A run published more stream chunks than its bound (``Engine(max_stream_chunks=)``).

    Raised at the ``current_node().stream`` call that went past it; the
    message names the run, the node, the attempt and the bound.
    """


class RunNotFound(RunError, KeyError):
    """No run with this id exists in the store."""

    def __str__(self) -> str:  # KeyError quotes its argument; we want the sentence.
        return str(self.args[0]) if self.args else ""


class RunExists(RunError):
    """A run with this id already exists."""


class DuplicateRun(RunExists):
    """A submit found its ``dedup_key`` held by a live run of the queue (``on_duplicate="raise"``).

    ``message`` says so; ``run_id`` names that run, ``dedup_key`` and ``queue`` the key.
    """

    def __init__(self, message: str, *, run_id: str, queue: str, dedup_key: str) -> None:
        super().__init__(message)
        self.run_id = run_id
        self.queue = queue
        self.dedup_key = dedup_key


class RunFailed(RunError):
    """A run that ``Engine.wait`` waited for failed; ``error`` is its stored error.

    ``message`` says so and ``run_id`` names the run. The handler's own
    exception stayed in the process that ran it (E9); this carries its text
    and the run's ``result`` as stored.
    """

    def __init__(self, message: str, *, run_id: str, error: str | None, result: Any) -> None:
        super().__init__(message)
        self.run_id = run_id
        self.error = error
        self.result = result


class Incompatibility(NamedTuple):
    """Why a changed graph cannot take over what a run did at one node (V1).

    ``node_id`` is None when the reason is the graph's as a whole (its old
    version's structure is unknown, say).
    """

    node_id: str | None
    reason: str


class GraphMismatch(RunError):
    """The graph changed since the run began in a way the run cannot continue on (V1).

    ``incompatible`` lists each node that makes it so, with the reason (empty
    when the message alone says why: a graph of another name, say).
    """

    def __init__(self, message: str, incompatible: Sequence[Incompatibility] = ()) -> None:
        super().__init__(message)
        self.incompatible = tuple(incompatible)


class NotResumable(RunError):
    """The run is finished or otherwise cannot be resumed."""


class ExecutorLost(RunError):
    """The process or host running a node attempt died (a Ray worker, a Ray node).

    The message names the run, node, visit and try; the executor's own error
    is chained as ``__cause__``. It fails that try like a handler error, so
    the node's ``RetryPolicy`` applies (give such nodes one) and the run goes on.
    """


class QueueNotEmpty(TailraceError, ValueError):
    """``delete_queue`` found live runs (queued, running or suspended) in the queue; nothing changed.

    ``message`` says so; ``queue`` names the queue and ``live`` counts its live runs.
    """

    def __init__(self, message: str, *, queue: str, live: int) -> None:
        super().__init__(message)
        self.queue = queue
        self.live = live


class StoreError(TailraceError):
    """The store's database failed; the driver's exception is chained as ``__cause__``."""


class UnsupportedFormat(StoreError):
    """A stored record carries a format version this tailrace cannot read (D4)."""


class CorruptRecord(StoreError):
    """A stored record does not decode; the message names the run and node."""


class StaleVersion(StoreError):
    """An artifact commit expected a head version that is no longer the head."""


class LeaseError(TailraceError):
    """Base of lease conflicts (D6)."""


class LeaseHeld(LeaseError):
    """Another engine holds a live lease on the run.

    Args:
        message: what happened and what the user can do.
        owner: the lease's holder, when the store knew it.
        expires_at: when that lease expires (wall clock, seconds since the
            epoch), when the store knew it.

    An engine that proves ``owner`` dead (``tailrace.core._lease.owner_is_dead``)
    may take the run over at once with ``acquire_lease(..., steal_from=owner)``
    instead of waiting until ``expires_at`` (D6).
    """

    def __init__(
        self, message: str, *, owner: str | None = None, expires_at: float | None = None
    ) -> None:
        super().__init__(message)
        self.owner = owner
        self.expires_at = expires_at


class LeaseLost(LeaseError):
    """This engine's lease was taken over; its writes are rejected by the fencing token."""


class LeaseLapsed(LeaseLost):
    """The store did not answer in time to renew this engine's lease: the run stopped before
    the lease could expire, so that whoever adopts it next is its only driver (D6, W7)."""


class QuestionError(TailraceError):
    """Base of question-ledger errors."""


class QuestionNotFound(QuestionError, KeyError):
    """No question with this id exists."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class AlreadyAnswered(QuestionError):
    """The question was answered before; the first answer won (Q2)."""
