"""Queues, claims, cancel requests, workers and wake-ups: the store contract of issue 10.

Run against every backend. Claims: a queued run is handed to one claimer
only; a queue's concurrency, rate limit, order, partitions and dedup keys
are kept by the store itself (the claim is atomic). Wake-ups: a change feed
reports submits, answers, releases and cancel requests made through another
store object on the same database.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import TYPE_CHECKING

import pytest

from tailrace._errors import QueueNotEmpty, RunExists, RunNotFound
from tailrace.stores import (
    ChangeFeed,
    Claim,
    GraphRow,
    Harvest,
    NewRun,
    Pulse,
    QuestionRow,
    QuestionStatus,
    Queue,
    RunStatus,
    RunStore,
    Submission,
    WorkerRow,
)

if TYPE_CHECKING:
    from tests.fixtures import Backend

TTL = 30.0


def new_run(run_id: str, *, at: float | None = None) -> NewRun:
    return NewRun(
        run_id=run_id, graph_name="g", graph_ref="pkg.mod:g", fingerprint="fp",
        input_json="1", created_at=at if at is not None else 0.0,
    )  # fmt: skip


async def submit(
    store: RunStore, run_id: str, queue: str = "q", *, at: float, **options: object
) -> str:
    return await store.submit_run(
        new_run(run_id, at=at),
        Submission(queue=queue, **options),  # type: ignore[arg-type]
    )


async def submit_many(store: RunStore, ids: list[str], queue: str = "q", **options: object) -> None:
    for n, run_id in enumerate(ids):
        await submit(store, run_id, queue, at=float(n + 1), **options)


async def finish(store: RunStore, run_id: str, owner: str = "w1") -> None:
    """Complete a claimed run the way its engine would: a terminal harvest, then release."""
    token = (await store.get_run(run_id)).lease_token
    await store.commit(
        run_id, token, Harvest(state_json="{}", status=RunStatus.COMPLETED, finished_at=5.0)
    )
    await store.release_lease(run_id, owner, token)


# --- submitting -------------------------------------------------------------------


async def test_many_runs_are_submitted_in_one_write_and_taken_ids_are_skipped(
    store: RunStore,
) -> None:
    """``submit_runs``: a map's child runs go in one transaction and one wake-up (R4)."""
    await submit(store, "taken", at=1.0)
    children = [
        (
            NewRun(
                run_id=run_id, graph_name="kid", graph_ref=None, fingerprint="fp",
                input_json=str(n), created_at=2.0, parent_run_id="p", deadline=99.0,
            ),
            Submission(queue="kids", priority=1 - n % 2),
        )
        for n, run_id in enumerate(["p/each/1/0", "taken", "p/each/1/2"])
    ]  # fmt: skip
    async with store.changes() as feed:
        stored = await store.submit_runs(children)
        kinds = await feed.wait(5.0)
    assert stored == ["p/each/1/0", "p/each/1/2"]
    assert "submit" in kinds
    kept = await store.get_run("taken")
    assert (kept.graph_name, kept.queue_name, kept.parent_run_id) == ("g", "q", None)
    first = await store.get_run("p/each/1/0")
    assert (first.status, first.queue_name, first.priority) == (RunStatus.QUEUED, "kids", 1)
    assert (first.parent_run_id, first.deadline, first.input_json) == ("p", 99.0, "0")
    assert [r.run_id for r in await store.list_runs(parent="p")] == ["p/each/1/2", "p/each/1/0"]
    with pytest.raises(ValueError, match="no dedup keys"):
        await store.submit_runs([(new_run("d"), Submission(queue="q", dedup_key="k"))])
    with pytest.raises(RunNotFound):
        await store.get_run("d")  # nothing of a refused batch is stored


def kid(run_id: str, *, graph: str = "kid") -> tuple[NewRun, Submission]:
    return (
        NewRun(
            run_id=run_id, graph_name=graph, graph_ref=None, fingerprint="fp",
            input_json="0", created_at=2.0, parent_run_id="p",
        ),
        Submission(queue="q"),
    )  # fmt: skip


async def test_submit_and_claim_leases_what_fits_in_the_same_write(store: RunStore) -> None:
    """``submit_and_claim``: the submitting worker's free slots take the new runs in
    queue order (R4); what is left queued wakes the fleet."""
    claim = Claim(queue="q", owner="w1", ttl=TTL, limit=2)
    async with store.changes() as feed:
        stored, claimed = await store.submit_and_claim([kid(f"p/k/1/{n}") for n in range(3)], claim)
        kinds = await feed.wait(5.0)
    assert stored == ["p/k/1/0", "p/k/1/1", "p/k/1/2"]
    assert claimed == ["p/k/1/0", "p/k/1/1"]
    assert "submit" in kinds  # p/k/1/2 is left to the fleet
    for run_id in claimed:
        record = await store.get_run(run_id)
        assert (record.status, record.lease_owner, record.lease_token) == (
            RunStatus.RUNNING, "w1", 1,
        )  # fmt: skip
        assert record.started_at is not None and record.lease_expires is not None
    left = await store.get_run("p/k/1/2")
    assert (left.status, left.lease_owner, left.started_at) == (RunStatus.QUEUED, None, None)
    assert await store.claim_runs("q", "w2", TTL, limit=5) == ["p/k/1/2"]  # one claimer each
    again, none = await store.submit_and_claim([kid("p/k/1/0")], claim)
    assert (again, none) == ([], [])  # submitted before: left as it is, not claimed again
    assert (await store.get_run("p/k/1/0")).lease_token == 1


