"""Tenants' quotas, enforced across every frontend through Redis: one Lua script call per request.

Requests and tokens per minute are counted in fixed one-minute windows of Redis's clock (every frontend
sees the same window); `max_concurrent` is a sorted set of leases per tenant, each lease scored with its
expiry and refreshed while its request runs, so the slots of a frontend that died come back within
`LEASE_TTL_S`. Prompt tokens are charged at admission (the request is refused if they do not fit in what is
left of the minute), completion tokens when the request ends (in the window it ends in).

When Redis does not answer, requests are admitted unchecked (fail-open, the default: an outage of the quota
store must not take serving down) or refused with 503 (`--no-tenants-fail-open`); either is logged and
counted (`ferry_tenant_quota_unchecked` / `ferry_tenant_rejections{reason="redis"}`).

The same script call charges the tenant's virtual token counter (weighted-fair admission,
server/tenants_fair.py) and returns every tenant's, so the counters are shared by every frontend at no extra
round trip.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Coroutine, Mapping
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from starlette.responses import Response

from schemas.tenants import Tenant
from server.errors import APIError
from server.metrics import FrontendMetrics

log = logging.getLogger("ferry.tenants")

LEASE_TTL_S = 90.0  # a concurrency slot whose frontend stopped refreshing it is free again after this
REFRESH_S = 30.0
REDIS_TIMEOUT_S = 0.5
RETRY_REDIS_S = 1.0  # after a failure, Redis is not asked again for this long (no stall per request)
WINDOW_S = 60

# KEYS[1]: the tenant's key prefix; KEYS[2]: the tenants' virtual token counters (a hash, server/tenants_fair.py).
# ARGV: rpm, tpm, max_concurrent, prompt tokens, lease id, lease ttl (ms), virtual cost, tenant.
# Returns {refused: "" | "requests" | "tokens" | "concurrency", requests used, tokens used, ms to reset,
# leases held, every tenant's counter as a flat name/value list}.
_ADMIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local win = math.floor(now / 60000)
local rk = KEYS[1] .. 'r:' .. win
local tk = KEYS[1] .. 't:' .. win
local ck = KEYS[1] .. 'c'
local rpm, tpm, maxc, tokens = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local used_r = tonumber(redis.call('GET', rk) or '0')
local used_t = tonumber(redis.call('GET', tk) or '0')
local held = 0
if maxc > 0 then
  redis.call('ZREMRANGEBYSCORE', ck, '-inf', now)
  held = redis.call('ZCARD', ck)
end
local refused = ''
if rpm > 0 and used_r >= rpm then refused = 'requests'
elseif tpm > 0 and used_t + tokens > tpm then refused = 'tokens'
elseif maxc > 0 and held >= maxc then refused = 'concurrency'
else
  used_r = redis.call('INCR', rk)
  redis.call('PEXPIRE', rk, 120000)
  if tokens > 0 then
    used_t = redis.call('INCRBY', tk, tokens)
    redis.call('PEXPIRE', tk, 120000)
  end
  if maxc > 0 then
    redis.call('ZADD', ck, now + tonumber(ARGV[6]), ARGV[5])
    redis.call('PEXPIRE', ck, tonumber(ARGV[6]))
    held = held + 1
  end
  redis.call('HINCRBYFLOAT', KEYS[2], ARGV[8], ARGV[7])
  redis.call('PEXPIRE', KEYS[2], 86400000)
end
return {refused, used_r, used_t, (win + 1) * 60000 - now, held, redis.call('HGETALL', KEYS[2])}
"""

# KEYS[1]: the tenant's key prefix; KEYS[2]: the virtual counters. ARGV: lease id, completion tokens,
# virtual cost, tenant.
_RELEASE = """
local t = redis.call('TIME')
local win = math.floor((tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)) / 60000)
redis.call('ZREM', KEYS[1] .. 'c', ARGV[1])
local tokens = tonumber(ARGV[2])
if tokens > 0 then
  local tk = KEYS[1] .. 't:' .. win
  redis.call('INCRBY', tk, tokens)
  redis.call('PEXPIRE', tk, 120000)
  redis.call('HINCRBYFLOAT', KEYS[2], ARGV[4], ARGV[3])
end
return 1
"""

# KEYS[1]: the concurrency set; ARGV: new expiry offset (ms), then lease ids.
_REFRESH = """
local t = redis.call('TIME')
local until_ = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[1])
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], 'XX', until_, ARGV[i]) end
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[1]))
return 1
"""


def _reset_text(ms: int) -> str:
    """OpenAI's way of writing a reset time: `1s`, `6m0s`, `0.5s`."""
    s = max(ms, 0) / 1000
    if s < 60:
        return f"{s:.3g}s"
    return f"{int(s // 60)}m{int(s % 60)}s"


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


