"""`ferry planner`: the autoscaler as a process of its own, for fleets the launcher does not start."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Sequence

import httpx
import uvloop
from prometheus_client import start_http_server

from kvstore.connect import redis_client
from kvstore.registry import Registry
from launch.flags import load
from launch.log_setup import setup_logging
from planner.actuators import Actuator, GaugeOnly, KubernetesDeployment
from planner.kafka_lag import KafkaLag
from planner.latency import FrontendScraper, PrometheusSource, fixed_frontends, registered_frontends
from planner.loop import LatencySource, Planner
from planner.metrics import PlannerMetrics
from schemas.names import RedisKeys
from schemas.ops_settings import PlannerSettings

log = logging.getLogger("ferry.planner")


def _actuator(s: PlannerSettings) -> Actuator:
    if s.actuator == "kubernetes":
        return KubernetesDeployment.in_cluster(s.k8s_namespace, s.k8s_deployment, s.k8s_api)
    return GaugeOnly()


async def run(s: PlannerSettings) -> int:
    """Run the planner until SIGINT/SIGTERM."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    redis = redis_client(s.redis)
    http = httpx.AsyncClient()
    registry = Registry(redis, RedisKeys(s.redis_prefix))
    latency: LatencySource
    if s.prometheus:
        latency = PrometheusSource(http, s.prometheus, s.served_model_name, 2 * s.planner_interval_s)
    elif s.frontends:
        latency = FrontendScraper(http, fixed_frontends(s.frontends.split(",")), s.served_model_name)
    else:
        latency = FrontendScraper(
            http, registered_frontends(registry, s.served_model_name), s.served_model_name
        )
    lag = KafkaLag(s.kafka)
    metrics = PlannerMetrics()
    server, _thread = start_http_server(s.planner_port, addr=s.planner_host, registry=metrics.registry)
    actuator = _actuator(s)
    try:
        await lag.start()
        planner = Planner(
            s,
            s.served_model_name,
            registry,
            latency,
            lag,
            actuator,
            metrics,
            pool=s.planner_pool,
        )
        # A line for launchers to wait on, printed whatever the log level.
        print(f"ferry-planner-ready http://{s.planner_host}:{server.server_port}/metrics", flush=True)
        log.info(
            "planner for %s: %d-%d workers, actuator %s, latency from %s",
            s.served_model_name, s.min_workers, s.max_workers, s.actuator, s.prometheus or s.frontends or "the registry's frontends",
        )  # fmt: skip
        await planner.run(stop)
    finally:
        server.shutdown()
        await lag.close()
        await http.aclose()
        await redis.aclose()
        if isinstance(actuator, KubernetesDeployment):
            await actuator.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`ferry planner [flags]`."""
    s = load(PlannerSettings, argv, prog="ferry planner")
    if not s.min_workers <= s.max_workers:
        raise SystemExit("ferry planner: --min-workers must not exceed --max-workers")
    setup_logging(s.log_level)
    return uvloop.run(run(s))
