"""Batch and file state in Redis: records, status transitions, deduplicated result lines, locks.

A batch is one hash: the static fields as JSON under `doc`, plus status, timestamps, counts and
file ids as fields, so a status change or a count is one atomic command. Result lines are staged
in Redis lists until the batch is finalized into its output and error files; the set of items
that have a line makes redelivered results harmless.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

import msgspec
import redis.asyncio as aioredis

from schemas.batch import (
    Batch,
    BatchErrors,
    BatchRequestCounts,
    BatchUsage,
    FileObject,
    InputTokensDetails,
    ItemMeta,
    file_object_decoder,
    item_meta_decoder,
)
from schemas.names import RedisKeys

_msgpack = msgspec.msgpack.Encoder()
_json = msgspec.json.Encoder()
_batch_doc = msgspec.json.Decoder(Batch)
_errors = msgspec.json.Decoder(BatchErrors)

_TIMESTAMPS = (
    "in_progress_at",
    "finalizing_at",
    "completed_at",
    "failed_at",
    "expired_at",
    "cancelling_at",
    "cancelled_at",
)

# KEYS: batch hash, done set, lines list. ARGV: item index, line, counter, input, cached, output tokens.
# Returns -1 if the batch is closed, -2 if the item already has its line, else 1 when this line made
# the batch complete (every item accounted for) and 0 otherwise.
_RECORD = """
if redis.call('HEXISTS', KEYS[1], 'closed') == 1 then return -1 end
if redis.call('SADD', KEYS[2], ARGV[1]) == 0 then return -2 end
redis.call('RPUSH', KEYS[3], ARGV[2])
redis.call('HINCRBY', KEYS[1], ARGV[3], 1)
redis.call('HINCRBY', KEYS[1], 'input_tokens', ARGV[4])
redis.call('HINCRBY', KEYS[1], 'cached_tokens', ARGV[5])
redis.call('HINCRBY', KEYS[1], 'output_tokens', ARGV[6])
local c = tonumber(redis.call('HGET', KEYS[1], 'completed') or '0')
local f = tonumber(redis.call('HGET', KEYS[1], 'failed') or '0')
local t = tonumber(redis.call('HGET', KEYS[1], 'total') or '-1')
if c + f == t then return 1 end
return 0
"""

# KEYS: batch hash. ARGV: allowed current statuses (comma-separated), new status, then field/value
# pairs. Returns the previous status on success, or "!" .. status when the transition is refused.
_TRANSITION = """
local cur = redis.call('HGET', KEYS[1], 'status')
if not cur then return false end
for s in string.gmatch(ARGV[1], '[^,]+') do
  if s == cur then
    redis.call('HSET', KEYS[1], 'status', ARGV[2])
    for i = 3, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
    return cur
  end
