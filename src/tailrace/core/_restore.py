"""Reading a stored run back: its graph (by reference only) and its state (D3, D4).

:func:`restore_run` rebuilds a :class:`RunState` from the node rows, loads the
result rows they refer to (each decoded once, shared), and refuses rows it
cannot read with :class:`CorruptRecord` or :class:`UnsupportedFormat`. It only
reads: a resume calls it before it writes anything, and ``Engine.wait`` calls
it to read a finished run. :func:`find_graph` imports a run's graph by its
module reference.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from typing import Any

from .._codec import Codec
from .._context import Checkpoint
from .._errors import CorruptRecord, GraphError, GraphMismatch, UnsupportedFormat
from .._events import EventType
from ..graph import Graph, NodeKind, Topology, is_file_reference, resolve_reference
from ..stores import FORMAT_VERSION, ItemRow, NodeRow, ParkedRow, RunRecord, RunStore, StoredRun
from ._checkpoints import parked_checkpoint
from ._state import ItemStatus, LateInput, MapItems, NodeStatus, RunState
from ._writer import NODE_ROW_VERSION, _unpairs


@dataclass(slots=True, kw_only=True)
class Restored:
    """A run as :func:`restore_run` read it back."""

    state: RunState
    #: The last event's sequence number and the run's turn (Q2).
    event_seq: int
    turn: int
    #: The durability mode stored with the run's state; None if it has none.
    durability: str | None
    #: node index -> (visit, value) of large results read back by reference: a
    #: writer takes them (``RunWriter.refer``) so node rows keep referring.
    big: dict[int, tuple[int, Any]] = field(default_factory=dict)


def find_graph(record: RunRecord, *, fork_at: str | None = None) -> Graph:
    """Import the graph a run recorded, by module reference only (``package.module:attr``).

    ``record`` is the stored run. Its ``graph_ref`` is data anyone with
    write access to the store could have written, so a file reference
    (``path/to/file.py:graph``) is never executed here (trust model,
    ``docs/trust.md``): the reader opts in by passing or registering the graph.
    ``fork_at`` names the node a fork of the run is made at: the hints of an
    error then say how to fork it, else how to resume it.
    """
    ref, run_id = record.graph_ref, record.run_id
    if fork_at is None:
        passing = "engine.resume(run_id, graph)"
        command = f"tailrace resume {shlex.quote(run_id)}"
    else:
        passing = f"engine.fork(run_id, at={fork_at!r}, graph=graph)"
        command = f"tailrace fork {shlex.quote(run_id)} --at {shlex.quote(fork_at)}"
    if not ref:
        raise GraphError(
            f"run {run_id!r} recorded no graph reference; pass the graph "
            f"({passing}) or register it (engine.register(graph))"
        )
    if is_file_reference(ref):
        path = shlex.quote(ref.rpartition(":")[0])
        serve = "" if fork_at is not None else f" (or tailrace serve --graphs {path})"
        raise GraphError(
            f"run {run_id!r} names its graph by the file reference {ref!r}; a stored "
            f"reference is never executed as a file. Opt in by passing the graph ({passing}) "
            "or registering it (engine.register(graph)), or on the command line: "
            f"{command} --graphs {path}{serve}"
        )
    try:
        graph = resolve_reference(ref)
    except Exception as exc:  # ImportError, AttributeError, GraphError, or the import failing
        raise GraphError(
            f"run {run_id!r}: cannot import its graph {ref!r}: {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(graph, Graph):
        raise GraphError(f"run {run_id!r}: {ref!r} is not a Graph")
    return graph


class Graphs:
    """The graphs an engine ran, submitted or was given, by name and fingerprint, so it can
    drive their runs even when they cannot be imported (defined in ``__main__``, say)."""

    __slots__ = ("_known",)

    def __init__(self) -> None:
        self._known: dict[tuple[str, str], Graph] = {}

    def add(self, graph: Graph, fingerprint: str) -> None:
        """Know ``graph`` (of structural ``fingerprint``), unless a graph of both is known."""
        self._known.setdefault((graph.name, fingerprint), graph)

    def register(self, *graphs: Graph) -> None:
        """Know ``graphs`` and, since whoever drives a run drives its children, their child graphs."""
        for graph in graphs:
            self.add(graph, graph.compile().fingerprint)
            self.register(*graph.child_graphs())

    def get(self, record: RunRecord) -> Graph | None:
        """The known graph of the stored run ``record`` (by its graph's name and fingerprint)."""
        return self._known.get((record.graph_name, record.fingerprint))

    def knows(self, fingerprint: str, name: str | None) -> bool:
        """Whether a graph of ``fingerprint`` (and ``name``, when given) is known."""
        return any(fp == fingerprint and name in (None, known) for known, fp in self._known)

    def of(self, record: RunRecord, graph: Graph | None, *, fork_at: str | None = None) -> Graph:
        """The graph to drive ``record`` with: ``graph``, a known one, or its reference
        (``fork_at``: for a fork at that node, see :func:`find_graph`).

        A graph of another name is refused whatever its shape (GraphMismatch).
        """
        graph = graph or self.get(record) or find_graph(record, fork_at=fork_at)
        if graph.name != record.graph_name:
            raise GraphMismatch(
                f"run {record.run_id!r} is a run of graph {record.graph_name!r}, not of "
                f"{graph.name!r}: a run is never driven by a graph of another name"
            )
        return graph


async def late_inputs(store: RunStore, codec: Codec, run_id: str) -> list[LateInput]:
    """The late inputs run ``run_id`` recorded (its ``node_late_input`` events), for a restore (E5)."""
    late: list[LateInput] = []
    for event in await store.events(run_id):
        if event.type != EventType.NODE_LATE_INPUT.value:
            continue
        data = codec.decode(event.data_json)
        data = data if isinstance(data, dict) else {}
        late.append(
            LateInput(
                node_id=event.node_id or "",
                source_id=str(data.get("source")),
                activation=event.visit or 0,
                reason=str(data.get("reason")),
                item=data.get("item"),
            )
        )
    return late


async def restore_run(
    store: RunStore, codec: Codec, topo: Topology, stored: StoredRun, late: list[LateInput]
) -> Restored:
    """Rebuild the state of ``stored`` (a run of ``topo``) from its rows; running nodes go back
    to ready (D3).

    ``late`` lists the late inputs already recorded for the run (E5). A node
    that was running or backing off between retries keeps its attempt count
    and the due time of its next attempt, so it continues its retry policy
    instead of starting it over (E11). Nothing is written.
    """
    return await _Reader(store, codec, stored.run.run_id, topo).read(stored, late)


class _Reader:
    """One reading of a run's rows, with the large results it shares between them."""

    def __init__(self, store: RunStore, codec: Codec, run_id: str, topo: Topology) -> None:
        self.store = store
        self.codec = codec
        self.run_id = run_id
        self.topo = topo
        self.stored_durability: str | None = None
        self._big: dict[int, tuple[int, Any]] = {}
        #: Per map node: the parked items its current visit took first (P4).
        self._parked: dict[str, list[ParkedRow]] = {}
        #: Per (map node, visit): the highest try its events say each item started.
        self._started: dict[tuple[str, int], dict[int, int]] = {}

    async def read(self, stored: StoredRun, late: list[LateInput]) -> Restored:
        rows = {node_id: self._decode_row(row) for node_id, row in stored.nodes.items()}
        values = await self._referenced_results(rows)
        self._parked = await self._parked_prefixes(rows)
        self._started = await self._started_items(stored, rows)
        state, event_seq, turn = self._restore(stored, rows, values, late)
        return Restored(
            state=state,
            event_seq=event_seq,
            turn=turn,
            durability=self.stored_durability,
            big=self._big,
        )

    def _restore(
        self,
        stored: StoredRun,
        rows: dict[str, dict[str, Any]],
        values: dict[tuple[str, int], Any],
        late: list[LateInput],
    ) -> tuple[RunState, int, int]:
        run = stored.run
        if run.format_version > FORMAT_VERSION:
            raise UnsupportedFormat(
                f"run {self.run_id!r} has format version {run.format_version}; "
                f"this tailrace reads up to {FORMAT_VERSION}"
            )
        meta = self._decode(run.state_json, "run state")
        durability = meta.get("durability")
        if durability is not None and durability not in ("async", "sync"):
            raise CorruptRecord(
                f"run {self.run_id!r}: stored durability {durability!r} is not 'async' or 'sync'"
            )
        self.stored_durability = durability
        state = RunState(self.topo)
        state.seq = int(meta.get("seq", 0))
        index = self.topo.index
        state.edge_gen = {(index[s], index[t]): int(g) for s, t, g in meta.get("edge_gen", [])}
        state.parked = [
            (index[src], index[dst], value, _unpairs(f, index))
            for src, dst, value, f in meta.get("parked", [])
        ]
        state.late.extend(late)
        items: dict[str, list[ItemRow]] = {}
        for item_row in stored.items:
            items.setdefault(item_row.node_id, []).append(item_row)
        for node_id, row in stored.nodes.items():
            i = self.topo.index.get(node_id)
            if i is None:
                raise CorruptRecord(
                    f"run {self.run_id!r}: stored node {node_id!r} is not in the graph"
                )
            self._restore_node(state, i, row, rows[node_id], values)
            if "map" in rows[node_id]:
                self._restore_items(state, i, rows[node_id]["map"], items.get(node_id, []))
        for cp in stored.checkpoints:
            state.checkpoints[(cp.node_id, cp.visit, cp.item)] = Checkpoint(
                value=self._decode(cp.value_json, f"checkpoint of {cp.node_id!r}"),
                run_id=self.run_id,
                node_id=cp.node_id,
                visit=cp.visit,
                item=None if cp.item < 0 else cp.item,
                saved_at=cp.saved_at,
            )
        state.dirty.clear()
        if not stored.nodes:
            state.activate_entries(self._decode(run.input_json, "input"))
        return state, int(meta.get("events", 0)), int(meta.get("turn", 0))

    async def _started_items(
        self, stored: StoredRun, rows: dict[str, dict[str, Any]]
    ) -> dict[tuple[str, int], dict[int, int]]:
        """Per current visit of a map with items still open: the highest try each item started,
        as its ``node_started`` and ``node_retrying`` events say (an item's row is written when
        it ends or backs off, not when it starts). The events are read only for such a map."""
        visits: dict[str, int] = {}
        for node_id, data in rows.items():
            info = data.get("map")
            if not isinstance(info, dict) or stored.nodes[node_id].status not in _CUT:
                continue
            visits[node_id] = int(data.get("visits") or 0)
        if not visits:
            return {}
        found: dict[tuple[str, int], dict[int, int]] = {}
        for event in await self.store.events(self.run_id):
            if event.type not in _TRIES or visits.get(event.node_id or "") != event.visit:
                continue
            item = _item_of(event.data_json)
            if item is None or event.attempt is None:
                continue
            key = (event.node_id or "", event.visit or 0)
            per = found.setdefault(key, {})
            per[item] = max(per.get(item, 0), event.attempt)
        return found

    async def _parked_prefixes(self, rows: dict[str, dict[str, Any]]) -> dict[str, list[ParkedRow]]:
        """The parked items each map visit took first (P4), as the store holds them."""
        found: dict[str, list[ParkedRow]] = {}
        for node_id, data in rows.items():
            info = data.get("map")
            if not isinstance(info, dict) or not info.get("parked"):
                continue
            claimant = f"{self.run_id}/{node_id}/{data.get('visits')}"
            held = {
                r.park_id: r for r in await self.store.list_parked(status=None, claimed_by=claimant)
            }
            try:
                found[node_id] = [held[park_id] for park_id in info["parked"]]
            except (KeyError, TypeError) as exc:
                raise CorruptRecord(
                    f"run {self.run_id!r}: map {node_id!r} names parked items it does not hold: {exc!r}"
                ) from exc
        return found

    def _decode_row(self, row: NodeRow) -> dict[str, Any]:
        data = self._decode(row.data_json, f"node {row.node_id!r}")
        if not isinstance(data, dict) or data.get("v", 0) > NODE_ROW_VERSION:
            raise UnsupportedFormat(
                f"run {self.run_id!r}: node {row.node_id!r} has an unsupported format"
            )
        return data

    async def _referenced_results(
        self, rows: dict[str, dict[str, Any]]
    ) -> dict[tuple[str, int], Any]:
        """Load the result rows that node rows refer to, each decoded once (shared)."""
        wanted: set[tuple[str, int]] = set()
        try:
            for node_id, data in rows.items():
                if "result_ref" in data:
                    wanted.add((node_id, int(data["result_ref"])))
                if "payload_ref" in data:
                    source, visit = data["payload_ref"]
                    wanted.add((str(source), int(visit)))
                for entry in data.get("inputs") or ():
                    if len(entry) > 4:
                        wanted.add((str(entry[0]), int(entry[4])))
        except (TypeError, ValueError) as exc:
            raise CorruptRecord(f"run {self.run_id!r}: a node row refers badly: {exc!r}") from exc
        values: dict[tuple[str, int], Any] = {}
        for node_id in sorted({node_id for node_id, _ in wanted}):
            for row in await self.store.results(self.run_id, node_id):
                key = (row.node_id, row.visit)
                if key in wanted:
                    values[key] = self._decode(row.value_json, f"result of {node_id!r}")
        missing = wanted - values.keys()
        if missing:
            raise CorruptRecord(
                f"run {self.run_id!r}: node rows refer to missing results {sorted(missing)}"
            )
        return values

    def _restore_node(
        self,
        state: RunState,
        i: int,
        row: NodeRow,
        data: dict[str, Any],
        values: dict[tuple[str, int], Any],
    ) -> None:
        index = self.topo.index
        ns = state.nodes[i]
        try:
            ns.status = NodeStatus(row.status)
            ns.fired = int(data["fired"])
            ns.visits = int(data["visits"])
            ns.attempts = int(data["attempts"])
            ns.payload = data["payload"]
            ns.result = data["result"]
            ns.has_result = bool(data["has_result"])
            ns.frontier = _unpairs(data["frontier"], index)
            if data["inputs"] is not None:
                ns.inputs = {}
                for entry in data["inputs"]:
                    s, seq, value, f = entry[:4]
                    if len(entry) > 4:
                        value = self._shared(index[s], values, (s, int(entry[4])))
                    ns.inputs[index[s]] = (int(seq), value, _unpairs(f, index))
            if data["pending"] is not None:
                ns.pending = (data["pending"][0], _unpairs(data["pending"][1], index))
            ns.question = data.get("question")
            if "result_ref" in data:
                ns.result = self._shared(i, values, (row.node_id, int(data["result_ref"])))
            if "payload_ref" in data:
                source, visit = data["payload_ref"]
                ns.payload = self._shared(index[source], values, (source, int(visit)))
            due = data.get("retry_due")
            ns.retry_due = None if due is None else float(due)
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptRecord(
                f"run {self.run_id!r}: node {row.node_id!r} row does not decode: {exc!r}"
            ) from exc
        if ns.status in (NodeStatus.RUNNING, NodeStatus.QUEUED):
            # D3: it was running; run that visit again, continuing its retry policy
            # (E11). A try that had started was cut: the re-run is the next try.
            if ns.status is NodeStatus.RUNNING:
                ns.attempts = next_try(ns.attempts, backing_off=ns.retry_due is not None)
            ns.status = NodeStatus.QUEUED
            state.ready.append(i)

    def _restore_items(self, state: RunState, i: int, info: Any, rows: list[ItemRow]) -> None:
        """Rebuild map ``i``'s current visit from its stored items (M6): only items that had
        not ended run again, and a decision made is kept (M3)."""
        ns = state.nodes[i]
        node_id = self.topo.ids[i]
        if self.topo.nodes[i].kind is not NodeKind.MAP or not isinstance(ns.payload, list):
            raise CorruptRecord(
                f"run {self.run_id!r}: node {node_id!r} has map items but is no map"
            )
        parked = self._parked.get(node_id, [])
        values = [self._decode(r.value_json, f"parked item of {node_id!r}") for r in parked]
        try:
            k = info["k"]
            items = MapItems(i, ns.visits, values + ns.payload, None if k is None else int(k))
            items.took_parked(parked, self.topo.nodes[i].max_parks)
            for j, r in enumerate(parked):
                key = (node_id, ns.visits, j)
                if r.checkpoint_json is not None and key not in state.checkpoints:
                    cp = self._decode(r.checkpoint_json, f"parked checkpoint of {node_id!r}")
                    state.checkpoints[key] = parked_checkpoint(r, cp)
            for row in rows:
                if row.visit != ns.visits:
                    continue  # an earlier visit's items: history only
                if not 0 <= row.item < len(items):
                    raise ValueError(f"item {row.item} of {len(items)}")
                status = ItemStatus(row.status)
                text = row.value_json
                items.restore_row(
                    row.item,
                    status,
                    seq=int(row.seq),
                    attempts=int(row.attempts),
                    result=None if text is None else self._decode(text, f"item of {node_id!r}"),
                    text=text,
                    error=row.error,
                    retry_due=row.retry_due,
                )
            if info["winners"] is not None:
                items.winners = tuple(int(w) for w in info["winners"])
            started = self._started.get((node_id, ns.visits), {})
            for j in items.pending():
                backing_off = j in items.retry_due
                items.attempts[j] = next_try(
                    items.attempts[j], backing_off=backing_off, known=started.get(j, 0)
                )
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptRecord(
                f"run {self.run_id!r}: map {node_id!r} items do not decode: {exc!r}"
            ) from exc
        ns.items = items
        late_items = self.topo.nodes[i].late == "record" and items.pending()
        if items.winners is not None and late_items and ns.status is NodeStatus.COMPLETED:
            state.ready.append(i)  # its late items run on (M5)

    def _shared(self, i: int, values: dict[tuple[str, int], Any], key: tuple[str, int]) -> Any:
        """A referenced result, the same object wherever it is referenced (so it stays stored once)."""
        value = values[key]
        big = self._big.get(i)
        if big is None or big[0] <= key[1]:
            self._big[i] = (key[1], value)
        return value

    def _decode(self, text: str, what: str) -> Any:
        try:
            return self.codec.decode(text)
        except ValueError as exc:
            raise CorruptRecord(f"run {self.run_id!r}: {what} does not decode: {exc}") from exc


#: Stored statuses of a node whose visit was cut by a crash or a stop (it runs again, D3).
_CUT = (NodeStatus.RUNNING.value, NodeStatus.QUEUED.value)

#: Events that say a try of an item started (a retry's next try starts after its backoff).
_TRIES = (EventType.NODE_STARTED.value, EventType.NODE_RETRYING.value)


def next_try(stored: int, *, backing_off: bool, known: int = 0) -> int:
    """The try a node or item cut by a crash or a stop runs next (E11).

    ``stored`` is the try its row holds, ``backing_off`` whether that try was
    still waiting out its backoff (it had not started), ``known`` the highest
    try its events say started. A try that started was cut: the re-run is the
    next one, so events, stream tags and the timelines never show one try twice.
    """
    started = known if backing_off else max(known, stored)
    return max(stored, started + 1) if started else stored


def _item_of(data_json: str) -> int | None:
    """The ``item`` of an event's data (a map item's event), else None."""
    try:
        data = json.loads(data_json)
    except ValueError:
        return None
    item = data.get("item") if isinstance(data, dict) else None
    return item if isinstance(item, int) and not isinstance(item, bool) else None
