"""The KV block index: which workers hold which blocks, kept from the engines' KV events.

Per model and block hash, a set of worker ids (and a signature of that set); per worker, the set of its
blocks, so a dead or cleared worker is removed in one sweep. Writes (one engine step's events) and lookups (a prompt's chain of
blocks) each cost one round trip: both run as Lua scripts inside Redis.
"""

from __future__ import annotations

from collections.abc import Sequence

import redis.asyncio as aioredis

from schemas.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from schemas.names import RedisKeys

# Hashes travel as 16 hex digits: Lua numbers are doubles and would lose 64-bit precision.
#
# Beside each block's set of holders, `kvs:<model>:<hash>` keeps a signature of that set: the sum over its
# workers of 2^32 + the first 32 bits of sha1(worker id). Two sets with equal signatures are the same set
# (short of a 32-bit collision), which lets a lookup compare the holders of a block with the workers still
# walking in one GET instead of reading every member.
_FINGERPRINT = """
local function fingerprint(w)
  return tonumber(string.sub(redis.sha1hex(w), 1, 8), 16) + 4294967296
end
"""

_APPLY = (
    _FINGERPRINT
    + """
local p, model, w = ARGV[1], ARGV[2], ARGV[3]
local wkey = p .. 'kvw:' .. w
local f = fingerprint(w)
local function drop(m)
  if redis.call('SREM', p .. 'kv:' .. m, w) == 1 then
    if redis.call('DECRBY', p .. 'kvs:' .. m, f) == 0 then redis.call('DEL', p .. 'kvs:' .. m) end
  end
end
for i = 4, #ARGV, 2 do
  local op, h = ARGV[i], ARGV[i + 1]
  local m = model .. ':' .. h
  if op == '+' then
    if redis.call('SADD', p .. 'kv:' .. m, w) == 1 then redis.call('INCRBY', p .. 'kvs:' .. m, f) end
    redis.call('SADD', wkey, m)
  elseif op == '-' then
    drop(m)
    redis.call('SREM', wkey, m)
  else
    for _, held in ipairs(redis.call('SMEMBERS', wkey)) do drop(held) end
    redis.call('DEL', wkey)
  end
end
return #ARGV
"""
)

# Walk the prompt's chain while at least one worker still holds every block so far; the cost is
# proportional to the longest overlap, not to the size of the index. Members are read only where the holders
# differ from the workers still walking (the signature says when); along a shared prefix every block costs
# one GET. The chain arrives as one string of 16-hex-digit hashes and the answer leaves as one string of
# "worker\ndepth" lines: packing and parsing a hundred arguments and replies each way would cost the client
# more than the walk.
_LOOKUP = (
    _FINGERPRINT
    + """
local p, model, chain = ARGV[1], ARGV[2], ARGV[3]
local out = {}
local alive, signature, depth = nil, -1, 0
for i = 1, #chain / 16 do
  local m = model .. ':' .. string.sub(chain, 16 * i - 15, 16 * i)
  local s = tonumber(redis.call('GET', p .. 'kvs:' .. m))
  if s == nil then break end
  if s == signature then
    depth = i
  elseif alive == nil then
    alive, signature, depth = {}, s, i
    for _, w in ipairs(redis.call('SMEMBERS', p .. 'kv:' .. m)) do alive[w] = true end
  else
    local next_alive, kept, dropped = {}, {}, {}
    for _, w in ipairs(redis.call('SMEMBERS', p .. 'kv:' .. m)) do
      if alive[w] then
        next_alive[w] = true
        table.insert(kept, w)
      end
    end
    if #kept == 0 then break end
    for w in pairs(alive) do
      if not next_alive[w] then
        table.insert(dropped, w)
        table.insert(out, w .. '\\n' .. depth)
      end
    end
    -- Hash whichever side is smaller.
    local next_signature = 0
    if #kept <= #dropped then
      for _, w in ipairs(kept) do next_signature = next_signature + fingerprint(w) end
    else
      next_signature = signature
      for _, w in ipairs(dropped) do next_signature = next_signature - fingerprint(w) end
    end
    alive, signature, depth = next_alive, next_signature, i
  end
end
if alive ~= nil then
  for w in pairs(alive) do table.insert(out, w .. '\\n' .. depth) end
end
return table.concat(out, '\\n')
"""
)


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
        raw = await self._lookup(args=[self._prefix, model, "".join(map(_hex, block_hashes))])
        if not raw:
            return {}
        parts = (raw.decode() if isinstance(raw, bytes) else raw).split("\n")
        return dict(zip(parts[::2], map(int, parts[1::2]), strict=True))
