"""The KV block index: which workers hold which blocks, kept from the engines' KV events.

Per model and block hash, a set of worker ids (and a signature of that set); per worker, the set of its
blocks, so a dead or cleared worker is removed in one sweep. Writes (one engine step's events) and lookups (a prompt's chain of
blocks) each cost one round trip: both run as Lua scripts inside Redis.

A worker holds a block if it is on its device pool or on its host offload tier (events with a host medium). The holder sets
do not tell the tiers apart; per worker, `kvh:<worker>` lists the blocks on its host tier and `kvo:<worker>` those only there,
so a lookup reports how many of a worker's leading blocks it would have to load from host memory. `kvho` lists the workers
that have host-only blocks: a lookup reads it once, and walks a found worker's blocks again only if it is listed.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import redis.asyncio as aioredis

from schemas.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, is_host
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
local wkey, hkey, okey = p .. 'kvw:' .. w, p .. 'kvh:' .. w, p .. 'kvo:' .. w
local f = fingerprint(w)
local function drop(m)
  if redis.call('SREM', p .. 'kv:' .. m, w) == 1 then
    if redis.call('DECRBY', p .. 'kvs:' .. m, f) == 0 then redis.call('DEL', p .. 'kvs:' .. m) end
  end
end
local function hold(m)
  if redis.call('SADD', p .. 'kv:' .. m, w) == 1 then redis.call('INCRBY', p .. 'kvs:' .. m, f) end
  redis.call('SADD', wkey, m)
end
local function release(m)
  drop(m)
  redis.call('SREM', wkey, m)
end
-- '+' / '-': stored on / removed from the device pool; 'H' / 'h': the same on the host tier; '!': cleared.
for i = 4, #ARGV, 2 do
  local op, h = ARGV[i], ARGV[i + 1]
  local m = model .. ':' .. h
  if op == '+' then
    hold(m)
    redis.call('SREM', okey, m)
  elseif op == '-' then
    if redis.call('SISMEMBER', hkey, m) == 1 then redis.call('SADD', okey, m) else release(m) end
  elseif op == 'H' then
    redis.call('SADD', hkey, m)
    if redis.call('SISMEMBER', wkey, m) == 0 then
      hold(m)
      redis.call('SADD', okey, m)
    end
  elseif op == 'h' then
    if redis.call('SREM', hkey, m) == 1 and redis.call('SREM', okey, m) == 1 then release(m) end
  else
    for _, held in ipairs(redis.call('SMEMBERS', wkey)) do drop(held) end
    redis.call('DEL', wkey, hkey, okey)
  end
end
-- Workers with host-only blocks, so a lookup pays for tiers only when some worker has them.
if redis.call('EXISTS', okey) == 1 then redis.call('SADD', p .. 'kvho', w) else redis.call('SREM', p .. 'kvho', w) end
return #ARGV
"""
)

# Walk the prompt's chain while at least one worker still holds every block so far; the cost is
# proportional to the longest overlap, not to the size of the index. Members are read only where the holders
# differ from the workers still walking (the signature says when); along a shared prefix every block costs
# one GET. The chain arrives as one string of 16-hex-digit hashes and the answer leaves as one string of
# "worker\ndepth" lines: packing and parsing a hundred arguments and replies each way would cost the client more than
# the walk. A second string has "worker\nhost" lines for the found workers listed in `kvho`: how many of their leading
# blocks are only on their host tier (empty, and nothing walked twice, while no worker has host-only blocks). The
# third is the registry marker (empty when missing): a frontend learns from its next lookup that Redis came back
# empty, instead of routing on the empty index until its indexer next reads the marker (server/kv_indexer.py).
_LOOKUP = (
    _FINGERPRINT
    + """
local p, model, chain = ARGV[1], ARGV[2], ARGV[3]
local marker = redis.call('GET', ARGV[4]) or ''
local out, hosts, names = {}, {}, {}
local tiered = {}
for _, w in ipairs(redis.call('SMEMBERS', p .. 'kvho')) do tiered[w] = true end
local function found(w, depth)
  table.insert(out, w .. '\\n' .. depth)
  if tiered[w] then
    local host, okey = 0, p .. 'kvo:' .. w
    -- One SMISMEMBER per 512 blocks (Lua's unpack has a stack limit), the block names built once per lookup.
    for i = #names + 1, depth do names[i] = model .. ':' .. string.sub(chain, 16 * i - 15, 16 * i) end
    for lo = 1, depth, 512 do
      for _, hit in ipairs(redis.call('SMISMEMBER', okey, unpack(names, lo, math.min(lo + 511, depth)))) do
        host = host + hit
      end
    end
    table.insert(hosts, w .. '\\n' .. host)
  end
end
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
        found(w, depth)
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
  for w in pairs(alive) do found(w, depth) end
end
return {table.concat(out, '\\n'), table.concat(hosts, '\\n'), marker}
"""
)


