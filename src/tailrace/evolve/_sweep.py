"""The merge sweep: rank candidates cheaply, route the best through the audit scheduler, commit.

A sweep applies each pending edit to its parent (the head, or with Pareto
selection the pool member its rollout rendered), keeps the ``max_candidates``
that most rollouts proposed, scores them on the ranking subset of the
held-out tasks, and takes the one that gains most over its parent there
(ties: the most proposed, then the first given). That candidate is *routed* by the
:class:`~tailrace.evolve.AuditScheduler`:

- to the **oracle** (the full held-out evaluation) when the edit is wider
  than ``FAST_MAX`` keys or trust in the cheap layer is under 0.75; the full
  verdict decides, and comparing it with the cheap verdict updates trust. A
  wide edit's audit is that verdict of the acceptance test (agentdescent's
  rule): free. An untrusted cheap layer's decision takes one call from
  ``oracle_budget``;
- with the budget spent, an untrusted decision is **refused** (not merged: an
  untrusted change never lands unchecked) and queued for audit with
  priority ``blast_radius x uncertainty / trust``; nothing can merge any more
  then, and the loop stops (``"oracle_budget"``);
- otherwise the cheap verdict on the subset may pass the candidate early
  (route ``"cheap"``) but never veto it: a candidate it does not pass is
  **escalated** to the full comparison (route ``"escalated"``), because a
  small subset often cannot see a gain the full set does. Either way the
  candidate is scored on the rest of the held-out set, free of the oracle
  budget (``target``, ``patience`` and the learning curve read the head's
  full score), and that full verdict decides. It is the oracle's verdict too,
  so it updates trust, and when it contradicts the subset it is a reversal;
  no audit re-buys it.

After its own decision, a sweep buys up to ``audits_per_sweep`` queued audits
(refused candidates), highest priority first, while the budget lasts; an
audit that finds a refused edit good merges it (a reversal too). The sweep's
evaluations stop at the ``max_seconds`` deadline; its commits, once decided,
are always made.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from ._accept import Verdict, mean, prob_beats
from ._audit import TRUST_FLOOR, AuditItem
from ._core import Evolution, first_error
from ._ledger import Version
from ._model import Artifact, Edit
from ._options import Proposal
from ._pool import Member
from ._result import Sweep

T = TypeVar("T")


@dataclass(frozen=True, slots=True, kw_only=True)
class Candidate:
    """An edit applied to its parent, with its rewards on the ranking subset."""

    edit: Edit
    parent: Member
    artifact: Artifact
    cheap: Sequence[float]


@dataclass(frozen=True, slots=True, kw_only=True)
class Judgement:
    """What a sweep decided about its best candidate."""

    candidate: Candidate
    candidates: int
    route: str
    cheap_verdict: Verdict
    verdict: Verdict
    full: Sequence[float] | None
    agreed: bool | None
    reversed: bool


async def sweep(evo: Evolution, proposals: Sequence[Proposal]) -> Sweep | None:
    """Judge ``proposals``, commit what passes, buy audits; None when nothing changes a parent."""
    base = evo.head
    judgement = await _by_deadline(evo, _judge(evo, proposals))
    if judgement is None:
        return None
    committed = await _apply(evo, judgement)
    bought = await _buy_audits(evo)
    _stop_if_nothing_can_merge(evo)
    assert base is not None and evo.head is not None
    record = Sweep(
        index=len(evo.history) + 1,
        base_version=base.version,
        candidates=judgement.candidates,
        accepted=committed,
        version=evo.head.version,
        probability=judgement.verdict.probability,
        threshold=judgement.verdict.threshold,
        held_out=evo.held_out_score,
        cheap_agreed=judgement.agreed,
        rollouts=evo.rollouts,
        elapsed=time.perf_counter() - evo.started,
        route=judgement.route,
        reversed=judgement.reversed,
        audits=bought,
        admitted=evo.pool is not None and judgement.verdict.accepted,
    )
    evo.history.append(record)
    evo.note_sweep(record.elapsed)
    evo.report()
    return record


async def _by_deadline(evo: Evolution, work: Awaitable[T]) -> T | None:
    """``await work`` unless the ``max_seconds`` deadline passes first (then stop, None)."""
    try:
        async with asyncio.timeout_at(evo.deadline):
            return await work
    except TimeoutError:
        evo.stop("max_seconds")
        return None


# -- judging ------------------------------------------------------------------------


async def _judge(evo: Evolution, proposals: Sequence[Proposal]) -> Judgement | None:
    candidates = await _ranked(evo, proposals)
    if not candidates:
        return None
    best = max(candidates, key=lambda c: _gain(evo, c))  # the first best wins ties
    evo.judged.add((best.parent.id, json.dumps(best.edit.to_dict(), sort_keys=True)))
    cheap_verdict = _cheap_verdict(evo, best)
    artifact_id = evo.ledger.artifact_id
    if evo.audit.force_oracle(best.edit.blast_radius, artifact_id):
        # A wide edit's audit is the acceptance test on the full held-out set, which
        # the decision runs anyway: free. Only an untrusted cheap layer costs a call.
        if evo.audit.trust(artifact_id) < TRUST_FLOOR:
            if not evo.audit.spend_oracle():
                _queue_for_audit(evo, best, cheap_verdict)  # bought when the budget allows
                return _judgement(best, candidates, "refused", cheap_verdict, cheap_verdict, None)
            evo.audits_bought += 1
        return await _full_decision(evo, best, candidates, "oracle", cheap_verdict)
    # The subset may pass a candidate early, never veto one: a rejection there is
    # an escalation to the full comparison, whose verdict is the audit too (free).
    route = "cheap" if cheap_verdict.accepted else "escalated"
    return await _full_decision(evo, best, candidates, route, cheap_verdict)


def _queue_for_audit(evo: Evolution, best: Candidate, cheap_verdict: Verdict) -> None:
    evo.audit.submit(
        f"sweep-{len(evo.history) + 1}",
        blast_radius=best.edit.blast_radius,
        uncertainty=1.0 - abs(2.0 * cheap_verdict.probability - 1.0),
        artifact_id=evo.ledger.artifact_id,
        payload=(best, cheap_verdict, _head_version(evo)),
    )


def _judgement(
    best: Candidate,
    candidates: Sequence[Candidate],
    route: str,
    cheap_verdict: Verdict,
    verdict: Verdict,
    full: Sequence[float] | None,
    agreed: bool | None = None,
    reversed_: bool = False,
) -> Judgement:
    return Judgement(
        candidate=best,
        candidates=len(candidates),
        route=route,
        cheap_verdict=cheap_verdict,
        verdict=verdict,
        full=full,
        agreed=agreed,
        reversed=reversed_,
    )


async def _full_decision(
    evo: Evolution,
    best: Candidate,
    candidates: Sequence[Candidate],
    route: str,
    cheap_verdict: Verdict,
) -> Judgement:
    """Score ``best`` on the rest of the held-out set; that verdict decides and is compared."""
    rest = await evo.evaluate(best.artifact, _head_version(evo), evo.held_out[evo.rank_size :])
    full = [*best.cheap, *rest]
    verdict = _full_verdict(evo, best, full)
    agreed = cheap_verdict.accepted == verdict.accepted
    evo.audit.record(agreed=agreed, artifact_id=evo.ledger.artifact_id)
    overturned = not agreed and route != "oracle"
    if overturned and route == "cheap":
        _record_reversal(evo, "accept_overturned", best, cheap_verdict, verdict, _head_version(evo))
    return _judgement(best, candidates, route, cheap_verdict, verdict, full, agreed, overturned)


async def _ranked(evo: Evolution, proposals: Sequence[Proposal]) -> list[Candidate]:
    """Distinct candidates that change their parent, scored on the ranking subset at once.

    The ones most rollouts proposed go first (ties: in the order given): an
    edit many failing rollouts asked for fixes the commonest failure, and
    ranking keeps only ``max_candidates`` of them. An edit already judged
    against the same parent is not judged again (a proposer that repeats a
    rejected edit would otherwise hold every sweep).
    """
    head_member = await evo.measured_head()
    support: dict[tuple[int, str], int] = {}
    pairs: dict[tuple[int, str], tuple[Edit, Member, Artifact]] = {}
    for p in proposals:
        parent = p.parent if evo.pool is not None and p.parent is not None else head_member
        key = (parent.id, json.dumps(p.edit.to_dict(), sort_keys=True))
        if key in evo.judged:  # decided against this very parent already
            continue
        if key not in pairs:
            artifact = parent.artifact.apply(p.edit)
            if artifact.entries == parent.artifact.entries:
                continue
            pairs[key] = (p.edit, parent, artifact)
        support[key] = support.get(key, 0) + 1
    order = sorted(pairs, key=lambda k: -support[k])  # stable: ties keep the given order
    chosen = [pairs[k] for k in order[: evo.settings.max_candidates]]
    subset = evo.held_out[: evo.rank_size]
    version = _head_version(evo)
    with first_error():
        async with asyncio.TaskGroup() as tg:  # rank every candidate at once
            scoring = [tg.create_task(evo.evaluate(a, version, subset)) for _, _, a in chosen]
    return [
        Candidate(edit=e, parent=p, artifact=a, cheap=tuple(s.result()))
        for (e, p, a), s in zip(chosen, scoring, strict=True)
    ]


def _gain(evo: Evolution, c: Candidate) -> float:
    return mean(c.cheap) - mean(c.parent.rewards[: evo.rank_size])


def _cheap_verdict(evo: Evolution, c: Candidate) -> Verdict:
    return evo.settings.acceptance.decide(
        c.cheap, c.parent.rewards[: evo.rank_size], _head_version(evo)
    )


def _full_verdict(evo: Evolution, c: Candidate, full: Sequence[float]) -> Verdict:
    """Head selection: the acceptance gate against the parent. Pareto: admission to the pool."""
    if evo.pool is None:
        return evo.settings.acceptance.decide(full, c.parent.rewards, _head_version(evo))
    # The child is the youngest member: among identical rewards the older one stays.
    child = Member(
        id=next(evo.member_ids), artifact=c.artifact, rewards=tuple(full), parent=c.parent.id
    )
    return Verdict(
        probability=prob_beats(full, c.parent.rewards),
        threshold=evo.settings.acceptance.threshold_at(_head_version(evo)),
        accepted=evo.pool.admits(child),
        candidate_mean=mean(full),
        base_mean=c.parent.mean,
    )


def _head_version(evo: Evolution) -> int:
    assert evo.head is not None
    return evo.head.version


# -- committing ----------------------------------------------------------------------


async def _apply(evo: Evolution, j: Judgement) -> bool:
    """Commit (or admit) an accepted candidate; returns whether the ledger head moved."""
    if not j.verdict.accepted or j.full is None:
        return False
    base = _head_version(evo)
    moved = await _merge(evo, j.candidate, j.full, j.verdict, j.route)
    if j.route == "escalated":  # the subset rejected what the full comparison accepted
        _record_reversal(evo, "reject_overturned", j.candidate, j.cheap_verdict, j.verdict, base)
    return moved


async def _merge(
    evo: Evolution, c: Candidate, full: Sequence[float], verdict: Verdict, route: str
) -> bool:
    head, head_member = evo.head, evo.head_member
    assert head is not None and head_member is not None
    child = evo.new_member(c.artifact, full, c.parent)
    if evo.pool is not None:
        evo.pool.admit(child, keep=head_member)
        gate = evo.settings.acceptance.decide(full, head_member.rewards, head.version)
        if not gate.accepted:  # in the pool, not (yet) better than the head
            return False
        verdict = gate
    meta = {
        "probability": verdict.probability,
        "threshold": verdict.threshold,
        "held_out": verdict.candidate_mean,
        "sweep": len(evo.history) + 1,
        "route": route,
    }
    new = await evo.ledger.commit(head, _edit_from(head, c), meta)
    # Rebased onto another writer's commit: the new head was never scored.
    evo.set_head(new, None if new.meta.get("rebased_onto") is not None else child)
    evo.commits += 1
    return True


def _edit_from(head: Version, c: Candidate) -> Edit:
    """The edit that turns the head into the candidate (the edit itself when the parent is the head)."""
    if c.parent.artifact.entries == head.artifact.entries:
        return c.edit
    target = c.artifact.entries
    changed = {k: v for k, v in target.items() if head.artifact.entries.get(k) != v}
    gone = tuple(sorted(k for k in head.artifact.entries if k not in target))
    return Edit(set=changed, remove=gone, note=c.edit.note)


# -- audits ---------------------------------------------------------------------------


async def _buy_audits(evo: Evolution) -> int:
    """Buy queued audits, highest priority first, while the budget and the sweep's share last."""
    bought = 0
    while bought < evo.settings.audits_per_sweep and len(evo.audit) and evo.stop_reason is None:
        if evo.audit.oracle_left == 0:
            break
        item = evo.audit.pop()
        assert item is not None
        evo.audit.spend_oracle()
        evo.audits_bought += 1
        bought += 1
        if not await _audit(evo, item):
            break  # the deadline passed
    return bought


