"""``tailrace._attempts``: how each attempt ended, derived once for the Gantt and ``tailrace show``."""

from __future__ import annotations

import json
from typing import Any

from tailrace._attempts import Attempt, Outcome, attempts_from_events, last_known
from tailrace.stores import CheckpointRow, ChunkRow, EventRow


def ev(seq: int, type: str, ts: float, node: str | None = None, attempt: int | None = 1,
       visit: int | None = 1, **data: Any) -> EventRow:  # fmt: skip
    return EventRow(
        seq=seq,
        type=type,
        node_id=node,
        visit=visit if node else None,
        attempt=attempt if node else None,
        ts=ts,
        data_json=json.dumps(data),
    )


def shape(attempts: list[Attempt]) -> list[tuple[str, float, float, str, bool]]:
    return [(a.label, a.start, a.end, a.outcome.value, a.hedge) for a in attempts]


def test_each_retry_is_a_try_of_its_own_starting_after_its_backoff() -> None:
    events = [
        ev(1, "node_started", 0.0, "a"),
        ev(2, "node_retrying", 1.0, "a", attempt=1, error="boom", delay=0.5),
        ev(3, "node_retrying", 2.0, "a", attempt=2, error="boom again", delay=0.5),
        ev(4, "node_completed", 3.0, "a", attempt=3),
    ]
    tries = attempts_from_events(events)
    assert shape(tries) == [
        ("a#1", 0.0, 1.0, "retried", False),
        ("a#1", 1.5, 2.0, "retried", False),
        ("a#1", 2.5, 3.0, "completed", False),
    ]
    assert [t.attempt for t in tries] == [1, 2, 3]
    assert [t.error for t in tries] == ["boom", "boom again", None]


def test_the_hedge_that_completes_wins_and_the_straggler_it_raced_lost() -> None:
    events = [
        ev(1, "node_started", 0.0, "h"),
        ev(2, "node_straggler", 3.0, "h", attempt=None, elapsed=3.0, estimate=1.0),
        ev(3, "node_hedged", 3.0, "h", attempt=None),
        ev(4, "node_started", 3.0, "h", hedge=True),
        ev(5, "node_completed", 4.0, "h", hedge=True),
    ]
    primary, backup = attempts_from_events(events)
    assert shape([primary, backup]) == [
        ("h#1", 0.0, 4.0, "lost", False),
        ("h#1", 3.0, 4.0, "completed", True),
    ]
    assert primary.straggler_at == 3.0 and backup.straggler_at is None


def test_a_straggler_that_finishes_first_beats_its_hedge() -> None:
    events = [
        ev(1, "node_started", 0.0, "h"),
        ev(2, "node_straggler", 3.0, "h", attempt=None),
        ev(3, "node_started", 3.0, "h", hedge=True),
        ev(4, "node_completed", 3.5, "h", hedge=False),
    ]
    assert shape(attempts_from_events(events)) == [
        ("h#1", 0.0, 3.5, "completed", False),
        ("h#1", 3.0, 3.5, "lost", True),
    ]


def test_an_attempt_open_at_a_resume_was_cut_and_its_rerun_is_separate() -> None:
    events = [
        ev(1, "run_started", 0.0),
        ev(2, "node_started", 1.0, "a"),  # the process died during this attempt
        ev(3, "run_resumed", 5.0),
        ev(4, "node_started", 6.0, "a"),
        ev(5, "node_completed", 7.0, "a"),
    ]
    assert shape(attempts_from_events(events)) == [
        ("a#1", 1.0, 1.0, "cut", False),  # ends at its process's last commit, not the resume
        ("a#1", 6.0, 7.0, "completed", False),
    ]


def test_open_attempts_run_to_now_while_live_and_are_cut_once_nothing_drives_the_run() -> None:
    events = [ev(1, "node_started", 1.0, "a")]
    [running] = attempts_from_events(events, live=True, now=9.0)
    assert (running.outcome, running.end) == (Outcome.RUNNING, 9.0)
    [orphaned] = attempts_from_events(events, live=False)
    assert (orphaned.outcome, orphaned.end) == (Outcome.CUT, 1.0)


def test_a_gate_asks_then_waits_until_its_answer_is_applied() -> None:
    events = [
        ev(1, "node_started", 0.0, "g"),
        ev(2, "question_opened", 0.5, "g", question_id="q"),
        ev(3, "run_suspended", 0.6),
        ev(4, "question_answered", 10.0, "g", attempt=None, question_id="q"),
        ev(5, "run_resumed", 10.0),
    ]
    assert shape(attempts_from_events(events)) == [
        ("g#1", 0.0, 0.5, "asked", False),
        ("g#1", 0.5, 10.0, "waiting", False),
    ]


def test_failures_and_cancellations_close_the_attempt_they_end() -> None:
    events = [
        ev(1, "node_started", 0.0, "a"),
        ev(2, "node_started", 0.0, "b"),
        ev(3, "node_failed", 1.0, "a", error="ValueError: no"),
        ev(4, "node_cancelled", 1.0, "b"),
    ]
    failed, cancelled = attempts_from_events(events)
    assert shape([failed, cancelled]) == [
        ("a#1", 0.0, 1.0, "failed", False),
        ("b#1", 0.0, 1.0, "cancelled", False),
    ]
    assert failed.error == "ValueError: no"


