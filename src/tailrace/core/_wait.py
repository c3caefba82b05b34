"""Waiting for a run, whichever process runs it: ``Engine.wait``.

The result is rebuilt from the store: with the run's graph (this engine ran,
submitted or was given it, or its module reference imports), from the node
rows exactly as a resume would see them, ``output`` included; without it,
from the result rows (``output`` is then None). The waiter sleeps on the
store's change feed (a run that ends releases its lease, which wakes it),
re-checking at most every :data:`RECHECK` seconds and at least every second.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from .._codec import DEFAULT_CODEC
from .._errors import RunFailed, TailraceError
from ..stores import QuestionStatus, RunRecord, RunStatus, RunStore, StoredRun
from ._outcome import NodeReport, RunResult

if TYPE_CHECKING:
    from ..graph import Graph
    from ._engine import Engine

#: Seconds between two looks at the run while wake-ups keep coming.
RECHECK = 0.02
#: Seconds between two looks with no wake-up at all (the fallback).
FALLBACK = 1.0


async def settled(store: RunStore, record: RunRecord, now: float) -> bool:
    """Whether ``record`` is where ``wait`` returns: finished, or suspended with nothing to resume it.

    A suspended run someone holds (it is being resumed), or one with an answer
    not applied yet (a worker is about to resume it), is not settled.
    """
    if record.status in (RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED):
        return True
    if record.status is not RunStatus.SUSPENDED:
        return False
    if record.lease_expires is not None and record.lease_expires >= now:
        return False
    return not any(
        q.status is QuestionStatus.ANSWERED
        or (q.status is QuestionStatus.EXPIRED and q.applied_at is None)
        for q in await store.list_questions(run_id=record.run_id)
    )


async def wait_for(
    engine: Engine,
    run_id: str,
    *,
    timeout: float | None,  # noqa: ASYNC109 (Engine.wait's own argument)
    graph: Graph | None,
) -> RunResult:
    """``Engine.wait``: the run's :class:`RunResult` once :func:`settled`; ``RunFailed`` if it failed."""
    store = engine.store
    if store is None:
        raise ValueError("wait needs an engine with a store: Engine(store=...)")
    deadline = None if timeout is None else time.monotonic() + timeout
    async with store.changes() as feed:
        while True:
            record = await store.get_run(run_id)
            if await settled(store, record, time.time()):
                return await stored_result(engine, record, graph)
            left = FALLBACK if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"run {run_id!r} is still {record.status.value} after {timeout:g} s"
                )
            await feed.wait(min(left, FALLBACK))
            await asyncio.sleep(RECHECK)  # let a burst of wake-ups pass: one look for all


async def stored_result(engine: Engine, record: RunRecord, graph: Graph | None) -> RunResult:
    """The :class:`RunResult` of ``record`` as stored; raises :class:`RunFailed` for a failed run."""
    assert engine.store is not None
    stored = await engine.store.load_run(record.run_id)
    graph = graph or _known_graph(engine, record)
    if stored.nodes and graph is not None and graph.compile().fingerprint == record.fingerprint:
        result = await _from_state(engine, stored, graph)
    else:
        result = await _from_rows(engine, stored)
    if record.status is RunStatus.SUSPENDED:
        questions = await engine.store.list_questions(
            run_id=record.run_id, status=QuestionStatus.OPEN
        )
        result = _replace(result, questions=tuple(questions))
    if record.status is RunStatus.FAILED:
        raise RunFailed(
            f"run {record.run_id!r} failed: {record.error}",
            run_id=record.run_id, error=record.error, result=result,
        )  # fmt: skip
    return result


def _known_graph(engine: Engine, record: RunRecord) -> Graph | None:
    from ._writer import Persister

    found = engine._graphs.get(record.fingerprint)
    if found is not None:
        return found
    try:
        return Persister.find_graph(record)  # a module reference only, never a file
    except TailraceError:
        return None


def _duration(record: RunRecord) -> float:
    start = record.started_at or record.created_at
    return max((record.finished_at or record.updated_at) - start, 0.0)


async def _from_state(engine: Engine, stored: StoredRun, graph: Graph) -> RunResult:
    """Rebuild the run's state as a resume would, and read the result off it."""
    from ._writer import Persister

    topo = graph.compile()
    state, _, _ = await Persister(engine, stored.run.run_id, topo, stored.run).restore(stored, [])
    ids, nodes = topo.ids, state.nodes
    done = [i for i in topo.sinks if nodes[i].has_result]
    output: Any = (
        nodes[done[0]].result if len(done) == 1 else {ids[i]: nodes[i].result for i in done} or None
    )
    return RunResult(
        run_id=stored.run.run_id,
        status=stored.run.status.value,
        results={ids[i]: ns.result for i, ns in enumerate(nodes) if ns.has_result},
        visits={ids[i]: ns.visits for i, ns in enumerate(nodes)},
        nodes={
            ids[i]: NodeReport(stored.nodes[ids[i]].status, ns.visits, ns.attempts, 0.0)
            if ids[i] in stored.nodes
            else NodeReport(ns.status.value, ns.visits, ns.attempts, 0.0)
            for i, ns in enumerate(nodes)
        },
        duration=_duration(stored.run),
        output=output,
    )


async def _from_rows(engine: Engine, stored: StoredRun) -> RunResult:
    """Without the graph: each node's latest result row, its visits and status."""
    assert engine.store is not None
    codec = engine.codec or DEFAULT_CODEC
    results: dict[str, Any] = {}
    for row in await engine.store.results(stored.run.run_id):  # by node, then visit
        results[row.node_id] = codec.decode(row.value_json)
    return RunResult(
        run_id=stored.run.run_id,
        status=stored.run.status.value,
        results=results,
        visits={node_id: row.visits for node_id, row in stored.nodes.items()},
        nodes={
            node_id: NodeReport(row.status, row.visits, 0, 0.0)
            for node_id, row in stored.nodes.items()
        },
        duration=_duration(stored.run),
    )


def _replace(result: RunResult, **changes: Any) -> RunResult:
    import dataclasses

    return dataclasses.replace(result, **changes)
