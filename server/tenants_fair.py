"""Weighted-fair admission between tenants while every worker is busy: a virtual token counter per tenant.

In the spirit of VTC (Sheng et al., "Fairness in Serving Large Language Models", OSDI '24): each tenant has
a counter of the tokens it was served divided by its weight. While a worker has room, requests go straight
through (and are charged), as many as the last refresh saw room for, plus one for each that ended since. While every worker is busy, requests
wait here; on each registry refresh (fresh load figures) as many as the workers have room for are let
through, highest priority class first, then the tenant with the smallest counter. A tenant that becomes
active (nothing waiting here, nothing in flight) has its counter lifted to the smallest among the active
ones (something waiting or in flight here, or seen in the last RECENT_S; what they were served: less what
they have waiting or in flight, which Redis charged on arrival), so idling does not bank credit. A flood from one tenant thus queues behind its own share instead of ahead of
everyone.

The order goes on below the frontend: every request let through carries an engine priority (`Turn`), its
class first, then its tenant's rank by counter (lower runs first, as in vLLM), so the engines order their
waiting queues the same way. A request whose priority is better than one this frontend has in flight is let
through at once even while workers are busy (`Turn.overtake`): it goes ahead of what the engine holds
waiting, where the frontend's order cannot reach (the router sends it to a busy worker, server/router.py).
Neither engine preempts a running sequence for a better waiting one (vLLM's V1 scheduler does not), so it
would still wait there for one running sequence to end. Hence the reserve (`--tenants-reserve` R): while a
tenant with a better priority than T's is active (something of it waiting or in flight here, or a request of
it seen in the last RECENT_S, here or through the shared counters), T's requests wait here while what is in
flight (every tenant's) fills the fleet's running slots less R per worker (`Slots`), so the best tenant's
next request finds a running slot free at once (the router sends an overtaking request to a worker with
one, server/router.py). With one tenant active nothing is reserved.

The counters are shared by every frontend through Redis: the quota script (server/tenants_quota.py) charges
a request's prompt at admission and its completion at the end, and hands back every tenant's counter, which
`sync` takes. While Redis does not answer (`SHARED_S` after the last sync) the frontend charges its own
counters instead. The lift of a tenant that becomes active is this frontend's own: `sync` adds each increase
of a shared counter on top of it.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import math
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from kvstore.load import WorkerLoad
from schemas.status import WorkerStatus
from schemas.tenants import Tenant
from server.errors import APIError
from server.tenants_quota import background

# Priority classes as engine priority bands (lower runs first); "normal" starts at 0, where requests without
# a tenant (the admin key) and interactive requests without tenants are.
_CLASS = {"high": -1, "normal": 0, "low": 1}
DEFAULT_CEILING = 99  # below the default `--batch-priority` (100)
SHARED_S = 10.0  # counters synced from Redis this recently are Redis's to charge
# A tenant seen this recently is active (its slots stay reserved between its requests): a tenant sending one
# request every few seconds keeps them; one gone quiet gives them back within this long.
RECENT_S = 10.0


@dataclass
class Turn:
    """A request let through: its engine priority, and whether it goes ahead of busy workers' queues."""

    tenant: str
    cost: float
    priority: int = 0
    overtake: bool = False


@dataclass
class Slots:
    """The fleet's running slots as the reserve sees them."""

    unreserved: int  # every worker's --max-num-seqs less the reserve (at least one each)
    others: int  # sequences other frontends hold there (of no known tenant: counted against the unreserved)


