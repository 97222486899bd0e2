"""The simulated host-memory KV tier: eviction to host, load back, KV events with medium, link timing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstore.hashing import block_hashes, chain_seed
from schemas.kv_events import MEDIUM_HOST, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from workers.block_pool import BlockPool, SequenceBlocks
from workers.host_tier import HostTier, kv_bytes_per_token

BS = 4
SEED = chain_seed("test-model")


def tiered(num_blocks: int = 4, host_blocks: int = 8, h2d: float = 0.0, d2h: float = 0.0) -> BlockPool:
    # 1000 bytes per block keeps the link arithmetic readable.
    return BlockPool(num_blocks, BS, HostTier(host_blocks, 1000, h2d, d2h))


def run(pool: BlockPool, tokens: list[int]) -> int:
    """Admit `tokens` as the engine does, free them again; the blocks found cached."""
    s = SequenceBlocks(seed=SEED)
    hit = pool.match_prefix(s, tokens)
    assert pool.allocate(s, tokens, len(tokens), num_hit_blocks=hit)
    pool.free(s)
    return hit


def by_medium(events: list[KVEvent], kind: type[BlockStored | BlockRemoved], medium: str | None) -> list[int]:
    return [
        h for e in events if isinstance(e, kind) and not isinstance(e, AllBlocksCleared) and e.medium == medium
        for h in e.block_hashes
    ]  # fmt: skip


A = list(range(100, 113))  # 3 full blocks and 1 token
B = list(range(200, 213))


def test_evicted_device_blocks_go_to_host_with_events() -> None:
    pool = tiered()
    run(pool, A)
    pool.take_events()
    run(pool, B)  # needs 4 blocks: the pool has 4, so A's 3 cached ones are evicted
    events = pool.take_events()
    ha = block_hashes(A, BS, SEED)
    assert sorted(by_medium(events, BlockRemoved, None)) == sorted(ha)
    assert sorted(by_medium(events, BlockStored, MEDIUM_HOST)) == sorted(ha)
    assert by_medium(events, BlockStored, None) == block_hashes(B, BS, SEED)


def test_prefix_on_host_is_loaded_back_not_recomputed() -> None:
    pool = tiered()
    run(pool, A)
    run(pool, B)
    pool.take_events()
    assert run(pool, A) == 3  # all 3 full blocks, from the host
    assert pool.host is not None and pool.host.loaded_blocks == 3
    events = pool.take_events()
    # Loaded blocks are device blocks again (their host copies stay); B's go to the host in turn.
    assert sorted(by_medium(events, BlockStored, None)) == sorted(block_hashes(A, BS, SEED))
    assert sorted(by_medium(events, BlockStored, MEDIUM_HOST)) == sorted(block_hashes(B, BS, SEED))
    assert by_medium(events, BlockRemoved, MEDIUM_HOST) == []


def test_without_host_tier_the_prefix_is_recomputed() -> None:
    pool = BlockPool(4, BS)
    run(pool, A)
    run(pool, B)
    assert run(pool, A) == 0


def test_full_host_tier_drops_its_oldest_blocks() -> None:
    pool = tiered(host_blocks=3)
    run(pool, A)
    run(pool, B)  # A's 3 blocks fill the host
    pool.take_events()
    run(pool, list(range(300, 313)))  # B's 3 blocks push A's out
    events = pool.take_events()
    assert sorted(by_medium(events, BlockRemoved, MEDIUM_HOST)) == sorted(block_hashes(A, BS, SEED))
    assert run(pool, A) == 0


def test_transfers_cost_bytes_over_bandwidth() -> None:
    # 1000 bytes per block: 3 blocks at 1e-6 GB/s (1000 B/s) take 3 s each way.
    pool = tiered(h2d=1e-6, d2h=2e-6)
    run(pool, A)
    assert pool.take_transfer_seconds() == 0.0
    run(pool, B)  # offloads A's 3 blocks
    assert pool.take_transfer_seconds() == pytest.approx(1.5)
    run(pool, A)  # loads 3, offloads B's 3
    assert pool.take_transfer_seconds() == pytest.approx(3.0 + 1.5)
    assert pool.take_transfer_seconds() == 0.0


def test_snapshot_and_reset_cover_both_tiers() -> None:
    pool = tiered()
    run(pool, A)
    run(pool, B)
    events = pool.snapshot().events
    assert events[0] == AllBlocksCleared()
    assert sorted(by_medium(events, BlockStored, MEDIUM_HOST)) == sorted(block_hashes(A, BS, SEED))
    assert pool.reset()
    assert pool.host is not None and len(pool.host) == 0
    assert run(pool, A) == 0


def test_kv_bytes_per_token_from_config(tmp_path: Path) -> None:
    cfg = {
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "hidden_size": 576,
        "torch_dtype": "bfloat16",
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    # SmolLM2-135M: 30 layers x 3 kv heads x 64 head dim x 2 (K and V) x 2 bytes.
    assert kv_bytes_per_token(tmp_path) == 30 * 3 * 64 * 2 * 2
