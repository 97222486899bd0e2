"""Real vLLM workers as child processes behind an in-process frontend, shared by the tests of a session.

Starting a vLLM worker takes 15-25 s on this host, so the session starts two once and every test that
needs the whole path (frontend -> Kafka -> vLLM worker) reuses them. A test that kills one (engine
death) leaves it dead; the next test that asks for it gets a fresh process under the same id.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families

from kvstore.registry import Registry
from launch.services import Child
from schemas.names import RedisKeys
from schemas.status import WorkerStatus
from server.frontend import Frontend
from tests.harness import Harness

HEARTBEAT_S = 0.5
# Worker 0 serves LoRA adapters, worker 1 does not: adapter requests must avoid worker 1.
LORA_SLOTS = {0: 2, 1: 0}


class VllmStack:
    """A frontend and two vLLM workers (`vllm-0`, `vllm-1`) on one broker and Redis, under one prefix."""

    def __init__(self, h: Harness, kafka: str, redis_url: str, prefix: str, model_path: Path) -> None:
        self.h = h
        self.kafka = kafka
        self.prefix = prefix
        self.model_path = model_path
        self.children: dict[int, Child] = {}
        self.redis = aioredis.from_url(redis_url)
        self.registry = Registry(self.redis, RedisKeys(prefix))
        self._redis_url = redis_url
        self.frontend: Frontend | None = None
        self.url = ""

    @staticmethod
    def worker_id(i: int) -> str:
        """The id of worker `i`."""
        return f"vllm-{i}"

    async def start(self) -> None:
        """Start both workers side by side, then the frontend."""
        await asyncio.gather(*(self.worker(i) for i in LORA_SLOTS))
        self.frontend, self.url = await self.h.add_frontend()

    async def ensure_workers(self) -> None:
        """Both workers running and seen by the frontend (restarting any an earlier test killed)."""
        await asyncio.gather(*(self.worker(i) for i in LORA_SLOTS))

    async def worker(self, i: int) -> Child:
        """Worker `i`, (re)started if it is not running, once it is registered and the frontend sees it."""
        child = self.children.get(i)
        if child is not None and child.proc.returncode is None:
            return child
        wid = self.worker_id(i)
        child = await Child.spawn(
            wid,
            [
                sys.executable,
                "-m",
                "launch",
                "worker",
                "--engine",
                "vllm",
                "--worker-id",
                wid,
                "--block-size",
                "32",
                "--kafka",
                self.kafka,
                "--redis",
                self._redis_url,
                "--redis-prefix",
                self.prefix,
                "--model-path",
                str(self.model_path),
                "--kv-cache-gib",
                "0.25",
                "--heartbeat-interval-s",
                str(HEARTBEAT_S),
                "--max-loras",
                str(LORA_SLOTS[i]),
                "--log-level",
                "warning",
            ],
            echo=False,
        )
        self.children[i] = child
        await child.wait_for_line(lambda line: line.startswith("ferry-worker-ready"), 240)
        if self.frontend is not None:
            await self.frontend.svc.pool.refresh()
        return child

    async def status(self, worker_id: str) -> WorkerStatus | None:
        """The worker's latest heartbeat in the registry, None if it is not registered."""
        live, _dead = await self.registry.snapshot()
        return next((w for w in live if w.worker_id == worker_id), None)

    async def wait_status(
        self, worker_id: str, accept: Callable[[WorkerStatus | None], bool], timeout_s: float
    ) -> WorkerStatus | None:
        """Poll the registry (one heartbeat apart) until `accept` holds for the worker's status."""
        deadline = time.monotonic() + timeout_s
        while True:
            st = await self.status(worker_id)
            if accept(st):
                return st
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"status of {worker_id} never matched within {timeout_s}s; last: {st}\n"
                    + await self.diagnose(worker_id)
                )
            await asyncio.sleep(HEARTBEAT_S / 2)  # poll period: the registry has no change notification

    async def diagnose(self, worker_id: str) -> str:
        """What a failed wait should show: the worker's request counters and the last lines it printed."""
        try:
            text = await self.metrics_text(worker_id)
            outcomes = [ln for ln in text.splitlines() if ln.startswith("ferry_worker_requests_total{")]
        except Exception as exc:  # the worker may be gone: say so instead of hiding the first failure
            outcomes = [repr(exc)]
        child = next((c for i, c in self.children.items() if self.worker_id(i) == worker_id), None)
        tail = "\n".join(child.tail) if child is not None else "(no such child)"
        return f"requests by outcome: {outcomes}\nlast output of {worker_id}:\n{tail}"

    async def metrics_text(self, worker_id: str) -> str:
        """The worker's /metrics page."""
        st = await self.status(worker_id)
        assert st is not None and st.metrics_url
        async with httpx.AsyncClient(timeout=10) as c:
            return (await c.get(st.metrics_url)).text

    async def metrics(self, worker_id: str) -> dict[str, float]:
        """The worker's /metrics samples without labels but its `model`, `worker` and `worker_role`, by name."""
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(await self.metrics_text(worker_id)):
            for sample in family.samples:
                if set(sample.labels) <= {"model", "worker", "worker_role"}:
                    out[sample.name] = sample.value
        return out

    async def wait_metrics(
        self, worker_id: str, accept: Callable[[dict[str, float]], bool], timeout_s: float
    ) -> dict[str, float]:
        """Poll the worker's /metrics (recorded once per heartbeat) until `accept` holds."""
        deadline = time.monotonic() + timeout_s
        while True:
            m = await self.metrics(worker_id)
            if accept(m):
                return m
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"metrics of {worker_id} never matched within {timeout_s}s; last: {m}\n"
                    + await self.diagnose(worker_id)
                )
            await asyncio.sleep(HEARTBEAT_S / 2)  # poll period: metrics change once per heartbeat

    def engine_core_pid(self, i: int) -> int:
        """The pid of vLLM's EngineCore process, a child of worker `i`."""
        child = self.children[i]
        kids = psutil.Process(child.proc.pid).children()
        cores = [p for p in kids if "EngineCore" in " ".join(p.cmdline()) or "EngineCore" in p.name()]
        assert len(cores) == 1, f"expected one EngineCore child of {self.worker_id(i)}, found {kids}"
        return cores[0].pid

    async def close(self) -> None:
        """Stop the workers (the harness stops the frontend)."""
        await asyncio.gather(*(c.stop(30) for c in self.children.values()))
        await self.redis.aclose()