@dataclass
class _Waiter:
    turn: Turn
    granted: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


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
        priority_ceiling: int = DEFAULT_CEILING,
        slots: Callable[[], Slots | None] = lambda: None,
    ) -> None:
        self.tenants = dict(tenants)
        self.counters = dict.fromkeys(tenants, 0.0)
        self.waiting: dict[str, deque[_Waiter]] = {name: deque() for name in tenants}
        # Requests let through and not ended, per tenant: their prompt costs (charged, not yet served).
        self.inflight: dict[str, list[float]] = {name: [] for name in tenants}
        # Engine priorities of the requests let through and not ended (what a better one may overtake).
        self._held: Counter[int] = Counter()
        self._room = room
        self._wait_refreshed = wait_refreshed
        self._max_wait_s = max_wait_s
        self._max_queued = max_queued  # --max-queued-requests, as for requests waiting without tenants
        self._on_queued = on_queued  # a tenant's number of waiting requests changed (a gauge)
        self._synced_at = -SHARED_S
        self._seen = dict.fromkeys(tenants, 0.0)  # each tenant's counter as Redis last handed it back
        # Tenant priorities stay above batch items' (`--batch-priority`): at most this.
        self._ceiling = priority_ceiling
        # Requests let through since the last refresh, less those that ended: the room the refresh saw is
        # theirs until load figures that count them arrive (a burst must not all go straight through on one
        # stale figure), and a request that ends gives its place to the next at once (not at the refresh).
        self._spent = 0
        # How old load figures must be before they count what was let through (heartbeat lag): the count
        # above starts again only this long after it last did, or the same requests are given room twice.
        self._settle_s = settle_s
        self._settled_at = 0.0
        # The fleet's slots for the reserve (None: no reserve, or a worker that does not say its capacity).
        self._slots = slots
        # When each tenant last sent a request, as far as this frontend knows.
        self._seen_at = dict.fromkeys(tenants, -math.inf)

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
        """The tenant's counter without its requests waiting here or in flight (Redis charges prompts on
        arrival; this frontend charges them when they are let through)."""
        pending = sum(self.inflight[tenant])
        if self._shared():
            pending += sum(w.turn.cost for w in self.waiting[tenant])
        return self.counters[tenant] - pending / self.tenants[tenant].weight

    def room(self) -> int:
        """Places free now: what the last refresh saw, less what went through since."""
        return max(0, self._room() - self._spent)

    def sync(self, shared: Mapping[str, float]) -> None:
        """Take what every frontend charged in Redis since the last sync (keeping what this frontend lifted)."""
        if not shared:
            return
        first = self._synced_at < 0 and not any(self._seen.values())
        self._synced_at = now = time.monotonic()
        for name, value in shared.items():
            if name in self.counters and value > self._seen[name]:
                # Only the increase: a lift stays on top of it, and an older answer never lowers a counter.
                self.counters[name] += value - self._seen[name]
                self._seen[name] = value
                if not first:  # (the first answer holds all that was ever charged, not what is new)
                    # Charged by some frontend: the tenant is active there (slots are reserved for it here too).
                    self._seen_at[name] = now

    def priority(self, tenant: str) -> int:
        """The engine priority of the tenant's next request (lower runs first): its class, then how many
        tenants have a smaller counter; never below what batch items get."""
        rank = sum(c < self.counters[tenant] for c in self.counters.values())
        return min(_CLASS[self.tenants[tenant].priority] * len(self.tenants) + rank, self._ceiling)

    def _lift(self, tenant: str) -> None:
        """A tenant that becomes active starts from the smallest counter among the active ones (those seen
        recently too: a tenant served alone for a while, whose requests happen to have ended, must not find
        a newcomer below it that goes ahead of all its requests until it has caught up)."""
        if self.waiting[tenant] or self.inflight[tenant]:
            return
        now = time.monotonic()
        active = [self._served(t) for t in self.tenants if t != tenant and self._active(t, now)]
        if active:
            self.counters[tenant] = max(self.counters[tenant], min(active))

    def _priorities(self) -> dict[str, int]:
        """Every tenant's `priority` at once."""
        ordered = sorted(self.counters.values())
        n = len(self.tenants)
        return {
            name: min(_CLASS[self.tenants[name].priority] * n + bisect.bisect_left(ordered, c), self._ceiling)
            for name, c in self.counters.items()
        }

    def _active(self, tenant: str, now: float) -> bool:
        return bool(self.waiting[tenant] or self.inflight[tenant]) or now - self._seen_at[tenant] < RECENT_S

    def held_back(self, tenant: str) -> bool:
        """Whether the tenant's next request waits to leave the reserve free: an active tenant has a better
        priority, and what is in flight (of every tenant) fills every unreserved slot."""
        return self._holding()(tenant)

    def _holding(self) -> Callable[[str], bool]:
        """`held_back` of any tenant from one look at the priorities, the slots and what is in flight."""
        now = time.monotonic()
        prio = self._priorities()
        best = min((p for t, p in prio.items() if self._active(t, now)), default=None)
        full: bool | None = None  # the slots are read once, and only if a tenant is behind the best

        def held(tenant: str) -> bool:
            nonlocal full
            if best is None or prio[tenant] <= best:
                return False  # the reserve is its own (or a single tenant is active: nothing is reserved)
            if full is None:
                slots = self._slots()
                # The best tenants' own requests count too: the reserve stays free for their next one (kept
                # at R per worker it would be taken, at 1 request/s of ~1 s each, by one of theirs a third
                # of the time).
                inflight = sum(len(requests) for requests in self.inflight.values())
                full = slots is not None and inflight + slots.others >= slots.unreserved
            return full

        return held

    def _may_overtake(self, tenant: str) -> bool:
        """Whether a request of the tenant goes ahead of busy workers' queues: its priority is better than
        that of more requests in flight than the tenant has in flight itself (each overtakes one of them),
        and none of its own waits here (a tenant's requests keep their order)."""
        if self.waiting[tenant] or not self._held:
            return False
        mine = self.priority(tenant)
        worse = sum(n for p, n in self._held.items() if p > mine)
        return len(self.inflight[tenant]) < worse

    def _grant(self, turn: Turn) -> Turn:
        turn.priority = self.priority(turn.tenant)
        self.charge(turn.tenant, turn.cost)
        self.inflight[turn.tenant].append(turn.cost)
        self._held[turn.priority] += 1
        return turn

    async def wait_turn(self, tenant: str, cost: int) -> Turn:
        """Return when it is this request's turn (at once while workers have room and nobody waits, or when it
        goes ahead of a request in flight), with the engine priority it carries."""
        self._lift(tenant)
        self._seen_at[tenant] = time.monotonic()
        turn = Turn(tenant, cost)
        held = self.held_back(tenant)
        if not held and not self.queued() and self.room() > 0:
            self._spent += 1
            return self._grant(turn)
        if not held and self._may_overtake(tenant):
            # Busy workers would take it ahead of a worse request this frontend sent them: send it now.
            self._spent += 1
            turn.overtake = True
            return self._grant(turn)
        if self.queued() >= self._max_queued:
            raise _busy()
        queue = self.waiting[tenant]
        waiter = _Waiter(turn)
        queue.append(waiter)
        self._on_queued(tenant, len(queue))
        self.release()
        try:
            async with asyncio.timeout(self._max_wait_s):
                await asyncio.shield(waiter.granted)
        except BaseException as exc:
            if waiter.granted.done() and not waiter.granted.cancelled():
                self.done(turn)  # let through as its wait ended otherwise: the place goes to the next
            if isinstance(exc, TimeoutError):
                raise _busy() from None
            raise
        finally:
            if not waiter.granted.done():
                waiter.granted.cancel()
                with contextlib.suppress(ValueError):
                    queue.remove(waiter)
                self._on_queued(tenant, len(queue))
        return turn

    def done(self, turn: Turn) -> None:
        """A request that had its turn ended: its place goes to the next waiting one."""
        self._spent -= 1
        with contextlib.suppress(ValueError):
            self.inflight[turn.tenant].remove(turn.cost)
        self._held[turn.priority] -= 1
        if self._held[turn.priority] <= 0:
            del self._held[turn.priority]
        if self.queued():
            self.release()

    def _next(self) -> str | None:
        """The tenant whose request goes next: highest priority class, then smallest counter; of those not
        held back by the reserve."""
        best: tuple[int, float] | None = None
        chosen = None
        held_back = self._holding()
        for name, queue in self.waiting.items():
            if queue and not held_back(name):
                key = (_CLASS[self.tenants[name].priority], self.counters[name])
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
            if waiter.granted.done():
                continue  # its client gave up
            self._grant(waiter.turn)
            waiter.granted.set_result(None)
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


def reserved_slots(
    workers: list[WorkerStatus], remote: Mapping[str, WorkerLoad], reserve: int
) -> Slots | None:
    """The fleet's slots for the fair queue's reserve of `reserve` per worker; None without one (no reserve, no
    worker, or a worker that does not say how many sequences it runs)."""
    if reserve <= 0 or not workers or any(w.max_num_seqs <= 0 for w in workers):
        return None
    unreserved = sum(max(1, w.max_num_seqs - reserve) for w in workers)
    others = sum(remote[w.worker_id].sequences for w in workers if w.worker_id in remote)
    return Slots(unreserved, others)
