"""Chained block hashes: the contract between router and engines."""

from __future__ import annotations

import xxhash

from kvstore.hashing import block_hashes, chain_seed, hash_block


def test_chain_matches_the_definition() -> None:
    seed = chain_seed("m")
    tokens = list(range(10))
    hs = block_hashes(tokens, 4, seed)
    assert len(hs) == 2  # full blocks only
    h0 = xxhash.xxh3_64_intdigest(seed.to_bytes(8, "little") + b"".join(t.to_bytes(4, "little") for t in range(4)))
    assert hs[0] == h0 == hash_block(seed, [0, 1, 2, 3])
    assert hs[1] == hash_block(h0, [4, 5, 6, 7])


def test_prefix_sharing_and_salts() -> None:
    a = block_hashes([1] * 8 + [2] * 4, 4, chain_seed("m"))
    b = block_hashes([1] * 8 + [3] * 4, 4, chain_seed("m"))
    assert a[:2] == b[:2] and a[2] != b[2]
    assert block_hashes([1] * 8, 4, chain_seed("m", "lora-a")) != block_hashes([1] * 8, 4, chain_seed("m"))
    assert block_hashes([1] * 8, 4, chain_seed("other")) != block_hashes([1] * 8, 4, chain_seed("m"))


def test_continuing_from_a_parent() -> None:
    seed = chain_seed("m")
    whole = block_hashes(list(range(16)), 4, seed)
    tail = block_hashes(list(range(8, 16)), 4, seed, parent=whole[1])
    assert tail == whole[2:]