end
return '!' .. cur
"""

_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def _int(raw: Any) -> int:
    return int(raw) if raw is not None else 0


def _str(raw: Any) -> str:
    """Redis replies are bytes (the client does not decode); ids and statuses are ASCII."""
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def _bytes(raw: Any) -> bytes:
    return raw if isinstance(raw, bytes) else str(raw).encode()


class BatchStore:
    """Every Redis operation of the batch API; one instance per process."""

    def __init__(self, redis: aioredis.Redis, keys: RedisKeys) -> None:
        self.redis = redis
        self.keys = keys
        self._record = redis.register_script(_RECORD)
        self._transition = redis.register_script(_TRANSITION)
        self._renew = redis.register_script(_RENEW)
        self._release = redis.register_script(_RELEASE)

    # ---- files -----------------------------------------------------------------------------------

    async def put_file(self, meta: FileObject) -> None:
        """Record a stored file's metadata."""
        async with self.redis.pipeline(transaction=True) as p:
            p.set(self.keys.file(meta.id), _msgpack.encode(meta))
            p.zadd(self.keys.files(), {meta.id: meta.created_at})
            await p.execute()

    async def get_file(self, file_id: str) -> FileObject | None:
        """A file's metadata, or None."""
        raw = await self.redis.get(self.keys.file(file_id))
        return file_object_decoder.decode(_bytes(raw)) if raw is not None else None

    async def delete_file(self, file_id: str) -> bool:
        """Forget a file; False if it was unknown."""
        async with self.redis.pipeline(transaction=True) as p:
            p.delete(self.keys.file(file_id))
            p.zrem(self.keys.files(), file_id)
            removed, _ = await p.execute()
        return bool(removed)

    async def list_files(
        self, after: str | None, limit: int, purpose: str | None = None
    ) -> tuple[list[FileObject], bool]:
        """Files newest first, after the id `after`; and whether there are more."""
        ids = await self._page(self.keys.files(), after, limit if purpose is None else 10_000)
        metas = [m for m in await self._many_files(ids) if purpose is None or m.purpose == purpose]
        return metas[:limit], len(metas) > limit

    async def _many_files(self, ids: list[str]) -> list[FileObject]:
        if not ids:
            return []
        raws = await self.redis.mget([self.keys.file(i) for i in ids])
        return [file_object_decoder.decode(_bytes(r)) for r in raws if r is not None]

    async def _page(self, zkey: str, after: str | None, limit: int) -> list[str]:
        start = 0
        if after is not None:
            rank = await self.redis.zrevrank(zkey, after)
            if rank is None:
                return []
            start = int(rank) + 1  # type: ignore[arg-type]
        raw = await self.redis.zrevrange(zkey, start, start + limit)
        return [_str(r) for r in raw]

    # ---- batches ---------------------------------------------------------------------------------

    async def create_batch(self, batch: Batch) -> None:
        """Record a new batch (status `validating`) and make it visible to listing and sweeping."""
        async with self.redis.pipeline(transaction=True) as p:
            p.hset(
                self.keys.batch(batch.id),
                mapping={"doc": _json.encode(batch), "status": batch.status, "expires_at": batch.expires_at},
            )
            p.zadd(self.keys.batches(), {batch.id: batch.created_at + _tiebreak()})
            p.sadd(self.keys.batches_active(), batch.id)
            await p.execute()

    async def get_batch(self, batch_id: str) -> Batch | None:
        """The batch as the API shows it, or None."""
        raw = await self.redis.hgetall(self.keys.batch(batch_id))
        return _to_batch(raw) if raw else None

    async def list_batches(self, after: str | None, limit: int) -> tuple[list[Batch], bool]:
        """Batches newest first, after the id `after`; and whether there are more."""
        ids = await self._page(self.keys.batches(), after, limit)
        async with self.redis.pipeline(transaction=False) as p:
            for i in ids:
                p.hgetall(self.keys.batch(i))
            raws = await p.execute()
        batches = [_to_batch(r) for r in raws if r]
        return batches[:limit], len(batches) > limit

    async def active_batches(self) -> list[str]:
        """Ids of batches not yet final."""
        return sorted(_str(m) for m in await self.redis.smembers(self.keys.batches_active()))

    async def fields(self, batch_id: str, *names: str) -> list[str | None]:
        """Values of some fields of a batch hash (None where unset)."""
        raws = await self.redis.hmget(self.keys.batch(batch_id), list(names))
        return [None if r is None else _str(r) for r in raws]

    async def set_fields(self, batch_id: str, values: Mapping[str, str | int]) -> None:
        """Set fields of a batch hash that no transition races with (e.g. `total`, `submitted`)."""
        await self.redis.hset(self.keys.batch(batch_id), mapping=dict(values))  # type: ignore[arg-type]

    async def transition(
        self,
        batch_id: str,
        allowed: Iterable[str],
        status: str,
        values: Mapping[str, str | int] | None = None,
    ) -> tuple[bool, str | None]:
        """Move a batch to `status` if its status is one of `allowed`; (moved, status before)."""
        args: list[str | int] = [",".join(allowed), status]
        for k, v in (values or {}).items():
            args += [k, v]
        res = await self._transition(keys=[self.keys.batch(batch_id)], args=args)
        if res is None:
            return False, None
        text = _str(res)
        if text.startswith("!"):
            return False, text[1:]
        return True, text

    async def stop(self, batch_id: str) -> None:
        """Tell workers to skip and abort the items of a cancelled or expired batch."""
        await self.redis.zadd(self.keys.batches_stopped(), {batch_id: time.time()})

    async def stopped_since(self, since: float) -> set[str]:
        """Ids of batches stopped after `since` (workers poll this)."""
        raw = await self.redis.zrangebyscore(self.keys.batches_stopped(), since, "+inf")
        return {_str(r) for r in raw}

    async def close(self, batch_id: str) -> None:
        """Take a finished batch out of the sweep and drop its staging data."""
        async with self.redis.pipeline(transaction=True) as p:
            p.srem(self.keys.batches_active(), batch_id)
            p.delete(
                self.keys.batch_lines(batch_id, "out"),
                self.keys.batch_lines(batch_id, "err"),
                self.keys.batch_items(batch_id),
                self.keys.batch_done(batch_id),
            )
            await p.execute()

    # ---- items and their result lines ------------------------------------------------------------

    async def put_items(self, batch_id: str, metas: Mapping[int, ItemMeta]) -> None:
        """Store what the coordinator needs to build each item's output line."""
        key = self.keys.batch_items(batch_id)
        items = list(metas.items())
        for start in range(0, len(items), 1000):
            await self.redis.hset(
                key, mapping={str(i): _msgpack.encode(m) for i, m in items[start : start + 1000]}
            )

    async def item_metas(self, batch_id: str, indexes: list[int]) -> list[ItemMeta | None]:
        """Stored metadata of some items of a batch."""
        raws = await self.redis.hmget(self.keys.batch_items(batch_id), [str(i) for i in indexes])
        return [item_meta_decoder.decode(_bytes(r)) if r is not None else None for r in raws]

    async def done_items(self, batch_id: str) -> set[int]:
        """Indexes of the items that already have their line."""
        return {int(m) for m in await self.redis.smembers(self.keys.batch_done(batch_id))}

    async def record(
        self,
        batch_id: str,
        index: int,
        line: bytes,
        ok: bool,
        input_tokens: int = 0,
        cached_tokens: int = 0,
        output_tokens: int = 0,
    ) -> int:
        """Stage one item's line unless it has one already: -1 closed, -2 duplicate, 1 batch complete, else 0."""
        kind = "out" if ok else "err"
        res = await self._record(
            keys=[
                self.keys.batch(batch_id),
                self.keys.batch_done(batch_id),
                self.keys.batch_lines(batch_id, kind),
            ],
            args=[index, line, "completed" if ok else "failed", input_tokens, cached_tokens, output_tokens],
        )
        return int(res)

    async def lines(self, batch_id: str, kind: str) -> list[bytes]:
        """Every staged line of one kind (`out` or `err`)."""
        return [_bytes(r) for r in await self.redis.lrange(self.keys.batch_lines(batch_id, kind), 0, -1)]

    # ---- Kafka-native items ----------------------------------------------------------------------

    async def put_item(self, item_id: str, meta: ItemMeta, ttl_s: int) -> None:
        """Store a Kafka-native item's metadata."""
        await self.redis.set(self.keys.batch_item(item_id), _msgpack.encode(meta), ex=ttl_s)

    async def get_items(self, item_ids: list[str]) -> list[ItemMeta | None]:
        """Metadata of some Kafka-native items."""
        raws = await self.redis.mget([self.keys.batch_item(i) for i in item_ids]) if item_ids else []
        return [item_meta_decoder.decode(_bytes(r)) if r is not None else None for r in raws]

    async def claim_item(self, item_id: str, ttl_s: int) -> bool:
        """True once per Kafka-native item: the caller sends its result."""
        return bool(await self.redis.set(self.keys.batch_item_done(item_id), 1, nx=True, ex=ttl_s))

    async def unclaim_item(self, item_id: str) -> None:
        """Give a claim back when the result could not be sent."""
        await self.redis.delete(self.keys.batch_item_done(item_id))

    # ---- items that kill engines -----------------------------------------------------------------

    async def note_engine_deaths(self, item_ids: Iterable[str], ttl_s: int) -> None:
        """An engine died with these items in it, none of which had produced anything: one more death each."""
        pipe = self.redis.pipeline(transaction=False)
        for item_id in item_ids:
            key = self.keys.batch_item_deaths(item_id)
            pipe.incr(key)
            pipe.expire(key, ttl_s)
        await pipe.execute()

    async def engine_deaths(self, item_ids: list[str]) -> list[int]:
        """How many engine deaths each item met so far (`note_engine_deaths`)."""
        raws = await self.redis.mget([self.keys.batch_item_deaths(i) for i in item_ids]) if item_ids else []
        return [_int(r) for r in raws]

    # ---- ownership -------------------------------------------------------------------------------

    async def lock(self, batch_id: str, owner: str, ttl_s: float) -> bool:
        """Take the batch's lock (submission, finalization) unless a live frontend holds it."""
        key = self.keys.batch_lock(batch_id)
        if await self.redis.set(key, owner, nx=True, px=int(ttl_s * 1000)):
            return True
        return await self.renew(batch_id, owner, ttl_s)

    async def renew(self, batch_id: str, owner: str, ttl_s: float) -> bool:
        """Extend a lock this owner holds."""
        return bool(await self._renew(keys=[self.keys.batch_lock(batch_id)], args=[owner, int(ttl_s * 1000)]))

    async def unlock(self, batch_id: str, owner: str) -> None:
        """Release a lock this owner holds."""
        await self._release(keys=[self.keys.batch_lock(batch_id)], args=[owner])


def _tiebreak() -> float:
    # Batches created in the same second keep their creation order in the listing.
    return (time.time() % 1.0) * 0.999


def _to_batch(raw: Mapping[Any, Any]) -> Batch:
    f = {_str(k): _bytes(v) for k, v in raw.items()}
    b = _batch_doc.decode(f["doc"])
    b.status = f["status"].decode()  # type: ignore[assignment]
    for name in _TIMESTAMPS:
        if name in f:
            setattr(b, name, int(f[name]))
    if "errors" in f:
        b.errors = _errors.decode(f["errors"])
    if "output_file_id" in f:
        b.output_file_id = f["output_file_id"].decode()
    if "error_file_id" in f:
        b.error_file_id = f["error_file_id"].decode()
    b.request_counts = BatchRequestCounts(
        total=_int(f.get("total")), completed=_int(f.get("completed")), failed=_int(f.get("failed"))
    )
    inp, out = _int(f.get("input_tokens")), _int(f.get("output_tokens"))
    b.usage = BatchUsage(
        input_tokens=inp,
        output_tokens=out,
        total_tokens=inp + out,
        input_tokens_details=InputTokensDetails(cached_tokens=_int(f.get("cached_tokens"))),
    )
    return b
