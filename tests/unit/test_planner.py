"""The planner's policy with a fake clock, its latency arithmetic, and the Kubernetes actuator against a fake
API server (a local HTTP server that records the PATCH; no real cluster is used)."""

from __future__ import annotations

import asyncio
import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from threading import Thread
from typing import Any, ClassVar

import httpx
import pytest

from planner.actuators import GaugeOnly, KubernetesDeployment
from planner.latency import ITL, TTFT, parse_histograms, quantile
from planner.policy import Action, Observation, Policy, Reason
from schemas.ops_settings import PlannerPolicySettings

CFG = PlannerPolicySettings(
    min_workers=1, max_workers=6, ttft_p90_target_s=1.0, itl_p90_target_s=0.05, planner_interval_s=5.0,
    worker_capacity=8.0, scale_out_cooldown_s=10.0, scale_in_cooldown_s=30.0, scale_in_stable=3,
    worker_start_s=5.0,
)  # fmt: skip


def obs(ready: int, running: int, rate: float, **kw: Any) -> Observation:
    return Observation(
        ready=ready,
        running=running,
        arrival_rate=rate,
        ttft_p90_s=kw.pop("ttft", 0.2),
        itl_p90_s=kw.pop("itl", 0.02),
        **kw,
    )


def test_load_within_capacity_holds() -> None:
    p = Policy(CFG)
    d = p.decide(obs(2, 6, 3.0), now=0)
    assert (d.action, d.desired) == (Action.HOLD, 2)


def test_rising_load_scales_out_ahead_of_the_slo() -> None:
    p = Policy(CFG)
    t, decisions = 0.0, []
    for rate in (2, 4, 6, 8, 10):
        running = int(rate * 2)  # Little: 2 s in the system
        decisions.append(p.decide(obs(2, running, rate), now=t))
        t += 5
    outs = [d for d in decisions if d.action is Action.SCALE_OUT]
    assert outs and outs[0].reason is Reason.LOAD
    # The trend is forecast: the first scale-out asks for more than today's concurrency alone needs.
    first = next(i for i, d in enumerate(decisions) if d.action is Action.SCALE_OUT)
    today = (2 + 2 * first) * 2 / (CFG.worker_capacity * CFG.target_utilisation)
    assert outs[0].desired > today


def test_slo_violation_with_a_queue_adds_a_worker_even_if_the_estimate_says_enough() -> None:
    p = Policy(CFG)
    d = p.decide(obs(2, 4, 2.0, ttft=3.0, waiting=3), now=0)
    assert (d.action, d.reason, d.desired) == (Action.SCALE_OUT, Reason.SLO_TTFT, 3)
    assert p.capacity < CFG.worker_capacity  # and the capacity estimate learnt from it


def test_a_queue_beyond_the_headroom_adds_a_worker_once_it_stood_for_two_intervals() -> None:
    # Two workers of capacity 8 at 70 % leave a headroom of 4.8 queued requests; the targets are met, and the
    # forecast (10 in the system) needs no third worker.
    queue, calm = obs(2, 4, 2.0, waiting=6), obs(2, 4, 2.0)
    p = Policy(CFG)
    # A burst's queue that is gone by the next interval adds nothing ...
    for t, o in enumerate([queue, calm, queue, calm]):
        assert p.decide(o, now=5 * t).action is Action.HOLD
    # ... one that stays does.
    assert p.decide(queue, now=20).action is Action.HOLD
    d = p.decide(queue, now=25)
    assert (d.action, d.reason, d.desired) == (Action.SCALE_OUT, Reason.QUEUE, 3)


def test_a_capacity_learnt_in_an_overload_recovers_when_the_targets_are_met_comfortably() -> None:
    p = Policy(CFG)
    for i in range(6):
        p.decide(obs(3, 30, 5.0, ttft=4.0, itl=0.2, waiting=10), now=5 * i)
    low = p.capacity
    assert low < CFG.worker_capacity / 2
    for i in range(30):
        p.decide(obs(3, 2, 0.5, ttft=0.2, itl=0.01), now=100 + 5 * i)
    assert low < p.capacity <= CFG.worker_capacity


def test_cooldown_and_starting_workers_hold_a_second_scale_out() -> None:
    p = Policy(CFG)
    assert p.decide(obs(2, 4, 2.0, ttft=3.0, waiting=3), now=0).action is Action.SCALE_OUT
    d = p.decide(obs(2, 4, 2.0, ttft=3.0, waiting=3, starting=1), now=5)
    assert (d.action, d.reason) == (Action.HOLD, Reason.STARTING)
    d = p.decide(obs(3, 4, 2.0, ttft=3.0, waiting=3), now=6)
    assert (d.action, d.reason) == (Action.HOLD, Reason.COOLDOWN)
    assert p.decide(obs(3, 4, 2.0, ttft=3.0, waiting=3), now=11).action is Action.SCALE_OUT


