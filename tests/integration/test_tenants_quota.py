"""Tenants' quotas against a real Redis: the limiter's logic, Redis down, and real frontends on a real broker.

Quotas are counted in Redis's one-minute windows: a test that counts to a limit waits out the last seconds of
a minute first so the window cannot turn under it.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
import redis.asyncio as aioredis

from launch.services import free_port
from launch.usage import read_usage, summarize
from schemas.tenants import Tenant
from server.errors import APIError
from server.metrics import FrontendMetrics
from server.tenants_quota import QuotaGate, RateLimited
from tests.harness import Harness, harness, until

pytestmark = pytest.mark.integration

MODEL = "SmolLM2-135M-Instruct"
CHAT = "/v1/chat/completions"
TENANTS = """
[tenants.small]
api_keys = ["key-small"]
requests_per_minute = 3

[tenants.single]
api_keys = ["key-single"]
max_concurrent = 1

[tenants.tokens]
api_keys = ["key-tokens"]
tokens_per_minute = 60

[tenants.meter]
api_keys = ["key-meter-1", "key-meter-2"]
"""


async def fresh_window(redis: aioredis.Redis) -> None:
    """Return at least 5 s before Redis's clock turns a minute (the windows quotas are counted in)."""
    secs, _ = await redis.time()
    if secs % 60 > 54:
        await asyncio.sleep(61 - secs % 60)


def chat(content: str = "Hello", **kw: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4, **kw}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def assert_429(r: httpx.Response, limit: str) -> None:
    """OpenAI's 429: `rate_limit_exceeded` body, Retry-After and the `x-ratelimit-*` headers."""
    assert r.status_code == 429, r.text
    err = r.json()["error"]
    assert err["type"] == "rate_limit_error" and err["code"] == "rate_limit_exceeded", err
    assert int(r.headers["retry-after"]) >= 1
    if limit:
        assert r.headers[f"x-ratelimit-remaining-{limit}"] is not None


# ---- the limiter on a real Redis ---------------------------------------------------------------------


