"""The planner's policy: from one interval's observation to a worker count and the reason for it.

Pure logic with the time passed in, so tests drive it with a fake clock. Like Dynamo's SLA planner it sizes
the fleet from a predicted load and a per-worker capacity at the latency targets; unlike it, the capacity
is learnt from what the fleet shows (no offline profile), interactive work is sized before batch backlog,
and a scale-in removes one worker at a time, which the actuator drains (never a killed stream).

Load is concurrency: sequences running or waiting on the workers plus requests routed but not yet read
(worker-topic lag). By Little's law concurrency = arrival rate x time in system, so the next interval's
concurrency is the current one scaled by the predicted arrival rate over the current one.
"""

from __future__ import annotations

import dataclasses
import enum
import math

from schemas.ops_settings import PlannerPolicySettings

# Intervals in a row a queue beyond the headroom must be seen before it adds a worker: a burst's arrivals queue for
# an interval and clear by themselves (a prefill pool's, above all), while capacity that is short keeps them there.
QUEUE_INTERVALS = 2


class Action(enum.StrEnum):
    """What a decision does to the worker count."""

    SCALE_OUT = "scale_out"
    SCALE_IN = "scale_in"
    HOLD = "hold"


class Reason(enum.StrEnum):
    """Why; the `reason` label of ferry_planner_decisions_total."""

    BELOW_MIN = "below_min"
    ABOVE_MAX = "above_max"
    LOAD = "load_forecast"  # predicted interactive load needs more workers
    SLO_TTFT = "slo_ttft"  # TTFT p90 over target with work waiting
    SLO_ITL = "slo_itl"  # ITL p90 over target
    QUEUE = "queue"  # requests waiting on the engines or unread in worker topics beyond capacity, two intervals running
    KV_PRESSURE = "kv_pressure"
    BATCH = "batch_backlog"
    AT_MAX = "at_max"  # more were needed but max_workers holds
    STARTING = "starting"  # workers asked for earlier are not ready yet
    COOLDOWN = "cooldown"
    HYSTERESIS = "hysteresis"  # fewer would do, but not for long enough yet
    LOW_LOAD = "low_load"
    STEADY = "steady"


@dataclasses.dataclass(frozen=True)
class Observation:
    """One interval's view of the fleet; None where a source did not answer."""

    ready: int  # live, registered, not draining
    starting: int = 0  # asked for, not registered yet
    draining: int = 0
    running: int = 0  # sequences running on ready workers
    waiting: int = 0  # sequences waiting in their engines
    worker_lag: int = 0  # requests routed to a worker and not yet read by it
    kv_usage: float = 0.0  # mean over ready workers
    arrival_rate: float | None = None  # interactive requests per second over the last interval
    ttft_p90_s: float | None = None
    itl_p90_s: float | None = None
    pool_lag: int = 0  # batch items not yet taken from the pool topic
    pool_rate: float | None = None  # batch items taken per second over the last interval

    @property
    def concurrency(self) -> int:
        """Interactive work in the system: running, waiting and unread."""
        return self.running + self.waiting + self.worker_lag


@dataclasses.dataclass(frozen=True)
class Decision:
    """The worker count to have, and why."""

    desired: int
    action: Action
    reason: Reason
    detail: str = ""


class Holt:
    """Double exponential smoothing (level and trend) of a rate: forecasts a ramp, not only its level."""

    def __init__(self, alpha: float = 0.5, beta: float = 0.3) -> None:
        self.alpha, self.beta = alpha, beta
        self.level: float | None = None
        self.trend = 0.0

    def update(self, value: float) -> None:
        """Take one observation."""
        if self.level is None:
            self.level = value
            return
        last = self.level
        self.level = self.alpha * value + (1 - self.alpha) * (last + self.trend)
        self.trend = self.beta * (self.level - last) + (1 - self.beta) * self.trend

    def forecast(self, steps: float) -> float | None:
        """The value `steps` intervals ahead (never below zero)."""
        return None if self.level is None else max(0.0, self.level + steps * self.trend)


