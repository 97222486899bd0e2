"""The KV block index: which workers hold which blocks, kept from the engines' KV events.

Per model and block hash, a set of worker ids; per worker, the set of its blocks, so a dead or cleared
worker is removed in one sweep. Writes (one engine step's events) and lookups (a prompt's chain of
blocks) each cost one round trip: both run as Lua scripts inside Redis.
"""

from __future__ import annotations

from collections.abc import Sequence

import redis.asyncio as aioredis

from schemas.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from schemas.names import RedisKeys

# Hashes travel as 16 hex digits: Lua numbers are doubles and would lose 64-bit precision.
_APPLY = """
local p, model, w = ARGV[1], ARGV[2], ARGV[3]
local wkey = p .. 'kvw:' .. w
local function sweep()
  for _, m in ipairs(redis.call('SMEMBERS', wkey)) do
    redis.call('SREM', p .. 'kv:' .. m, w)
  end
  redis.call('DEL', wkey)
end
for i = 4, #ARGV, 2 do
  local op, h = ARGV[i], ARGV[i + 1]
  local m = model .. ':' .. h
  if op == '+' then
    redis.call('SADD', p .. 'kv:' .. m, w)
    redis.call('SADD', wkey, m)
  elseif op == '-' then
    redis.call('SREM', p .. 'kv:' .. m, w)
    redis.call('SREM', wkey, m)
  else
    sweep()
  end
end
return #ARGV
"""

# Walk the prompt's chain while at least one worker still holds every block so far; the cost is
# proportional to the longest overlap, not to the size of the index.
_LOOKUP = """
local p, model = ARGV[1], ARGV[2]
local overlap = {}
local alive = nil
for i = 3, #ARGV do
  local holders = redis.call('SMEMBERS', p .. 'kv:' .. model .. ':' .. ARGV[i])
  local next_alive = {}
  local any = false
  for _, w in ipairs(holders) do
    if alive == nil or alive[w] then
      next_alive[w] = true
      overlap[w] = i - 2
      any = true
    end
  end
  if not any then break end
  alive = next_alive
end
local out = {}
for w, n in pairs(overlap) do
  table.insert(out, w)
  table.insert(out, n)
end
return out
"""


def _hex(h: int) -> str:
    return f"{h:016x}"


class KVIndex:
    """Apply workers' KV events and answer overlap lookups."""

    def __init__(self, client: aioredis.Redis, keys: RedisKeys) -> None:
        self._redis = client
        self._prefix = keys.prefix
        self._apply = client.register_script(_APPLY)
        self._lookup = client.register_script(_LOOKUP)

    async def apply(self, worker_id: str, model: str, batch: KVEventBatch) -> None:
        """Apply one engine step's events for `worker_id` in one round trip."""
        args: list[str] = [self._prefix, model, worker_id]
        for ev in batch.events:
            match ev:
                case BlockStored():
                    for h in ev.block_hashes:
                        args += ("+", _hex(h))
                case BlockRemoved():
                    for h in ev.block_hashes:
                        args += ("-", _hex(h))
                case AllBlocksCleared():
                    args += ("!", "")
        if len(args) > 3:
            await self._apply(args=args)

    async def clear_worker(self, worker_id: str) -> None:
        """Remove every entry of `worker_id` (it died, restarted, or cleared its cache)."""
        await self._apply(args=[self._prefix, "", worker_id, "!", ""])

    async def overlaps(self, model: str, block_hashes: Sequence[int]) -> dict[str, int]:
        """For each worker holding the first block: how many leading blocks of the chain it holds."""
        if not block_hashes:
            return {}
        flat = await self._lookup(args=[self._prefix, model, *map(_hex, block_hashes)])
        it = iter(flat)
        return {(w.decode() if isinstance(w, bytes) else w): int(n) for w, n in zip(it, it, strict=True)}
