"""Router load shared by frontend replicas: each publishes what it has in flight per worker.

A frontend's own counts are exact and current; the others' arrive with every registry refresh. Keys
expire with their frontend, so a frontend that dies takes its load with it instead of leaving
counters that never come down.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis

from schemas.names import RedisKeys

# One round trip: replace this frontend's entry, then sum every other live frontend's entries.
_EXCHANGE = """
local me, ttl = ARGV[1], tonumber(ARGV[2])
local mykey = KEYS[2] .. me
redis.call('DEL', mykey)
if #ARGV > 2 then
  local fields = {}
  for i = 3, #ARGV do table.insert(fields, ARGV[i]) end
  redis.call('HSET', mykey, unpack(fields))
  redis.call('PEXPIRE', mykey, ttl)
end
redis.call('SADD', KEYS[1], me)
local out = {}
for _, fe in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  if fe ~= me then
    local entries = redis.call('HGETALL', KEYS[2] .. fe)
    if #entries == 0 and redis.call('EXISTS', KEYS[2] .. fe) == 0 then
      redis.call('SREM', KEYS[1], fe)
    end
    for i = 1, #entries do table.insert(out, entries[i]) end
  end
end
return out
"""


@dataclass
class WorkerLoad:
    """What routers have sent a worker and not seen finish."""

    prefill_tokens: int = 0
    decode_blocks: int = 0
    sequences: int = 0
    # Blocks the worker's decode steps read: every decoding sequence's prompt blocks, a prefix that several
    # share once per sequence (decode_blocks counts it once, as the engine stores it).
    read_blocks: int = 0

    def add(self, other: WorkerLoad) -> None:
        """Accumulate `other` into this load."""
        self.prefill_tokens += other.prefill_tokens
        self.decode_blocks += other.decode_blocks
        self.sequences += other.sequences
        self.read_blocks += other.read_blocks


class LoadBoard:
    """Publish this frontend's load and read everyone else's."""

    def __init__(self, client: aioredis.Redis, keys: RedisKeys) -> None:
        self._keys = keys
        self._exchange = client.register_script(_EXCHANGE)

    async def exchange(self, frontend_id: str, mine: dict[str, WorkerLoad], ttl_s: float) -> dict[str, WorkerLoad]:
        """Store `mine` for `ttl_s`; return the summed load of all other frontends per worker."""
        args: list[str | int] = [frontend_id, int(ttl_s * 1000)]
        for wid, load in mine.items():
            if load.sequences:
                fields = (load.prefill_tokens, load.decode_blocks, load.sequences, load.read_blocks)
                args += (wid, ":".join(map(str, fields)))
        flat = await self._exchange(keys=[self._keys.frontends(), self._keys.load("")], args=args)
        out: dict[str, WorkerLoad] = {}
        it = iter(flat)
        for wid_raw, value in zip(it, it, strict=True):
            wid = wid_raw.decode() if isinstance(wid_raw, bytes) else wid_raw
            text = value.decode() if isinstance(value, bytes) else value
            p, d, n, *read = (int(x) for x in text.split(":"))
            # A frontend from before read_blocks sends three fields: no rereads known, read = decode.
            out.setdefault(wid, WorkerLoad()).add(WorkerLoad(p, d, n, read[0] if read else d))
        return out