def test_a_late_input_marks_the_completion_of_its_source() -> None:
    events = [
        ev(1, "node_started", 0.0, "fast"),
        ev(2, "node_started", 0.0, "slow"),
        ev(3, "node_completed", 1.0, "fast"),
        ev(4, "node_completed", 2.0, "slow"),
        ev(5, "node_late_input", 2.0, "merge", attempt=None, source="slow", reason="fired"),
    ]
    assert {a.node_id: a.late for a in attempts_from_events(events)} == {
        "fast": False,
        "slow": True,
    }


def test_loop_visits_are_separate_rows_in_start_order() -> None:
    events = [
        ev(1, "node_started", 0.0, "w", visit=1),
        ev(2, "node_completed", 1.0, "w", visit=1),
        ev(3, "node_started", 2.0, "w", visit=2),
        ev(4, "node_completed", 3.0, "w", visit=2),
    ]
    assert [a.label for a in attempts_from_events(events)] == ["w#1", "w#2"]


def test_data_that_does_not_decode_is_ignored() -> None:
    broken = EventRow(seq=2, type="node_started", node_id="a", visit=1, attempt=1, ts=0.0,
                      data_json="not json")  # fmt: skip
    events = [broken, ev(3, "node_completed", 1.0, "a")]
    assert shape(attempts_from_events(events)) == [("a#1", 0.0, 1.0, "completed", False)]


def test_a_cut_attempt_ends_at_its_last_commit_and_its_rerun_is_the_next_try() -> None:
    events = [
        ev(1, "node_started", 1.0, "a"),
        ev(2, "node_completed", 2.0, "a"),
        ev(3, "node_started", 2.5, "b"),
        ev(4, "run_resumed", 9.0),
        ev(5, "node_started", 9.5, "b"),
        ev(6, "node_completed", 10.0, "b"),
    ]
    cut, rerun = [a for a in attempts_from_events(events) if a.node_id == "b"]
    assert (cut.outcome, cut.end, cut.attempt) == (Outcome.CUT, 2.5, 1)
    assert (rerun.outcome, rerun.start, rerun.attempt) == (Outcome.COMPLETED, 9.5, 2)


def test_a_waiting_gate_waits_until_now_while_the_run_is_suspended() -> None:
    events = [
        ev(1, "node_started", 0.0, "g"),
        ev(2, "question_opened", 0.5, "g", question_id="q"),
        ev(3, "run_suspended", 0.6),
    ]
    waits = [a for a in attempts_from_events(events, live=False, now=30.0) if a.attempt is None]
    assert [(w.outcome, w.end) for w in waits] == [(Outcome.WAITING, 30.0)]


def test_a_cut_attempt_is_drawn_up_to_its_last_checkpoint_or_chunk() -> None:
    events = [
        ev(1, "node_started", 1.0, "a"),  # its last event: then it checkpointed and streamed
        ev(2, "node_started", 1.0, "b"),
        ev(3, "node_started", 1.0, "m", item=0),
        ev(4, "run_resumed", 9.0),
        ev(5, "node_started", 9.5, "a", attempt=2),
        ev(6, "node_completed", 10.0, "a", attempt=2),
    ]
    seen = {("a", 1, None, 1): 3.5, ("a", 1, None, 2): 9.8, ("m", 1, 0, 1): 2.0}
    drawn = attempts_from_events(events, seen=seen)
    assert [(a.label, a.start, a.end, a.outcome.value) for a in drawn] == [
        ("a#1", 1.0, 3.5, "cut"),  # up to what it last left, not 0 s at its start
        ("b#1", 1.0, 1.0, "cut"),  # nothing known of it past its start
        ("m#1[0]", 1.0, 2.0, "cut"),
        ("a#1", 9.5, 10.0, "completed"),  # what the re-run left does not stretch it
    ]
    [orphaned] = attempts_from_events(events[:1], live=False, seen=seen)
    assert (orphaned.outcome, orphaned.end) == (Outcome.CUT, 3.5)


async def test_last_known_reads_checkpoints_and_the_chunks_of_cut_attempts_only() -> None:
    checkpoints = [CheckpointRow("a", 1, -1, 1, "{}", 2.0), CheckpointRow("m", 1, 0, 1, "{}", 1.5)]
    rows = [
        ChunkRow(1, 1, "a", 1, None, 1, 0, "chunk", '"x"', 3.0),
        ChunkRow(2, 2, "c", 1, None, 1, 0, "chunk", '"y"', 7.0),  # c completed: not kept
        ChunkRow(3, 1, "a", 1, None, 1, 0, "discarded", None, 9.0),  # written at the resume
    ]
    reads: list[tuple[int, int]] = []

    async def read(after: int, limit: int) -> list[ChunkRow]:
        reads.append((after, limit))
        return [r for r in rows if r.seq > after][:2]

    events = [
        ev(1, "node_started", 1.0, "a"),
        ev(2, "node_started", 1.0, "c"),
        ev(3, "node_completed", 1.2, "c"),
        ev(4, "run_resumed", 9.0),
    ]
    cut = attempts_from_events(events)
    known = await last_known(cut, checkpoints, read)
    assert known == {("a", 1, None, 1): 3.0, ("m", 1, 0, 1): 1.5}
    assert [after for after, _ in reads] == [0, 2, 3]
    reads.clear()
    assert await last_known(attempts_from_events(events[:3]), checkpoints, read) == {
        ("a", 1, None, 1): 2.0,
        ("m", 1, 0, 1): 1.5,
    }
    assert reads == []  # nothing was cut: no stream row is read
