"""Prefix caching, reference counting, LRU eviction and KV events of the block pool."""

from __future__ import annotations

from kvstore.hashing import block_hashes, chain_seed
from schemas.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from workers.block_pool import BlockPool, SequenceBlocks

BS = 4
SEED = chain_seed("test-model")


def seq() -> SequenceBlocks:
    return SequenceBlocks(seed=SEED)


def stored(events: list[KVEvent]) -> list[int]:
    return [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]


def removed(events: list[KVEvent]) -> list[int]:
    return [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]


def fill(pool: BlockPool, tokens: list[int]) -> SequenceBlocks:
    s = seq()
    assert pool.allocate(s, tokens, len(tokens))
    return s


def test_stored_events_carry_ferry_chained_hashes() -> None:
    pool = BlockPool(num_blocks=8, block_size=BS)
    tokens = list(range(100, 111))  # 2 full blocks and a partial one
    s = fill(pool, tokens)
    events = pool.take_events()
    assert events == [BlockStored(block_hashes=block_hashes(tokens, BS, SEED), parent_hash=None)]
    assert len(s.block_ids) == 3
    assert pool.take_events() == []


def test_generated_tokens_store_blocks_as_they_fill() -> None:
    pool = BlockPool(num_blocks=8, block_size=BS)
    tokens = list(range(10, 16))  # 1 full block + 2 tokens
    s = fill(pool, tokens)
    first = pool.take_events()
    for t in (16, 17, 18):  # decode: the block fills at the 8th token
        tokens.append(t)
        assert pool.allocate(s, tokens, len(tokens))
    events = pool.take_events()
    expected = block_hashes(tokens, BS, SEED)
    assert stored(first) == expected[:1]
    assert events == [BlockStored(block_hashes=[expected[1]], parent_hash=expected[0])]


def test_lora_salts_the_chain() -> None:
    pool = BlockPool(num_blocks=8, block_size=BS)
    tokens = list(range(8))
    lora_seed = chain_seed("test-model", "adapter")
    s = SequenceBlocks(seed=lora_seed, lora_name="adapter")
    assert pool.allocate(s, tokens, len(tokens))
    (event,) = pool.take_events()
    assert isinstance(event, BlockStored)
    assert event.lora_name == "adapter"
    assert event.block_hashes == block_hashes(tokens, BS, lora_seed)
    assert pool.longest_prefix(block_hashes(tokens, BS, SEED)) == 0


def test_prefix_hit_shares_blocks_and_counts_references() -> None:
    pool = BlockPool(num_blocks=8, block_size=BS)
    prompt = list(range(12))
    a = fill(pool, prompt)
    assert pool.num_used_blocks == 3
    b = seq()
    # A fully cached prompt still recomputes its last block (its last token needs logits).
    hits = pool.match_prefix(b, prompt)
    assert hits == 2
    assert pool.match_prefix(seq(), [*prompt, 99]) == 3
    assert pool.allocate(b, prompt, len(prompt), num_hit_blocks=hits)
    assert b.block_ids[:2] == a.block_ids[:2]
    assert b.block_ids[2] != a.block_ids[2]
    assert pool.num_used_blocks == 4
    pool.free(a)
    # Shared blocks stay referenced by b; a's own last block is unreferenced but cached.
    assert pool.num_used_blocks == 3
    assert pool.longest_prefix(block_hashes(prompt, BS, SEED)) == 3
    pool.free(b)
    assert pool.num_used_blocks == 0
    assert pool.usage() == 0.0
    assert pool.num_cached_blocks == 3


