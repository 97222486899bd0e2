"""The fair queue's reserve: tenants behind the best active one leave running slots free for it."""

from __future__ import annotations

import asyncio

import pytest

from kvstore.load import WorkerLoad
from schemas.status import WorkerStatus
from schemas.tenants import Tenant
from server import tenants_fair
from server.tenants_fair import FairQueue, Slots, Turn, reserved_slots


async def _never_refreshed(timeout_s: float) -> None:
    await asyncio.sleep(3600)


def queue(slots: Slots | None, room: int = 100) -> FairQueue:
    """A queue of `flood` and `quiet` whose workers always have `room` (only the reserve holds anything back)."""
    tenants = {"flood": Tenant(api_keys=["f"]), "quiet": Tenant(api_keys=["q"])}
    return FairQueue(tenants, lambda: room, _never_refreshed, max_wait_s=5.0, slots=lambda: slots)


async def flood_holding(q: FairQueue, n: int) -> list[Turn]:
    """The flood alone sends `n` requests: with one tenant active none waits, whatever the reserve."""
    return [await q.wait_turn("flood", 10) for _ in range(n)]


async def test_a_single_active_tenant_may_fill_every_slot() -> None:
    q = queue(Slots(unreserved=6, others=0))
    async with asyncio.timeout(1):
        turns = await flood_holding(q, 8)  # 8 slots in the fleet: none kept back
    assert len(turns) == 8 and q.queued() == 0


async def test_the_flood_leaves_the_reserve_free_while_the_quiet_tenant_is_active() -> None:
    q = queue(Slots(unreserved=6, others=0))
    flood = await flood_holding(q, 5)
    quiet = await q.wait_turn("quiet", 10)  # lifted to what the flood was served: ahead of it
    assert quiet.priority < flood[-1].priority
    more = [asyncio.create_task(q.wait_turn("flood", 10)) for _ in range(3)]
    await asyncio.sleep(0)
    # 6 in flight fill the 6 unreserved slots: the flood's requests wait (the room would let them go).
    assert not any(t.done() for t in more) and q.queued() == 3
    q.done(quiet)  # the quiet tenant has nothing in flight, but was seen just now: still active
    assert q.queued() == 2  # its slot is the flood's next request's, at once
    q.done(flood[0])
    assert q.queued() == 1
    # The quiet tenant's next request is not held back: it goes ahead of the flood's waiting one.
    async with asyncio.timeout(1):
        again = await q.wait_turn("quiet", 10)
    assert again.overtake and q.queued() == 1
    async with asyncio.timeout(1):
        went = [await t for t in more[:2]]  # (released in their order)
    for t in [*flood[1:], again, *went]:
        q.done(t)
    async with asyncio.timeout(1):
        await asyncio.gather(*more)


async def test_the_reserve_is_given_back_when_the_quiet_tenant_goes(monkeypatch: pytest.MonkeyPatch) -> None:
    q = queue(Slots(unreserved=2, others=0))
    flood = await flood_holding(q, 2)
    q.done(await q.wait_turn("quiet", 10))
    waiting = asyncio.create_task(q.wait_turn("flood", 10))
    await asyncio.sleep(0)
    assert q.queued() == 1
    monkeypatch.setattr(tenants_fair, "RECENT_S", 0.0)  # its last request is now long ago
    assert q.release() == 1  # (the next refresh)
    async with asyncio.timeout(1):
        await waiting
    for t in flood:
        q.done(t)


async def test_sequences_of_other_frontends_count_against_the_unreserved_slots() -> None:
    q = queue(Slots(unreserved=6, others=4))
    flood = await flood_holding(q, 2)
    q.done(await q.wait_turn("quiet", 10))
    waiting = asyncio.create_task(q.wait_turn("flood", 10))
    await asyncio.sleep(0)
    assert q.queued() == 1  # 2 here and 4 elsewhere: every unreserved slot is taken
    q.done(flood[0])
    async with asyncio.timeout(1):
        await waiting


