"""`ferry up`: broker, Redis, workers and a frontend on one machine, stopped together."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import secrets
import signal
import sys
from collections.abc import Awaitable, Sequence
from typing import Any

from launch.autoscale import LocalPlanner, LocalWorkers, start_planner
from launch.flags import ENGINE_EPILOG, EPILOG, add_flags, from_namespace, given, split_engine_flags, to_argv
from launch.model_prepare import ModelPrepareError
from launch.model_source import resolve_model
from launch.monitor import Monitor, start_monitor
from launch.role_flags import ROLES, RoleFlags, parse_role_flags
from launch.services import Child, free_port, start_broker, start_redis
from launch.supervise import READY_MARK, WorkerSupervisor
from schemas.ops_settings import PlannerPolicySettings, PlannerPool, StackSettings
from schemas.settings import ENV_PREFIX, FrontendSettings, WorkerSettings
from server.tenants import TenantsError, configured_tenants
from workers.engine_choice import kv_connector_given
from workers.vllm_kv_transfer import NIXL_CONNECTORS, NIXL_PORT_ENV

log = logging.getLogger("ferry.stack")

# The launcher names each child itself, so these are not flags of `ferry up`.
PER_CHILD = ("frontend_id", "worker_id")
# Set on each child from what the launcher started or chose.
_CHOSEN = ("kafka", "redis", "port")
# Children's settings whose default differs when `ferry up` starts its own broker: the embedded broker never
# trims a topic and slows as a partition grows (docs/architecture.md, broker quirks "slow long partitions"
# and "no DeleteRecords, no retention"), so request topics roll there, and pool and batch results topics
# hourly, unless the operator chose otherwise.
EMBEDDED_BROKER_DEFAULTS: dict[str, Any] = {"request_roll_s": 60.0, "pool_roll_s": 3600.0}


@dataclasses.dataclass
class Stack:
    """`ferry up`'s command line: its own settings, each child's, and the flags given for each child."""

    settings: StackSettings
    frontend: FrontendSettings
    worker: WorkerSettings
    frontend_flags: list[str]
    worker_flags: list[str]
    planner: PlannerPolicySettings = dataclasses.field(default_factory=PlannerPolicySettings)
    # vLLM's own engine flags, passed to every worker after `--`.
    engine_flags: list[str] = dataclasses.field(default_factory=list)
    # The settings given as flags, which the children are passed.
    passed: set[str] = dataclasses.field(default_factory=set)
    # Each pool's own flags (--prefill-flags, --decode-flags), passed after the ones above.
    role_flags: dict[str, RoleFlags] = dataclasses.field(default_factory=dict)


def stack_parser() -> argparse.ArgumentParser:
    """`ferry up`'s flags: its own, then every frontend and worker flag but the per-child ids."""
    parser = argparse.ArgumentParser(
        prog="ferry up",
        usage="%(prog)s [flags] [vLLM engine flags] [-- vLLM engine flags]",
        description="The whole system on one machine: an embedded Kafka broker and Redis (unless --kafka / "
        "--redis name running ones), N workers and a frontend. Takes every flag of `ferry frontend` and "
        "`ferry worker` but their ids, and passes each child the ones it takes.",
        epilog=f"{EPILOG} {ENGINE_EPILOG}",
        allow_abbrev=False,
    )
    taken = set(PER_CHILD)
    for cls in (StackSettings, FrontendSettings, WorkerSettings, PlannerPolicySettings):
        add_flags(parser, cls, taken)
    return parser