async def test_submit_and_claim_keeps_the_queue_order_and_limits(store: RunStore) -> None:
    """Runs queued before go first; a paused queue, a full one, a skipped graph and a zero
    limit hand out nothing; bad claims are refused before anything is stored."""
    await submit(store, "old", at=1.0)
    _, claimed = await store.submit_and_claim(
        [kid("p/a")], Claim(queue="q", owner="w", ttl=TTL, limit=1)
    )
    assert claimed == ["old"]  # older, so first: the new run waits its turn
    assert (await store.get_run("p/a")).status is RunStatus.QUEUED
    await store.declare_queue(Queue("q", concurrency=1))  # "old" runs: the queue is full
    _, claimed = await store.submit_and_claim(
        [kid("p/b")], Claim(queue="q", owner="w", ttl=TTL, limit=4)
    )
    assert claimed == []
    await finish(store, "old", owner="w")
    await store.pause_queue("q")
    _, claimed = await store.submit_and_claim(
        [kid("p/c")], Claim(queue="q", owner="w", ttl=TTL, limit=4)
    )
    assert claimed == []
    await store.resume_queue("q")
    skip = (("kid", "fp"),)
    stored, claimed = await store.submit_and_claim(
        [kid("p/d", graph="other"), kid("p/e")],
        Claim(queue="q", owner="w", ttl=TTL, limit=4, skip=skip),
    )
    assert (stored, claimed) == (["p/d", "p/e"], ["p/d"])  # the one graph not skipped
    stored, claimed = await store.submit_and_claim(
        [kid("p/f")], Claim(queue="q", owner="w", ttl=TTL, limit=0)
    )
    assert (stored, claimed) == (["p/f"], [])
    with pytest.raises(ValueError, match="owner"):
        await store.submit_and_claim(
            [kid("p/g")], Claim(queue="q", owner="w\x00", ttl=TTL, limit=1)
        )
    with pytest.raises(ValueError, match="ttl"):
        await store.submit_and_claim([kid("p/g")], Claim(queue="q", owner="w", ttl=-1.0, limit=1))
    with pytest.raises(RunNotFound):
        await store.get_run("p/g")  # nothing of a refused call is stored
    queued = {r.run_id for r in await store.list_runs(queue="q", status=RunStatus.QUEUED)}
    assert queued == {"p/a", "p/b", "p/c", "p/e", "p/f"}


async def test_a_submitted_run_is_queued_with_its_submission(store: RunStore) -> None:
    run_id = await submit(
        store, "r1", at=3.0, priority=2, partition="p", dedup_key="k", cost=4.0, estimate=9.0
    )
    record = await store.get_run(run_id)
    assert run_id == "r1"
    assert record.status is RunStatus.QUEUED
    assert (record.queue_name, record.priority, record.partition_key, record.dedup_key) == (
        "q", 2, "p", "k",
    )  # fmt: skip
    assert (record.cost, record.estimate, record.queued_at, record.started_at) == (
        4.0, 9.0, 3.0, None,
    )  # fmt: skip
    assert record.lease_owner is None
    assert [r.run_id for r in await store.list_runs(queue="q", status=RunStatus.QUEUED)] == ["r1"]
    assert await store.list_runs(queue="other") == []


async def test_a_taken_run_id_is_refused(store: RunStore) -> None:
    await submit(store, "r1", at=1.0)
    with pytest.raises(RunExists, match="'r1'"):
        await submit(store, "r1", at=2.0)


async def test_a_live_dedup_key_returns_its_run_and_a_finished_one_frees_it(
    store: RunStore,
) -> None:
    assert await submit(store, "r1", at=1.0, dedup_key="k") == "r1"
    assert await submit(store, "r2", at=2.0, dedup_key="k") == "r1"  # nothing stored
    with pytest.raises(RunNotFound):
        await store.get_run("r2")
    assert await submit(store, "r3", "other", at=3.0, dedup_key="k") == "r3"  # per queue
    assert await store.claim_runs("q", "w1", TTL, limit=1) == ["r1"]
    assert await submit(store, "r4", at=4.0, dedup_key="k") == "r1"  # running: still live
    await finish(store, "r1")
    assert await submit(store, "r5", at=5.0, dedup_key="k") == "r5"


# --- claiming ---------------------------------------------------------------------