def test_scale_in_needs_stable_low_load_and_removes_one_worker_at_a_time() -> None:
    p = Policy(CFG)
    seen = [p.decide(obs(4, 1, 0.5), now=100 + 5 * i) for i in range(4)]
    assert [d.reason for d in seen[:2]] == [Reason.HYSTERESIS, Reason.HYSTERESIS]
    d = seen[2]
    assert (d.action, d.desired, d.reason) == (Action.SCALE_IN, 3, Reason.LOW_LOAD)
    # The next one waits out the scale-in cooldown, however calm it is.
    later = [p.decide(obs(3, 1, 0.5), now=115 + 5 * i) for i in range(1, 6)]
    assert all(x.action is Action.HOLD for x in later[:4])


def test_a_blip_resets_the_scale_in_count() -> None:
    p = Policy(CFG)
    p.decide(obs(4, 1, 0.5), now=0)
    p.decide(obs(4, 1, 0.5), now=5)
    p.decide(obs(4, 1, 0.5, waiting=2), now=10)  # work waiting: not calm
    assert p.decide(obs(4, 1, 0.5), now=15).reason is Reason.HYSTERESIS


def test_never_below_min_nor_above_max() -> None:
    p = Policy(CFG)
    d = p.decide(Observation(ready=0), now=0)
    assert (d.action, d.desired, d.reason) == (Action.SCALE_OUT, 1, Reason.BELOW_MIN)
    d = Policy(CFG).decide(obs(6, 200, 50.0, ttft=5.0, waiting=40), now=0)
    assert (d.action, d.desired, d.reason) == (Action.HOLD, 6, Reason.AT_MAX)
    p = Policy(CFG)
    assert all(p.decide(obs(1, 0, 0.0), now=10 * i).action is Action.HOLD for i in range(10))


def test_batch_backlog_scales_within_its_budget_and_below_interactive() -> None:
    p = Policy(CFG)
    d = p.decide(obs(2, 2, 1.0, pool_lag=100_000, pool_rate=10.0), now=0)
    assert (d.action, d.reason) == (Action.SCALE_OUT, Reason.BATCH)
    # The budget caps it, however large the backlog: interactive needs one worker here, batch two more.
    assert d.desired == 1 + CFG.batch_max_workers
    # Batch never takes the last places from interactive load: at max, interactive need decides.
    p = Policy(CFG)
    d = p.decide(obs(5, 40, 20.0, pool_lag=100_000, pool_rate=1.0), now=0)
    assert d.desired <= CFG.max_workers
    # A backlog that is being cleared in time adds nothing.
    assert Policy(CFG).decide(obs(2, 2, 1.0, pool_lag=100, pool_rate=10.0), now=0).action is Action.HOLD


def test_a_batch_backlog_keeps_its_budget_of_workers_from_draining() -> None:
    p = Policy(CFG)
    ready, lowest = 4, 4
    for i in range(40):
        d = p.decide(obs(ready, 0, 0.0, pool_lag=50_000, pool_rate=3.0 * ready), now=100 + 5 * i)
        ready = d.desired
        lowest = min(lowest, ready)
    # No interactive load: the fleet drains down to the batch budget and no further.
    assert lowest == ready == CFG.batch_max_workers


def test_quantile_interpolates_like_prometheus() -> None:
    buckets = {0.1: 50.0, 0.5: 90.0, 1.0: 100.0, float("inf"): 100.0}
    assert quantile(0.5, buckets) == pytest.approx(0.1)
    assert quantile(0.9, buckets) == pytest.approx(0.5)
    assert quantile(0.95, buckets) == pytest.approx(0.75)
    assert quantile(0.9, {}) is None


def test_histograms_are_summed_over_label_sets_of_the_model_only() -> None:
    text = "\n".join([
        f"# TYPE {TTFT} histogram",
        f'{TTFT}_bucket{{le="0.5",model="m",worker="a"}} 3',
        f'{TTFT}_bucket{{le="+Inf",model="m",worker="a"}} 4',
        f'{TTFT}_bucket{{le="0.5",model="m",worker="b"}} 1',
        f'{TTFT}_bucket{{le="+Inf",model="m",worker="b"}} 1',
        f'{TTFT}_bucket{{le="0.5",model="other"}} 100',
        f'{TTFT}_bucket{{le="+Inf",model="other"}} 100',
        f'{TTFT}_count{{model="m"}} 5',
        "",
    ])  # fmt: skip
    got = parse_histograms(text, (TTFT, ITL), "m")
    assert got[TTFT] == {0.5: 4.0, float("inf"): 5.0} and got[ITL] == {}