def test_lru_eviction_order_and_removed_events() -> None:
    pool = BlockPool(num_blocks=4, block_size=BS)
    a_tokens, b_tokens = list(range(8)), list(range(50, 58))
    a, b = fill(pool, a_tokens), fill(pool, b_tokens)
    pool.free(a)
    pool.free(b)
    pool.take_events()
    ha, hb = block_hashes(a_tokens, BS, SEED), block_hashes(b_tokens, BS, SEED)
    # Reuse a's prefix: its first block becomes most recently used.
    c = seq()
    assert pool.allocate(c, [*a_tokens[:4], 7, 7, 7, 7], 8, num_hit_blocks=1)
    # c needed one new block: the least recently used is a's tail (freed first, tail first).
    assert removed(pool.take_events()) == [ha[1]]
    pool.free(c)
    pool.take_events()
    d = fill(pool, list(range(200, 216)))
    events = pool.take_events()
    # Next evictions: b (tail first), then c's blocks and a's head, which were freed later.
    evicted = removed(events)
    assert evicted[:2] == [hb[1], hb[0]]
    assert set(evicted) == {hb[0], hb[1], ha[0], block_hashes([*a_tokens[:4], 7, 7, 7, 7], BS, SEED)[1]}
    # Removals precede the stores of the blocks that replaced them.
    assert isinstance(events[0], BlockRemoved)
    assert isinstance(events[-1], BlockStored)
    assert len(d.block_ids) == 4


def test_never_hashed_blocks_are_used_before_evicting() -> None:
    pool = BlockPool(num_blocks=4, block_size=BS)
    a = fill(pool, list(range(6)))  # one cached block, one partial
    pool.free(a)
    pool.take_events()
    b = fill(pool, [9, 9, 9])  # takes a never-used block
    c = fill(pool, [8, 8, 8])
    d = fill(pool, [7, 7, 7])  # a's partial block: free and not cached, so no eviction
    assert removed(pool.take_events()) == []
    assert pool.num_cached_blocks == 1
    assert pool.num_free_blocks == 1
    assert len({*b.block_ids, *c.block_ids, *d.block_ids}) == 3


def test_allocation_fails_without_side_effects_when_short() -> None:
    pool = BlockPool(num_blocks=3, block_size=BS)
    a = fill(pool, list(range(8)))
    b = seq()
    assert not pool.allocate(b, list(range(30, 38)), 8)
    assert b.block_ids == []
    assert pool.num_used_blocks == 2
    pool.free(a)
    pool.take_events()
    # Reclaiming unreferenced cached blocks as hits consumes free capacity too: 2 hits + 2 new > 3.
    long_prompt = [*range(8), 1, 2, 3, 4, 5]
    c = seq()
    hits = pool.match_prefix(c, long_prompt)
    assert hits == 2
    assert not pool.allocate(c, long_prompt, len(long_prompt), num_hit_blocks=hits)
    assert c.block_ids == [] and pool.num_used_blocks == 0
    assert pool.allocate(c, long_prompt, 12, num_hit_blocks=hits)
    assert pool.num_used_blocks == 3
    assert pool.take_events() == [
        BlockStored(
            block_hashes=block_hashes(long_prompt, BS, SEED)[2:],
            parent_hash=block_hashes(long_prompt, BS, SEED)[1],
        )
    ]


def test_eviction_takes_a_freed_sequence_tail_first() -> None:
    pool = BlockPool(num_blocks=3, block_size=BS)
    a = fill(pool, list(range(8)))
    pool.free(a)
    fill(pool, [5] * 8)  # one never-used block, then one eviction
    hashes = block_hashes(list(range(8)), BS, SEED)
    assert removed(pool.take_events()) == [hashes[1]]
    assert pool.match_prefix(seq(), [*range(8), 1]) == 1


def test_duplicate_block_is_stored_and_removed_once() -> None:
    pool = BlockPool(num_blocks=4, block_size=BS)
    tokens = list(range(4))
    a, b = seq(), seq()
    # Two sequences compute the same block in one step (neither found it cached beforehand).
    assert pool.allocate(a, tokens, 4)
    assert pool.allocate(b, tokens, 4)
    assert stored(pool.take_events()) == block_hashes(tokens, BS, SEED)
    pool.free(a)
    pool.free(b)
    fill(pool, list(range(100, 116)))
    assert removed(pool.take_events()) == block_hashes(tokens, BS, SEED)


def test_reset_requires_idle_pool_and_clears_cache() -> None:
    pool = BlockPool(num_blocks=4, block_size=BS)
    a = fill(pool, list(range(8)))
    assert not pool.reset()
    pool.free(a)
    pool.take_events()
    assert pool.reset()
    assert pool.take_events() == [AllBlocksCleared()]
    assert pool.num_cached_blocks == 0
    assert pool.match_prefix(seq(), list(range(9))) == 0
