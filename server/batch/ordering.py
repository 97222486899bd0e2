"""Which pool partition each item goes to, and in what order: the cache-friendly plan.

Prefix order sorts a batch's items by the chained hashes of their prompt blocks, so items sharing
a prefix become neighbours (longer shared prefixes, closer neighbours), then cuts the sorted list
into one contiguous run per partition. A partition is read by one worker at a time and the range
assignor gives each worker adjacent partitions, so the items of one prefix run close together on
the same worker, which prefills the prefix once and serves the rest from its cache.

Submission order keeps the file's order and deals items round robin over the partitions, which is
what a queue without this plan does; the benchmark compares the two.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from kvstore.hashing import block_hashes, chain_seed

# Blocks of the prompt that decide the order; beyond this, items differ anyway.
MAX_KEY_BLOCKS = 256


def prefix_key(prompt: Sequence[int], model: str, block_size: int) -> tuple[int, ...]:
    """Sort key of one prompt: the hashes of its full blocks."""
    hashes = block_hashes(prompt[: MAX_KEY_BLOCKS * block_size], block_size, chain_seed(model))
    return tuple(hashes)


def plan(
    prompts: Sequence[tuple[int, Sequence[int]]],
    partitions: int,
    model: str,
    block_size: int,
    order: Literal["prefix", "submission"],
) -> list[tuple[int, int]]:
    """(item index, partition) for every item, in the order to produce them."""
    if partitions <= 0:
        raise ValueError("partitions must be positive")
    if order == "submission":
        return [(index, i % partitions) for i, (index, _p) in enumerate(prompts)]
    keyed = sorted(prompts, key=lambda ip: (prefix_key(ip[1], model, block_size), ip[0]))
    n = len(keyed)
    # Run r covers positions [r*n/P, (r+1)*n/P): equal runs, each on one partition.
    return [(index, i * partitions // n) for i, (index, _p) in enumerate(keyed)]


def partition_for(
    prompt: Sequence[int], partitions: int, model: str, block_size: int, blocks: int = 4
) -> int:
    """Partition of a lone item (Kafka-native path): items sharing their first blocks share a partition."""
    hashes = block_hashes(prompt[: blocks * block_size], block_size, chain_seed(model))
    if not hashes:
        return hash(tuple(prompt)) % partitions
    return hashes[-1] % partitions
