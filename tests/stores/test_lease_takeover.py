"""Taking over a dead owner's live lease (D6; issue 9, finding 10), against every backend.

``acquire_lease(..., steal_from=owner)`` is a compare-and-set on the holder:
it takes the lease over only while exactly ``owner`` holds it, with a new
fencing token that fences the old owner out. ``LeaseHeld`` carries the holder
and the expiry, so an engine can prove the holder dead and retry, and its
message says what the user can do.
"""

from __future__ import annotations

import asyncio
import pickle
from typing import TYPE_CHECKING

import pytest

from tailrace._errors import LeaseHeld, LeaseLost, RunNotFound
from tailrace.stores import Harvest, NewRun, RunStatus, RunStore

if TYPE_CHECKING:
    from tests.fixtures import Backend

TTL = 30.0


async def run_leased_by(store: RunStore, owner: str, run_id: str = "r1") -> int:
    run = NewRun(
        run_id=run_id, graph_name="g", graph_ref=None, fingerprint="fp", input_json="null",
        created_at=1.0,
    )  # fmt: skip
    await store.create_run(run)
    return await store.acquire_lease(run_id, owner, TTL)


async def test_stealing_from_the_holder_fences_it_out(backend: Backend) -> None:
    store = backend.store
    old = await run_leased_by(store, "dead")
    new = await store.acquire_lease("r1", "B", TTL, steal_from="dead")
    assert new > old
    record = await store.get_run("r1")
    assert (record.lease_owner, record.lease_token) == ("B", new)
    assert record.lease_expires == backend.clock.now + TTL
    with pytest.raises(LeaseLost):
        await store.commit("r1", old, Harvest(state_json='{"stale":true}'))
    with pytest.raises(LeaseLost):
        await store.heartbeat("r1", "dead", old, TTL)
    await store.release_lease("r1", "dead", old)  # the old owner cannot drop B's lease
    assert (await store.get_run("r1")).lease_owner == "B"
    await store.commit("r1", new, Harvest(state_json='{"mine":true}'))
    assert (await store.get_run("r1")).state_json == '{"mine":true}'


async def test_stealing_from_someone_else_is_refused(backend: Backend) -> None:
    store = backend.store
    token = await run_leased_by(store, "A")
    with pytest.raises(LeaseHeld) as info:
        await store.acquire_lease("r1", "B", TTL, steal_from="C")
    assert (info.value.owner, info.value.expires_at) == ("A", backend.clock.now + TTL)
    record = await store.get_run("r1")
    assert (record.lease_owner, record.lease_token) == ("A", token)


async def test_steal_from_on_a_free_or_expired_lease_is_a_plain_grant(backend: Backend) -> None:
    store = backend.store
    first = await run_leased_by(store, "A")
    backend.clock.advance(TTL + 1)
    second = await store.acquire_lease("r1", "B", TTL, steal_from="nobody")
    assert second == first + 1
    await store.release_lease("r1", "B", second)
    third = await store.acquire_lease("r1", "C", TTL, steal_from="B")
    assert third == second + 1
    assert (await store.get_run("r1")).lease_owner == "C"


async def test_the_holder_naming_itself_keeps_its_token(backend: Backend) -> None:
    store = backend.store
    token = await run_leased_by(store, "A")
    assert await store.acquire_lease("r1", "A", TTL, steal_from="A") == token
    assert await store.acquire_lease("r1", "A", TTL, steal_from="Z") == token


async def test_racing_takeovers_of_one_dead_owner_have_one_winner(backend: Backend) -> None:
    store = backend.store
    old = await run_leased_by(store, "dead")
    thieves = [f"engine-{i}" for i in range(8)]
    outcomes = await asyncio.gather(
        *(store.acquire_lease("r1", t, TTL, steal_from="dead") for t in thieves),
        return_exceptions=True,
    )
    tokens = [o for o in outcomes if isinstance(o, int)]
    refused = [o for o in outcomes if isinstance(o, LeaseHeld)]
    assert tokens == [old + 1] and len(refused) == len(thieves) - 1, outcomes
    winner = (await store.get_run("r1")).lease_owner
    assert winner in thieves and all(exc.owner == winner for exc in refused)


async def test_lease_held_says_who_until_when_and_what_to_do(backend: Backend) -> None:
    store = backend.store
    await run_leased_by(store, "host:123:456:abcd")
    backend.clock.advance(4)
    with pytest.raises(LeaseHeld) as info:
        await store.acquire_lease("r1", "B", TTL)
    exc = info.value
    assert exc.owner == "host:123:456:abcd"
    assert exc.expires_at == backend.clock.now + TTL - 4
    message = str(exc)
    assert "'r1'" in message and "host:123:456:abcd" in message
    assert "another 26.0 s" in message and "Wait" in message and "taken over at once" in message


async def test_a_takeover_from_a_holder_counts_as_a_recovery(backend: Backend) -> None:
    """W3: the store counts each time a running run is taken over from an owner that held it."""
    store = backend.store
    token = await run_leased_by(store, "A")
    assert (await store.get_run("r1")).recoveries == 0  # the first grant is no recovery
    assert await store.acquire_lease("r1", "A", TTL) == token  # a renewal neither
    backend.clock.advance(TTL + 1)
    token = await store.acquire_lease("r1", "B", TTL)  # A's lease expired: B recovers it
    assert (await store.get_run("r1")).recoveries == 1
    token = await store.acquire_lease("r1", "C", TTL, steal_from="B")  # B proved dead
    assert (await store.get_run("r1")).recoveries == 2
    await store.release_lease("r1", "C", token)  # a drain lets go: the next grant is no recovery
    token = await store.acquire_lease("r1", "D", TTL)
    assert (await store.get_run("r1")).recoveries == 2
    await store.commit("r1", token, Harvest(state_json="{}", status=RunStatus.SUSPENDED))
    backend.clock.advance(TTL + 1)
    await store.acquire_lease("r1", "E", TTL)  # resuming a suspended run is no recovery
    assert (await store.get_run("r1")).recoveries == 2


async def test_stealing_an_unknown_run_raises_run_not_found(store: RunStore) -> None:
    with pytest.raises(RunNotFound):
        await store.acquire_lease("nope", "B", TTL, steal_from="A")


def test_lease_held_keeps_its_fields_through_pickle() -> None:
    exc = LeaseHeld("run 'r1' is leased", owner="A", expires_at=12.5)
    copy = pickle.loads(pickle.dumps(exc))
    assert (str(copy), copy.owner, copy.expires_at) == (str(exc), "A", 12.5)
    assert LeaseHeld("plain").owner is None  # callers that know no holder still work