@contextlib.asynccontextmanager
async def background(coro: Coroutine[object, object, None], name: str) -> AsyncIterator[None]:
    """Run `coro` as a task for the duration of the block; cancelled and awaited on the way out."""
    task = asyncio.create_task(coro, name=name)
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@dataclass
class Lease:
    """A tenant's admitted request: its concurrency slot and what it is charged when it ends."""

    tenant: str
    lease_id: str
    headers: dict[str, str]
    holds_slot: bool
    prompt_tokens: int = 0
    completion_tokens: int = 0
    released: bool = False
    # Every tenant's virtual token counter as Redis held it at admission (empty when Redis did not answer).
    counters: dict[str, float] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)


class QuotaGate:
    """Admits a tenant's request (or raises 429 with OpenAI's headers) and releases it when it ends."""

    def __init__(
        self,
        redis: aioredis.Redis,
        prefix: str,
        tenants: Mapping[str, Tenant],
        metrics: FrontendMetrics,
        fail_open: bool = True,
    ) -> None:
        self._redis = redis
        self._prefix = prefix
        self.tenants = dict(tenants)
        self._metrics = metrics
        self._fail_open = fail_open
        self._admit = redis.register_script(_ADMIT)
        self._release = redis.register_script(_RELEASE)
        self._refresh = redis.register_script(_REFRESH)
        self._down_until = 0.0
        self._logged_down = 0.0
        self.open: dict[str, Lease] = {}  # leases holding a concurrency slot, by id

    def _key(self, tenant: str) -> str:
        # One hash tag for every tenant's keys: a script touches a tenant's keys and the shared counters,
        # and Redis Cluster runs a script on one slot.
        return f"{self._prefix}{{tenants}}:{tenant}:"

    @property
    def _counters_key(self) -> str:
        return f"{self._prefix}{{tenants}}:vtc"

    def _redis_down(self, tenant: str, exc: BaseException, prompt_tokens: int = 0) -> Lease:
        now = time.monotonic()
        self._down_until = now + RETRY_REDIS_S
        self._metrics.redis_errors.inc()
        if now - self._logged_down > 10:
            self._logged_down = now
            log.warning(
                "tenant quotas unchecked: Redis does not answer (%r); %s", exc,
                "admitting requests without quota (fail-open)" if self._fail_open else "refusing requests (503)",
            )  # fmt: skip
        if not self._fail_open:
            self._metrics.tenant_rejections.labels(tenant, "redis").inc()
            raise APIError(
                503, "Quotas cannot be checked right now (Redis); try again shortly.",
                code="redis_unavailable", retry_after=2,
            )  # fmt: skip
        self._metrics.tenant_quota_unchecked.labels(tenant).inc()
        return Lease(tenant, "", {}, holds_slot=False, prompt_tokens=prompt_tokens)

    async def admit(self, tenant: str, prompt_tokens: int) -> Lease:
        """Charge one request and its prompt tokens to `tenant`, or raise 429 (or 503 fail-closed)."""
        t = self.tenants[tenant]
        if time.monotonic() < self._down_until:
            return self._redis_down(
                tenant, ConnectionError("Redis failed less than a second ago"), prompt_tokens
            )
        lease_id = secrets.token_hex(8)
        args: list[str | int] = [t.requests_per_minute, t.tokens_per_minute, t.max_concurrent, prompt_tokens, lease_id,
                int(LEASE_TTL_S * 1000), repr(prompt_tokens / t.weight), tenant]  # fmt: skip
        try:
            with self._metrics.redis_seconds.labels("tenant_admit").time():
                async with asyncio.timeout(REDIS_TIMEOUT_S):
                    refused, used_r, used_t, reset_ms, _held, flat = await self._admit(
                        keys=[self._key(tenant), self._counters_key], args=args
                    )
        except Exception as exc:  # any failure of the store: the policy decides, never a hang
            return self._redis_down(tenant, exc, prompt_tokens)
        refused = refused.decode() if isinstance(refused, bytes) else str(refused)
        headers = self._headers(t, int(used_r), int(used_t), int(reset_ms))
        if refused:
            self._metrics.tenant_rejections.labels(tenant, refused).inc()
            raise self._over(tenant, t, refused, int(reset_ms), headers)
        lease = Lease(tenant, lease_id, headers, holds_slot=t.max_concurrent > 0, prompt_tokens=prompt_tokens)
        lease.counters = {_text(flat[i]): float(flat[i + 1]) for i in range(0, len(flat) - 1, 2)}
        if lease.holds_slot:
            self.open[lease_id] = lease
        self._metrics.tenant_inflight.labels(tenant).inc()
        return lease

    def _headers(self, t: Tenant, used_r: int, used_t: int, reset_ms: int) -> dict[str, str]:
        h: dict[str, str] = {}
        if t.requests_per_minute:
            h["x-ratelimit-limit-requests"] = str(t.requests_per_minute)
            h["x-ratelimit-remaining-requests"] = str(max(t.requests_per_minute - used_r, 0))
            h["x-ratelimit-reset-requests"] = _reset_text(reset_ms)
        if t.tokens_per_minute:
            h["x-ratelimit-limit-tokens"] = str(t.tokens_per_minute)
            h["x-ratelimit-remaining-tokens"] = str(max(t.tokens_per_minute - used_t, 0))
            h["x-ratelimit-reset-tokens"] = _reset_text(reset_ms)
        return h

    def _over(self, name: str, t: Tenant, refused: str, reset_ms: int, headers: dict[str, str]) -> APIError:
        if refused == "requests":
            what = f"requests per minute (RPM): Limit {t.requests_per_minute}"
        elif refused == "tokens":
            what = f"tokens per minute (TPM): Limit {t.tokens_per_minute}"
        else:
            what = f"concurrent requests: Limit {t.max_concurrent}"
        # A freed concurrency slot can come any moment; a minute's quota comes back when the window turns.
        retry = 1.0 if refused == "concurrency" else reset_ms / 1000
        err = RateLimited(
            429, f"Rate limit reached for tenant {name} on {what}. Please try again in {_reset_text(int(retry * 1000))}.",
            code="rate_limit_exceeded", retry_after=retry,
        )  # fmt: skip
        err.headers = headers
        return err

    async def release(self, lease: Lease) -> None:
        """The request ended (done, error, disconnect, cancellation): free its slot, charge its completion."""
        if lease.released:
            return
        lease.released = True
        self.open.pop(lease.lease_id, None)
        if lease.lease_id:
            self._metrics.tenant_inflight.labels(lease.tenant).dec()
        if not lease.lease_id or (not lease.holds_slot and not lease.completion_tokens):
            return
        try:
            async with asyncio.timeout(REDIS_TIMEOUT_S):
                await self._release(
                    keys=[self._key(lease.tenant), self._counters_key],
                    args=[
                        lease.lease_id,
                        lease.completion_tokens,
                        repr(lease.completion_tokens / self.tenants[lease.tenant].weight),
                        lease.tenant,
                    ],
                )
        except Exception as exc:
            # The slot comes back when its lease expires (LEASE_TTL_S); the tokens are not charged.
            log.warning("could not release a lease of tenant %s (%r); it expires in %.0f s", lease.tenant, exc,
                        LEASE_TTL_S)  # fmt: skip

    async def charge(self, tenant: str, tokens: int) -> None:
        """Charge tokens served outside a lease (a batch item) to the tenant's minute and virtual counter."""
        if tokens <= 0:
            return
        try:
            async with asyncio.timeout(REDIS_TIMEOUT_S):
                args: list[str | int] = [
                    "",
                    tokens,
                    repr(tokens / self.tenants[tenant].weight),
                    tenant,
                ]  # no lease
                await self._release(keys=[self._key(tenant), self._counters_key], args=args)
        except Exception as exc:
            log.warning("could not charge %d tokens to tenant %s (%r)", tokens, tenant, exc)

    async def refresh(self) -> None:
        """Extend the leases of this frontend's running requests (one script call per tenant)."""
        by_tenant: dict[str, list[str]] = {}
        for lease in list(self.open.values()):
            by_tenant.setdefault(lease.tenant, []).append(lease.lease_id)
        for tenant, ids in by_tenant.items():
            try:
                async with asyncio.timeout(REDIS_TIMEOUT_S):
                    await self._refresh(keys=[self._key(tenant) + "c"], args=[int(LEASE_TTL_S * 1000), *ids])
            except Exception as exc:
                log.warning("could not refresh the leases of tenant %s (%r)", tenant, exc)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[QuotaGate]:
        """Refresh leases in the background while the frontend runs."""

        async def loop() -> None:
            while True:
                await asyncio.sleep(REFRESH_S)
                await self.refresh()

        async with background(loop(), "tenant-leases"):
            yield self


class RateLimited(APIError):
    """A 429 carrying OpenAI's `x-ratelimit-*` headers."""

    headers: dict[str, str]

    def response(self) -> Response:
        """The error response with the rate-limit headers."""
        resp = super().response()
        resp.headers.update(self.headers)
        return resp