class Policy:
    """Decides a worker count once per interval; keeps the estimates and timers that need history."""

    def __init__(self, config: PlannerPolicySettings) -> None:
        self.config = config
        self.capacity = config.worker_capacity  # sequences per worker within the targets
        self.rate = Holt()
        self.predicted: float = 0.0  # the last predicted concurrency
        self._last_out = -math.inf
        self._last_in = -math.inf
        self._calm = 0  # intervals in a row that fewer workers would have done
        self._queued = 0  # intervals in a row with a queue beyond the headroom

    # ---- estimates ------------------------------------------------------------------------------

    def _learn_capacity(self, obs: Observation) -> None:
        """Move the per-worker capacity towards what this interval shows.

        Latency grows with concurrency, so at c sequences per worker with p90 latency l over the target L the
        capacity is about c x L / l: a missed target lowers the estimate (at most by half a step). A met
        target only raises it when the load was near the estimate, and to at most 1.25 x the load carried.
        Steps are smoothed, so one noisy interval cannot swing the fleet.
        """
        c = self.config
        if obs.ready == 0 or obs.concurrency == 0:
            return
        per_worker = obs.concurrency / obs.ready
        ratios = [
            t / v
            for t, v in ((c.ttft_p90_target_s, obs.ttft_p90_s), (c.itl_p90_target_s, obs.itl_p90_s))
            if v
        ]
        if not ratios:
            return
        ratio = min(ratios)
        if ratio >= 1:
            # Met targets prove the load carried, not what latency extrapolates to (at low load latency is
            # mostly fixed cost): raise the estimate only near it, and only a little beyond what was carried.
            if per_worker < 0.8 * self.capacity:
                # Far from the estimate and comfortably within the targets: drift back towards the configured
                # prior, so an overload (or a noisy neighbour) does not pin the estimate low for ever.
                if ratio >= 1.5 and self.capacity < c.worker_capacity:
                    self.capacity = min(c.worker_capacity, self.capacity * 1.1)
                return
            estimate = max(self.capacity, min(per_worker * ratio, per_worker * 1.25))
        else:
            estimate = min(self.capacity, max(per_worker * ratio, self.capacity * 0.5))
        self.capacity = max(1.0, 0.6 * self.capacity + 0.4 * estimate)

    def _forecast(self, obs: Observation) -> float:
        """Concurrency expected `lead_s` from now."""
        now = float(obs.concurrency)
        if obs.arrival_rate is None:
            return now
        self.rate.update(obs.arrival_rate)
        c = self.config
        # One interval until the next decision, plus the time a worker asked for now takes to be ready.
        ahead = self.rate.forecast(1 + c.worker_start_s / c.planner_interval_s)
        level = self.rate.level or 0.0
        if ahead is None or level <= 1e-9:
            return now
        # Little's law: concurrency scales with the arrival rate; never plan below what is already there.
        return max(now, now * ahead / level)

    def _batch_workers(self, obs: Observation) -> int:
        """Workers the batch backlog needs in all to be cleared within the horizon (0 without a backlog).

        Every worker takes batch work with its spare capacity, so this is the fleet size at which the
        pool's observed per-worker rate clears the backlog in time; decide() caps it at the batch budget.
        """
        c = self.config
        if obs.pool_lag <= 0:
            return 0
        need_rate = obs.pool_lag / c.batch_horizon_s
        if not obs.pool_rate or not obs.ready:
            return obs.ready + 1  # backlog and nothing taken: the workers have no spare capacity
        return math.ceil(need_rate / (obs.pool_rate / obs.ready))

    # ---- the decision ---------------------------------------------------------------------------

    def decide(self, obs: Observation, now: float) -> Decision:
        """The worker count to have after this interval."""
        c = self.config
        self._learn_capacity(obs)
        predicted = self.predicted = self._forecast(obs)
        current = obs.ready + obs.starting
        interactive = math.ceil(predicted / (self.capacity * c.target_utilisation))
        need, reason = max(interactive, 0), Reason.LOAD
        detail = (
            f"concurrency {obs.concurrency} -> {predicted:.1f} predicted, capacity {self.capacity:.1f}/worker, "
            f"ttft p90 {_fmt(obs.ttft_p90_s)} itl p90 {_fmt(obs.itl_p90_s)}"
        )
        # Latency over target with work queued says capacity is short whatever the estimate says.
        queued = obs.waiting + obs.worker_lag
        beyond = obs.ready and queued > obs.ready * self.capacity * (1 - c.target_utilisation)
        self._queued = self._queued + 1 if beyond else 0
        if obs.ttft_p90_s is not None and obs.ttft_p90_s > c.ttft_p90_target_s and queued > 0:
            need, reason = max(need, current + 1), Reason.SLO_TTFT
        elif obs.itl_p90_s is not None and obs.itl_p90_s > c.itl_p90_target_s and obs.running > 0:
            need, reason = max(need, current + 1), Reason.SLO_ITL
        elif obs.ready and obs.kv_usage >= c.kv_usage_high:
            need, reason = max(need, current + 1), Reason.KV_PRESSURE
        elif self._queued >= QUEUE_INTERVALS:
            need, reason = max(need, current + 1), Reason.QUEUE
        # Batch backlog gets workers of its own budget above the interactive need, never the other way.
        batch = min(self._batch_workers(obs), need + c.batch_max_workers)
        if batch > need:
            need, reason = batch, Reason.BATCH
            detail += f", pool lag {obs.pool_lag}"
        capped = need > c.max_workers
        need = min(need, c.max_workers)
        if current < c.min_workers:
            return self._out(c.min_workers, now, Reason.BELOW_MIN, detail)
        if current > c.max_workers:
            return self._in(c.max_workers, now, Reason.ABOVE_MAX, detail)
        if need > current:
            self._calm = 0
            if obs.starting:
                return Decision(current, Action.HOLD, Reason.STARTING, detail)
            if now - self._last_out < c.scale_out_cooldown_s:
                return Decision(current, Action.HOLD, Reason.COOLDOWN, detail)
            return self._out(need, now, reason, detail)
        if capped:
            self._calm = 0
            return Decision(current, Action.HOLD, Reason.AT_MAX, detail)
        return self._maybe_in(obs, need, predicted, current, now, detail)

    def _maybe_in(
        self, obs: Observation, need: int, predicted: float, current: int, now: float, detail: str
    ) -> Decision:
        """Remove one worker if the others would stay below the scale-in utilisation for long enough."""
        c = self.config
        fewer = current - 1
        fits = (
            fewer >= max(c.min_workers, need) and predicted <= fewer * self.capacity * c.scale_in_utilisation
        )
        busy = (
            obs.starting or obs.draining or obs.waiting or obs.worker_lag or obs.kv_usage >= c.kv_usage_high
        )
        if not fits or busy:
            self._calm = 0
            return Decision(current, Action.HOLD, Reason.STEADY, detail)
        self._calm += 1
        if self._calm < c.scale_in_stable:
            return Decision(current, Action.HOLD, Reason.HYSTERESIS, detail)
        if now - max(self._last_in, self._last_out) < c.scale_in_cooldown_s:
            return Decision(current, Action.HOLD, Reason.COOLDOWN, detail)
        return self._in(fewer, now, Reason.LOW_LOAD, detail)

    def _out(self, desired: int, now: float, reason: Reason, detail: str) -> Decision:
        self._last_out = now
        self._calm = 0
        return Decision(desired, Action.SCALE_OUT, reason, detail)

    def _in(self, desired: int, now: float, reason: Reason, detail: str) -> Decision:
        self._last_in = now
        self._calm = 0
        return Decision(desired, Action.SCALE_IN, reason, detail)


def _fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v * 1000:.0f}ms"