PATH = "/apis/apps/v1/namespaces/llm/deployments/ferry-worker/scale"


async def test_the_gauge_keeps_asking_for_workers_someone_else_starts() -> None:
    gauge = GaugeOnly()
    assert gauge.starting(registered=1) == 0
    await gauge.scale(3)
    assert gauge.starting(registered=1) == 2  # KEDA has not started them yet: still wanted
    assert gauge.starting(registered=3) == 0
    await gauge.scale(2)
    assert gauge.starting(registered=3) == 0


class _FakeApi(BaseHTTPRequestHandler):
    """A Kubernetes API server that knows one Deployment's scale subresource."""

    replicas = 2
    patches: ClassVar[list[tuple[str, str, dict[str, Any]]]] = []

    def _send(self, code: int, body: dict[str, Any]) -> None:
        raw = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def _scale(self) -> dict[str, Any]:
        return {"kind": "Scale", "apiVersion": "autoscaling/v1", "spec": {"replicas": self.replicas},
                "status": {"replicas": self.replicas}}  # fmt: skip

    def do_GET(self) -> None:
        if self.path != PATH:
            return self._send(404, {"kind": "Status", "code": 404})
        self._send(200, self._scale())

    def do_PATCH(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path != PATH:
            return self._send(404, {"kind": "Status", "code": 404})
        type(self).patches.append((self.path, self.headers["Content-Type"], body))
        if self.headers["Content-Type"] != "application/merge-patch+json":
            return self._send(415, {"kind": "Status", "code": 415})
        type(self).replicas = int(body["spec"]["replicas"])
        self._send(200, self._scale())

    def log_message(self, *args: Any) -> None:
        pass


async def test_kubernetes_actuator_patches_the_deployment_scale() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeApi)
    Thread(target=server.serve_forever, daemon=True).start()
    api = f"http://127.0.0.1:{server.server_port}"
    act = KubernetesDeployment(httpx.AsyncClient(), api, "llm", "ferry-worker")
    try:
        assert await act.replicas() == (2, 2)
        await act.scale(5)
        assert _FakeApi.patches[-1] == (
            "/apis/apps/v1/namespaces/llm/deployments/ferry-worker/scale",
            "application/merge-patch+json",
            {"spec": {"replicas": 5}},
        )
        assert await act.replicas() == (5, 5)
        assert act.starting(registered=3) == 2
        wrong = KubernetesDeployment(httpx.AsyncClient(), api, "llm", "nope")
        with pytest.raises(httpx.HTTPStatusError):
            await wrong.scale(1)
        await wrong.close()
    finally:
        await act.close()
        await asyncio.to_thread(server.shutdown)


async def test_a_planner_per_pool_counts_its_pool_and_the_latency_it_answers_for() -> None:
    """With prefill and decode pools, each planner sees only its workers; prefill is sized by TTFT, decode by ITL."""
    from types import SimpleNamespace

    import msgspec

    from planner.latency import Latency
    from planner.loop import Planner
    from planner.metrics import PlannerMetrics
    from schemas.status import WorkerStatus

    def worker(wid: str, role: Any, running: int) -> WorkerStatus:
        return WorkerStatus(wid, "m", "sim", 64, 100, 8192, 0.0, 0.0, running=running, role=role)

    fleet = [worker("p1", "prefill", 1), worker("p2", "prefill", 2), worker("d1", "decode", 10),
             worker("b1", "both", 20), msgspec.structs.replace(worker("x1", "prefill", 50), model="other")]  # fmt: skip

    class Registry:
        async def view(self) -> Any:
            return SimpleNamespace(live=fleet)

    class Source:
        async def read(self, now: float) -> Latency:
            return Latency(ttft_p90_s=0.8, itl_p90_s=0.04, arrival_rate=3.0)

    def planner(pool: Any) -> Planner:
        return Planner(CFG, "m", Registry(), Source(), None, GaugeOnly(), PlannerMetrics(), pool=pool)  # type: ignore[arg-type]

    seen = {pool: await planner(pool).observe(0.0) for pool in ("all", "prefill", "decode")}
    assert [(o.ready, o.running) for o in seen.values()] == [(4, 33), (2, 3), (2, 30)]
    assert (seen["all"].ttft_p90_s, seen["all"].itl_p90_s) == (0.8, 0.04)
    assert (seen["prefill"].ttft_p90_s, seen["prefill"].itl_p90_s) == (0.8, None)
    assert (seen["decode"].ttft_p90_s, seen["decode"].itl_p90_s) == (None, 0.04)
    assert {o.arrival_rate for o in seen.values()} == {3.0}
