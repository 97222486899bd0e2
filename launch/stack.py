"""`ferry up`: broker, Redis, workers and a frontend on one machine, stopped together."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import signal
import sys

from launch.flags import load, to_argv
from launch.services import Child, free_port, start_broker, start_redis
from schemas.settings import FrontendSettings, StackSettings

log = logging.getLogger("ferry.stack")


# Stack settings each child takes under the same flag, passed through as they are.
_SHARED = ("redis_prefix", "model_path", "served_model_name", "heartbeat_interval_s", "log_level")
_WORKER = ("engine", "speedup", "block_size", "num_blocks", "max_model_len")
_FRONTEND = (
    "host", "router_policy", "kv_events", "inflight_overlap", "decode_load", "overlap_weight", "router_temperature",
    "migration_limit",
)


def _worker_argv(s: StackSettings, kafka: str, redis: str, index: int) -> list[str]:
    return [
        sys.executable, "-m", "launch", "worker",
        "--worker-id", f"worker-{index}", "--kafka", kafka, "--redis", redis,
        *to_argv(s, only=_SHARED + _WORKER),
    ]  # fmt: skip


def _frontend_argv(s: StackSettings, kafka: str, redis: str, port: int) -> list[str]:
    return [
        sys.executable, "-m", "launch", "frontend",
        "--port", str(port),
        # A fresh replies topic per run: Tansu keeps every record and slows as a topic grows.
        "--frontend-id", f"frontend-{secrets.token_hex(3)}",
        "--kafka", kafka, "--redis", redis,
        *to_argv(s, only=_SHARED + _FRONTEND),
    ]  # fmt: skip


async def _start(s: StackSettings, services: list[Child], workers: list[Child], fronts: list[Child]) -> str:
    """Start services, workers and the frontend (recording each child as it starts); return the URL."""
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
        workers.append(await Child.spawn(f"worker-{i}", _worker_argv(s, kafka, redis, i)))
    await asyncio.gather(
        *(
            w.wait_for_line(lambda line: line.startswith("ferry-worker-ready"), s.ready_timeout_s)
            for w in workers
        )
    )
    port = s.port or free_port(s.host)
    fronts.append(await Child.spawn("frontend", _frontend_argv(s, kafka, redis, port)))
    await fronts[0].wait_for_line(lambda line: line.startswith("ferry-frontend-ready"), s.ready_timeout_s)
    url = f"http://{s.host}:{port}"
    # The frontend inherits FERRY_API_KEYS / FERRY_ADMIN_KEY from this process's environment (variables,
    # not flags, so keys never show in `ps`); the example names the header without printing a key.
    auth = "-H 'Authorization: Bearer YOUR_KEY' " if load(FrontendSettings, []).api_keys else ""
    print(
        f"\nFerry is up: {url}  (model {s.served_model_name}, {s.workers} {s.engine} worker(s))\n"
        f"Kafka {kafka}  Redis {redis}  metrics {url}/metrics\n\n"
        f"  curl -N {url}/v1/chat/completions {auth}-H 'Content-Type: application/json' \\\n"
        f'    -d \'{{"model": "{s.served_model_name}", "stream": true, '
        f'"messages": [{{"role": "user", "content": "What is the capital of France?"}}]}}\'\n\n'
        f"Press Ctrl-C to stop.\n"
        f"ferry-ready {url}",
        flush=True,
    )
    return url


async def run_stack(s: StackSettings) -> int:
    """Start everything, print how to use it, and stop everything on SIGINT/SIGTERM or a crash."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    services: list[Child] = []
    workers: list[Child] = []
    fronts: list[Child] = []
    stopping = asyncio.create_task(stop.wait())
    starting = asyncio.create_task(_start(s, services, workers, fronts))
    code = 0
    try:
        await asyncio.wait([starting, stopping], return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            log.info("interrupted while starting; stopping what was started")
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
            return 130
        starting.result()
        children = [*fronts, *workers]
        exits = [asyncio.create_task(c.proc.wait()) for c in children]
        done, _ = await asyncio.wait([stopping, *exits], return_when=asyncio.FIRST_COMPLETED)
        if stopping not in done:
            crashed = [c.name for c in children if c.proc.returncode is not None]
            log.error("%s exited unexpectedly; stopping the stack", ", ".join(crashed))
            code = 1
        for t in exits:
            t.cancel()
    except (TimeoutError, RuntimeError) as exc:
        log.error("the stack did not come up: %s", exc)
        code = 1
    finally:
        stopping.cancel()
        # Frontend first (no new requests), then workers (drain), then the services they use.
        for front in fronts:
            await front.stop()
        await asyncio.gather(*(w.stop() for w in workers))
        for child in reversed(services):
            with contextlib.suppress(Exception):
                await child.stop()
        log.info("stack stopped")
    return code
