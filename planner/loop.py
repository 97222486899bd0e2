"""The planner's loop: every interval observe (registry, latency source, Kafka lag), decide, act, record."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

from kvstore.registry import Registry
from planner.actuators import Actuator
from planner.kafka_lag import KafkaLag
from planner.latency import Latency
from planner.metrics import PlannerMetrics
from planner.policy import Action, Decision, Observation, Policy
from schemas.ops_settings import PlannerPolicySettings, PlannerPool
from schemas.status import WorkerStatus

log = logging.getLogger("ferry.planner")


class LatencySource(Protocol):
    """Where TTFT, ITL and the request rate come from (planner/latency.py)."""

    async def read(self, now: float) -> Latency:
        """The last interval's numbers."""
        ...


def in_pool(w: WorkerStatus, pool: PlannerPool) -> bool:
    """Whether a worker belongs to the pool a planner sizes (decode: every role that decodes)."""
    return pool == "all" or (w.role == "prefill") == (pool == "prefill")


class Planner:
    """Owns the policy and one interval's round trip through sources, policy and actuator."""

    def __init__(
        self,
        settings: PlannerPolicySettings,
        model: str,
        registry: Registry,
        latency: LatencySource,
        lag: KafkaLag | None,
        actuator: Actuator,
        metrics: PlannerMetrics,
        clock: Callable[[], float] = time.monotonic,
        policy: Policy | None = None,
        pool: PlannerPool = "all",
    ) -> None:
        self.settings = settings
        self.model = model
        self.pool = pool
        self.policy = policy or Policy(settings)
        self._registry = registry
        self._latency = latency
        self._lag = lag
        self.actuator = actuator
        self.metrics = metrics
        self._clock = clock
        self._pool_done: tuple[float, int] | None = None  # (when, committed items) at the last look
        self._last: tuple[Action, str] | None = None
        # The recent decisions with their clock time, for tests and the benchmark.
        self.decisions: deque[tuple[float, Observation, Decision]] = deque(maxlen=10_000)

    async def observe(self, now: float) -> Observation:
        """One interval's view of the model's fleet."""
        view = await self._registry.view()
        mine = [w for w in view.live if w.model == self.model and in_pool(w, self.pool)]
        ready = [w for w in mine if not w.draining]
        lat = await self._latency.read(now)
        # Disaggregated pools answer for different latencies, as in Dynamo's planner: a prefill pool for the
        # first token (a remote prefill's TTFT is its), a decode pool for the gaps between tokens.
        ttft = lat.ttft_p90_s if self.pool != "decode" else None
        itl = lat.itl_p90_s if self.pool != "prefill" else None
        worker_lag = pool_lag = 0
        pool_rate: float | None = None
        if self._lag is not None:
            worker_lag = await self._lag.workers([w.worker_id for w in ready]) or 0
            pool = await self._lag.pool(self.model)
            if pool is not None:
                pool_lag, done = pool
                if self._pool_done is not None and now > self._pool_done[0]:
                    pool_rate = max(0, done - self._pool_done[1]) / (now - self._pool_done[0])
                self._pool_done = (now, done)
        return Observation(
            ready=len(ready),
            starting=self.actuator.starting(len(ready)),
            draining=len(mine) - len(ready),
            running=sum(w.running for w in ready),
            waiting=sum(w.waiting for w in ready),
            worker_lag=worker_lag,
            kv_usage=sum(w.kv_usage for w in ready) / len(ready) if ready else 0.0,
            arrival_rate=lat.arrival_rate,
            ttft_p90_s=ttft,
            itl_p90_s=itl,
            pool_lag=pool_lag,
            pool_rate=pool_rate,
        )

    async def step(self) -> Decision:
        """Observe, decide, act once; returns the decision."""
        now = self._clock()
        obs = await self.observe(now)
        decision = self.policy.decide(obs, now)
        self._record(obs, decision)
        self.decisions.append((now, obs, decision))
        if decision.action is not Action.HOLD:
            await self.actuator.scale(decision.desired)
        return decision

    def _record(self, obs: Observation, d: Decision) -> None:
        m = self.metrics
        m.desired.set(d.desired)
        m.decisions.labels(action=d.action.value, reason=d.reason.value).inc()
        m.ready.set(obs.ready)
        m.starting.set(obs.starting)
        m.draining.set(obs.draining)
        m.concurrency.set(obs.concurrency)
        m.predicted.set(self.policy.predicted)
        m.capacity.set(self.policy.capacity)
        m.ttft_p90.set(obs.ttft_p90_s if obs.ttft_p90_s is not None else float("nan"))
        m.itl_p90.set(obs.itl_p90_s if obs.itl_p90_s is not None else float("nan"))
        m.pool_lag.set(obs.pool_lag)
        # Scalings always at info; a hold only when its reason changed, else every interval would log a line.
        key = (d.action, d.reason.value)
        level = logging.INFO if d.action is not Action.HOLD or key != self._last else logging.DEBUG
        self._last = key
        log.log(
            level,
            "planner%s %s -> %d workers (ready %d, starting %d, draining %d), reason %s: %s",
            "" if self.pool == "all" else f" ({self.pool} pool)",
            d.action.value, d.desired, obs.ready, obs.starting, obs.draining, d.reason.value, d.detail,
        )  # fmt: skip

    async def run(self, stop: asyncio.Event) -> None:
        """Step every interval until `stop` is set; a failed interval is logged and counted, not fatal."""
        interval = self.settings.planner_interval_s
        while not stop.is_set():
            try:
                await self.step()
            except Exception as exc:
                self.metrics.errors.inc()
                log.warning("planner: interval failed (%r); trying again next interval", exc)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await stop.wait()
