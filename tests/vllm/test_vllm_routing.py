"""Cache-aware routing with real vLLM workers: their KV events reach the index and steer the router."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from schemas.settings import DEFAULT_MODEL_NAME as MODEL
from tests.vllm.stack import VllmStack

pytestmark = pytest.mark.vllm


async def test_shared_prefix_follows_the_cache(vllm_stack: VllmStack) -> None:
    stack = vllm_stack
    await stack.ensure_workers()
    system = "You are a meticulous geography tutor. " * 45  # a long shared prefix: many 32-token blocks
    async with httpx.AsyncClient(base_url=stack.url, timeout=120) as c:

        async def ask(question: str) -> httpx.Response:
            body = {
                "model": MODEL,
                "max_tokens": 4,
                "temperature": 0,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            }
            r = await c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            return r

        first = await ask("What is the capital of France?")
        holder = first.headers["x-ferry-worker"]
        assert first.json()["usage"]["prompt_tokens"] > 320
        second = await ask("What is the capital of Spain?")
        assert second.headers["x-ferry-worker"] == holder
        assert int(second.headers["x-ferry-predicted-cached-blocks"]) >= 8
        assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 256
    # The engine's own prefix-cache hit rate reaches the heartbeat and /metrics.
    st = await stack.wait_status(holder, lambda s: s is not None and s.prefix_hit_rate > 0, 10)
    assert st is not None
    m = await stack.metrics(holder)
    assert m["ferry_worker_prefix_cache_hits_total"] >= 256
    assert m["ferry_worker_prefix_cache_queries_total"] > m["ferry_worker_prefix_cache_hits_total"]
    # vLLM's own families are served beside Ferry's, as vLLM's server would (dashboards for vLLM read them).
    vllm: dict[str, float] = {}
    for f in text_string_to_metric_families(await stack.metrics_text(holder)):
        for sample in f.samples:
            if sample.name.startswith("vllm:"):  # summed over labels (finished_reason, engine)
                vllm[sample.name] = vllm.get(sample.name, 0.0) + sample.value
    assert vllm["vllm:request_success_total"] >= 2
    assert vllm["vllm:prefix_cache_hits_total"] >= 256
    assert vllm["vllm:e2e_request_latency_seconds_count"] >= 2
