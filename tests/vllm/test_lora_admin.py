"""The LoRA admin API's refusals, with simulated workers (which cannot serve adapters) and without vLLM:
clear errors when no worker has LoRA slots, when a worker never answers, and the admin key."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis

from kvstore.registry import Registry
from schemas.names import RedisKeys
from schemas.settings import DEFAULT_MODEL_NAME as BASE
from schemas.status import WorkerStatus
from tests.harness import Harness

pytestmark = pytest.mark.integration

LOAD = "/v1/admin/load_lora_adapter"


async def test_sim_workers_have_no_lora_slots(h: Harness, tmp_path: Path) -> None:
    w = await h.add_worker()
    _fe, url = await h.add_frontend()
    body = {"lora_name": "a", "lora_path": str(tmp_path)}
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        r = await c.post(LOAD, json=body)
        assert (r.status_code, r.json()["error"]["code"]) == (400, "lora_not_supported")
        assert "--max-loras" in r.json()["error"]["message"]
        r = await c.post(LOAD, json={**body, "worker_id": w.worker.settings.worker_id})
        assert (r.status_code, r.json()["error"]["code"]) == (400, "lora_not_supported")
        r = await c.post("/v1/admin/unload_lora_adapter", json={"lora_name": "a"})
        assert (r.status_code, r.json()["error"]["code"]) == (404, "lora_not_found")
        assert (await c.get("/v1/admin/lora_adapters")).json() == {"object": "list", "data": []}
        r = await c.post(
            "/v1/chat/completions", json={"model": "a", "messages": [{"role": "user", "content": "hi"}]}
        )
        assert (r.status_code, r.json()["error"]["code"]) == (404, "model_not_found")


async def test_a_worker_that_never_answers_is_a_504(
    h: Harness, redis_url: str, prefix: str, tmp_path: Path
) -> None:
    # A registered worker whose requests topic nobody reads (hung, or its inbox loop stuck).
    redis = aioredis.from_url(redis_url)
    try:
        now = time.time()
        ghost = WorkerStatus("ghost", BASE, "vllm", 32, 100, 2048, now, now)
        await Registry(redis, RedisKeys(prefix)).publish(ghost, 60)
        fe, url = await h.add_frontend()
        assert fe.lora_admin is not None
        fe.lora_admin.timeout_s = 0.5
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            r = await c.post(LOAD, json={"lora_name": "a", "lora_path": str(tmp_path)})
        assert (r.status_code, r.json()["error"]["code"]) == (504, "worker_timeout")
        assert "ghost" in r.json()["error"]["message"]
    finally:
        await redis.aclose()


async def test_admin_routes_need_the_admin_key(h: Harness, tmp_path: Path) -> None:
    await h.add_worker()
    _fe, url = await h.add_frontend(api_keys="user-key", admin_key="admin-key")
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        as_user = await c.get("/v1/admin/lora_adapters", headers={"Authorization": "Bearer user-key"})
        assert as_user.status_code in (401, 403)
        as_admin = await c.get("/v1/admin/lora_adapters", headers={"Authorization": "Bearer admin-key"})
        assert as_admin.status_code == 200