async def test_a_claim_hands_runs_out_once_in_submit_order(backend: Backend) -> None:
    store = backend.store
    await submit_many(store, ["r1", "r2", "r3"])
    now = backend.clock.now
    assert await store.claim_runs("q", "w1", TTL, limit=2) == ["r1", "r2"]
    assert await store.claim_runs("q", "w2", TTL, limit=5) == ["r3"]
    assert await store.claim_runs("q", "w3", TTL, limit=5) == []
    record = await store.get_run("r1")
    assert record.status is RunStatus.RUNNING
    assert (record.lease_owner, record.lease_expires, record.started_at) == ("w1", now + TTL, now)
    assert record.lease_token == 1
    # The claimant's engine then re-acquires its own live lease and keeps the token (D6).
    assert await store.acquire_lease("r1", "w1", TTL) == 1
    assert await store.runs_leased_by("w1") == ["r1", "r2"]


async def test_priority_and_lpt_queues_order_their_claims(store: RunStore) -> None:
    await store.declare_queue(Queue("prio", order="priority"))
    await store.declare_queue(Queue("long", order="lpt"))
    for n, (run_id, priority) in enumerate([("a", 0), ("b", 5), ("c", 5), ("d", -1)]):
        await submit(store, run_id, "prio", at=float(n), priority=priority)
    for n, (run_id, estimate) in enumerate([("e", 1.0), ("f", None), ("g", 30.0), ("h", 2.0)]):
        await submit(store, run_id, "long", at=float(n), estimate=estimate)
    assert await store.claim_runs("prio", "w", TTL, limit=9) == ["b", "c", "a", "d"]
    assert await store.claim_runs("long", "w", TTL, limit=9) == ["g", "h", "e", "f"]


async def test_a_runs_priority_orders_every_queue_fifo_among_equals(store: RunStore) -> None:
    # No queue declared: a plain fifo queue still hands out higher priorities first.
    for n, (run_id, priority) in enumerate([("a", 0), ("b", 5), ("c", 5), ("d", -1)]):
        await submit(store, run_id, "plain", at=float(n), priority=priority)
    await store.declare_queue(Queue("long", order="lpt"))
    for n, (run_id, priority, estimate) in enumerate(
        [("e", 0, 50.0), ("f", 1, 1.0), ("g", 1, 9.0), ("h", 0, None)]
    ):
        await submit(store, run_id, "long", at=float(n), priority=priority, estimate=estimate)
    assert await store.claim_runs("plain", "w", TTL, limit=9) == ["b", "c", "a", "d"]
    assert await store.claim_runs("long", "w", TTL, limit=9) == ["g", "f", "e", "h"]


async def test_concurrency_is_global_and_a_slot_frees_when_a_run_ends(backend: Backend) -> None:
    store = backend.store
    await store.declare_queue(Queue("q", concurrency=2))
    await submit_many(store, ["r1", "r2", "r3", "r4"])
    assert await store.claim_runs("q", "w1", TTL, limit=5) == ["r1", "r2"]
    assert await store.claim_runs("q", "w2", TTL, limit=5) == []
    await finish(store, "r1")
    assert await store.claim_runs("q", "w2", TTL, limit=5) == ["r3"]
    # A run suspended on a gate gives its slot back; being resumed (leased), it holds one.
    token = (await store.get_run("r2")).lease_token
    await store.commit("r2", token, Harvest(state_json="{}", status=RunStatus.SUSPENDED))
    await store.release_lease("r2", "w1", token)
    assert await store.claim_runs("q", "w2", TTL, limit=5) == ["r4"]
    await store.acquire_lease("r2", "w3", TTL)
    await finish(store, "r3", "w2")
    assert await store.claim_runs("q", "w2", TTL, limit=5) == []  # r2 (leased) and r4 hold both


async def test_the_rate_limit_is_a_sliding_window_of_claims(backend: Backend) -> None:
    store = backend.store
    await store.declare_queue(Queue("q", limit=2, period=10.0))
    await submit_many(store, [f"r{i}" for i in range(5)])
    assert await store.claim_runs("q", "w1", TTL, limit=5) == ["r0", "r1"]
    await finish(store, "r0")
    assert await store.claim_runs("q", "w1", TTL, limit=5) == []  # finished, still started
    backend.clock.advance(10.5)
    assert await store.claim_runs("q", "w2", TTL, limit=5) == ["r2", "r3"]


async def test_a_partition_starts_one_run_at_a_time_in_submit_order(store: RunStore) -> None:
    await store.declare_queue(Queue("q", order="priority"))
    await submit(store, "a1", at=1.0, partition="A")
    await submit(store, "b1", at=2.0, partition="B")
    await submit(store, "a2", at=3.0, partition="A", priority=9)  # priority does not jump A's line
    await submit(store, "free", at=4.0)
    assert await store.claim_runs("q", "w", TTL, limit=9) == ["a1", "b1", "free"]
    assert await store.claim_runs("q", "w", TTL, limit=9) == []
    await finish(store, "a1", "w")
    assert await store.claim_runs("q", "w", TTL, limit=9) == ["a2"]


async def test_a_partitions_runs_start_in_submit_order_whatever_their_priority(
    store: RunStore,
) -> None:
    """With room for two runs of a partition, its later run of a higher priority still starts
    after its earlier one: a keyed run goes by its partition's first run's priority (W2)."""
    await store.declare_queue(Queue("q", order="priority", partition_concurrency=2))
    await submit(store, "a1", at=1.0, partition="A")
    await submit(store, "a2", at=2.0, partition="A", priority=9)
    await submit(store, "b1", at=3.0, partition="B", priority=5)
    claimed = [await store.claim_runs("q", "w", TTL, limit=1) for _ in range(4)]
    assert claimed == [["b1"], ["a1"], ["a2"], []]


