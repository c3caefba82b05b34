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


def _wide(radius: int, *tasks: str) -> Edit:
    return Edit(set={"solves": " ".join(tasks)} | {f"k{i}": "x" for i in range(radius - 1)})


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
    assert result.history[0].route == "oracle" and result.history[0].accepted


async def test_the_acceptance_test_is_a_wide_edit_s_free_audit():
    # Eight wide edits in eight rounds, each decided by the full held-out comparison:
    # that verdict is the audit, so none of them spends the oracle budget (none left).
    # The first solves everything; the others gain nothing (both layers reject them).
    wides = [_wide(FAST_MAX + 1 + i, *(HELD if i == 0 else ["h0"])) for i in range(8)]
    audit = AuditScheduler(initial_trust=1.0, oracle_budget=0)
    result = await _run(wides, audit)
    assert [s.route for s in result.history] == ["oracle"] * 8
    assert [s.accepted for s in result.history] == [True] + [False] * 7
    assert all(s.cheap_agreed for s in result.history) and result.trust["artifact"] == 1.0
    assert result.audits == 0 and audit.oracle_used == 0 and result.oracle_refused == 0
    assert sum(s.audits for s in result.history) == 0 and len(audit) == 0
    assert result.stop_reason == "budget" and result.held_out == 1.0


async def test_with_the_budget_spent_forced_decisions_are_refused_and_the_loop_stops():
    audit = AuditScheduler(initial_trust=0.5, oracle_budget=0)
    result = await _run([solves("h0", "h1"), solves("h1")], audit)
    assert [s.route for s in result.history] == ["refused"]
    assert result.commits == 0 and not result.history[0].accepted
    # Trust is under the gate and cannot be measured any more: nothing could merge.
    assert result.stop_reason == "oracle_budget"
    assert result.oracle_refused == 1 and result.audits == 0


async def test_with_the_budget_spent_a_trusted_layer_still_judges_wide_and_narrow_edits():
    wide = Edit(set={f"k{i}": "x" for i in range(FAST_MAX + 1)})  # gains nothing
    audit = AuditScheduler(initial_trust=1.0, oracle_budget=0)
    result = await _run([wide, solves("h0", "h1")], audit)
    assert [s.route for s in result.history] == ["oracle", "cheap"]
    assert [s.accepted for s in result.history] == [False, True]
    assert result.stop_reason == "budget" and result.entries == {"solves": "h0 h1"}
    assert result.oracle_refused == 0 and audit.oracle_used == 0


async def test_a_queued_audit_merges_a_refused_edit_once_the_budget_allows():
    # An untrusted layer with no budget refuses the edit and stops; the scheduler
    # keeps it queued, and the next loop given a budget buys its audit.
    audit = AuditScheduler(initial_trust=0.5, oracle_budget=0)
    refused = await _run([solves("h1", "h2")], audit)
    assert [s.route for s in refused.history] == ["refused"] and len(audit) == 1
    assert refused.stop_reason == "oracle_budget" and refused.commits == 0
    audit.oracle_budget = 2  # one for the next loop's own decision, one for the audit
    result = await _run([Edit(set={"unrelated": "z"})], audit)
    assert [s.route for s in result.history] == ["oracle"]
    assert result.history[0].audits == 1 and result.commits == 1 and len(audit) == 0
    [reversal] = result.reversals
    assert reversal["kind"] == "reject_overturned"
    assert reversal["edit"]["set"] == {"solves": "h1 h2"}
    assert result.entries == {"solves": "h1 h2"} and audit.oracle_used == 2


async def test_the_budget_buys_the_highest_priority_audit_first():
    audit = AuditScheduler(initial_trust=0.5, oracle_budget=0)
    narrower = _wide(1, "h1")
    wider = _wide(FAST_MAX, "h1", "h2")  # higher priority
    for edit in (narrower, wider):  # each refused by its own loop, both queued
        refused = await _run([edit], audit)
        assert [s.route for s in refused.history] == ["refused"]
    assert len(audit) == 2
    audit.oracle_budget = 2  # the next loop's own decision, then one audit
    result = await _run([Edit(set={"unrelated": "z"})], audit)
    [reversal] = result.reversals
    assert reversal["edit"]["set"] == wider.set  # blast_radius x uncertainty / trust
    assert audit.oracle_used == 2 and result.audits == 2
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
