"""In-memory run store, and the store rules every backend shares.

The rules (fencing, lease grants, status transitions, format checks) are plain
functions over values read from the backend, so the memory, SQLite and
Postgres stores apply the very same decisions inside their own transactions.

>>> import asyncio
>>> async def demo() -> int:
...     async with MemoryStore() as store:
...         await store.create_run(NewRun(run_id="r1", graph_name="g", graph_ref=None,
...                                       fingerprint="f", input_json="1", created_at=1.0))
...         return await store.acquire_lease("r1", "engine-a", ttl=30.0)
>>> asyncio.run(demo())
1
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterable, Iterator

from .._errors import (
    CorruptRecord,
    LeaseHeld,
    LeaseLost,
    RunExists,
    RunNotFound,
    StoreError,
    UnsupportedFormat,
)
from ._base import (
    FORMAT_VERSION,
    RUN_TRANSITIONS,
    EventRow,
    FrozenInput,
    Harvest,
    NewRun,
    NodeRow,
    ResultRow,
    RunRecord,
    RunStatus,
    RunStore,
    StoredRun,
)

#: ``state_json`` of a run that has not committed a harvest yet.
EMPTY_STATE_JSON = "{}"

# --- rules shared by every backend -------------------------------------------


def check_ttl(ttl: float) -> None:
    """Raise ``ValueError`` unless ``ttl`` is a positive, finite number of seconds."""
    if not ttl > 0 or ttl == float("inf"):
        raise ValueError(f"lease ttl must be a positive number of seconds, got {ttl!r}")


def check_new_format(run: NewRun) -> None:
    """Raise :class:`UnsupportedFormat` if ``run`` is in a format this code cannot read back (D4)."""
    if run.format_version > FORMAT_VERSION:
        raise UnsupportedFormat(
            f"run {run.run_id!r}: cannot create a run in format {run.format_version}; "
            f"this tailrace writes format {FORMAT_VERSION}"
        )


def check_readable(run_id: str, format_version: int) -> None:
    """Raise :class:`UnsupportedFormat` naming ``run_id`` if ``format_version`` is newer than ours (D4)."""
    if format_version > FORMAT_VERSION:
        raise UnsupportedFormat(
            f"run {run_id!r} is stored in format {format_version}, newer than this "
            f"tailrace supports ({FORMAT_VERSION}); upgrade tailrace to read it"
        )


def parse_status(run_id: str, text: str) -> RunStatus:
    """Decode the stored status ``text`` of run ``run_id``; :class:`CorruptRecord` if unknown."""
    try:
        return RunStatus(text)
    except ValueError:
        raise CorruptRecord(f"run {run_id!r} has unknown status {text!r}") from None


def check_commit(
    run_id: str,
    *,
    current: RunStatus,
    format_version: int,
    lease_token: int,
    token: int,
    new: RunStatus,
) -> None:
    """Decide whether a harvest may be written to run ``run_id``.

    Checks, in order: the row's ``format_version`` (D4); that ``token`` equals
    the row's ``lease_token`` (fencing, D6, else :class:`LeaseLost`); that the
    ``current`` status may become ``new`` (else :class:`StoreError`).
    """
    check_readable(run_id, format_version)
    if token != lease_token:
        raise LeaseLost(
            f"run {run_id!r}: lease token {token} is stale (current token {lease_token}); "
            "another engine took the run over, nothing was written"
        )
    if new not in RUN_TRANSITIONS[current]:
        raise StoreError(
            f"run {run_id!r}: illegal status transition {current.value} -> {new.value}"
        )


def grant_lease(
    run_id: str,
    owner: str,
    *,
    now: float,
    holder: str | None,
    expires: float | None,
    lease_token: int,
) -> int:
    """Return the fencing token ``owner`` gets on run ``run_id`` at ``now`` (D6).

    ``holder``, ``expires`` and ``lease_token`` describe the current lease. A
    live lease of the same owner keeps its token; a live lease of another
    owner raises :class:`LeaseHeld`; any fresh grant (no lease, an expired or
    a released one) gets the next, larger token.
    """
    live = holder is not None and expires is not None and expires > now
    if live and holder == owner:
        return lease_token
    if live:
        assert expires is not None
        raise LeaseHeld(f"run {run_id!r} is leased by {holder!r} for another {expires - now:.3f}s")
    return lease_token + 1


def check_holder(
    run_id: str, owner: str, token: int, *, holder: str | None, lease_token: int
) -> None:
    """Raise :class:`LeaseLost` unless ``owner`` still holds run ``run_id`` with ``token``.

    ``holder`` and ``lease_token`` describe the current lease.
    """
    if holder != owner or lease_token != token:
        raise LeaseLost(
            f"run {run_id!r}: lease of {owner!r} with token {token} was lost "
            f"(holder {holder!r}, token {lease_token})"
        )


def duplicate_in_harvest(run_id: str, harvest: Harvest) -> str | None:
    """Describe a row ``harvest`` of run ``run_id`` repeats itself (result, frozen input, event)."""
    checks: tuple[tuple[str, Iterable[object]], ...] = (
        ("result", ((r.node_id, r.visit) for r in harvest.results)),
        ("frozen input", ((f.node_id, f.activation) for f in harvest.frozen)),
        ("event", (e.seq for e in harvest.events)),
    )
    for kind, keys in checks:
        seen: set[object] = set()
        for key in keys:
            if key in seen:
                return f"run {run_id!r}: harvest repeats {kind} {key!r}"
            seen.add(key)
    return None


# --- the store ---------------------------------------------------------------


class MemoryStore(RunStore):
    """A store in process memory: fast, thread-safe, gone when the process ends.

    Args:
        clock: wall clock used for lease expiry, in seconds since the epoch;
            tests pass a fake one.

    Data survives ``close()``/``open()`` on the same object, which lets tests
    simulate a restart. Every operation runs under one :class:`threading.Lock`
    and never awaits while holding it, so the store is safe across threads and
    event loops alike.
    """

    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._runs: dict[str, RunRecord] = {}
        self._nodes: dict[str, dict[str, NodeRow]] = {}
        self._results: dict[str, dict[tuple[str, int], ResultRow]] = {}
        self._frozen: dict[str, dict[tuple[str, int], FrozenInput]] = {}
        self._events: dict[str, dict[int, EventRow]] = {}

    async def open(self) -> None:
        """Nothing to connect; kept for the contract. Idempotent."""

    async def close(self) -> None:
        """Nothing to flush; data is kept for a later ``open``. Idempotent."""

    def _run(self, run_id: str) -> RunRecord:
        try:
            return self._runs[run_id]
        except KeyError:
            raise RunNotFound(f"no run {run_id!r} in the store") from None

    async def create_run(self, run: NewRun) -> None:
        """Store a new run with status ``running``; ``RunExists`` if ``run.run_id`` is taken."""
        check_new_format(run)
        with self._lock:
            if run.run_id in self._runs:
                raise RunExists(f"run {run.run_id!r} already exists")
            self._runs[run.run_id] = RunRecord(
                run_id=run.run_id,
                graph_name=run.graph_name,
                graph_ref=run.graph_ref,
                fingerprint=run.fingerprint,
                status=RunStatus.RUNNING,
                input_json=run.input_json,
                state_json=EMPTY_STATE_JSON,
                error=None,
                created_at=run.created_at,
                updated_at=run.created_at,
                finished_at=None,
                nodes_done=0,
                lease_owner=None,
                lease_expires=None,
                lease_token=0,
                format_version=run.format_version,
            )
            self._nodes[run.run_id] = {}
            self._results[run.run_id] = {}
            self._frozen[run.run_id] = {}
            self._events[run.run_id] = {}

    async def commit(self, run_id: str, token: int, harvest: Harvest) -> None:
        """Apply ``harvest`` to ``run_id`` atomically if ``token`` is current (D1, D6)."""
        with self._lock:
            record = self._run(run_id)
            check_commit(
                run_id,
                current=record.status,
                format_version=record.format_version,
                lease_token=record.lease_token,
                token=token,
                new=harvest.status,
            )
            self._check_no_rewrite(run_id, harvest)
            self._nodes[run_id].update((n.node_id, n) for n in harvest.nodes)
            self._results[run_id].update(((r.node_id, r.visit), r) for r in harvest.results)
            self._frozen[run_id].update(((f.node_id, f.activation), f) for f in harvest.frozen)
            self._events[run_id].update((e.seq, e) for e in harvest.events)
            self._runs[run_id] = dataclasses.replace(
                record,
                state_json=harvest.state_json,
                status=harvest.status,
                error=harvest.error,
                updated_at=self._clock(),
                finished_at=harvest.finished_at
                if harvest.finished_at is not None
                else record.finished_at,
                nodes_done=record.nodes_done + harvest.nodes_done_delta,
            )

    def _check_no_rewrite(self, run_id: str, harvest: Harvest) -> None:
        """Nothing already committed is rewritten: refuse the harvest before applying any of it."""
        problem = duplicate_in_harvest(run_id, harvest) or next(
            self._rewrites(run_id, harvest), None
        )
        if problem is not None:
            raise StoreError(problem + "; nothing of this harvest was written")

    def _rewrites(self, run_id: str, harvest: Harvest) -> Iterator[str]:
        results, frozen, events = self._results[run_id], self._frozen[run_id], self._events[run_id]
        for r in harvest.results:
            if (r.node_id, r.visit) in results:
                yield f"run {run_id!r}: result of node {r.node_id!r} visit {r.visit} already committed"
        for f in harvest.frozen:
            if (f.node_id, f.activation) in frozen:
                yield (
                    f"run {run_id!r}: frozen input of node {f.node_id!r} "
                    f"activation {f.activation} already committed"
                )
        for e in harvest.events:
            if e.seq in events:
                yield f"run {run_id!r}: event seq {e.seq} already committed"

    async def load_run(self, run_id: str) -> StoredRun:
        """Return run ``run_id`` with its node rows; ``UnsupportedFormat`` if written by a newer tailrace."""
        with self._lock:
            record = self._run(run_id)
            check_readable(run_id, record.format_version)
            return StoredRun(run=record, nodes=dict(self._nodes[run_id]))

    async def get_run(self, run_id: str) -> RunRecord:
        """Return the record of run ``run_id``; ``RunNotFound`` if absent."""
        with self._lock:
            return self._run(run_id)

    async def list_runs(
        self, *, status: RunStatus | None = None, limit: int | None = None
    ) -> list[RunRecord]:
        """Runs newest first (``created_at``, then ``run_id``), only ``status`` ones if given, at most ``limit``."""
        with self._lock:
            runs = [r for r in self._runs.values() if status is None or r.status == status]
        runs.sort(key=lambda r: (r.created_at, r.run_id), reverse=True)
        return runs if limit is None else runs[: max(limit, 0)]

    async def results(self, run_id: str, node_id: str | None = None) -> list[ResultRow]:
        """Result rows of ``run_id`` (only ``node_id``'s if given), by node then visit."""
        with self._lock:
            self._run(run_id)
            rows = [r for r in self._results[run_id].values() if node_id in (None, r.node_id)]
        return sorted(rows, key=lambda r: (r.node_id, r.visit))

    async def frozen_inputs(self, run_id: str) -> list[FrozenInput]:
        """First-k decisions of ``run_id``, by node then activation (E4)."""
        with self._lock:
            self._run(run_id)
            rows = list(self._frozen[run_id].values())
        return sorted(rows, key=lambda f: (f.node_id, f.activation))

    async def events(self, run_id: str, *, after_seq: int = 0) -> list[EventRow]:
        """Events of ``run_id`` with ``seq > after_seq``, in seq order."""
        with self._lock:
            self._run(run_id)
            rows = [e for seq, e in self._events[run_id].items() if seq > after_seq]
        return sorted(rows, key=lambda e: e.seq)

    async def acquire_lease(self, run_id: str, owner: str, ttl: float) -> int:
        """Lease ``run_id`` to ``owner`` for ``ttl`` seconds; return the fencing token (D6)."""
        check_ttl(ttl)
        with self._lock:
            record = self._run(run_id)
            now = self._clock()
            token = grant_lease(
                run_id,
                owner,
                now=now,
                holder=record.lease_owner,
                expires=record.lease_expires,
                lease_token=record.lease_token,
            )
            self._runs[run_id] = dataclasses.replace(
                record, lease_owner=owner, lease_expires=now + ttl, lease_token=token
            )
            return token

    async def heartbeat(self, run_id: str, owner: str, token: int, ttl: float) -> None:
        """Extend ``owner``'s lease on ``run_id`` to ``ttl`` from now; ``LeaseLost`` if ``token`` is stale."""
        check_ttl(ttl)
        with self._lock:
            record = self._run(run_id)
            check_holder(
                run_id, owner, token, holder=record.lease_owner, lease_token=record.lease_token
            )
            self._runs[run_id] = dataclasses.replace(record, lease_expires=self._clock() + ttl)

    async def release_lease(self, run_id: str, owner: str, token: int) -> None:
        """Drop ``owner``'s lease on ``run_id`` if still held with ``token``; else do nothing."""
        with self._lock:
            record = self._runs.get(run_id)
            if record and record.lease_owner == owner and record.lease_token == token:
                self._runs[run_id] = dataclasses.replace(
                    record, lease_owner=None, lease_expires=None
                )

    async def expired_leases(self, now: float, *, limit: int = 100) -> list[str]:
        """Ids of ``running`` runs with no lease or one that expired before ``now``, at most ``limit``."""
        with self._lock:
            orphans = [
                r
                for r in self._runs.values()
                if r.status == RunStatus.RUNNING
                and (r.lease_owner is None or r.lease_expires is None or r.lease_expires < now)
            ]
        orphans.sort(key=lambda r: (r.lease_expires or 0.0, r.run_id))
        return [r.run_id for r in orphans[: max(limit, 0)]]