def load_stack(argv: Sequence[str] | None = None) -> Stack:
    """Parse `ferry up`'s flags and FERRY_* variables."""
    parser = stack_parser()
    ns, engine_flags = split_engine_flags(parser, argv)
    frontend, worker = from_namespace(FrontendSettings, ns), from_namespace(WorkerSettings, ns)
    per_child = {"--" + name.replace("_", "-") for name in PER_CHILD}
    named = per_child.intersection(flag.split("=")[0] for flag in engine_flags)
    if named:
        parser.error(f"{', '.join(sorted(named))}: `ferry up` names each child itself")
    if engine_flags and worker.engine != "vllm":
        parser.error(f"vLLM engine flags need --engine vllm: {' '.join(engine_flags)}")
    # Only what was given as a flag is passed on: a child reads the same variables and defaults itself,
    # and a key set through FERRY_API_KEYS stays out of `ps`.
    passed = given(ns) - set(_CHOSEN)
    settings, planner = from_namespace(StackSettings, ns), from_namespace(PlannerPolicySettings, ns)
    if not settings.kafka:
        frontend, worker, passed = _embedded_defaults(frontend, worker, passed)
    try:  # a bad tenants file stops `ferry up` before anything starts
        configured_tenants(frontend.tenants, frontend.api_keys)
    except TenantsError as exc:
        raise SystemExit(f"ferry up: {exc}") from None
    pools = settings.prefill_workers + settings.decode_workers
    if (
        settings.workers + pools <= 0
        or min(settings.workers, settings.prefill_workers, settings.decode_workers) < 0
    ):
        raise SystemExit(
            "ferry up: --workers, --prefill-workers and --decode-workers must start at least one worker"
        )
    if settings.prefill_workers and not settings.workers + settings.decode_workers:
        raise SystemExit(
            "ferry up: prefill workers need a worker that decodes (--decode-workers or --workers)"
        )
    if pools and "role" in given(ns):
        raise SystemExit(
            "ferry up: --prefill-workers/--decode-workers start workers with their roles; they do not combine "
            "with --role"
        )
    if pools and settings.autoscale and settings.workers:
        raise SystemExit(
            "ferry up --autoscale: with --prefill-workers/--decode-workers the planners size those two pools; "
            f"--workers must then be 0, not {settings.workers}"
        )
    sizes = {role: getattr(settings, f"{role}_workers") for role in ROLES}
    role_flags = {
        role: parse_role_flags(role, text, worker.engine)
        for role in ROLES
        if (text := getattr(settings, f"{role}_flags"))
    }
    for role in role_flags:
        if not sizes[role]:
            raise SystemExit(f"ferry up: --{role}-flags without --{role}-workers: no worker would take them")
    pool_engine_flags = [
        [*engine_flags, *role_flags.get(role, RoleFlags()).engine] for role in ROLES if sizes[role]
    ]
    if pools and worker.engine == "vllm" and not all(kv_connector_given(f) for f in pool_engine_flags):
        raise SystemExit(
            "ferry up: vLLM prefill and decode workers need a KV connector between their engines: pass vLLM's "
            "--kv-transfer-config after -- or in --prefill-flags and --decode-flags (docs/architecture.md, "
            '"Disaggregated prefill and decode")'
        )
    nixl = any(name in flag for flags in pool_engine_flags for flag in flags for name in NIXL_CONNECTORS)
    if worker.engine == "vllm" and nixl and settings.workers + pools > 1 and NIXL_PORT_ENV in os.environ:
        # Each worker picks a free side-channel port unless this is set; set for all, they would collide.
        raise SystemExit(
            f"ferry up: {NIXL_PORT_ENV} gives every NIXL engine on this host the same side-channel port: unset "
            "it, and each worker picks a free one"
        )
    starting = {f"{role}-workers": n for role, n in sizes.items()} if pools else {"workers": settings.workers}
    for flag, count in starting.items():
        if settings.autoscale and not planner.min_workers <= count <= planner.max_workers:
            raise SystemExit(
                f"ferry up --autoscale: --{flag} {count} (the starting count) must lie between "
                f"--min-workers {planner.min_workers} and --max-workers {planner.max_workers}"
            )
    return Stack(settings, frontend, worker, to_argv(frontend, only=passed), to_argv(worker, only=passed),
                 planner, engine_flags, passed, role_flags)  # fmt: skip


def _embedded_defaults(
    frontend: FrontendSettings, worker: WorkerSettings, passed: set[str]
) -> tuple[FrontendSettings, WorkerSettings, set[str]]:
    """The children's settings with `EMBEDDED_BROKER_DEFAULTS` for those the operator set neither as a flag
    nor as a FERRY_* variable."""
    chosen = {
        name: value
        for name, value in EMBEDDED_BROKER_DEFAULTS.items()
        if name not in passed and ENV_PREFIX + name.upper() not in os.environ
    }
    return (
        dataclasses.replace(frontend, **chosen),
        dataclasses.replace(worker, **chosen),
        passed | set(chosen),
    )


def resolve_stack_model(stack: Stack) -> Stack:
    """`stack` with a GGUF `--model` converted here, once, before any child starts: the children are given
    the model directory and the served name derived from the file (launch/model_source.py)."""
    try:
        worker = resolve_model(stack.worker)
    except ModelPrepareError as exc:
        raise SystemExit(f"ferry up: {exc}") from None
    if worker.model_path == stack.worker.model_path:
        return stack
    frontend = dataclasses.replace(stack.frontend, model_path=worker.model_path)
    passed = stack.passed | {"model_path", "served_model_name"}
    return dataclasses.replace(
        stack, frontend=frontend, worker=worker, frontend_flags=to_argv(frontend, only=passed),
        worker_flags=to_argv(worker, only=passed), passed=passed,
    )  # fmt: skip