async def test_runs_submitted_at_one_moment_take_their_partitions_turns_by_id(
    store: RunStore,
) -> None:
    await store.declare_queue(Queue("q", partition_concurrency=3))
    for run_id in ("c", "a", "d", "b"):
        await submit(store, run_id, at=1.0, partition="A")
    assert await store.claim_runs("q", "w", TTL, limit=2) == ["a", "b"]
    assert await store.claim_runs("q", "w", TTL, limit=5) == ["c"]  # room for three
    await finish(store, "b", "w")
    assert await store.claim_runs("q", "w", TTL, limit=5) == ["d"]


async def test_a_suspended_run_blocks_its_partition(store: RunStore) -> None:
    await submit(store, "a1", at=1.0, partition="A")
    await submit(store, "a2", at=2.0, partition="A")
    assert await store.claim_runs("q", "w", TTL, limit=9) == ["a1"]
    token = (await store.get_run("a1")).lease_token
    await store.commit("a1", token, Harvest(state_json="{}", status=RunStatus.SUSPENDED))
    await store.release_lease("a1", "w", token)
    assert await store.claim_runs("q", "w", TTL, limit=9) == []


async def test_a_lone_partition_waits_behind_at_most_one_run_of_a_busy_one(
    backend: Backend,
) -> None:
    """A port of DBOS Transact's partition fairness test (W2).

    DBOS enqueues a long backlog on one partition, then one run on another,
    and requires the lone run to start before half the backlog is done. Here
    the bar is the clause's: it waits behind at most one run of each other
    partition, whether the queue serves one run at a time or ten.
    """
    store = backend.store
    for slots in (1, 10):
        queue = f"fair{slots}"
        await store.declare_queue(Queue(queue, concurrency=slots, partition_concurrency=slots))
        busy = [f"{queue}-busy{n:03}" for n in range(120)]
        for n, run_id in enumerate(busy):
            await submit(store, run_id, queue, at=float(n), partition="busy")
        await submit(store, f"{queue}-lone", queue, at=200.0, partition="lone")
        started: list[str] = []
        while f"{queue}-lone" not in started:
            claimed = await store.claim_runs(queue, "w", TTL, limit=slots)
            assert claimed, "the queue stalled"
            started.extend(claimed)
            backend.clock.advance(1.0)
            await finish(store, claimed[0], "w")  # one run ends per step
        ahead = started.index(f"{queue}-lone")
        # With ten slots the first claim starts ten at once: one busy run goes
        # first (it was submitted first), the lone run takes the second slot.
        assert ahead <= 1, f"{slots} slot(s): the lone run waited behind {ahead} busy runs"


async def test_partitions_take_turns_among_three(store: RunStore) -> None:
    await store.declare_queue(Queue("q", concurrency=1, partition_concurrency=5))
    for n in range(4):
        await submit(store, f"a{n}", at=float(n), partition="A")
        await submit(store, f"b{n}", at=float(n) + 0.5, partition="B")
    await submit(store, "c0", at=10.0, partition="C")
    order = []
    for _ in range(9):
        (run_id,) = await store.claim_runs("q", "w", TTL, limit=1)
        order.append(run_id)
        await finish(store, run_id, "w")
    assert order.index("c0") <= 2  # behind at most one of A and one of B
    assert [r for r in order if r[0] == "a"] == ["a0", "a1", "a2", "a3"]  # submit order per key
    assert [r for r in order if r[0] == "b"] == ["b0", "b1", "b2", "b3"]


async def test_partition_concurrency_and_rate_limit(backend: Backend) -> None:
    store = backend.store
    await store.declare_queue(Queue("q", partition_concurrency=2, partition_limit=3, period=10.0))
    for n in range(5):
        await submit(store, f"a{n}", at=float(n), partition="A")
    await submit(store, "b0", at=9.0, partition="B")
    assert await store.claim_runs("q", "w", TTL, limit=9) == ["a0", "b0", "a1"]
    assert await store.claim_runs("q", "w", TTL, limit=9) == []  # two of A run
    await finish(store, "a0", "w")
    assert await store.claim_runs("q", "w", TTL, limit=9) == ["a2"]
    await finish(store, "a1", "w")
    await finish(store, "a2", "w")
    assert await store.claim_runs("q", "w", TTL, limit=9) == []  # A started 3 within 10 s
    backend.clock.advance(10.5)
    assert await store.claim_runs("q", "w", TTL, limit=9) == ["a3", "a4"]