# Blocks per script call when a worker's entries are written back whole: a call blocks Redis while it runs.
REPLACE_CHUNK = 4096


def _hex(h: int) -> str:
    return f"{h:016x}"


class KVIndex:
    """Apply workers' KV events and answer overlap lookups."""

    def __init__(self, client: aioredis.Redis, keys: RedisKeys) -> None:
        self._redis = client
        self._prefix = keys.prefix
        self._marker_key = keys.registry_marker()
        self._apply = client.register_script(_APPLY)
        self._lookup = client.register_script(_LOOKUP)

    async def apply(self, worker_id: str, model: str, batch: KVEventBatch) -> None:
        """Apply one engine step's events for `worker_id` in one round trip."""
        args: list[str] = [self._prefix, model, worker_id]
        for ev in batch.events:
            match ev:
                case BlockStored():
                    op = "H" if is_host(ev.medium) else "+"
                    for h in ev.block_hashes:
                        args += (op, _hex(h))
                case BlockRemoved():
                    op = "h" if is_host(ev.medium) else "-"
                    for h in ev.block_hashes:
                        args += (op, _hex(h))
                case AllBlocksCleared():
                    args += ("!", "")
        if len(args) > 3:
            await self._apply(args=args)

    async def clear_worker(self, worker_id: str) -> None:
        """Remove every entry of `worker_id` (it died, restarted, or cleared its cache)."""
        await self._apply(args=[self._prefix, "", worker_id, "!", ""])

    async def replace_workers(
        self,
        model: str,
        workers: dict[str, tuple[Collection[int], Collection[int]]],
        chunk: int = REPLACE_CHUNK,
    ) -> None:
        """Make each worker's entries exactly its (device, host) blocks, every call in one pipelined round trip.

        Each worker's first call clears its entries; a worker with many blocks takes several calls (a lookup
        in between sees part of them).
        """
        async with self._redis.pipeline(transaction=False) as pipe:
            for worker_id, (device, host) in workers.items():
                ops = [("+", _hex(h)) for h in device] + [("H", _hex(h)) for h in host]
                for lo in range(0, max(len(ops), 1), chunk):
                    args: list[str] = [self._prefix, model, worker_id] + (["!", ""] if lo == 0 else [])
                    for op in ops[lo : lo + chunk]:
                        args += op
                    await self._apply(args=args, client=pipe)
            await pipe.execute()

    async def overlaps(self, model: str, block_hashes: Sequence[int]) -> dict[str, int]:
        """For each worker holding the first block: how many leading blocks of the chain it holds (any tier)."""
        return {w: n for w, (n, _host) in (await self.tiered_overlaps(model, block_hashes)).items()}

    async def tiered_overlaps(self, model: str, block_hashes: Sequence[int]) -> dict[str, tuple[int, int]]:
        """For each worker holding the first block: (leading blocks it holds, how many of them only on host)."""
        if not block_hashes:
            return {}
        return (await self.lookup(model, block_hashes))[0]

    async def lookup(
        self, model: str, block_hashes: Sequence[int]
    ) -> tuple[dict[str, tuple[int, int]], str | None]:
        """`tiered_overlaps` of a non-empty chain, and the registry marker read in the same call (None: missing,
        Redis was emptied and no registry read has set it again yet)."""
        raw, raw_hosts, raw_marker = await self._lookup(
            args=[self._prefix, model, "".join(map(_hex, block_hashes)), self._marker_key]
        )
        marker = (raw_marker.decode() if isinstance(raw_marker, bytes) else raw_marker) or None
        return _found(raw, raw_hosts), marker


def _found(raw: bytes | str, raw_hosts: bytes | str) -> dict[str, tuple[int, int]]:
    """The lookup script's answer as (leading blocks, of which only on host) per worker."""
    if not raw:
        return {}
    parts = (raw.decode() if isinstance(raw, bytes) else raw).split("\n")
    host: dict[str, int] = {}
    if raw_hosts:
        hosts = (raw_hosts.decode() if isinstance(raw_hosts, bytes) else raw_hosts).split("\n")
        host = dict(zip(hosts[::2], map(int, hosts[1::2]), strict=True))
    return {w: (int(n), host.get(w, 0)) for w, n in zip(parts[::2], parts[1::2], strict=True)}
