"""The KV block index against a real Redis."""

from __future__ import annotations

import random
import time

import pytest
import redis.asyncio as aioredis

from bench.routing.virtual import MemoryIndex
from kvstore.hashing import block_hashes, chain_seed
from kvstore.kv_index import KVIndex
from schemas.kv_events import MEDIUM_HOST, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from schemas.names import RedisKeys

pytestmark = pytest.mark.integration

SEED = chain_seed("m")


def _batch(*events: object) -> KVEventBatch:
    return KVEventBatch(time.time(), list(events))  # type: ignore[arg-type]


async def test_leading_overlap_per_worker(redis_url: str, prefix: str) -> None:
    idx = KVIndex(aioredis.from_url(redis_url), RedisKeys(prefix))
    chain = block_hashes(list(range(640)), 64, SEED)  # 10 blocks
    await idx.apply("a", "m", _batch(BlockStored(chain[:6])))
    await idx.apply("b", "m", _batch(BlockStored(chain[:2]), BlockStored(chain[3:10])))  # gap at block 2
    await idx.apply("c", "m", _batch(BlockStored(chain[5:])))  # no first block: no overlap
    assert await idx.overlaps("m", chain) == {"a": 6, "b": 2}
    assert await idx.overlaps("other-model", chain) == {}
    assert await idx.overlaps("m", []) == {}
    await idx.apply("a", "m", _batch(BlockRemoved([chain[3]])))
    assert await idx.overlaps("m", chain) == {"a": 3, "b": 2}


async def test_cleared_and_swept_workers_vanish(redis_url: str, prefix: str) -> None:
    client = aioredis.from_url(redis_url)
    keys = RedisKeys(prefix)
    idx = KVIndex(client, keys)
    chain = block_hashes(list(range(256)), 64, SEED)
    await idx.apply("a", "m", _batch(BlockStored(chain)))
    await idx.apply("b", "m", _batch(BlockStored(chain)))
    await idx.apply("a", "m", _batch(AllBlocksCleared(), BlockStored(chain[:1])))  # cleared, then refilled
    assert await idx.overlaps("m", chain) == {"a": 1, "b": 4}
    await idx.clear_worker("b")
    assert await idx.overlaps("m", chain) == {"a": 1}
    assert await client.exists(keys.worker_blocks("b")) == 0
    await idx.clear_worker("a")
    assert await client.keys(f"{prefix}kv*") == []


async def test_host_tier_blocks_are_held_and_counted_apart(redis_url: str, prefix: str) -> None:
    client = aioredis.from_url(redis_url)
    idx = KVIndex(client, RedisKeys(prefix))
    chain = block_hashes(list(range(64 * 6)), 64, SEED)
    # a: 4 blocks on device; its last 2 evicted to the host, and 2 more stored only on the host.
    await idx.apply("a", "m", _batch(BlockStored(chain[:4])))
    await idx.apply("a", "m", _batch(BlockRemoved(chain[2:4]), BlockStored(chain[2:6], medium=MEDIUM_HOST)))
    await idx.apply("b", "m", _batch(BlockStored(chain[:3])))
    assert await idx.tiered_overlaps("m", chain) == {"a": (6, 4), "b": (3, 0)}
    assert await idx.overlaps("m", chain) == {"a": 6, "b": 3}
    # Loaded back to the device: device again, with the host copy kept.
    await idx.apply("a", "m", _batch(BlockStored(chain[2:3])))
    assert (await idx.tiered_overlaps("m", chain))["a"] == (6, 3)
    # The host tier drops a copy the device also holds: still held; one only there: gone.
    await idx.apply("a", "m", _batch(BlockRemoved(chain[2:4], medium=MEDIUM_HOST)))
    assert (await idx.tiered_overlaps("m", chain))["a"] == (3, 0)
    await idx.apply("a", "m", _batch(BlockRemoved(chain[2:3])))
    assert (await idx.tiered_overlaps("m", chain))["a"] == (2, 0)
    await idx.clear_worker("a")
    await idx.clear_worker("b")
    assert await client.keys(f"{prefix}kv*") == []


async def test_full_64_bit_hashes_survive_lua(redis_url: str, prefix: str) -> None:
    idx = KVIndex(aioredis.from_url(redis_url), RedisKeys(prefix))
    big = [2**64 - 1, 2**63 + 1]
    await idx.apply("a", "m", _batch(BlockStored(big)))
    assert await idx.overlaps("m", big) == {"a": 2}
    assert await idx.overlaps("m", [2**64 - 2]) == {}


async def test_the_virtual_benchmarks_index_answers_like_this_one(redis_url: str, prefix: str) -> None:
    """bench/routing/virtual.py routes from an in-memory copy of the index: the same events, the same answers."""
    rng = random.Random(7)
    redis_index = KVIndex(aioredis.from_url(redis_url), RedisKeys(prefix))
    memory_index = MemoryIndex()
    chains = [block_hashes([p * 1000 + t for t in range(64 * 12)], 64, SEED) for p in range(4)]
    # Conversations that extend each other: chain 1 shares its first 5 blocks with chain 0.
    chains[1] = chains[0][:5] + block_hashes(list(range(64 * 7)), 64, SEED, parent=chains[0][4])
    for _ in range(60):
        worker, chain = rng.choice("abc"), rng.choice(chains)
        lo = rng.randrange(len(chain))
        hi = rng.randrange(lo, len(chain)) + 1
        kind = rng.random()
        if kind < 0.6:
            event: object = BlockStored(chain[lo:hi])
        elif kind < 0.95:
            event = BlockRemoved(chain[lo:hi])
        else:
            event = AllBlocksCleared()
        model = rng.choice(["m", "m", "n"])
        await redis_index.apply(worker, model, _batch(event))
        memory_index.apply(worker, model, _batch(event))
        for probe in chains:
            for m in ("m", "n"):
                assert await memory_index.overlaps(m, probe) == await redis_index.overlaps(m, probe)
