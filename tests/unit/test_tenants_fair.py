"""Weighted-fair admission: a flood from one tenant queues behind its own share while workers are busy."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from schemas.kafka import SamplingParams
from schemas.status import WorkerStatus
from schemas.tenants import Tenant
from server.errors import APIError
from server.http import with_turn
from server.preprocess import Prepared
from server.tenants_fair import FairQueue, Turn, room_of


class Busy:
    """Stands in for the pool: `room` free places until the test lets more through."""

    def __init__(self) -> None:
        self.room = 0
        self.refreshed = asyncio.Event()

    async def wait_refreshed(self, timeout_s: float) -> None:
        await asyncio.sleep(3600)


def queue(busy: Busy, **tenants: Tenant) -> FairQueue:
    return FairQueue(tenants, lambda: busy.room, busy.wait_refreshed, max_wait_s=5.0)


async def test_free_room_lets_requests_straight_through_and_charges_them() -> None:
    busy = Busy()
    busy.room = 1
    q = queue(busy, a=Tenant(api_keys=["a"], weight=2.0))
    await q.wait_turn("a", 100)
    assert q.counters["a"] == 50.0 and q.queued() == 0


async def test_a_flood_queues_behind_its_own_share() -> None:
    busy = Busy()
    q = queue(busy, flood=Tenant(api_keys=["f"]), quiet=Tenant(api_keys=["q"]))
    order: list[str] = []

    async def one(tenant: str) -> None:
        await q.wait_turn(tenant, 10)
        order.append(tenant)

    tasks = [asyncio.create_task(one("flood")) for _ in range(20)]
    await asyncio.sleep(0)
    tasks += [asyncio.create_task(one("quiet")) for _ in range(3)]
    await asyncio.sleep(0)
    assert q.queued() == 23
    for _ in range(8):  # one place per refresh
        q.release(1)
        await asyncio.sleep(0)
    # Arrival order would serve 20 flood requests first; fair order alternates from the start.
    assert order[:6].count("quiet") == 3, order
    q.release(100)
    await asyncio.gather(*tasks)
    assert len(order) == 23


async def test_weight_and_priority_order_the_tenants() -> None:
    busy = Busy()
    q = queue(
        busy, light=Tenant(api_keys=["l"]), heavy=Tenant(api_keys=["h"], weight=3.0),
        vip=Tenant(api_keys=["v"], priority="high"),
    )  # fmt: skip
    order: list[str] = []

    async def one(tenant: str) -> None:
        await q.wait_turn(tenant, 10)
        order.append(tenant)

    tasks = [asyncio.create_task(one(t)) for t in ["light"] * 8 + ["heavy"] * 8]
    await asyncio.sleep(0)
    vip = asyncio.create_task(one("vip"))
    await asyncio.sleep(0)
    for _ in range(9):
        q.release(1)
        await asyncio.sleep(0)
    assert order[0] == "vip"
    # Weight 3 gets about three times the turns of weight 1 (arrival order would give it none of these 8).
    assert 5 <= order[1:9].count("heavy") <= 6, order
    q.release(100)
    await asyncio.gather(*tasks, vip)


async def test_waiting_too_long_is_503_and_leaves_the_queue() -> None:
    busy = Busy()
    q = FairQueue({"a": Tenant(api_keys=["a"])}, lambda: busy.room, busy.wait_refreshed, max_wait_s=0.05)
    with pytest.raises(APIError) as info:
        await q.wait_turn("a", 1)
    assert info.value.status == 503 and info.value.code == "workers_busy"
    assert q.queued() == 0


async def test_the_queue_is_bounded_by_max_queued_requests() -> None:
    busy = Busy()
    tenants = {"a": Tenant(api_keys=["a"]), "b": Tenant(api_keys=["b"])}
    q = FairQueue(tenants, lambda: busy.room, busy.wait_refreshed, max_wait_s=5.0, max_queued=2)
    waiting = [asyncio.create_task(q.wait_turn(t, 1)) for t in ("a", "b")]
    await asyncio.sleep(0)
    # Full: the next is refused at once, as the plain path refuses it, whichever tenant it is.
    for tenant in ("a", "b"):
        async with asyncio.timeout(1):
            with pytest.raises(APIError) as info:
                await q.wait_turn(tenant, 1)
        assert info.value.status == 503 and info.value.code == "workers_busy"
    assert q.queued() == 2
    q.release(1)
    await asyncio.sleep(0)
    later = asyncio.create_task(q.wait_turn("a", 1))  # a place came free
    await asyncio.sleep(0)
    assert q.queued() == 2 and not later.done()
    q.release(10)
    await asyncio.gather(*waiting, later)


def test_room_counts_what_available_workers_can_take() -> None:
    w = [WorkerStatus(f"w{i}", "m", "sim", 16, 100, 2048, 0.0, 0.0, waiting=i) for i in range(3)]
    assert room_of(w, w[:2], 0) == 2
    assert room_of(w, w[:2], 4) == 4 + 3


async def test_counters_synced_from_redis_order_the_queue_and_are_not_charged_twice() -> None:
    busy = Busy()
    q = queue(busy, a=Tenant(api_keys=["a"]), b=Tenant(api_keys=["b"]))
    # Another frontend served `a` a lot: `a` waits behind `b` here too.
    q.sync({"a": 500.0, "b": 10.0})
    order: list[str] = []

    async def one(tenant: str) -> None:
        await q.wait_turn(tenant, 10)
        order.append(tenant)

    tasks = [asyncio.create_task(one(t)) for t in ("b", "a", "a", "b")]
    await asyncio.sleep(0)
    q.release(2)
    for _ in range(3):
        await asyncio.sleep(0)
    assert order == ["b", "b"]
    assert q.counters == {"a": 500.0, "b": 10.0}  # Redis charges while synced
    q.sync({"a": 400.0})
    assert q.counters["a"] == 500.0  # never lowered
    q.release(10)
    await asyncio.gather(*tasks)


async def test_a_burst_takes_the_room_once_until_the_next_refresh() -> None:
    busy = Busy()
    busy.room = 2  # as the last refresh saw it: the burst's first two use it up
    q = queue(busy, a=Tenant(api_keys=["a"]))
    burst = [asyncio.create_task(q.wait_turn("a", 1)) for _ in range(5)]
    await asyncio.sleep(0)
    assert sum(t.done() for t in burst) == 2 and q.queued() == 3
    q._spent = 0  # a refresh: the room is the workers' again
    assert q.release() == 2
    q.release(10)
    await asyncio.gather(*burst)


async def test_a_newcomer_goes_ahead_of_a_flood_charged_on_arrival_by_redis() -> None:
    busy = Busy()
    q = queue(busy, flood=Tenant(api_keys=["f"]), quiet=Tenant(api_keys=["q"]))
    order: list[str] = []

    async def one(tenant: str, shared: dict[str, float]) -> None:
        q.sync(shared)  # what the quota script handed back at admission
        await q.wait_turn(tenant, 10)
        order.append(tenant)

    # Redis charges each prompt as it arrives: 10 flood requests waiting, 100 tokens on its counter already.
    tasks = [asyncio.create_task(one("flood", {"flood": 10.0 * (i + 1)})) for i in range(10)]
    await asyncio.sleep(0)
    tasks.append(asyncio.create_task(one("quiet", {"flood": 100.0, "quiet": 10.0})))
    await asyncio.sleep(0)
    q.release(1)
    for _ in range(3):
        await asyncio.sleep(0)
    # Lifted to what the flood was served (0), not to what it asked for: the quiet tenant goes first.
    assert order == ["quiet"]
    q.release(100)
    await asyncio.gather(*tasks)


async def test_a_request_that_ends_gives_its_place_to_the_next_at_once() -> None:
    busy = Busy()
    busy.room = 1
    q = queue(busy, a=Tenant(api_keys=["a"]), b=Tenant(api_keys=["b"]))
    first = await q.wait_turn("a", 1)  # takes the one place the last refresh saw
    waiting = asyncio.create_task(q.wait_turn("b", 1))
    await asyncio.sleep(0)
    assert q.queued() == 1
    q.done(first)  # no refresh: the ended request's place is the waiting one's
    async with asyncio.timeout(1):
        await waiting
    assert q.queued() == 0


async def test_the_turn_carries_an_engine_priority_by_class_then_counter() -> None:
    busy = Busy()
    busy.room = 100
    q = queue(
        busy, flood=Tenant(api_keys=["f"]), quiet=Tenant(api_keys=["q"]),
        vip=Tenant(api_keys=["v"], priority="high"), spare=Tenant(api_keys=["s"], priority="low"),
    )  # fmt: skip
    q.sync({"flood": 5000.0, "quiet": 100.0, "vip": 9000.0, "spare": 0.0})
    flood, quiet = await q.wait_turn("flood", 10), await q.wait_turn("quiet", 10)
    vip, spare = await q.wait_turn("vip", 10), await q.wait_turn("spare", 10)
    # Lower runs first: the quiet tenant (smaller counter) ahead of the flood; the high class ahead of every
    # normal one whatever its counter; the low class behind them all; all above batch items (100).
    assert quiet.priority < flood.priority
    assert vip.priority < quiet.priority and spare.priority > flood.priority
    assert spare.priority < 100
    assert not any(t.overtake for t in (flood, quiet, vip, spare))


async def test_priorities_stay_below_the_batch_ceiling() -> None:
    busy = Busy()
    busy.room = 10
    tenants = {f"t{i}": Tenant(api_keys=[f"k{i}"], priority="low") for i in range(4)}
    q = FairQueue(tenants, lambda: busy.room, busy.wait_refreshed, max_wait_s=5.0, priority_ceiling=4)
    q.sync({f"t{i}": float(i) for i in range(4)})
    assert [(await q.wait_turn(f"t{i}", 1)).priority for i in range(4)] == [4, 4, 4, 4]


async def test_a_better_request_overtakes_while_workers_are_busy() -> None:
    busy = Busy()
    busy.room = 4
    q = queue(busy, flood=Tenant(api_keys=["f"]), quiet=Tenant(api_keys=["q"]))
    q.sync({"flood": 1000.0, "quiet": 10.0})
    held = [await q.wait_turn("flood", 10) for _ in range(4)]  # the room is theirs: workers now busy
    waiting = asyncio.create_task(q.wait_turn("flood", 10))
    await asyncio.sleep(0)
    assert q.queued() == 1 and not waiting.done()
    # The quiet tenant's request would go ahead of the flood's in an engine's queue: it is sent at once.
    async with asyncio.timeout(1):
        quiet = await q.wait_turn("quiet", 10)
    assert quiet.overtake and quiet.priority < held[0].priority
    assert q.queued() == 1  # the flood's own request still waits its turn
    for turn in [*held, quiet]:
        q.done(turn)
    await waiting


async def test_overtaking_is_bounded_by_the_worse_requests_in_flight() -> None:
    busy = Busy()
    busy.room = 1
    q = queue(busy, flood=Tenant(api_keys=["f"]), quiet=Tenant(api_keys=["q"]))
    q.sync({"flood": 1000.0, "quiet": 10.0})
    flood = await q.wait_turn("flood", 10)
    first = await q.wait_turn("quiet", 10)
    assert first.overtake
    # One worse request in flight, already overtaken once: the next quiet request waits.
    second = asyncio.create_task(q.wait_turn("quiet", 10))
    await asyncio.sleep(0)
    assert not second.done() and q.queued() == 1
    q.done(flood)
    q.done(first)  # their places go to the waiting one
    async with asyncio.timeout(1):
        assert not (await second).overtake


async def test_a_tenant_back_from_idling_banks_no_credit() -> None:
    busy = Busy()
    busy.room = 100
    q = queue(busy, a=Tenant(api_keys=["a"]), b=Tenant(api_keys=["b"]))
    q.sync({"a": 10.0, "b": 5000.0})
    b = [await q.wait_turn("b", 100) for _ in range(3)]  # b active: 300 of its counter is in flight
    turn = await q.wait_turn("a", 10)
    # Lifted to what b was served (5000 less its 300 in flight), not left at the 10 it had before idling.
    assert q.counters["a"] == 4700.0
    assert turn.priority < b[0].priority  # still ahead of what b has in flight
    q.sync({"a": 20.0, "b": 5300.0})  # Redis's next answer: a's own charge adds on top of the lift
    assert q.counters["a"] == 4710.0 and q.counters["b"] == 5300.0


def test_a_body_priority_only_lowers_the_tenants_standing() -> None:
    def prepared(priority: int) -> Prepared:
        return Prepared([[1]], ["x"], 4, SamplingParams(), 1, False, False, priority)

    def request(turn: Turn | None) -> Any:
        return SimpleNamespace(state=SimpleNamespace(fair_turn=turn) if turn else SimpleNamespace())

    turn = Turn("quiet", 10, priority=3, overtake=True)
    assert with_turn(request(turn), prepared(0)).priority == 3
    assert with_turn(request(turn), prepared(5)).priority == 8  # lowered further
    raised = with_turn(request(turn), prepared(-50))  # cannot go ahead of its tenant's standing
    assert raised.priority == 3 and raised.overtake
    # Without a turn (no fair queue, or the admin key) the body's priority is the engine's, as before.
    assert with_turn(request(None), prepared(-50)).priority == -50


async def test_a_request_cancelled_as_it_is_let_through_gives_its_place_back() -> None:
    busy = Busy()
    q = queue(busy, a=Tenant(api_keys=["a"]), b=Tenant(api_keys=["b"]))
    first = asyncio.create_task(q.wait_turn("a", 1))
    second = asyncio.create_task(q.wait_turn("b", 1))
    await asyncio.sleep(0)
    busy.room = 1
    assert q.release() == 1  # `a` has its turn ...
    first.cancel()  # ... and its client leaves before it runs on
    with pytest.raises(asyncio.CancelledError):
        await first
    async with asyncio.timeout(1):
        await second  # the place went on to `b`
    assert q.inflight["a"] == [] and q.room() == 0
