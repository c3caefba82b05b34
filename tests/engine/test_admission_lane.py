"""The slot queue's lane for backups (E3, T5), against a reference model, under any ordering.

Tickets are submitted by key or ahead (a backup's), cancelled while they wait,
and slots released in any order. At every step: no slot is idle while a live
ticket waits, no more than ``capacity`` slots are held, each ticket is
granted at most once, and each freed slot goes to the first live ticket
waiting ahead, else to the live ticket with the smallest key (arrival order
breaking ties), never to a cancelled one.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tailrace.core._admission import SlotQueue, Ticket

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("submit"), st.integers(0, 3)),
        st.tuples(st.just("ahead"), st.just(0)),
        st.tuples(st.just("cancel"), st.integers(0, 50)),
        st.tuples(st.just("release"), st.integers(0, 50)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(capacity=st.integers(1, 3), ops=OPS)
def test_backups_go_first_and_no_slot_is_idle_or_granted_twice(
    capacity: int, ops: list[tuple[str, int]]
) -> None:
    queue = SlotQueue(capacity)
    granted: list[int] = []  # ticket numbers, in grant order
    holding: list[int] = []  # tickets that hold a slot now
    waiting: dict[int, tuple[bool, int, Ticket]] = {}  # number -> (ahead, key, ticket)

    def grant_of(n: int) -> Ticket:
        def grant() -> None:
            assert n not in granted, f"ticket {n} granted twice"
            granted.append(n)
            holding.append(n)
            waiting.pop(n, None)

        return Ticket(grant)

    def expected_next() -> int | None:
        ahead = [n for n, (first, _, t) in waiting.items() if first and t.alive]
        if ahead:
            return min(ahead)
        keyed = [(key, n) for n, (first, key, t) in waiting.items() if not first and t.alive]
        return min(keyed)[1] if keyed else None

    for number, (op, arg) in enumerate(ops):
        before = len(granted)
        if op in ("submit", "ahead"):
            ticket = grant_of(number)
            waiting[number] = (op == "ahead", arg, ticket)
            if op == "ahead":
                queue.submit_ahead(ticket)
            else:
                queue.submit((arg,), ticket)
        elif op == "cancel" and waiting:
            victim = sorted(waiting)[arg % len(waiting)]
            waiting.pop(victim)[2].cancel()
        elif op == "release" and holding:
            expected = expected_next()
            holding.pop(arg % len(holding))
            queue.release()
            assert granted[before:] == ([] if expected is None else [expected])
        live = [n for n, (_, _, t) in waiting.items() if t.alive]
        assert queue.in_use == len(holding) <= capacity
        assert not live or queue.in_use == capacity, "a slot is idle while a ticket waits"
        assert queue.waiting() == len(live)
        if queue.try_acquire():  # idle capacity (a clone's) only while nobody waits
            assert not live
            queue.release()
