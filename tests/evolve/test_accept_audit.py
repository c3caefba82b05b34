"""The held-out gate (Beta posterior, rising bar) and the audit scheduler."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import tailrace.evolve as ev
from tailrace.evolve import FAST_MAX, Acceptance, AuditScheduler, prob_beats
from tailrace.evolve._audit import HEAP_CAP


def test_prob_beats_is_a_probability_and_antisymmetric():
    a, b = [1, 1, 0, 1], [0, 1, 0, 0]
    p = prob_beats(a, b)
    assert 0.5 < p < 1.0
    assert p + prob_beats(b, a) == pytest.approx(1.0, abs=1e-9)
    assert prob_beats(a, a) == pytest.approx(0.5, abs=1e-9)


def test_prob_beats_grows_with_evidence():
    small = prob_beats([1, 1, 1, 0], [1, 0, 0, 0])
    large = prob_beats([1, 1, 1, 0] * 8, [1, 0, 0, 0] * 8)
    assert large > small


def test_threshold_tightens_with_version_up_to_a_cap():
    acc = Acceptance(threshold=0.6, step=0.1, max_threshold=0.85)
    bars = [acc.threshold_at(v) for v in (1, 2, 3, 4, 10)]
    assert bars == pytest.approx([0.6, 0.7, 0.8, 0.85, 0.85])


def test_the_same_evidence_passes_early_and_fails_late():
    acc = Acceptance(threshold=0.6, step=0.1, max_threshold=0.95)
    cand, base = [1, 1, 1, 0, 1, 1], [1, 0, 1, 0, 1, 0]
    assert acc.decide(cand, base, version=1).accepted
    late = acc.decide(cand, base, version=5)
    assert not late.accepted and late.threshold == pytest.approx(1.0 - 0.05)


def test_acceptance_validates():
    with pytest.raises(ValueError):
        Acceptance(threshold=1.0)
    with pytest.raises(ValueError):
        Acceptance(step=-0.1)


def test_priority_is_blast_radius_times_uncertainty_over_trust():
    audit = AuditScheduler(initial_trust=0.5)
    assert audit.priority(4, 0.5, "a") == pytest.approx(4 * 0.5 / 0.5)
    audit.record(agreed=True, artifact_id="a")
    assert audit.priority(4, 0.5, "a") == pytest.approx(4 * 0.5 / 0.75)
    with pytest.raises(ValueError):
        audit.priority(1, 1.5, "a")


def test_force_oracle_on_wide_changes_or_low_trust():
    audit = AuditScheduler(initial_trust=1.0)
    assert not audit.force_oracle(FAST_MAX, "a")
    assert audit.force_oracle(FAST_MAX + 1, "a")
    audit.record(agreed=False, artifact_id="a")  # 1.0 -> 0.5
    assert audit.force_oracle(1, "a")
    assert not audit.force_oracle(1, "other")  # trust is per artifact


def test_trust_rises_by_a_quarter_capped_and_halves_on_disagreement():
    audit = AuditScheduler(initial_trust=0.5)
    assert audit.record(agreed=True, artifact_id="a") == 0.75
    assert audit.record(agreed=True, artifact_id="a") == 1.0
    assert audit.record(agreed=True, artifact_id="a") == 1.0
    assert audit.record(agreed=False, artifact_id="a") == 0.5
    assert audit.record(agreed=False, artifact_id="a") == 0.25
    assert (audit.comparisons, audit.agreements) == (5, 3)


def test_collect_false_keeps_nothing():
    audit = AuditScheduler(collect=False)
    assert audit.submit("x", blast_radius=2, uncertainty=0.5, artifact_id="a") == 2.0
    assert len(audit) == 0 and audit.pop() is None


def test_collect_true_pops_highest_priority_first():
    audit = AuditScheduler(collect=True, initial_trust=1.0)
    for i, (radius, unc) in enumerate([(1, 0.1), (5, 0.9), (2, 0.5)]):
        audit.submit(f"i{i}", blast_radius=radius, uncertainty=unc, artifact_id="a", payload=i)
    popped = [audit.pop() for _ in range(3)]
    assert [p.item_id for p in popped if p] == ["i1", "i2", "i0"]
    assert audit.pop() is None


def test_collect_heap_is_capped_and_reports_what_it_shed():
    audit = AuditScheduler(collect=True, initial_trust=1.0)
    for i in range(HEAP_CAP + 10):
        audit.submit(str(i), blast_radius=1, uncertainty=(i % 100) / 100, artifact_id="a")
    assert len(audit) == HEAP_CAP == 4096
    assert audit.dropped == 10
    top = audit.pop()
    assert top is not None and top.uncertainty == pytest.approx(0.99)


def test_oracle_budget_is_enforced():
    audit = AuditScheduler(oracle_budget=2)
    assert [audit.spend_oracle() for _ in range(4)] == [True, True, False, False]
    assert (audit.oracle_used, audit.oracle_refused) == (2, 2)
    assert AuditScheduler().spend_oracle()


def test_fast_max_is_defined_in_exactly_one_place():
    package = Path(ev.__file__).parent
    definitions = [
        (path.name, line)
        for path in package.glob("*.py")
        for line in path.read_text().splitlines()
        if re.match(r"\s*FAST_MAX\s*(:[^=]*)?=", line)
    ]
    assert len(definitions) == 1, definitions
    numbers = [
        path.name
        for path in package.glob("*.py")
        if re.search(rf"blast_radius\s*>\s*{FAST_MAX}\b", path.read_text())
    ]
    assert not numbers, f"FAST_MAX's value is hard-coded in {numbers}"
