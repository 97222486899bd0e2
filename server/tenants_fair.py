"""Weighted-fair admission between tenants while every worker is busy: a virtual token counter per tenant.

In the spirit of VTC (Sheng et al., "Fairness in Serving Large Language Models", OSDI '24): each tenant has
a counter of the tokens it was served divided by its weight. While a worker has room, requests go straight
through (and are charged), as many as the last refresh saw room for, plus one for each that ended since. While every worker is busy, requests
wait here; on each registry refresh (fresh load figures) as many as the workers have room for are let
through, highest priority class first, then the tenant with the smallest counter. A tenant that starts
waiting has its counter lifted to the smallest among those waiting (what they were served: less what they
have waiting here, which Redis charged on arrival), so idling does not bank credit. A flood from one tenant thus queues behind its
own share instead of ahead of everyone.

The counters are shared by every frontend through Redis: the quota script (server/tenants_quota.py) charges
a request's prompt at admission and its completion at the end, and hands back every tenant's counter, which
`sync` takes. While Redis does not answer (`SHARED_S` after the last sync) the frontend charges its own
counters instead. The lift of a tenant that starts waiting is this frontend's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from schemas.status import WorkerStatus
from schemas.tenants import Tenant
from server.errors import APIError
from server.tenants_quota import background

_RANK = {"high": 0, "normal": 1, "low": 2}
SHARED_S = 10.0  # counters synced from Redis this recently are Redis's to charge


@dataclass
class _Waiter:
    cost: float
    turn: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class FairQueue:
    """Orders tenants' requests while workers are busy; `room()` says how many may go now."""

    def __init__(
        self,
        tenants: Mapping[str, Tenant],
        room: Callable[[], int],
        wait_refreshed: Callable[[float], Awaitable[None]],
        max_wait_s: float,
        max_queued: int = 256,
        on_queued: Callable[[str, int], None] = lambda tenant, n: None,
        settle_s: float = 0.0,
    ) -> None:
        self.tenants = dict(tenants)
        self.counters = dict.fromkeys(tenants, 0.0)
        self.waiting: dict[str, deque[_Waiter]] = {name: deque() for name in tenants}
        self._room = room
        self._wait_refreshed = wait_refreshed
        self._max_wait_s = max_wait_s
        self._max_queued = max_queued  # --max-queued-requests, as for requests waiting without tenants
        self._on_queued = on_queued  # a tenant's number of waiting requests changed (a gauge)
        self._synced_at = -SHARED_S
        # Requests let through since the last refresh, less those that ended: the room the refresh saw is
        # theirs until load figures that count them arrive (a burst must not all go straight through on one
        # stale figure), and a request that ends gives its place to the next at once (not at the refresh).
        self._spent = 0
        # How old load figures must be before they count what was let through (heartbeat lag): the count
        # above starts again only this long after it last did, or the same requests are given room twice.
        self._settle_s = settle_s
        self._settled_at = 0.0

    def queued(self) -> int:
        """Requests waiting for their turn."""
        return sum(len(q) for q in self.waiting.values())

    def _shared(self) -> bool:
        return time.monotonic() - self._synced_at < SHARED_S

    def charge(self, tenant: str, tokens: float) -> None:
        """Add served tokens to the tenant's virtual counter (scaled by its weight), unless Redis does."""
        if not self._shared():
            self.counters[tenant] += tokens / self.tenants[tenant].weight

    def _served(self, tenant: str) -> float:
        """The tenant's counter without its requests waiting here (Redis charges prompts on arrival)."""
        if not self._shared():
            return self.counters[tenant]
        return self.counters[tenant] - sum(w.cost for w in self.waiting[tenant]) / self.tenants[tenant].weight

    def room(self) -> int:
        """Places free now: what the last refresh saw, less what went through since."""
        return max(0, self._room() - self._spent)

    def sync(self, shared: Mapping[str, float]) -> None:
        """Take the counters every frontend charges in Redis (never lowering one this frontend lifted)."""
        if not shared:
            return
        self._synced_at = time.monotonic()
        for name, value in shared.items():
            if name in self.counters:
                self.counters[name] = max(self.counters[name], value)

    async def wait_turn(self, tenant: str, cost: int) -> None:
        """Return when it is this request's turn (at once while workers have room and nobody waits)."""
        if not self.queued() and self.room() > 0:
            self._spent += 1
            self.charge(tenant, cost)
            return
        if self.queued() >= self._max_queued:
            raise _busy()
        queue = self.waiting[tenant]
        if not queue:
            backlogged = [self._served(t) for t, q in self.waiting.items() if q]
            if backlogged:
                self.counters[tenant] = max(self.counters[tenant], min(backlogged))
        waiter = _Waiter(cost)
        queue.append(waiter)
        self._on_queued(tenant, len(queue))
        self.release()
        try:
            async with asyncio.timeout(self._max_wait_s):
                await asyncio.shield(waiter.turn)
        except TimeoutError:
            raise _busy() from None
        finally:
            if not waiter.turn.done():
                waiter.turn.cancel()
                with contextlib.suppress(ValueError):
                    queue.remove(waiter)
                self._on_queued(tenant, len(queue))

    def done(self) -> None:
        """A request that had its turn ended: its place goes to the next waiting one."""
        self._spent -= 1
        if self.queued():
            self.release()

    def _next(self) -> str | None:
        """The tenant whose request goes next: highest priority class, then smallest counter."""
        best: tuple[int, float] | None = None
        chosen = None
        for name, queue in self.waiting.items():
            if queue:
                key = (_RANK[self.tenants[name].priority], self.counters[name])
                if best is None or key < best:
                    best, chosen = key, name
        return chosen

    def release(self, budget: int | None = None) -> int:
        """Let through as many waiting requests as there is room for, in fair order; how many went."""
        room = self.room() if budget is None else budget
        went = 0
        while went < room:
            tenant = self._next()
            if tenant is None:
                break
            waiter = self.waiting[tenant].popleft()
            self._on_queued(tenant, len(self.waiting[tenant]))
            if waiter.turn.done():
                continue  # its client gave up
            waiter.turn.set_result(None)
            self.charge(tenant, waiter.cost)
            went += 1
        self._spent += went
        return went

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[FairQueue]:
        """Release waiting requests after each registry refresh while the frontend runs."""

        async def loop() -> None:
            while True:
                await self._wait_refreshed(1.0)
                if time.monotonic() - self._settled_at >= self._settle_s:
                    self._spent = 0
                    self._settled_at = time.monotonic()
                if self.queued():
                    self.release()

        async with background(loop(), "tenant-fair-queue"):
            yield self


def _busy() -> APIError:
    # The plain path's answer (server/generation.py) when its wait is full or over.
    return APIError(503, "Every worker is busy; try again shortly.", code="workers_busy", retry_after=1)


def room_of(workers: list[WorkerStatus], available: list[WorkerStatus], busy_waiting: int) -> int:
    """How many requests the non-busy workers can take before the next refresh says otherwise."""
    if busy_waiting <= 0:
        return len(available)
    return sum(max(1, busy_waiting - w.waiting) for w in available)