@pytest_asyncio.fixture(loop_scope="session")
async def rclient(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.from_url(redis_url)
    yield client
    await client.aclose()


async def test_limiter_counts_requests_tokens_and_leases(rclient: aioredis.Redis, prefix: str) -> None:
    tenants = {
        "r": Tenant(api_keys=["a"], requests_per_minute=2),
        "t": Tenant(api_keys=["b"], tokens_per_minute=100),
        "c": Tenant(api_keys=["c"], max_concurrent=2),
    }
    gate = QuotaGate(rclient, prefix, tenants, FrontendMetrics())
    await fresh_window(rclient)
    first = await gate.admit("r", 0)
    assert first.headers["x-ratelimit-limit-requests"] == "2"
    assert first.headers["x-ratelimit-remaining-requests"] == "1"
    assert (await gate.admit("r", 0)).headers["x-ratelimit-remaining-requests"] == "0"
    with pytest.raises(RateLimited) as info:
        await gate.admit("r", 0)
    assert info.value.status == 429 and 0 < (info.value.retry_after or 0) <= 60
    # Tokens: prompt at admission, completion at the end; a prompt that does not fit is refused.
    lease = await gate.admit("t", 70)
    assert lease.headers["x-ratelimit-remaining-tokens"] == "30"
    with pytest.raises(RateLimited):
        await gate.admit("t", 31)
    lease.completion_tokens = 20
    await gate.release(lease)
    last = await gate.admit("t", 10)
    assert last.headers["x-ratelimit-remaining-tokens"] == "0"
    # The virtual token counter (weighted-fair admission) was charged 70 + 20 + 10, and comes back with it.
    assert last.counters["t"] == 100.0
    # Concurrency: two leases, the third refused until one is released; releasing twice frees one slot only.
    a, b = await gate.admit("c", 0), await gate.admit("c", 0)
    with pytest.raises(RateLimited) as info:
        await gate.admit("c", 0)
    assert info.value.retry_after == 1.0
    await gate.release(a)
    await gate.release(a)
    c = await gate.admit("c", 0)
    with pytest.raises(RateLimited):
        await gate.admit("c", 0)
    await gate.refresh()  # extends b and c; they still hold their slots
    with pytest.raises(RateLimited):
        await gate.admit("c", 0)
    await gate.release(b)
    await gate.release(c)
    assert not gate.open


async def test_virtual_counters_are_shared_between_frontends(rclient: aioredis.Redis, prefix: str) -> None:
    tenants = {"a": Tenant(api_keys=["a"], weight=2.0), "b": Tenant(api_keys=["b"])}
    one, two = (QuotaGate(rclient, prefix, tenants, FrontendMetrics()) for _ in range(2))
    lease = await one.admit("a", 100)
    lease.completion_tokens = 50
    await one.release(lease)
    seen = await two.admit("b", 10)
    assert seen.counters == {"a": 75.0, "b": 10.0}


@pytest.mark.parametrize("fail_open", [True, False])
async def test_redis_down_fails_open_or_closed(fail_open: bool, caplog: pytest.LogCaptureFixture) -> None:
    dead = aioredis.from_url(f"redis://127.0.0.1:{free_port()}/0", socket_connect_timeout=0.2)
    metrics = FrontendMetrics()
    gate = QuotaGate(
        dead, "x:", {"a": Tenant(api_keys=["k"], max_concurrent=1)}, metrics, fail_open=fail_open
    )
    try:
        for _ in range(3):  # never a hang, and the second and third do not wait on Redis again
            async with asyncio.timeout(2):
                if fail_open:
                    lease = await gate.admit("a", 5)
                    assert lease.headers == {}
                    await gate.release(lease)
                else:
                    with pytest.raises(APIError) as info:
                        await gate.admit("a", 5)
                    assert info.value.status == 503 and info.value.code == "redis_unavailable"
    finally:
        await dead.aclose()
    assert "tenant quotas unchecked" in caplog.text
    if fail_open:
        assert metrics.tenant_quota_unchecked.labels("a")._value.get() == 3
    else:
        assert metrics.tenant_rejections.labels("a", "redis")._value.get() == 3


# ---- real frontends --------------------------------------------------------------------------------


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def two_frontends(
    kafka: str, redis_url: str, model_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[Harness, list[str]]]:
    """Two frontends with the same tenants file on one Redis, and one sim worker."""
    path = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    path.write_text(TENANTS)
    async with harness(kafka, redis_url, f"t{uuid.uuid4().hex[:8]}:", model_path) as h:
        await h.add_worker(speedup=1.0)  # slow enough that a 400-token stream is still running when checked
        urls = [(await h.add_frontend(tenants=str(path), admin_key="admin-key"))[1] for _ in range(2)]
        # A third that sees every worker as busy (any KV usage is over 0) and waits 0.3 s for one.
        _fe, busy = await h.add_frontend(tenants=str(path), busy_kv_usage=0.0, busy_wait_s=0.3)
        yield h, [*urls, busy]


async def test_unknown_key_is_401_and_admin_is_not_metered(two_frontends: tuple[Harness, list[str]]) -> None:
    _h, urls = two_frontends
    async with httpx.AsyncClient(base_url=urls[0], timeout=30) as c:
        r = await c.post(CHAT, json=chat(), headers=bearer("key-in-no-tenant"))
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = await c.post(CHAT, json=chat(), headers=bearer("admin-key"))
        assert r.status_code == 200 and "x-ratelimit-limit-requests" not in r.headers


async def test_two_frontends_share_one_quota(
    two_frontends: tuple[Harness, list[str]], redis_url: str
) -> None:
    _h, urls = two_frontends
    redis = aioredis.from_url(redis_url)
    await fresh_window(redis)
    await redis.aclose()
    remaining = []
    async with httpx.AsyncClient(timeout=30) as c:
        for i in range(3):
            r = await c.post(urls[i % 2] + CHAT, json=chat(), headers=bearer("key-small"))
            assert r.status_code == 200, r.text
            assert r.headers["x-ratelimit-limit-requests"] == "3"
            assert r.headers["x-ratelimit-reset-requests"].endswith("s")
            remaining.append(int(r.headers["x-ratelimit-remaining-requests"]))
        assert remaining == [2, 1, 0]
        for url in urls[:2]:  # over the quota on either frontend
            assert_429(await c.post(url + CHAT, json=chat(), headers=bearer("key-small")), "requests")
        # Streams carry the headers too, and count the same.
        r = await c.post(urls[0] + CHAT, json=chat(stream=True), headers=bearer("key-tokens"))
        assert r.status_code == 200 and "x-ratelimit-remaining-tokens" in r.headers


async def test_tokens_per_minute(two_frontends: tuple[Harness, list[str]], redis_url: str) -> None:
    _h, urls = two_frontends
    async with httpx.AsyncClient(base_url=urls[1], timeout=30) as c:
        refused = None
        for _ in range(20):  # 60 tokens a minute: a few short chats use them up
            r = await c.post(CHAT, json=chat("Hi there"), headers=bearer("key-tokens"))
            if r.status_code == 429:
                refused = r
                break
            assert r.status_code == 200, r.text
        assert refused is not None, "the tokens quota never refused"
        assert_429(refused, "tokens")
        assert "tokens per minute" in refused.json()["error"]["message"]


async def test_concurrency_is_released_after_disconnects(two_frontends: tuple[Harness, list[str]]) -> None:
    _h, urls = two_frontends
    long = chat("Tell me a long story", max_tokens=400, stream=True)
    async with httpx.AsyncClient(timeout=30) as c:
        # A stream holds the tenant's one slot, on every frontend.
        async with c.stream("POST", urls[0] + CHAT, json=long, headers=bearer("key-single")) as s:
            assert s.status_code == 200
            # Kept referenced: breaking out of `async for` would let the iterator close the stream early.
            lines = s.aiter_lines()
            assert (await anext(lines)).startswith("data: ")
            for url in urls[:2]:
                assert_429(await c.post(url + CHAT, json=chat(), headers=bearer("key-single")), "")

        # The client left mid-stream: the slot comes back.
        async def free() -> bool:
            r = await c.post(urls[1] + CHAT, json=chat(), headers=bearer("key-single"))
            return r.status_code == 200

        await until(free, 10)
        # A whole (non-stream) request whose client gives up: the slot comes back too.
        with pytest.raises(httpx.ReadTimeout):
            await c.post(urls[0] + CHAT, json=chat(max_tokens=400), headers=bearer("key-single"), timeout=0.3)
        await until(free, 10)


async def test_usage_topic_totals_equal_the_responses(
    two_frontends: tuple[Harness, list[str]], kafka: str
) -> None:
    _h, urls = two_frontends
    since = time.time() - 1
    prompt = completion = cached = 0
    # One long prompt, repeated: the sim worker serves the repeats' prefix from its cache.
    long = " ".join(f"word{i}" for i in range(120))
    async with httpx.AsyncClient(timeout=30) as c:
        for i in range(4):
            r = await c.post(
                urls[i % 2] + CHAT, json=chat(f"{long} Count"), headers=bearer(f"key-meter-{i % 2 + 1}")
            )
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
            prompt += usage["prompt_tokens"]
            completion += usage["completion_tokens"]
            cached += usage["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0
    expected = {"requests": 4, "errors": 0, "prompt_tokens": prompt, "cached_tokens": cached,
                "completion_tokens": completion}  # fmt: skip

    async def published() -> bool:
        return summarize(await read_usage(kafka, since), "tenant").get("meter") == expected

    await until(published, 20, period_s=0.5)
    by_key = summarize([r for r in await read_usage(kafka, since) if r.tenant == "meter"], "key")
    assert len(by_key) == 2 and sum(v["requests"] for v in by_key.values()) == 4
    assert all("key-meter" not in k for k in by_key)  # key ids, never the keys


async def test_concurrency_is_released_after_errors(two_frontends: tuple[Harness, list[str]]) -> None:
    _h, urls = two_frontends
    async with httpx.AsyncClient(timeout=30) as c:
        # Admitted (the tenant's one slot taken), then refused after waiting for a worker: 503, slot released.
        for _ in range(3):
            r = await c.post(urls[2] + CHAT, json=chat(), headers=bearer("key-single"))
            assert r.status_code == 503 and r.json()["error"]["code"] == "workers_busy", r.text
        r = await c.post(urls[0] + CHAT, json=chat(), headers=bearer("key-single"))
        assert r.status_code == 200, r.text