def _worker_argv(stack: Stack, kafka: str, redis: str, name: str, role: str = "") -> list[str]:
    own = stack.role_flags.get(role, RoleFlags())
    engine_flags = [*stack.engine_flags, *own.engine]
    return [
        sys.executable, "-m", "launch", "worker",
        "--worker-id", name, "--kafka", kafka, "--redis", redis,
        *stack.worker_flags,
        *(["--role", role] if role else []),
        *own.worker,
        *(["--", *engine_flags] if engine_flags else []),
    ]  # fmt: skip


def _frontend_argv(stack: Stack, kafka: str, redis: str, port: int) -> list[str]:
    return [
        sys.executable, "-m", "launch", "frontend",
        "--port", str(port),
        # A fresh replies topic per run: Tansu keeps every record and slows as a topic grows.
        "--frontend-id", f"frontend-{secrets.token_hex(3)}",
        "--kafka", kafka, "--redis", redis,
        *stack.frontend_flags,
    ]  # fmt: skip


@dataclasses.dataclass
class Started:
    """Where the started stack is."""

    url: str
    kafka: str
    redis: str


async def _start(
    stack: Stack, services: list[Child | Monitor], workers: list[Child], fronts: list[Child]
) -> Started:
    """Start services, workers and the frontend (recording each child as it starts)."""
    s, fe = stack.settings, stack.frontend
    kafka, redis = s.kafka, s.redis
    if not kafka:
        child, kafka = await start_broker()
        services.append(child)
        log.info("embedded Kafka broker (Tansu) on %s", kafka)
    if not redis:
        child, redis = await start_redis()
        services.append(child)
        log.info("embedded Redis on %s", redis)
    for i in range(s.workers):
        workers.append(await Child.spawn(f"worker-{i}", _worker_argv(stack, kafka, redis, f"worker-{i}")))
    # Disaggregated pools (docs/architecture.md, "Disaggregated prefill and decode").
    for role, n in (("prefill", s.prefill_workers), ("decode", s.decode_workers)):
        for i in range(n):
            name = f"{role}-{i}"
            workers.append(await Child.spawn(name, _worker_argv(stack, kafka, redis, name, role)))
    await asyncio.gather(
        *(
            w.wait_for_line(lambda line: line.startswith(READY_MARK), s.ready_timeout_s)
            for w in workers
        )
    )
    port = fe.port or free_port(fe.host)
    fronts.append(await Child.spawn("frontend", _frontend_argv(stack, kafka, redis, port)))
    await fronts[0].wait_for_line(lambda line: line.startswith("ferry-frontend-ready"), s.ready_timeout_s)
    url = f"http://{fe.host}:{port}"
    monitoring = ""
    if s.monitor:
        monitor = await start_monitor(f"{url}/discovery/prometheus")
        services.append(monitor)
        monitoring = f"Prometheus {monitor.url}  (targets: {url}/discovery/prometheus)\n"
    # The frontend inherits FERRY_API_KEYS / FERRY_ADMIN_KEY from this process's environment (variables,
    # not flags, so keys never show in `ps`) unless they were flags here; the example names the header
    # without printing a key.
    auth = "-H 'Authorization: Bearer YOUR_KEY' " if fe.api_keys else ""
    p = stack.planner
    pools = s.prefill_workers or s.decode_workers
    scaling = (
        f", autoscaled {p.min_workers}-{p.max_workers}{' per pool' if pools else ''}" if s.autoscale else ""
    )
    if pools:
        scaling += f", {s.prefill_workers} prefill + {s.decode_workers} decode"
    print(
        f"\nFerry is up: {url}  (model {fe.served_model_name}, {s.workers} {stack.worker.engine} worker(s)"
        f"{scaling})\n"
        f"Kafka {kafka}  Redis {redis}  metrics {url}/metrics\n{monitoring}\n"
        f"  curl -N {url}/v1/chat/completions {auth}-H 'Content-Type: application/json' \\\n"
        f'    -d \'{{"model": "{fe.served_model_name}", "stream": true, '
        f'"messages": [{{"role": "user", "content": "What is the capital of France?"}}]}}\'\n\n'
        f"Press Ctrl-C to stop.\n"
        f"ferry-ready {url}",
        flush=True,
    )
    return Started(url, kafka, redis)