async def test_a_paused_queue_hands_out_nothing_until_resumed(backend: Backend) -> None:
    store = backend.store
    await store.declare_queue(Queue("q", concurrency=5))
    await store.pause_queue("q")
    await store.pause_queue("q")  # idempotent
    await submit_many(store, ["r1", "r2"])  # submits are still stored
    await store.declare_queue(Queue("q", concurrency=3))  # a declaration keeps the pause
    assert await store.claim_runs("q", "w", TTL, limit=5) == []
    stats = {s.name: s for s in await store.queue_stats(backend.clock.now)}
    assert (stats["q"].paused, stats["q"].queued, stats["q"].queue) == (
        True, 2, Queue("q", concurrency=3),
    )  # fmt: skip
    assert await store.resume_queue("q") is True
    assert await store.resume_queue("q") is False
    assert await store.claim_runs("q", "w", TTL, limit=5) == ["r1", "r2"]
    assert not {s.name: s for s in await store.queue_stats(backend.clock.now)}["q"].paused
    await store.pause_queue("never-declared")  # declared with the defaults, paused
    assert Queue("never-declared") in await store.queues()


async def test_a_queue_is_deleted_only_when_empty(store: RunStore) -> None:
    await store.declare_queue(Queue("q", concurrency=2))
    await store.pause_queue("q")
    await submit_many(store, ["r1"])
    with pytest.raises(QueueNotEmpty, match="'q' still holds 1 live run") as refused:
        await store.delete_queue("q")
    assert (refused.value.queue, refused.value.live) == ("q", 1)
    assert await store.queues() == [Queue("q", concurrency=2)]  # nothing changed
    await store.resume_queue("q")
    assert await store.claim_runs("q", "w", TTL, limit=1) == ["r1"]
    with pytest.raises(QueueNotEmpty):
        await store.delete_queue("q")  # running is live
    await finish(store, "r1", "w")
    assert await store.delete_queue("q") is True
    assert await store.delete_queue("q") is False
    assert await store.queues() == []
    assert (await store.get_run("r1")).queue_name == "q"  # finished runs keep their queue
    with pytest.raises(ValueError, match="queue"):
        await store.delete_queue("bad\x00name")


async def test_claims_refuse_bad_names_before_touching_the_store(store: RunStore) -> None:
    with pytest.raises(ValueError, match="queue"):
        await store.claim_runs("q\x00", "w", TTL, limit=1)
    with pytest.raises(ValueError, match="owner"):
        await store.claim_runs("q", "w\x00", TTL, limit=1)
    with pytest.raises(ValueError, match="ttl"):
        await store.claim_runs("q", "w", 0.0, limit=1)
    assert await store.claim_runs("q", "w", TTL, limit=0) == []


async def test_racing_claimers_on_two_store_objects_never_share_a_run(backend: Backend) -> None:
    if backend.sibling is None:
        pytest.skip("a memory store is one process's own")
    await submit_many(backend.store, [f"r{i:03d}" for i in range(60)])
    async with backend.sibling() as other:

        async def drain(store: RunStore, owner: str) -> list[str]:
            got: list[str] = []
            while batch := await store.claim_runs("q", owner, TTL, limit=3):
                got += batch
            return got

        mine, theirs = await asyncio.gather(drain(backend.store, "w1"), drain(other, "w2"))
    assert sorted(mine + theirs) == [f"r{i:03d}" for i in range(60)]
    assert not set(mine) & set(theirs)


# --- answers ------------------------------------------------------------------------


async def suspended_with_answer(store: RunStore, run_id: str, queue: str = "q") -> str:
    """A claimed run suspended on a question that has been answered; returns the question id."""
    await submit(store, run_id, queue, at=1.0)
    (claimed,) = await store.claim_runs(queue, "w0", TTL, limit=1)
    token = (await store.get_run(claimed)).lease_token
    question = QuestionRow(
        question_id=f"q-{run_id}", run_id=run_id, node_id="gate", visit=1, turn=1,
        prompt_json='"?"', created_at=1.0,
    )  # fmt: skip
    harvest = Harvest(state_json="{}", status=RunStatus.SUSPENDED, questions=(question,))
    await store.commit(run_id, token, harvest)
    await store.release_lease(run_id, "w0", token)
    await store.answer(question.question_id, '"yes"')
    return question.question_id


async def test_an_answered_run_is_leased_to_one_claimer(store: RunStore) -> None:
    question_id = await suspended_with_answer(store, "r1")
    (row,) = await store.claim_answers("w1", TTL, limit=5)
    assert (row.question_id, row.status) == (question_id, QuestionStatus.ANSWERED)
    assert (await store.get_run("r1")).lease_owner == "w1"
    assert await store.claim_answers("w2", TTL, limit=5) == []
    token = (await store.get_run("r1")).lease_token
    await store.release_lease("r1", "w1", token)  # not applied (the worker died, say)
    assert [r.question_id for r in await store.claim_answers("w2", TTL, limit=5)] == [question_id]


async def test_an_answer_waits_for_a_slot_of_its_queue(store: RunStore) -> None:
    await store.declare_queue(Queue("q", concurrency=1))
    await suspended_with_answer(store, "r1")
    await submit(store, "busy", at=2.0)
    assert await store.claim_runs("q", "w1", TTL, limit=1) == ["busy"]
    assert await store.claim_answers("w2", TTL, limit=5) == []
    await finish(store, "busy", "w1")
    assert [r.run_id for r in await store.claim_answers("w2", TTL, limit=5)] == ["r1"]