async def test_a_tenant_active_on_another_frontend_keeps_its_reserve_here() -> None:
    q = queue(Slots(unreserved=2, others=0))
    q.sync({"flood": 20.0, "quiet": 5.0})  # the first answer: what was ever charged, nobody counts as active
    flood = await flood_holding(q, 2)
    third = asyncio.create_task(q.wait_turn("flood", 10))
    await asyncio.sleep(0)
    assert third.done()  # the quiet tenant has not been seen: nothing is reserved
    q.sync({"flood": 50.0, "quiet": 15.0})  # another frontend charged a quiet request
    fourth = asyncio.create_task(q.wait_turn("flood", 10))
    await asyncio.sleep(0)
    assert not fourth.done() and q.queued() == 1
    for t in [*flood, third.result()]:
        q.done(t)
    async with asyncio.timeout(1):
        await fourth


async def test_every_tenant_behind_the_best_active_one_shares_the_unreserved_slots() -> None:
    tenants = {name: Tenant(api_keys=[name]) for name in ("flood", "mid", "quiet")}
    q = FairQueue(tenants, lambda: 100, _never_refreshed, max_wait_s=5.0, slots=lambda: Slots(4, 0))
    q.sync({"flood": 1000.0, "mid": 500.0, "quiet": 10.0})  # Redis's counters (it charges from now on)
    held = [await q.wait_turn(t, 10) for t in ("flood", "flood", "mid", "mid")]  # quiet not active yet
    q.done(await q.wait_turn("quiet", 10))  # active from now on
    late = [asyncio.create_task(q.wait_turn(t, 10)) for t in ("flood", "mid")]
    await asyncio.sleep(0)
    # mid is ahead of the flood, but both are behind the quiet tenant: together they hold the 4 unreserved.
    assert q.queued() == 2
    q.done(held[0])
    # The freed slot goes to the better of the two.
    assert q.queued() == 1 and len(q.inflight["mid"]) == 3 and len(q.inflight["flood"]) == 1
    async with asyncio.timeout(1):
        mid = await late[1]
    for t in [*held[1:], mid]:
        q.done(t)
    async with asyncio.timeout(1):
        await late[0]


async def test_without_a_reserve_nothing_is_held_back() -> None:
    q = queue(None)
    await flood_holding(q, 4)
    q.done(await q.wait_turn("quiet", 10))
    async with asyncio.timeout(1):
        await flood_holding(q, 4)
    assert q.queued() == 0


def test_reserved_slots_of_the_fleet() -> None:
    def w(wid: str, seqs: int) -> WorkerStatus:
        return WorkerStatus(wid, "m", "sim", 16, 100, 2048, 0.0, 0.0, max_num_seqs=seqs)

    remote = {"a": WorkerLoad(sequences=3), "gone": WorkerLoad(sequences=9)}
    assert reserved_slots([w("a", 4), w("b", 4)], remote, 1) == Slots(unreserved=6, others=3)
    # At least one slot each stays unreserved.
    assert reserved_slots([w("a", 1), w("b", 4)], {}, 2) == Slots(unreserved=1 + 2, others=0)
    assert reserved_slots([w("a", 4), w("b", 4)], remote, 0) is None  # --tenants-reserve 0
    assert reserved_slots([w("a", 4), w("b", 0)], remote, 1) is None  # a worker that does not say
    assert reserved_slots([], remote, 1) is None


async def test_a_flood_beside_a_tenant_served_just_now_starts_from_its_counter() -> None:
    q = queue(Slots(6, 0))
    for _ in range(5):
        q.done(await q.wait_turn("quiet", 10))  # served alone: 50 on its counter, nothing in flight now
    flood = [await q.wait_turn("flood", 10) for _ in range(2)]
    quiet = await q.wait_turn("quiet", 10)
    # Lifted to the quiet tenant's 50 on arrival; from 0 it would go ahead of the quiet tenant (and have the
    # reserve) until it had been served 50.
    assert q.counters["flood"] == 70.0
    assert quiet.priority < flood[-1].priority
