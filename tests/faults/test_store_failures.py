"""A store whose commit fails stops the run at once (issue 9, finding 2; E9, D1, D2, D3).

The store under test is wrapped in a :class:`FailingStore` whose ``commit``
raises :class:`~tailrace.StoreError` from its N-th call on (N = 1..20, drawn
from a seed per case), while a sibling handler never returns. The graph is a
chain, a fan-out into a first-k merge, a chain after the merge, and that
never-returning branch::

    start -> sibling (never returns)
    start -> c0 -> ... -> c5 -> w0..w4 -> merge (first 3 of 5) -> d0 -> ... -> d11 -> end

Handlers pace themselves on the writes (each waits until its own start is
durable; worker ``wj`` also until ``w(j-1)``'s result is), so the run makes
more than 20 commits before it could block, whatever the machine's speed,
and the N-th commit is always reached. Then:

- the run raises the store's own exception, unwrapped (E9), well before the
  hang guard;
- no handler starts after the failed write, and the engine attempts no
  write after it (D2);
- every handler that was running, the never-returning sibling included, saw
  its cancellation, and was awaited before the run raised;
- the run stays ``running`` with its lease released, and a healthy engine
  (another owner) resumes it to the results of an uninterrupted run, running
  exactly the visits that were not committed (D1, D3), the merge on the
  decision that was saved (E4).
"""

from __future__ import annotations

import functools
import json
import random
import uuid
from typing import Any

import pytest

import tailrace as tr
from tailrace.stores import RunStatus, RunStore
from tests import fixtures
from tests.faults import _faulty as faulty

#: The run must fail long before this; it only turns a hang into a failure.
FAIL_GUARD = 5.0
CHAIN = 6
WORKERS = 5
K = 3
TAIL = 12
SEEDS = range(8)


def _fail_at(seed: int) -> int:
    return random.Random(f"store-failure-{seed}").randint(1, 20)


store = fixtures.each_store  # the fixture: each backend in turn, on a fresh database


def _plus_one(x: int) -> int:
    return x + 1


def _same(x: Any) -> Any:
    return x


def _worker(j: int, x: int) -> int:
    return x * 10 + j


def build_graph(rec: Any) -> tr.Graph:
    """The chain, the fan-out into a first-k merge, and the never-returning sibling."""
    g = tr.Graph("store-failure")
    g.add_node("start", rec.task(_same))
    g.add_node("sibling", rec.never_returns("sibling done"))
    g.add_edge("start", "sibling")
    prev = "start"
    for i in range(CHAIN):
        g.add_node(f"c{i}", rec.task(_plus_one))
        g.add_edge(prev, f"c{i}")
        prev = f"c{i}"
    g.add_node("merge", rec.task(_same), kind="aggregate", required=K)
    for j in range(WORKERS):
        after = (f"w{j - 1}",) if j else ()
        g.add_node(f"w{j}", rec.task(functools.partial(_worker, j), after=after))
        g.add_edge(prev, f"w{j}")
        g.add_edge(f"w{j}", "merge")
    prev = "merge"
    for i in range(TAIL):
        g.add_node(f"d{i}", rec.task(sum if i == 0 else _plus_one))
        g.add_edge(prev, f"d{i}")
        prev = f"d{i}"
    g.add_node("end", rec.task(_same))
    g.add_edge(prev, "end")
    return g


async def _reference(store: RunStore, rec: Any, graph: tr.Graph) -> tr.RunResult:
    """The same graph run uninterrupted, nobody hanging."""
    rec.phase, rec.pace, rec.hang = "reference", None, False
    result = await faulty.guarded(
        tr.Engine(store=store).run(graph, 1, run_id=f"ref-{uuid.uuid4().hex}"), "reference run"
    )
    assert result.status == "completed"
    assert result.results["merge"] == [70, 71, 72]  # w0, w1, w2: E4's tie by definition order
    return result


