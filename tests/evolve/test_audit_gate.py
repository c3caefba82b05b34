"""The audit scheduler in the loop: routing, trust, the oracle budget, queued audits, reversals.

A scripted domain makes every verdict known in advance. Eight tasks, half
held out: ``h0`` is the ranking subset (``rank_size=1``), ``h1..h3`` the rest.
The artifact's entries say which held-out tasks it solves: an entry
``"solves"`` lists them (``"h0 h2"``), so an edit's cheap verdict (on ``h0``)
and its full verdict (on all four) are whatever the test writes. One worker,
one proposal per round, one sweep per round: the sync loop is deterministic.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tailrace.evolve import FAST_MAX, AuditScheduler, Edit, EvolutionResult, Task, evolve

HELD = ["h0", "h1", "h2", "h3"]


def _tasks() -> list[Task]:
    train = [Task(id=f"r{i}", prompt="") for i in range(4)]
    return [*train, *(Task(id=h, prompt="") for h in HELD)]


def _reward(task: Task, output: str) -> float:
    solved = output.split("solves: ", 1)[-1].split() if "solves: " in output else []
    return 1.0 if task.id in solved else 0.0


def _proposer(edits: list[Edit]) -> object:
    queue: Iterator[Edit] = iter(edits)

    def propose(rendered: str, task: Task, output: str, value: float) -> Edit | None:
        return next(queue, None)

    return propose


async def _run(edits: list[Edit], audit: AuditScheduler, **options: object) -> EvolutionResult:
    settings: dict[str, object] = {"rank_size": 1, "artifact": {"solves": ""}, **options}
    return await evolve(
        _tasks(),
        _reward,
        run=lambda rendered, task: rendered,
        propose=_proposer(edits),
        held_out_frac=0.5,
        workers=1,
        max_candidates=1,
        max_rollouts=len(edits),
        audit=audit,
        **settings,  # type: ignore[arg-type]
    )


def solves(*tasks: str) -> Edit:
    return Edit(set={"solves": " ".join(tasks)})


async def test_untrusted_cheap_layer_goes_to_the_oracle_until_agreement_earns_trust():
    audit = AuditScheduler(initial_trust=0.5)
    edits = [solves("h0", "h2"), solves("h0", "h1", "h2")]
    result = await _run(edits, audit, rank_size=2)  # the subset: h0, h1
    # Sweep 1: trust 0.5 < 0.75, so the oracle decides (and agrees: +0.25).
    # Sweep 2: trust 0.75, one key: the cheap layer decides; the merge is measured and agrees.
    assert [s.route for s in result.history] == ["oracle", "cheap"]
    assert [s.accepted for s in result.history] == [True, True]
    assert [s.cheap_agreed for s in result.history] == [True, True]
    assert result.audits == 1 and audit.oracle_used == 1  # only the forced decision was paid
    assert result.trust == {"artifact": 1.0} and result.audit_trust == 1.0
    assert result.reversals == () and result.commits == 2


async def test_a_wide_edit_goes_to_the_oracle_even_when_trusted():
    wide = Edit(set={f"k{i}": "x" for i in range(FAST_MAX)} | {"solves": "h0 h1"})
    assert wide.blast_radius == FAST_MAX + 1
    result = await _run([wide], AuditScheduler(initial_trust=1.0))
    assert result.history[0].route == "oracle" and result.audits == 1


async def test_with_the_budget_spent_forced_decisions_are_refused_and_the_loop_stops():
    audit = AuditScheduler(initial_trust=0.5, oracle_budget=0)
    result = await _run([solves("h0", "h1"), solves("h1")], audit)
    assert [s.route for s in result.history] == ["refused"]
    assert result.commits == 0 and not result.history[0].accepted
    # Trust is under the gate and cannot be measured any more: nothing could merge.
    assert result.stop_reason == "oracle_budget"
    assert result.oracle_refused == 1 and result.audits == 0


async def test_with_the_budget_spent_a_trusted_layer_still_merges_narrow_edits_only():
    wide = Edit(set={f"k{i}": "x" for i in range(FAST_MAX + 1)})
    audit = AuditScheduler(initial_trust=1.0, oracle_budget=0)
    result = await _run([wide, solves("h0", "h1")], audit)
    assert [s.route for s in result.history] == ["refused", "cheap"]
    assert [s.accepted for s in result.history] == [False, True]
    assert result.stop_reason == "budget" and result.entries == {"solves": "h0 h1"}


async def test_a_cheap_acceptance_the_full_set_contradicts_is_not_merged():
    # The head solves h1 h2 h3; the edit is better on the ranking subset (h0), worse on the rest.
    first = {"solves": "h1 h2 h3"}
    result = await _run([solves("h0")], AuditScheduler(initial_trust=1.0), artifact=first)
    [sweep] = result.history
    assert sweep.route == "cheap" and not sweep.accepted and sweep.reversed
    assert sweep.cheap_agreed is False and sweep.version == 1
    [reversal] = result.reversals
    assert reversal["kind"] == "accept_overturned" and reversal["edit"]["set"] == {"solves": "h0"}
    assert reversal["version"] is None  # nothing was merged
    assert result.entries == first and result.commits == 0
    assert result.trust["artifact"] == 0.5  # a disagreement halves trust


async def test_an_edit_the_subset_cannot_see_is_escalated_to_the_full_set_and_merged():
    # Invisible on the subset (h0 unsolved either way), better on the rest: the
    # subset never vetoes, the full comparison decides, free of the oracle budget.
    result = await _run([solves("h1", "h2")], AuditScheduler(initial_trust=1.0))
    [sweep] = result.history
    assert sweep.route == "escalated" and sweep.accepted and sweep.audits == 0
    assert sweep.version == 2 and result.commits == 1
    [reversal] = result.reversals
    assert reversal["kind"] == "reject_overturned" and reversal["version"] == 2
    assert result.audits == 0 and result.trust["artifact"] == 0.5


def _wide(radius: int, *tasks: str) -> Edit:
    return Edit(set={"solves": " ".join(tasks)} | {f"k{i}": "x" for i in range(radius - 1)})


async def test_a_queued_audit_merges_a_refused_edit_once_the_budget_allows():
    audit = AuditScheduler(initial_trust=1.0, oracle_budget=0)
    wide = _wide(FAST_MAX + 1, "h1", "h2")

    def progress(p: object) -> None:
        if len(audit) == 1:  # refused and queued: now the budget buys its audit
            audit.oracle_budget = 1

    result = await _run([wide, Edit(set={"unrelated": "z"})], audit, progress=progress)
    assert [s.route for s in result.history] == ["refused", "escalated"]
    assert result.history[1].audits == 1 and result.commits == 1
    [reversal] = result.reversals
    assert reversal["kind"] == "reject_overturned" and reversal["edit"]["set"] == wide.set
    assert result.audits == 1 and audit.oracle_used == 1


async def test_the_budget_buys_the_highest_priority_audit_first():
    audit = AuditScheduler(initial_trust=1.0, oracle_budget=0)
    narrower = _wide(FAST_MAX + 1, "h1")
    wider = _wide(FAST_MAX + 3, "h1", "h2")  # higher priority
    edits = [narrower, wider, Edit(set={"unrelated": "z"})]

    def progress(p: object) -> None:
        if len(audit) == 2:  # both refusals queued: now the budget buys one audit
            audit.oracle_budget = 1

    result = await _run(edits, audit, progress=progress)
    [reversal] = result.reversals
    assert reversal["edit"]["set"] == wider.set  # blast_radius x uncertainty / trust
    assert audit.oracle_used == 1 and result.audits == 1
    remaining = audit.pop()
    assert remaining is not None and remaining.blast_radius == narrower.blast_radius


@pytest.mark.parametrize("budget", [None, 3])
async def test_audits_bought_never_exceed_the_budget(budget):
    edits = [solves(*HELD[i : i + 2]) for i in range(3)] * 2
    audit = AuditScheduler(initial_trust=1.0, oracle_budget=budget)
    result = await _run(edits, audit, audits_per_sweep=2)
    assert result.audits == audit.oracle_used
    if budget is not None:
        assert result.audits <= budget