# --- cancelling ---------------------------------------------------------------------


async def test_cancelling_a_queued_run_is_immediate_and_final(store: RunStore) -> None:
    await submit_many(store, ["r1", "r2"])
    assert await store.request_cancel("r1") is RunStatus.CANCELLED
    record = await store.get_run("r1")
    assert (record.status, record.finished_at is not None) == (RunStatus.CANCELLED, True)
    assert await store.claim_runs("q", "w", TTL, limit=5) == ["r2"]
    assert await store.request_cancel("r1") is RunStatus.CANCELLED  # idempotent


async def test_cancelling_a_running_run_asks_its_driver(backend: Backend) -> None:
    store = backend.store
    await submit_many(store, ["r1"])
    await store.claim_runs("q", "w1", TTL, limit=1)
    assert await store.cancel_requests("w1") == []
    assert await store.request_cancel("r1") is RunStatus.RUNNING
    first = (await store.get_run("r1")).cancel_requested_at
    assert first == backend.clock.now
    backend.clock.advance(5)
    await store.request_cancel("r1")
    assert (await store.get_run("r1")).cancel_requested_at == first  # the first request counts
    assert await store.cancel_requests("w1") == ["r1"]
    assert await store.cancel_requests("w2") == []
    await finish(store, "r1")
    assert await store.request_cancel("r1") is RunStatus.COMPLETED  # finished: left alone
    with pytest.raises(RunNotFound, match="'nope'"):
        await store.request_cancel("nope")


# --- queues, workers, durations ---------------------------------------------------------


async def test_declared_queues_workers_and_stats(backend: Backend) -> None:
    store = backend.store
    now = backend.clock.now
    await store.declare_queue(Queue("q", concurrency=3, limit=5, period=2.0, order="lpt"))
    await store.declare_queue(Queue("q", concurrency=4))  # a later declaration replaces it
    await store.declare_queue(Queue("empty"))
    assert await store.queues() == [Queue("empty"), Queue("q", concurrency=4)]
    await submit_many(store, ["r1", "r2", "r3"])
    await submit(store, "x", "other", at=0.5)
    await store.claim_runs("q", "w1", TTL, limit=1)
    seen = WorkerRow(worker_id="w1", queues=("q",), concurrency=8, started_at=now, seen_at=now)
    await store.worker_seen(seen)
    stale = WorkerRow(worker_id="w0", queues=("q",), concurrency=8, started_at=0, seen_at=0)
    await store.worker_seen(stale)
    assert [w.worker_id for w in await store.workers()] == ["w0", "w1"]
    stats = {s.name: s for s in await store.queue_stats(now, window=60.0)}
    assert set(stats) == {"empty", "other", "q"}
    q = stats["q"]
    assert (q.queued, q.running, q.suspended, q.started, q.workers) == (2, 1, 0, 1, 1)
    assert (q.queue, q.oldest_queued_at) == (Queue("q", concurrency=4), 2.0)
    assert (stats["empty"].queued, stats["empty"].oldest_queued_at) == (0, None)
    assert stats["other"].queue is None
    await store.forget_worker("w0")
    assert await store.workers() == [seen]


async def test_registered_graphs_are_listed_by_name_the_version_deployed_last_first(
    store: RunStore,
) -> None:
    for fingerprint, ref, at in (("fp1", "m:g", 1.0), ("fp2", "m:g", 5.0), ("fp1", "n:g", 9.0)):
        await store.register_graph(
            GraphRow(name="g", fingerprint=fingerprint, graph_ref=ref, registered_at=at)
        )
    await store.register_graph(GraphRow(name="h", fingerprint="x", graph_ref=None, registered_at=2))
    # fp1 registered again (a worker of that version restarting) takes the new reference
    # and keeps the time it was first registered: fp2 stays the version deployed last.
    assert await store.graphs_named("g") == [
        GraphRow(name="g", fingerprint="fp2", graph_ref="m:g", registered_at=5.0),
        GraphRow(name="g", fingerprint="fp1", graph_ref="n:g", registered_at=1.0),
    ]  # fmt: skip
    assert await store.graphs_named("nobody") == []
    with pytest.raises(ValueError, match="graph_name"):
        await store.graphs_named("a\x00b")


async def test_a_new_version_is_the_newest_whatever_the_registering_hosts_clock(
    store: RunStore,
) -> None:
    """A version new to the store, registered from a host whose clock is behind, is still
    the one deployed last (its time is put just after the newest of its name)."""
    for fingerprint, at in (("fp1", 100.0), ("fp2", 40.0), ("fp2", 500.0), ("fp3", 100.0)):
        await store.register_graph(
            GraphRow(name="g", fingerprint=fingerprint, graph_ref="m:g", registered_at=at)
        )
    rows = await store.graphs_named("g")
    assert [r.fingerprint for r in rows] == ["fp3", "fp2", "fp1"]
    assert rows[2].registered_at == 100.0 < rows[1].registered_at < rows[0].registered_at < 101