@pytest.mark.parametrize("seed", SEEDS, ids=[f"seed{s}-N{_fail_at(s)}" for s in SEEDS])
async def test_failed_commit_stops_the_run_and_it_resumes_without_rerunning_committed_visits(
    store: RunStore, seed: int
) -> None:
    fail_at = _fail_at(seed)
    rec = faulty.Recorder()
    graph = build_graph(rec)
    reference = await _reference(store, rec, graph)

    run_id = f"fail-{seed}-{uuid.uuid4().hex}"
    failing = faulty.FailingStore(store, fail_at=fail_at, log=rec.log)
    rec.phase, rec.pace, rec.hang = "fail", failing, True
    engine = tr.Engine(store=failing)
    with pytest.raises(tr.StoreError) as raised:
        await faulty.guarded(engine.run(graph, 1, run_id=run_id), "the failing run", FAIL_GUARD)

    # E9: the store's own exception, unwrapped; D2: no write attempted after it.
    assert failing.errors, "the run ended without reaching the failing commit"
    assert raised.value is failing.errors[0]
    assert failing.calls == fail_at
    _assert_nothing_started_after_the_failure(rec.log)
    _assert_in_flight_cancelled_and_awaited(rec)
    assert not faulty.lease_tasks()

    record = await store.get_run(run_id)
    assert record.status is RunStatus.RUNNING
    assert record.lease_owner is None
    committed = await faulty.committed_keys(store, run_id)
    await _assert_committed_matches_what_ran(store, rec, run_id, committed)

    rec.phase, rec.pace, rec.hang = "resume", None, False
    healthy = tr.Engine(store=store)
    assert healthy.owner != engine.owner
    resumed = await faulty.guarded(healthy.resume(run_id, graph), "the resume")

    assert resumed.status == "completed"
    assert resumed.results == reference.results
    assert resumed.output == reference.output
    executed = rec.started["resume"]
    rerun = sorted(set(executed) & set(committed))
    assert not rerun, f"committed visits ran again on resume (D1): {rerun}"
    assert all(n == 1 for n in executed.values()), executed
    # Exactly the visits that were not committed ran again; together they make the whole run.
    assert set(executed) | set(committed) == set(rec.started["reference"])
    if ("merge", 1) in executed:  # it re-ran: on the saved decision if there was one (E4)
        assert rec.payloads[("resume", "merge", 1)] == [70, 71, 72]


def _assert_nothing_started_after_the_failure(log: list[Any]) -> None:
    """No handler was dispatched once the write failed (the loop woke and stopped at once)."""
    failed_at = next(i for i, entry in enumerate(log) if entry[0] == "store_failed")
    late = [entry for entry in log[failed_at:] if entry[0] == "start"]
    assert not late, f"handlers started after the store failed: {late}"


def _assert_in_flight_cancelled_and_awaited(rec: Any) -> None:
    """Every handler of the failed run ended before it raised; those still running were cancelled."""
    assert not rec.unfinished("fail"), f"not awaited: {rec.unfinished('fail')}"
    assert all(n == 1 for n in rec.started["fail"].values()), rec.started["fail"]
    assert rec.cancelled["fail"][("sibling", 1)] == 1, (
        "the never-returning sibling was not cancelled"
    )
    assert not rec.returned["fail"][("sibling", 1)]


async def _assert_committed_matches_what_ran(
    store: RunStore, rec: Any, run_id: str, committed: dict[tuple[str, int], str]
) -> None:
    """What the store holds came from handlers that returned, with a saved decision for each merge."""
    returned = rec.returned["fail"]
    stray = sorted(key for key in committed if not returned[key])
    assert not stray, f"results committed for visits that never returned: {stray}"
    frozen = {(f.node_id, f.activation): f.payload_json for f in await store.frozen_inputs(run_id)}
    if ("merge", 1) in committed:  # D1: its decision is written with (or before) its result
        assert json.loads(frozen[("merge", 1)]) == json.loads(committed[("merge", 1)])
    if ("merge", 1) in frozen:
        assert json.loads(frozen[("merge", 1)]) == [70, 71, 72]
    if rec.started["fail"][("merge", 1)]:  # it ran on the decision being saved, never another
        assert rec.payloads[("fail", "merge", 1)] == [70, 71, 72]