async def _autoscale(
    stack: Stack, started: Started, workers: list[Child], planners: list[LocalPlanner]
) -> None:
    """Hand the started workers to local actuators and build a planner on each (recording each as it starts):
    one for the aggregated workers, or one per pool (prefill sized by TTFT, decode by ITL, as
    deploy/kubernetes-disagg does)."""
    s, p = stack.settings, stack.planner
    pools: tuple[PlannerPool, ...] = (
        ("prefill", "decode") if s.prefill_workers + s.decode_workers else ("all",)
    )
    for pool in pools:
        role = "" if pool == "all" else pool

        def spawn(name: str, role: str = role) -> Awaitable[Child]:
            return Child.spawn(name, _worker_argv(stack, started.kafka, started.redis, name, role))

        actuator = LocalWorkers(spawn, stack.worker, s.ready_timeout_s, pool)
        actuator.adopt([w for w in workers if w.name.startswith(f"{actuator.prefix}-")])
        local = await start_planner(p, stack.worker, started.kafka, started.redis, actuator)
        planners.append(local)
        sized = "workers" if pool == "all" else f"{pool} pool"
        ttft, itl = f"TTFT p90 <= {p.ttft_p90_target_s}s", f"ITL p90 <= {p.itl_p90_target_s}s"
        target = {"prefill": ttft, "decode": itl}.get(pool, f"{ttft}, {itl}")
        print(
            f"planner: {sized} {p.min_workers}-{p.max_workers}, {target}; its metrics {local.metrics_url}",
            flush=True,
        )


async def run_stack(stack: Stack) -> int:
    """Start everything, print how to use it, and stop everything on SIGINT/SIGTERM or a crash."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    services: list[Child | Monitor] = []
    workers: list[Child] = []
    fronts: list[Child] = []
    stopping = asyncio.create_task(stop.wait())
    starting = asyncio.create_task(_start(stack, services, workers, fronts))
    planners: list[LocalPlanner] = []
    code = 0
    try:
        await asyncio.wait([starting, stopping], return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            log.info("interrupted while starting; stopping what was started")
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
            return 130
        started = starting.result()
        children = [*fronts, *workers]
        watched: list[asyncio.Future[Any]] = []
        if stack.settings.autoscale:
            # The planner owns the workers from here: they come and go, and a crashed one is replaced.
            await _autoscale(stack, started, workers, planners)
            for monitor in (m for m in services if isinstance(m, Monitor)):
                monitor.scrape_planners({local.planner.pool: local.metrics_url for local in planners})
            workers.clear()
            children = [*fronts]
            watched += [asyncio.create_task(local.planner.run(stop), name="the planner") for local in planners]
        else:
            # A worker that exits is started again (launch/supervise.py); the stack stops only with its frontend.
            children = [*fronts]

            def respawn(name: str) -> Awaitable[Child]:
                role = name.rpartition("-")[0]
                argv = _worker_argv(stack, started.kafka, started.redis, name, "" if role == "worker" else role)
                return Child.spawn(name, argv)

            supervisor = WorkerSupervisor(workers, respawn, stack.settings.ready_timeout_s)
            watched.append(asyncio.create_task(supervisor.run(), name="the worker supervisor"))
        watched += [asyncio.create_task(c.proc.wait()) for c in children]
        done, _ = await asyncio.wait([stopping, *watched], return_when=asyncio.FIRST_COMPLETED)
        if stopping not in done:
            crashed = [c.name for c in children if c.proc.returncode is not None] or [
                t.get_name() for t in done if isinstance(t, asyncio.Task)
            ]
            log.error("%s exited unexpectedly; stopping the stack", ", ".join(crashed))
            for t in done:
                if isinstance(t, asyncio.Task) and not t.cancelled() and t.exception() is not None:
                    log.error("%s failed", t.get_name(), exc_info=t.exception())
            code = 1
        for t in watched:
            t.cancel()
        await asyncio.gather(*watched, return_exceptions=True)  # (a worker being started again is in the list)
    except (TimeoutError, RuntimeError) as exc:
        log.error("the stack did not come up: %s", exc)
        code = 1
    finally:
        stopping.cancel()
        # Frontend first (no new requests), then workers (drain), then the services they use.
        for front in fronts:
            await front.stop()
        await asyncio.gather(*(w.stop() for w in workers))
        for local in planners:
            await local.actuator.stop_all()
            await local.close()
        for child in reversed(services):
            with contextlib.suppress(Exception):
                await child.stop()
        log.info("stack stopped")
    return code