def worker(worker_id: str, seen: float, queues: tuple[str, ...] = ("q",)) -> WorkerRow:
    return WorkerRow(worker_id=worker_id, queues=queues, concurrency=4, started_at=seen,
                     seen_at=seen, dead_after=30.0)  # fmt: skip


async def test_a_pulse_reports_the_worker_and_what_is_worth_a_look(backend: Backend) -> None:
    """The idle heartbeat: one call, the report written, each thing probed, and when the next
    thing no change announces comes due (W3, W7)."""
    store, now = backend.store, backend.clock.now
    me = worker("box:1:0:a", now)
    assert await store.pulse(me) == Pulse()  # nothing to do, nothing coming
    assert await store.workers() == [me]
    await submit(store, "r1", "q", at=1.0)
    await submit(store, "r2", "q", at=2.0)
    await submit(store, "later", "q", at=3.0, not_before=now + 50)
    await submit(store, "elsewhere", "other", at=4.0, not_before=now + 5)
    assert await store.claim_runs("q", "box:1:0:a", TTL, limit=1) == ["r1"]
    await store.request_cancel("r1")
    # r1's lease expires first; the delayed run of another queue is not this worker's.
    assert await store.pulse(me) == Pulse(kinds=frozenset({"submit", "cancel"}), due_at=now + TTL)
    theirs = await store.pulse(worker("box:1:0:a", now, queues=("other",)))
    assert theirs == Pulse(kinds=frozenset({"submit", "cancel"}), due_at=now + 5)
    backend.clock.advance(TTL + 1)  # r1's lease expired: an orphan; the delayed run comes next
    pulse = await store.pulse(worker("box:1:0:a", backend.clock.now))
    assert "release" in pulse.kinds and pulse.due_at == now + 50


#: What a heartbeat (``pulse``) rewrites in a worker's row.
REPORTED = ("queues_json", "concurrency", "started_at", "seen_at", "running", "dead_after", "host")


async def test_no_index_covers_what_a_heartbeat_rewrites(backend: Backend) -> None:
    """W7: a report rewrites its row in place (Postgres: a HOT update, with room left on the
    page for it), so no index entry is written per heartbeat, nor left dead for scans."""
    if backend.execute is None:
        pytest.skip("a memory store has no indexes")
    if backend.name == "postgres":
        indexes = await backend.execute(
            "SELECT indexdef FROM pg_indexes WHERE schemaname = current_schema() "
            "AND tablename = 'workers'", (),
        )  # fmt: skip
        options = await backend.execute(
            "SELECT reloptions FROM pg_class WHERE oid = 'workers'::regclass", ()
        )
        assert options == [(["fillfactor=50"],)]
    else:
        indexes = await backend.execute(
            "SELECT sql FROM sqlite_master WHERE type = 'index' AND tbl_name = 'workers' "
            "AND sql IS NOT NULL", (),
        )  # fmt: skip
    assert indexes, "the ring of sessions reads workers by session"
    for (definition,) in indexes:
        assert not [c for c in REPORTED if c in definition], definition


#: The heartbeat of the release before sessions (W7), statement by statement: its workers
#: keep pulsing through a rolling deploy while this release's share the database.
PREVIOUS_PULSE = (
    (
        "INSERT INTO workers (worker_id, queues_json, concurrency, started_at, seen_at, "
        "running, dead_after, host) VALUES (?, ?, ?, ?, ?, ?, ?, ?) "
        "ON CONFLICT (worker_id) DO UPDATE SET queues_json = excluded.queues_json, "
        "concurrency = excluded.concurrency, started_at = excluded.started_at, "
        "seen_at = excluded.seen_at, running = excluded.running, "
        "dead_after = excluded.dead_after, host = excluded.host",
        ("old:1:0:a", '["q"]', 4, 1.0, 2.0, 0, 30.0, "old"),
    ),
    ("SELECT scope, due_at FROM worker_scans WHERE scope IN (?, ?)", ("*", "host:old")),
    (
        "INSERT INTO worker_scans (scope, due_at) VALUES (?, ?) ON CONFLICT (scope) DO NOTHING",
        ("*", 10.0),
    ),
    ("UPDATE worker_scans SET due_at = ? WHERE scope = ? AND due_at <= ?", (20.0, "*", 15.0)),
    (
        "SELECT worker_id FROM workers WHERE seen_at + dead_after < ? "
        "ORDER BY seen_at + dead_after LIMIT ?",
        (1.0, 10),
    ),
    ("SELECT worker_id FROM workers WHERE host = ? AND seen_at < ?", ("old", 1.0)),
)


async def test_the_previous_releases_heartbeat_runs_on_this_schema(backend: Backend) -> None:
    """A rolling deploy: the workers of the release before sessions pulse on this schema
    (the table of its scan turns is still there; the indexes it lost only slow it down)."""
    if backend.execute is None:
        pytest.skip("a memory store has no schema")
    async with backend.store.presence(worker("new:1:0:a", backend.clock.now)):
        for statement, values in PREVIOUS_PULSE:
            await backend.execute(statement.replace("?", backend.mark), values)
        assert {w.worker_id for w in await backend.store.workers()} == {"new:1:0:a", "old:1:0:a"}


