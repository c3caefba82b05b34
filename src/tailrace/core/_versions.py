"""Versions and forks: a run against a changed graph (V1-V3), and a run forked from a node (V4).

A graph is identified by its name and structural fingerprint; a store keeps
each version's structure (``graph_shape``) with its runs, so a changed graph
is checked against what a run did without the old code:

- :func:`check_stored` says, per node, whether a changed graph can take over
  a run (V1): every node that ran or holds state (it has a node row: results,
  first-k decisions and questions are written with their node's row, D1)
  exists with the same kind and the same ``required``, and no edge into it
  was added or removed. New nodes and changes downstream of that frontier
  are free. It only reads (V2).
- :func:`move_leased` moves a run it holds the lease of onto the new version,
  re-checked under the lease, in one fenced store write (D6);
  :func:`migrate_runs` does it over the live runs of a graph name.
- :func:`plan_fork` builds the state of a fork from one moment of the source
  run (a store snapshot): its committed state for every node not downstream
  of the fork's node, that node activated afresh, and everything downstream
  of it fresh (V4), and the streams the reused nodes' accepted attempts
  wrote, numbered from the fork's cursor 1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._codec import Codec
from .._errors import (
    CorruptRecord,
    EncodeError,
    GraphMismatch,
    Incompatibility,
    LeaseHeld,
    LeaseLost,
    NotResumable,
)
from ..graph import Graph, NodeKind, Topology, guess_reference, shape_json
from ..stores import (
    ChunkRow,
    FrozenInput,
    ItemRow,
    ResultRow,
    RunRecord,
    RunSnapshot,
    RunStatus,
    RunStore,
    StoredRun,
)
from ._lease import Lease
from ._restore import restore_run
from ._state import NodeStatus, RunState, switch_edges
from ._streams import ChunkKind

#: The statuses of a run that has state to move onto another version (V2).
LIVE = (RunStatus.RUNNING, RunStatus.SUSPENDED)


# -- the structure of a version ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Shape:
    """A graph version's structure: per node its kind, ``required``, in-edges and, for a node
    run as a child run, its child graph (name and fingerprint), in definition order."""

    ids: tuple[str, ...]
    kinds: dict[str, str]
    required: dict[str, object]
    in_edges: dict[str, frozenset[tuple[str, str | None]]]
    children: dict[str, object] = field(default_factory=dict)

    @classmethod
    def of(cls, graph: Graph) -> Shape:
        """The structure of ``graph``."""
        return cls.parse(json.loads(shape_json(graph)), f"graph {graph.name!r}")

    @classmethod
    def parse(cls, data: Any, where: str) -> Shape:
        """The structure ``graph_shape`` wrote (read back from a store); :class:`CorruptRecord` if malformed."""
        try:
            nodes = [
                (str(n[0]), str(n[1]), n[2], n[5] if len(n) > 5 else None) for n in data["nodes"]
            ]
            edges = [
                (str(e[0]), str(e[1]), None if e[2] is None else str(e[2])) for e in data["edges"]
            ]
        except (KeyError, IndexError, TypeError) as exc:
            raise CorruptRecord(
                f"{where}: stored graph structure does not decode: {exc!r}"
            ) from exc
        in_edges: dict[str, set[tuple[str, str | None]]] = {n[0]: set() for n in nodes}
        for source, target, route in edges:
            in_edges.setdefault(target, set()).add((source, route))
        return cls(
            ids=tuple(n[0] for n in nodes),
            kinds={n[0]: n[1] for n in nodes},
            required={n[0]: n[2] for n in nodes},
            in_edges={node_id: frozenset(e) for node_id, e in in_edges.items()},
            children={n[0]: n[3] for n in nodes if n[3] is not None},
        )


def incompatibilities(old: Shape, new: Shape, frontier: Iterable[str]) -> list[Incompatibility]:
    """Why ``new`` cannot take over the nodes of ``frontier`` that ``old`` ran (V1), in ``old``'s order.

    A node's ``required`` is compared as declared, whatever the kind that
    declares it (aggregates, maps; a function by its name and code): a
    first-k decision made with one ``k`` is never continued with another. A
    node run as a child run keeps its child graph (name and version): its
    child runs were made with it.
    """
    out: list[Incompatibility] = []
    held = set(frontier)
    for node_id in (n for n in old.ids if n in held):
        if node_id not in new.kinds:
            out.append(
                Incompatibility(
                    node_id, "it ran or holds state, and the new graph has no such node"
                )
            )
            continue
        was, now = old.kinds[node_id], new.kinds[node_id]
        if was != now:
            out.append(Incompatibility(node_id, f"its kind changed from {was} to {now}"))
            continue
        was_k, now_k = old.required.get(node_id), new.required.get(node_id)
        if not _same_required(was_k, now_k):
            out.append(
                Incompatibility(
                    node_id,
                    f"its required changed from {_required_text(was_k)} to {_required_text(now_k)}",
                )
            )
        if node_id in old.children and old.children[node_id] != new.children.get(node_id):
            before_child, after_child = old.children[node_id], new.children.get(node_id)
            out.append(
                Incompatibility(
                    node_id,
                    f"its child graph changed from {_child_text(before_child)} to "
                    f"{_child_text(after_child)}",
                )
            )
        before, after = (
            old.in_edges.get(node_id, frozenset()),
            new.in_edges.get(node_id, frozenset()),
        )
        for source, route in sorted(after - before, key=str):
            out.append(
                Incompatibility(
                    node_id, f"an edge into it was added: {_edge(source, node_id, route)}"
                )
            )
        for source, route in sorted(before - after, key=str):
            out.append(
                Incompatibility(
                    node_id, f"an edge into it was removed: {_edge(source, node_id, route)}"
                )
            )
    return out


def _same_required(was: object, now: object) -> bool:
    """Whether ``required`` stayed the same. A structure stored before a function's code was
    part of it names the function alone: the same name is taken as the same function."""
    if isinstance(was, str) and isinstance(now, list) and now:
        return bool(was == now[0])
    return was == now


def _required_text(value: object) -> str:
    if isinstance(value, list) and len(value) == 2:
        return f"{value[0]} (code {value[1]})"
    return repr(value)


def _child_text(value: object) -> str:
    if isinstance(value, list) and len(value) == 2:
        return f"graph {value[0]!r} version {value[1]}"
    return "none (it runs no child graph)"


def _edge(source: str, target: str, route: str | None) -> str:
    return f"{source} -> {target}" + ("" if route is None else f" (route {route!r})")


# -- checking a run (V1, V2) -----------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Compatibility:
    """Whether run ``run_id`` can continue on a graph version (V1), as :meth:`Engine.check` reports it.

    ``from_fingerprint`` is the version the run is on, ``to_fingerprint`` the
    one checked; ``frontier`` the nodes that ran or hold state; each entry of
    ``incompatible`` names a node (None: the graph as a whole) and why.
    """

    run_id: str
    graph_name: str
    status: RunStatus
    from_fingerprint: str
    to_fingerprint: str
    frontier: tuple[str, ...]
    incompatible: tuple[Incompatibility, ...] = ()

    @property
    def compatible(self) -> bool:
        """Whether the run can continue on the version checked."""
        return not self.incompatible

    @property
    def same_version(self) -> bool:
        """Whether the run is on the version checked already."""
        return self.from_fingerprint == self.to_fingerprint

    def describe(self) -> str:
        """One readable paragraph: the verdict, then each incompatible node and why."""
        head = (
            f"run {self.run_id!r} ({self.status.value}) of graph {self.graph_name!r}, "
            f"version {self.from_fingerprint} -> {self.to_fingerprint}: "
        )
        if self.same_version:
            return head + "on that version already"
        if self.compatible:
            return head + f"compatible ({len(self.frontier)} nodes ran or hold state)"
        return (
            head
            + "incompatible:\n"
            + "\n".join(
                f"  {'the graph' if i.node_id is None else repr(i.node_id)}: {i.reason}"
                for i in self.incompatible
            )
        )


async def stored_shape(store: RunStore, record: RunRecord, known: Graph | None) -> Shape | None:
    """The structure of the version ``record`` is on: kept by the store, else ``known`` (the engine's)."""
    text = await store.graph_shape(record.graph_name, record.fingerprint)
    if text is not None:
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise CorruptRecord(f"graph {record.graph_name!r} {record.fingerprint}: {exc}") from exc
        return Shape.parse(data, f"graph {record.graph_name!r} version {record.fingerprint}")
    if known is not None and known.compile().fingerprint == record.fingerprint:
        return Shape.of(known)
    return None


def compatibility(
    record: RunRecord, frontier: Iterable[str], graph: Graph, old: Shape | None
) -> Compatibility:
    """Check ``graph`` against the nodes of ``frontier`` that run ``record`` ran (V1).

    ``old`` is the structure of the version ``record`` is on (None: unknown).
    """
    fingerprint = graph.compile().fingerprint
    held = tuple(frontier)
    report = Compatibility(
        run_id=record.run_id, graph_name=record.graph_name, status=record.status,
        from_fingerprint=record.fingerprint, to_fingerprint=fingerprint, frontier=held,
    )  # fmt: skip
    if graph.name != record.graph_name:
        reason = f"the run is of graph {record.graph_name!r}, not {graph.name!r}"
        return dataclasses.replace(report, incompatible=(Incompatibility(None, reason),))
    if fingerprint == record.fingerprint or not held:
        return report
    if old is None:
        reason = (
            f"the structure of version {record.fingerprint} is not kept in the store and no "
            "graph of that version is registered: register it (engine.register) to check"
        )
        return dataclasses.replace(report, incompatible=(Incompatibility(None, reason),))
    bad = incompatibilities(old, Shape.of(graph), held)
    return dataclasses.replace(report, incompatible=tuple(bad))


async def check_stored(
    store: RunStore, stored: StoredRun, graph: Graph, known: Graph | None
) -> Compatibility:
    """:func:`compatibility` of ``stored`` (every node with a row) with ``graph``, the old
    structure read from ``store``. Reads only."""
    old = await stored_shape(store, stored.run, known)
    return compatibility(stored.run, stored.nodes, graph, old)


def require_compatible(report: Compatibility) -> None:
    """Raise :class:`GraphMismatch` listing each incompatible node of ``report`` (V1)."""
    if not report.compatible:
        raise GraphMismatch(report.describe(), report.incompatible)


async def move_leased(
    store: RunStore, stored: StoredRun, graph: Graph, owner: str, token: int, known: Graph | None
) -> Compatibility:
    """Move ``stored`` (read under ``owner``'s lease ``token``) onto ``graph``'s version, if compatible.

    Raises :class:`GraphMismatch` (nothing written) when it is not; the
    move itself is one store write fenced by the lease (D6).
    """
    report = await check_stored(store, stored, graph, known)
    require_compatible(report)
    if not report.same_version:
        await store.move_run(
            stored.run.run_id, owner, token, fingerprint=report.to_fingerprint,
            graph_ref=guess_reference(graph) or stored.run.graph_ref,
            expected=stored.run.fingerprint,
        )  # fmt: skip
    return report


# -- migrating the live runs of a graph (V2) -----------------------------------------------------


class MoveOutcome(enum.StrEnum):
    """What a migration did, or would do, with one run."""

    CURRENT = "current"  # on the new version already
    COMPATIBLE = "compatible"  # can move (a dry run moves nothing)
    MOVED = "moved"
    INCOMPATIBLE = "incompatible"
    HELD = "held"  # another engine drives it: fenced, left alone
    GONE = "gone"  # it finished or was moved meanwhile


@dataclass(frozen=True, slots=True, kw_only=True)
class RunMove:
    """One run in a :class:`MigrationReport`: its outcome and, when it did not move, why."""

    run_id: str
    status: RunStatus
    from_fingerprint: str
    outcome: MoveOutcome
    reason: str = ""
    incompatible: tuple[Incompatibility, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class MigrationReport:
    """The live runs of graph ``graph_name`` against version ``to_fingerprint`` (V2)."""

    graph_name: str
    to_fingerprint: str
    applied: bool
    runs: tuple[RunMove, ...] = field(default=())

    def count(self, outcome: MoveOutcome) -> int:
        """How many runs had ``outcome``."""
        return sum(1 for r in self.runs if r.outcome is outcome)

    def summary(self) -> str:
        """One line: how many runs had each outcome."""
        counts = ", ".join(f"{self.count(o)} {o.value}" for o in MoveOutcome if self.count(o))
        verb = "migrated" if self.applied else "checked (dry run)"
        return (
            f"graph {self.graph_name!r} -> {self.to_fingerprint}: {len(self.runs)} live runs "
            f"{verb}: {counts or 'none'}"
        )


async def migrate_runs(
    store: RunStore,
    graph: Graph,
    *,
    owner: str,
    ttl: float,
    apply: bool,
    known: Callable[[RunRecord], Graph | None],
    guard: Callable[[str], contextlib.AbstractContextManager[None]],
) -> MigrationReport:
    """Check (and with ``apply``, move) every live run of ``graph``'s name onto its version (V2).

    ``known`` gives the engine's graph for a run's version (for runs whose
    structure the store does not keep); ``guard`` is held around each move
    (the engine's own drivers refuse it). Each move is leased and fenced
    (D6): a run another engine holds is left alone (``held``); a failure
    moves nothing of that run and stops the migration (the runs before it
    stay moved, each whole).
    """
    fingerprint = graph.compile().fingerprint
    shapes: dict[str, Shape | None] = {}
    verdicts: dict[tuple[str, frozenset[str]], tuple[Incompatibility, ...]] = {}
    frontiers = await store.frontiers(graph.name)
    moves: list[RunMove] = []
    for status in LIVE:
        for record in await store.list_runs(status=status, graph=graph.name):
            if record.fingerprint == fingerprint:
                moves.append(_outcome(record, MoveOutcome.CURRENT))
                continue
            if record.fingerprint not in shapes:
                shapes[record.fingerprint] = await stored_shape(store, record, known(record))
            held = frontiers.get(record.run_id, ())
            key = (record.fingerprint, frozenset(held))  # runs alike are checked once
            if key not in verdicts:
                verdicts[key] = compatibility(
                    record, held, graph, shapes[record.fingerprint]
                ).incompatible
            report = Compatibility(
                run_id=record.run_id, graph_name=record.graph_name, status=record.status,
                from_fingerprint=record.fingerprint, to_fingerprint=fingerprint,
                frontier=tuple(held), incompatible=verdicts[key],
            )  # fmt: skip
            if not report.compatible:
                moves.append(_outcome(record, MoveOutcome.INCOMPATIBLE, report))
            elif not apply:
                moves.append(_outcome(record, MoveOutcome.COMPATIBLE, report))
            else:
                moves.append(await _move_one(store, record, graph, owner, ttl, known, guard))
    moves.sort(key=lambda m: m.run_id)
    return MigrationReport(
        graph_name=graph.name, to_fingerprint=fingerprint, applied=apply, runs=tuple(moves)
    )


async def _move_one(
    store: RunStore,
    record: RunRecord,
    graph: Graph,
    owner: str,
    ttl: float,
    known: Callable[[RunRecord], Graph | None],
    guard: Callable[[str], contextlib.AbstractContextManager[None]],
) -> RunMove:
    """Lease ``record``'s run, re-check it as it stands under the lease, and move it."""
    try:
        with guard(record.run_id):
            async with Lease(store, record.run_id, owner, ttl) as lease:
                stored = await store.load_run(record.run_id)  # re-read under the lease
                if stored.run.status not in LIVE:
                    return _outcome(record, MoveOutcome.GONE, reason=f"it is {stored.run.status}")
                report = await move_leased(
                    store, stored, graph, owner, lease.token, known(stored.run)
                )
                return _outcome(record, MoveOutcome.MOVED, report)
    except LeaseHeld as exc:
        return _outcome(record, MoveOutcome.HELD, reason=str(exc))
    except GraphMismatch as exc:
        if exc.incompatible:
            return RunMove(
                run_id=record.run_id, status=record.status, from_fingerprint=record.fingerprint,
                outcome=MoveOutcome.INCOMPATIBLE, reason=str(exc), incompatible=exc.incompatible,
            )  # fmt: skip
        return _outcome(record, MoveOutcome.GONE, reason=str(exc))
    except (LeaseLost, NotResumable) as exc:
        return _outcome(record, MoveOutcome.GONE, reason=str(exc))


def _outcome(
    record: RunRecord,
    outcome: MoveOutcome,
    report: Compatibility | None = None,
    *,
    reason: str = "",
) -> RunMove:
    incompatible = () if report is None else report.incompatible
    if report is not None and incompatible:
        reason = report.describe()
    return RunMove(
        run_id=record.run_id, status=record.status, from_fingerprint=record.fingerprint,
        outcome=outcome, reason=reason, incompatible=incompatible,
    )  # fmt: skip


# -- forks (V4) ------------------------------------------------------------------------------------


@dataclass(slots=True, kw_only=True)
class ForkPlan:
    """What a fork starts from: its state, the source's rows it copies, and its input."""

    state: RunState
    #: The source's result rows, first-k decisions and map items of the reused nodes,
    #: copied as stored.
    results: list[ResultRow]
    frozen: list[FrozenInput]
    items: list[ItemRow]
    #: Large results read back by reference (see ``RunWriter.refer``).
    big: dict[int, tuple[int, Any]]
    #: The source run's input (the fork's input too).
    input: Any
    #: Ids of the reused nodes, in definition order.
    reused: tuple[str, ...]
    #: The stream rows of the reused nodes' accepted attempts, renumbered 1..n (S1-S3).
    chunks: list[ChunkRow]


def downstream_of(topo: Topology, start: int) -> set[int]:
    """``start`` and every node reachable from it, loops included, in O(V+E)."""
    seen = {start}
    stack = [start]
    while stack:
        for edge in topo.out_edges[stack.pop()]:
            if edge.target not in seen:
                seen.add(edge.target)
                stack.append(edge.target)
    return seen


async def plan_fork(
    store: RunStore,
    codec: Codec,
    snapshot: RunSnapshot,
    graph: Graph,
    at: str,
    payload: Any,
    old: Shape | None,
    fork_id: str,
) -> ForkPlan:
    """The starting state of fork ``fork_id`` at node ``at`` on ``graph`` (V4) of the source
    run as ``snapshot`` holds it: one moment of it, whatever it committed since. Reads only.

    Every node not downstream of ``at`` keeps the source's committed state
    (results, visits, first-k decisions, collected inputs); of those, one
    that was running, waiting on a gate, failed or cancelled runs again (a
    gate opens its own question). ``at`` is activated with ``payload`` (None:
    the payload of its latest visit in the source); everything downstream of
    it starts fresh, and the outputs of reused nodes into it are delivered
    again, before anything the fork runs. On a changed graph, V1 is checked
    over the reused nodes only (``old`` is the source version's structure).
    A ``payload`` the codec cannot encode is refused here, before the fork
    writes anything (D5); the fork runs with it as it reads back.
    """
    topo = graph.compile()
    source = snapshot.stored
    run_id = source.run.run_id
    if at not in topo.index:
        raise ValueError(
            f"run {run_id!r}: cannot fork at {at!r}: graph {graph.name!r} has no such node"
        )
    a = topo.index[at]
    fresh = downstream_of(topo, a)
    reused = tuple(n for n in topo.ids if n in source.nodes and topo.index[n] not in fresh)
    report = compatibility(source.run, reused, graph, old)
    require_compatible(report)
    if payload is None:
        payload = _last_payload(codec, snapshot, at)
    else:
        payload = _fork_input(codec, payload, fork_id, run_id, at)
    keep = set(reused)
    rows = {node_id: source.nodes[node_id] for node_id in reused}
    items = [r for r in source.items if r.node_id in keep]
    if rows:
        kept = dataclasses.replace(source.run, state_json=_kept_meta(codec, source.run, keep))
        restored = await restore_run(
            store, codec, topo, StoredRun(run=kept, nodes=rows, items=items), []
        )
        state, big = restored.state, restored.big
    else:
        state, big = RunState(topo), {}
    _rerun_unfinished(state, [topo.index[n] for n in reused])
    _redeliver(state, [topo.index[n] for n in reused], fresh - {a})
    state.activate(a, payload)
    return ForkPlan(
        state=state, big=big,
        results=[r for r in snapshot.results if r.node_id in keep],
        frozen=[f for f in snapshot.frozen if f.node_id in keep],
        items=items, chunks=_accepted_streams(snapshot.chunks, keep),
        input=_decode(codec, source.run.input_json, run_id, "input"), reused=reused,
    )  # fmt: skip


def _accepted_streams(chunks: Sequence[ChunkRow], keep: set[str]) -> list[ChunkRow]:
    """The stream rows among ``chunks`` (a run's, in seq order) whose attempts, of nodes in
    ``keep``, were accepted (their chunks and marks, S2), renumbered 1..n as the fork's own.

    A stream that was discarded or is still open (the source runs on) is left out: what a
    fork carries is what the results it reuses were made with.
    """
    rows = [row for row in chunks if row.node_id in keep]
    accepted = {row.stream for row in rows if row.kind == ChunkKind.ACCEPTED}
    carried: list[ChunkRow] = []
    first: dict[int, int] = {}  # a source stream -> its first row's seq in the fork
    for row in rows:
        if row.stream in accepted:
            seq = len(carried) + 1
            carried.append(row._replace(seq=seq, stream=first.setdefault(row.stream, seq)))
    return carried


def _fork_input(codec: Codec, payload: Any, fork_id: str, run_id: str, at: str) -> Any:
    """``payload`` as it reads back from the codec; :class:`EncodeError` naming the fork, its
    node and the input when it does not encode (D5)."""
    try:
        return codec.decode(codec.encode(payload))
    except (TypeError, ValueError, RecursionError) as exc:
        raise EncodeError(
            f"fork {fork_id!r} of run {run_id!r} at node {at!r}: input {_brief(payload)} "
            f"cannot be encoded: {exc}"
        ) from exc


def _brief(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _rerun_unfinished(state: RunState, reused: Sequence[int]) -> None:
    """Every reused node is written with the fork; one that did not complete runs again."""
    for i in reused:
        ns = state.nodes[i]
        if ns.status in (NodeStatus.WAITING, NodeStatus.FAILED, NodeStatus.CANCELLED):
            ns.status = NodeStatus.QUEUED
            ns.question = None  # a gate asks again, in the fork's own name
            ns.attempts = 0
            ns.retry_due = None
            state.ready.append(i)
        state.dirty[i] = None
    state.ready.sort()


def _redeliver(state: RunState, reused: Sequence[int], fresh: set[int]) -> None:
    """Deliver again what completed reused nodes sent into the fresh part (definition order)."""
    topo = state.topo
    for s in reused:
        ns = state.nodes[s]
        if ns.status is not NodeStatus.COMPLETED:
            continue  # it runs again and delivers then
        if topo.nodes[s].kind is NodeKind.SWITCH:
            edges, value = switch_edges(topo, s, ns.result), ns.payload
        else:
            edges, value = list(topo.out_edges[s]), ns.result
        for edge in edges:
            if edge.target in fresh:
                state.redeliver(s, edge.target, value)


def _kept_meta(codec: Codec, record: RunRecord, keep: set[str]) -> str:
    """The source's run state with loop generations and parked deliveries of reused nodes only."""
    meta = _decode(codec, record.state_json, record.run_id, "run state")
    if not isinstance(meta, dict):
        raise CorruptRecord(f"run {record.run_id!r}: run state is not an object")
    meta = dict(meta)
    meta["edge_gen"] = [e for e in meta.get("edge_gen", []) if e[0] in keep and e[1] in keep]
    meta["parked"] = [p for p in meta.get("parked", []) if p[0] in keep and p[1] in keep]
    return codec.encode(meta)


def _last_payload(codec: Codec, snapshot: RunSnapshot, at: str) -> Any:
    """The payload node ``at``'s latest visit ran with in the source ``snapshot`` holds."""
    run_id = snapshot.stored.run.run_id
    row = snapshot.stored.nodes.get(at)
    data = None if row is None else _decode(codec, row.data_json, run_id, f"node {at!r}")
    if not isinstance(data, dict) or not data.get("visits"):
        raise ValueError(
            f"run {run_id!r}: node {at!r} never ran, so there is no payload to fork it with; "
            "pass input= (the payload it runs with)"
        )
    ref = data.get("payload_ref")
    if ref is None:
        return data.get("payload")
    for result in snapshot.results:
        if (result.node_id, result.visit) == (str(ref[0]), int(ref[1])):
            return _decode(codec, result.value_json, run_id, f"result of {ref[0]!r}")
    raise CorruptRecord(f"run {run_id!r}: node {at!r} refers to a missing result {ref!r}")


def _decode(codec: Codec, text: str, run_id: str, what: str) -> Any:
    try:
        return codec.decode(text)
    except ValueError as exc:
        raise CorruptRecord(f"run {run_id!r}: {what} does not decode: {exc}") from exc
