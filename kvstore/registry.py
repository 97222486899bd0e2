"""The worker registry: heartbeats with a TTL; a worker whose key expired is dead."""

from __future__ import annotations

import socket
import uuid
from dataclasses import dataclass

import msgspec
import redis.asyncio as aioredis

from schemas.names import RedisKeys
from schemas.status import FrontendStatus, WorkerStatus, frontend_decoder, status_decoder, status_encoder

# One round trip for the whole view: read every registered worker's status and reap the ids whose
# status key has expired, returning both so the caller can sweep a dead worker's KV index entries. The
# marker key (no TTL) gets a random value from the first read that finds it missing, and keeps it: a reader
# that sees another value than last time knows Redis lost its data since (a restart without persistence),
# so an empty registry then says nothing about the workers. Every frontend tells by its own last read.
_LIST_LIVE = """
local ids = redis.call('SMEMBERS', KEYS[1])
local live, dead = {}, {}
for _, id in ipairs(ids) do
  local v = redis.call('GET', ARGV[1] .. id)
  if v then
    table.insert(live, v)
  else
    redis.call('SREM', KEYS[1], id)
    table.insert(dead, id)
  end
end
redis.call('SET', KEYS[2], ARGV[2], 'NX')
return {live, dead, redis.call('GET', KEYS[2])}
"""


# The same sweep for frontends' announcements: live ones, reaping ids whose key expired.
_LIST_FRONTENDS = """
local out = {}
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local v = redis.call('GET', ARGV[1] .. id)
  if v then table.insert(out, v) else redis.call('SREM', KEYS[1], id) end
end
return out
"""

_WILDCARDS = ("", "0.0.0.0", "::", "[::]")


def reachable_host(bind_host: str) -> str:
    """The host others reach a server bound to `bind_host` at: a wildcard bind names this machine's address."""
    host = bind_host
    if bind_host in _WILDCARDS:
        name = socket.gethostname()
        try:
            host = socket.gethostbyname(name)
        except OSError:
            host = name
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


@dataclass(frozen=True)
class RegistryView:
    """One read of the registry."""

    live: list[WorkerStatus]
    dead: list[str]
    # The registry's marker: another value than a previous read's means Redis lost its data in between,
    # and workers may not have registered again yet.
    marker: str


class Registry:
    """Publish, remove and list worker statuses."""

    def __init__(self, client: aioredis.Redis, keys: RedisKeys) -> None:
        self._redis = client
        self._keys = keys
        self._list_live = client.register_script(_LIST_LIVE)
        self._list_frontends = client.register_script(_LIST_FRONTENDS)

    async def publish(self, status: WorkerStatus, ttl_s: float) -> None:
        """Write one heartbeat; the status disappears after `ttl_s` without another."""
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.set(self._keys.worker(status.worker_id), status_encoder.encode(status), px=int(ttl_s * 1000))
            pipe.sadd(self._keys.workers(), status.worker_id)
            await pipe.execute()

    async def remove(self, worker_id: str) -> None:
        """Leave the registry at once (drain or clean exit)."""
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(self._keys.worker(worker_id))
            pipe.srem(self._keys.workers(), worker_id)
            await pipe.execute()

    async def view(self) -> RegistryView:
        """Live workers, the ids found dead (and reaped) by this call, and the registry's marker."""
        live_raw, dead_raw, marker = await self._list_live(
            keys=[self._keys.workers(), self._keys.registry_marker()],
            args=[self._keys.worker(""), uuid.uuid4().hex],
        )
        live: list[WorkerStatus] = []
        for raw in live_raw:
            try:
                live.append(status_decoder.decode(raw))
            except msgspec.DecodeError:
                # A status written by an incompatible version: treat that worker as absent, not fatal.
                continue
        dead = [d.decode() if isinstance(d, bytes) else d for d in dead_raw]
        return RegistryView(live, dead, marker.decode() if isinstance(marker, bytes) else marker)

    async def snapshot(self) -> tuple[list[WorkerStatus], list[str]]:
        """Live workers, and the ids found dead (and reaped) by this call."""
        v = await self.view()
        return v.live, v.dead

    async def announce_frontend(self, status: FrontendStatus, ttl_s: float) -> None:
        """Write a frontend's announcement; it disappears after `ttl_s` without another."""
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.set(self._keys.frontend(status.frontend_id), status_encoder.encode(status), px=int(ttl_s * 1000))
            pipe.sadd(self._keys.frontend_members(), status.frontend_id)
            await pipe.execute()

    async def withdraw_frontend(self, frontend_id: str) -> None:
        """Remove a frontend's announcement at once (clean exit)."""
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(self._keys.frontend(frontend_id))
            pipe.srem(self._keys.frontend_members(), frontend_id)
            await pipe.execute()

    async def frontends(self) -> list[FrontendStatus]:
        """Every live frontend's announcement (expired ids are reaped)."""
        raw = await self._list_frontends(keys=[self._keys.frontend_members()], args=[self._keys.frontend("")])
        out: list[FrontendStatus] = []
        for item in raw:
            try:
                out.append(frontend_decoder.decode(item))
            except msgspec.DecodeError:
                continue
        return out