async def test_a_pulse_says_when_a_waiting_run_passes_its_deadline(backend: Backend) -> None:
    """R6: a queued or suspended run's deadline comes due (``due_at``), then is ``overdue``;
    a finished run's deadline is no one's business (it is not even read)."""
    store, now = backend.store, backend.clock.now
    ended = dataclasses.replace(new_run("ended", at=1.0), deadline=now + 2)
    await store.submit_run(ended, Submission(queue="q"))
    await store.claim_runs("q", "w1", TTL, limit=1)
    await finish(store, "ended")
    waiting = dataclasses.replace(new_run("waiting", at=2.0), deadline=now + 20)
    await store.submit_run(waiting, Submission(queue="q"))
    me = worker("box:1:0:a", now, queues=("none",))
    assert await store.pulse(me) == Pulse(due_at=now + 20)
    backend.clock.advance(21)
    assert await store.pulse(me) == Pulse(overdue=True)
    assert await store.overdue_runs(backend.clock.now, limit=10) == ["waiting"]


async def test_run_durations_feed_the_estimator(backend: Backend) -> None:
    store = backend.store
    await submit(store, "r1", at=1.0, cost=2.0)
    await submit(store, "r2", at=2.0)
    await store.claim_runs("q", "w1", TTL, limit=2)
    token = (await store.get_run("r1")).lease_token
    finished = backend.clock.now + 3.0
    await store.commit(
        "r1", token, Harvest(state_json="{}", status=RunStatus.COMPLETED, finished_at=finished)
    )
    assert await store.run_durations("fp") == [(2.0, 3.0)]
    assert await store.run_durations("other") == []


# --- wake-ups ---------------------------------------------------------------------------


async def until_kinds(feed: ChangeFeed, wanted: set[str], deadline: float = 10.0) -> set[str]:
    """Kinds the feed reports until all of ``wanted`` were seen (or the deadline passed)."""
    seen: set[str] = set()
    end = time.monotonic() + deadline
    while not wanted <= seen and time.monotonic() < end:
        seen |= await feed.wait(0.5)
    return seen


async def test_a_change_feed_reports_writes_made_elsewhere(backend: Backend) -> None:
    store = backend.store
    writer_cm = backend.sibling() if backend.sibling is not None else None
    async with store.changes() as feed:
        writer = store if writer_cm is None else await writer_cm.__aenter__()
        try:
            question_id = await suspended_with_answer(writer, "r1")
            assert {"submit", "answer", "release"} <= await until_kinds(
                feed, {"submit", "answer", "release"}
            )
            await writer.request_cancel("r1")
            assert "cancel" in await until_kinds(feed, {"cancel"})
        finally:
            if writer_cm is not None:
                await writer_cm.__aexit__(None, None, None)
    assert question_id == "q-r1"


async def test_a_quiet_feed_waits_out_its_timeout(store: RunStore) -> None:
    async with store.changes() as feed:
        await feed.wait(0.0)  # whatever the set-up left behind
        assert await feed.wait(0.05) == frozenset()


async def test_a_workers_graph_versions_are_kept_by_worker_and_replaced_whole(
    backend: Backend,
) -> None:
    """R3: each worker's registered graph versions, read by worker (none registered:
    absent); a registration replaces the worker's earlier one; those of a worker whose
    row is gone are dropped by a later registration once an hour old, not sooner."""
    store, clock = backend.store, backend.clock
    seen = WorkerRow(
        worker_id="w1", queues=("kids",), concurrency=1, started_at=clock.now, seen_at=clock.now
    )
    await store.worker_seen(seen)
    await store.register_worker_graphs("w1", [("kid", "fp1"), ("family", "fp9")])
    await store.register_worker_graphs("w2", [("kid", "fp2")])  # no row of its own yet
    await store.register_worker_graphs("w3", [])
    both = {"w1": frozenset({("kid", "fp1"), ("family", "fp9")}), "w2": frozenset({("kid", "fp2")})}
    assert await store.worker_graphs(["w1", "w2", "w3", "w4"]) == both
    await store.register_worker_graphs("w1", [("kid", "fp3")])
    assert await store.worker_graphs(["w1"]) == {"w1": frozenset({("kid", "fp3")})}
    assert await store.worker_graphs([]) == {}
    clock.advance(3599.0)
    await store.register_worker_graphs("w5", [("kid", "fp3")])
    assert set(await store.worker_graphs(["w1", "w2"])) == {"w1", "w2"}  # w2 may still report
    clock.advance(2.0)
    await store.register_worker_graphs("w5", [("kid", "fp3")])
    assert set(await store.worker_graphs(["w1", "w2", "w5"])) == {"w1", "w5"}  # w1 has a row
    with pytest.raises(ValueError, match="worker_id"):
        await store.register_worker_graphs("a\x00b", [("kid", "fp")])
    with pytest.raises(ValueError, match="graph_name"):
        await store.register_worker_graphs("w1", [("a\x00b", "fp")])
    with pytest.raises(ValueError, match="pairs, got 'kid'"):
        await store.register_worker_graphs("w1", ["kid"])  # type: ignore[list-item]