async def _audit(evo: Evolution, item: AuditItem) -> bool:
    """Judge a refused candidate with the oracle; merge it when the oracle accepts it."""
    candidate, cheap_verdict, version = item.payload
    head_member = await evo.measured_head()
    same_base = evo.pool is not None or (
        version == _head_version(evo) and candidate.parent.id == head_member.id
    )
    if same_base:  # the comparison the cheap layer made still holds: it counts for trust
        rest = evo.held_out[evo.rank_size :]
        scored = await _by_deadline(evo, evo.evaluate(candidate.artifact, version, rest))
        full = None if scored is None else [*candidate.cheap, *scored]
    else:  # the head moved: judge the edit on the head it would land on now
        artifact = head_member.artifact.apply(candidate.edit)
        if artifact.entries == head_member.artifact.entries:
            return True
        candidate = Candidate(edit=candidate.edit, parent=head_member, artifact=artifact, cheap=())
        full = await _by_deadline(evo, evo.evaluate(artifact, _head_version(evo), evo.held_out))
    if full is None:
        return False
    verdict = _full_verdict(evo, candidate, full)
    if same_base:
        evo.audit.record(agreed=not verdict.accepted, artifact_id=evo.ledger.artifact_id)
    if verdict.accepted:
        base = _head_version(evo)
        await _merge(evo, candidate, full, verdict, "audit")
        _record_reversal(evo, "reject_overturned", candidate, cheap_verdict, verdict, base)
    return True


def _record_reversal(
    evo: Evolution, kind: str, c: Candidate, cheap_verdict: Verdict, verdict: Verdict, base: int
) -> None:
    """Record a decision the full held-out evaluation reversed (``version``: what it merged)."""
    merged = (
        _head_version(evo) if kind == "reject_overturned" and base != _head_version(evo) else None
    )
    evo.reversals.append(
        {
            "sweep": len(evo.history) + 1,
            "kind": kind,
            "edit": c.edit.to_dict(),
            "base_version": base,
            "version": merged,
            "cheap_probability": cheap_verdict.probability,
            "probability": verdict.probability,
        }
    )


def _stop_if_nothing_can_merge(evo: Evolution) -> None:
    """With the oracle budget spent and trust under the gate, every decision would be refused."""
    if evo.reached_target():  # the loop ends for the better reason
        return
    if evo.audit.oracle_left == 0 and evo.audit.trust(evo.ledger.artifact_id) < TRUST_FLOOR:
        evo.stop("oracle_budget")
